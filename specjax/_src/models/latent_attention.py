"""Multi-head latent attention (MLA): DeepSeek-V2/V3's attention (``model_type`` ``deepseek_v3``).

"DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language
Model" (arXiv:2405.04434), section 2.1. Keys and values are decompressed from a
``kv_lora_rank``-wide latent of each token; each head's query and key are
``qk_nope_head_dim`` features without position then ``qk_rope_head_dim``
rotated ones, and the key's rotated part is one head shared by all the heads.
The math is transformers' ``DeepseekV3Attention`` (what the tests compare with).

The cache is the "naive" one, as transformers' own: per-head keys ``[nope |
rope]`` and values zero-padded from ``v_head_dim`` to the same width, so the
``[B, num_heads, S, qk_nope_head_dim + qk_rope_head_dim]`` buffers of every
other layout hold them and the engine's cache handling (slots, prefix cache,
trees, sharding) is unchanged. The compressed latent cache (``kv_lora_rank +
qk_rope_head_dim`` per token, the paper's memory saving) is not built.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp

from specjax._src.models.attention_ops import (
    attention_mask,
    cache_attention,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
    rotate,
    write_cache,
    yarn_mscale,
)
from specjax._src.models.config import ModelConfig
from specjax._src.models.layers import RMSNorm, dense
from specjax._src.models.lm import Array

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default
# epsilon, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def deinterleave(x: Array) -> Array:
    """``[..., (x0, x1), (x2, x3), ...]`` -> ``[..., x0, x2, ..., x1, x3, ...]``: DeepSeek's
    interleaved rotary pairs in the halves layout :func:`rotate` turns (transformers'
    ``apply_rotary_pos_emb_interleave`` is this, then rotate-half)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def softmax_scale(config: ModelConfig) -> float:
    """``(qk_nope + qk_rope) ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2``
    under YaRN scaling with ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "yarn" and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


class LatentAttention(nn.Module):
    """:class:`~specjax._src.models.decoder.Attention`'s call and return, computed as
    multi-head latent attention. Params: ``q`` (or ``q_a``, ``q_a_norm``, ``q_b``),
    ``kv_a``, ``kv_a_norm``, ``kv_b``, ``o``; kernels ``[in, out]``."""

    config: ModelConfig
    matmul: str = "auto"
    attention_reads: str = "auto"
    layer: int = 0

    @nn.compact
    def __call__(self, x, positions, kv_cache, lengths, mask=None, width_index=None):
        cfg = self.config
        b, t, _ = x.shape
        n, nope, rope, vd = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        d = nope + rope
        dtype = jnp.dtype(cfg.dtype)
        if cfg.q_lora_rank is None:
            q = dense(cfg, n * d, False, "q", self.matmul)(x)
        else:
            q = dense(cfg, cfg.q_lora_rank, cfg.attention_bias, "q_a", self.matmul)(x)
            q = RMSNorm(LATENT_NORM_EPS, dtype, name="q_a_norm")(q)
            q = dense(cfg, n * d, False, "q_b", self.matmul)(q)
        q = q.reshape(b, t, n, d)
        compressed = dense(cfg, cfg.kv_lora_rank + rope, cfg.attention_bias, "kv_a", self.matmul)(x)
        latent, k_rope = compressed[..., : cfg.kv_lora_rank], compressed[..., cfg.kv_lora_rank :]
        latent = RMSNorm(LATENT_NORM_EPS, dtype, name="kv_a_norm")(latent)
        kv = dense(cfg, n * (nope + vd), False, "kv_b", self.matmul)(latent).reshape(b, t, n, nope + vd)
        k_nope, v = kv[..., :nope], kv[..., nope:]

        bound = t if kv_cache is None else kv_cache[0].shape[2]  # every position indexes the cache
        cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg, self.layer), bound)
        factor = rope_attention_factor(cfg.rope_scaling)
        if factor != 1.0:  # YaRN's attention factor scales cos and sin (the rotated features only)
            cos, sin = cos * factor, sin * factor
        q_rope, k_rope = q[..., nope:], k_rope[:, :, None, :]  # one rotated key head, shared
        if cfg.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q = jnp.concatenate([q[..., :nope], rotate(q_rope, cos, sin)], axis=-1)
        k_rope = jnp.broadcast_to(rotate(k_rope, cos, sin), (b, t, n, rope))
        k = jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1)
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, d - vd)))  # the cache's one width

        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # heads-major [B, N, T, D]
        if kv_cache is None:
            keys, values, new_cache = k, v, None
        else:
            keys = write_cache(kv_cache[0], k, lengths)
            values = write_cache(kv_cache[1], v, lengths)
            new_cache = (keys, values)
        if mask is None:  # a chain: causal by position
            mask_at = functools.partial(attention_mask, positions, sliding_window=None)
        else:
            mask_at = lambda width: mask[:, :, :width]  # noqa: E731
        out = cache_attention(
            q,
            keys,
            values,
            mask_at,
            softmax_scale(cfg),
            None if kv_cache is None else width_index,
            self.attention_reads,
        )
        out = out.reshape(b, t, n, d)[..., :vd].reshape(b, t, n * vd)  # the padding's zeros dropped
        out = dense(cfg, cfg.hidden_size, cfg.attention_out_bias, "o", self.matmul)(out)
        return out, new_cache
