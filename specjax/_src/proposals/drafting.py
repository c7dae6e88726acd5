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
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import struct

from specjax._src.foundation.checks import check_interval, check_positive_int
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
      first_acceptance: float32 scalar, how likely the lossless rule was to
        accept the draft's first token had it been drafted: ``sum(min(p, q))``
        over the first slot's target and draft distributions (greedy: 1 if the
        draft's argmax is the target's). Known even in a cycle that drafted
        nothing (where its first draft step ran), so a policy that turned
        drafting off keeps learning whether to turn it on; -1 where the draft
        did not run at all, None where a cycle does not compute it.
      copy_acceptance: float32 scalar, how likely the lossless rule was to
        accept the context lookup's proposal for the first slot, taken or not
        (the target's probability of the copied token; greedy: 1 if it is the
        target's pick); -1 where the lookup proposed nothing, None where a
        cycle does not compute it. ``first_acceptance`` is the drafter's own
        first token's, even where a copy took the slot, so the two compare.
    """

    num_drafted: Array
    num_accepted: Array
    valid: Array
    entropies: Array
    token_probs: Array
    first_acceptance: Optional[Array] = None
    copy_acceptance: Optional[Array] = None


class DraftingPolicy:
    """Base class of drafting policies: hashable values, like the rules.

    A policy is a frozen ``flax.struct.dataclass`` deriving from this class;
    its pytree fields (thresholds, windows) are traced by the decode loop and
    its ``struct.field(pytree_node=False)`` fields are static. Methods, per
    sequence (the engine vmaps them):

    * ``init(num_draft: int) -> state``, one sequence's initial state;
    * ``budget(state, num_draft: int) -> int32``, the most tokens to draft
      this cycle (clipped to ``[1, num_draft]``);
    * ``plan(states, live, num_draft: int) -> [B] int32``, the batch's budgets
      at once (default: ``budget`` per sequence); a policy that weighs the
      batch's shared cost (:func:`auto`) overrides it, and may answer 0
      (no drafts: the cycle is a plain target step) where it sets
      ``may_draft_none``;
    * ``proceed(state, DraftStep) -> bool``, draft another token after this one?
    * ``copies(state) -> bool``, whether this cycle's slots may take the
      context lookup's copies (with ``lookup=``; default: always);
    * ``update(state, DraftOutcome) -> state``, once per cycle;
    * ``spec``: name and parameters (a :class:`specjax.rules.RuleSpec`).
    """

    name = "policy"
    # A policy whose plan may give 0 drafts: the verification then needs a one-token width.
    may_draft_none = False

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

    def copies(self, state: PolicyState) -> Array:
        del state
        return jnp.bool_(True)

    def plan(self, states: PolicyState, live: Array, num_draft: int) -> Array:
        """``[B]`` int32 budgets for the batch (``states``: the ``[B]``-batched
        states, ``live [B]``: the sequences still decoding)."""
        budgets = jax.vmap(lambda s: self.budget(s, num_draft), axis_size=live.shape[0])(states)
        return jnp.clip(jnp.asarray(budgets, jnp.int32), 1, num_draft)

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

    def copies(self, state) -> Array:
        return jnp.all(jnp.stack([jnp.asarray(p.copies(s), bool) for p, s in zip(self.policies, state)]))

    def plan(self, states, live: Array, num_draft: int) -> Array:
        plans = [p.plan(s, live, num_draft) for p, s in zip(self.policies, states)]
        return jnp.min(jnp.stack(plans), axis=0)

    @property
    def may_draft_none(self) -> bool:
        return any(p.may_draft_none for p in self.policies)

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


# ---------------------------------------------------------------------------
# auto: the draft length that pays, from measured costs and live acceptance
# ---------------------------------------------------------------------------


@struct.dataclass
class CostModel:
    """What a cycle costs on the machine it runs on, in units of one target
    forward of one token per sequence at the measured batch size.

    Made by :func:`specjax.engine.measure_costs` (``decode`` and the slots
    engine measure it when :func:`auto` is given without one). Every field is
    a traced array, so a new measurement compiles nothing.

    Attributes:
      verify: ``[K + 1]`` float32, the cost of verifying ``w = 1 .. K + 1``
        tokens per sequence (entry ``w - 1``): the target forward at the
        narrowest compiled width that holds ``w`` tokens (``Buckets.verify``).
      draft_first: the cycle's first draft step (a draft model's two-token
        forward, a feature head's ``K + 1``-token one), run every cycle.
      draft_step: each further draft token's forward.
      cycle: the cycle's own work when it drafts (the target's distributions
        over ``K + 1`` positions, the rule's verdict, the emitted token's
        sample); a cycle that drafts nothing is a plain target step, whose
        sampling a target-only step pays too.
      forward_ms: the unit, one target forward of one token, in milliseconds
        (for reports; the policy reads only the ratios).
      batch: the batch size measured at (float32, for reports).
      measured: ``[K + 1]``, what a cycle drafting ``k`` tokens cost when
        timed in the loop's own program, relative to one drafting none
        (:func:`specjax.engine.calibrate_costs`); zeros where not timed. When
        timed, the policy reads these instead of the sum of the parts above:
        they hold everything the parts miss (the loop's control flow, copies,
        fusions).

    Costs measured at several batch sizes (:func:`stack_costs`; the slots
    engine's row buckets) carry a leading ``[R]`` axis on every field, and
    :meth:`at_batch` picks the row of the batch a program runs.
    """

    verify: Array
    draft_first: Array
    draft_step: Array
    cycle: Array
    forward_ms: Array
    batch: Array
    measured: Array

    @property
    def max_draft(self) -> int:
        """The largest ``K`` these costs cover."""
        return int(self.verify.shape[-1]) - 1

    def at_batch(self, rows: int) -> "CostModel":
        """The costs measured at the smallest batch of at least ``rows``
        sequences (the largest measured where none is); unstacked costs as they are."""
        if self.verify.ndim == 1:
            return self
        fits = self.batch >= rows
        index = jnp.where(fits.any(), jnp.argmax(fits), self.batch.shape[0] - 1)
        return jax.tree_util.tree_map(lambda x: x[index], self)

    def cycle_costs(self, num_draft: int) -> Array:
        """``[K + 1]``: the cost of a cycle that drafts ``k = 0 .. K`` tokens.
        ``k = 0`` verifies one token and skips the draft, whose cache then
        catches up in one first step at most every ``K`` cycles (counted as
        ``draft_first / K`` a cycle)."""
        k = jnp.arange(num_draft + 1, dtype=jnp.float32)
        steps = jnp.maximum(k - 1.0, 0.0) * self.draft_step
        first = jnp.where(k > 0, self.draft_first + self.cycle, self.draft_first / num_draft)
        parts = first + steps + self.verify[: num_draft + 1]
        return jnp.where(self.is_timed(num_draft), self.measured[: num_draft + 1], parts)

    def is_timed(self, num_draft: int) -> Array:
        """bool scalar: whether cycles drafting ``0 .. num_draft`` were timed in the loop
        (``measured``), so that :meth:`cycle_costs` reads those times, not the parts' sum."""
        return jnp.all(self.measured[: num_draft + 1] > 0)

    def describe(self) -> str:
        """One line: the unit and each cost relative to it (one line per batch size when stacked)."""
        if self.verify.ndim == 2:
            return "\n".join(jax.tree_util.tree_map(lambda x, i=i: x[i], self).describe()
                             for i in range(self.verify.shape[0]))
        widths = ", ".join(f"{w + 1}: {float(c):.2f}" for w, c in enumerate(self.verify))
        return (f"target forward {float(self.forward_ms):.2f} ms at batch {int(self.batch)}; verify by tokens "
                f"{{{widths}}}; draft first step {float(self.draft_first):.3f}, further step "
                f"{float(self.draft_step):.3f}; a drafting cycle's own work {float(self.cycle):.3f} "
                "(in target forwards)"
                + ("" if not (self.measured > 0).all() else "; timed in the loop, a cycle drafting k costs {"
                   + ", ".join(f"{k}: {float(c):.2f}" for k, c in enumerate(self.measured))
                   + "} plain steps (generate's where decode timed it, else the loop's own)"))


def stack_costs(costs) -> CostModel:
    """Costs measured at several batch sizes (ascending), as one
    :class:`CostModel` whose fields have a leading axis (:meth:`CostModel.at_batch`)."""
    costs = list(costs)
    if not costs or not all(isinstance(c, CostModel) for c in costs):
        raise TypeError("stack_costs takes one or more CostModels (specjax.engine.measure_costs).")
    if len(costs) == 1:
        return costs[0]
    if any(c.verify.ndim != 1 for c in costs) or len({c.verify.shape for c in costs}) != 1:
        raise ValueError("stack_costs takes unstacked costs measured with the same num_draft.")
    batches = [float(c.batch) for c in costs]
    if batches != sorted(set(batches)):
        raise ValueError(f"stack_costs takes costs in ascending order of batch size, got batches {batches}.")
    return jax.tree_util.tree_map(lambda *x: jnp.stack(x), *costs)


def expected_tokens(acceptance: Array) -> Array:
    """``[..., K + 1]``: the tokens a cycle commits on average when it drafts
    ``k = 0 .. K`` tokens, from ``acceptance [..., K]``, the probability that
    slot ``j`` is accepted given that slots ``0 .. j - 1`` were:
    ``1 + sum_{i <= k} prod_{j < i} acceptance[j]`` (the accepted run plus
    the emitted token)."""
    runs = jnp.cumprod(acceptance, axis=-1)
    zero = jnp.zeros(acceptance.shape[:-1] + (1,), acceptance.dtype)
    return 1.0 + jnp.concatenate([zero, jnp.cumsum(runs, axis=-1)], axis=-1)


def best_draft_length(expected: Array, costs: Array, margin=0.0, tie=0.0) -> Array:
    """The ``k`` that maximises committed tokens per unit of cost,
    ``expected[k] / costs[k]`` (the smallest such ``k`` on ties), where drafting
    (``k > 0``) must beat a plain step's ratio by the factor ``1 + margin``, and
    a drafting length within the factor ``1 + tie`` of the best one's ratio
    counts as a tie. int32 scalar."""
    goodput = expected / costs
    best = jnp.argmax(goodput.at[0].multiply(1.0 + jnp.asarray(margin, goodput.dtype)))
    drafting = goodput[1:]
    near = drafting * (1.0 + jnp.asarray(tie, goodput.dtype)) >= jnp.max(drafting)
    return jnp.where(best == 0, 0, 1 + jnp.argmax(near)).astype(jnp.int32)


class AutoState(NamedTuple):
    """One sequence's acceptance evidence, each a decayed count.

    Attributes:
      accepted: ``[K]`` float32, accepted drafts at slot ``j``.
      judged: ``[K]`` float32, drafts judged at slot ``j`` (those after an accepted run).
      copies: ``[2]`` float32, the context lookup's first-slot proposals: their summed
        acceptance probabilities and their count (``DraftOutcome.copy_acceptance``);
        None: no evidence (a state built by hand).
      own: ``[2]`` float32, the same for the drafter's own first tokens
        (``DraftOutcome.first_acceptance``).
    """

    accepted: Array
    judged: Array
    copies: Optional[Array] = None
    own: Optional[Array] = None


@struct.dataclass
class Auto(DraftingPolicy):
    """Drafts the number of tokens that maximises committed tokens per unit
    of measured cost; see :func:`auto`. Every field is traced."""

    costs: Optional[CostModel] = None
    memory: float = 0.9
    prior: float = 0.6
    prior_weight: float = 2.0
    margin: float = 0.2
    timed_margin: float = 0.05
    tie: float = 0.03
    timed: Optional[bool] = struct.field(pytree_node=False, default=None)
    choose_copies: bool = struct.field(pytree_node=False, default=True)
    name = "auto"
    may_draft_none = True

    @property
    def spec(self) -> PolicySpec:  # the measured costs are the machine's, not the policy's settings
        return PolicySpec(self.name, tuple((n, spec_value(getattr(self, n))) for n in ("memory", "prior",
                                                                                     "prior_weight", "margin",
                                                                                     "timed_margin", "tie", "timed",
                                                                                     "choose_copies")))

    def init(self, num_draft: int) -> AutoState:
        zeros = jnp.zeros((num_draft,), jnp.float32)
        return AutoState(zeros, zeros, jnp.zeros((2,), jnp.float32), jnp.zeros((2,), jnp.float32))

    def _shrunk(self, counts: Array) -> Array:
        """``(accepted + prior * w) / (judged + w)`` of ``counts = [accepted, judged]``."""
        w = jnp.asarray(self.prior_weight, jnp.float32)
        return (counts[0] + self.prior * w) / (counts[1] + w)

    def copies(self, state: AutoState) -> Array:
        """Copy from the context only where the lookup's first-slot proposals would have been
        accepted more often than the drafter's own first tokens (both observed every drafting
        cycle, whichever took the slot, and shrunk towards ``prior``): a copy takes the drafter's
        slot, so a worse one costs accepted tokens. Without evidence, do not copy: the evidence
        comes whether or not the copies are taken."""
        if not self.choose_copies or state.copies is None:
            return jnp.bool_(True)
        return self._shrunk(state.copies) > self._shrunk(state.own)

    def acceptance(self, state: AutoState) -> Array:
        """``[K]`` the estimated acceptance of each slot given the slots before it:
        the decayed counts shrunk, with the weight of ``prior_weight``
        observations, towards ``prior`` for slot 0 and towards the estimate of
        the slot before for the others (a slot not judged for a while drifts
        back to them, so a policy that stopped drafting tries again).

        A deep slot is judged only after an accepted run, so its own evidence is
        thin and the shrinkage target decides its estimate. Shrunk towards the
        fixed ``prior`` (0.6) instead, slots 2 and 3 of the real pair at T=1
        (accepted about half the time) looked better than slot 1, and ``auto()``
        drafted three tokens in 85% of cycles at batch 2, where two paid more
        (benchmarks/results/2026-11-30-auto-drafting-grid-batch-2-and-16-k1-6-lookup.md)."""
        w = jnp.asarray(self.prior_weight, jnp.float32)
        estimates, above = [], jnp.asarray(self.prior, jnp.float32)
        for j in range(state.accepted.shape[-1]):
            above = jnp.clip((state.accepted[..., j] + above * w) / (state.judged[..., j] + w), 0.0, 1.0)
            estimates.append(above)
        return jnp.stack(estimates, axis=-1)

    def _choice_costs(self, num_draft: int, rows: int = 1) -> tuple[Array, Array]:
        """``[K + 1]`` the cost of a cycle drafting ``k = 0 .. K`` at ``rows`` rows, and the margin
        drafting must beat: ``timed_margin`` where those costs were timed in the loop, else ``margin``."""
        if self.costs is None:
            raise ValueError("drafting.auto() has no measured costs: decode and Engine measure them when "
                             "given auto(); elsewhere pass auto(costs=specjax.engine.measure_costs(...)).")
        if self.costs.max_draft < num_draft:
            raise ValueError(f"auto(costs=...) covers drafts up to {self.costs.max_draft}, but num_draft is "
                             f"{num_draft}; measure the costs with num_draft={num_draft}.")
        costs = self.costs.at_batch(rows)
        margin = jnp.where(costs.is_timed(num_draft), self.timed_margin, self.margin)
        return costs.cycle_costs(num_draft), margin

    def budget(self, state: AutoState, num_draft: int) -> Array:
        """This sequence alone: the best ``k`` in ``0 .. K`` (the batch's is :meth:`plan`)."""
        return best_draft_length(expected_tokens(self.acceptance(state)), *self._choice_costs(num_draft),
                                 tie=self.tie)

    def promised(self, states: AutoState, live: Array) -> Array:
        """``[K + 1]`` the tokens a cycle drafting ``k = 0 .. K`` commits on average, summed
        over the ``live [B]`` sequences of ``states``, by their own estimates."""
        expected = expected_tokens(jax.vmap(self.acceptance)(states))  # [B, K + 1]
        return jnp.sum(jnp.where(live[:, None], expected, 0.0), axis=0)

    def plan(self, states: AutoState, live: Array, num_draft: int) -> Array:
        """One ``k`` for the whole batch: the verification's width, and so its
        cost, is the batch's longest draft, and each draft step runs every row.
        The expected tokens of the live rows are summed per ``k``."""
        k = best_draft_length(self.promised(states, live), *self._choice_costs(num_draft, live.shape[0]),
                              tie=self.tie)
        return jnp.full(live.shape, jnp.where(live.any(), k, 0), jnp.int32)

    def update(self, state: AutoState, outcome: DraftOutcome) -> AutoState:
        """Slot ``j`` is judged when it was drafted and slots ``0 .. j - 1``
        were accepted; it counts as accepted when ``j < num_accepted``. A cycle
        that drafted nothing still judges slot 0 by ``first_acceptance``. The
        copies' and the drafter's own first-slot acceptance add to their evidence."""
        k = outcome.valid.shape[0]
        slots = jnp.arange(k)
        judged = outcome.valid & (slots <= outcome.num_accepted)
        accepted = (judged & (slots < outcome.num_accepted)).astype(jnp.float32)
        judged = judged.astype(jnp.float32)
        if outcome.first_acceptance is not None:
            none = (outcome.num_drafted == 0) & (outcome.first_acceptance >= 0)
            judged = judged.at[0].set(jnp.where(none, 1.0, judged[0]))
            accepted = accepted.at[0].set(jnp.where(none, outcome.first_acceptance, accepted[0]))

        def evidence(p):  # [acceptance, 1] where observed (p >= 0), else nothing
            if p is None:
                return jnp.zeros((2,), jnp.float32)
            return jnp.where(p >= 0, jnp.stack([p, 1.0]), 0.0).astype(jnp.float32)

        m = jnp.asarray(self.memory, jnp.float32)
        copies = jnp.zeros((2,), jnp.float32) if state.copies is None else state.copies
        own = jnp.zeros((2,), jnp.float32) if state.own is None else state.own
        return AutoState(m * state.accepted + accepted, m * state.judged + judged,
                         m * copies + evidence(outcome.copy_acceptance), m * own + evidence(outcome.first_acceptance))

    # -- a dynamic tree's size (decode(tree=dynamic_tree(...), drafting=auto())) -------------

    def tree_prior(self, num_nodes: int, top_k: int) -> Array:
        """``[M]`` the chance that the draft node of rank ``r`` (by draft score, best first)
        lies on the accepted path before any evidence: ``prior ** (1 + r // top_k + r %
        top_k)``, as if a tree held ``top_k`` nodes a level, each level a chain's slot deeper
        and each later node of a level a slot's chance less (a chain, ``top_k = 1``, gets the
        chain's prior). Giving every node of a level its full chance instead, ``prior ** (1 +
        r // top_k)``, valued a (4, 4, 12) tree at 4.7 tokens before any evidence; at batch 4
        on a 2-core CPU the sized trees then ran their program and 0.62-0.96x target-only,
        where with this prior they open with plain decoding's and ran 0.98-1.00x."""
        r = jnp.arange(num_nodes, dtype=jnp.float32)
        return jnp.asarray(self.prior, jnp.float32) ** (1.0 + r // top_k + r % top_k)

    def node_acceptance(self, state: AutoState, top_k: int) -> Array:
        """``[M]`` the estimated chance that the rank-``r`` node, when verified, lies on the
        accepted path: its decayed counts shrunk, with the weight of ``prior_weight`` cycles,
        towards ``prior`` times the estimate of rank ``r - top_k`` (about a level above; ranks
        below ``top_k``, the root's children: of rank ``r - 1``, the sibling before), so
        :meth:`tree_prior` without evidence. A rank seldom verified is thus valued from the
        ranks above it, as a chain's next slot is, and the root's later children follow what
        plain cycles learn of the first (:meth:`update_tree_first`); shrunk towards ``prior **
        (1 + r)`` there, a second child's estimate went back to ``prior ** 2`` whatever they learned.
        Shrunk towards ``prior ** (1 + r)`` instead (a fixed chain), the real pair's ranks 2
        and 3 of a (4, 2, 6) tree at T=1, accepted 0.40 and 0.21 of the times verified, were
        valued 0.18 and 0.11 after a few cycles unverified, and the sized tree verified 2.2
        draft nodes a cycle and ran 0.92x the fixed tree's speed on a 2-core CPU.

        An estimate does not depend on how many nodes are verified: a node's ancestors and
        earlier siblings rank above it, so whenever it is verified they are too, and the
        walk reaches and judges it as it would in any larger tree."""
        w, prior = jnp.asarray(self.prior_weight, jnp.float32), jnp.asarray(self.prior, jnp.float32)

        def rank(above, inputs):  # above: the last top_k estimates, the oldest first
            r, accepted, judged = inputs
            towards = jnp.where(r < top_k, above[-1], above[0])  # the rank before, or a level above
            estimate = jnp.clip((accepted + prior * towards * w) / (judged + w), 0.0, 1.0)
            return jnp.concatenate([above[1:], estimate[None]]), estimate

        ranks = jnp.arange(state.accepted.shape[-1])
        _, estimates = jax.lax.scan(rank, jnp.ones((top_k,), jnp.float32), (ranks, state.accepted, state.judged))
        return estimates

    def tree_costs(self, counts, depth: int, rows: int = 1) -> Array:
        """``[W]`` the cost of a cycle verifying ``counts[i] = n`` draft nodes (``0``: a plain
        step): ``min(n, depth)`` draft forwards (the first, then one over each further
        level's frontier: ``draft_step``, measured over ``top_k`` rows with
        ``measure_costs(tree=...)``; the best ``n`` nodes lie in the first ``n`` levels),
        the verification of ``n + 1`` nodes and the cycle's own work; a plain step verifies
        one token and pays ``draft_first / depth`` for the catch-up every ``depth`` cycles,
        as a chain's does. Where ``decode`` timed its own program verifying each of
        ``counts`` (``measured``, indexed by ``n``), those times instead."""
        if self.costs is None:
            raise ValueError("drafting.auto() has no measured costs: decode and Engine measure them when "
                             "given auto(); elsewhere pass auto(costs=specjax.engine.measure_costs(...)).")
        most = max(counts)
        if self.costs.max_draft < most:
            raise ValueError(f"auto(costs=...) covers verifications of up to {self.costs.max_draft + 1} tokens, "
                             f"but the tree verifies {most + 1}; measure the costs with num_draft={most}.")
        costs = self.costs.at_batch(rows)
        n = jnp.asarray(counts, jnp.int32)
        levels = jnp.minimum(n, depth).astype(jnp.float32)
        drafting = costs.draft_first + jnp.maximum(levels - 1.0, 0.0) * costs.draft_step + costs.cycle
        draft = jnp.where(n > 0, drafting, costs.draft_first / depth)
        return jnp.where(costs.is_timed(most), costs.measured[n], draft + costs.verify[n])

    def tree_expected(self, state: AutoState, counts, top_k: int) -> Array:
        """``[W]`` one sequence's expected committed tokens when verifying its ``counts[i]``
        best-ranked nodes: ``1 + sum_{r < n}`` of their :meth:`node_acceptance`."""
        upto = jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(self.node_acceptance(state, top_k))])
        return 1.0 + upto[jnp.asarray(counts, jnp.int32)]

    def plan_tree(self, states: AutoState, live: Array, counts, depth: int, top_k: int) -> Array:
        """The index into ``counts`` (draft nodes verified, ascending, ``counts[0] = 0``: a
        plain step) that maximises the batch's expected committed tokens per unit of cost:
        verifying the ``n`` best-ranked nodes commits ``1 + sum_{r < n}`` of their
        :meth:`node_acceptance` on average, and drafting must beat a plain step by ``1 +
        margin`` (``1 + timed_margin`` against costs timed in the loop). int32 scalar (0
        when no row is live)."""
        expected = jax.vmap(lambda s: self.tree_expected(s, counts, top_k))(states)  # [B, W]
        total = jnp.sum(jnp.where(live[:, None], expected, 0.0), axis=0)
        timed = self.costs.at_batch(live.shape[0]).is_timed(max(counts))
        index = best_draft_length(total, self.tree_costs(counts, depth, live.shape[0]),
                                  jnp.where(timed, self.timed_margin, self.margin))
        return jnp.where(live.any(), index, 0).astype(jnp.int32)

    def update_tree_first(self, state: AutoState, acceptance: Array) -> AutoState:
        """One sequence's cycle that verified no node but judged the best-ranked one against
        the root's target distribution (``acceptance``, a probability): rank 0 gains that much
        evidence, as a chain's first slot does in a cycle that drafted nothing; every count decays."""
        m = jnp.asarray(self.memory, jnp.float32)
        first = (jnp.arange(state.accepted.shape[-1]) == 0).astype(jnp.float32)
        return state._replace(accepted=m * state.accepted + first * acceptance, judged=m * state.judged + first)

    def update_tree(self, state: AutoState, verified: Array, on_path: Array) -> AutoState:
        """One sequence's cycle: the ``verified`` best-ranked nodes were judged (0 in a plain
        step), and ``on_path [M]`` marks those on the accepted path. Every count decays by
        ``memory``, so a rank not verified for a while drifts back to its prior."""
        judged = (jnp.arange(on_path.shape[-1]) < verified).astype(jnp.float32)
        m = jnp.asarray(self.memory, jnp.float32)
        return state._replace(accepted=m * state.accepted + (on_path & (judged > 0)).astype(jnp.float32),
                              judged=m * state.judged + judged)


def auto(costs: Optional[CostModel] = None, *, memory: float = 0.9, prior: float = 0.6,
         prior_weight: float = 2.0, margin: float = 0.2, timed_margin: float = 0.05, tie: float = 0.03,
         timed: Optional[bool] = None, choose_copies: bool = True) -> Auto:
    """Each cycle, draft the ``k`` in ``0 .. num_draft`` that maximises the
    batch's expected committed tokens per unit of measured cost (goodput);
    ``k = 0`` is a plain target step inside the same program.

    The expected tokens come from each sequence's own acceptance so far, per
    draft slot (:class:`AutoState`: counts decayed by ``memory`` per cycle and
    shrunk, with the weight of ``prior_weight`` cycles, towards ``prior`` for the
    first slot and towards the slot before's estimate for the others); the
    cost of each ``k`` from ``costs`` (:class:`CostModel`, measured on this
    machine: ``decode`` and the slots engine measure it once per shape when
    ``costs`` is None). Drafting must promise ``1 + margin`` times a plain
    step's tokens per unit of cost: the costs and estimates are measured, not
    known, and a draft that only breaks even on paper loses where they err
    (at batch 4 on a 2-core CPU the loop's drafting cycles cost a fifth to a
    quarter more than their parts; at batch 1 on a 4-bit target they cost a
    tenth to a fifth less). Costs timed in the loop itself (``CostModel.measured``:
    ``timed`` below, or the server's live step times) hold what the parts miss,
    and drafting must then promise only ``1 + timed_margin``. ``timed``:
    whether ``decode`` also times its own loop forced to each ``k``
    (:func:`specjax.engine.calibrate_costs`, once per program in a process)
    and chooses by those times: None (the default) only
    where the parts cannot decide, their best draft's gain over a plain step
    at the prior lying within the parts' error of ``1 + margin``
    (:func:`specjax.engine.parts_undecided`); True always; False never (see
    docs/drafting.md). Draft lengths whose promised rates lie within the
    factor ``1 + tie`` of the best drafting length's are tied, and the
    shortest of them is drafted: the timed costs err by 0.02-0.05 of a step
    between calibrations on a 2-core CPU, and a deep slot's estimate leans
    on the slot before's, so a longer draft that promises only a little more
    than a shorter one does not deliver it (on the GGUF's 4-bit target at
    batch 1, T=1, one and two drafts promised the same and auto drafted 1.56
    a cycle, 0.90 of fixed K=1's speed). With a context lookup (``decode(..., lookup=)``), each
    sequence also chooses whether to take its copies: only while the lookup's
    first-slot proposals would have been accepted more often than the
    drafter's own first tokens (each cycle's verification tells both, whichever
    took the slot; decayed by ``memory`` and shrunk towards ``prior``;
    ``choose_copies=False`` always copies, as other policies do). The choice depends only on past cycles, so a lossless
    rule stays lossless and greedy output stays the target's. A ``decode``
    call whose first cycle would draft nothing at the prior
    (:func:`drafts_before_evidence`) runs ``generate``'s program instead,
    which carries no draft. The idea is
    vLLM's and SGLang's adaptive draft length: "Optimizing Speculative
    Decoding for Serving Large Language Models Using Goodput" (SmartSpec,
    arXiv:2406.14066).
    """
    check_interval("auto(memory)", memory, 0.0, 1.0)
    check_interval("auto(prior)", prior, 0.0, 1.0)
    check_interval("auto(prior_weight)", prior_weight, 0.0, 1e6, open_lo=True)
    check_interval("auto(margin)", margin, 0.0, 10.0)
    check_interval("auto(timed_margin)", timed_margin, 0.0, 10.0)
    check_interval("auto(tie)", tie, 0.0, 1.0)
    if costs is not None and not isinstance(costs, CostModel):
        raise TypeError(f"auto(costs=...) takes a CostModel (specjax.engine.measure_costs), got {type(costs).__name__}.")
    if timed is not None and not isinstance(timed, bool):
        raise TypeError(f"auto(timed=...) takes True, False or None (where the parts cannot decide), got {timed!r}.")
    if not isinstance(choose_copies, bool):
        raise TypeError(f"auto(choose_copies=...) takes True or False, got {choose_copies!r}.")
    return Auto(costs=costs, memory=memory, prior=prior, prior_weight=prior_weight, margin=margin,
                timed_margin=timed_margin, tie=tie, timed=timed, choose_copies=choose_copies)


def drafts_before_evidence(policy: DraftingPolicy, num_draft: int, sizes=None, top_k: int = 1) -> bool:
    """Whether ``policy`` drafts in its first cycle, before any acceptance
    has been seen (its initial state, one live sequence). Only a policy that
    ``may_draft_none`` can answer False: :func:`auto` whose costs say that
    drafts accepted at its prior do not pay (``decode`` then runs the
    target-only program). With costs timed in the loop, drafting must also
    beat the target-only step itself (their unit where ``decode`` timed
    ``generate`` beside the loop), whose cost the drafting program's plain
    cycle exceeds by its draft's catch-up and its own work. ``sizes``: a dynamic tree's verification widths
    (``n + 1`` for each node count ``n`` auto chooses from), whose ``depth``
    is ``num_draft`` and frontier ``top_k``."""
    if not policy.may_draft_none:
        return True
    first = bool(_first_plan(policy, num_draft, None if sizes is None else tuple(sizes), top_k) > 0)
    if not first or not isinstance(policy, Auto):
        return first
    # Costs timed in the loop: against generate's step, which decode runs instead (their unit where
    # decode timed generate beside the loop), not against the drafting program's own plain cycle,
    # which also carries the draft's catch-up and the cycle's work.
    return bool(_beats_target_only(policy, num_draft, None if sizes is None else tuple(sizes), top_k))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _beats_target_only(policy: "Auto", num_draft: int, sizes, top_k: int) -> Array:
    """Whether, with costs timed in the loop, some ``k >= 1`` (a tree: some node count of
    ``sizes - 1``) promises ``1 + timed_margin`` tokens per unit of cost at the prior: more
    than a target-only step's one token for one unit. True for the parts' costs, whose plain
    cycle is already weighed against drafting by :meth:`Auto.plan`."""
    if sizes is None:
        expected = expected_tokens(policy.acceptance(policy.init(num_draft)))
        costs, most = policy._choice_costs(num_draft)[0], num_draft
    else:
        counts = tuple(w - 1 for w in sizes)
        expected = policy.tree_expected(policy.init(counts[-1]), counts, top_k)
        costs, most = policy.tree_costs(counts, num_draft), counts[-1]
    timed = policy.costs.at_batch(1).is_timed(most)
    return ~timed | (jnp.max(expected[1:] / costs[1:]) >= 1.0 + policy.timed_margin)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _first_plan(policy: DraftingPolicy, num_draft: int, sizes, top_k: int) -> Array:
    """The draft length (or a tree's size index) ``policy`` plans for one live sequence in its initial
    state. Jitted: ``decode`` asks at every call, and run op by op the plan took about 5 ms of host time."""
    live = jnp.ones((1,), bool)
    if sizes is not None:
        counts = tuple(w - 1 for w in sizes)
        state = jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], policy.init(counts[-1]))
        return policy.plan_tree(state, live, counts, num_draft, top_k)
    state = jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], policy.init(num_draft))
    return policy.plan(state, live, num_draft)[0]


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


def boolean(value: str) -> bool:
    """``"true"``/``"1"``/``"yes"`` or ``"false"``/``"0"``/``"no"`` (any case), as the CLI's specs write a flag."""
    word = value.strip().lower()
    if word in ("true", "1", "yes"):
        return True
    if word in ("false", "0", "no"):
        return False
    raise ValueError(f"{value!r} is not true or false")


_POLICIES = {
    "fixed": (fixed, {"k": int}),
    "adasd_entropy": (adasd_entropy, {"window": int}),
    "heuristic": (heuristic, {"initial": int}),
    "confidence": (confidence, {"threshold": float}),
    "auto": (auto, {"memory": float, "prior": float, "prior_weight": float, "margin": float,
                     "timed_margin": float, "tie": float, "timed": boolean}),
}


def parse_drafting(spec: str) -> DraftingPolicy:
    """A policy from a spec string, the CLI's syntax: ``"auto"``, ``"fixed"``, ``"fixed:k=3"``,
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
