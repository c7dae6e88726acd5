"""A target-feature draft head (EAGLE-style): one decoder block over the target's hidden states.

Following "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty" (Li et al., arXiv:2401.15077), the head drafts at the *feature*
level. At head position ``i`` it reads the target's feature ``f_i`` (the
output of one of the target's blocks at position ``i``, before the final
norm) and the embedding of the token ``x_{i+1}`` the target sampled from
``f_i``, and predicts ``f_{i+1}``; the token ``x_{i+2}`` is drawn from the
predicted feature through a final norm and an LM head. Given the token, the
next feature is nearly deterministic, which is why a one-block head accepts
more drafts than a separate small model of the same cost.

    embedded = embed(x_{i+1})                                 # the target's table, frozen
    fused    = fuse([embedded, feature_norm(f_i)])            # [2H] -> [H]
    f_hat    = block(fused)                                   # one causal decoder block, its own KV cache
    logits   = lm_head(final_norm(f_hat))                     # a reduced vocabulary, scattered to V

When drafting the second token and later, the target's feature is not known
yet, so the head feeds its own ``f_hat`` back as ``f``.

A head may read several of the target's blocks (``feature_layers``, e.g. a
low, a middle and the last one, as "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test", Li et al.,
arXiv:2503.01840, does). Each block's output is RMS-normalised and a learned
``reduce`` ``[n H] -> [H]`` mixes them into the one feature ``f_i`` above
(:meth:`FeatureHead.target_features`); the head's own ``f_hat`` replaces that
mixture in later draft steps. ``feature_norm`` makes
the head scale-free in its input (the target's residual stream grows with
depth), and ``final_norm`` makes the logits depend on ``f_hat``'s direction
only; the trainer regresses normalised features accordingly.

The head borrows the target's embedding table: its checkpoint stores only its
own weights, and :func:`specjax.pair` puts the target's table into the head's
params (the same array, no copy). The LM head scores a reduced,
frequency-ranked vocabulary (``head_vocab_size``) and scatters it to the full
vocabulary with ``-inf`` elsewhere, so lossless rules stay lossless.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from specjax._src.kernels import quant
from specjax._src.models.lm import Array, KVCache, LMOutput, Model, Params, ReducedLogits
from specjax._src.models.config import ModelConfig
from specjax._src.models.decoder import (
    MLP,
    Attention,
    Block,
    Decoder,
    attention_width_index,
    head_logits,
    scatter_to_vocab,
    tree_attention_mask,
)
from specjax._src.models.layers import INIT_STD, dense, norm
from specjax._src.models.files import load_tokenizer, write_directory
from specjax._src.models.hf import write_safetensors

CONFIG_KEY = "specjax_feature_head"
WEIGHTS_FILE = "head.safetensors"
EMBED_PATH = ("embed", "embedding")

# The block layouts a FeatureHead computes (``FeatureHead.variant``):
#   "specjax": this module's own head (feature_norm, fuse, Llama blocks, final_norm, reduced LM head);
#   "eagle":   EAGLE-1/2's (SafeAILab/EAGLE cnets1.py): fuse with a bias over [embedding, feature], the
#              first block without its input norm, no final norm, the target's own final norm on the
#              features it reads and the target's LM head on its predictions;
#   "eagle3":  EAGLE-3's (cnets.py, SpecForge llama3_eagle.py): features fused by ``reduce`` from the
#              raw outputs of three target blocks, one block whose attention reads
#              cat(input_norm(embedding), hidden_norm(feature)) [2H] with the feature as residual, a
#              final norm and a reduced LM head; the block's pre-norm output is fed back;
#   "eagle3_norm_before_residual": the same, its residual the normed feature (vLLM's
#              ``norm_before_residual`` checkpoints).
VARIANTS = ("specjax", "eagle", "eagle3", "eagle3_norm_before_residual")
# The params an "eagle" head borrows from its target at pairing (never saved with the head).
TARGET_NORM = "target_norm"
BORROWED_HEAD = ("lm_head", "lm_head_table")


class BorrowedEmbed(nn.Module):
    """The target's embedding table, float or quantized (the head only reads rows of it)."""

    num_embeddings: int
    features: int
    dtype: Any

    @nn.compact
    def __call__(self, tokens: Array) -> Array:
        if self.has_variable("params", "embedding"):  # as attached: its own shape and dtypes
            table = self.get_variable("params", "embedding")
        else:
            table = self.param("embedding", nn.initializers.zeros, (self.num_embeddings, self.features), self.dtype)
        if quant.is_quantized(table):
            return quant.embed_rows(table, tokens, self.dtype)
        return jnp.take(table, tokens, axis=0).astype(self.dtype)


class _EagleFirstBlock(nn.Module):
    """EAGLE-1/2's first block: a Llama block without its input norm (cnets1.py's
    ``LlamaDecoderLayer(index=0)``): the fused input is already on the target's scale."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x, positions, kv_cache, lengths, mask=None, width_index=None):
        cfg = self.config
        attn, new_cache = Attention(cfg, name="attn")(x, positions, kv_cache, lengths, mask, width_index)
        x = x + attn
        return x + MLP(cfg, name="mlp")(norm(cfg, "mlp_norm")(x)), new_cache


class _Eagle3Block(nn.Module):
    """EAGLE-3's one block (cnets.py ``LlamaDecoderLayeremb``): attention over
    ``cat(attn_norm(embedded), hidden_norm(hidden))`` ``[2H]``, added to the
    residual ``hidden`` (or, ``norm_before_residual``, to its normed form), then
    the usual MLP. Returns ``(f_hat [B, T, H] pre-norm, cache)``."""

    config: ModelConfig
    norm_before_residual: bool = False

    @nn.compact
    def __call__(self, embedded, hidden, positions, kv_cache, lengths, mask=None, width_index=None):
        cfg = self.config
        normed = norm(cfg, "hidden_norm")(hidden)
        x = jnp.concatenate([norm(cfg, "attn_norm")(embedded), normed], axis=-1)
        attn, new_cache = Attention(cfg, name="attn")(x, positions, kv_cache, lengths, mask, width_index)
        x = (normed if self.norm_before_residual else hidden) + attn
        return x + MLP(cfg, name="mlp")(norm(cfg, "mlp_norm")(x)), new_cache


class FeatureHeadModule(nn.Module):
    """The Flax module behind :class:`FeatureHead`: fuse, ``config.num_layers``
    blocks, final norm, reduced LM head (``variant``: the published layouts, see ``VARIANTS``).

    Returns ``(logits float32, f_hat [B, T, H], caches)``: the logits are
    ``[B, T, V']`` over the reduced vocabulary (``head_vocab_ids`` order), or
    ``[B, T, V]`` for the ``"eagle"`` variant, which scores with its target's
    full LM head.
    """

    config: ModelConfig
    variant: str = "specjax"

    @nn.compact
    def __call__(self, tokens, features, positions, kv_caches, lengths, logits_at=None, mask=None, width_index=None):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        embedded = BorrowedEmbed(cfg.vocab_size, cfg.hidden_size, dtype, name="embed")(tokens)
        eagle3 = self.variant.startswith("eagle3")
        float_cfg = cfg.replace(quantization=None)  # fuse stays float in a quantized head (quant.FEATURE_MIXING)
        if eagle3:
            x = features.astype(dtype)  # already fused by ``reduce`` (target_features)
        elif self.variant == "eagle":  # cnets1.py: fc(cat(embeds, hidden)) with a bias, the feature as read
            x = dense(float_cfg, cfg.hidden_size, True, "fuse")(jnp.concatenate([embedded, features.astype(dtype)], -1))
        else:
            feature = norm(cfg, "feature_norm")(features.astype(dtype))
            x = dense(float_cfg, cfg.hidden_size, False, "fuse")(jnp.concatenate([embedded, feature], axis=-1))
        new_caches = []
        for i in range(cfg.num_layers):
            layer_cache = None if kv_caches is None else kv_caches[i]
            if eagle3 and i == 0:  # later blocks read the stream alone, as standard blocks (vLLM's llama_eagle3.py)
                x, c = _Eagle3Block(cfg, self.variant.endswith("norm_before_residual"), name=f"layer_{i}")(
                    embedded, x, positions, layer_cache, lengths, mask, width_index)
            elif self.variant == "eagle" and i == 0:
                x, c = _EagleFirstBlock(cfg, name="layer_0")(x, positions, layer_cache, lengths, mask, width_index)
            else:
                x, c = Block(cfg, name=f"layer_{i}")(x, positions, layer_cache, lengths, mask, width_index)
            new_caches.append(c)
        f_hat = x
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at.astype(jnp.int32)[:, None, None], axis=1)
        if self.variant == "eagle":  # the target's LM head on the prediction itself (no norm: cnets1.py)
            return self._target_head(x), f_hat, tuple(new_caches)
        x = norm(cfg, "final_norm")(x)
        if cfg.quantization is not None:
            head = quant.quant_head(self, "lm_head", cfg.quant.embedding, cfg.hidden_size, cfg.head_vocab_size)
            logits = quant.qdot(x, head)
        else:
            head = self.param("lm_head", nn.initializers.normal(INIT_STD), (cfg.hidden_size, cfg.head_vocab_size),
                              dtype)
            logits = jnp.einsum("bth,hv->btv", x, head, preferred_element_type=jnp.float32)
        self.param("head_vocab_ids", lambda k, s: jnp.arange(s[0], dtype=jnp.int32), (cfg.head_vocab_size,))
        return logits, f_hat, tuple(new_caches)

    def _target_head(self, x):
        """The borrowed full-vocabulary LM head: ``lm_head [H, V]`` (an untied
        target's) or ``lm_head_table [V, H]`` (a tied one's embedding table)."""
        cfg = self.config
        if self.has_variable("params", "lm_head_table"):
            return head_logits(x, self.get_variable("params", "lm_head_table"), "auto", table=True)
        if self.has_variable("params", "lm_head"):
            return head_logits(x, self.get_variable("params", "lm_head"), "auto")
        head = self.param("lm_head", nn.initializers.normal(INIT_STD), (cfg.hidden_size, cfg.vocab_size),
                          jnp.dtype(cfg.dtype))
        return head_logits(x, head, "auto")


@dataclasses.dataclass(frozen=True)
class FeatureHead:
    """The static half of a target-feature draft head (hashable; a ``jit`` static).

    A draft for :func:`specjax.decode` like a :class:`~specjax.Decoder`, with
    one more input: ``apply(params, tokens, cache, features=...)``. The engine
    recognises it by ``reads_target_features``, asks the target for the
    outputs of ``feature_layers`` in each verification forward and turns them
    into the head's input with :meth:`target_features`.

    Attributes:
      config: the head's blocks (``num_layers`` of them, usually 1), in the
        target's width: ``hidden_size`` and ``vocab_size`` equal the
        target's; ``head_vocab_size`` is the reduced LM head's size.
      feature_layers: the target blocks whose outputs the head reads (``-1``:
        the last, before the final norm). One block is read as it is; several
        are mixed by the learned ``reduce`` kernel. An ``"eagle3"`` head may
        leave it empty: EAGLE-3's default blocks, fixed by :func:`specjax.pair`
        from the target's depth.
      variant: the block layout (``VARIANTS``): ``"specjax"`` (this module's
        own), ``"eagle"`` (EAGLE-1/2) or ``"eagle3"``, the layouts of
        published heads (:mod:`specjax._src.models.published_heads` loads them).
      borrows_embedding: the embedding table comes from the target at pairing
        (False: the checkpoint shipped its own, which is kept).
    """

    config: ModelConfig
    feature_layers: tuple[int, ...] = (-1,)
    variant: str = "specjax"
    borrows_embedding: bool = True

    reads_target_features = True
    supports_logits_at = True
    supports_trees = True

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"FeatureHead: unknown variant {self.variant!r}; one of {', '.join(VARIANTS)}.")
        layers = tuple(int(x) for x in self.feature_layers)
        empty_ok = self.variant.startswith("eagle3")  # resolved by pairing
        if (not layers and not empty_ok) or len(set(layers)) != len(layers):
            raise ValueError(f"FeatureHead: feature_layers must name distinct target blocks; got {self.feature_layers}.")
        object.__setattr__(self, "feature_layers", layers)
        if not self.config.has_reduced_head:
            raise ValueError("A FeatureHead needs config.head_vocab_size (its reduced LM head).")
        if self.config.is_gpt2:
            raise ValueError("A FeatureHead is built from rotary (Llama-family) blocks, not GPT-2 ones.")

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def target_features(self, params: Params, hidden: Array) -> Array:
        """The head's input from the target's ``feature_layers`` outputs.

        Args:
          hidden: ``[B, T, n * H]``, the n blocks' outputs concatenated in
            ``feature_layers`` order.

        Returns:
          ``[B, T, H]`` float32: the block's output itself for one layer, else
          ``reduce`` applied to the RMS-normalised outputs.
        """
        if not self.feature_layers:
            raise ValueError("This EAGLE-3 head reads the target's default blocks, known once it is paired: "
                             "specjax.pair(target, head).")
        if self.variant == "eagle":  # EAGLE-1/2 read the target's last hidden state after its final norm
            return rms_norm(hidden, params[TARGET_NORM]["scale"], self.config.norm_eps)
        if self.variant.startswith("eagle3"):  # fc over the raw outputs, no norm (cnets.py)
            hidden = jnp.asarray(hidden, jnp.float32)
            if len(self.feature_layers) == 1:
                return hidden
            kernel = params["reduce"]["kernel"]
            return jnp.einsum("btk,kh->bth", hidden.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
        return reduce_features(params, hidden, len(self.feature_layers), self.config.norm_eps)

    def init(self, key: Array) -> Params:
        """Random params (normal(0.02) kernels, unit norm scales, zero embedding)."""
        return _init_params(self.config, key, _num_feature_layers(self), self.variant)

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> KVCache:
        return Decoder(self.config).init_cache(batch_size, max_length, dtype)

    def apply(
        self,
        params: Params,
        tokens: Array,
        cache: Optional[KVCache] = None,
        *,
        features: Array,
        hidden_layers=(),
        logits_at: Optional[Array] = None,
        tree_parents: Optional[Array] = None,
        tree_offset: int = 0,
    ) -> LMOutput:
        """Drafts from ``features[B, T, H]`` (the target's, or the head's own ``f_hat``).

        Token ``t`` of the block is ``x_{i+1}`` for feature ``f_i``; see the
        module docstring. ``logits_at``, ``tree_parents`` and ``tree_offset``
        work as in :meth:`specjax.Decoder.apply`; ``hidden_layers`` is
        ignored: ``hidden`` is always ``(f_hat [B, T, H],)``, the predicted
        next features, to be fed back as ``features``.
        """
        del hidden_layers
        cfg = self.config
        tokens = jnp.asarray(tokens)
        features = jnp.asarray(features)
        if tokens.ndim != 2 or features.shape != tokens.shape + (cfg.hidden_size,):
            raise ValueError(
                f"FeatureHead.apply: tokens must be [B, T] and features [B, T, {cfg.hidden_size}]; got "
                f"tokens {tokens.shape} and features {features.shape}."
            )
        if EMBED_PATH[0] not in params:
            raise ValueError(
                "This head has no embedding table: its checkpoint stores only its own weights. Pair it "
                "with its target (specjax.pair(target, head)) or call attach_embedding(head, target)."
            )
        b, t = tokens.shape
        if cache is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            kv_caches = lengths = width_index = None
        else:
            lengths = cache.lengths.astype(jnp.int32)
            positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
            kv_caches = tuple(zip(cache.keys, cache.values))
            # the cache prefix attention reads (see Decoder.apply)
            width_index = attention_width_index(cache.max_length, lengths, t)
        mask = None
        if tree_parents is not None:
            if not isinstance(tree_parents, np.ndarray):
                tree_parents = jnp.asarray(tree_parents, jnp.int32)
            start = jnp.zeros((b,), jnp.int32) if lengths is None else lengths - tree_offset
            kv_len = t if cache is None else cache.max_length
            mask, positions = tree_attention_mask(
                tree_parents, start, kv_len, cfg.sliding_window, offset=tree_offset, num=t
            )
        logits, f_hat, new_caches = FeatureHeadModule(cfg, self.variant).apply(
            {"params": params}, tokens, features, positions, kv_caches, lengths, logits_at, mask, width_index
        )
        new_cache = None
        if cache is not None:
            new_cache = KVCache(
                keys=tuple(c[0] for c in new_caches), values=tuple(c[1] for c in new_caches), lengths=lengths + t
            )
        reduced = None
        if self.variant != "eagle":  # the reduced LM head; the full logits are its scatter, -inf elsewhere
            reduced = ReducedLogits(logits, params["head_vocab_ids"])
            logits = scatter_to_vocab(logits, reduced.ids, cfg.vocab_size)
        return LMOutput(logits=logits, hidden=(f_hat.astype(jnp.float32),), cache=new_cache, reduced=reduced)


def _num_feature_layers(module) -> int:
    """How many target blocks a head mixes (an EAGLE-3 head before pairing: its default three)."""
    if module.feature_layers:
        return len(module.feature_layers)
    return 3 if module.variant.startswith("eagle3") else 1


def is_feature_head(module) -> bool:
    """Whether a draft module reads the target's features (the engine's test)."""
    return bool(getattr(module, "reads_target_features", False))


def rms_norm(x: Array, scale: Array, eps: float) -> Array:
    """HF's RMSNorm in float32: ``scale * x / rms(x)``."""
    x = jnp.asarray(x, jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * jnp.asarray(scale, jnp.float32)


def reduce_features(params: Params, hidden: Array, num_feature_layers: int, eps: float) -> Array:
    """``[B, T, n * H] -> [B, T, H]`` float32 (see :meth:`FeatureHead.target_features`).

    Each block's output is RMS-normalised first: the residual stream grows
    with depth, and ``reduce`` should weigh the blocks by what they say, not
    by their scale.
    """
    hidden = jnp.asarray(hidden, jnp.float32)
    if num_feature_layers == 1:
        return hidden
    kernel = params["reduce"]["kernel"]
    h = kernel.shape[-1]
    parts = hidden.reshape(hidden.shape[:-1] + (num_feature_layers, h))
    parts = parts * jax.lax.rsqrt(jnp.mean(parts * parts, axis=-1, keepdims=True) + eps)
    # One [n H, H] matmul over the flattened blocks: contracting a [n, H, H]
    # view over (n, h) instead makes XLA transpose the whole kernel on every call.
    return jnp.einsum("btk,kh->bth", parts.reshape(hidden.shape).astype(kernel.dtype), kernel,
                      preferred_element_type=jnp.float32)


@functools.lru_cache(maxsize=16)
def _param_shapes(config: ModelConfig, num_feature_layers: int = 1, variant: str = "specjax") -> Params:
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    feats = jax.ShapeDtypeStruct((1, 1, config.hidden_size), jnp.float32)
    variables = jax.eval_shape(
        lambda k, t, f: FeatureHeadModule(config, variant).init(k, t, f, t, None, None), jax.random.key(0), tokens,
        feats
    )
    params = dict(variables["params"])
    if num_feature_layers > 1:
        h = config.hidden_size
        params["reduce"] = {"kernel": jax.ShapeDtypeStruct((num_feature_layers * h, h), jnp.dtype(config.dtype))}
    if variant == "eagle":
        params[TARGET_NORM] = {"scale": jax.ShapeDtypeStruct((config.hidden_size,), jnp.dtype(config.dtype))}
    return params


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _init_params(config: ModelConfig, key: Array, num_feature_layers: int = 1, variant: str = "specjax") -> Params:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(_param_shapes(config, num_feature_layers, variant))
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, (path, leaf) in zip(keys, leaves):
        name = str(getattr(path[-1], "key", path[-1]))
        if name == "head_vocab_ids":
            out.append(jnp.arange(leaf.shape[0], dtype=leaf.dtype))
        elif name == "scale":
            out.append(jnp.ones(leaf.shape, leaf.dtype))
        elif name == "embedding":
            out.append(jnp.zeros(leaf.shape, leaf.dtype))
        else:
            out.append((INIT_STD * jax.random.normal(k, leaf.shape, jnp.float32)).astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def require_head(head, what: str) -> None:
    """A clear error where ``head`` is not a feature head (a pair, a target, a Medusa head)."""
    module = getattr(head, "module", None)
    if isinstance(module, FeatureHead):
        return
    got = type(module).__name__ if module is not None else type(head).__name__
    hint = " (a pair's head is pair.draft)" if hasattr(head, "draft") and hasattr(head, "target") else ""
    raise TypeError(f"{what} needs a feature head (specjax.load of a head directory); got a {got}{hint}.")


def _borrowed_names(module) -> set[str]:
    """The params a head takes from its target at pairing: not part of its checkpoint."""
    names = {".".join(EMBED_PATH)} if getattr(module, "borrows_embedding", True) else set()
    if getattr(module, "variant", "specjax") == "eagle":
        names |= {f"{TARGET_NORM}.scale", *BORROWED_HEAD}
    return names


def _flat(params: Params, module=None) -> dict[str, np.ndarray]:
    out = {}
    skip = _borrowed_names(module)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = ".".join(str(getattr(p, "key", p)) for p in path)
        if name in skip or name.split(".")[0] in skip:
            continue  # the target's: not part of the head's checkpoint
        out[name] = np.asarray(jax.device_get(leaf))
    return out


def save_head(head: Model, path: str, *, overwrite: bool = False, extra: Optional[dict] = None,
              weights_format: Optional[str] = None) -> None:
    """Writes ``config.json`` and ``head.safetensors`` (without the borrowed embedding).

    Stored in the head's dtype, or with ``weights_format="int8"`` the block's
    and LM head's matrices as int8 with a float16 scale per output channel
    (``"int8/32"``: per 32 inputs of one, GGUF's Q8_0) in ``NAME.qweight`` /
    ``NAME.qscale`` (:func:`specjax._src.kernels.quant.quantize_matrix`), the fusion
    layers in the head's dtype: about 60% of the bytes of bfloat16, loaded
    back as float weights in the config's dtype.
    ``extra`` adds keys to the JSON (e.g. which target it was trained for). An
    existing non-empty ``path`` is replaced only with ``overwrite=True``, and
    then whole (written aside, swapped in).
    """
    require_head(head, "save_head")
    module = head.module
    _stored_format(weights_format, "weights_format must be None (the head's dtype) or")
    if weights_format is not None and module.config.quantization is not None:
        raise ValueError("This head is quantized in memory; save its float version with weights_format=.")
    own = {} if module.variant == "specjax" else {"variant": module.variant}
    if not module.borrows_embedding:
        own["borrows_embedding"] = False
    if weights_format is not None:
        own["weights_format"] = weights_format
    meta = {CONFIG_KEY: {"config": module.config.to_dict(),
                         "feature_layers": list(module.feature_layers), **own, **(extra or {})}}
    flat = _flat(head.params, module)
    if weights_format is not None:
        flat = _stored_int8(flat, _stored_format(weights_format))

    def write(tmp: str) -> None:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(meta, f, indent=1)
        # Not safetensors' save_file, which writes mode 0600 whatever the umask:
        # a head shared between users must stay readable.
        tensors = [(name, x.shape, x.dtype, lambda x=x: x) for name, x in flat.items()]
        for _ in write_safetensors(os.path.join(tmp, WEIGHTS_FILE), tensors):
            pass

    write_directory(path, overwrite, write)


def _stored_format(weights_format: Optional[str], problem: str = "") -> Optional[quant.Format]:
    """The int8 format ``weights_format`` names (None: the head's dtype)."""
    if weights_format is None:
        return None
    try:
        fmt = quant.parse_format(weights_format)
    except ValueError:
        fmt = None
    if fmt is None or fmt.kind != "int8":
        raise ValueError(f"{problem or 'weights_format must be'} an int8 format (\"int8\": a scale per output "
                         f"channel, \"int8/32\": a scale per 32 inputs); got {weights_format!r}.")
    return fmt


def _stored_quantized(name: str, x) -> bool:
    """Whether int8 storage quantizes the param ``name``: a float matrix that
    ``specjax.quantize`` would (not the fusion layers, ``quant.FEATURE_MIXING``)."""
    return (jnp.issubdtype(x.dtype, jnp.floating)  # (NumPy's issubdtype misses bfloat16)
            and quant.quantized_role(tuple(name.split(".")), len(x.shape)) is not None)


def _stored_int8(flat: dict[str, np.ndarray], fmt: quant.Format) -> dict[str, np.ndarray]:
    """The block's and LM head's matrices as int8 rows with float16 scales
    (``fmt``), the ``[in, out]`` kernels and LM head quantized along ``in`` as
    ``specjax.quantize`` would; everything else as it is."""
    out = {}
    for name, x in flat.items():
        if not _stored_quantized(name, x):
            out[name] = x
            continue
        parts = quant.quantize_leaf(tuple(name.split(".")), np.asarray(x, np.float32), quant.Quantization(fmt, fmt))
        out.update({f"{name}.{part}": value for part, value in parts.parts().items()})
    return out


def _read_int8(tensors: dict, name: str, shape: tuple[int, ...], fmt: quant.Format, where: str) -> np.ndarray:
    """The float ``[in, out]`` matrix ``name`` that :func:`_stored_int8` wrote."""
    parts = {part: tensors.get(f"{name}.{part}") for part in ("qweight", "qscale")}
    missing = [f"{name}.{part}" for part, value in parts.items() if value is None]
    if missing:
        raise ValueError(f"{where} lacks tensor {missing[0]!r} that this int8-stored head's config needs.")
    transposed = quant.stored_transposed(tuple(name.split(".")))
    rows, cols = (shape[1], shape[0]) if transposed else shape
    groups = cols // fmt.group_of(cols)
    if parts["qweight"].shape != (rows, cols) or parts["qscale"].shape != (rows, groups) \
            or parts["qweight"].dtype != np.int8:
        raise ValueError(f"{where}: tensors {name}.qweight {parts['qweight'].dtype}{list(parts['qweight'].shape)} / "
                         f"{name}.qscale {list(parts['qscale'].shape)} do not store an int8 matrix of shape "
                         f"{list(shape)} in {fmt} (expected int8{[rows, cols]} / {[rows, groups]}).")
    w = np.asarray(quant.QArray.from_parts(parts, fmt).dequantize(jnp.float32))
    return w.T if transposed else w


def _check_vocab_ids(ids: np.ndarray, vocab_size: int, where: str) -> None:
    """A stored ``head_vocab_ids``: integer target ids in ``[0, vocab_size)``, each once."""
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{where}: head_vocab_ids holds {ids.dtype} values; it must hold the integer target ids "
                         "of the head's LM head rows.")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{where}: head_vocab_ids holds ids outside the target vocabulary [0, {vocab_size}).")
    if np.unique(ids).size != ids.size:
        raise ValueError(f"{where}: head_vocab_ids names a target id twice; each LM head row scores its own id.")


def is_head_dir(path: str) -> bool:
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        return False
    try:
        with open(cfg) as f:
            return CONFIG_KEY in json.load(f)
    except (OSError, ValueError):
        return False


def _read_meta(path: str) -> dict:
    """The ``specjax_feature_head`` object of ``path/config.json``, or an error naming what it lacks."""
    where = os.path.join(path, "config.json")
    with open(where) as f:
        meta = json.load(f)
    meta = meta.get(CONFIG_KEY) if isinstance(meta, dict) else None
    if not isinstance(meta, dict):
        raise ValueError(f"{where} has no {CONFIG_KEY!r} object; it is not a head saved by heads.save_head "
                         "(specjax.load reads published EAGLE and Medusa heads by their own layouts).")
    if not isinstance(meta.get("config"), dict):
        raise ValueError(f"{where}: {CONFIG_KEY}.config must be the head's model config (an object).")
    layers = meta.get("feature_layers", [meta.get("feature_layer", -1)])
    if not isinstance(layers, list) or not layers or not all(isinstance(x, int) and not isinstance(x, bool)
                                                             for x in layers):
        raise ValueError(f"{where}: {CONFIG_KEY}.feature_layers must be a list of int block indices; "
                         f"got {layers!r}.")
    return meta


def stored_format(path: str) -> tuple[Optional[str], str]:
    """How the head saved in ``path`` stores its block's and LM head's
    matrices (``"int8"``, ``"int8/G"``, or None: float) and its dtype."""
    meta = _read_meta(path)
    fmt = _stored_format(meta.get("weights_format"),
                         f"{path}/config.json: this version of specjax reads weights_format None or")
    return None if fmt is None else str(fmt), ModelConfig.from_dict(meta["config"]).dtype


def load_feature_head(path: str, dtype: Any = None) -> Model:
    """Loads a head saved by :func:`save_head` with float weights (an
    int8-stored head's matrices dequantized exactly); pair it with its target
    to use it. ``specjax.load`` keeps an int8-stored head's matrices int8.

    Raises:
      ValueError: missing or mismatched weights (names the tensor).
    """
    from safetensors.numpy import load_file

    meta = _read_meta(path)
    cfg = ModelConfig.from_dict(meta["config"])
    if dtype is not None:
        cfg = cfg.replace(dtype=jnp.dtype(dtype).name)
    # "feature_layer": one block, as heads saved before feature_layers were written
    layers = meta.get("feature_layers", [meta.get("feature_layer", -1)])
    module = FeatureHead(cfg, feature_layers=tuple(int(x) for x in layers), variant=meta.get("variant", "specjax"),
                         borrows_embedding=bool(meta.get("borrows_embedding", True)))
    weights_file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_file):
        raise ValueError(f"{path} has no {WEIGHTS_FILE}; a feature head directory holds config.json and it.")
    tensors = load_file(weights_file)
    flat = {}
    skip = _borrowed_names(module)
    shapes = _param_shapes(cfg, _num_feature_layers(module), module.variant)
    if not module.borrows_embedding:
        shapes = {**shapes, EMBED_PATH[0]: {EMBED_PATH[1]: jax.ShapeDtypeStruct((cfg.vocab_size, cfg.hidden_size),
                                                                              jnp.dtype(cfg.dtype))}}
    stored = _stored_format(meta.get("weights_format"),
                            f"{path}/config.json: this version of specjax reads weights_format None or")
    read = set()
    for key, leaf in traverse_util.flatten_dict(shapes).items():
        if ".".join(key) in skip or key[0] in skip:
            continue
        name = ".".join(key)
        if stored is not None and _stored_quantized(name, leaf):
            flat[key] = jnp.asarray(_read_int8(tensors, name, tuple(leaf.shape), stored, weights_file), leaf.dtype)
            read |= {f"{name}.qweight", f"{name}.qscale"}
            continue
        if name not in tensors:
            raise ValueError(f"{weights_file} lacks tensor {name!r} that this head's config needs.")
        value = tensors[name]
        if tuple(value.shape) != tuple(leaf.shape):
            raise ValueError(f"{weights_file}: tensor {name!r} has shape {value.shape}, expected {leaf.shape}.")
        if name == "head_vocab_ids":
            _check_vocab_ids(value, cfg.vocab_size, weights_file)
        flat[key] = jnp.asarray(value, leaf.dtype)
        read.add(name)
    extra = sorted(set(tensors) - read)
    if extra:
        raise ValueError(f"{weights_file} holds tensor(s) {extra[:5]} that this head's config does not use; it was "
                         "written for another layout (a head saved by heads.save_head holds only its own).")
    params = traverse_util.unflatten_dict(flat)
    return Model(params=params, module=module, tokenizer=load_tokenizer(path), chat_template=None)
