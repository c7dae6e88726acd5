"""Deterministic acceptance criteria: accepted sets that are upper level sets of p.

These are the rules of acceptance-theory-summary.txt (and vLLM's typical
acceptance). Each decides from the target alone — whether ``p(x)`` is high
enough — and ignores ``q`` and the uniforms (which only serve to label a path).

Shared conventions (:func:`criterion`):

* Greedy: ``p`` is the target's T=1 distribution ``softmax(raw logits)``;
  correction ``argmax p``.
* Sampling: ``p`` is the warped distribution; correction ``p`` restricted to
  the accepted set ``A`` and renormalised (``p`` itself if ``A`` holds no mass).
  Why not the residual: these rules do not preserve ``p`` anyway, and the
  residual ``p - q`` can put mass on tokens the rule itself would reject.
  Drawing from ``p`` restricted to ``A`` keeps every emitted token inside the
  rule's notion of an acceptable token, and at the strict limits
  (``t = 0``, ``alpha = 1``, ``m = 1``) makes the correction ``argmax p``, so
  those limits are greedy verification at any temperature.
* Paths: ``EXACT`` where the lossless test (greedy: ``x == argmax p``;
  sampling: ``U <= p/q`` with the same ``U``) accepts too, else ``RELAXED``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from specjax._src.rules import common
from specjax._src.rules.base import (
    AcceptanceRule,
    Path,
    RuleSpec,
    Verdict,
    VerifyInputs,
    no_state,
    one_hot_argmax,
    stateless_update,
)

Array = jax.Array

# (target_logits [K, V], target_probs [K, V]) -> accepted set mask [K, V]
AcceptedSet = Callable[[Array, Array], Array]


def criterion(accepted_set: AcceptedSet, *, name: str, params: tuple = ()) -> AcceptanceRule:
    """A stateless deterministic rule from its accepted-set function.

    Args:
      accepted_set: ``(logits[K, V], probs[K, V]) -> bool[K, V]``, which target
        tokens are acceptable at each slot (the target's first ``K`` rows). The
        draft token is accepted iff it is in the set.
      name, params: the rule's :class:`RuleSpec`.

    Conventions (corrections, paths): see this module's docstring.
    """

    def verify(inputs: VerifyInputs, state, *, greedy: bool) -> Verdict:
        del state
        k = inputs.draft_tokens.shape[0]
        logits, probs = inputs.target_logits[:k], inputs.target_probs[:k]
        allowed = accepted_set(logits, probs)
        accept = jnp.take_along_axis(allowed, inputs.draft_tokens[:, None], -1)[:, 0]
        exact = common.lossless_accept(inputs, greedy=greedy)
        if greedy:
            correction = one_hot_argmax(logits)
        else:
            correction = common.restricted_distribution(probs, allowed)
        return Verdict(accept, common.paths(accept, exact, Path.RELAXED), correction)

    return AcceptanceRule(
        init=no_state, verify=verify, update=stateless_update, spec=RuleSpec(name, params)
    )


def typical_set(logits: Array, probs: Array, eps: float, delta: float) -> Array:
    """``p(y) > min(eps, delta * exp(-H(p)))``, ``H`` in nats (as vLLM)."""
    del logits
    threshold = jnp.minimum(eps, delta * jnp.exp(-common.entropy(probs)))
    return probs > threshold[..., None]


def typical(eps: float = 0.09, delta: float = 0.3) -> AcceptanceRule:
    """vLLM's typical acceptance: accept iff ``p(x) > min(eps, delta * exp(-H(p)))``.

    Deterministic and blind to ``q``. Correction: ``argmax p`` (greedy) or ``p``
    restricted to the accepted set (sampling); see the module docstring.

    Args:
      eps: probability floor, ``> 0`` (vLLM: 0.09).
      delta: entropy scale, ``> 0`` (vLLM: 0.3).
    """
    eps = common.check_positive("typical: eps", eps)
    delta = common.check_positive("typical: delta", delta)
    return criterion(
        lambda z, p: typical_set(z, p, eps, delta),
        name="typical",
        params=(("eps", eps), ("delta", delta)),
    )


def additive(t: float) -> AcceptanceRule:
    """Additive relaxed greedy: accept iff ``p(x) >= p(1) - t``.

    ``t = 0`` is greedy exact match (ties aside). Correction: ``argmax p``
    (greedy) or ``p`` restricted to the accepted set (sampling).

    Args:
      t: slack in probability, in ``[0, 1]``.
    """
    t = common.check_interval("additive: t", t, 0.0, 1.0)
    return criterion(
        lambda z, p: p >= p.max(-1, keepdims=True) - t, name="additive", params=(("t", t),)
    )


def multiplicative(alpha: float) -> AcceptanceRule:
    """Multiplicative relaxed greedy: accept iff ``p(x) >= alpha * p(1)``.

    ``alpha = 1`` is greedy exact match (ties aside). Correction: ``argmax p``
    (greedy) or ``p`` restricted to the accepted set (sampling).

    Args:
      alpha: fraction of the top probability, in ``(0, 1]``.
    """
    alpha = common.check_interval("multiplicative: alpha", alpha, 0.0, 1.0, open_lo=True)
    return criterion(
        lambda z, p: p >= alpha * p.max(-1, keepdims=True),
        name="multiplicative",
        params=(("alpha", alpha),),
    )


def top_m_set(logits: Array, m: int) -> Array:
    """Tokens with fewer than ``m`` strictly higher logits (ties are in).

    Tokens the warp masked to ``-inf`` are never in, even when fewer than ``m``
    tokens survive the mask.
    """
    # The m-th largest logit, then everything at or above it.
    kth = common.largest_values(logits, m)[..., -1:]
    return (logits >= kth) & (logits > -jnp.inf)


def top_m(m: int) -> AcceptanceRule:
    """Accept iff the draft token is in the target's top-``m`` (ties included).

    ``m = 1`` is greedy exact match (ties aside). Ranks use the target logits,
    which order tokens as ``p`` does without softmax-underflow ties.
    Correction: ``argmax p`` (greedy) or ``p`` restricted to the top-m (sampling).

    Args:
      m: integer ``>= 1`` (larger than the vocabulary accepts everything).
    """
    m = common.check_positive_int("top_m: m", m)

    def accepted_set(logits, probs):
        del probs
        return top_m_set(logits, min(m, logits.shape[-1]))

    return criterion(accepted_set, name="top_m", params=(("m", m),))
