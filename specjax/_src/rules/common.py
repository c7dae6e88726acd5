"""Small pure helpers shared by the rules (argument checks: ``specjax._src.foundation.checks``).

Shapes are per sequence: ``K`` draft slots, vocabulary ``V``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax._src.logits import sampling
from specjax._src.rules.base import Path, VerifyInputs, lossless_decision, token_prob

Array = jax.Array


# --------------------------------------------------------------------------- paths


def paths(accept: Array, exact: Array, relaxed_code: Path) -> Array:
    """``[K]`` int32 path codes: EXACT where the lossless test accepts too,
    ``relaxed_code`` where only the relaxed criterion accepts, else REJECTED."""
    code = jnp.where(exact, Path.EXACT, relaxed_code)
    return jnp.where(accept, code, Path.REJECTED).astype(jnp.int32)


def lossless_accept(inputs: VerifyInputs, *, greedy: bool) -> Array:
    """``[K]`` bool: would standard speculative sampling accept (same uniforms)?"""
    return lossless_decision(inputs, greedy=greedy)[0]


# --------------------------------------------------------------------- statistics


def token_logit(logits: Array, tokens: Array) -> Array:
    """``logits[k, tokens[k]]`` for the first ``K`` rows of ``logits[>=K, V]``."""
    return token_prob(logits, tokens)


def token_rank(logits: Array, tokens: Array) -> Array:
    """``[K]`` int32: how many tokens score strictly higher than the draft token.

    ``rank < m`` means "in the top-m", counting ties generously (a token tied
    with the m-th is in). Ranking by logits rather than probabilities avoids
    ties manufactured by softmax underflow.
    """
    k = tokens.shape[0]
    z = logits[:k]
    z_x = token_logit(z, tokens)
    return jnp.sum(z > z_x[:, None], axis=-1).astype(jnp.int32)


def largest_values(logits: Array, m: int) -> Array:
    """``[..., m]`` the m largest values over the last axis, descending (ties repeat).

    Same values as ``jax.lax.top_k(logits, m)[0]``, computed as m masked
    maxima: XLA's CPU top_k sorts the whole row and made MARS ~9x slower per
    decode cycle than the lossless rule on a 2048-token vocabulary. For the
    small m of verification rules, O(m V) reductions are cheaper; large m keeps
    top_k.
    """
    if m > 8:
        return jax.lax.top_k(logits, m)[0]
    iota = jnp.arange(logits.shape[-1])
    values = []
    remaining = logits
    for _ in range(m):
        index = jnp.argmax(remaining, -1)
        values.append(jnp.take_along_axis(remaining, index[..., None], -1)[..., 0])
        remaining = jnp.where(iota == index[..., None], -jnp.inf, remaining)
    return jnp.stack(values, -1)


# One entropy for the library (the drafting policies, the rules and the theory
# module all read this one).
entropy = sampling.entropy


def js_distance(p: Array, q: Array) -> Array:
    """Jensen-Shannon distance ``sqrt(JSD(p, q))`` with base-2 logs, in [0, 1].

    Works over the last axis. Zero-probability entries contribute nothing
    (``xlogy``), so masked (top-k / top-p) vocabularies are fine.
    """
    m = 0.5 * (p + q)

    def kl_to_m(a):
        # sum a * log(a / m); where a > 0, m >= a / 2 > 0, so no 0 division.
        return jnp.sum(jax.scipy.special.xlogy(a, a) - jax.scipy.special.xlogy(a, m), axis=-1)

    jsd = 0.5 * (kl_to_m(p) + kl_to_m(q)) / jnp.log(2.0)
    # Rounding can push JSD a hair outside [0, 1]; clip before the sqrt.
    return jnp.sqrt(jnp.clip(jsd, 0.0, 1.0))


def restricted_distribution(probs: Array, mask: Array) -> Array:
    """``probs`` restricted to ``mask`` and renormalised; ``probs`` where the
    mask holds no mass (keeps every row a valid distribution)."""
    kept = jnp.where(mask, probs, 0.0)
    total = kept.sum(-1, keepdims=True)
    return jnp.where(total > 1e-12, kept / jnp.maximum(total, 1e-30), probs)
