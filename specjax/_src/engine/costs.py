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
  feature head's ``K + 1``-token one, with its features) and a further step.

Each is jitted on its own, warmed up, then timed in turns (``repeats``
rounds, every contender once a round, so a slow spell of a shared machine
hits them alike); the medians, divided by the one-token forward's, form a
:class:`~specjax._src.drafting.CostModel`. Only shapes and dtypes matter, so
a measurement is kept per (models, shapes, batch, ``K``, widths, cache
length, platform) for the life of the process (:func:`cached_costs`).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src import drafting as drafting_lib
from specjax._src.checks import check_positive_int
from specjax._src.models.feature_head import is_feature_head
from specjax._src.pairing import ModelPair

Array = jax.Array

_MEASURED: dict = {}
_LAST: list = []


def measure_costs(params: ModelPair, *, batch: int = 1, num_draft: int = 4,
                  verify_widths: Optional[Sequence[int]] = None, cache_length: int = 512, context: int = 64,
                  repeats: int = 7) -> drafting_lib.CostModel:
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

    Returns:
      A :class:`~specjax._src.drafting.CostModel` in units of the target's
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
    first_width = num_draft + 1 if head else 2
    runs["draft_first"] = _forward(draft, batch, first_width, context, cache_length, features=head,
                                   logits_at=head or getattr(draft.module, "supports_logits_at", False))
    runs["draft_step"] = _forward(draft, batch, 1, context, cache_length, features=head)
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
    return drafting_lib.CostModel(
        verify=jnp.asarray(at_width, jnp.float32),
        draft_first=jnp.float32(median["draft_first"] / unit),
        draft_step=jnp.float32(median["draft_step"] / unit),
        forward_ms=jnp.float32(1e3 * unit),
        batch=jnp.float32(batch),
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


def cached_costs(params: ModelPair, *, batch: int, num_draft: int, verify_widths: Optional[Sequence[int]],
                 cache_length: int) -> drafting_lib.CostModel:
    """:func:`measure_costs` once per shape in this process (costs depend on
    the models' shapes and dtypes and the loop's, not on the weights' values)."""
    shapes = jax.tree_util.tree_map(lambda x: (tuple(np.shape(x)), str(getattr(x, "dtype", type(x)))),
                                    (params.target.params, params.draft.params))
    key = (repr(params.target.module), repr(params.draft.module), str(jax.tree_util.tree_structure(shapes)),
           str(jax.tree_util.tree_leaves(shapes)), batch, num_draft, tuple(verify_widths or ()), cache_length,
           jax.default_backend())
    if key not in _MEASURED:
        _MEASURED[key] = measure_costs(params, batch=batch, num_draft=num_draft, verify_widths=verify_widths,
                                       cache_length=cache_length)
    _LAST[:] = [_MEASURED[key]]
    return _MEASURED[key]


def last_measured() -> Optional[drafting_lib.CostModel]:
    """The costs the last ``decode`` or ``Engine`` with :func:`~specjax.drafting.auto` used (for reports)."""
    return _LAST[0] if _LAST else None


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
