"""What a server asks of the slots engine beyond tokens: log-probabilities, forks, settings
checked as data, and a step program chosen from host settings (``specjax.engine``)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax.engine import Engine, FieldError, GenerationControls, SlotSettings, StepPlan
from specjax.rules import mars
from specjax.testing import llama_config, peaked_target_and_draft
from test_decode import count_compilations, np_warp_probs

K, CAPACITY, TOP = 3, 40, 4


@pytest.fixture(scope="module")
def llama_pair():
    return specjax.pair(*peaked_target_and_draft(llama_config()))


@pytest.fixture(scope="module")
def engine(llama_pair):
    """Four slots reporting up to TOP alternatives per token."""
    return Engine(llama_pair, num_slots=4, capacity=CAPACITY, num_draft=K, logprobs=TOP)


@pytest.fixture(scope="module")
def planned(llama_pair):
    """Four slots, the three step programs and row buckets 1, 2, 4 (no log-probs)."""
    return Engine(llama_pair, num_slots=4, capacity=CAPACITY, num_draft=K, specialized_steps=True,
                  row_buckets="powers")


def run_to_end(engine, state, plan=None, cycles=3):
    """Steps until every slot is done. Returns ``{slot: {name: committed entries}}``
    with the StepOutput's per-token fields (those it has)."""
    got = {}
    for _ in range(200):
        state, out = engine.step(state, cycles, plan=plan)
        out = jax.device_get(out)
        for s in range(engine.num_slots):
            n = out.counts[s]
            for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
                value = getattr(out, name)
                if value is not None:
                    got.setdefault(s, {}).setdefault(name, []).extend(value[s, :n])
        if out.done.all():
            return got, state
    raise AssertionError("the slots did not finish in 200 steps")


# ---------------------------------------------------------------------------
# 1. Log-probabilities of the committed tokens
# ---------------------------------------------------------------------------

PROMPTS = [[5, 9, 3], [7, 7, 1, 7, 7], [1, 2, 3, 4], [11, 12]]
PENALTY = GenerationControls(repetition_penalty=1.3)
REQUESTS = [
    SlotSettings(temperature=0.0, max_new_tokens=12, logprobs=TOP),
    SlotSettings(temperature=0.7, top_k=6, top_p=0.9, seed=3, max_new_tokens=12, controls=PENALTY, logprobs=3),
    SlotSettings(temperature=1.0, seed=4, max_new_tokens=12, logprobs=0),  # its own token's only
    SlotSettings(temperature=0.7, seed=9, max_new_tokens=12),  # none asked
]


def reference_logprobs(pair, prompt, generated, s: SlotSettings, raw: bool = False):
    """``[m, V]`` float64: the target alone over ``prompt + generated``, then at each generated
    position its repetition penalty (numpy), temperature, top-k and top-p (``np_warp_probs``);
    greedy: log_softmax of the processed logits. ``raw``: log_softmax of the raw logits at T."""
    target = pair.target
    x = np.asarray(prompt + generated, np.int32)
    padded = np.zeros((1, CAPACITY), np.int32)
    padded[0, : len(x)] = x
    logits = np.asarray(_forward(target, padded)[0], np.float64)
    out = []
    for j in range(len(generated)):
        z = logits[len(prompt) - 1 + j].copy()
        if raw:
            z = z / s.temperature
            out.append(z - np.logaddexp.reduce(z))
            continue
        r = s.controls.repetition_penalty if s.controls else 1.0
        seen = np.zeros(z.shape, bool)
        seen[x[: len(prompt) + j]] = True
        z = np.where(seen, np.where(z > 0, z / r, z * r), z)
        if s.temperature == 0.0:
            out.append(z - np.logaddexp.reduce(z))
        else:
            with np.errstate(divide="ignore"):
                out.append(np.log(np_warp_probs(z, s.temperature, s.top_k, s.top_p)))
    return np.maximum(np.stack(out), -9999.0)


@jax.jit
def _forward(target, tokens):
    return target.module.apply(target.params, tokens).logits


def test_logprobs_are_the_targets_sampling_distribution(llama_pair, engine):
    """Greedy, sampled (T=0.7, top-k, top-p, a repetition penalty), chosen-only and no-log-prob
    requests in one state: each committed token's log-prob is the target's alone at that prefix
    after the same processing, and the alternatives are that distribution's most likely tokens.
    Negative control: the raw logits' log-softmax at T=0.7 would differ."""
    state = engine.init()
    for slot, (prompt, s) in enumerate(zip(PROMPTS, REQUESTS)):
        state = engine.insert(state, slot, prompt, s)
    got, _ = run_to_end(engine, state)
    for slot, (prompt, s) in enumerate(zip(PROMPTS, REQUESTS[:3])):
        tokens = [int(t) for t in got[slot]["tokens"]]
        assert len(tokens) == s.max_new_tokens or tokens[-1] in (0, 1, 2)  # ran to its end
        ref = reference_logprobs(llama_pair, prompt, tokens, s)
        chosen = ref[np.arange(len(tokens)), tokens]
        assert (chosen > -9999.0).all(), slot  # every committed token was one its distribution allows
        np.testing.assert_allclose(got[slot]["logprobs"], chosen, atol=1e-4, err_msg=f"slot {slot}")
        if s.temperature == 0.0:
            assert tokens == ref.argmax(1).tolist()
        if s.logprobs:
            k = s.logprobs
            top_ids, top_lp = np.stack(got[slot]["top_ids"])[:, :k], np.stack(got[slot]["top_logprobs"])[:, :k]
            ref_sorted = -np.sort(-ref, axis=1)[:, :k]
            np.testing.assert_allclose(top_lp, ref_sorted, atol=1e-4, err_msg=f"slot {slot}")
            assert (np.diff(top_lp, axis=1) <= 0).all()  # most likely first
            kept = ref_sorted > -9999.0  # past the kept tokens the order among -inf ones is arbitrary
            np.testing.assert_array_equal(np.where(kept, top_ids, -1),
                                          np.where(kept, np.argsort(-ref, axis=1, kind="stable")[:, :k], -1))
            np.testing.assert_allclose(np.take_along_axis(ref, top_ids, axis=1), top_lp, atol=1e-4)
    tokens = [int(t) for t in got[1]["tokens"]]
    raw = reference_logprobs(llama_pair, PROMPTS[1], tokens, REQUESTS[1], raw=True)[np.arange(len(tokens)), tokens]
    assert np.abs(np.asarray(got[1]["logprobs"]) - raw).max() > 0.05


def test_logprobs_off_compiles_what_the_engine_compiled_before(llama_pair, planned):
    """``Engine(logprobs=0)`` is the engine without log-probs: the same static structure, so its
    programs are the ones already compiled (none new), and its StepOutput has no log-prob leaves.
    A request cannot ask it for log-probs."""
    off = Engine(llama_pair, num_slots=4, capacity=CAPACITY, num_draft=K, specialized_steps=True,
                 row_buckets="powers", logprobs=0)
    assert off.cfg == planned.cfg and off.logprobs == 0
    settings = SlotSettings(temperature=0.0, max_new_tokens=4)
    planned.step(planned.insert(planned.init(), 0, PROMPTS[0], settings), 2)  # compiled here, if not before
    with count_compilations() as compiled:
        state, out = off.step(off.insert(off.init(), 0, PROMPTS[0], settings), 2)
    assert compiled["n"] == 0
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None
    assert len(jax.tree_util.tree_leaves(out)) == 5 and state.logprobs is None and state.loop.logprobs is None
    assert off.validate(settings._replace(logprobs=0), 3)[0].field == "logprobs"


# ---------------------------------------------------------------------------
# 2. Fork: n choices of one prompt from one prefill
# ---------------------------------------------------------------------------


def test_fork_samples_what_decode_samples_per_row(llama_pair, engine):
    """A request inserted with decode's key of row 0 and forked into two slots with those of rows
    1 and 2 decodes, per slot, what ``decode([prompt] * 3, key=key(5))`` gives that row."""
    prompt, base = [4, 5, 6, 7], jax.random.key(5)
    s = SlotSettings(temperature=1.0, max_new_tokens=16, key=jax.random.fold_in(base, 0))
    state = engine.insert(engine.init(), 0, prompt, s)
    state = engine.fork(state, 0, [2, 3], [jax.random.fold_in(base, 1), jax.random.fold_in(base, 2)])
    assert engine.free_slots(state) == [1]
    got, _ = run_to_end(engine, state)
    ref = specjax.decode(llama_pair, [prompt] * 3, num_draft=K, max_new_tokens=16, temperature=1.0, key=base,
                         max_length=CAPACITY + K).to_lists()
    rows = [[int(t) for t in got[slot]["tokens"]] for slot in (0, 2, 3)]
    assert rows == ref
    assert len({tuple(r) for r in rows}) > 1  # the keys made the copies differ


def test_fork_checks_its_arguments(llama_pair, engine):
    state = engine.insert(engine.init(), 1, [4, 5], SlotSettings(seed=0, max_new_tokens=4))
    key = jax.random.key(0)
    cases = [
        (dict(source=0), "source slot 0 holds no request"),
        (dict(slots=[1]), r"slot\(s\) \[1\] are busy"),
        (dict(slots=[2, 2], keys=[key, key]), "name a slot twice"),
        (dict(slots=[4]), "slot 4 is not one of this engine's 4 slots"),
        (dict(slots=[2, 3]), "2 slots and 1 keys"),
        (dict(keys=[0]), "key must be one typed PRNG key"),
        (dict(slots=[]), "at least one slot"),
    ]
    for change, message in cases:
        args = dict(source=1, slots=[2], keys=[key])
        args.update(change)
        with pytest.raises((ValueError, TypeError), match=message):
            engine.fork(state, args["source"], args["slots"], args["keys"])
    assert engine.free_slots(state) == [0, 2, 3]
    # A copy draws its own first token from the prompt's prefill: a request that has stepped is refused.
    stepped, _ = engine.step(state, 1)
    with pytest.raises(ValueError, match="slot 1's request has run steps since its insert"):
        engine.fork(stepped, 1, [2], [key])
    # A donating engine consumes the state passed in, as insert does.
    donating = Engine(llama_pair, num_slots=4, capacity=CAPACITY, num_draft=K, logprobs=TOP, donate_state=True)
    before = donating.insert(donating.init(), 1, [4, 5], SlotSettings(seed=0, max_new_tokens=4))
    after = donating.fork(before, 1, [0, 3], jax.random.split(key, 2))
    assert before.loop.tokens.is_deleted() and donating.free_slots(after) == [2]


# ---------------------------------------------------------------------------
# 3. Settings checked as data
# ---------------------------------------------------------------------------


def test_validate_names_each_bad_field(engine):
    """Each bad setting comes back as a FieldError naming its SlotSettings field (controls as
    ``controls.<field>``); several come back together, in the order insert raises them, and insert
    raises the first one's message. Good settings give ()."""
    good = SlotSettings(temperature=0.7, top_p=0.9, top_k=5, seed=1, max_new_tokens=8, logprobs=2,
                        controls=GenerationControls(repetition_penalty=1.2, logit_bias={3: 1.0}))
    assert engine.validate(good, 3) == () and engine.validate(SlotSettings(max_new_tokens=8), 3) == ()
    cases = {
        "temperature": dict(temperature=-1.0),
        "top_p": dict(top_p=0.0),
        "top_k": dict(top_k=1000),
        "seed": dict(seed=-1),
        "key": dict(key=7),
        "max_new_tokens": dict(max_new_tokens=CAPACITY),  # with the 3-token prompt, past the capacity
        "eos_token_id": dict(eos_token_id=999),
        "stop_token_ids": dict(stop_token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9]),  # more than max_eos ids
        "num_draft": dict(num_draft=K + 1),
        "rule": dict(rule=mars(0.5)),
        "logprobs": dict(logprobs=TOP + 1),
        "controls.logit_bias": dict(controls=GenerationControls(logit_bias={999: 1.0})),
        "controls.presence_penalty": dict(controls=GenerationControls(presence_penalty=3.0)),
        "controls.frequency_penalty": dict(controls=GenerationControls(frequency_penalty=-3.0)),
        "controls.repetition_penalty": dict(controls=GenerationControls(repetition_penalty=0.0)),
        "controls.min_new_tokens": dict(controls=GenerationControls(min_new_tokens=-1)),
    }
    for field, change in cases.items():
        bad = SlotSettings(max_new_tokens=8, seed=0)._replace(**change)
        if field == "key":
            bad = bad._replace(seed=None)
        errors = engine.validate(bad, 3)
        assert [e.field for e in errors] == [field], (field, errors)
        assert isinstance(errors[0], FieldError) and errors[0].message
        with pytest.raises((ValueError, TypeError)) as raised:
            engine.insert(engine.init(), 0, [1, 2, 3], bad)
        assert str(raised.value).endswith(errors[0].message)  # insert adds "request 0: " to the capacity's
    several = SlotSettings(temperature=-1.0, top_p=2.0, max_new_tokens=8, num_draft=-1, logprobs=9,
                           controls=GenerationControls(presence_penalty=5.0, logit_bias={999: 1.0}))
    assert [e.field for e in engine.validate(several, 3)] == [
        "temperature", "top_p", "num_draft", "controls.presence_penalty", "controls.logit_bias", "logprobs"]
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        engine.insert(engine.init(), 0, [1, 2, 3], several)
    with pytest.raises(TypeError, match="SlotSettings"):
        engine.validate({"temperature": 1.0}, 3)


# ---------------------------------------------------------------------------
# 4. The step program chosen by the caller
# ---------------------------------------------------------------------------

GREEDY = SlotSettings(temperature=0.0, max_new_tokens=10)
SAMPLED = SlotSettings(temperature=0.7, seed=2, max_new_tokens=10)
MIXES = [
    {},
    {0: GREEDY},
    {0: GREEDY, 1: SAMPLED},
    {0: SlotSettings(temperature=0.7, top_p=0.9, seed=1, max_new_tokens=10)},
    {2: GREEDY._replace(controls=GenerationControls(repetition_penalty=1.3))},
    {1: SlotSettings(temperature=0.7, top_k=5, seed=1, max_new_tokens=10), 3: GREEDY},
    {0: SAMPLED._replace(top_p=1.0 - 1e-9)},  # rounds to 1 in float32, as the state holds it
    {3: SAMPLED._replace(controls=GenerationControls())},  # default controls change nothing
]


def test_plan_matches_the_state_and_steps_the_same(llama_pair, planned):
    """For each mix of settings, ``plan`` from the host settings is what the engine reads from a
    state holding them; stepping with the plan decodes what stepping without it does."""
    expected = [("greedy", 1), ("greedy", 1), ("sampled", 2), ("general", 1), ("general", 4), ("general", 4),
                ("sampled", 1), ("sampled", 4)]
    for mix, want in zip(MIXES, expected):
        state = planned.init()
        for slot, s in mix.items():
            state = planned.insert(state, slot, PROMPTS[slot], s)
        plan = planned.plan(mix)
        assert isinstance(plan, StepPlan) and plan == want, (mix, plan)
        assert plan == (planned.step_program(state), planned.rows_to_run(state)), mix
    mix = MIXES[2]
    state = planned.init()
    for slot, s in mix.items():
        state = planned.insert(state, slot, PROMPTS[slot], s)
    with_plan, _ = run_to_end(planned, state, plan=planned.plan(mix))
    without, _ = run_to_end(planned, state)
    assert [list(with_plan[s]["tokens"]) for s in mix] == [list(without[s]["tokens"]) for s in mix]
    with pytest.raises(ValueError, match="not one of this engine's"):
        planned.step(state, 1, plan=StepPlan("greedy", 3))
    with pytest.raises(TypeError, match="StepPlan"):
        planned.step(state, 1, plan=("greedy", 1))
    plain = Engine(llama_pair, num_slots=4, capacity=CAPACITY, num_draft=K)
    assert plain.plan({0: GREEDY}) == StepPlan("general", 4)
