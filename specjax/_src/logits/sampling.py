"""Sampling warps shared by the target, the draft and the baseline.

Speculative sampling is lossless only if ``p`` and ``q`` are warped the same
way, so every model's logits go through :func:`warp_logits` with the same
settings: temperature first, then top-k, then top-p (the order Hugging Face
uses). Filtered tokens get ``-inf``.

Temperature 0 means greedy: no warp at all (:func:`warp_logits` is not called;
tokens are the argmax of the raw logits, and rules see ``softmax(raw)``).

``top_k`` is a static Python int (it fixes the shape of ``lax.top_k``);
``temperature`` and ``top_p`` may be traced scalars, so changing them does not
recompile the decode loop.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from specjax._src.foundation.checks import check_positive_int

Array = jax.Array


def apply_top_k(logits: Array, top_k: int) -> Array:
    """Keeps the ``top_k`` largest logits of the last axis (ties with the k-th kept)."""
    vocab = logits.shape[-1]
    if top_k >= vocab:
        return logits
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    return jnp.where(logits < kth, -jnp.inf, logits)


def apply_top_k_rows(logits: Array, top_k: Array) -> Array:
    """:func:`apply_top_k` with a traced ``k`` per row (``top_k`` broadcasts
    against ``logits[..., :1]``; 0 keeps every token). The k-th largest logit
    comes from a sort, so the kept set is :func:`apply_top_k`'s."""
    vocab = logits.shape[-1]
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]
    k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), logits.shape[:-1] + (1,))
    kth = jnp.take_along_axis(ordered, jnp.clip(k - 1, 0, vocab - 1), axis=-1)
    return jnp.where((k > 0) & (k < vocab) & (logits < kth), -jnp.inf, logits)


def apply_top_p(logits: Array, top_p) -> Array:
    """Nucleus filter: keeps the smallest set of most likely tokens whose mass is
    ``>= top_p`` (ties with its least likely member kept).

    A token is kept iff the mass of the strictly more likely tokens (in sorted
    order) is below ``top_p``, so the most likely token is always kept.
    """
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep = mass_before < top_p
    num_keep = jnp.maximum(keep.sum(-1, keepdims=True), 1)
    threshold = jnp.take_along_axis(sorted_logits, num_keep - 1, axis=-1)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def warp_logits(
    logits: Array,
    temperature,
    top_k: Optional[int] = None,
    top_p=None,
) -> Array:
    """Temperature, then top-k, then top-p over the last axis; float32 out.

    Args:
      logits: ``[..., V]`` raw logits.
      temperature: positive scalar (Python or traced). Greedy decoding never
        calls this.
      top_k: static int or None.
      top_p: scalar in (0, 1] (Python or traced), or None for no nucleus filter.
    """
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        logits = apply_top_k(logits, int(top_k))
    if top_p is not None:
        logits = apply_top_p(logits, top_p)
    return logits


def uniform_open(key: Array, shape) -> Array:
    """Uniform draws in ``[tiny, 1)`` (safe for ``log``)."""
    return jax.random.uniform(key, shape, jnp.float32, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)


# Two-level reductions over the vocabulary: blocks of this many entries.
_BLOCK = 64


def _blocked(x: Array, fill) -> Array:
    """``[..., V]`` -> ``[..., ceil(V / _BLOCK), _BLOCK]``, padded with ``fill``."""
    v = x.shape[-1]
    nb = -(-v // _BLOCK)
    pad = nb * _BLOCK - v
    if pad:
        x = jnp.concatenate([x, jnp.full(x.shape[:-1] + (pad,), fill, x.dtype)], axis=-1)
    return x.reshape(x.shape[:-1] + (nb, _BLOCK))


def _take_last(x: Array, index: Array) -> Array:
    """``x[..., index]`` for ``index[...]``."""
    return jnp.take_along_axis(x, index[..., None], axis=-1)[..., 0]


def argmax(x: Array) -> Array:
    """``jnp.argmax(x, -1)``: the first maximum, int32 (a NaN counts as ``+inf``).

    Two levels (the block holding the maximum, then inside it): XLA's CPU
    backend lowers a vocabulary-wide ``argmax`` to a slow variadic reduction,
    2-3x the cost of these plain ones.
    """
    blocks = _blocked(x, -jnp.inf)  # [..., nb, B]
    # A plain max does not reliably propagate NaN on CPU: map it to +inf first.
    block = jnp.argmax(jnp.where(jnp.isnan(blocks), jnp.inf, blocks).max(-1), axis=-1)
    row = jnp.take_along_axis(blocks, block[..., None, None], axis=-2)[..., 0, :]
    return (block * _BLOCK + jnp.argmax(row, axis=-1)).astype(jnp.int32)


def top_indices(x: Array, k: int) -> Array:
    """``[..., k]`` int32 indices of the ``k`` largest entries over the last axis,
    in descending order (ties: the lower index first), like ``lax.top_k``'s.

    For small ``k`` this is ``k`` masked :func:`argmax` passes: XLA's CPU
    ``top_k`` sorts the whole row, many times slower on a vocabulary-wide row.
    """
    if k > 8:
        return jax.lax.top_k(x, k)[1].astype(jnp.int32)
    # Masked (-inf) tokens rank last but stay pickable, so the k picks are
    # distinct as top_k's are. Written without a pass over a constant mask:
    # XLA constant-folds such a pass at length B * V (seconds of compile time).
    x = jnp.where(x == -jnp.inf, jnp.finfo(jnp.float32).min, x.astype(jnp.float32))
    iota = jnp.arange(x.shape[-1], dtype=jnp.int32)
    picked = []
    for _ in range(k):
        index = argmax(x)
        picked.append(index)
        x = jnp.where(iota == index[..., None], -jnp.inf, x)
    return jnp.stack(picked, -1)


def sample_categorical(probs: Array, u: Array) -> Array:
    """One draw per row by inverse CDF: the first token whose cumulative mass
    exceeds ``u * total``.

    Args:
      probs: ``[..., V]`` non-negative weights (need not sum to one).
      u: ``[...]`` Uniform[0, 1) draws, one per row.

    Returns:
      ``[...]`` int32 tokens. A zero-weight token is never drawn: its
      cumulative sum equals its predecessor's, so the search skips it, and a
      search that rounding carries past the end stops at the last positive
      weight.

    One uniform per token instead of the ``V`` a Gumbel-max draw needs (the
    PRNG dominated sampling on CPU); the search is two-level (block masses,
    then one block) so no vocabulary-wide cumulative sum is formed.
    """
    blocks = _blocked(probs.astype(jnp.float32), 0.0)  # [..., nb, B]
    mass = blocks.sum(-1)  # [..., nb]
    cum = jnp.cumsum(mass, axis=-1)
    target = u.astype(jnp.float32) * cum[..., -1]
    nb = mass.shape[-1]
    last_block = jnp.max(jnp.where(mass > 0, jnp.arange(nb), 0), axis=-1)
    block = jnp.minimum((cum <= target[..., None]).sum(-1), last_block)
    before = jnp.where(block > 0, _take_last(cum, jnp.maximum(block - 1, 0)), 0.0)
    row = jnp.take_along_axis(blocks, block[..., None, None], axis=-2)[..., 0, :]  # [..., B]
    last_in_row = jnp.max(jnp.where(row > 0, jnp.arange(_BLOCK), 0), axis=-1)
    inner = jnp.minimum((jnp.cumsum(row, axis=-1) <= (target - before)[..., None]).sum(-1), last_in_row)
    return (block * _BLOCK + inner).astype(jnp.int32)


def entropy(probs: Array) -> Array:
    """Shannon entropy in nats over the last axis (``0 log 0 = 0``)."""
    return jax.scipy.special.entr(probs).sum(-1)


def nonfinite_rows(logits: Array) -> Array:
    """True where a row of raw logits holds a NaN or ``+inf``, or is all ``-inf``.

    ``-inf`` entries alone are legitimate (masked tokens); a row with no
    finite entry is not a distribution. One reduction: with NaN mapped to
    ``+inf`` (a plain max does not reliably propagate NaN on CPU), the row
    maximum is infinite exactly in those cases.
    """
    return ~jnp.isfinite(jnp.max(jnp.where(jnp.isnan(logits), jnp.inf, logits), axis=-1))


def check_sampling_args(temperature, top_k, top_p) -> None:
    """Raises ``ValueError`` for settings no warp can honour."""
    try:
        temperature = float(temperature)
    except TypeError as e:  # pragma: no cover - defensive
        raise TypeError(f"temperature must be a number, got {temperature!r}") from e
    # NaN fails both tests; inf would turn a masked (-inf) logit into NaN and
    # every token into 0, or flatten the distribution and void top-k / top-p.
    if not (temperature >= 0.0 and math.isfinite(temperature)):
        raise ValueError(
            f"temperature must be a finite number >= 0 (0 means greedy), got {temperature}."
        )
    if top_k is not None:
        check_positive_int("top_k (or None)", top_k)
    if top_p is not None:
        if not (0.0 < float(top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}.")
