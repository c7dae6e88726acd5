"""The slots engine: per-request settings in one state, each request decoded as ``decode`` decodes it alone."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

import specjax
from specjax.drafting import ngram_lookup
from specjax.engine import Engine, GenerationControls, SlotSettings
from specjax.rules import speculative_sampling
from specjax.trees import static_tree
from specjax.testing import bigram_model, llama_config, peaked_target_and_draft, random_table
from specjax._src.models import feature_head_build as fhb
from test_decode import count_compilations, exact_two_token_distribution, goodness_of_fit

K, CAPACITY = 3, 48


@pytest.fixture(scope="module")
def llama_pair():
    return specjax.pair(*peaked_target_and_draft(llama_config()))


@pytest.fixture(scope="module")
def engine(llama_pair):
    """Four slots with the processors compiled in (at their defaults they change no logit), shared
    by the tests here and in test_processors.py so that its programs are compiled once."""
    return Engine(llama_pair, num_slots=4, capacity=CAPACITY, num_draft=K)


def run_to_end(engine, state, pending=(), cycles=2):
    """Steps until every slot is done; ``pending``: ``(after_step, slot, prompt, settings)``
    requests inserted once that many steps ran. Returns ``{slot: tokens}``."""
    out, steps, pending = {}, 0, list(pending)
    while True:
        assert steps < 500, "the slots did not finish in 500 steps"
        for item in [p for p in pending if p[0] == steps]:
            state = engine.insert(state, item[1], item[2], item[3])
            pending.remove(item)
        state, step = engine.step(state, cycles)
        step = jax.device_get(step)
        steps += 1
        for s in range(engine.num_slots):
            out.setdefault(s, []).extend(step.tokens[s, : step.counts[s]].tolist())
        if step.done.all() and not pending:
            return out, state


def alone(pair, prompt, s: SlotSettings, **kw):
    """What ``decode`` gives the request alone (the slot's cache length, so that attention shapes agree)."""
    key = None if s.seed is None else jax.random.key(s.seed)
    out = specjax.decode(
        pair, [prompt], num_draft=K, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
        top_k=s.top_k, top_p=None if s.top_p >= 1 else s.top_p, key=key, max_length=CAPACITY + K,
        eos_token_id=s.eos_token_id, controls=s.controls, **kw,
    )
    return out.to_lists()[0]


MIXED = [
    SlotSettings(temperature=0.0, max_new_tokens=20),
    # 16, not more: its reference alone shares the program of the top-p visitor's in
    # test_specialized_steps_switch_programs_and_decode_the_same (max_new_tokens is bucketed, 16 and 4 alike).
    SlotSettings(temperature=0.7, top_p=0.9, seed=3, max_new_tokens=16),
    SlotSettings(temperature=1.0, top_k=20, seed=5, max_new_tokens=20),
    SlotSettings(temperature=0.0, num_draft=0, max_new_tokens=12),  # plain decoding in a speculative state
]
PROMPTS = [[5, 9, 3], [7] * 12, [1, 2, 3, 4, 5, 6], [11, 12]]


def test_mixed_settings_each_equal_decode_alone(llama_pair, engine):
    """Greedy, T=0.7 with top_p, T=1 with top_k and a zero-draft request share one state; the
    last is inserted while the others are mid-generation. Each gets what decode gives it alone."""
    state = engine.init()
    for slot in range(3):
        state = engine.insert(state, slot, PROMPTS[slot], MIXED[slot])
    got, state = run_to_end(engine, state, pending=[(2, 3, PROMPTS[3], MIXED[3])])
    for slot in range(4):
        assert got[slot] == alone(llama_pair, PROMPTS[slot], MIXED[slot]), f"slot {slot} ({MIXED[slot]})"
    # The zero-draft request drafted nothing: plain decoding, one target token per cycle.
    stats = jax.device_get(state.loop.stats)
    assert stats.drafted[3] == 0 and stats.drafted[0] > 0
    # A freed slot takes the next request, which again decodes as alone.
    state = engine.release(state, 1)
    state = engine.insert(state, 1, PROMPTS[2], MIXED[2])
    again, _ = run_to_end(engine, state)
    assert again[1] == got[2]


def test_an_inserted_request_s_first_token_is_out_before_any_step(llama_pair, engine):
    """The insert draws each request's first token from its prefill: ``flush`` gives it out
    with no cycle run, the steps after it give the rest, and together they are decode's tokens."""
    settings = [SlotSettings(temperature=0.0, max_new_tokens=9), SlotSettings(temperature=1.0, seed=4,
                                                                                max_new_tokens=9)]
    state = engine.insert_many(engine.init(), [0, 2], [PROMPTS[0], PROMPTS[2]], settings)
    state, first = engine.flush(state)
    first = jax.device_get(first)
    np.testing.assert_array_equal(first.counts, [1, 0, 1, 0])
    assert int(np.sum(state.loop.stats.cycles)) == 0  # no cycle ran
    state, again = engine.flush(state)
    np.testing.assert_array_equal(again.counts, 0)  # given out once
    got, _ = run_to_end(engine, state)
    for slot, prompt, s in zip((0, 2), (PROMPTS[0], PROMPTS[2]), settings):
        assert [int(first.tokens[slot, 0])] + got[slot] == alone(llama_pair, prompt, s)
    # Without a flush, the first step gives the first token with its own.
    state = engine.insert(engine.init(), 1, PROMPTS[1], settings[0])
    state, step = engine.step(state, 1)
    assert int(step.counts[1]) >= 2 and int(step.tokens[1, 0]) == alone(llama_pair, PROMPTS[1], settings[0])[0]


def test_lookup_in_slots(llama_pair):
    """Drafts copied from each slot's own context."""
    engine = Engine(llama_pair, num_slots=2, capacity=CAPACITY, num_draft=K, lookup=ngram_lookup(2),
                    controls=False)
    prompt = [4, 5, 6, 4, 5, 6, 4, 5]
    state = engine.insert(engine.init(), 1, prompt, MIXED[1])
    got, state = run_to_end(engine, state)
    assert got[1] == alone(llama_pair, prompt, MIXED[1], lookup=ngram_lookup(2))
    assert int(jax.device_get(state.loop.stats.copied)[1]) > 0  # the repeated prompt was copied from


@pytest.mark.slow
def test_feature_head_in_slots(llama_pair):
    """An EAGLE-style head drafts in slots as it does in decode."""
    target = llama_pair.target
    head_pair = specjax.pair(target, fhb.init_from_target(target, jax.random.key(1), np.arange(80)[::-1]))
    engine = Engine(head_pair, num_slots=2, capacity=CAPACITY, num_draft=K, controls=False)
    state = engine.insert(engine.init(), 0, PROMPTS[2], MIXED[0])
    got, _ = run_to_end(engine, state)
    assert got[0] == alone(head_pair, PROMPTS[2], MIXED[0])


def test_compiles_per_prompt_bucket_then_none(llama_pair):
    """50 requests of mixed prompt lengths (two width buckets) and settings, inserted as slots
    free up: one insert program per bucket and one step program (release compiles nothing); none
    on a second pass."""
    # Its own static structure (7 EOS ids a slot), so that no earlier test built its programs.
    engine = Engine(llama_pair, num_slots=4, capacity=CAPACITY, num_draft=K, max_eos=7)
    rng = np.random.default_rng(0)
    requests = []
    for i in range(50):
        length = int(rng.integers(1, 30))
        settings = SlotSettings(
            temperature=float(rng.choice([0.0, 0.7, 1.0])), top_p=float(rng.choice([1.0, 0.9])),
            top_k=int(rng.choice([0, 20])) or None, seed=i, max_new_tokens=int(rng.integers(2, 12)),
            num_draft=int(rng.integers(0, K + 1)),
            controls=GenerationControls(repetition_penalty=float(rng.choice([1.0, 1.3]))),
        )
        requests.append((rng.integers(0, 96, length).tolist(), settings))

    def serve(state):
        queue, outputs = list(requests), 0
        while queue or not np.asarray(state.loop.done).all():
            for slot in engine.free_slots(state):
                if queue:
                    state = engine.insert(state, slot, *queue.pop(0))
            state, out = engine.step(state, 2)
            for slot in np.flatnonzero(np.asarray(out.done) & np.asarray(state.occupied)):
                state = engine.release(state, int(slot))
                outputs += 1
        return state, outputs

    state = engine.init()
    with count_compilations() as first:
        state, served = serve(state)
    assert served == 50
    assert first["n"] <= 2 + 1, first  # prompt buckets 16 and 32, the step
    with count_compilations() as second:
        serve(state)
    assert second["n"] == 0


def test_a_short_prompt_alone_runs_at_its_own_width(llama_pair):
    """With one prompt width (as ``specjax serve`` builds its engine), a prompt inserted alone that
    fits one prefill block runs at its own width rounded up to 16 (16 or 32 here), rather than the
    bucket's; a group keeps the bucket. Both decode what the request decodes alone."""
    engine = Engine(llama_pair, num_slots=2, capacity=CAPACITY, num_draft=K, prompt_bucket=CAPACITY)
    assert [engine._insert_width(1, n) for n in (3, 16, 17, 33, 40)] == [16, 16, 32, CAPACITY, CAPACITY]
    assert engine._insert_width(2, 3) == CAPACITY
    assert engine._single_prompt_widths() == (16, 32)
    wide = Engine(llama_pair, num_slots=2, capacity=120, num_draft=K, prompt_bucket=120)
    assert [wide._insert_width(1, n) for n in (33, 48, 49, 64, 65)] == [48, 48, 64, 64, 120]
    assert wide._single_prompt_widths() == (16, 32, 48, 64)
    settings = SlotSettings(temperature=0.0, max_new_tokens=12)
    single, _ = run_to_end(engine, engine.insert(engine.init(), 0, PROMPTS[1], settings))
    grouped, _ = run_to_end(engine, engine.insert_many(engine.init(), [0, 1], PROMPTS[1::-1], [settings] * 2))
    ref = alone(llama_pair, PROMPTS[1], settings)
    assert single[0] == ref and grouped[0] == ref


def test_release_mid_generation_stops_the_slot_and_keeps_its_tokens(llama_pair, engine):
    """A request released before it finished: the slot is free, later steps report nothing for it,
    its tokens so far stay as they were, and the other slot decodes as alone. The state passed
    in is unchanged (release returns a new value)."""
    state = engine.insert_many(engine.init(), [0, 1], PROMPTS[:2], MIXED[:2])
    state, out = engine.step(state, 1)
    assert not np.asarray(out.done)[0]  # still generating when released
    committed = int(np.asarray(state.loop.num_committed)[0])
    tokens_before = np.asarray(state.loop.tokens)[0, :committed].copy()
    released = engine.release(state, 0)
    assert engine.free_slots(released) == [0, 2, 3] and engine.free_slots(state) == [2, 3]
    assert not np.asarray(state.loop.done)[0]
    later = released
    got = jax.device_get(out).tokens[1, : int(out.counts[1])].tolist()
    for _ in range(20):
        later, out = engine.step(later, 2)
        out = jax.device_get(out)
        assert out.counts[0] == 0 and out.done[0]
        got += out.tokens[1, : out.counts[1]].tolist()
        if out.done[1]:
            break
    # Its committed tokens stay (the buffer past them is the loop's scratch space).
    assert int(np.asarray(later.loop.num_committed)[0]) == committed
    np.testing.assert_array_equal(np.asarray(later.loop.tokens)[0, :committed], tokens_before)
    assert got == alone(llama_pair, PROMPTS[1], MIXED[1])


def test_bad_settings_name_the_field_and_insert_nothing(engine):
    state = engine.init()
    cases = [
        (dict(settings=SlotSettings(top_k=1000)), "top_k=1000 exceeds the vocabulary"),
        (dict(slot=4), "slot 4 is not one of this engine's 4 slots"),
        (dict(prompt=[1] * 45), "exceed the slot capacity"),
        (dict(settings=SlotSettings(controls=GenerationControls(repetition_penalty=-1.0))),
         "repetition_penalty must be > 0"),
        (dict(settings=SlotSettings(controls=GenerationControls(presence_penalty=3.0))), "presence_penalty"),
        (dict(settings=SlotSettings(num_draft=K + 1)), "num_draft must be an integer in 0 .. 3"),
        (dict(settings=SlotSettings(temperature=-0.5)), "temperature"),
        (dict(settings=SlotSettings(controls=GenerationControls(logit_bias={500: 1.0}))), "token id 500"),
        (dict(prompt=[1, 2, 999]), "token id 999"),
    ]
    for change, message in cases:
        args = dict(slot=0, prompt=[1, 2, 3], settings=SlotSettings(seed=0, max_new_tokens=8))
        args.update(change)
        if change.get("settings"):
            args["settings"] = args["settings"]._replace(max_new_tokens=8)
        with pytest.raises((ValueError, TypeError), match=message):
            engine.insert(state, args["slot"], args["prompt"], args["settings"])
    # A batch with one bad request inserts none of them.
    with pytest.raises(ValueError, match="top_k"):
        engine.insert_many(state, [0, 1], [[1, 2], [3, 4]],
                           [SlotSettings(seed=0, max_new_tokens=8), SlotSettings(top_k=1000, max_new_tokens=8)])
    assert engine.free_slots(state) == [0, 1, 2, 3]
    state = engine.insert(state, 0, [1, 2, 3], SlotSettings(seed=0, max_new_tokens=8))
    with pytest.raises(ValueError, match=r"slot\(s\) \[0\] are busy"):
        engine.insert(state, 0, [1, 2, 3], SlotSettings(seed=0, max_new_tokens=8))
    assert engine.free_slots(state) == [1, 2, 3]
    with pytest.raises(ValueError, match="slot -1"):
        engine.release(state, -1)


# ---------------------------------------------------------------------------
# The lossless law, per slot, with per-slot temperatures
# ---------------------------------------------------------------------------

VOCAB = 8


def test_lossless_law_per_slot_with_per_slot_temperatures():
    """Three groups of slots in one state: T=1, T=0.6 with top_k 3, and T=1 drafting nothing;
    each group's first two tokens follow its own warped target law. Negative control: the
    T=0.6 group is far from the T=1 law, so the test can tell the temperatures apart."""
    pair = specjax.pair(bigram_model(random_table(0, VOCAB)), bigram_model(random_table(1, VOCAB)))
    groups = [SlotSettings(temperature=1.0, max_new_tokens=2, eos_token_id=()),
              SlotSettings(temperature=0.6, top_k=3, max_new_tokens=2, eos_token_id=()),
              SlotSettings(temperature=1.0, num_draft=0, max_new_tokens=2, eos_token_id=())]
    per_group = 6000
    n = per_group * len(groups)
    engine = Engine(pair, num_slots=n, capacity=8, num_draft=K, controls=False)
    settings = [groups[i % 3]._replace(seed=i) for i in range(n)]
    state = engine.insert_many(engine.init(), list(range(n)), [[3]] * n, settings)
    state, out = engine.step(state, 4)
    out = jax.device_get(out)
    assert (out.counts == 2).all()
    table = np.asarray(pair.target.params["table"])
    laws = [exact_two_token_distribution(table, 3, g.temperature, g.top_k, None) for g in groups]
    for g in range(3):
        toks = out.tokens[g::3, :2]
        counts = np.zeros((VOCAB, VOCAB))
        np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
        pvalue, tv = goodness_of_fit(counts, laws[g])
        assert pvalue > 1e-3 and tv < 0.05, (g, pvalue, tv)
    toks = out.tokens[1::3, :2]
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
    pvalue, tv = goodness_of_fit(counts, laws[0])
    assert pvalue < 1e-6 and tv > 0.1, (pvalue, tv)


def test_rule_numbers_per_slot():
    """Greedy MARS with theta 0.3 and 0.95 in two slots of one engine: each request gets what decode
    gives it alone with its own theta; a rule of another type is refused."""
    from specjax.rules import mars

    pair = specjax.pair(bigram_model(random_table(0, 16)), bigram_model(random_table(1, 16)))
    engine = Engine(pair, num_slots=2, capacity=40, num_draft=K, rule=mars(0.9), controls=False)
    requests = [SlotSettings(temperature=0.0, max_new_tokens=32, rule=mars(0.3), eos_token_id=()),
                SlotSettings(temperature=0.0, max_new_tokens=32, rule=mars(0.95), eos_token_id=())]
    state = engine.insert_many(engine.init(), [0, 1], [[3, 4], [3, 4]], requests)
    got, _ = run_to_end(engine, state)
    for slot, s in enumerate(requests):
        ref = specjax.decode(pair, [[3, 4]], num_draft=K, max_new_tokens=32, rule=s.rule, temperature=0.0,
                             max_length=40 + K, eos_token_id=())
        assert got[slot] == ref.to_lists()[0], slot
    assert got[0] != got[1]  # the two thetas decoded differently
    with pytest.raises(ValueError, match="not the engine's rule type"):
        engine.insert(engine.init(), 0, [1], SlotSettings(rule=speculative_sampling(), max_new_tokens=4))


def test_until_first_finish_returns_when_a_slot_frees(llama_pair, engine):
    """A step told to stop at the first finish returns after the cycle in which the short request
    ended, the long one mid-generation; stepping on, the long one gets what it gets alone."""
    short, long_ = SlotSettings(temperature=0.0, max_new_tokens=2), SlotSettings(temperature=0.0, max_new_tokens=20)
    state = engine.insert_many(engine.init(), [0, 1], PROMPTS[:2], [short, long_])
    with pytest.raises(TypeError, match="until_first_finish must be True or False"):
        engine.step(state, 30, until_first_finish="yes")  # a string would be truthy, not a flag
    state, out = engine.step(state, 30, until_first_finish=True)
    out = jax.device_get(out)
    assert out.done[0] and not out.done[1] and 0 < out.counts[1] < 20
    got = out.tokens[1, : out.counts[1]].tolist()
    while not out.done[1]:
        state, out = engine.step(state, 30)  # without the flag: runs until every slot is done
        out = jax.device_get(out)
        got += out.tokens[1, : out.counts[1]].tolist()
    assert got == alone(llama_pair, PROMPTS[1], long_)


def test_a_donating_engine_decodes_the_same_and_refuses_a_consumed_state(llama_pair, engine):
    """``donate_state=True`` writes each new state into the old one's buffers: outputs are those of
    the engine that copies, and passing the consumed state again is a clear error, not a crash."""
    donating = Engine(llama_pair, num_slots=4, capacity=CAPACITY, num_draft=K, donate_state=True)
    first = donating.init()
    state = donating.insert(first, 0, PROMPTS[0], MIXED[0])
    assert first.loop.tokens.is_deleted()  # the buffers were reused, not copied
    with pytest.raises(ValueError, match="consumed by an earlier insert or step .*donate_state=True"):
        donating.step(first, 1)
    before_step = state
    state, out = donating.step(state, 1)
    assert before_step.loop.target_cache.keys[0].is_deleted()  # the step reused the caches too
    with pytest.raises(TypeError, match="host arrays"):
        donating.step(jax.device_get(state), 1)
    head = jax.device_get(out).tokens[0, : int(out.counts[0])].tolist()
    rest, state = run_to_end(donating, state)
    assert head + rest[0] == alone(llama_pair, PROMPTS[0], MIXED[0])
    state = donating.release(state, 0)
    with pytest.raises(ValueError, match="consumed"):
        donating.insert(first, 1, PROMPTS[1], MIXED[1])


def step_hlo(engine, state, plan) -> str:
    """The optimised HLO of ``engine``'s step program for ``plan``."""
    cfg = engine._programs[plan.program]
    return engine._step_fn.lower(engine.params, engine.rule, engine.drafting, state, np.int32(2), np.bool_(False),
                                 cfg=cfg, rows_run=plan.rows).compile().as_text()


@pytest.mark.parametrize("tree", [None, static_tree((2,))], ids=["chain", "tree"])
def test_a_step_of_leading_rows_carries_whole_cache_buffers(llama_pair, tree):
    """A chain's step of the first row of four carries the whole cache buffers through its
    loops (each forward writes and reads its row in place, ``write_cache``) rather than a
    copy of the row, copied out and back every step. A tree's cycle moves entries within a
    row's buffer, so it steps a cut row: the negative control."""
    engine = Engine(llama_pair, num_slots=4, capacity=CAPACITY, num_draft=None if tree else K, tree=tree,
                    row_buckets="powers")
    state = engine.insert(engine.init(), 0, PROMPTS[0], MIXED[0])
    plan = engine.plan({0: MIXED[0]})
    assert plan.rows == 1
    buffer = ",".join(map(str, state.loop.target_cache.keys[0].shape[1:]))
    carried = " ".join(re.findall(r"^\s*\S+ = \((.*)\) while\(", step_hlo(engine, state, plan), re.M))
    whole, cut = f"f32[4,{buffer}]" in carried, f"f32[1,{buffer}]" in carried
    assert (whole, cut) == ((False, True) if tree else (True, False))


def test_row_buckets_run_the_occupied_rows_and_decode_the_same(llama_pair):
    """An engine with row buckets runs only the leading rows that hold every occupied slot; each
    request still gets what it gets alone, whichever bucket its steps ran in."""
    bucketed = Engine(llama_pair, num_slots=4, capacity=CAPACITY, num_draft=K, row_buckets="powers")
    assert bucketed.row_buckets == (1, 2, 4)
    state = bucketed.insert(bucketed.init(), 0, PROMPTS[0], MIXED[0])
    assert bucketed.rows_to_run(state) == 1
    # Slot 2 joins mid-generation: the steps from then on run all four rows.
    got, state = run_to_end(bucketed, state, pending=[(1, 2, PROMPTS[1], MIXED[1])])
    assert got[0] == alone(llama_pair, PROMPTS[0], MIXED[0])
    assert got[2] == alone(llama_pair, PROMPTS[1], MIXED[1])
    assert bucketed.rows_to_run(state) == 4  # finished requests hold their slots until released
    state = bucketed.release(bucketed.release(state, 0), 2)
    state = bucketed.insert(state, 1, PROMPTS[3], MIXED[3])
    assert bucketed.rows_to_run(state) == 2
    got, _ = run_to_end(bucketed, state)
    assert got[1] == alone(llama_pair, PROMPTS[3], MIXED[3]) and got[0] == [] and got[2] == []
    with pytest.raises(ValueError, match="row_buckets must be slot counts in 1 .. num_slots"):
        Engine(llama_pair, num_slots=4, capacity=CAPACITY, num_draft=K, row_buckets=(0, 2))


def test_specialized_steps_switch_programs_and_decode_the_same(llama_pair):
    """With ``specialized_steps=True`` each step runs the program for its occupied slots: greedy
    requests alone the greedy one, a sampled request without filters the sampled one, one with
    top-p (or a greedy request with a penalty) the general one. Greedy requests that cross between
    the programs as sampled ones come and go, and each sampled one, get what they get alone."""
    fast = Engine(llama_pair, num_slots=4, capacity=CAPACITY, num_draft=K, specialized_steps=True)
    assert fast.specialized_steps and not Engine(llama_pair, num_slots=4, capacity=CAPACITY).specialized_steps
    # MIXED[0] (20 tokens): its reference alone is the program test_mixed_settings_each_equal_decode_alone
    # compiled. The zero-draft request of slot 1 (12 cycles) outlasts both visitors (4 tokens each).
    long_greedy = MIXED[0]
    visitors = [SlotSettings(temperature=0.7, seed=3, max_new_tokens=4),  # only a temperature: "sampled"
                SlotSettings(temperature=0.7, top_p=0.9, seed=5, max_new_tokens=4)]  # top-p: "general"
    state = fast.insert_many(fast.init(), [0, 1], [PROMPTS[0], PROMPTS[3]], [long_greedy, MIXED[3]])
    got, programs, visited = {0: [], 1: [], 2: []}, [], []
    while True:
        if visitors and not bool(state.occupied[2]) and programs:
            visited.append((visitors.pop(0), len(got[2])))
            state = fast.insert(state, 2, PROMPTS[1], visited[-1][0])
        programs.append(fast.step_program(state))
        state, out = fast.step(state, 1)
        out = jax.device_get(out)
        for slot in got:
            got[slot] += out.tokens[slot, : out.counts[slot]].tolist()
        if out.done[2] and bool(state.occupied[2]):
            state = fast.release(state, 2)  # the visitor leaves; the next one, or none, takes the slot
        if out.done[:2].all():
            break
    runs = [p for i, p in enumerate(programs) if i == 0 or p != programs[i - 1]]
    assert runs == ["greedy", "sampled", "general", "greedy"], programs
    assert got[0] == alone(llama_pair, PROMPTS[0], long_greedy)
    assert got[1] == alone(llama_pair, PROMPTS[3], MIXED[3])
    (first, _), (second, middle) = visited
    assert got[2][:middle] == alone(llama_pair, PROMPTS[1], first)
    assert got[2][middle:] == alone(llama_pair, PROMPTS[1], second)
    penalised = SlotSettings(temperature=0.0, max_new_tokens=12, controls=GenerationControls(repetition_penalty=1.3))
    state = fast.insert(fast.release(fast.release(state, 0), 1), 0, PROMPTS[2], penalised)
    assert fast.step_program(state) == "general"
    got, _ = run_to_end(fast, state)
    assert got[0] == alone(llama_pair, PROMPTS[2], penalised)
