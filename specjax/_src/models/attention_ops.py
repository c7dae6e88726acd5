"""The pure functions attention layers share: rotary embeddings (RoPE, with Llama 3,
linear or YaRN scaling), causal masks, attention over a prefix of a preallocated KV
cache, and cache writes.

:mod:`~specjax._src.models.decoder`'s attention and
:mod:`~specjax._src.models.latent_attention`'s multi-head latent attention both
build on them (the decoder module re-exports every public name here).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.kernels import platforms
from specjax._src.models.config import ModelConfig
from specjax._src.models.lm import Array


def rope_inv_freq(config: ModelConfig, layer: Optional[int] = None) -> np.ndarray:
    """Inverse RoPE frequencies ``[rope_dim // 2]`` float32, Llama 3, linear or YaRN scaling applied
    (``config.rope_dim``: ``head_dim``, or the rotated part of a latent-attention head).

    Computed on the host with NumPy (a compile-time constant), in float32 like
    Hugging Face's reference so that angles agree to the last bit or two.
    With ``layer``, that layer's: a sliding layer of a config with
    ``rope_local_theta`` (Gemma 3) uses that base, unscaled.
    """
    dim = config.rope_dim
    theta, scaling = config.rope_theta, config.rope_scaling
    if (
        layer is not None
        and config.rope_local_theta is not None
        and config.layer_types
        and config.layer_types[layer] == "sliding_attention"
    ):
        theta, scaling = config.rope_local_theta, None
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":  # positions interpolated: every angle divided by `factor`
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(np.float32(theta) ** exponents, dim, float(theta), scaling)
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, and blend
    # linearly in between (the reference's `_compute_llama3_parameters`).
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(wavelengths: np.ndarray, dim: int, theta: float, scaling) -> np.ndarray:
    """YaRN's frequencies (arXiv:2309.00071), as transformers' ``_compute_yarn_parameters``:
    frequencies below the ramp divided by ``factor`` (interpolated), above it kept
    (extrapolated), linearly blended across it; all in float32 as the reference."""

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return (
            dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        )

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolated = (1 - ramp).astype(np.float32)  # each frequency's share kept as it is
    kept = (np.float32(1.0) / wavelengths).astype(np.float32)
    interpolated = (np.float32(1.0) / (np.float32(scaling.factor) * wavelengths)).astype(np.float32)
    return (interpolated * (1 - extrapolated) + kept * extrapolated).astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling) -> float:
    """What cos and sin are multiplied by (YaRN's ``attention_factor``; 1 for other scalings)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


# Longest table of rotary sines/cosines embedded as a constant (rows x D/2 x 2
# float32: 4 MiB at head_dim 128); longer caches compute them on the fly.
_ROPE_TABLE_MAX_ROWS = 4096


@functools.lru_cache(maxsize=32)
def _rope_table(num_positions: int, inv_freq: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    # float32 angles then float32 cos/sin: the same arithmetic as the on-device path.
    angles = np.arange(num_positions, dtype=np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None]
    return np.cos(angles), np.sin(angles)


def rope_cos_sin(positions: Array, inv_freq: np.ndarray, num_positions: Optional[int] = None) -> tuple[Array, Array]:
    """``cos, sin`` of the rotary angles, each ``[B, T, 1, D/2]`` float32.

    With ``num_positions`` (a static bound: every position is below it, e.g.
    the cache length) and at most ``_ROPE_TABLE_MAX_ROWS`` of them, rows are
    gathered from a table computed once on the host. Computed on device
    instead, XLA's CPU backend fuses the sines and cosines into every consumer
    and evaluates them once per head and per half of ``x``: a third of a
    5-token, batch-32 forward.
    """
    if num_positions is not None and num_positions <= _ROPE_TABLE_MAX_ROWS:
        cos_table, sin_table = _rope_table(int(num_positions), tuple(np.asarray(inv_freq, np.float32).tolist()))
        cos, sin = jnp.asarray(cos_table)[positions], jnp.asarray(sin_table)[positions]
    else:
        angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [B, T, D/2]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
    return cos[:, :, None, :], sin[:, :, None, :]


def rotate(x: Array, cos: Array, sin: Array) -> Array:
    """Rotates ``x[B, T, N, D]`` by precomputed ``cos, sin`` (rotate-half convention)."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def apply_rope(x: Array, positions: Array, inv_freq: np.ndarray) -> Array:
    """Rotates ``x[B, T, N, D]`` by ``positions[B, T]`` (rotate-half convention).

    Angles, sines and cosines are computed in float32, then the result is cast
    back to ``x.dtype``.
    """
    return rotate(x, *rope_cos_sin(positions, inv_freq))


def attention_mask(q_pos: Array, kv_len: int, sliding_window: Optional[int]) -> Array:
    """``[B, T, S]`` bool: query at absolute position ``q_pos[b, t]`` may see key ``s``."""
    kv_pos = jnp.arange(kv_len, dtype=jnp.int32)[None, None, :]
    q = q_pos[:, :, None]
    mask = kv_pos <= q
    if sliding_window is not None:
        # The reference (HF `sliding_window_overlay`) keeps `kv > q - window`:
        # the query itself and the `window - 1` positions before it.
        mask &= kv_pos > q - sliding_window
    return mask


def grouped_attention(
    q: Array, k: Array, v: Array, mask: Array, scale: float, softcap: Optional[float] = None,
    sinks: Optional[Array] = None,
) -> Array:
    """Multi-head attention with grouped key/value heads.

    Args:
      q: ``[B, T, N, D]`` queries.
      k, v: ``[B, K, S, D]`` keys and values, heads-major (the cache layout),
        ``N % K == 0``.
      mask: ``[B, T, S]`` bool.
      scale: multiplies the scores.
      softcap: if set, scores become ``softcap * tanh(scores / softcap)``
        after scaling, before masking (Gemma 2).
      sinks: ``[N]`` attention sinks (gpt-oss), or None: head ``n``'s logit joins
        every query's softmax as one more key without a value, so the weights
        of the real keys sum to less than 1 (``softmax_with_sinks``).

    Returns:
      ``[B, T, N * D]`` in ``v.dtype``. Scores and softmax run in float32.
    """
    b, t, n, d = q.shape
    kv_heads = k.shape[1]
    # Group query heads by their kv head instead of repeating k/v (no copy).
    # Heads-major k/v make both dots plain batched matmuls over (b, k): with
    # [B, S, K, D] buffers XLA transposed the whole cache before every dot,
    # 60% of a batch-32 decode step on CPU.
    # The small q / output tensors are transposed to heads-major outside the
    # dots: a dot whose output must come out [b, t, k, g, d] ran 4x slower for
    # a 5-token block on CPU.
    q = q.reshape(b, t, kv_heads, n // kv_heads, d).transpose(0, 2, 3, 1, 4)
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    else:  # query head n = kv head * G + g, as the reshape above groups them
        probs = softmax_with_sinks(scores, sinks.reshape(kv_heads, n // kv_heads)[None, :, :, None, None]).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n * d)


def softmax_with_sinks(scores: Array, sinks: Array) -> Array:
    """``softmax([scores, sink])`` over the last axis with the sink's column dropped:
    ``exp(s_j) / (sum_i exp(s_i) + exp(sink))`` (gpt-oss's attention sinks, as
    transformers' ``eager_attention_forward`` computes them, in float32).

    ``scores``: ``[..., S]``; ``sinks``: broadcastable to ``scores[..., :1]``.
    """
    sinks = jnp.broadcast_to(sinks.astype(jnp.float32), scores.shape[:-1] + (1,))
    return jax.nn.softmax(jnp.concatenate([scores, sinks], axis=-1), axis=-1)[..., :-1]


# A cache with fewer slots than 4/3 of this is read whole: a narrower read
# would save too little to be worth compiled branches (256 positions of K and
# V are a few percent of a one-row step's weight bytes for the models specjax
# runs; every short-capacity ``decode`` and test program keeps one branch).
_LADDER_FROM = 256
# A longer cache (a server's slots) is read in steps of this many slots up to
# ``_LADDER_FROM``, then at 1.5 and 2 times each power of two. Eight rows of a
# 4-token verify block read 1.5 MB of K and V per layer at 256 slots: on a
# 2-core CPU the slots engine's cycle on SmolLM2-135M at T=0.7 (384 slots, rows
# at 40-170 positions) cost 1.05x [1.03-1.07] the cycle of ``decode`` with its
# 195-slot cache when it read 256 slots, 1.00x [0.98-1.13] with these steps
# (``benchmarks/serve_programs.py``). Past 256 a doubling ladder read up to
# twice the slots needed, and attention is no small part of a step on a CPU:
# one token of the GGUF's 4-bit SmolLM2-135M over 250 cached entries cost 15.9
# ms reading 256 slots and 20.1 ms reading the server's whole 516. On TPU,
# whose lanes hold 128, the widths 64 and 192 are expected to run padded to 128
# and 256: a branch that saves nothing there, not a wrong result (unmeasured:
# no TPU was at hand).
_ATTENTION_STEP = 64


def attention_widths(capacity: int) -> tuple[int, ...]:
    """The static key widths :func:`cache_attention` may read from ``capacity`` slots.

    ``(capacity,)`` below 342 slots. From 342 on, multiples of 64 up to 256,
    then 1.5 and 2 times each power of two (384, 512, 768, 1024, ...), each
    saving at least a quarter of the capacity, then the capacity itself:
    ``(64, 128, 192, 256, 384)`` for 384, ``(64, 128, 192, 256, 384, 516)``
    for 516, ``(64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)`` for
    2048. Below the last, a width depends on the positions needed only, so a
    short sequence reads the same slots in any long cache.
    """
    capacity = int(capacity)
    if 4 * _LADDER_FROM > 3 * capacity:
        return (capacity,)
    widths = []
    width = _ATTENTION_STEP
    while 4 * width <= 3 * capacity:
        widths.append(width)
        if width < _LADDER_FROM:
            width += _ATTENTION_STEP
        else:  # 256 -> 384 -> 512 -> 768 -> 1024: up to 1.5 times the slots needed, not 2
            width = width * 3 // 2 if width & (width - 1) == 0 else width * 4 // 3
    return tuple(widths) + (capacity,)


def attention_width_index(capacity: int, lengths: Array, num_new: int) -> Array:
    """Which of :func:`attention_widths` ``(capacity)`` holds every row's
    ``lengths[b] + num_new`` positions: an int32 scalar, the same for the
    whole batch (the longest row decides; 0 where there is one width).
    Past the capacity (which ``specjax.decode`` rules out before tracing) it
    names the capacity, the whole buffer, as a full read would.
    """
    widths = attention_widths(capacity)
    needed = jnp.max(lengths).astype(jnp.int32) + num_new
    narrower = jnp.sum(jnp.asarray(widths[:-1], jnp.int32) < needed).astype(jnp.int32)
    return narrower  # widths[narrower] is the first width >= needed, else the capacity


# Where ``attention_reads="auto"`` reads a prefix: the platforms on which a
# conditional is a branch on the device (not on GPUs; see cache_attention).
_PREFIX_READ_PLATFORMS = ("cpu", "tpu")
ATTENTION_READS = ("auto", "prefix", "whole")


def check_attention_reads(mode: str) -> None:
    if mode not in ATTENTION_READS:
        raise ValueError(
            f"attention_reads must be one of {ATTENTION_READS}, got {mode!r}: 'auto' reads the "
            "needed cache prefix on CPU and TPU and the whole buffer on GPUs."
        )


def cache_attention(
    q: Array,
    keys: Array,
    values: Array,
    mask_at,
    scale: float,
    width_index: Optional[Array],
    reads: str = "auto",
    softcap: Optional[float] = None,
    sinks: Optional[Array] = None,
) -> Array:
    """:func:`grouped_attention` over the first ``attention_widths(S)[width_index]``
    slots of ``keys, values`` ``[R, K, S, D]`` (their first ``B`` rows, those of
    ``q [B, ...]``; cast to ``q``'s dtype); ``mask_at(width)`` gives the
    ``[B, T, width]`` mask. Every slot past that width is masked for every
    query (the index holds the batch's longest row), so the output is the
    full read's: masked slots only add exact zeros. ``reads``: ``"prefix"``
    on every platform, ``"whole"`` never (every slot, as with no index),
    ``"auto"`` on CPU and TPU only. ``softcap``, ``sinks``: as in
    :func:`grouped_attention`, at every width.

    Why a ``lax.switch`` per layer that only reads (the cache is written
    before it): XLA copies a buffer that a conditional's branch updates in
    place, so one switch around the whole forward, whose blocks write the
    cache, copied the whole 2048-slot cache on every step; a loop over cache
    chunks with an online softmax would round differently from one softmax
    (and a sequence's tokens would depend on the chunking). On CPU and TPU a
    conditional is a branch on the device. XLA's GPU runtime copies the
    branch index to the host and waits for the stream before running a
    branch, draining the queue of launched kernels once per layer and step;
    at batch 1 that is expected to cost more than a short cache saves, so
    with ``"auto"`` GPUs read the whole buffer (``benchmarks/accelerator.py``
    measures both on a GPU).
    """
    capacity, rows = keys.shape[2], q.shape[0]
    widths = attention_widths(capacity)

    def at(width: int):
        def run(q, keys, values):
            # One slice for the rows and the width: the buffers may hold more rows than the batch
            # (write_cache), and a slice is copied, so only what is read is.
            if width < capacity or keys.shape[0] != rows:
                keys, values = keys[:rows, :, :width], values[:rows, :, :width]
            keys, values = keys.astype(q.dtype), values.astype(q.dtype)
            return grouped_attention(q, keys, values, mask_at(width), scale, softcap, sinks)

        return run

    if width_index is None or reads == "whole":
        return at(capacity)(q, keys, values)
    if len(widths) == 1:
        return platforms.platform_dependent(q, keys, values, default=at(capacity), cpu=_in_a_conditional(
            at(capacity), width_index))

    def prefix(q, keys, values):
        return jax.lax.switch(width_index, [at(w) for w in widths], q, keys, values)

    if reads == "prefix":
        return prefix(q, keys, values)
    branches = {platform: prefix for platform in _PREFIX_READ_PLATFORMS}
    return platforms.platform_dependent(q, keys, values, default=at(capacity), **branches)


def _in_a_conditional(attend, width_index: Array):
    """``attend`` run as both branches of a conditional (``width_index`` is 0, traced).

    Why, on the CPU: in the computation that writes the cache, XLA fuses the
    write into the fusion that lays out the attention dot's operand, beside the
    write kept for the cache itself, and copies the whole buffer to update it in
    place twice: four copies of the value cache per layer and step (120 for
    SmolLM2-135M, a 256-slot cache). A conditional's operands are buffers the
    write has finished, so the attention reads the value cache where it lies, as
    the width ladder's branches already did (the key cache is still transposed
    for the score dot, once, as in those branches).
    ``generate`` on the GGUF's 4-bit SmolLM2-135M took 0.94-0.96 of the time a
    token it took with the read straight after the write (``benchmarks/one_width_read.py``,
    10 alternating rounds, 2-core AMD EPYC VM).
    """

    def run(q, keys, values):
        # the index is a constant here: behind the barrier XLA cannot fold the conditional away
        return jax.lax.cond(jax.lax.optimization_barrier(width_index) == 0, attend, attend, q, keys, values)

    return run


def write_cache(buffer: Array, new: Array, offsets: Array) -> Array:
    """Writes ``new[b]`` (``[K, T, D]``) into ``buffer[b]`` (``[K, S, D]``) at ``offsets[b]``.

    ``buffer`` may hold more rows than ``new`` (``[R, K, S, D]``, ``R >= B``):
    its first ``B`` rows are written, each in place, and the rest kept. The
    slots engine steps its leading rows over its whole caches this way, so
    that a step copies no cache rows in or out (each row a dynamic update, as
    the ``vmap`` of a batch's own buffer is).
    """

    def one(buf, upd, off):
        return jax.lax.dynamic_update_slice(buf, upd.astype(buf.dtype), (0, off, 0))

    rows = new.shape[0]
    if buffer.shape[0] == rows:
        return jax.vmap(one)(buffer, new, offsets)

    def row(b, buf):
        upd = jax.lax.dynamic_index_in_dim(new, b, keepdims=True).astype(buf.dtype)
        return jax.lax.dynamic_update_slice(buf, upd, (b, 0, offsets[b], 0))

    if rows <= 8:  # unrolled: a few updates, no loop per layer
        for b in range(rows):
            buffer = row(b, buffer)
        return buffer
    return jax.lax.fori_loop(0, rows, row, buffer)
