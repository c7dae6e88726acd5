"""A rule per request: ``one_of(...)`` in the slots engine, each request judged by the member it picks."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax.engine import Engine, SlotSettings
from specjax.rules import (OneOf, adasd, ears, mars, one_of, parse_rule, speculative_sampling, top_m, typical)
from specjax.testing import bigram_model, llama_config, peaked_target_and_draft, random_table
from test_decode import count_compilations, exact_two_token_distribution, goodness_of_fit
from test_slots import run_to_end

K, CAPACITY = 3, 48
RULES = (speculative_sampling(), mars(theta=0.5), ears(beta=0.5), typical(eps=0.3, delta=0.3))


def test_parse_round_trip_and_factory_checks():
    rule = parse_rule("one_of(sd,mars:theta=0.9,ears:beta=0.1,typical)")
    assert isinstance(rule, OneOf) and int(rule.index) == 0 and len(rule.rules) == 4
    assert rule == one_of(speculative_sampling(), mars(0.9), ears(0.1), typical())
    assert str(rule) == "one_of(speculative_sampling,mars:theta=0.9,ears:beta=0.1,typical:eps=0.09,delta=0.3)"
    for r in (rule, one_of(*RULES, index=2), parse_rule("one_of(typical:eps=0.09,delta=0.3,mars:theta=0.9):index=1")):
        assert parse_rule(str(r)) == r and parse_rule(str(r)).spec == r.spec
    assert str(one_of(*RULES, index=3)).endswith("):index=3")
    with pytest.raises(ValueError, match="index must be an integer in 0 .. 3"):
        one_of(*RULES, index=4)
    with pytest.raises(ValueError, match="one_of takes only 'rules' and 'index'"):
        parse_rule("one_of(sd,mars):theta=1")
    assert one_of(mars(), typical()).level_set is False and one_of(typical(), top_m(2)).level_set


@pytest.fixture(scope="module")
def llama_pair():
    return specjax.pair(*peaked_target_and_draft(llama_config()))


def test_each_request_decodes_as_decode_alone_with_its_rule(llama_pair):
    """Four slots, four rules (greedy and sampled), one inserted mid-run: each request gets exactly
    what decode gives it alone with its rule; a second request with another rule compiles nothing;
    a rule outside the set, or another static setting of a member, is refused by name."""
    engine = Engine(llama_pair, num_slots=4, capacity=CAPACITY, num_draft=K, rule=one_of(*RULES), controls=False)
    assert engine.served_rules == RULES and engine.cfg.per_slot_rule
    prompts = [[5, 9, 3], [7] * 12, [1, 2, 3, 4, 5, 6], [11, 12]]
    requests = [
        SlotSettings(temperature=0.0, max_new_tokens=20),  # the default: the first member (lossless)
        SlotSettings(temperature=0.0, max_new_tokens=20, rule=mars(theta=0.3)),  # a member with its own number
        SlotSettings(temperature=1.0, seed=3, max_new_tokens=18, rule=ears(beta=0.5)),
        SlotSettings(temperature=0.8, seed=5, max_new_tokens=20, rule=typical(eps=0.3, delta=0.3)),
    ]
    state = engine.insert_many(engine.init(), [0, 1, 2], prompts[:3], requests[:3])
    got, state = run_to_end(engine, state, pending=[(2, 3, prompts[3], requests[3])])
    for slot, s in enumerate(requests):
        key = None if s.seed is None else jax.random.key(s.seed)
        ref = specjax.decode(llama_pair, [prompts[slot]], num_draft=K, max_new_tokens=s.max_new_tokens,
                             temperature=s.temperature, key=key, rule=s.rule or RULES[0], max_length=CAPACITY + K,
                             controls=None)
        assert got[slot] == ref.to_lists()[0], (slot, str(s.rule))
    greedy_mars = specjax.decode(llama_pair, [prompts[1]], num_draft=K, max_new_tokens=20, temperature=0.0,
                                 max_length=CAPACITY + K).to_lists()[0]
    assert got[1] != greedy_mars  # MARS at theta 0.3 relaxed something: the slot did not run the default
    # rule_for: the engine's one_of, pointing at the member, with the request's numbers.
    chosen = engine.rule_for(mars(theta=0.3))
    assert int(chosen.index) == 1 and chosen.rules[1] == mars(theta=0.3) and chosen.rules[0] == RULES[0]
    assert int(engine.rule_for(typical(eps=0.3, delta=0.3)).index) == 3
    # Another rule, later, compiles nothing.
    state = engine.release(state, 0)
    with count_compilations() as compiled:
        state = engine.insert(state, 0, prompts[0], SlotSettings(temperature=0.0, max_new_tokens=4,
                                                                 rule=ears(beta=0.2)))
        state, _ = engine.step(state, 2)
        jax.block_until_ready(state.loop.tokens)
    assert compiled["n"] == 0
    # Outside the set: refused with the served rules named, as data by validate and raised by insert.
    for bad in (top_m(2), mars(theta=0.9, variant="authors"), adasd()):
        errors = engine.validate(SlotSettings(rule=bad, max_new_tokens=4), 3)
        assert [e.field for e in errors] == ["rule"], bad
        assert "not a rule this engine serves (speculative_sampling, mars:theta=0.5" in errors[0].message
    with pytest.raises(ValueError, match="not a rule this engine serves"):
        engine.insert(engine.init(), 0, [1], SlotSettings(rule=top_m(2), max_new_tokens=4))
    with pytest.raises(TypeError, match="expected an AcceptanceRule"):
        engine.rule_for("mars")


def test_update_advances_only_the_chosen_members_state():
    """AdaSD's running means belong to the requests AdaSD judges: a lossless request beside it leaves
    its AdaSD state at init, and the AdaSD request samples what decode samples with AdaSD alone."""
    pair = specjax.pair(bigram_model(random_table(0, 16)), bigram_model(random_table(1, 16)))
    engine = Engine(pair, num_slots=2, capacity=40, num_draft=K, rule=one_of(speculative_sampling(), adasd()),
                    controls=False)
    requests = [SlotSettings(temperature=1.0, seed=1, max_new_tokens=30, eos_token_id=()),
                SlotSettings(temperature=1.0, seed=2, max_new_tokens=30, eos_token_id=(), rule=adasd())]
    state = engine.insert_many(engine.init(), [0, 1], [[3, 4], [3, 4]], requests)
    got, state = run_to_end(engine, state)
    for slot, s in enumerate(requests):
        ref = specjax.decode(pair, [[3, 4]], num_draft=K, max_new_tokens=30, temperature=1.0,
                             key=jax.random.key(s.seed), rule=s.rule or speculative_sampling(),
                             max_length=40 + K, eos_token_id=())
        assert got[slot] == ref.to_lists()[0], slot
    adasd_state = jax.device_get(state.loop.rule_state[1])
    counts = np.asarray(adasd_state.accepted_count) + np.asarray(adasd_state.rejected_count)
    assert counts[0] == 0 and counts[1] > 0  # slot 0 (lossless) never advanced AdaSD's means


VOCAB = 8


def test_lossless_request_in_a_mixed_state_samples_the_targets_law():
    """Slots judged by four rules in one state, at T=1: the lossless slots' first two tokens follow
    the target's law exactly; the slots of a relaxed member (typical with a high floor) do not, so
    the test can tell the rules apart."""
    pair = specjax.pair(bigram_model(random_table(0, VOCAB)), bigram_model(random_table(1, VOCAB)))
    engine = Engine(pair, num_slots=5000 * len(RULES), capacity=8, num_draft=K, rule=one_of(*RULES), controls=False)
    fit = first_two_tokens_by_member(engine, pair, RULES)
    pvalue, tv = fit(0)
    assert pvalue > 1e-3 and tv < 0.05, (pvalue, tv)
    pvalue, tv = fit(3)  # negative control: typical's law is not the target's
    assert pvalue < 1e-6 and tv > 0.05, (pvalue, tv)


def first_two_tokens_by_member(engine, pair, rules):
    """Fills every slot with the prompt ``[3]`` at T=1, slot ``i`` judged by ``rules[i % len(rules)]``
    (seed ``i``), steps until each slot has 2 tokens, and returns ``fit(member) -> (p-value, TV)``
    of that member's slots' first two tokens against the target's exact law."""
    n = engine.num_slots
    settings = [SlotSettings(temperature=1.0, max_new_tokens=2, eos_token_id=(), seed=i, rule=rules[i % len(rules)])
                for i in range(n)]
    state = engine.insert_many(engine.init(), list(range(n)), [[3]] * n, settings)
    _, out = engine.step(state, 4)
    out = jax.device_get(out)
    assert (out.counts == 2).all()
    vocab = engine.vocab_size
    law = exact_two_token_distribution(np.asarray(pair.target.params["table"]), 3, 1.0, None, None)

    def fit(member):
        toks = out.tokens[member::len(rules), :2]
        counts = np.zeros((vocab, vocab))
        np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
        return goodness_of_fit(counts, law)

    return fit
