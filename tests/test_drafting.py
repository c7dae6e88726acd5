"""Drafting policies: their schedules, and that decoding with them stays exact.

Greedy decoding with the lossless rule must return the target's own greedy
tokens whatever the drafting policy does, so each policy is checked against
``generate``; the schedules are unit-tested on the pure functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import drafting

from bigram import bigram_model, random_table

VOCAB = 8
K = 4


def step(token_prob=0.5, entropy=1.0, position=0):
    probs = jnp.full((VOCAB,), 1.0 / VOCAB)
    return drafting.DraftStep(
        position=jnp.int32(position), token=jnp.int32(0), probs=probs,
        token_prob=jnp.float32(token_prob), entropy=jnp.float32(entropy),
    )


def outcome(num_accepted, num_drafted, entropies=None):
    valid = jnp.arange(K) < num_drafted
    ent = jnp.zeros((K,)) if entropies is None else jnp.asarray(entropies, jnp.float32)
    return drafting.DraftOutcome(
        num_drafted=jnp.int32(num_drafted), num_accepted=jnp.int32(num_accepted), valid=valid,
        entropies=ent, token_probs=jnp.full((K,), 0.5),
    )


# ---------------------------------------------------------------------------
# Schedules (pure functions)
# ---------------------------------------------------------------------------


def test_fixed_schedule():
    p = drafting.fixed(2)
    s = p.init(K)
    assert int(p.budget(s, K)) == 2
    assert bool(p.proceed(s, step(token_prob=0.0)))
    assert int(drafting.fixed().budget(s, K)) == K
    with pytest.raises(ValueError, match="positive integer"):
        drafting.fixed(0)


def test_heuristic_schedule():
    p = drafting.heuristic(initial=2)
    s = p.init(K)
    trace = [int(p.budget(s, K))]
    # all accepted, all accepted (clipped at K), rejected x4 (clipped at 1), all accepted
    for n, v in [(2, 2), (4, 4), (1, 4), (0, 3), (0, 2), (0, 1), (1, 1)]:
        s = p.update(s, outcome(n, v))
        trace.append(int(p.budget(s, K)))
    assert trace == [2, 4, 4, 3, 2, 1, 1, 3]
    assert int(drafting.heuristic().init(K)) == K  # default: start at the cap
    assert int(drafting.heuristic(initial=9).init(K)) == K


def test_confidence_schedule():
    p = drafting.confidence(0.4)
    s = p.init(K)
    assert int(p.budget(s, K)) == K
    assert not bool(p.proceed(s, step(token_prob=0.39)))
    assert bool(p.proceed(s, step(token_prob=0.4)))
    with pytest.raises(ValueError, match="threshold"):
        drafting.confidence(1.5)


def test_adasd_entropy_schedule():
    p = drafting.adasd_entropy(window=3)
    s = p.init(K)
    assert int(p.budget(s, K)) == 3  # min(window, num_draft)
    assert int(drafting.adasd_entropy().budget(s, K)) == K
    # Before any rejection the threshold is +inf: never stop early.
    assert float(drafting.adasd_entropy_threshold(s)) == np.inf
    assert bool(p.proceed(s, step(entropy=50.0)))
    # Rejection at slot 1: its entropy (0.7) is recorded; later slots are not.
    s = p.update(s, outcome(1, 3, [0.1, 0.7, 0.2, 0.0]))
    assert float(drafting.adasd_entropy_threshold(s)) == pytest.approx(0.7)
    assert not bool(p.proceed(s, step(entropy=0.8)))
    assert bool(p.proceed(s, step(entropy=0.6)))
    # All accepted: nothing recorded.
    s = p.update(s, outcome(3, 3, [5.0, 5.0, 5.0, 0.0]))
    assert float(drafting.adasd_entropy_threshold(s)) == pytest.approx(0.7)
    # Rejection at slot 0 with entropy 0.3: mean of rejected = 0.5.
    s = p.update(s, outcome(0, 2, [0.3, 9.0, 0.0, 0.0]))
    assert float(drafting.adasd_entropy_threshold(s)) == pytest.approx(0.5)


def test_combine_takes_the_strictest():
    p = drafting.combine(drafting.heuristic(initial=3), drafting.confidence(0.4), drafting.fixed(2))
    s = p.init(K)
    assert int(p.budget(s, K)) == 2
    assert not bool(p.proceed(s, step(token_prob=0.1)))
    assert bool(p.proceed(s, step(token_prob=0.9)))
    s = p.update(s, outcome(0, 2))
    assert int(s[0]) == 2  # the heuristic's own state moved
    with pytest.raises(TypeError):
        drafting.combine(drafting.fixed(), "fixed")


# ---------------------------------------------------------------------------
# In the loop
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    return specjax.pair(bigram_model(random_table(0, VOCAB)), bigram_model(random_table(1, VOCAB, scale=1.0)))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, size=int(rng.integers(1, 7))).tolist() for _ in range(12)]


@pytest.fixture(scope="module")
def reference(pair, prompts):
    return specjax.generate(pair.target, prompts, max_new_tokens=15, temperature=0.0)


POLICIES = {
    "fixed2": lambda: drafting.fixed(2),
    "adasd_entropy": lambda: drafting.adasd_entropy(),
    "heuristic": lambda: drafting.heuristic(initial=1),
    "confidence": lambda: drafting.confidence(0.4),
    "hf_default": lambda: drafting.combine(drafting.heuristic(), drafting.confidence(0.4)),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_greedy_decode_with_policy_equals_generate(pair, prompts, reference, name):
    out = specjax.decode(pair, prompts, drafting=POLICIES[name](), num_draft=K, max_new_tokens=15, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(reference.tokens))
    s = out.stats
    drafted_at = np.asarray(s.drafted_at)
    assert (np.asarray(s.drafted) <= K * np.asarray(s.cycles)).all()
    assert (np.asarray(s.drafted) >= np.asarray(s.cycles)).all()  # at least one per cycle
    assert (np.diff(drafted_at, axis=1) <= 0).all()  # valid slots are a prefix
    if name == "fixed2":
        np.testing.assert_array_equal(np.asarray(s.drafted), 2 * np.asarray(s.cycles))
        assert drafted_at[:, 2:].sum() == 0
    if name != "fixed2":
        assert 0 < s.mean_drafted_per_cycle < K  # it adapted
    # The verification forward covered every sequence's drafts and never more than the block.
    verified, cycles, drafted = (np.asarray(x) for x in (s.verified, s.cycles, s.drafted))
    assert (verified >= cycles + drafted).all() and (verified <= (K + 1) * cycles).all()


def test_heuristic_grows_when_everything_is_accepted():
    model = bigram_model(random_table(0, VOCAB))
    same = specjax.pair(model, model)
    # Budgets 1, 3, 4, 4 commit 2 + 4 + 5 + 5 = 16 tokens in 4 cycles.
    out = specjax.decode(same, [[1]], drafting=drafting.heuristic(initial=1), num_draft=K, max_new_tokens=16, temperature=0.0)
    s = out.stats
    assert int(s.cycles[0]) == 4 and int(s.drafted[0]) == 12 and int(s.accepted[0]) == 12
    np.testing.assert_array_equal(np.asarray(s.drafted_at)[0], [4, 3, 3, 2])


def test_early_stop_saves_draft_forwards(pair):
    """confidence(1.0) stops after every first draft: one draft forward per cycle."""
    out = specjax.decode(pair, [[1, 2]], drafting=drafting.confidence(1.0), num_draft=K, max_new_tokens=15, temperature=0.0)
    s = out.stats
    assert int(s.drafted[0]) == int(s.cycles[0])
    assert int(s.draft_forwards) == int(s.target_forwards) == int(s.cycles[0])


def test_fixed_k_above_num_draft_is_refused(pair):
    with pytest.raises(ValueError, match=r"fixed\(k=6\) exceeds num_draft=4; pass num_draft=6"):
        specjax.decode(pair, [[1]], drafting=drafting.fixed(6), num_draft=4, temperature=0.0)
    with pytest.raises(TypeError, match="DraftingPolicy"):
        specjax.decode(pair, [[1]], drafting=3, temperature=0.0)


def test_verification_width_follows_the_drafts(pair, prompts, reference):
    """A cycle verifies only as many tokens as its longest draft needs (rounded
    up to 2, 4, ..., K + 1), and the tokens are those of the full-width block."""
    def run(policy, **kw):
        return specjax.decode(pair, prompts, drafting=policy, num_draft=K, max_new_tokens=15, temperature=0.0, **kw)

    def per_cycle(out):
        return set((np.asarray(out.stats.verified) / np.asarray(out.stats.cycles)).tolist())

    one = run(drafting.confidence(1.0))  # stops after one draft every cycle: width 2
    full = run(drafting.confidence(1.0), buckets=specjax.Buckets(verify=None))
    for out in (one, full):
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(reference.tokens))
    assert per_cycle(one) == {2.0} and per_cycle(full) == {K + 1.0}
    assert per_cycle(run(drafting.fixed(2))) == {3.0}  # a fixed budget: its own static width
    assert per_cycle(run(drafting.fixed())) == {K + 1.0}


def test_verification_widths():
    from specjax._src.engine.prepare import verify_widths_for

    conf = drafting.confidence(0.5)
    assert verify_widths_for(specjax.Buckets(), conf, 6) == (2, 4, 7)
    assert verify_widths_for(specjax.Buckets(), conf, 8) == (2, 4, 8, 9)
    assert verify_widths_for(specjax.Buckets(verify=3), conf, 4) == (3, 5)
    assert verify_widths_for(specjax.Buckets(), conf, 1) is None  # the full block is 2 tokens anyway
    # combine's budget is its smallest: fixed(2) caps every block at 3 tokens
    assert verify_widths_for(specjax.Buckets(), drafting.combine(drafting.fixed(2), conf), 4) == (2, 3)
    assert verify_widths_for(specjax.Buckets(), drafting.combine(drafting.fixed(1), conf), 4) == (2,)

    from specjax._src.proposals.drafting import Fixed

    class Greedier(Fixed):  # a subclass may draft more than its k: no static width for it
        def budget(self, state, num_draft):
            return jnp.int32(num_draft)

    assert verify_widths_for(specjax.Buckets(), Greedier(k=2), 4) == (2, 4, 5)
    assert verify_widths_for(specjax.Buckets(), drafting.fixed(), 4) is None
    assert verify_widths_for(specjax.Buckets(), drafting.fixed(2), 4) == (3,)
    assert verify_widths_for(specjax.Buckets(verify=None), conf, 4) is None
    assert verify_widths_for(None, conf, 4) is None
    # auto() verifies each draft length at its own width up to 8 tokens, then doubles.
    assert verify_widths_for(specjax.Buckets(), drafting.auto(), 3) == (1, 2, 3, 4)
    assert verify_widths_for(specjax.Buckets(), drafting.auto(), 8) == (1, 2, 3, 4, 5, 6, 7, 8, 9)
    assert verify_widths_for(specjax.Buckets(), drafting.auto(), 20) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 21)
    assert verify_widths_for(specjax.Buckets(verify=3), drafting.auto(), 4) == (1, 3, 4, 5)
    assert verify_widths_for(specjax.Buckets(), drafting.auto(), 1) == (1, 2)
    with pytest.raises(ValueError, match="Buckets.verify"):
        specjax.decode(specjax.pair(bigram_model(random_table(0, VOCAB)), bigram_model(random_table(1, VOCAB))),
                       [[1]], drafting=conf, temperature=0.0, buckets=specjax.Buckets(verify=0))
