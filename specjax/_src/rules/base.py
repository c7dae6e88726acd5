"""The acceptance-rule interface: small NamedTuples of pure functions.

Modelled on optax's ``GradientTransformation``. A rule looks at one sequence's
draft block and says, for every draft slot independently, whether it would
accept the draft token *if every earlier slot were accepted*, why, and which
distribution the correction token is drawn from if that slot is the first
rejection. The engine vmaps the rule over the batch, takes the accepted prefix,
samples the correction or bonus token and calls ``update`` with the outcome.

Deciding every slot at once (rather than in a sequential loop) is exact: a
slot's decision only matters when all earlier slots were accepted, and every
rule here decides a slot from that slot's own distributions.

Shapes below are per sequence: ``K`` draft slots, vocabulary ``V``.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from specjax._src import sampling

Array = jax.Array
RuleState = Any


class Path(enum.IntEnum):
    """Why a slot was accepted. Stored as int32 in verdicts and stats."""

    REJECTED = 0
    EXACT = 1  # the lossless test accepted it (or, greedy, the draft is the target's argmax)
    RELAXED = 2  # a deterministic relaxed criterion accepted what the lossless test rejected
    PARDON = 3  # a tolerance or classifier accepted what the lossless test rejected (EARS, PAD)


NUM_PATHS = len(Path)


class VerifyInputs(NamedTuple):
    """One sequence's draft block, as every rule sees it.

    Attributes:
      draft_tokens: ``[K]`` int32 proposed tokens.
      draft_logits: ``[K, V]`` float32 draft logits after the sampling warp
        (temperature, top-k, top-p; raw logits when greedy).
      draft_probs: ``[K, V]`` ``softmax(draft_logits)``: the draft's
        distribution q (at temperature 0, the model's own T=1 distribution).
      target_logits: ``[K + 1, V]`` target logits after the same warp; slot ``K``
        is the bonus position after the last draft.
      target_probs: ``[K + 1, V]`` ``softmax(target_logits)``: p.
      uniforms: ``[K]`` Uniform(0, 1) draws; shared by every rule of a
        combination, so ``any_of`` composes decisions made with the same coins.
      valid: ``[K]`` bool, False for slots the drafting policy did not fill.
      features: extra per-slot inputs some rules need (PAD's hidden states), a
        dict of arrays with leading axis ``K``, or an empty dict.
    """

    draft_tokens: Array
    draft_logits: Array
    draft_probs: Array
    target_logits: Array
    target_probs: Array
    uniforms: Array
    valid: Array
    features: dict


class Verdict(NamedTuple):
    """A rule's decision for every slot of one block.

    Attributes:
      accept: ``[K]`` bool, accept slot k given all earlier slots accepted.
      path: ``[K]`` int32 :class:`Path` code (``REJECTED`` where not accepted).
      correction: ``[K, V]`` float32 distribution of the token emitted when slot
        k is the first rejection. Rows only need to be valid where ``accept`` is
        False. Greedy rules return one-hot rows.
    """

    accept: Array
    path: Array
    correction: Array


class RuleSpec(NamedTuple):
    """A rule's name and hyperparameters: for reports, parsing and theory.

    ``params`` is a tuple of ``(name, value)`` pairs so the spec is hashable.
    """

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        # The inverse of ``specjax.rules.parse_rule``: "mars:theta=0.9", and
        # combinators as "any_of(speculative_sampling,mars:theta=0.9)".
        if not self.params:
            return self.name
        subs = self.params[0][1] if len(self.params) == 1 else None
        if (self.params[0][0] == "rules" and isinstance(subs, tuple)
                and all(isinstance(s, RuleSpec) for s in subs)):
            return self.name + "(" + ",".join(str(s) for s in subs) + ")"
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.params)

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


class AcceptanceRule(NamedTuple):
    """A verification rule: pure functions plus a spec.

    Attributes:
      init: ``() -> state``, one sequence's initial running state (a pytree;
        ``()`` for stateless rules).
      verify: ``(inputs, state, *, greedy) -> Verdict``. ``greedy`` is a static
        Python bool: True when decoding at temperature 0.
      update: ``(state, inputs, verdict, num_accepted, *, greedy) -> state``,
        called once per cycle with the accepted prefix length (int32 scalar).
      spec: the rule's name and parameters.
    """

    init: Callable[[], RuleState]
    verify: Callable[..., Verdict]
    update: Callable[..., RuleState]
    spec: RuleSpec


def stateless_update(state, inputs, verdict, num_accepted, *, greedy):
    del inputs, verdict, num_accepted, greedy
    return state


def no_state() -> tuple:
    return ()


def residual_distribution(target_probs: Array, draft_probs: Array) -> Array:
    """``norm(max(0, p - q))`` over the last axis; falls back to ``p`` where p == q.

    When p and q coincide the residual is empty, but the lossless test then
    accepts with probability one, so the fallback row is never sampled; it only
    keeps the row a valid distribution (no 0/0).
    """
    residual = jnp.maximum(target_probs - draft_probs, 0.0)
    total = residual.sum(-1, keepdims=True)
    return jnp.where(total > 1e-12, residual / jnp.maximum(total, 1e-30), target_probs)


def one_hot_argmax(logits: Array) -> Array:
    """``[..., V]`` one-hot of the argmax, float32."""
    return jax.nn.one_hot(sampling.argmax(logits), logits.shape[-1], dtype=jnp.float32)


def token_prob(probs: Array, tokens: Array) -> Array:
    """``probs[k, tokens[k]]`` for ``probs[K, V]`` (first K rows), ``tokens[K]``."""
    k = tokens.shape[0]
    return jnp.take_along_axis(probs[:k], tokens[:, None], axis=-1)[:, 0]


def lossless_decision(inputs: VerifyInputs, *, greedy: bool) -> tuple[Array, Array]:
    """The standard speculative-sampling test and its residual.

    Returns ``(accept[K], correction[K, V])``. Greedy: accept iff the draft is
    the target's argmax; the correction is the argmax. Sampling: accept iff
    ``U <= p(x) / q(x)``; the correction is ``norm(max(0, p - q))``.
    """
    k = inputs.draft_tokens.shape[0]
    target_logits = inputs.target_logits[:k]
    if greedy:
        accept = inputs.draft_tokens == sampling.argmax(target_logits)
        return accept, one_hot_argmax(target_logits)
    p = token_prob(inputs.target_probs, inputs.draft_tokens)
    q = token_prob(inputs.draft_probs, inputs.draft_tokens)
    # U * q <= p avoids dividing by q; q(x) > 0 always holds for a sampled x.
    accept = inputs.uniforms * q <= p
    return accept, residual_distribution(inputs.target_probs[:k], inputs.draft_probs)


def speculative_sampling() -> AcceptanceRule:
    """Standard (lossless) speculative sampling; greedy exact match at T=0.

    Output tokens follow the target's warped distribution exactly. Correction:
    ``norm(max(0, p - q))`` (sampling) or ``argmax p`` (greedy).
    """

    def verify(inputs: VerifyInputs, state, *, greedy: bool) -> Verdict:
        del state
        accept, correction = lossless_decision(inputs, greedy=greedy)
        path = jnp.where(accept, Path.EXACT, Path.REJECTED).astype(jnp.int32)
        return Verdict(accept=accept, path=path, correction=correction)

    return AcceptanceRule(
        init=no_state,
        verify=verify,
        update=stateless_update,
        spec=RuleSpec("speculative_sampling"),
    )
