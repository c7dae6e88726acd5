"""Deterministic acceptance criteria: accepted sets that are upper level sets of p.

These are the rules of "When Is a Draft Accepted? A Theory of Acceptance in
Speculative Decoding" (Sharma, arXiv:2606.30265) and vLLM's typical acceptance. Each decides from the target alone — whether ``p(x)`` is high
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
* On a token tree: a node's first child in the accepted set of the target at
  the node is accepted; if none is, the emitted token is drawn from ``p``
  restricted to that set (greedy: ``argmax p``). Accepted tokens and
  corrections stay in the set, as on a chain.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from specjax._src.foundation.checks import check_interval, check_positive, check_positive_int
from specjax._src.rules import common
from specjax._src.rules.base import (
    AcceptanceRule,
    Path,
    RuleSpec,
    Verdict,
    VerifyInputs,
    one_hot_argmax,
    position_probs,
    static_field,
)

Array = jax.Array

# (target_logits [K, V], target_probs [K, V]) -> accepted set mask [K, V]
AcceptedSet = Callable[[Array, Array], Array]


@struct.dataclass
class Criterion(AcceptanceRule):
    """A stateless deterministic rule from its accepted-set function.

    Attributes:
      set_fn: ``(logits[..., V], probs[..., V], **hyper, **static) -> bool[..., V]``,
        which target tokens are acceptable (static: compare by identity, so
        pass a module-level function to share compiled programs).
      hyper: ``{name: number}`` traced parameters passed to ``set_fn``.
      static_params: ``((name, value), ...)`` compile-time parameters passed to
        ``set_fn`` (e.g. a rank ``m`` that shapes a ``top_k``).
      name: the rule's name in its spec.
      level_set: the set is an upper level set of ``p`` (then ``specjax.theory``
        can certify it).
    """

    set_fn: Callable = static_field(spec=False)
    hyper: dict = struct.field(default_factory=dict)
    static_params: tuple = static_field((), spec=False)
    name: str = static_field("criterion", spec=False)
    level_set: bool = static_field(False, spec=False)

    @property
    def spec(self) -> RuleSpec:
        hyper = tuple((k, float(v)) for k, v in self.hyper.items())
        return RuleSpec(self.name, hyper + tuple(self.static_params))

    def accepted_set(self, logits: Array, probs: Array) -> Array:
        """``bool[..., V]``: the tokens this rule accepts at each position."""
        return self.set_fn(logits, probs, **self.hyper, **dict(self.static_params))

    def verify(self, inputs: VerifyInputs, state, *, greedy: bool) -> Verdict:
        del state
        k = inputs.draft_tokens.shape[0]
        # The set is the position's (on a tree, the same for every child of a
        # node, whatever residual the earlier siblings left in target_probs).
        logits, probs = inputs.target_logits[:k], position_probs(inputs)
        allowed = self.accepted_set(logits, probs)
        accept = jnp.take_along_axis(allowed, inputs.draft_tokens[:, None], -1)[:, 0]
        exact = common.lossless_accept(inputs, greedy=greedy)
        if greedy:
            correction = one_hot_argmax(logits)
        else:
            correction = common.restricted_distribution(probs, allowed)
        return Verdict(accept, common.paths(accept, exact, Path.RELAXED), correction)


def criterion(accepted_set: AcceptedSet, *, name: str = "criterion", hyper: dict | None = None,
              level_set: bool = False) -> Criterion:
    """A stateless deterministic rule from its accepted-set function.

    Args:
      accepted_set: ``(logits[K, V], probs[K, V], **hyper) -> bool[K, V]``, which
        target tokens are acceptable at each slot (the target's first ``K``
        rows). The draft token is accepted iff it is in the set. A
        module-level function lets rules built twice share one compiled loop.
      name: the rule's name in its :class:`RuleSpec`.
      hyper: numbers passed to ``accepted_set`` as keywords, traced (a new
        value compiles nothing).
      level_set: declare that the set is an upper level set of ``p`` (every
        token at least as likely as an accepted one is accepted), which makes
        the rule certifiable by ``specjax.theory``.

    Conventions (corrections, paths): see this module's docstring.
    """
    if not callable(accepted_set):
        raise TypeError(f"criterion(): accepted_set must be a function, got {type(accepted_set).__name__}.")
    return Criterion(set_fn=accepted_set, hyper=dict(hyper or {}), name=str(name), level_set=bool(level_set))


def typical_set(logits: Array, probs: Array, *, eps: float, delta: float) -> Array:
    """``p(y) > min(eps, delta * exp(-H(p)))``, ``H`` in nats (as vLLM)."""
    del logits
    threshold = jnp.minimum(eps, delta * jnp.exp(-common.entropy(probs)))
    return probs > threshold[..., None]


def typical(eps: float = 0.09, delta: float = 0.3) -> Criterion:
    """vLLM's typical acceptance: accept iff ``p(x) > min(eps, delta * exp(-H(p)))``.

    Deterministic and blind to ``q``. Correction: ``argmax p`` (greedy) or ``p``
    restricted to the accepted set (sampling); see the module docstring.

    Args:
      eps: probability floor, ``> 0`` (vLLM: 0.09).
      delta: entropy scale, ``> 0`` (vLLM: 0.3).
    """
    eps = check_positive("typical: eps", eps)
    delta = check_positive("typical: delta", delta)
    return Criterion(set_fn=typical_set, hyper={"eps": eps, "delta": delta}, name="typical", level_set=True)


def additive_set(logits: Array, probs: Array, *, t: float) -> Array:
    """``p(y) >= p(1) - t``."""
    del logits
    return probs >= probs.max(-1, keepdims=True) - t


def additive(t: float) -> Criterion:
    """Additive relaxed greedy: accept iff ``p(x) >= p(1) - t``.

    ``t = 0`` is greedy exact match (ties aside). Correction: ``argmax p``
    (greedy) or ``p`` restricted to the accepted set (sampling).

    Args:
      t: slack in probability, in ``[0, 1]``.
    """
    t = check_interval("additive: t", t, 0.0, 1.0)
    return Criterion(set_fn=additive_set, hyper={"t": t}, name="additive", level_set=True)


def multiplicative_set(logits: Array, probs: Array, *, alpha: float) -> Array:
    """``p(y) >= alpha * p(1)``."""
    del logits
    return probs >= alpha * probs.max(-1, keepdims=True)


def multiplicative(alpha: float) -> Criterion:
    """Multiplicative relaxed greedy: accept iff ``p(x) >= alpha * p(1)``.

    ``alpha = 1`` is greedy exact match (ties aside). Correction: ``argmax p``
    (greedy) or ``p`` restricted to the accepted set (sampling).

    Args:
      alpha: fraction of the top probability, in ``(0, 1]``.
    """
    alpha = check_interval("multiplicative: alpha", alpha, 0.0, 1.0, open_lo=True)
    return Criterion(set_fn=multiplicative_set, hyper={"alpha": alpha}, name="multiplicative", level_set=True)


def top_m_set(logits: Array, m: int) -> Array:
    """Tokens with fewer than ``m`` strictly higher logits (ties are in).

    Tokens the warp masked to ``-inf`` are never in, even when fewer than ``m``
    tokens survive the mask.
    """
    # The m-th largest logit, then everything at or above it.
    kth = common.largest_values(logits, m)[..., -1:]
    return (logits >= kth) & (logits > -jnp.inf)


def _top_m_accepted(logits: Array, probs: Array, *, m: int) -> Array:
    del probs
    return top_m_set(logits, min(m, logits.shape[-1]))


def top_m(m: int) -> Criterion:
    """Accept iff the draft token is in the target's top-``m`` (ties included).

    ``m = 1`` is greedy exact match (ties aside). Ranks use the target logits,
    which order tokens as ``p`` does without softmax-underflow ties.
    Correction: ``argmax p`` (greedy) or ``p`` restricted to the top-m (sampling).

    Args:
      m: integer ``>= 1`` (larger than the vocabulary accepts everything).
    """
    m = check_positive_int("top_m: m", m)
    return Criterion(set_fn=_top_m_accepted, static_params=(("m", m),), name="top_m", level_set=True)
