"""LiveCosts: drafting.auto()'s costs refreshed from the slots engine's own step times.

The estimator is checked on synthetic timings (no clock, nothing compiled);
one engine and one scheduler check that a forced length runs as forced,
that serving records the step times, and that output stays the target's.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import drafting
from specjax._src.engine.live_costs import step_draft_length, widths_read
from specjax._src.serve import scheduler as sched
from specjax._src.serve.metrics import Counters, latency_histograms, prometheus_text
from specjax._src.serve.warm_branches import run_every_branch
from specjax.engine import Engine, LiveCosts, SlotSettings
from specjax.testing import llama_config, peaked_target_and_draft

from test_auto_drafting import cost_model

K = 3
EXPENSIVE = cost_model(first=0.5, step=0.5, verify=[1.0, 3.0, 5.0, 7.0])  # the parts say: never draft


def stacked(one=EXPENSIVE, four=EXPENSIVE):
    return drafting.stack_costs([one, four.replace(batch=jnp.float32(4))])


def sure_drafts(rows: int = 1):
    """An auto state whose drafts were always accepted, for ``rows`` sequences."""
    state = drafting.AutoState(jnp.full((rows, K), 50.0), jnp.full((rows, K), 50.0))
    return state, jnp.ones((rows,), bool)


def note(live, rows, k, seconds):
    """One timed step of length ``k``, after the (untimed) step that switched to it where the last one's differed."""
    live.observe(rows, k, None)
    live.observe(rows, k, seconds)


def feed(live, rows, seconds_by_length, times):
    for _ in range(times):
        for k, seconds in enumerate(seconds_by_length):
            note(live, rows, k, seconds)


def test_costs_come_from_the_steps_once_every_length_is_timed():
    """Where the parts say a draft never pays but the steps say it costs 10% a token, auto drafts
    K at that row bucket, and not before every length has its samples (the negative control)."""
    live = LiveCosts(stacked(), min_samples=3)
    policy = lambda costs: drafting.auto(costs)  # noqa: E731
    state, alive = sure_drafts()
    assert int(policy(live.costs()).plan(state, alive, K)[0]) == 0
    feed(live, 1, [0.010, 0.011, 0.012, 0.013], times=2)
    note(live, 1, 0, 0.010)  # k = 0 has 3, the others 2: still the parts
    assert (np.asarray(live.costs().measured) == 0).all()
    assert int(policy(live.costs()).plan(state, alive, K)[0]) == 0
    feed(live, 1, [0.010, 0.011, 0.012, 0.013], times=1)
    measured = np.asarray(live.costs().measured)
    np.testing.assert_allclose(measured[0], [1.0, 1.1, 1.2, 1.3], rtol=1e-6)
    assert (measured[1] == 0).all()  # four rows: nothing timed, its parts stand
    assert int(policy(live.costs()).plan(state, alive, K)[0]) == K
    four_state, four_alive = sure_drafts(4)
    assert int(policy(live.costs()).plan(four_state, four_alive, K)[0]) == 0


def test_timings_are_medians_and_never_cheaper_for_a_longer_draft():
    """A step that compiled (100x) is one sample of the window; a length timed below a shorter one
    (it does all its work) is pooled with it: as many samples each, both cost their mean."""
    live = LiveCosts(EXPENSIVE, min_samples=3)
    feed(live, 1, [0.010, 0.020, 0.015, 0.030], times=3)
    live.observe(1, 3, 3.0)
    np.testing.assert_allclose(np.asarray(live.costs().measured), [1.0, 1.75, 1.75, 3.0], rtol=1e-6)
    assert live.samples().tolist() == [[3, 3, 3, 4]]
    report = live.report()
    assert report["rows"] == [1] and report["samples"] == [[3, 3, 3, 4]]
    np.testing.assert_allclose(report["relative"][0], [1.0, 1.75, 1.75, 3.0], rtol=1e-6)
    text = prometheus_text(_metrics_with(report))
    assert 'specjax_cycle_seconds{rows="1",draft_length="2"} 0.015' in text
    assert 'specjax_cycle_cost{rows="1",draft_length="3"} 3.0' in text


def test_a_busy_spell_does_not_make_the_lengths_it_timed_look_dear():
    """The drafting lengths timed only during a spell that slowed every step twofold, the plain
    cycle before, during and after it: each length costs its time over the plain steps timed
    around it (1.25, 1.45, 1.725 plain cycles), not over the quiet plain median (2.5, 2.9, 3.45,
    what comparing the medians gave). The control: the same lengths dear in quiet times stay dear."""
    quiet = [0.040, 0.050, 0.058, 0.069]
    live = LiveCosts(EXPENSIVE, min_samples=3)
    feed(live, 4, quiet[:1], times=8)
    for _ in range(3):  # the spell: plain steps as the policy chose them, and one forced step of each length
        feed(live, 4, [2 * quiet[0]], times=4)
        for k in (1, 2, 3):
            note(live, 4, k, 2 * quiet[k])
        feed(live, 4, [2 * quiet[0]], times=4)
    feed(live, 4, quiet[:1], times=24)
    np.testing.assert_allclose(np.asarray(live.costs().measured), [1.0, 1.25, 1.45, 1.725], rtol=1e-6)
    assert live.seconds()[0, 0] == pytest.approx(0.040)  # the plain cycles' median is the quiet one

    dear = LiveCosts(EXPENSIVE, min_samples=3)
    feed(dear, 4, [0.040, 0.100, 0.116, 0.138], times=3)
    feed(dear, 4, quiet[:1], times=24)
    np.testing.assert_allclose(np.asarray(dear.costs().measured), [1.0, 2.5, 2.9, 3.45], rtol=1e-6)


def _metrics_with(report):
    m = dataclasses.asdict(Counters())
    m.update(queue_depth=0, live_slots=0, num_slots=1, latency=latency_histograms(), host_share=0.0, cycle_costs=report)
    return m


def test_exploration_times_every_length_then_two_steps_in_explore_every():
    """A policy that always drafts K: forced steps time the other lengths, a pair every four steps
    until each has its samples, then a pair in ``explore_every``, each time the length timed
    longest ago; only the second step of a pair is a sample."""
    live = LiveCosts(EXPENSIVE, min_samples=2, explore_every=10, warmup_explore_every=4)
    forced = []
    for step in range(1, 101):
        k = live.explore(1)
        forced.append((step, k))
        live.observe(1, K if k is None else k, 0.01)
    forced = [(step, k) for step, k in forced if k is not None]
    assert [k for _, k in forced[:12]] == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]  # never timed first, then the oldest
    assert [step for step, _ in forced[:12]] == [4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25]
    after = [(step, k) for step, k in forced if step > 25]
    assert [step for step, _ in after] == [30, 31, 40, 41, 50, 51, 60, 61, 70, 71, 80, 81, 90, 91, 100]
    assert [k for _, k in after] == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2, 0, 0, 1]
    # One sample per whole pair: five of length 0, four of 1 (step 100 began a fifth) and of 2.
    assert live.samples()[0, :3].tolist() == [5, 4, 4]


def test_the_first_step_after_a_length_changes_is_not_a_sample():
    """In the server a step that changed the draft length ran up to 150 ms longer than a cycle of
    its length (mostly a branch's first run): neither that step nor the one switching back is a
    sample of the length it ran. The control: the same switch, timed, would have made a plain cycle look
    20 times dearer than its steady ones."""
    live = LiveCosts(EXPENSIVE, min_samples=1)
    steps = [(K, 0.010)] * 4 + [(0, 0.140), (0, 0.007), (K, 0.150)] + [(K, 0.010)] * 4 + [(None, 0.01), (K, 0.2)]
    for k, seconds in steps:
        live.observe(1, k, seconds)
    np.testing.assert_allclose(live.seconds()[0, [0, K]], [0.007, 0.010])
    assert live.samples()[0].tolist() == [1, 0, 0, 7]
    np.testing.assert_allclose(live.relative(1)[[0, K]], [1.0, 0.010 / 0.007], rtol=1e-6)
    # So is the first step after a change of row bucket or of program, at any length.
    live.observe(4, K, 0.3)
    live.observe(1, K, 0.4)
    live.observe(1, K, 0.5, program="sampled")
    live.observe(1, K, 0.010, program="sampled")
    assert live.samples()[:, K].tolist() == [8]
    timed_every_step = np.median([0.140, 0.007])  # what recording the switch gave the plain cycle
    assert timed_every_step > 10 * 0.007


def test_a_step_that_runs_a_length_at_a_key_width_for_the_first_time_is_not_a_sample():
    """XLA's CPU runtime prepares a branch's kernels the first time it runs: the real pair's step
    ran 100-150 ms longer the first time a draft length met a new key width. Such a step is no
    sample of its length; the next one at the same width is, and so is one at a width already run
    (the control: with no widths given, the first run is recorded)."""
    live = LiveCosts(EXPENSIVE, min_samples=1)
    live.observe(1, K, None, widths=(0,))  # switched to K: noted, not timed
    live.observe(1, K, 0.010, widths=(0,))  # K at width 0 ran in the step before
    live.observe(1, K, 0.150, widths=(0, 1))  # reaches width 1 for the first time
    live.observe(1, K, 0.011, widths=(1,))
    assert live.samples()[0, K] == 2
    np.testing.assert_allclose(live.seconds()[0, K], 0.0105)
    live.observe(1, 0, None, widths=(0,))
    live.observe(1, 0, 0.007, widths=(0,))
    live.observe(1, 0, 0.140, widths=(1,))  # plain cycles at width 1: another branch, its first run
    live.observe(1, 0, 0.008, widths=(1,))
    assert live.samples()[0, 0] == 2
    np.testing.assert_allclose(live.seconds()[0, 0], 0.0075)
    control = LiveCosts(EXPENSIVE, min_samples=1)
    control.observe(1, K, None)
    control.observe(1, K, 0.150)
    assert control.samples()[0, K] == 1


def test_a_length_is_priced_against_plain_cycles_that_read_the_same_key_width():
    """While drafting pays, plain cycles are timed rarely, so the plain samples nearest in time
    may come from shorter contexts (a narrower key width, cheaper). A length is priced against the
    plain samples that read its key width first; the control, the same samples with no widths,
    prices one draft against the narrow, old plain cycles and makes it look a fifth dearer."""
    def run(with_widths):
        live = LiveCosts(EXPENSIVE, min_samples=1, neighbours=2)
        width = (lambda w: (w,)) if with_widths else (lambda w: ())
        live.observe(1, 0, None, widths=width(0))
        for _ in range(6):
            live.observe(1, 0, 0.030, widths=width(0))  # plain cycles over short contexts
        for k in (1, 2, 3):  # drafting at the wider width, no plain cycle timed meanwhile
            live.observe(1, k, None, widths=width(1))
            for _ in range(5 if k == 1 else 3):
                live.observe(1, k, 0.040 * (1 + 0.1 * k), widths=width(1))
        live.observe(1, 0, None, widths=width(1))
        for _ in range(2):
            live.observe(1, 0, 0.040, widths=width(1))  # plain cycles at the wider width, later
        return live.relative(1)

    np.testing.assert_allclose(run(True), [1.0, 1.1, 1.2, 1.3], rtol=1e-6)
    # 0.044 against the short contexts' 0.030 (1.47), pooled with two and three drafts out of order
    assert run(False)[1] > 1.3


def test_a_length_is_priced_against_plain_steps_of_as_many_cycles():
    """A step's fixed host cost is spread over its cycles, so a one-cycle step's seconds per
    cycle hold all of it. A length timed in one-cycle steps is priced against plain one-cycle
    steps first; the control, the same samples with no cycle counts, prices one draft against
    plain four-cycle steps and makes it look dear enough not to draft."""
    def run(with_cycles):
        live = LiveCosts(EXPENSIVE, min_samples=1, neighbours=2)
        cycles = (lambda n: n) if with_cycles else (lambda n: 0)
        live.observe(1, 0, None, widths=(0,), cycles=cycles(4))
        for _ in range(2):
            live.observe(1, 0, 0.060, widths=(0,), cycles=cycles(1))  # plain one-cycle steps: 16 ms of fixed cost
        for _ in range(2):
            live.observe(1, 0, 0.048, widths=(0,), cycles=cycles(4))  # then four-cycle steps: 4 ms a cycle of it
        for k in (1, 2, 3):  # drafting in one-cycle steps only, timed after the plain ones
            live.observe(1, k, None, widths=(0,), cycles=cycles(1))
            for _ in range(3):
                live.observe(1, k, 0.060 + 0.011 * k, widths=(0,), cycles=cycles(1))
        return live.relative(1)

    np.testing.assert_allclose(run(True), [1.0, 71 / 60, 82 / 60, 93 / 60], rtol=1e-6)
    assert run(False)[1] > 1.4  # 0.071 against the four-cycle steps' 0.048


def test_a_length_is_priced_against_plain_cycles_of_its_program_and_width_only():
    """A server times its lengths at start-up in the greedy program; requests at T=1 then run
    the sampled program, whose cycles do more work. Their drafting cycles are priced against
    plain cycles of the sampled program at their key width, and where a length has such samples,
    its samples at a width with no plain cycle (here seven, more than half) are not priced at all.
    The control, with no program named, prices the sampled one-draft cycles mostly against the
    greedy plain ones and makes them look 1.4 plain cycles or dearer, where they cost 1.33."""
    def run(programs):
        live = LiveCosts(EXPENSIVE, min_samples=1, neighbours=2)
        greedy, sampled = ("greedy", "sampled") if programs else ("", "")
        for k in range(K, -1, -1):  # start-up, plain cycles last
            live.observe(1, k, None, greedy, widths=(1,), cycles=4)
            for _ in range(3 if k == 0 else 1):
                live.observe(1, k, 0.040 * (1 + 0.3 * k), greedy, widths=(1,), cycles=4)
        live.observe(1, 1, None, sampled, widths=(1,), cycles=4)
        for _ in range(6):
            live.observe(1, 1, 0.060, sampled, widths=(1,), cycles=4)  # serving at T=1: no plain cycle yet
        live.observe(1, 0, None, sampled, widths=(1,), cycles=4)
        live.observe(1, 0, 0.045, sampled, widths=(1,), cycles=4)  # plain cycles of that program, width
        live.observe(1, 1, None, sampled, widths=(2,), cycles=4)
        for _ in range(7):
            live.observe(1, 1, 0.090, sampled, widths=(2,), cycles=4)  # a wider width: no plain partner
        return live.relative(1)

    np.testing.assert_allclose(run(True)[1], 0.060 / 0.045, rtol=1e-6)
    assert run(False)[1] > 1.4


def test_lengths_chosen_over_wider_contexts_are_priced_once_plain_cycles_are_forced_there():
    """Where drafting pays, the lengths a policy chooses later in a request run over wider
    contexts than the plain cycles timed early in it. Exploration forces plain cycles at the wider
    width though they promise far less than drafting, and two and three drafts are then priced at
    what they cost there (1.4 and 1.52 plain cycles). The control, before those plain cycles are
    timed: priced against the narrow width's, two drafts look 1.75 plain cycles, dearer than one
    draft's 1.2 by more than they promise (0.43 tokens more)."""
    live = LiveCosts(EXPENSIVE, min_samples=1, neighbours=2, explore_every=1000, warmup_explore_every=1000)
    for k, seconds, width in [(0, 0.010, 0), (1, 0.012, 0), (2, 0.0175, 1), (3, 0.019, 1)]:
        live.observe(1, k, None, widths=(width,))
        for _ in range(3):
            live.observe(1, k, seconds, widths=(width,))
    np.testing.assert_allclose(live.relative(1), [1.0, 1.2, 1.75, 1.9], rtol=1e-6)
    promise = lambda: np.array([1.0, 1.7, 2.13, 2.4])  # noqa: E731  plain: far from the best rate
    assert [live.explore(1, "", 1, promise=promise) for _ in range(3)] == [0, 0, None]
    live.observe(1, 0, None, widths=(1,))
    live.observe(1, 0, 0.0125, widths=(1,))
    np.testing.assert_allclose(live.relative(1), [1.0, 1.2, 1.4, 1.52], rtol=1e-6)


def test_plain_cycles_are_forced_at_a_width_until_it_has_min_samples_of_them():
    """One plain sample at a width prices every drafting length timed there alone, so plain steps
    are forced there (a pair at most once in ``explore_every`` steps) until it holds
    ``min_samples``; the control: once it does, never again."""
    live = LiveCosts(EXPENSIVE, min_samples=3, explore_every=8, warmup_explore_every=1000)
    forced = []
    for _ in range(40):
        k = live.explore(1, "greedy", 1)
        forced.append(k)
        live.observe(1, 0 if k == 0 else 1, 0.02, "greedy", widths=(1,))
    runs = [i for i, k in enumerate(forced) if k == 0 and (i == 0 or forced[i - 1] != 0)]
    assert runs[:3] == [0, 8, 16]  # two plain steps each (the second timed), a sample a pair
    assert all(k != 0 for k in forced[18:])  # three samples: no more


def test_a_length_priced_from_a_few_dear_samples_does_not_price_the_longer_ones():
    """One draft timed at start-up in a slow spell (3 samples, 2.4 plain cycles), two and three
    drafts timed while serving (12 and 16 samples, 1.35 and 1.45): a length costs at least what
    a shorter one does, and the lengths out of order are pooled by their samples, so two and
    three drafts cost 1.52, not the running maximum's 2.4 (the control, computed here)."""
    live = LiveCosts(EXPENSIVE, min_samples=1, neighbours=2)
    for k, seconds, n in [(0, 0.020, 16), (1, 0.048, 3), (2, 0.027, 12), (3, 0.029, 16)]:
        live.observe(1, k, None, widths=(0,))
        for _ in range(n):
            live.observe(1, k, seconds, widths=(0,))
    pooled = (3 * 2.4 + 12 * 1.35 + 16 * 1.45) / 31
    np.testing.assert_allclose(live.relative(1), [1.0, pooled, pooled, pooled], rtol=1e-6)
    assert np.fmax.accumulate([1.0, 2.4, 1.35, 1.45])[3] == 2.4  # the running maximum's price
    # In order, the estimates are kept as they are; none falls below a plain cycle.
    ordered = LiveCosts(EXPENSIVE, min_samples=1, neighbours=2)
    for k, seconds in [(0, 0.020), (1, 0.018), (2, 0.027), (3, 0.029)]:
        ordered.observe(1, k, None, widths=(0,))
        for _ in range(3):
            ordered.observe(1, k, seconds, widths=(0,))
    np.testing.assert_allclose(ordered.relative(1), [1.0, 1.0, 1.35, 1.45], rtol=1e-6)


def test_plain_cycles_are_forced_where_a_program_and_width_has_none():
    """A step at a program and key width with no plain sample in its bucket runs two plain
    steps (the second timed), then lets the policy choose; once a plain sample is there, never
    again, and without one (the steps cut short) at most once in ``explore_every`` steps. The
    control: a step whose width is not known is never forced for it."""
    live = LiveCosts(EXPENSIVE, min_samples=1, explore_every=1000, warmup_explore_every=1000)
    forced = [live.explore(1, "sampled", 1) for _ in range(4)]
    assert forced == [0, 0, None, None]
    forced = [live.explore(1, "sampled", 2) for _ in range(3)]  # another width, its steps never timed
    assert forced == [0, 0, None]
    assert 0 not in [live.explore(1, "sampled", 2) for _ in range(991)]  # steps 8-998: not within explore_every
    # Steps 999-1006: the regular exploration's pair at step 1000, then this width's again at 1005.
    assert [live.explore(1, "sampled", 2) for _ in range(8)] == [None, 0, 0, None, None, None, 0, 0]
    live.observe(1, 0, None, "greedy", widths=(3,))
    live.observe(1, 0, 0.04, "greedy", widths=(3,))
    assert [live.explore(1, "greedy", 3) for _ in range(3)] == [None] * 3  # a plain sample there already
    assert [live.explore(1, "greedy", 3) for _ in range(3)] == [None] * 3
    assert [live.explore(1, "sampled", 3)] == [0]  # the same width, another program
    control = LiveCosts(EXPENSIVE, min_samples=1, explore_every=1000, warmup_explore_every=1000)
    assert [control.explore(1) for _ in range(10)] == [None] * 10


def _timed_at_eight_rows():
    """Every length timed, one draft at 1.3 plain cycles, two and three at 2.0 and 2.3."""
    live = LiveCosts(EXPENSIVE, min_samples=1, explore_every=4, warmup_explore_every=4)
    feed(live, 1, [0.040, 0.052, 0.080, 0.092], times=2)
    return live


def test_exploration_skips_lengths_no_cost_error_would_make_worth_drafting():
    """With the rows' promised tokens, exploration times only the lengths whose promised rate lies
    within ``1 + explore_within`` of the best's: at an acceptance of a half (8, 12, 14 and 15
    tokens from eight rows), plain cycles (rate 8 against one draft's 9.2) and not two or three
    drafts (7 and 6.5). Where one draft promises far more, nothing is explored. The control: without
    a promise every length the policy does not choose is, two and three drafts too."""
    def forced(promise, steps=32):
        live, seconds, out = _timed_at_eight_rows(), [0.040, 0.052, 0.080, 0.092], []
        for _ in range(steps):
            k = live.explore(1, promise=promise)
            live.observe(1, 1 if k is None else k, seconds[1 if k is None else k])  # the policy drafts one
            out += [] if k is None else [k]
        return out

    half = np.array([8.0, 12.0, 14.0, 15.0])
    np.testing.assert_allclose(_timed_at_eight_rows().relative(1), [1.0, 1.3, 2.0, 2.3])
    assert set(forced(lambda: half)) == {0}
    assert forced(lambda: np.array([8.0, 15.0, 17.0, 18.0])) == []  # one draft: 11.5, plain 8
    assert set(forced(None)) == {0, 2, 3}  # (one draft, chosen, is timed at every step)
    assert set(forced(lambda: None)) == {0, 2, 3}  # no estimate: as without a promise
    # Plain cycles at a width with none are timed even where they promise little: the drafting
    # lengths timed at that width are priced against them. The promise is not read for them.
    live, asked = _timed_at_eight_rows(), []
    far = lambda: asked.append(1) or np.array([8.0, 15.0, 17.0, 18.0])  # noqa: E731
    assert [live.explore(1, "", 5, promise=far) for _ in range(3)] == [0, 0, None]
    assert asked == []
    assert live.explore(1, "", 6, promise=lambda: half) == 0


def test_a_length_timed_dear_once_is_timed_again_and_priced_by_its_recent_samples():
    """Two and three drafts timed at 3.0 and 3.5 plain cycles (at start-up, in a busy spell)
    promise too little to be explored at those prices, though they now cost 1.5 and 1.7. Once
    their last sample is ``refresh_every`` steps old they are explored anyway, one forced pair
    each, and priced by their recent samples alone, so two drafts, now the best rate (9.3
    against one draft's 9.2), get their true price. The control: with no refresh the old prices
    stand and they are never forced."""
    then, now = [0.040, 0.052, 0.120, 0.140], [0.040, 0.052, 0.060, 0.068]
    half = np.array([8.0, 12.0, 14.0, 15.0])

    def run(refresh_every, steps=100):
        live = LiveCosts(EXPENSIVE, min_samples=2, explore_every=4, warmup_explore_every=4,
                         refresh_every=refresh_every)
        feed(live, 1, then, times=2)
        forced = []
        for step in range(1, steps + 1):
            k = live.explore(1, promise=lambda: half)
            forced += [] if k is None else [(step, k)]
            live.observe(1, 1 if k is None else k, now[1 if k is None else k])  # the policy drafts one
        return live, forced

    live, forced = run(refresh_every=64, steps=71)
    np.testing.assert_allclose(live.relative(1), [1.0, 1.3, 1.5, 1.7], rtol=1e-6)
    # Stale at step 64 (the start-up's samples are from step 0), each length one pair at the next turns.
    assert [(step, k) for step, k in forced if k in (2, 3)] == [(64, 2), (65, 2), (68, 3), (69, 3)]
    assert live.samples()[0, 2:].tolist() == [3, 3]  # the old samples stay, unread while recent ones exist
    assert live.refreshes().tolist() == [[0, 0, 1, 1]]  # plain cycles were worth timing: not refreshes
    assert 'specjax_cycle_refreshes_total{rows="1",draft_length="2"} 1' in prometheus_text(_metrics_with(live.report()))

    stale, forced = run(refresh_every=10**6)
    np.testing.assert_allclose(stale.relative(1), [1.0, 1.3, 3.0, 3.5], rtol=1e-6)
    assert not {2, 3} & {k for _, k in forced}
    assert not stale.refreshes().any()


@pytest.mark.parametrize("capacity", [64, 512, 2051])
def test_the_widths_a_step_reads_are_the_models(capacity):
    """``widths_read`` picks, for every cycle a step may have run, the index the model's
    ``attention_width_index`` computes from the cache's lengths."""
    from specjax._src.models.attention_ops import attention_width_index, attention_widths

    widths = attention_widths(capacity)
    rng = np.random.default_rng(capacity)
    for _ in range(40):
        k = int(rng.integers(0, 4))
        before = int(rng.integers(1, capacity - 8))
        after = min(before + int(rng.integers(0, 9)), capacity - k - 1)
        got = widths_read(widths, before, after, k)
        index = lambda n: 0 if len(widths) == 1 else int(attention_width_index(capacity, jnp.array([n]), k + 1))  # noqa: E731
        want = sorted({index(n) for n in range(before, max(after, before + 1))})
        assert list(got) == list(range(want[0], want[-1] + 1)), (before, after, k)


def test_a_steps_draft_length_from_the_slots_counters():
    asked = 4
    assert step_draft_length([2, 2, 0], [[2, 2, 0], [2, 0, 0], [0, 0, 0]], asked) == 2  # a slot capped lower
    assert step_draft_length([2, 2], [[0, 0, 0], [0, 0, 0]], asked) == 0
    assert step_draft_length([2, 2], [[2, 1, 0], [2, 2, 0]], asked) is None  # two lengths in one slot
    assert step_draft_length([2, 1], [[2, 2, 0], [1, 1, 0]], asked) is None  # unequal cycles
    assert step_draft_length([9, 2], [[9, 0, 0], [2, 0, 0]], asked) is None  # a fork's copied counts
    assert step_draft_length([0, 0], [[0, 0, 0], [0, 0, 0]], asked) is None  # nothing ran


def test_bad_arguments_get_clear_errors(bigram_pair):
    with pytest.raises(TypeError, match="CostModel"):
        LiveCosts({"verify": 1})
    with pytest.raises(ValueError, match="min_samples .* cannot exceed window"):
        LiveCosts(EXPENSIVE, window=2, min_samples=3)
    with pytest.raises(ValueError, match="neighbours"):
        LiveCosts(EXPENSIVE, neighbours=0)
    with pytest.raises(ValueError, match="refresh_every"):
        LiveCosts(EXPENSIVE, refresh_every=0)
    with pytest.raises(ValueError, match=r"explore_within must lie in \[0, 100\], got -0.1"):
        LiveCosts(EXPENSIVE, explore_within=-0.1)
    with pytest.raises(ValueError, match="draft_length must lie in 0 .. 3"):
        LiveCosts(EXPENSIVE).observe(1, 4, 0.01)
    with pytest.raises(ValueError, match="draft_length must lie in 0 .. 3"):
        LiveCosts(EXPENSIVE).forced_costs(4)  # would force nothing: every length costs a million cycles
    fixed = Engine(bigram_pair, num_slots=2, capacity=32, num_draft=K)
    assert fixed.costs is None
    with pytest.raises(ValueError, match="drafting=auto"):
        fixed.set_costs(EXPENSIVE)
    engine = Engine(bigram_pair, num_slots=2, capacity=32, num_draft=K, drafting=drafting.auto(EXPENSIVE))
    with pytest.raises(ValueError, match="derive them from Engine.costs"):
        engine.set_costs(cost_model(k=2))
    with pytest.raises(TypeError, match="CostModel"):
        engine.step(engine.init(), costs="cheap")


def test_forced_steps_draft_as_forced_and_serving_times_its_steps(bigram_pair):
    """``step(costs=forced_costs(k))`` drafts ``k`` whatever the engine's costs (stacked by row
    bucket) say, in the same program; a scheduler with live costs records its steps' lengths and keeps greedy output the
    target's."""
    two_rows = drafting.stack_costs([EXPENSIVE, EXPENSIVE.replace(batch=jnp.float32(2))])
    engine = Engine(
        bigram_pair,
        num_slots=2,
        capacity=48,
        num_draft=K,
        drafting=drafting.auto(two_rows),
        logprobs=1,
        row_buckets=(1, 2),
    )
    live = LiveCosts(engine.costs)
    settings = SlotSettings(temperature=0.0, max_new_tokens=40, eos_token_id=(), logprobs=0)  # events carry tokens
    state = engine.insert(engine.init(), 0, [1, 2, 3], settings)
    before = np.asarray(state.loop.stats.drafted_at)[0].copy()
    for k in (K, 0, 2):
        state, _ = engine.step(state, num_cycles=2, costs=live.forced_costs(k))
        after = np.asarray(state.loop.stats.drafted_at)[0]
        assert step_draft_length([2], [after - before], 2) == k
        before = after.copy()
    # Built once per length, whatever the timings since: a forced step adds no host work to the step it times.
    forced = live.forced_costs(2)
    feed(live, 1, [0.010, 0.011, 0.012, 0.013], times=3)
    assert live.forced_costs(2) is forced

    scheduler = sched.Scheduler(engine, _NoText(), num_cycles=2, warmup_widths=(16,), prefill_groups=[1]).start()
    prompt = [1, 2, 3]
    events = []
    try:
        assert scheduler.ready.wait(300) and scheduler.live_costs is not None
        # Before any request, every row bucket's step was timed at every length: auto's first
        # requests plan with the loop's costs, not the parts'.
        warmed = scheduler.live_costs.samples()
        assert (warmed >= scheduler.live_costs.min_samples).all(), warmed
        assert all(bool(engine.costs.at_batch(rows).is_timed(K)) for rows in (1, 2))
        # And every branch of every step program ran once (a branch's first run is not timed).
        programs = ("greedy", "sampled", "general") if engine.specialized_steps else ("general",)
        assert all(scheduler.live_costs.has_run(rows, program, k, 0)
                   for rows in (1, 2) for program in programs for k in range(K + 1))
        scheduler.submit(sched.Request(prompt=prompt, settings=settings, emit=events.append))
        deadline = time.monotonic() + 300
        while not any(isinstance(e, (sched.Done, sched.Failed)) for e in events) and time.monotonic() < deadline:
            time.sleep(0.02)
        metrics = scheduler.metrics()
    finally:
        scheduler.close(drain_seconds=5)
    assert isinstance(events[-1], sched.Done), events[-1]
    tokens = [t for e in events if isinstance(e, sched.Delta) for t in e.tokens]
    ref = specjax.generate(bigram_pair.target, [prompt], max_new_tokens=40, temperature=0.0)
    assert tokens == np.asarray(ref.tokens)[0].tolist()
    samples = np.asarray(metrics["cycle_costs"]["samples"])
    assert samples[0].sum() > warmed[0].sum()  # serving's steps are timed too


def test_only_steps_that_ran_every_cycle_asked_are_timed(bigram_pair):
    """A step cut short by a finish spreads its fixed host work over fewer cycles: it is not
    timed (its length would look dearer); one that ran every cycle it was asked is."""
    engine = Engine(bigram_pair, num_slots=2, capacity=48, num_draft=K, drafting=drafting.auto(EXPENSIVE))
    scheduler = sched.Scheduler(engine, _NoText(), num_cycles=4)
    two_drafts = np.array([[3, 3, 0]])  # three cycles, each drafting slots 0 and 1
    scheduler._time_step(1, 4, np.array([3]), two_drafts, 0.03)
    assert scheduler.live_costs.samples()[0].sum() == 0
    scheduler._time_step(1, 3, np.array([3]), two_drafts, 0.03)
    assert scheduler.live_costs.samples()[0].tolist() == [0, 0, 1, 0]
    np.testing.assert_allclose(scheduler.live_costs.seconds()[0, 2], 0.01)


def test_the_scheduler_promises_auto_s_expected_tokens_of_its_live_slots(bigram_pair):
    """What exploration weighs (``Scheduler._promise``): the committed tokens a cycle of each
    length promises, summed over the live slots among the step's rows, from auto's own state;
    None for an engine that drafts with another policy."""
    engine = Engine(bigram_pair, num_slots=2, capacity=48, num_draft=K, drafting=drafting.auto(EXPENSIVE))
    scheduler = sched.Scheduler(engine, _NoText(), num_cycles=2)
    settings = SlotSettings(temperature=0.0, max_new_tokens=8, eos_token_id=())
    state = engine.insert(engine.insert(engine.init(), 0, [1, 2], settings), 1, [3], settings)
    sure, _ = sure_drafts(2)
    never = sure._replace(accepted=sure.accepted.at[1].set(0.0))  # slot 1: nothing ever accepted
    state = state.replace(loop=state.loop.replace(policy_state=state.loop.policy_state._replace(
        accepted=never.accepted, judged=never.judged)))
    scheduler._live = {0: None, 1: None}
    per_slot = np.asarray(drafting.expected_tokens(jax.vmap(engine.drafting.acceptance)(state.loop.policy_state)))
    np.testing.assert_allclose(scheduler._promise(state, 2), per_slot.sum(0), rtol=1e-6)
    assert per_slot[0, K] > 3.9 and per_slot[1, K] < 1.1
    np.testing.assert_allclose(scheduler._promise(state, 1), per_slot[0], rtol=1e-6)  # slot 1 is not in the step
    scheduler._live = {1: None}
    assert scheduler._promise(state, 1) is None  # no live slot among the rows
    fixed = sched.Scheduler(Engine(bigram_pair, num_slots=2, capacity=48, num_draft=K), _NoText(), num_cycles=2)
    fixed._live = {0: None}
    assert fixed._promise(state, 2) is None


class _NoText:
    """A tokenizer stand-in that decodes every id to one character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)


def test_the_warm_up_runs_every_draft_length_at_every_key_width():
    """Before its first request the server runs one cycle of every (row bucket, program, draft
    length, key width): XLA's CPU runtime prepares a branch of the step the first time it runs it,
    which would fall on a request and leave that length untimed at that width. The control:
    nothing has run before the pass."""
    pair = specjax.pair(*peaked_target_and_draft(llama_config(max_position_embeddings=512)))
    engine = Engine(pair, num_slots=1, capacity=400, num_draft=K, drafting=drafting.auto(EXPENSIVE))
    widths = engine.attention_widths()
    assert len(widths) > 2 and not engine.specialized_steps
    branches = [(1, "general", k, j) for k in range(K + 1) for j in range(len(widths))]
    scheduler = sched.Scheduler(engine, _NoText(), num_cycles=2, prefill_chunk=0)
    live = scheduler.live_costs
    assert [b for b in branches if live.has_run(*b)] == []
    state = run_every_branch(engine, live, engine.init(), [SlotSettings(temperature=0.0)], scheduler._note_untimed)
    assert [b for b in branches if not live.has_run(*b)] == []
    assert not np.asarray(state.occupied).any()  # every slot it used is free again
