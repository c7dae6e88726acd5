"""Drafting policies: how many tokens the draft proposes in each cycle.

A separate axis from acceptance rules, built the same way: a hashable value
(a frozen pytree dataclass) with pure methods over one sequence's state, made
by lowercase factories and composed with :func:`combine`. The engine vmaps every function over the batch,
so each sequence drafts its own number of tokens.

Per cycle, for one sequence (``K = num_draft``, the static cap and the shape of
every draft buffer)::

    budget = clip(policy.budget(state, K), 1, K)     # before drafting
    for j in range(K):                                # while any sequence is drafting
        draw draft token j                            # always at least one
        keep drafting iff j + 1 < budget and policy.proceed(state, DraftStep(...))
    ... verification ...
    state = policy.update(state, DraftOutcome(...))   # once, after verification

The token that triggers a stop is still proposed (it is already drawn): this is
what Hugging Face's stopping criteria do. The target then verifies only as many
tokens as the batch's longest draft needs, rounded up to one of a few compiled
widths (``Buckets.verify``), so a stop saves verification work as well as draft
forwards.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import struct

from specjax._src.checks import check_interval, check_positive_int
from specjax._src.rules.base import RuleSpec, spec_value

Array = jax.Array
PolicyState = Any

# Policies reuse the rules' (name, params) spec: one format for reports.
PolicySpec = RuleSpec


class DraftStep(NamedTuple):
    """What a policy sees right after the draft proposed the token at ``position``.

    Attributes:
      position: int32 scalar, 0-based draft slot.
      token: int32 scalar, the proposed token.
      probs: ``[V]`` the draft distribution it was drawn from (after the
        sampling warp; ``softmax(raw logits)`` when greedy).
      token_prob: ``probs[token]``.
      entropy: entropy of ``probs`` in nats.
    """

    position: Array
    token: Array
    probs: Array
    token_prob: Array
    entropy: Array


class DraftOutcome(NamedTuple):
    """One sequence's cycle as the policy learns it after verification.

    Attributes:
      num_drafted: int32, valid draft slots this cycle.
      num_accepted: int32, length of the accepted prefix (``<= num_drafted``).
      valid: ``[K]`` bool, slots that were drafted.
      entropies: ``[K]`` draft entropies (nats) per slot.
      token_probs: ``[K]`` draft probability of each proposed token.
    """

    num_drafted: Array
    num_accepted: Array
    valid: Array
    entropies: Array
    token_probs: Array


class DraftingPolicy:
    """Base class of drafting policies: hashable values, like the rules.

    A policy is a frozen ``flax.struct.dataclass`` deriving from this class;
    its pytree fields (thresholds, windows) are traced by the decode loop and
    its ``struct.field(pytree_node=False)`` fields are static. Methods, per
    sequence (the engine vmaps them):

    * ``init(num_draft: int) -> state``, one sequence's initial state;
    * ``budget(state, num_draft: int) -> int32``, the most tokens to draft
      this cycle (the engine clips it to ``[1, num_draft]``);
    * ``proceed(state, DraftStep) -> bool``, draft another token after this one?
    * ``update(state, DraftOutcome) -> state``, once per cycle;
    * ``spec``: name and parameters (a :class:`specjax.rules.RuleSpec`).
    """

    name = "policy"

    def init(self, num_draft: int) -> PolicyState:
        del num_draft
        return ()

    def budget(self, state: PolicyState, num_draft: int) -> Array:
        del state
        return jnp.int32(num_draft)

    def proceed(self, state: PolicyState, step: DraftStep) -> Array:
        del state, step
        return jnp.bool_(True)

    def update(self, state: PolicyState, outcome: DraftOutcome) -> PolicyState:
        del outcome
        return state

    @property
    def spec(self) -> PolicySpec:
        params = tuple((f.name, spec_value(getattr(self, f.name))) for f in dataclasses.fields(self)
                       if getattr(self, f.name) is not None)
        return PolicySpec(self.name, params)

    def __str__(self) -> str:
        return str(self.spec)


@struct.dataclass
class Fixed(DraftingPolicy):
    """Always draft ``k`` tokens (``None``: ``num_draft``); see :func:`fixed`."""

    k: Optional[int] = struct.field(pytree_node=False, default=None)
    name = "fixed"

    def budget(self, state, num_draft: int) -> Array:
        del state
        return jnp.int32(num_draft if self.k is None else min(self.k, num_draft))


def fixed(k: Optional[int] = None) -> Fixed:
    """Always draft ``k`` tokens (``None``: ``num_draft``). ``k`` must not exceed
    ``num_draft``, which ``decode`` checks."""
    return Fixed(k=None if k is None else check_positive_int("fixed(k)", k))


class AdaSDEntropyState(NamedTuple):
    """Running sum and count of the entropies of rejected draft tokens (float32)."""

    rejected_entropy_sum: Array
    rejected_count: Array


def adasd_entropy_threshold(state: AdaSDEntropyState) -> Array:
    """Mean entropy of the rejected draft tokens so far; ``+inf`` before any rejection."""
    return jnp.where(
        state.rejected_count > 0,
        state.rejected_entropy_sum / jnp.maximum(state.rejected_count, 1.0),
        jnp.inf,
    )


@struct.dataclass
class AdaSDEntropy(DraftingPolicy):
    """AdaSD's generation threshold; see :func:`adasd_entropy`. ``window`` is traced."""

    window: int = 20
    name = "adasd_entropy"

    def init(self, num_draft: int) -> AdaSDEntropyState:
        del num_draft
        return AdaSDEntropyState(jnp.float32(0.0), jnp.float32(0.0))

    def budget(self, state, num_draft: int) -> Array:
        del state
        return jnp.minimum(jnp.asarray(self.window, jnp.int32), num_draft)

    def proceed(self, state: AdaSDEntropyState, step: DraftStep) -> Array:
        return step.entropy <= adasd_entropy_threshold(state)

    def update(self, state: AdaSDEntropyState, outcome: DraftOutcome) -> AdaSDEntropyState:
        rejected = outcome.num_accepted < outcome.num_drafted
        k = outcome.entropies.shape[0]
        slot = jnp.minimum(outcome.num_accepted, k - 1)
        ent = outcome.entropies[slot]
        return AdaSDEntropyState(
            state.rejected_entropy_sum + jnp.where(rejected, ent, 0.0),
            state.rejected_count + rejected.astype(jnp.float32),
        )


def adasd_entropy(window: int = 20) -> AdaSDEntropy:
    """AdaSD's generation threshold ("AdaSD: Adaptive Speculative Decoding for
    Efficient Language Model Inference", section 4.3).

    Threshold = mean entropy (nats) of every previously *rejected* draft token
    of this sequence (the first rejected slot of each cycle; later slots are
    never judged). Drafting stops after a token whose draft entropy exceeds the
    threshold. Before any rejection the threshold is ``+inf``: draft up to the
    cap. ``window`` is the paper's hard cap on drafts per cycle (20); the
    effective cap is ``min(window, num_draft)``.
    """
    return AdaSDEntropy(window=check_positive_int("adasd_entropy(window)", window))


@struct.dataclass
class Heuristic(DraftingPolicy):
    """Hugging Face's "heuristic" schedule; see :func:`heuristic`."""

    initial: Optional[int] = None
    name = "heuristic"

    def init(self, num_draft: int) -> Array:
        if self.initial is None:
            return jnp.int32(num_draft)
        return jnp.minimum(jnp.asarray(self.initial, jnp.int32), num_draft)

    def budget(self, state: Array, num_draft: int) -> Array:
        del num_draft
        return state

    def update(self, state: Array, outcome: DraftOutcome) -> Array:
        k = outcome.valid.shape[0]
        all_accepted = outcome.num_accepted >= outcome.num_drafted
        new = jnp.where(all_accepted, state + 2, state - 1)
        return jnp.clip(new, 1, k).astype(jnp.int32)


def heuristic(initial: Optional[int] = None) -> Heuristic:
    """Hugging Face's "heuristic" schedule, per sequence.

    Starts at ``initial`` drafts (``None``: ``num_draft``); after each cycle,
    ``+2`` if every drafted token was accepted, else ``-1``, clipped to
    ``[1, num_draft]``.
    """
    return Heuristic(initial=None if initial is None else check_positive_int("heuristic(initial)", initial))


@struct.dataclass
class Confidence(DraftingPolicy):
    """Stop after a token drafted with probability below ``threshold`` (traced)."""

    threshold: float = 0.4
    name = "confidence"

    def proceed(self, state, step: DraftStep) -> Array:
        del state
        return step.token_prob >= self.threshold


def confidence(threshold: float = 0.4) -> Confidence:
    """Stop drafting after a token whose draft probability is below ``threshold``
    (Hugging Face's ``assistant_confidence_threshold``; default 0.4)."""
    return Confidence(threshold=check_interval("confidence(threshold)", threshold, 0.0, 1.0))


@struct.dataclass
class Combine(DraftingPolicy):
    """Several policies at once; see :func:`combine`."""

    policies: tuple
    name = "combine"

    def init(self, num_draft: int):
        return tuple(p.init(num_draft) for p in self.policies)

    def budget(self, state, num_draft: int) -> Array:
        budgets = [jnp.asarray(p.budget(s, num_draft), jnp.int32) for p, s in zip(self.policies, state)]
        return jnp.min(jnp.stack(budgets))

    def proceed(self, state, step: DraftStep) -> Array:
        flags = [jnp.asarray(p.proceed(s, step), bool) for p, s in zip(self.policies, state)]
        return jnp.all(jnp.stack(flags))

    def update(self, state, outcome: DraftOutcome):
        return tuple(p.update(s, outcome) for p, s in zip(self.policies, state))

    @property
    def spec(self) -> PolicySpec:
        return PolicySpec(self.name, tuple((f"p{i}", p.spec) for i, p in enumerate(self.policies)))


def combine(*policies: DraftingPolicy) -> Combine:
    """Runs several policies together: the budget is the smallest, drafting
    stops as soon as any of them says stop, each updates its own state.

    ``combine(heuristic(), confidence(0.4))`` is Hugging Face's default.
    """
    if not policies:
        raise ValueError("combine() needs at least one policy.")
    for p in policies:
        if not isinstance(p, DraftingPolicy):
            raise TypeError(f"combine() takes DraftingPolicy objects, got {type(p).__name__}.")
    return Combine(policies=tuple(policies))


def max_fixed_k(policy: DraftingPolicy) -> Optional[int]:
    """The largest ``k`` of any ``fixed(k)`` inside ``policy`` (for ``decode``'s check)."""
    found = []

    def visit(spec):
        if not isinstance(spec, RuleSpec):
            return
        if spec.name == "fixed" and spec.get("k") is not None:
            found.append(int(spec.get("k")))
        for _, value in spec.params:
            visit(value)

    visit(policy.spec)
    return max(found) if found else None


_POLICIES = {
    "fixed": (fixed, {"k": int}),
    "adasd_entropy": (adasd_entropy, {"window": int}),
    "heuristic": (heuristic, {"initial": int}),
    "confidence": (confidence, {"threshold": float}),
}


def parse_drafting(spec: str) -> DraftingPolicy:
    """A policy from a spec string, the CLI's syntax: ``"fixed"``, ``"fixed:k=3"``,
    ``"adasd_entropy:window=20"``, ``"heuristic"``, ``"confidence:threshold=0.4"``;
    ``"+"`` combines (``"heuristic+confidence"``, Hugging Face's default).

    Raises:
      ValueError: an unknown policy or parameter, a repeated or malformed one.
    """
    parts = [p.strip() for p in spec.split("+")]
    if len(parts) > 1:
        return combine(*(parse_drafting(p) for p in parts))
    name, _, rest = spec.strip().partition(":")
    if name not in _POLICIES:
        raise ValueError(f"Unknown drafting policy {name!r}; choose from {', '.join(_POLICIES)}.")
    factory, types = _POLICIES[name]
    kwargs = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in types:
            raise ValueError(
                f"Bad parameter {item!r} for drafting policy {name!r}; it takes "
                f"{', '.join(f'{k}=...' for k in types)}."
            )
        if key in kwargs:
            raise ValueError(f"Parameter {key!r} given twice in drafting policy {spec!r}.")
        try:
            kwargs[key] = types[key](value)
        except ValueError as e:
            raise ValueError(f"Drafting policy {name!r}: {key}={value!r} is not a {types[key].__name__}.") from e
    return factory(**kwargs)
