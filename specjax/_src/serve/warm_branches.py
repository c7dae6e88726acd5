"""The server's warm-up pass over every branch of its step programs.

The draft length and the attention's key width each pick a branch of a ``lax.switch`` in the
slots engine's step, and XLA's CPU runtime prepares a branch's kernels the first time it runs
it: on the real pair at four rows, 100-150 ms over a 40 ms cycle. Served, those fell on the
first requests, and :class:`~specjax.engine.LiveCosts` records no sample at a branch's first
run, so a length met at a new width went untimed (docs/drafting.md).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from specjax._src.engine.live_costs import LiveCosts
from specjax._src.engine.slots import Engine, SlotSettings


def branch_warmup_prompts(widths: Sequence[int], num_draft: int, capacity: int) -> list[tuple[int, int]]:
    """``(width index, prompt length)`` for each of ``widths`` (a step's key widths, ascending):
    a prompt whose step reads that width at every draft length up to ``num_draft`` (one position
    past the width before; the first width: one token). Widths no such prompt fits are left out."""
    room, longest = num_draft + 1, capacity - 2
    out = []
    for j, width in enumerate(widths):
        length = 1 if j == 0 else widths[j - 1] + 1
        if length + room <= min(width, longest):
            out.append((j, length))
    return out


def run_every_branch(engine: Engine, live: LiveCosts, state, programs: Sequence[SlotSettings],
                     record: Callable, check_stop: Callable[[], None] = lambda: None):
    """Runs one cycle of every (row bucket, step program, draft length, key width) that ``live``
    has not seen run, and returns the state with every slot it used free again.

    ``programs``: one request's settings per step program (the first alone without
    ``engine.specialized_steps``). ``record(rows, ran [S], drafted [S, K], program, longest)``
    is given each step's cycles and drafted-slot counts per slot it ran, and the longest row
    before and after it (the scheduler notes them in ``live``, untimed). ``check_stop`` raises to
    abandon the pass. One long request in slot 0 sets the width every row of a step reads; a
    one-token request in a bucket's last slot makes the step run that bucket."""
    chosen = programs if engine.specialized_steps else programs[:1]
    widths = engine.attention_widths()

    def longest(state, slots):
        return int(np.max(np.asarray(state.loop.target_cache.lengths)[list(slots)]))

    for j, length in branch_warmup_prompts(widths, engine.num_draft, engine.capacity):
        prompt = [0] * length
        settings = SlotSettings(temperature=0.0, max_new_tokens=engine.capacity - length, seed=0, eos_token_id=())
        state = engine.insert(state, 0, prompt, settings)
        for rows in engine.row_buckets:
            slots = sorted({0, rows - 1})
            if rows > 1:
                state = engine.insert(state, rows - 1, [0], settings)
            for program_settings in chosen:
                plan = engine.plan({slot: program_settings for slot in slots})
                for k in range(live.num_lengths):
                    if live.has_run(plan.rows, plan.program, k, j):
                        continue
                    check_stop()
                    before = longest(state, slots)
                    if before + live.num_lengths > widths[j]:  # it would leave width j: start it again
                        state = engine.insert(engine.release(state, 0), 0, prompt, settings)
                        before = longest(state, slots)
                    stats = state.loop.stats
                    cycles, drafted = np.asarray(stats.cycles)[slots], np.asarray(stats.drafted_at)[slots]
                    state, _ = engine.step(state, 1, plan=plan, costs=live.forced_costs(k))
                    stats = state.loop.stats
                    record(plan.rows, np.asarray(stats.cycles)[slots] - cycles,
                           np.asarray(stats.drafted_at)[slots] - drafted, plan.program,
                           (before, longest(state, slots)))
            if rows > 1:
                state = engine.release(state, rows - 1)
        state = engine.release(state, 0)
    jax.block_until_ready(state)
    return state
