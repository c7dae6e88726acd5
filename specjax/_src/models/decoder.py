"""One Flax decoder family for the Llama, Mistral, Qwen2, Qwen3, GPT-2 and Gemma layouts.

The layout follows from :class:`~specjax._src.models.config.ModelConfig`:

=========  ==========================================================
llama      RMSNorm, RoPE (optionally Llama 3 scaled), gated SiLU MLP
mistral    llama + ``sliding_window`` attention
qwen2      llama + q/k/v biases
qwen3      llama + per-head RMSNorm on q and k, explicit ``head_dim``
gpt2       LayerNorm, learned positions, fused q/k/v, gelu MLP, all biases
gemma      embeddings x sqrt(H), (1 + weight) RMSNorms, GeGLU MLP, tied head
gemma2     gemma + post-attention/MLP norms, ``query_pre_attn_scalar``,
           attention and logit soft-capping, sliding/full ``layer_types``
gemma3*    gemma2's norms and scaling + q/k norms, no soft-capping,
           sliding layers with their own RoPE base (``rope_local_theta``)
=========  ==========================================================

(``gemma3*``: ``model_type`` ``"gemma3_text"``.) The mixtures of experts
(Mixtral, Qwen2-MoE, Qwen3-MoE, dots1, gpt-oss) are these blocks with :class:`~specjax._src.models.moe.MoE`
for the MLP (gpt-oss's attention adds per-head sinks and YaRN's cos/sin factor); DeepSeek-V3 (``deepseek_v3``) also swaps the attention for
:class:`~specjax._src.models.latent_attention.LatentAttention`. A sliding layer's mask
(``attention_mask``) hides keys ``sliding_window`` or more positions back.

All of them support GQA (``num_kv_heads < num_heads``), tied or untied
embeddings, and float32 or bfloat16 params and compute (``config.dtype``).
Logits are always float32 (the head accumulates in float32). Accuracy against
the Hugging Face PyTorch models (``tests/test_models.py``, relative error
``max|a - b| / max|b|`` of the logits): float32 within 1e-4 (about 1e-6 in
practice); bfloat16 params and compute within 5e-2 of the float32 reference
(bf16 keeps 8 mantissa bits; 1-3% was measured on the tiny test models).

Params layout: one subtree per block (``layer_0``, ``layer_1``, ...), and one
KV buffer per block, never a stacked ``[L, ...]`` array with a scan over
layers. On XLA's CPU backend, a 27.8M-param Llama-shaped model with stacked
weights indexed per layer took 43 ms per decoded token against 7.4 ms with
per-layer buffers (issue 2's measurement). ``benchmarks/model_layout.py``
re-measured it on a quiet 2-core CPU (batch 1, 27.7M params, greedy decode
inside one jitted loop; BENCHMARKS.md section 7): per-layer buffers 7.3 ms per
token wall (11.7 ms CPU), the same weights stacked with a ``lax.scan`` 11.6 ms
(22.5 ms CPU).
Scan-over-layers compiles faster on TPU; the per-layer layout is chosen for
the CPU, where the tests and small-model users run.

Cache contract: see :mod:`specjax._src.models.lm`. Attention runs over a prefix of
the preallocated buffer with a mask (key position ``s`` is visible to the query
at absolute position ``p`` iff ``s <= p`` and, with a sliding window ``W``,
``s > p - W``). Because the block's own keys are written at ``lengths[b] ...``
before attending, ``s <= p`` covers both "cached entries before
``lengths[b]``" and "causal within the block", and stale entries beyond the
block are never read: rollback is a length reset. The prefix is the narrowest
of a few static widths that holds ``max(lengths) + T`` (:func:`attention_widths`:
steps of 64 up to 256, then 1.5 and 2 times each power of two, then the
capacity), so a step over short sequences in a long cache reads only their part
of it (:func:`cache_attention`; on CPU and TPU, while GPUs read the whole buffer).

Only shapes can be checked here (this code runs under ``jit``): a block longer
than the cache, a cache longer than GPT-2's position table, or a full forward
longer than it raise ``ValueError``. Whether ``lengths + T <= max_length`` holds
depends on traced values; ``specjax.decode`` checks it before tracing, because
XLA clamps out-of-range cache writes silently.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.kernels import quant
from specjax._src.kernels import cpu_matmul
from specjax._src.models.lm import Array, KVCache, LMOutput, Params
from specjax._src.models.config import ModelConfig
from specjax._src.models.attention_ops import (  # noqa: F401 (re-exported: the decoder's public helpers)
    ATTENTION_READS, apply_rope, attention_mask, attention_width_index, attention_widths, cache_attention,
    check_attention_reads, grouped_attention, rope_attention_factor, rope_cos_sin, rope_inv_freq, rotate, write_cache,
)
from specjax._src.models.latent_attention import LatentAttention
from specjax._src.models.layers import MLP, RMSNorm  # noqa: F401 (RMSNorm: re-exported)
from specjax._src.models.layers import INIT_STD as _INIT_STD
from specjax._src.models.layers import dense as _dense
from specjax._src.models.layers import float_embed as _float_embed
from specjax._src.models.layers import norm as _norm
from specjax._src.models.moe import ExpertMesh, MoE, check_experts


# --------------------------------------------------------------------------- #
# Small pure helpers
# --------------------------------------------------------------------------- #


def tree_ancestors(parents: Array) -> Array:
    """``[..., T, T]`` bool: ``out[t, j]`` iff node ``j`` is ``t`` or one of its ancestors.

    ``parents[..., T]`` int32 in topological order (``parents[t] < t``, ``-1``
    for a root). Follows every node's parent chain ``T`` times: ``O(T^2)``
    work on a few dozen nodes, no sort or scan over the cache. A numpy
    ``parents`` (a static tree shape) is computed on the host, so the compiled
    program holds the matrix as a constant instead of ``T`` rounds of ops.
    """
    if isinstance(parents, np.ndarray):
        return _host_ancestors(parents)
    t = parents.shape[-1]
    parents = jnp.asarray(parents, jnp.int32)
    node = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), parents.shape)
    anc = jnp.zeros(parents.shape + (t,), bool)
    for _ in range(t):
        anc |= jax.nn.one_hot(node, t, dtype=bool)  # -1 (past a root) sets nothing
        node = jnp.where(node >= 0, jnp.take_along_axis(parents, jnp.maximum(node, 0), axis=-1), -1)
    return anc


def _host_ancestors(parents: np.ndarray) -> np.ndarray:
    """:func:`tree_ancestors` in numpy, for a static tree shape."""
    t = parents.shape[-1]
    anc = np.zeros(parents.shape + (t,), bool)
    node = np.broadcast_to(np.arange(t), parents.shape)
    for _ in range(t):
        valid = node >= 0
        index = np.where(valid, node, 0)
        anc |= (np.arange(t) == index[..., None]) & valid[..., None]
        node = np.where(valid, np.take_along_axis(parents, index, -1), -1)
    return anc


def tree_attention_mask(
    parents: Array, start: Array, kv_len: int, sliding_window: Optional[int], offset: int = 0,
    num: Optional[int] = None,
) -> tuple[Array, Array]:
    """``(mask [B, T, S], positions [B, T])`` for nodes ``offset .. offset + T - 1``
    of a token tree whose node ``j`` sits in cache slot ``start[b] + j``.

    ``parents``: ``[N]`` or ``[B, N]``, the whole tree (``T = num``, default
    ``N - offset``). A node sees every cached entry before ``start[b]`` and the
    slots of its ancestors (itself included); its position is ``start[b] +
    depth``. Feeding a tree level by level (breadth-first levels are contiguous
    node ranges) is thus the same as feeding it whole: a level's nodes see the
    earlier levels' slots through the ancestor relation, not as a prefix. With
    a sliding window, a key's position is its slot for the prefix and
    ``start + depth(j)`` for a tree node.
    """
    b = start.shape[0]
    if isinstance(parents, np.ndarray):  # a static shape: ancestors and depths on the host
        parents = np.broadcast_to(parents.astype(np.int32), (b, parents.shape[-1]))
        anc_host = tree_ancestors(parents)
        anc, depth = jnp.asarray(anc_host), jnp.asarray(anc_host.sum(-1).astype(np.int32) - 1)
    else:
        parents = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (b, parents.shape[-1]))
        anc = tree_ancestors(parents)  # [B, N, N]
        depth = anc.sum(-1).astype(jnp.int32) - 1  # [B, N]
    n = parents.shape[-1]
    t = n - offset if num is None else num
    query_anc = anc[:, offset : offset + t]  # [B, T, N]
    positions = start[:, None] + depth[:, offset : offset + t]
    slot = jnp.arange(kv_len, dtype=jnp.int32)[None, :] - start[:, None]  # [B, S]: node index of each slot
    in_tree = (slot >= 0) & (slot < n)
    node = jnp.clip(slot, 0, n - 1)
    sees_node = jnp.take_along_axis(query_anc, jnp.broadcast_to(node[:, None, :], (b, t, kv_len)), axis=2)
    mask = (slot < 0)[:, None, :] | (in_tree[:, None, :] & sees_node)
    if sliding_window is not None:
        key_pos = jnp.where(in_tree, start[:, None] + jnp.take_along_axis(depth, node, axis=1),
                            jnp.arange(kv_len, dtype=jnp.int32)[None, :])
        mask &= key_pos[:, None, :] > positions[:, :, None] - sliding_window
    return mask, positions


# --------------------------------------------------------------------------- #
# Flax modules
# --------------------------------------------------------------------------- #


class Attention(nn.Module):
    """Self-attention of one block; reads and writes that block's KV buffers.

    With a cache, attention reads the prefix ``width_index`` names
    (:func:`attention_width_index`; ``None``: the whole buffer) where
    ``attention_reads`` allows (:func:`cache_attention`), and a given
    ``mask`` spans the whole buffer, ``[B, T, S]``.
    """

    config: ModelConfig
    matmul: str = "auto"
    attention_reads: str = "auto"
    layer: int = 0

    @nn.compact
    def __call__(self, x, positions, kv_cache, lengths, mask=None, width_index=None):
        cfg = self.config
        b, t, _ = x.shape
        n, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if cfg.is_gpt2:
            qkv = _dense(cfg, 3 * n * d, True, "qkv", self.matmul)(x)
            q, k, v = jnp.split(qkv, 3, axis=-1)
        else:
            q = _dense(cfg, n * d, cfg.attention_bias, "q", self.matmul)(x)
            k = _dense(cfg, kv * d, cfg.attention_bias, "k", self.matmul)(x)
            v = _dense(cfg, kv * d, cfg.attention_bias, "v", self.matmul)(x)
        q = q.reshape(b, t, n, d)
        k = k.reshape(b, t, kv, d)
        v = v.reshape(b, t, kv, d)
        if cfg.qk_norm:
            q = _norm(cfg, "q_norm")(q)
            k = _norm(cfg, "k_norm")(k)
        if not cfg.is_gpt2:
            # Every position indexes the cache (or the block, without one).
            bound = t if kv_cache is None else kv_cache[0].shape[2]
            cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg, self.layer), bound)
            factor = rope_attention_factor(cfg.rope_scaling)  # YaRN's (gpt-oss); 1 otherwise
            if factor != 1.0:
                cos, sin = cos * factor, sin * factor
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)

        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # heads-major [B, K, T, D]
        if kv_cache is None:
            keys, values, new_cache = k, v, None
        else:
            keys = write_cache(kv_cache[0], k, lengths)
            values = write_cache(kv_cache[1], v, lengths)
            new_cache = (keys, values)
        if mask is None:  # a chain: causal by position
            mask_at = functools.partial(attention_mask, positions, sliding_window=cfg.layer_window(self.layer))
        else:
            mask_at = lambda width: mask[:, :, :width]  # noqa: E731
        scale = d**-0.5 if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar**-0.5
        sinks = self.param("sinks", nn.initializers.zeros, (n,), jnp.dtype(cfg.dtype)) if cfg.attention_sinks else None
        out = cache_attention(q, keys, values, mask_at, scale,
                              None if kv_cache is None else width_index, self.attention_reads,
                              cfg.attn_logit_softcapping, sinks)
        out = _dense(cfg, cfg.hidden_size, cfg.is_gpt2 or cfg.attention_out_bias, "o", self.matmul)(out)
        return out, new_cache


class Block(nn.Module):
    """Pre-norm residual block: attention then MLP (Gemma 2/3: each output
    normed again, ``post_attn_norm`` / ``post_mlp_norm``, before the residual add)."""

    config: ModelConfig
    matmul: str = "auto"
    attention_reads: str = "auto"
    layer: int = 0
    experts: str | ExpertMesh = "routed"

    @nn.compact
    def __call__(self, x, positions, kv_cache, lengths, mask=None, width_index=None):
        cfg = self.config
        attention = LatentAttention if cfg.latent_attention else Attention  # DeepSeek-V3's MLA
        attn, new_cache = attention(cfg, self.matmul, self.attention_reads, self.layer, name="attn")(
            _norm(cfg, "attn_norm")(x), positions, kv_cache, lengths, mask, width_index
        )
        if cfg.sandwich_norms:
            attn = _norm(cfg, "post_attn_norm")(attn)
        x = x + attn
        if cfg.is_moe_layer(self.layer):
            mlp = MoE(cfg, self.matmul, self.experts, name="mlp")(_norm(cfg, "mlp_norm")(x))
        else:
            mlp = MLP(cfg, self.matmul, name="mlp")(_norm(cfg, "mlp_norm")(x))
        if cfg.sandwich_norms:
            mlp = _norm(cfg, "post_mlp_norm")(mlp)
        x = x + mlp
        return x, new_cache


# Block under nn.jit: one trace per distinct (fields, argument shapes), shared by layers.
_TracedOnceBlock = nn.jit(Block)


class Transformer(nn.Module):
    """Embeddings, ``num_layers`` blocks, final norm and LM head.

    Returns ``(logits[B, T, V] float32, block outputs (one per layer), caches)``.
    ``matmul``, ``attention_reads``, ``experts``: see :class:`specjax.Decoder`.
    """

    config: ModelConfig
    matmul: str = "auto"
    attention_reads: str = "auto"
    experts: str | ExpertMesh = "routed"

    @nn.compact
    def __call__(self, tokens, positions, kv_caches, lengths, logits_at=None, reduced_logits=False, mask=None,
                 width_index=None):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        if cfg.quantization is not None:
            embed = quant.QuantEmbed(cfg.vocab_size, cfg.hidden_size, cfg.quant.embedding, dtype, self.matmul,
                                     name="embed")
        else:
            embed = _float_embed(cfg.vocab_size, cfg.hidden_size, dtype, "embed")
        x = embed(tokens)
        if cfg.is_gemma:  # scaled by sqrt(H) rounded to the model's dtype, as transformers does
            x = x * jnp.asarray(math.sqrt(cfg.hidden_size), dtype)
        if cfg.is_gpt2:
            x = x + _float_embed(cfg.max_position_embeddings, cfg.hidden_size, dtype, "pos_embed")(positions)
        block_outputs, new_caches = [], []
        for i in range(cfg.num_layers):
            layer_cache = None if kv_caches is None else kv_caches[i]
            layer_mask = mask[i] if isinstance(mask, (tuple, list)) else mask  # one per layer, or shared
            # Each layer is a jitted call of its kind's block (``representative_layer``): a forward
            # traces one block per kind, not per layer (tracing was 3/4 of a server's start-up).
            x, c = _TracedOnceBlock(cfg, self.matmul, self.attention_reads, cfg.representative_layer(i),
                                    self.experts, name=f"layer_{i}")(
                x, positions, layer_cache, lengths, layer_mask, width_index)
            block_outputs.append(x)
            new_caches.append(c)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at.astype(jnp.int32)[:, None, None], axis=1)  # [B, 1, H]
        x = _norm(cfg, "final_norm")(x)
        # Accumulate the head in float32: bf16 logits would round away the
        # small differences acceptance rules compare.
        if cfg.has_reduced_head:
            head = self._head(cfg.head_vocab_size)
            ids = self.param("head_vocab_ids", _identity_ids, (cfg.head_vocab_size,))
            logits = _softcap_logits(cfg, head_logits(x, head, self.matmul))
            if not reduced_logits:
                logits = scatter_to_vocab(logits, ids, cfg.vocab_size)
        elif cfg.tie_word_embeddings:
            # Against the [V, H] table as stored, the table as the dot's left
            # operand: written as x @ table.T, XLA's CPU backend fused a
            # transposed copy of the table into a naive loop (0.14 ms per draft
            # token for a 2048 x 64 table), and with the table on the right a
            # 4-token verification of SmolLM2's 49152 x 576 table took 1.3 ms
            # more (a 20.9 ms forward against 19.6 ms; 1 token: the same).
            logits = _softcap_logits(cfg, head_logits(x, embed.embedding, self.matmul, table=True))
        else:
            logits = _softcap_logits(cfg, head_logits(x, self._head(cfg.vocab_size), self.matmul))
        return logits, tuple(block_outputs), tuple(new_caches)

    def _head(self, vocab: int):
        """The untied LM head: ``[H, vocab]``, or its quantized arrays (``[vocab, H]``)."""
        cfg = self.config
        if cfg.quantization is not None:
            return quant.quant_head(self, "lm_head", cfg.quant.embedding, cfg.hidden_size, vocab)
        return self.param("lm_head", nn.initializers.normal(_INIT_STD), (cfg.hidden_size, vocab), jnp.dtype(cfg.dtype))


def _softcap_logits(cfg: ModelConfig, logits: Array) -> Array:
    """``c * tanh(logits / c)`` with ``c = final_logit_softcapping`` (Gemma 2), else as is."""
    cap = cfg.final_logit_softcapping
    return logits if cap is None else jnp.tanh(logits / cap) * cap


def head_logits(x: Array, head: Array, matmul: str, table: bool = False) -> Array:
    """``x[B, T, H] @ head[H, V]`` (``table``: ``@ head[V, H].T``; quantized:
    always ``[V, H]``), accumulated in float32."""
    if quant.is_quantized(head):
        return quant.qdot(x, head, matmul)
    if cpu_matmul.applies(x, head, matmul):
        return cpu_matmul.matmul(x, head, transpose_w=table)
    if table:
        return jnp.einsum("vh,bth->vbt", head, x, preferred_element_type=jnp.float32).transpose(1, 2, 0)
    return jnp.einsum("bth,hv->btv", x, head, preferred_element_type=jnp.float32)


def _identity_ids(key, shape):
    del key
    return jnp.arange(shape[0], dtype=jnp.int32)


def scatter_to_vocab(logits: Array, ids: Array, vocab_size: int) -> Array:
    """Reduced-head logits ``[..., V']`` -> ``[..., vocab_size]``, ``-inf`` off ``ids``."""
    full = jnp.full(logits.shape[:-1] + (vocab_size,), -jnp.inf, logits.dtype)
    return full.at[..., ids].set(logits, unique_indices=True)


def is_index_param(path) -> bool:
    """The integer leaves of a params tree (a reduced head's token ids): never
    cast to the compute dtype, never trained."""
    return str(getattr(path[-1], "key", path[-1])) == "head_vocab_ids"


@functools.lru_cache(maxsize=64)
def _param_shapes(config: ModelConfig) -> Params:
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    variables = jax.eval_shape(
        lambda k, t: Transformer(config).init(k, t, t, None, None), jax.random.key(0), tokens
    )
    return variables["params"]


@functools.partial(jax.jit, static_argnums=0)
def _init_params(config: ModelConfig, key: Array) -> Params:
    shapes = _param_shapes(config)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    sizes = [int(np.prod(x.shape)) for _, x in leaves]
    noise = _INIT_STD * jax.random.normal(key, (sum(sizes),), jnp.float32)
    out, start = [], 0
    for (path, leaf), size in zip(leaves, sizes):
        name = str(getattr(path[-1], "key", path[-1]))
        if name == "head_vocab_ids":
            value = jnp.arange(leaf.shape[0], dtype=leaf.dtype)
        elif name == "scale":  # Gemma's norms store the offset from 1
            value = (jnp.zeros if config.is_gemma else jnp.ones)(leaf.shape, leaf.dtype)
        elif name in ("bias", "router_bias"):
            value = jnp.zeros(leaf.shape, leaf.dtype)
        else:  # kernels, embeddings, lm_head
            value = noise[start:start + size].reshape(leaf.shape).astype(leaf.dtype)
        start += size
        out.append(value)
    return jax.tree_util.tree_unflatten(treedef, out)


# --------------------------------------------------------------------------- #
# The LanguageModel
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Decoder:
    """The static half of a decoder model (hashable; a ``jit`` static).

    Implements :class:`specjax.LanguageModel`. Params are a nested dict:
    ``embed/embedding [V, H]``, ``pos_embed/embedding [P, H]`` (GPT-2),
    ``layer_{i}/{attn_norm, attn/{q,k,v,o | qkv,o, q_norm, k_norm}, mlp_norm,
    mlp/{gate,up,down | fc,proj}}``, ``final_norm``, ``lm_head [H, V]`` (untied).
    Dense kernels are ``[in, out]``.

    Example::

        model = Decoder(cfg)
        params = model.init(jax.random.key(0))
        cache = model.init_cache(batch_size=2, max_length=64)
        out = model.apply(params, prompt, cache)          # prefill
        out = model.apply(params, next_tokens, out.cache)  # append

    ``matmul`` picks how the float32 products of 2 to 16 rows (verification
    blocks at small batch) run on the CPU: ``"auto"`` (default) by specjax's
    few-row kernels where they can be built (:mod:`specjax._src.kernels.cpu_matmul`),
    else by XLA's dot; ``"kernel"`` by the kernels or an error saying why
    they cannot be built; ``"xla"`` always by XLA's dot. Other platforms,
    dtypes and row counts always use XLA's dot. ``dataclasses.replace(model,
    matmul="xla")`` gives the same model with another choice (a new program).

    ``attention_reads`` picks how much of a KV cache each forward's attention
    reads: ``"auto"`` (default) the prefix every row needs on CPU and TPU
    (the narrowest of :func:`~specjax._src.models.decoder.attention_widths`) and the whole buffer on GPUs,
    ``"prefix"`` the prefix everywhere, ``"whole"`` the whole buffer
    everywhere. The outputs are the same; only the bytes read and the
    programs differ (:func:`~specjax._src.models.decoder.cache_attention` says why GPUs default to the
    whole buffer).

    ``experts`` picks how a mixture of experts computes: ``"routed"`` (default)
    only the experts each token is routed to (:mod:`~specjax._src.models.moe`),
    ``"all"`` every expert for every token (the reference), or a ``moe.ExpertMesh``:
    the routed ones on a mesh that splits the experts (``specjax.sharding`` sets it).
    """

    config: ModelConfig
    matmul: str = "auto"
    attention_reads: str = "auto"
    experts: str | ExpertMesh = "routed"

    # ``apply(..., logits_at=)`` is implemented (the optional protocol extension).
    supports_logits_at = True
    supports_trees = True  # apply(tree_parents=...): see specjax._src.models.lm

    def __post_init__(self):
        cpu_matmul.check_mode(self.matmul)
        check_attention_reads(self.attention_reads)
        check_experts(self.experts)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def dtype(self):
        return jnp.dtype(self.config.dtype)

    def init(self, key: Array) -> Params:
        """Random params like Hugging Face's: normal(0.02) weights, unit norm scales, zero biases.

        Draws all weights with one ``jax.random.normal`` call and slices it:
        Flax's per-parameter initialisers emit one PRNG computation per tensor,
        which XLA's CPU backend took ~10 s to compile for a 2-layer model.
        A quantized model's are the float model's, quantized.
        """
        cfg = self.config
        if cfg.quantization is not None:
            return quant.quantize_params(_init_params(cfg.replace(quantization=None), key), cfg.quant)
        return _init_params(cfg, key)

    def attention_widths(self, capacity: int) -> tuple[int, ...]:
        """The key widths this model's attention may read from a cache of
        ``capacity`` slots (the narrowest holding every row's positions runs),
        where it reads a prefix: every platform with ``attention_reads="prefix"``,
        CPU and TPU with ``"auto"``. ``(capacity,)``: the whole buffer always."""
        return (int(capacity),) if self.attention_reads == "whole" else attention_widths(capacity)

    def param_shapes(self) -> Params:
        """The params' ``jax.ShapeDtypeStruct`` tree, without allocating anything."""
        return _param_shapes(self.config)

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> KVCache:
        """Zeroed per-layer buffers ``[B, num_kv_heads, max_length, head_dim]``.

        Raises:
          ValueError: for GPT-2 when ``max_length`` exceeds its position table.
        """
        cfg = self.config
        if cfg.is_gpt2 and max_length > cfg.max_position_embeddings:
            raise ValueError(
                f"Cache max_length {max_length} exceeds this GPT-2 model's "
                f"{cfg.max_position_embeddings} learned positions (max_position_embeddings)."
            )
        dtype = self.dtype if dtype is None else jnp.dtype(dtype)
        shape = (batch_size, cfg.num_kv_heads, max_length, cfg.head_dim)
        zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731 (a fresh buffer per layer)
        return KVCache(
            keys=tuple(zeros() for _ in range(cfg.num_layers)),
            values=tuple(zeros() for _ in range(cfg.num_layers)),
            lengths=jnp.zeros((batch_size,), jnp.int32),
        )

    def apply(
        self,
        params: Params,
        tokens: Array,
        cache: Optional[KVCache] = None,
        *,
        hidden_layers: Sequence[int] = (),
        logits_at: Optional[Array] = None,
        tree_parents: Optional[Array] = None,
        tree_offset: int = 0,
    ) -> LMOutput:
        """Runs ``tokens[B, T]``; see :mod:`specjax._src.models.lm` for the cache contract.

        Args:
          params: from :meth:`init` or :func:`specjax.load`.
          tokens: ``[B, T]`` int token ids.
          cache: ``None`` for a plain causal forward from position 0 (training),
            else the cache to append to (token ``t`` of sequence ``b`` goes to
            position ``cache.lengths[b] + t``).
          hidden_layers: block outputs to return, indexed like a Python list
            (``-1``: the last block, before the final norm).
          logits_at: optional ``[B]`` int, one position in ``[0, T)`` per
            sequence: logits come back ``[B, 1, V]`` for that position only,
            and the LM head runs on one row (a vocabulary-wide matmul saved per
            extra row). Positions are traced values: out-of-range ones clamp.
          tree_parents: optional ``[B, T]`` (or ``[T]``) int32, the tokens as a
            flattened tree in topological order (``parents[t] < t``, ``-1`` for
            a child of the last cached token): node ``t`` attends to the prefix
            and its ancestors only and sits at position ``lengths + depth``
            (``tree_attention_mask``), so its logits are those of a chain
            forward over its root path. Node ``t``'s K/V go to slot
            ``lengths + t``; :meth:`KVCache.keep_path` keeps the accepted path.
            ``parents = [-1, 0, 1, ...]`` is the plain causal block.
          tree_offset: static; with ``tree_parents`` of the whole tree
            (``[N]`` or ``[B, N]``, ``N >= T``), the block is nodes
            ``tree_offset .. tree_offset + T - 1`` and the tree started at
            slot ``cache.lengths - tree_offset``: a tree drafted level by level
            attends exactly as if it had been fed whole.

        Returns:
          ``LMOutput(logits [B, T, V] float32 ([B, 1, V] with ``logits_at``),
          hidden (one [B, T, H] float32 per requested layer), cache with
          lengths + T or None)``.
        """
        cfg = self.config
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}.")
        b, t = tokens.shape
        layers = [self._layer_index(i) for i in hidden_layers]
        if logits_at is not None and jnp.shape(logits_at) != (b,):
            raise ValueError(
                f"logits_at must hold one position per sequence, shape ({b},), got shape "
                f"{jnp.shape(logits_at)}; pass None for logits at every position."
            )
        if cache is None:
            if cfg.is_gpt2 and t > cfg.max_position_embeddings:
                raise ValueError(
                    f"Sequence of {t} tokens exceeds this GPT-2 model's "
                    f"{cfg.max_position_embeddings} learned positions."
                )
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            kv_caches = lengths = None
        else:
            self._check_cache(cache, b, t)
            lengths = cache.lengths.astype(jnp.int32)
            positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
            kv_caches = tuple(zip(cache.keys, cache.values))
        mask = width_index = None
        if cache is not None:
            width_index = attention_width_index(cache.max_length, lengths, t)
        if tree_parents is not None:
            if not isinstance(tree_parents, np.ndarray):  # numpy stays on the host (static shape)
                tree_parents = jnp.asarray(tree_parents, jnp.int32)
            n = tree_offset + t
            if tree_parents.ndim not in (1, 2) or tree_parents.shape[-1] < n or (
                    tree_parents.ndim == 2 and tree_parents.shape[0] != b):
                raise ValueError(
                    f"tree_parents must be [N] or [B, N] = [{b}, N] with N >= tree_offset + T = {n} (one "
                    f"parent per tree node), got shape {tree_parents.shape}."
                )
            if cache is None and tree_offset:
                raise ValueError("tree_offset needs a cache holding the tree's earlier nodes.")
            start = jnp.zeros((b,), jnp.int32) if lengths is None else lengths - tree_offset
            kv_len = t if cache is None else cache.max_length
            windows = {cfg.layer_window(i) for i in range(cfg.num_layers)}
            masks = {}
            for window in windows:
                masks[window], positions = tree_attention_mask(tree_parents, start, kv_len, window,
                                                               offset=tree_offset, num=t)
            # One mask for all layers, or one per layer where sliding and full layers mix (Gemma 2/3).
            mask = masks.popitem()[1] if len(masks) == 1 else tuple(
                masks[cfg.layer_window(i)] for i in range(cfg.num_layers))
        logits, block_outputs, new_caches = Transformer(cfg, self.matmul, self.attention_reads, self.experts).apply(
            {"params": params}, tokens, positions, kv_caches, lengths, logits_at, False, mask, width_index
        )
        hidden = tuple(block_outputs[i].astype(jnp.float32) for i in layers)
        new_cache = None
        if cache is not None:
            new_cache = KVCache(
                keys=tuple(c[0] for c in new_caches),
                values=tuple(c[1] for c in new_caches),
                lengths=lengths + t,
            )
        return LMOutput(logits=logits, hidden=hidden, cache=new_cache)

    def _layer_index(self, i: int) -> int:
        n = self.config.num_layers
        if not isinstance(i, (int, np.integer)) or not -n <= i < n:
            raise IndexError(
                f"hidden_layers index {i!r} out of range for a model with {n} layers "
                f"(valid: {-n} ... {n - 1})."
            )
        return int(i) % n

    def _check_cache(self, cache: KVCache, batch: int, t: int) -> None:
        cfg = self.config
        if len(cache.keys) != cfg.num_layers:
            raise ValueError(
                f"Cache has {len(cache.keys)} layers but the model has {cfg.num_layers}; "
                "build it with this model's init_cache."
            )
        if cache.batch_size != batch:
            raise ValueError(
                f"Cache batch size {cache.batch_size} does not match tokens batch {batch}."
            )
        if t > cache.max_length:
            raise ValueError(
                f"Prompt/block of {t} tokens is longer than the cache (max_length="
                f"{cache.max_length}); build a larger cache with init_cache."
            )
