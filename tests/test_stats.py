"""DecodeStats: the counting conventions of ``record_cycle`` and the rates.

``record_cycle`` is called on hand-built arrays, so these tests pin the
definitions independently of the decode loop: only committed drafts count as
accepted, a rejection is judged only when its correction was committed, and
``acceptance_rate`` is the per-token alpha of Leviathan et al.
(arXiv:2211.17192), which ``accepted_per_drafted`` is not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax._src.rules.base import Path
from specjax._src.engine.stats import DecodeStats, concatenate, expected_tau, record_cycle

K = 4
E, R = int(Path.EXACT), int(Path.RELAXED)


def one_cycle(*, live, num_drafted, num_accepted, num_committed, paths=None, draft_forwards=K):
    """One cycle over rows given as lists; valid slots are a prefix of ``num_drafted``."""
    b = len(live)
    valid = np.arange(K)[None, :] < np.asarray(num_drafted)[:, None]
    n = np.asarray(num_accepted)
    if paths is None:  # EXACT on the accepted prefix, as a rule would report
        paths = np.where(np.arange(K)[None, :] < n[:, None], E, int(Path.REJECTED))
    return record_cycle(
        DecodeStats.zeros(b, K),
        live=jnp.asarray(live),
        valid=jnp.asarray(valid),
        num_accepted=jnp.asarray(n, jnp.int32),
        num_committed=jnp.asarray(num_committed, jnp.int32),
        paths=jnp.asarray(paths, jnp.int32),
        draft_forwards=jnp.int32(draft_forwards),
    )


def row(stats, b=0):
    names = ("cycles", "drafted", "accepted", "judged", "tokens")
    return {f: int(np.asarray(getattr(stats, f))[b]) for f in names}


def at(stats, field, b=0):
    return np.asarray(getattr(stats, field))[b].tolist()


def test_full_acceptance_with_bonus():
    s = one_cycle(live=[True], num_drafted=[K], num_accepted=[K], num_committed=[K + 1])
    assert row(s) == dict(cycles=1, drafted=K, accepted=K, judged=K, tokens=K + 1)
    assert at(s, "reached_at") == at(s, "accepted_at") == at(s, "drafted_at") == [1] * K
    assert s.acceptance_rate == 1.0 and s.tau == K + 1 == expected_tau(1.0, K)


def test_eos_cuts_accepted_drafts():
    """4 drafts accepted, EOS is draft 2 (position 1): 2 tokens committed."""
    s = one_cycle(live=[True], num_drafted=[K], num_accepted=[4], num_committed=[2])
    assert row(s) == dict(cycles=1, drafted=K, accepted=2, judged=2, tokens=2)
    assert at(s, "accepted_at") == [1, 1, 0, 0]
    assert at(s, "reached_at") == [1, 1, 0, 0]  # slots after EOS are after the sequence ended
    assert at(s, "drafted_at") == [1, 1, 1, 1]  # but they were drafted: that is cost
    assert at(s, "accepted_by_path")[E] == 2
    assert s.acceptance_rate == 1.0 and s.accepted_per_drafted == 0.5


def test_max_new_tokens_cuts_the_block():
    """3 accepted then a rejection, but only 1 token of budget left."""
    s = one_cycle(live=[True], num_drafted=[K], num_accepted=[3], num_committed=[1])
    assert row(s) == dict(cycles=1, drafted=K, accepted=1, judged=1, tokens=1)
    assert at(s, "reached_at") == [1, 0, 0, 0]


def test_rejection_cut_off_is_not_judged():
    """2 accepted, slot 2 rejected, budget of exactly 2: the correction never lands."""
    s = one_cycle(live=[True], num_drafted=[K], num_accepted=[2], num_committed=[2])
    assert row(s) == dict(cycles=1, drafted=K, accepted=2, judged=2, tokens=2)
    assert at(s, "reached_at") == [1, 1, 0, 0]


def test_rejection_at_slot_1():
    """Slot 0 accepted, slot 1 rejected, slots 2-3 drafted but never judged."""
    paths = [[R, int(Path.REJECTED), E, E]]  # a rule may mark later slots; they do not count
    s = one_cycle(live=[True], num_drafted=[K], num_accepted=[1], num_committed=[2], paths=paths)
    assert row(s) == dict(cycles=1, drafted=K, accepted=1, judged=2, tokens=2)
    assert at(s, "accepted_at") == [1, 0, 0, 0]
    assert at(s, "reached_at") == [1, 1, 0, 0]
    assert at(s, "drafted_at") == [1, 1, 1, 1]
    assert at(s, "accepted_by_path") == [0, 0, 1, 0]  # one RELAXED, nothing EXACT
    assert s.acceptance_rate == 0.5 and s.accepted_per_drafted == 0.25
    np.testing.assert_array_equal(s.acceptance_at_position, [1.0, 0.0, np.nan, np.nan])
    np.testing.assert_array_equal(s.prefix_acceptance, [1.0, 0.0, 0.0, 0.0])


def test_fewer_drafts_all_accepted():
    """A drafting policy filled 2 slots, both accepted, bonus committed."""
    s = one_cycle(live=[True], num_drafted=[2], num_accepted=[2], num_committed=[3])
    assert row(s) == dict(cycles=1, drafted=2, accepted=2, judged=2, tokens=3)
    assert at(s, "reached_at") == at(s, "drafted_at") == [1, 1, 0, 0]


def test_non_live_row_counts_nothing():
    """Row 1 is done (or hit non-finite logits): even a stale verdict counts nothing."""
    s = one_cycle(live=[True, False], num_drafted=[K, K], num_accepted=[0, 3], num_committed=[1, 3])
    assert row(s, 0) == dict(cycles=1, drafted=K, accepted=0, judged=1, tokens=1)
    assert row(s, 1) == dict(cycles=0, drafted=0, accepted=0, judged=0, tokens=0)
    for field in ("drafted_at", "reached_at", "accepted_at", "accepted_by_path"):
        assert sum(at(s, field, 1)) == 0
    assert int(s.target_forwards) == 1 and int(s.draft_forwards) == K  # batch forwards: counted once


def test_record_cycle_jits_and_accumulates():
    step = jax.jit(record_cycle)
    s = DecodeStats.zeros(2, K)
    args = dict(
        live=jnp.array([True, True]), valid=jnp.ones((2, K), bool), num_accepted=jnp.array([1, 4], jnp.int32),
        num_committed=jnp.array([2, 5], jnp.int32), paths=jnp.full((2, K), E, jnp.int32),
        draft_forwards=jnp.int32(K),
    )
    for _ in range(3):
        s = step(s, **args)
    assert np.asarray(s.judged).tolist() == [6, 12] and np.asarray(s.accepted).tolist() == [3, 12]
    assert int(s.target_forwards) == 3 and int(s.draft_forwards) == 3 * K
    assert s.acceptance_rate == pytest.approx(15 / 18)


def test_zeros_for_generate():
    """``generate`` builds its stats from ``zeros(batch, 0)``: no slots, new counters zero."""
    s = DecodeStats.zeros(3, 0).replace(cycles=jnp.array([2, 3, 4]), tokens=jnp.array([2, 3, 4]),
                                        target_forwards=jnp.int32(4))
    assert s.num_draft == 0 and s.tau == 1.0
    assert np.asarray(s.judged).tolist() == [0, 0, 0] and np.shape(s.reached_at) == (3, 0)
    assert np.isnan(s.acceptance_rate)
    summary = s.summary()
    assert summary["judged"] == 0.0 and not any(k.startswith("alpha_at_") for k in summary)


def test_expected_tau():
    assert expected_tau(0.0, K) == 1.0 and expected_tau(1.0, K) == K + 1
    for a in (0.2, 0.5, 0.9):
        assert expected_tau(a, 3) == pytest.approx((1 - a ** 4) / (1 - a))
    np.testing.assert_allclose(expected_tau(np.array([0.5, 1.0]), 2), [1.75, 3.0])
    assert float(jax.jit(expected_tau, static_argnums=1)(jnp.float32(0.5), 2)) == 1.75


@pytest.mark.parametrize("alpha", [0.3, 0.7, 0.9])
def test_acceptance_rate_is_alpha(alpha):
    """i.i.d. Bernoulli(alpha) acceptance per slot, many cycles, simulated in numpy.

    ``acceptance_rate`` recovers alpha and predicts tau through Leviathan et
    al.'s formula; ``accepted_per_drafted`` (the old ``acceptance_rate``) is
    biased low and does not.
    """
    rng = np.random.default_rng(0)
    b, cycles = 64, 200
    s = DecodeStats.zeros(b, K)
    step = jax.jit(record_cycle)
    for _ in range(cycles):
        coins = rng.random((b, K)) < alpha
        n = np.cumprod(coins, axis=1).sum(1)
        s = step(s, live=jnp.ones(b, bool), valid=jnp.ones((b, K), bool), num_accepted=jnp.asarray(n, jnp.int32),
                 num_committed=jnp.asarray(n + 1, jnp.int32), paths=jnp.full((b, K), E, jnp.int32),
                 draft_forwards=jnp.int32(K))
    trials = float(np.sum(s.judged))  # ~ b * cycles * E[judged per cycle]
    sd = np.sqrt(alpha * (1 - alpha) / trials)
    assert abs(s.acceptance_rate - alpha) < 4 * sd
    assert s.tau == pytest.approx(expected_tau(s.acceptance_rate, K), rel=0.02)
    # Constant over slots (alpha_k = alpha), each within 4 sd of its own trials.
    reached = np.asarray(s.reached_at).sum(0)
    assert (np.abs(s.acceptance_at_position - alpha) < 4 * np.sqrt(alpha * (1 - alpha) / reached)).all()
    np.testing.assert_allclose(s.prefix_acceptance, alpha ** np.arange(1, K + 1), atol=0.02)
    # accepted / drafted is E[n] / K, far from alpha, and its tau prediction is wrong.
    assert s.accepted_per_drafted == pytest.approx((expected_tau(alpha, K) - 1) / K, rel=0.03)
    assert abs(s.accepted_per_drafted - alpha) > 10 * sd
    assert abs(expected_tau(s.accepted_per_drafted, K) - s.tau) > 0.1 * s.tau


def test_summary_names_and_concatenate():
    a = one_cycle(live=[True], num_drafted=[K], num_accepted=[1], num_committed=[2])
    b = one_cycle(live=[True, True], num_drafted=[K, K], num_accepted=[4, 0], num_committed=[5, 1])
    both = concatenate([a, b])
    assert both.batch_size == 3 and int(both.target_forwards) == 2 and int(both.draft_forwards) == 2 * K
    # Pooled from counts: (1 + 4 + 0) accepted of (2 + 4 + 1) judged.
    assert both.acceptance_rate == pytest.approx(5 / 7)
    assert both.accepted_per_drafted == pytest.approx(5 / 12)
    summary = both.summary()
    assert all(isinstance(v, float) for v in summary.values())
    names = {"acceptance_rate", "accepted_per_drafted", "judged", "alpha_at_0", f"prefix_acceptance_{K - 1}"}
    assert names <= set(summary)
    assert not any(k.startswith("acceptance_at_") for k in summary)
    assert summary["alpha_at_1"] == pytest.approx(1 / 2)  # slot 1 judged twice, accepted once
    assert summary["prefix_acceptance_1"] == pytest.approx(1 / 3)
    assert "alpha=" in str(both) and "accepted/drafted=" in str(both)
    extra = concatenate([a.replace(extra={"x": np.array([1.0])}), b.replace(extra={"x": np.array([2.0, 3.0])})]).extra
    np.testing.assert_array_equal(extra["x"], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="num_draft"):
        concatenate([a, DecodeStats.zeros(1, K + 1)])


def test_verified_counts_what_each_verification_scored():
    """``verified``: K + 1 per cycle for a chain, the node count for a static
    tree, the kept nodes plus the root for a dynamic tree, 1 per token for
    target-only decoding; finished rows add nothing."""
    import specjax
    from specjax.testing import bigram_model, random_table
    from specjax.trees import dynamic_tree, static_tree

    pair = specjax.pair(bigram_model(random_table(0, 12)), bigram_model(random_table(1, 12)))
    prompts = [[1, 2, 3], [4], [5, 6]]
    kw = dict(max_new_tokens=9, temperature=0.0, eos_token_id=3)
    for call, per_cycle in (
        (dict(num_draft=3), 4),
        (dict(tree=static_tree((2, 2))), 7),
        (dict(tree=dynamic_tree(2, 2, 5)), 6),
    ):
        s = specjax.decode(pair, prompts, **call, **kw).stats
        np.testing.assert_array_equal(np.asarray(s.verified), per_cycle * np.asarray(s.cycles))
        assert s.verified_per_cycle == per_cycle
    g = specjax.generate(pair.target, prompts, **kw).stats
    np.testing.assert_array_equal(np.asarray(g.verified), np.asarray(g.tokens))
