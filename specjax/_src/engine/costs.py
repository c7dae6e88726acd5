"""What a draft-verify cycle costs on this machine: measured, for :func:`specjax.drafting.auto`.

Whether speculation pays depends on the machine, the batch and the models:
on a 2-core CPU a 4-token verification of SmolLM2-135M costs about 1.1
one-token forwards at batch 1 and far more at batch 8; on a GPU a small
target's forward is launch-bound and a head step costs a sixth of it. So
the costs are measured where the engine runs, with the shapes it will run:

* the target's forward at each width the loop's verification may run
  (``Buckets.verify``: 1, 2, 4, ..., ``K + 1``), over a cache of the loop's
  length holding ``context`` tokens;
* the draft's first step of a cycle (a draft model's two-token forward, a
  feature head's ``K + 1``-token one, with its features) and a further step,
  each with its slot's sampling over the vocabulary;
* the cycle's own work when it drafted: the target's distributions over the
  ``K + 1`` positions, the lossless rule's verdict, the emitted token's sample
  (on a large vocabulary at batch 4 this was a fifth of a target forward).

Each is jitted on its own, warmed up, then timed in turns (``repeats``
rounds, every contender once a round, so a slow spell of a shared machine
hits them alike); the medians, divided by the one-token forward's, form a
:class:`~specjax._src.proposals.drafting.CostModel`. Only shapes and dtypes matter, so
a measurement is kept per (models, shapes, batch, ``K``, widths, cache
length, platform) for the life of the process (:func:`cached_costs`).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.proposals import drafting as drafting_lib
from specjax._src.logits import sampling
from specjax._src.foundation.checks import check_positive_int
from specjax._src.models.feature_head import is_feature_head
from specjax._src.models.pairing import ModelPair
from specjax._src.rules.base import VerifyInputs, speculative_sampling

Array = jax.Array

_MEASURED: dict = {}
_CALIBRATED: dict = {}
_LAST: list = []


def measure_costs(params: ModelPair, *, batch: int = 1, num_draft: int = 4,
                  verify_widths: Optional[Sequence[int]] = None, cache_length: int = 512, context: int = 64,
                  repeats: int = 7, tree=None) -> drafting_lib.CostModel:
    """Times one cycle's pieces on this machine and returns their costs.

    Args:
      params: ``specjax.pair(target, draft)`` (a draft model or a feature head).
      batch: sequences per forward (the loop's batch bucket, or the engine's slots).
      num_draft: K, the most drafts per cycle.
      verify_widths: the widths the verification forward is compiled at
        (ascending, the last ``K + 1``); None: ``K + 1`` only, as a loop
        without ``Buckets.verify`` runs.
      cache_length: each cache's capacity, as the loop allocates it.
      context: tokens already in the caches when timed (attention reads them).
      repeats: timed rounds after one warm-up call each (more, up to 20x, where
        a one-token forward takes under 7 ms, so that about 50 ms is timed).
      tree: a :class:`specjax.trees.DynamicTree` whose size :func:`specjax.drafting.auto`
        chooses (``num_draft`` is then its ``num_nodes``): its draft steps are
        timed as it runs them, a feature head's first one over ``depth + 1``
        tokens and each further one over a level's ``top_k`` frontier nodes,
        each drawing children over the vocabulary.

    Returns:
      A :class:`~specjax._src.proposals.drafting.CostModel` in units of the target's
      one-token forward at this batch.
    """
    batch = check_positive_int("batch", batch)
    num_draft = check_positive_int("num_draft", num_draft)
    widths = tuple(sorted(set(verify_widths or ()))) or (num_draft + 1,)
    if widths[-1] != num_draft + 1 or widths[0] < 1:
        raise ValueError(f"verify_widths must lie in 1 .. num_draft + 1 and end at num_draft + 1 = "
                         f"{num_draft + 1}; got {tuple(verify_widths)}.")
    context = min(context, cache_length - 2 * (num_draft + 2))
    if context < 1:
        raise ValueError(f"cache_length {cache_length} leaves no room for a context before K + 1 = "
                         f"{num_draft + 1} tokens; give a longer cache.")
    target, draft = params.target, params.draft
    head = is_feature_head(draft.module)
    head_layers = tuple(draft.module.feature_layers) if head else ()
    runs = {1: _forward(target, batch, 1, context, cache_length, hidden_layers=head_layers)}
    for w in widths:
        runs.setdefault(w, _forward(target, batch, w, context, cache_length, hidden_layers=head_layers))
    depth, rows = (num_draft, 1) if tree is None else (tree.depth, tree.top_k)
    if tree is not None and num_draft != tree.num_kept:
        raise ValueError(f"measure_costs(tree=...) verifies up to the tree's {tree.num_kept} nodes: pass "
                         f"num_draft={tree.num_kept}, got {num_draft}.")
    first_width = depth + 1 if head else 2
    runs["draft_first"] = _forward(draft, batch, first_width, context, cache_length, features=head,
                                   logits_at=head or getattr(draft.module, "supports_logits_at", False))
    runs["draft_step"] = _forward(draft, batch, rows, context, cache_length, features=head)
    runs["slot_work"] = _slot_work(batch, params.vocab_size)
    runs["cycle_work"] = _cycle_work(batch, num_draft, params.vocab_size)
    times = {name: [] for name in runs}
    # Small models' forwards take well under a millisecond: time enough rounds for a stable median.
    start = time.perf_counter()
    runs[1]()
    rounds = int(min(max(repeats, 0.05 / max(time.perf_counter() - start, 1e-6)), 20 * repeats))
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    median = {name: float(np.median(t)) for name, t in times.items()}
    unit = median[1]
    at_width = [median[next(w for w in widths if w >= need)] / unit for need in range(1, num_draft + 2)]
    slot = median["slot_work"]  # each drafted slot is also warped, sampled and scored over the vocabulary
    return drafting_lib.CostModel(
        verify=jnp.asarray(nondecreasing(at_width), jnp.float32),
        draft_first=jnp.float32((median["draft_first"] + slot) / unit),
        draft_step=jnp.float32((median["draft_step"] + rows * slot) / unit),
        cycle=jnp.float32(median["cycle_work"] / unit),
        forward_ms=jnp.float32(1e3 * unit),
        batch=jnp.float32(batch),
        measured=jnp.zeros((num_draft + 1,), jnp.float32),
    )


def _forward(model, batch: int, width: int, context: int, cache_length: int, *, hidden_layers=(),
             features: bool = False, logits_at: bool = False):
    """A warmed-up, jitted forward of ``width`` tokens over a cache holding ``context`` entries."""
    module, params = model.module, model.params
    cache = module.init_cache(batch, cache_length).rollback(jnp.full((batch,), context, jnp.int32))
    traced = {}
    if features:
        traced["features"] = jnp.ones((batch, width, module.hidden_size), jnp.float32)
    if logits_at:
        traced["logits_at"] = jnp.full((batch,), width - 1, jnp.int32)
    static = {"hidden_layers": hidden_layers} if hidden_layers else {}
    tokens = jnp.ones((batch, width), jnp.int32)
    forward = jax.jit(lambda params, cache, tokens, traced: module.apply(params, tokens, cache, **static,
                                                                         **traced).logits)

    def run():
        jax.block_until_ready(forward(params, cache, tokens, traced))

    run()
    return run


def _slot_work(batch: int, vocab: int):
    """A warmed-up, jitted draft slot's work besides its forward: the
    distribution over the vocabulary, its entropy, a sample and its probability."""
    logits = jax.random.normal(jax.random.key(0), (batch, vocab), jnp.float32)
    u = jnp.full((batch,), 0.5, jnp.float32)

    @jax.jit
    def work(logits, u):
        probs = jax.nn.softmax(logits, axis=-1)
        token = sampling.sample_categorical(probs, u)
        return token, jnp.take_along_axis(probs, token[:, None], axis=-1), sampling.entropy(probs)

    return _warm(lambda: work(logits, u))


def _cycle_work(batch: int, num_draft: int, vocab: int):
    """A warmed-up, jitted cycle's work besides its forwards, for a cycle that
    drafted: the target's ``K + 1`` distributions over the vocabulary, the
    lossless rule's verdict on ``K`` slots, the emitted token's sample and the
    non-finite checks (what every drafting cycle pays, whatever it drafted: the
    buffers are ``K`` wide)."""
    k = num_draft
    keys = jax.random.split(jax.random.key(0), 2)
    target = jax.random.normal(keys[0], (batch, k + 1, vocab), jnp.float32)
    draft = jax.random.normal(keys[1], (batch, k, vocab), jnp.float32)
    u = jnp.full((batch, k), 0.5, jnp.float32)
    rule = speculative_sampling()
    rule_state = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (batch,) + jnp.shape(x)), rule.init())

    @jax.jit
    def work(target, draft, u):
        target_probs, draft_probs = jax.nn.softmax(target, -1), jax.nn.softmax(draft, -1)
        inputs = VerifyInputs(draft_tokens=sampling.argmax(draft), draft_logits=draft, draft_probs=draft_probs,
                              target_logits=target, target_probs=target_probs, uniforms=u,
                              valid=jnp.ones((batch, k), bool), features={})
        verdict = jax.vmap(lambda i, s: rule.verify(i, s, greedy=False))(inputs, rule_state)
        n = jnp.cumprod(jnp.asarray(verdict.accept, jnp.int32), axis=1).sum(1)
        correction = jnp.take_along_axis(verdict.correction, jnp.minimum(n, k - 1)[:, None, None], axis=1)[:, 0]
        bonus = jnp.take_along_axis(target_probs, n[:, None, None], axis=1)[:, 0]
        return (sampling.sample_categorical(correction, u[:, 0]), sampling.sample_categorical(bonus, u[:, 0]),
                sampling.nonfinite_rows(target).any(-1))

    return _warm(lambda: work(target, draft, u))


def _warm(call):
    """``call`` run once (compiled), as a function that runs it and waits for it."""
    def run():
        jax.block_until_ready(call())

    run()
    return run


def cached_costs(params: ModelPair, *, batch: int, num_draft: int, verify_widths: Optional[Sequence[int]],
                 cache_length: int, tree=None) -> drafting_lib.CostModel:
    """:func:`measure_costs` once per shape in this process (costs depend on
    the models' shapes and dtypes and the loop's, not on the weights' values)."""
    key = (shape_key(params), batch, num_draft, tuple(verify_widths or ()), cache_length, tree)
    if key not in _MEASURED:
        _MEASURED[key] = measure_costs(params, batch=batch, num_draft=num_draft, verify_widths=verify_widths,
                                       cache_length=cache_length, tree=tree)
    _LAST[:] = [_MEASURED[key]]
    return _MEASURED[key]


def cached_costs_by_batch(params: ModelPair, *, batches: Sequence[int], num_draft: int,
                          verify_widths: Optional[Sequence[int]], cache_length: int,
                          tree=None) -> drafting_lib.CostModel:
    """:func:`cached_costs` at each of ``batches`` (ascending), stacked
    (:func:`~specjax.drafting.stack_costs`): the slots engine's steps run at
    its row buckets, and whether a draft pays differs between 1 and 8 rows."""
    costs = drafting_lib.stack_costs([cached_costs(params, batch=b, num_draft=num_draft, verify_widths=verify_widths,
                                                   cache_length=cache_length, tree=tree) for b in batches])
    _LAST[:] = [costs]
    return costs


def cached_calibration(key, costs: drafting_lib.CostModel, run, baseline=None,
                       lengths: Optional[Sequence[int]] = None) -> drafting_lib.CostModel:
    """:func:`calibrate_costs` once per ``key`` (the loop's static settings and shapes) in this process."""
    if key not in _CALIBRATED:
        _CALIBRATED[key] = calibrate_costs(costs, run, baseline=baseline, lengths=lengths)
    _LAST[:] = [_CALIBRATED[key]]
    return _CALIBRATED[key]


def find_auto(policy: drafting_lib.DraftingPolicy) -> Optional[drafting_lib.Auto]:
    """The first :func:`~specjax.drafting.auto` inside ``policy``, or None."""
    if isinstance(policy, drafting_lib.Auto):
        return policy
    if isinstance(policy, drafting_lib.Combine):
        return next((a for a in map(find_auto, policy.policies) if a is not None), None)
    return None


def auto_costs(policy: drafting_lib.DraftingPolicy) -> Optional[drafting_lib.CostModel]:
    """The costs of the first :func:`~specjax.drafting.auto` inside ``policy``, or None."""
    found = find_auto(policy)
    return None if found is None else found.costs


def last_measured() -> Optional[drafting_lib.CostModel]:
    """The costs the last ``decode`` or ``Engine`` with :func:`~specjax.drafting.auto` used (for reports)."""
    return _LAST[0] if _LAST else None


def forcing(costs: drafting_lib.CostModel, k: int) -> drafting_lib.CostModel:
    """Costs of ``costs``' shapes under which :func:`~specjax.drafting.auto`
    always drafts ``k`` tokens (every other length costs a million cycles)."""
    lengths = jnp.arange(costs.verify.shape[-1])
    verify = jnp.broadcast_to(jnp.where(lengths == k, 1.0, 1e6), costs.verify.shape)  # stacked: every row bucket
    return costs.replace(verify=verify.astype(jnp.float32),
                         draft_first=jnp.zeros_like(costs.draft_first), draft_step=jnp.zeros_like(costs.draft_step),
                         cycle=jnp.zeros_like(costs.cycle), measured=jnp.zeros_like(costs.measured))


def calibrate_costs(costs: drafting_lib.CostModel, run, *, baseline=None, lengths: Optional[Sequence[int]] = None,
                    short: int = 2, long: int = 24, repeats: int = 3) -> drafting_lib.CostModel:
    """``costs`` with :attr:`~specjax.drafting.CostModel.measured` timed in the loop itself.

    ``run(costs, max_new_tokens) -> (seconds, cycles)`` runs the loop's own
    program (the same compiled shapes the real call uses: only traced values
    change) with ``auto(costs)`` and returns its wall time and loop cycles.
    One untimed call compiles the program. Then, ``repeats`` times, for each
    ``k`` in turn, the policy is forced (``forcing``) and the loop run to
    ``short`` and to ``long`` tokens; each run's fastest time is kept (a busy
    machine only ever adds time), and the extra time over the extra cycles is
    a cycle's cost, the prefill cancelling out. A plain length's cost includes
    the draft's catch-up every ``K`` cycles. Where some length gives no extra
    cycles (every sequence ended early), ``costs`` is returned as it was.

    ``baseline(max_new_tokens) -> (seconds, steps)``: ``generate``'s program on
    the same call, timed in the same turns. Where given, the costs are in units
    of its step, so ``measured[0]`` tells what a plain cycle of the drafting
    program costs against ``generate``'s (which ``decode`` runs when drafting
    does not pay from the start; :func:`~specjax.drafting.drafts_before_evidence`);
    else in units of the drafting program's own plain cycle.

    ``lengths``: the ``k`` the policy chooses from, ascending from 0 (default every
    ``0 .. K``); a dynamic tree's node counts (``0, 1, 2, 4, ..., num_nodes``). A
    ``k`` between two of them is given the next one's cost (it is never chosen).
    """
    lengths = tuple(range(costs.max_draft + 1) if lengths is None else lengths)
    if lengths[0] != 0 or list(lengths) != sorted(set(lengths)) or lengths[-1] > costs.max_draft:
        raise ValueError(f"calibrate_costs times lengths ascending from 0 up to the costs' {costs.max_draft}; "
                         f"got {lengths}.")
    timed = {k: (lambda n, k=k: run(forcing(costs, k), n)) for k in lengths}
    if baseline is not None:
        timed["generate"] = baseline
    timed[0](short)  # compiles: every forced length runs this one program
    if baseline is not None:
        baseline(short)
    fastest = {(k, n): (np.inf, 0) for k in timed for n in (short, long)}
    for _ in range(repeats):
        for k, go in timed.items():  # in turns, so that a slow spell of a shared machine hits each alike
            for n in (short, long):
                seconds, cycles = go(n)
                fastest[k, n] = (min(fastest[k, n][0], seconds), cycles)

    def per_cycle_of(k):
        (t_short, c_short), (t_long, c_long) = fastest[k, short], fastest[k, long]
        return (t_long - t_short) / (c_long - c_short) if c_long > c_short else None

    per_cycle = [per_cycle_of(k) for k in lengths]
    if any(c is None for c in per_cycle) or min(per_cycle) <= 0:
        return costs  # sequences ended early, or a noisy machine timed a longer run as shorter: the parts
    unit = per_cycle_of("generate") if baseline is not None else None
    if unit is None or unit <= 0:
        unit = per_cycle[0]
    by_length = [per_cycle[next(i for i, k in enumerate(lengths) if k >= n)] for n in range(lengths[-1] + 1)]
    measured = np.zeros(costs.max_draft + 1)
    measured[: len(by_length)] = nondecreasing(np.array(by_length) / unit)
    return costs.replace(measured=jnp.asarray(measured, jnp.float32))


def nondecreasing(costs) -> np.ndarray:
    """``costs`` by draft length or width, made non-decreasing (a running
    maximum): a cycle drafting ``k + 1`` tokens, or a forward over one more
    token, does all the work of the shorter one, so timing it as cheaper is
    noise (on a busy 2-core machine ``k = 3`` once timed below ``k = 2``, and
    the policy then drafted 3 where neither paid)."""
    return np.maximum.accumulate(np.asarray(costs, np.float64))


def needs_costs(policy: drafting_lib.DraftingPolicy) -> bool:
    """Whether ``policy`` holds an :func:`~specjax.drafting.auto` without costs."""
    if isinstance(policy, drafting_lib.Auto):
        return policy.costs is None
    return isinstance(policy, drafting_lib.Combine) and any(map(needs_costs, policy.policies))


def timing_asked(policy: drafting_lib.DraftingPolicy) -> Optional[bool]:
    """Whether ``policy``'s :func:`~specjax.drafting.auto`, given without
    costs, asks ``decode`` to time its loop: its ``timed`` (True, False, or
    None: where :func:`parts_undecided`). False without such an ``auto``."""
    found = find_auto(policy)
    return found.timed if found is not None and found.costs is None else False


# How far the parts' sum may miss a drafting cycle's cost relative to a plain
# one, either way, as measured on the 2-core CPU: 20-25% under at batch 4 and
# 8 (float32), 10-20% over at batch 1 on the GGUF's 4-bit target.
PARTS_ERROR = 0.25


def parts_undecided(policy: drafting_lib.DraftingPolicy, num_draft: int, rows: int, tree=None,
                    sizes: Optional[Sequence[int]] = None) -> bool:
    """Whether the parts' costs cannot tell if drafting pays at the prior.

    The gain is the best draft length's expected tokens per unit of cost over
    a plain step's, every slot accepted at ``auto``'s ``prior``, at ``rows``
    rows. Drafting needs ``1 + margin``; where the gain lies within a factor
    ``1 + PARTS_ERROR`` of that, either way, the parts' error could flip the
    choice, and ``decode`` times its own loop (``auto(timed=None)``). With a
    dynamic ``tree`` sized by ``auto`` (``sizes``: its verification widths), the
    sizes' expected tokens at the tree's prior over their parts' costs."""
    found = find_auto(policy)
    if tree is not None:
        counts = tuple(w - 1 for w in sizes)
        if found is None or found.costs is None or found.costs.max_draft < counts[-1]:
            return False
        costs = np.asarray(found.tree_costs(counts, tree.max_depth, rows), np.float64)
        expected = np.asarray(found.tree_expected(found.init(counts[-1]), counts, tree.top_k), np.float64)
    else:
        if found is None or found.costs is None or found.costs.max_draft < num_draft:
            return False
        costs = np.asarray(found.costs.at_batch(rows).cycle_costs(num_draft), np.float64)
        expected = np.asarray(drafting_lib.expected_tokens(jnp.full((num_draft,), found.prior, jnp.float32)),
                              np.float64)
    goodput = expected / costs
    gain = goodput[1:].max() / goodput[0]
    need = 1.0 + float(found.margin)
    return bool(need / (1.0 + PARTS_ERROR) <= gain < need * (1.0 + PARTS_ERROR))


def set_costs(policy: drafting_lib.DraftingPolicy, costs: drafting_lib.CostModel) -> drafting_lib.DraftingPolicy:
    """``policy`` with every :func:`~specjax.drafting.auto` inside it given ``costs``."""
    if isinstance(policy, drafting_lib.Auto):
        return policy.replace(costs=costs)
    if isinstance(policy, drafting_lib.Combine):
        return policy.replace(policies=tuple(set_costs(p, costs) for p in policy.policies))
    return policy


def shape_key(params: ModelPair) -> tuple:
    """What costs depend on in a pair: its modules and its parameters' shapes and dtypes.

    Hashable as built (no strings formatted per leaf): ``decode`` asks for it at every call, and
    formatting the real pair's 718 leaves took 8-18 ms of a call's host time."""
    leaves, structure = jax.tree_util.tree_flatten((params.target.params, params.draft.params))
    shapes = tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves)
    return (repr(params.target.module), repr(params.draft.module), structure, shapes, jax.default_backend())


def with_costs(policy: drafting_lib.DraftingPolicy, measure) -> drafting_lib.DraftingPolicy:
    """``policy`` with every :func:`~specjax.drafting.auto` inside it that has
    no costs given ``measure()``'s (called at most once)."""
    measured = []

    def fill(p):
        if isinstance(p, drafting_lib.Auto) and p.costs is None:
            if not measured:
                measured.append(measure())
            return p.replace(costs=measured[0])
        if isinstance(p, drafting_lib.Combine):
            return p.replace(policies=tuple(fill(q) for q in p.policies))
        return p

    return fill(policy)
