"""Token trees in the slots engine: every slot drafts a tree per cycle, with its own settings, and
each request decodes what ``decode(tree=...)`` gives it alone."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax.drafting import ngram_lookup
from specjax.engine import Engine, SlotSettings
from specjax.rules import ears, mars, one_of, speculative_sampling, typical
from specjax.testing import bigram_model, llama_config, peaked_target_and_draft, random_table
from specjax.trees import dynamic_tree, static_tree
from test_decode import count_compilations
from test_rule_per_request import first_two_tokens_by_member
from test_slots import run_to_end
from test_slots_serving import reference_logprobs
from test_slots_serving import run_to_end as run_with_logprobs

CAPACITY = 48
RULES = (speculative_sampling(), mars(theta=0.5), ears(beta=0.5), typical(eps=0.3, delta=0.3))
PROMPTS = [[5, 9, 3], [7] * 12, [1, 2, 3, 4, 5, 6], [11, 12]]
PENALTIES = specjax.GenerationControls(repetition_penalty=1.4, frequency_penalty=0.5, logit_bias={3: 2.0})
# PENALTIES' fields at values that change no logit: decode runs it with PENALTIES' program (the
# numbers are traced), a no-penalty reference that compiles nothing new.
NO_PENALTIES = specjax.GenerationControls(repetition_penalty=1.0, frequency_penalty=0.0, logit_bias={3: 0.0})
REQUESTS = [
    SlotSettings(temperature=0.0, max_new_tokens=20, controls=PENALTIES),  # the lossless member, greedy, penalised
    SlotSettings(temperature=0.0, max_new_tokens=20, rule=mars(theta=0.3)),  # relaxed, greedy, its own number
    SlotSettings(temperature=1.0, seed=3, max_new_tokens=18, rule=ears(beta=0.5), controls=PENALTIES),
    SlotSettings(temperature=0.8, top_p=0.9, top_k=20, seed=5, max_new_tokens=20, rule=typical(eps=0.3, delta=0.3)),
]


@pytest.fixture(scope="module")
def llama_pair():
    return specjax.pair(*peaked_target_and_draft(llama_config()))


@pytest.fixture(scope="module")
def head_pair(llama_pair):
    target = llama_pair.target
    return specjax.pair(target, specjax.heads.init_from_target(target, jax.random.key(1), np.arange(80)[::-1]))


def alone(pair, tree, prompt, s: SlotSettings, rule=None):
    key = None if s.seed is None else jax.random.key(s.seed)
    out = specjax.decode(pair, [prompt], tree=tree, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                         top_k=s.top_k, top_p=None if s.top_p >= 1 else s.top_p, key=key,
                         rule=rule or s.rule or RULES[0], max_length=CAPACITY + tree.num_nodes, controls=s.controls)
    return out.to_lists()[0]


# Static trees of the draft model in slots also decode as decode does in
# test_draft_cap_limits_the_path_depth and test_fork_on_a_tree_samples_what_decode_samples_per_row.
@pytest.mark.parametrize("drafter, tree", [
    pytest.param("draft model", static_tree((2, 2, 1)), marks=pytest.mark.slow),
    ("feature head", dynamic_tree(3, 2, 5)),
], ids=["static-draft-model", "dynamic-feature-head"])
def test_each_request_decodes_as_decode_alone_on_its_tree(llama_pair, head_pair, drafter, tree):
    """Four slots, four rules, greedy and sampled (top-p and top-k on one), penalties on two, one
    inserted mid-run: each request gets exactly the tokens decode(tree=...) gives it alone with its
    rule and controls; a request with other numbers later compiles nothing."""
    pair = llama_pair if drafter == "draft model" else head_pair
    engine = Engine(pair, num_slots=4, capacity=CAPACITY, rule=one_of(*RULES), tree=tree)
    assert engine.tree == tree and engine.num_draft == tree.max_depth and engine.cfg.controls
    state = engine.insert_many(engine.init(), [0, 1, 2], PROMPTS[:3], REQUESTS[:3])
    got, state = run_to_end(engine, state, pending=[(2, 3, PROMPTS[3], REQUESTS[3])])
    for slot, s in enumerate(REQUESTS):
        assert got[slot] == alone(pair, tree, PROMPTS[slot], s), (slot, str(s.rule))
    # MARS at theta 0.3 relaxed something on the tree: the slot did not run the lossless default.
    assert got[1] != alone(pair, tree, PROMPTS[1], REQUESTS[0])
    # The penalties changed what the greedy request got.
    assert got[0] != alone(pair, tree, PROMPTS[0], REQUESTS[0]._replace(controls=NO_PENALTIES))
    state = engine.release(state, 0)
    with count_compilations() as compiled:
        state = engine.insert(state, 0, PROMPTS[0], SlotSettings(temperature=0.6, seed=1, max_new_tokens=4,
                                                                 top_k=5, rule=mars(theta=0.8)))
        state, _ = engine.step(state, 2)
        jax.block_until_ready(state.loop.tokens)
    assert compiled["n"] == 0


def test_draft_cap_limits_the_path_depth(llama_pair):
    """A request's num_draft caps the depth its path accepts: greedy, the output is the target's
    own (cap 0, 1 or the full depth); cap 1 accepts at most one draft per cycle (tau <= 2, as
    decode on the tree's first level), cap 0 none; beyond the tree's depth it is refused by name."""
    tree = static_tree((2, 2, 1))
    # Four slots (the last stays free), as in test_fork_on_a_tree_samples_what_decode_samples_per_row:
    # one step program for both.
    engine = Engine(llama_pair, num_slots=4, capacity=CAPACITY, tree=tree)
    requests = [SlotSettings(temperature=0.0, max_new_tokens=20, num_draft=cap) for cap in (0, 1, None)]
    state = engine.insert_many(engine.init(), [0, 1, 2], [PROMPTS[2]] * 3, requests)
    got, state = run_to_end(engine, state)
    target_only = specjax.generate(llama_pair.target, [PROMPTS[2]], max_new_tokens=20, temperature=0.0,
                                   max_length=CAPACITY).to_lists()[0]
    assert got[0] == got[1] == got[2] == target_only
    one_level = alone(llama_pair, static_tree((2,)), PROMPTS[2], requests[1])
    assert got[1] == one_level
    stats = jax.device_get(state.loop.stats)
    accepted, cycles = np.asarray(stats.accepted), np.asarray(stats.cycles)  # [S]
    assert accepted[0] == 0 and 0 < accepted[1] <= cycles[1] and accepted[2] > accepted[1], (accepted, cycles)
    errors = engine.validate(SlotSettings(num_draft=4, max_new_tokens=4), 3)
    assert [e.field for e in errors] == ["num_draft"] and "0 .. 3" in errors[0].message


def test_logprobs_on_trees_are_the_targets_sampling_distribution(llama_pair):
    """Log-probabilities of a tree's committed path: each token's under the target's warped
    distribution at its position (numpy reference), greedy and at T=0.7 with top-k; a raw-logits
    negative control differs."""
    engine = Engine(llama_pair, num_slots=2, capacity=CAPACITY, tree=dynamic_tree(3, 2, 5), logprobs=4)
    requests = [SlotSettings(temperature=0.0, max_new_tokens=12, logprobs=4),
                SlotSettings(temperature=0.7, top_k=6, seed=3, max_new_tokens=12, logprobs=2)]
    state = engine.insert_many(engine.init(), [0, 1], PROMPTS[:2], requests)
    got, _ = run_with_logprobs(engine, state)
    for slot, s in enumerate(requests):
        tokens = [int(t) for t in got[slot]["tokens"]]
        ref = reference_logprobs(llama_pair, PROMPTS[slot], tokens, s)
        np.testing.assert_allclose(got[slot]["logprobs"], ref[np.arange(len(tokens)), tokens], atol=1e-4)
        top = np.stack(got[slot]["top_logprobs"])[:, : s.logprobs]
        np.testing.assert_allclose(top, -np.sort(-ref, axis=1)[:, : s.logprobs], atol=1e-4)
    tokens = [int(t) for t in got[1]["tokens"]]
    raw = reference_logprobs(llama_pair, PROMPTS[1], tokens, requests[1], raw=True)[np.arange(len(tokens)), tokens]
    assert np.abs(np.asarray(got[1]["logprobs"]) - raw).max() > 0.05


VOCAB = 8


# The static tree is slow-only (about 12 s): a static tree samples in slots what decode samples
# per row (test_fork_on_a_tree_samples_what_decode_samples_per_row), and decode's law on static
# trees runs by default in test_tree_decode.py::test_tree_sampling_is_lossless.
@pytest.mark.parametrize("tree", [pytest.param(static_tree((3, 2)), marks=pytest.mark.slow),
                                  dynamic_tree(2, 3, 4, sampled=False)],
                         ids=["static", "dynamic-point-mass"])
def test_lossless_slots_in_a_mixed_state_sample_the_targets_law(tree):
    """Slots judged by the lossless rule and by typical in one state, at T=1, on trees: the
    lossless slots' first two tokens follow the target's law exactly (chi-square); typical's with
    a high floor do not, so the test can tell the rules apart."""
    pair = specjax.pair(bigram_model(random_table(0, VOCAB)), bigram_model(random_table(1, VOCAB)))
    rules = (speculative_sampling(), typical(eps=0.3, delta=0.3))
    engine = Engine(pair, num_slots=5000 * len(rules), capacity=8, rule=one_of(*rules), tree=tree)
    fit = first_two_tokens_by_member(engine, pair, rules)
    pvalue, tv = fit(0)
    assert pvalue > 1e-3 and tv < 0.05, (pvalue, tv)
    pvalue, tv = fit(1)  # negative control
    assert pvalue < 1e-6 and tv > 0.05, (pvalue, tv)


def test_tree_engine_refuses_what_trees_do_not_take(llama_pair):
    tree = static_tree((2, 1))
    with pytest.raises(ValueError, match="lookup= drafts chains"):
        Engine(llama_pair, num_slots=1, capacity=16, tree=tree, lookup=ngram_lookup(2))
    with pytest.raises(ValueError, match="num_draft=2 but the tree's depth is 3"):
        Engine(llama_pair, num_slots=1, capacity=16, tree=static_tree((2, 1, 1)), num_draft=2)
    with pytest.raises(TypeError, match="tree must be a TokenTree"):
        Engine(llama_pair, num_slots=1, capacity=16, tree=(2, 1))
    with pytest.raises(ValueError, match="the tree's 5 nodes exceeds the target model's 128 positions"):
        Engine(llama_pair, num_slots=1, capacity=126, tree=tree)
    engine = Engine(llama_pair, num_slots=1, capacity=16, tree=tree, controls=False)
    errors = engine.validate(SlotSettings(controls=specjax.GenerationControls(repetition_penalty=1.2),
                                          max_new_tokens=4), 3)
    assert [e.field for e in errors] == ["controls"] and "controls=False" in errors[0].message


# The sampled request is slow-only (about 5 s, a decode program of its own for the reference): a
# sampled request after a chunked insert runs by default in test_chunked_prefill.py.
@pytest.mark.parametrize("s", [SlotSettings(temperature=0.0, max_new_tokens=12),
                               pytest.param(SlotSettings(temperature=0.9, seed=4, max_new_tokens=12),
                                            marks=pytest.mark.slow)], ids=["greedy", "sampled"])
def test_a_prompt_prefilled_in_chunks_decodes_as_a_whole_insert_on_a_tree(head_pair, s):
    """Chunked prefill into a tree engine (a feature head, whose pending features the last chunk
    builds): the request decodes what decode(tree=...) gives it alone, while a neighbour steps
    between the chunks."""
    tree = dynamic_tree(3, 2, 5)
    engine = Engine(head_pair, num_slots=2, capacity=120, tree=tree)
    prompt = [(7 * i) % 90 + 1 for i in range(100)]
    state = engine.insert(engine.init(), 0, PROMPTS[0], SlotSettings(temperature=0.0, max_new_tokens=40))
    job = engine.begin_insert(state, 1, prompt, s, chunk=64)
    while not job.finished:
        state, _ = engine.step(state, 1)
        state, job = engine.continue_insert(state, job)
    got, _ = run_to_end(engine, state)
    key = None if s.seed is None else jax.random.key(s.seed)
    ref = specjax.decode(head_pair, [prompt], tree=tree, max_new_tokens=12, temperature=s.temperature, key=key,
                         max_length=120 + tree.num_nodes).to_lists()[0]
    assert got[1] == ref, s


def test_fork_on_a_tree_samples_what_decode_samples_per_row(llama_pair):
    """``n`` choices of one prompt on a tree: a request forked into two slots with decode's keys
    of rows 1 and 2 decodes, per slot, what ``decode([prompt] * 3, tree=..., key=key(5))`` gives."""
    tree = static_tree((2, 2, 1))
    engine = Engine(llama_pair, num_slots=4, capacity=CAPACITY, tree=tree)
    prompt, base = [4, 5, 6, 7], jax.random.key(5)
    state = engine.insert(engine.init(), 0, prompt, SlotSettings(temperature=1.0, max_new_tokens=16,
                                                                 key=jax.random.fold_in(base, 0)))
    state = engine.fork(state, 0, [2, 3], [jax.random.fold_in(base, 1), jax.random.fold_in(base, 2)])
    got, _ = run_to_end(engine, state)
    ref = specjax.decode(llama_pair, [prompt] * 3, tree=tree, max_new_tokens=16, temperature=1.0, key=base,
                         max_length=CAPACITY + tree.num_nodes).to_lists()
    rows = [got[slot] for slot in (0, 2, 3)]
    assert rows == ref and len({tuple(r) for r in rows}) > 1
