"""drafting.auto() on a dynamic tree: each cycle verifies the best-ranked nodes it chose, or none.

The kept candidates come best first, so the first ``n`` nodes are a subtree for
every ``n``; the policy's estimate per rank and its choice are checked on its pure
functions; in the loop, whatever size it chooses (a plain step included), greedy
output stays the target's and the lossless walk's samples follow the target's
law, which the same statistic rejects for a wrong residual under the same policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import drafting
from specjax._src.engine import costs as costs_lib
from specjax.testing import bigram_model, llama_config, peaked_target_and_draft, random_table
from specjax.trees import dynamic_tree, rerank, static_tree

from test_decode import (
    NO_BUCKETS,
    VOCAB,
    exact_two_token_distribution,
    opening_with,
    random_prompts,
)

TREE = dynamic_tree(3, 2, 6)  # sizes 0, 1, 2, 4, 6


def tree_costs(first=0.5, step=0.05, verify=None, nodes=TREE.num_kept):
    verify = np.linspace(1.0, 1.05, nodes + 1) if verify is None else verify
    return drafting.CostModel(verify=jnp.asarray(verify, jnp.float32), draft_first=jnp.float32(first),
                              draft_step=jnp.float32(step), cycle=jnp.float32(0.0), forward_ms=jnp.float32(1.0),
                              batch=jnp.float32(1), measured=jnp.zeros((nodes + 1,), jnp.float32))


COUNTS = (0, 1, 2, 4, 6)


def batched(*states):
    return jax.tree_util.tree_map(lambda *x: jnp.stack(x), *states)


# ---------------------------------------------------------------------------
# The order and the arithmetic
# ---------------------------------------------------------------------------


def test_rerank_by_rank_keeps_the_same_subtree_best_first():
    """Every prefix of the ranked nodes is a subtree (each node's parent comes first), the set is
    the one drafting order keeps, and ties go to the earlier drafted (a parent before its child)."""
    rng = np.random.default_rng(0)
    for trial in range(30):
        c, m = 14, 7
        parents = np.full(c, -1)
        scores = np.zeros(c)
        for j in range(c):
            parents[j] = -1 if j < 3 else rng.integers(0, j)
            base = 0.0 if parents[j] < 0 else scores[parents[j]]
            scores[j] = base - (0.0 if trial % 5 == 0 and j % 4 == 0 else rng.exponential())  # some ties
        kept, tree = rerank(jnp.asarray(scores, jnp.float32), jnp.asarray(parents, jnp.int32), m)
        ranked, ranked_tree = rerank(jnp.asarray(scores, jnp.float32), jnp.asarray(parents, jnp.int32), m,
                                     by_rank=True)
        assert sorted(np.asarray(ranked).tolist()) == np.asarray(kept).tolist()
        order = sorted(range(c), key=lambda j: (-np.float32(scores[j]), j))[:m]
        assert np.asarray(ranked).tolist() == order
        ranked_tree = np.asarray(ranked_tree)
        assert ranked_tree[0] == -1 and all(0 <= ranked_tree[j] < j for j in range(1, m + 1))
        for j in range(1, m + 1):  # node j is candidate ranked[j - 1]; its parent's candidate is its drafted parent
            up = parents[int(ranked[j - 1])]
            assert ranked_tree[j] == (0 if up < 0 else 1 + np.asarray(ranked).tolist().index(up))


def test_the_estimate_per_rank_and_its_prior():
    policy = drafting.auto(tree_costs(), memory=0.5, prior=0.5, prior_weight=1.0)
    state = policy.init(TREE.num_kept)
    # prior ** (1 + r // top_k + r % top_k): a level a slot deeper, a later node of a level a slot less
    prior = [0.5, 0.25, 0.25, 0.125, 0.125, 0.0625]
    np.testing.assert_allclose(policy.node_acceptance(state, 2), prior)
    np.testing.assert_allclose(policy.tree_prior(6, 2), prior)
    np.testing.assert_allclose(policy.tree_prior(3, 1), [0.5, 0.25, 0.125])  # a chain: the chain's prior
    on_path = jnp.asarray([True, False, True, False, False, False])
    state = policy.update_tree(state, jnp.int32(4), on_path)  # ranks 0-3 verified; 0 and 2 on the path
    # each rank shrinks towards prior times the estimate top_k ranks above (one cycle's weight);
    # the root's later children towards prior times the sibling before
    want = []
    for r, (accepted, judged) in enumerate(zip([1, 0, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0])):
        above = 1.0 if r == 0 else want[r - 1] if r < 2 else want[r - 2]
        want.append((accepted + 0.5 * above) / (judged + 1.0))
    np.testing.assert_allclose(policy.node_acceptance(state, 2), want, rtol=1e-6)
    # unverified ranks 4 and 5 follow ranks 2 and 3: rank 2 was on the path, rank 3 was not
    assert want[4] == pytest.approx(0.5 * want[2]) and want[4] > 0.25 > want[5]
    # a plain step judges nothing and decays every count towards the prior
    state = policy.update_tree(state, jnp.int32(0), jnp.zeros(6, bool))
    np.testing.assert_allclose(state.judged, [0.5, 0.5, 0.5, 0.5, 0.0, 0.0])
    np.testing.assert_allclose(state.accepted, [0.5, 0.0, 0.5, 0.0, 0.0, 0.0])
    # a plain cycle that ran the draft judges rank 0 by its acceptance probability; the root's
    # second child and the level below follow it down
    first = policy.update_tree_first(policy.init(6), jnp.float32(0.1))
    np.testing.assert_allclose(first.judged, [1, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(first.accepted, [0.1, 0, 0, 0, 0, 0], rtol=1e-6)
    low = np.asarray(policy.node_acceptance(first, 2))
    assert low[0] == pytest.approx(0.3) and low[1] == pytest.approx(0.15) and low[2] == pytest.approx(0.15)
    assert (low < np.asarray(prior)).all()
    # a node past the verified count is never counted as accepted
    state = policy.update_tree(policy.init(6), jnp.int32(1), jnp.asarray([True, True, False, False, False, False]))
    np.testing.assert_allclose(state.accepted, [1, 0, 0, 0, 0, 0])


def test_the_size_that_pays_most_per_unit_of_cost():
    costs = tree_costs(first=0.3, step=0.05, verify=[1.0, 1.0, 1.05, 1.1, 1.2, 1.4, 1.6])
    policy = drafting.auto(costs, prior_weight=1e-3, margin=0.0)
    # n nodes draft min(n, depth) levels: the first step, then a step per further level
    np.testing.assert_allclose(policy.tree_costs(COUNTS, 3), [1.0 + 0.1, 1.3, 1.4, 1.6, 2.0], rtol=1e-6)

    def seen(on_path, n=6):
        return policy.update_tree(policy.init(6), jnp.int32(n), jnp.asarray(on_path))

    deep = seen([True, False, True, False, True, False])  # a path through ranks 0, 2 and 4
    shallow = seen([True, False, False, False, False, False])
    none = seen([False] * 6)
    live = jnp.ones((1,), bool)
    # deep: 1, 2, 2, 3 and 4 tokens for 1.1, 1.3, 1.4, 1.6 and 2.0 -> the whole tree
    assert int(policy.plan_tree(batched(deep), live, COUNTS, 3, 2)) == 4
    # shallow: rank 0 only -> one node (2 tokens for 1.3) beats the rest
    assert int(policy.plan_tree(batched(shallow), live, COUNTS, 3, 2)) == 1
    assert int(policy.plan_tree(batched(none), live, COUNTS, 3, 2)) == 0
    # the batch shares one size: the expected tokens add up over its live rows, here 2, 4, 4, 5
    # and 6 for deep and shallow together: four nodes, which neither row alone would verify
    two = batched(deep, shallow)
    assert int(policy.plan_tree(two, jnp.asarray([True, True]), COUNTS, 3, 2)) == 3
    assert int(policy.plan_tree(two, jnp.asarray([False, True]), COUNTS, 3, 2)) == 1
    assert int(policy.plan_tree(two, jnp.zeros(2, bool), COUNTS, 3, 2)) == 0
    # drafting must beat a plain step by the margin: one node at 2 tokens for 1.3 is a gain of 1.69
    assert int(drafting.auto(costs, prior_weight=1e-3, margin=0.6).plan_tree(
        batched(shallow), live, COUNTS, 3, 2)) == 1
    assert int(drafting.auto(costs, prior_weight=1e-3, margin=0.8).plan_tree(
        batched(shallow), live, COUNTS, 3, 2)) == 0
    with pytest.raises(ValueError, match="verifications of up to 4 tokens, but the tree verifies 7"):
        drafting.auto(tree_costs(nodes=3)).plan_tree(batched(deep), live, COUNTS, 3, 2)


@pytest.mark.parametrize("count", [0, 1, 2, 4, 9])
def test_a_sized_draft_holds_the_best_nodes_and_drafts_only_their_levels(count):
    """Drafted for ``count`` nodes, the tree's first ``count`` nodes are the ``count`` best
    candidates by EAGLE-2's score (those ``dynamic_tree(depth, top_k, count)`` verifies,
    best first), and levels below them are not drafted (one draft forward per level)."""
    from specjax._src.engine.tree_drafting import draft_dynamic
    from test_dynamic_trees import _reference_expansion, _state

    vocab, depth, k, m = 12, 4, 3, 9
    table = random_table(3, vocab) * 2.0
    pair = specjax.pair(bigram_model(table), bigram_model(table))
    tree = dynamic_tree(depth, k, m)
    cfg, _, state = _state(pair, tree, [[1, 4, 7], [2, 9], [5]])
    drafts, _ = jax.jit(lambda s: draft_dynamic(cfg, tree, pair, s, need_logits=False, count=jnp.int32(count)))(state)
    assert int(drafts.forwards) == max(1, min(count, depth))  # the first step always runs
    logq = np.asarray(jax.nn.log_softmax(jnp.asarray(table, jnp.float32), axis=-1))
    for b, root in enumerate([7, 9, 5]):
        tokens, parents, _ = _reference_expansion(lambda toks: logq[toks[-1]], [root], depth, k, count)
        got_tokens, got_parents = np.asarray(drafts.tokens[b]), np.asarray(drafts.parents[b])

        def paths(toks, pars, n):  # each node as its token path from the root
            out = []
            for j in range(1, n + 1):
                path, node = [], j
                while node > 0:
                    path.append(int(toks[node]))
                    node = int(pars[node])
                out.append(tuple(path[::-1]))
            return out

        assert sorted(paths(got_tokens, got_parents, count)) == sorted(paths(tokens, parents, count))
        assert all(0 <= got_parents[j] < j for j in range(1, count + 1))


# ---------------------------------------------------------------------------
# In the loop
# ---------------------------------------------------------------------------


# Cheap drafts: a tree at the prior's acceptance; after a cycle whose nodes were all rejected
# (memory 0), a plain step; an accepted node turns the tree back on.
SWITCHING = dict(memory=0.0, prior=0.5, prior_weight=0.25, margin=0.1)


def switching_policy():
    return drafting.auto(tree_costs(first=0.8, step=0.05, verify=np.linspace(1.0, 1.1, TREE.num_kept + 1)),
                         **SWITCHING)


def cycle_kinds(stats):
    """Per sequence: (plain cycles, drafting cycles), from cycles and the cycles that drafted."""
    cycles, drafted = np.asarray(stats.cycles), np.asarray(stats.drafted_at)[:, 0]
    return cycles - drafted, drafted


def test_greedy_output_is_the_targets_while_the_size_switches(bigram_pair):
    prompts = [np.random.default_rng(i).integers(0, VOCAB, size=1 + i % 6).tolist() for i in range(12)]
    ref = specjax.generate(bigram_pair.target, prompts, max_new_tokens=24, temperature=0.0)
    out = specjax.decode(bigram_pair, prompts, drafting=switching_policy(), tree=TREE, max_new_tokens=24,
                         temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    plain, drafted = cycle_kinds(out.stats)
    assert plain.min() > 0 and drafted.min() > 0
    # a plain cycle verifies one token and runs no draft forward
    assert (np.asarray(out.stats.verified) < np.asarray(out.stats.cycles) * (TREE.num_kept + 1)).all()
    assert int(out.stats.draft_forwards) < TREE.depth * int(out.stats.target_forwards)


@pytest.mark.parametrize("drafter", ["draft model", "feature head"])
def test_greedy_with_transformers_while_the_size_switches(drafter):
    """A draft model catches up on the cycles it skipped in its first step; a head reads
    its pending target features. Both give the target's greedy tokens."""
    if drafter == "draft model":
        target, draft = peaked_target_and_draft(llama_config())
        pair = specjax.pair(target, draft)
        prompts = random_prompts(3, 6, 96, 12)
    else:
        from test_feature_head import _small_head_pair

        pair = _small_head_pair(16)
        prompts = random_prompts(21, 8, 16, 14)
    ref = specjax.generate(pair.target, prompts, max_new_tokens=20, temperature=0.0)
    out = specjax.decode(pair, prompts, drafting=switching_policy(), tree=TREE, max_new_tokens=20, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    plain, drafted = cycle_kinds(out.stats)
    assert plain.sum() > 0 and drafted.sum() > 0 and np.asarray(out.stats.accepted).sum() > 0


def test_plain_cycles_that_run_the_draft_teach_the_size():
    """A draft whose every pick the target rejects (its bigram table rolled half the
    vocabulary): the tree pays at the prior, so the first cycles draft; after that the
    catch-up cycles, which run the draft's first step while verifying no node, judge the best
    node against the root's target distribution, and the estimates stay low. Without that
    evidence they drifted back to the prior between catch-ups, and the tree was drafted again
    in 14 of 39 cycles."""
    table = np.asarray(random_table(0, VOCAB))
    pair = specjax.pair(bigram_model(table), bigram_model(np.roll(table, VOCAB // 2, axis=-1)))
    policy = drafting.auto(tree_costs(first=0.1, step=0.05, verify=np.linspace(1.0, 1.2, TREE.num_kept + 1)))
    prompts = [[1, 2], [3], [4, 5, 6]]
    ref = specjax.generate(pair.target, prompts, max_new_tokens=40, temperature=0.0)
    out = specjax.decode(pair, prompts, drafting=policy, tree=TREE, max_new_tokens=40, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    plain, drafted = cycle_kinds(out.stats)
    assert np.asarray(out.stats.accepted).sum() == 0
    assert drafted.min() > 0 and drafted.max() <= 8 and plain.min() >= 30


def test_lossless_law_while_the_size_switches(bigram_pair):
    """The tokens of the first two cycles follow the target's law: the first cycle verifies the
    tree the prior chose, and rows whose nodes were all rejected make the second cycle a plain
    step. The same statistic rejects a rule with a wrong residual under the same policy. (The
    prompts' last token leads to 2, the first token: the first cycle drafts after 2.)"""
    pair, table = opening_with(bigram_pair, 7, 2)
    expected = exact_two_token_distribution(table, 2, 1.0, None, None)
    prompts = np.array([[7, 0], [5, 7]] * 10000, np.int32)
    lengths = np.array([1, 2] * 10000, np.int32)
    tree = dynamic_tree(2, 3, 6, sampled=True)  # drawn children for both rules

    from test_auto_drafting import assert_law_with_negative_control, two_tokens_after_the_first

    def counts(rule):
        return two_tokens_after_the_first(pair, prompts, lengths, jax.random.key(3), rule=rule,
                                          drafting=switching_policy(), tree=tree)

    stats = assert_law_with_negative_control(counts, expected)
    plain, drafted = cycle_kinds(stats)
    assert plain.sum() > 1000 and drafted.sum() > 1000  # the second cycle's choice followed the first


def test_a_sized_tree_that_would_open_plain_runs_plain_decodings_program(bigram_pair):
    """As on a chain: where no size pays at the prior, ``decode`` runs ``generate``'s program
    (its sampled tokens for the same key, no draft forward); where one pays, the tree's."""
    prompts = [[1, 2], [3], [4, 5, 6]]
    kw = dict(max_new_tokens=12, temperature=1.0, key=jax.random.key(7), buckets=NO_BUCKETS)
    ref = specjax.generate(bigram_pair, prompts, **kw)
    costly = drafting.auto(tree_costs(first=0.5, verify=np.linspace(1.0, 4.0, TREE.num_kept + 1)))
    cheap = drafting.auto(tree_costs(first=0.0, step=0.0, verify=np.ones(TREE.num_kept + 1)))
    widths = (1, 2, 3, 5, 7)
    assert not drafting.drafts_before_evidence(costly, TREE.depth, sizes=widths, top_k=TREE.top_k)
    assert drafting.drafts_before_evidence(cheap, TREE.depth, sizes=widths, top_k=TREE.top_k)
    out = specjax.decode(bigram_pair, prompts, drafting=costly, tree=TREE, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert int(out.stats.draft_forwards) == 0
    assert int(specjax.decode(bigram_pair, prompts, drafting=cheap, tree=TREE, **kw).stats.draft_forwards) > 0


def test_a_sized_trees_costs_timed_in_the_loop_replace_the_parts():
    """Calibrated at the tree's node counts, each count's cost is its extra time over its extra
    cycles; a count between two of them gets the next one's. The plan then reads those times
    and needs only ``timed_margin``."""
    per_cycle, prefill = {0: 2.0, 1: 2.4, 2: 2.6, 4: 3.0, 6: 3.6}, 30.0

    def run(costs, max_new):
        n = int(np.argmin(np.asarray(costs.verify)))  # forcing(n): every other count costs 1e6
        cycles = 1 + max_new // (1 + min(n, TREE.depth))
        return prefill + cycles * per_cycle[n], cycles

    parts = tree_costs(first=0.5, step=0.1, verify=[1.0 + 0.2 * n for n in range(7)])
    timed = costs_lib.calibrate_costs(parts, run, lengths=COUNTS, short=2, long=14, repeats=1)
    np.testing.assert_allclose(timed.measured, [1.0, 1.2, 1.3, 1.5, 1.5, 1.8, 1.8], rtol=1e-6)
    policy = drafting.auto(parts, prior_weight=1e-3)
    np.testing.assert_allclose(policy.replace(costs=timed).tree_costs(COUNTS, TREE.depth), [1.0, 1.2, 1.3, 1.5, 1.8],
                               rtol=1e-6)
    # one node always on the path: 2 tokens. By the parts (1.8 against 1.17 for a plain step) a
    # gain of 1.30; timed (1.2 against 1.0), 1.67
    sure = batched(policy.update_tree(policy.init(6), jnp.int32(6), jnp.asarray([True] + [False] * 5)))
    live = jnp.ones((1,), bool)
    assert int(policy.replace(margin=0.4).plan_tree(sure, live, COUNTS, TREE.depth, TREE.top_k)) == 0
    assert int(policy.replace(costs=timed, margin=0.4).plan_tree(sure, live, COUNTS, TREE.depth, TREE.top_k)) == 1
    assert int(policy.replace(costs=timed, timed_margin=0.7).plan_tree(sure, live, COUNTS, TREE.depth,
                                                                      TREE.top_k)) == 0
    with pytest.raises(ValueError, match="ascending from 0"):
        costs_lib.calibrate_costs(parts, run, lengths=(1, 2), repeats=1)


def test_decode_times_a_sized_trees_loop_where_the_parts_cannot_decide(monkeypatch):
    """As on a chain: where the parts' gain at the tree's prior lies within their error of the
    margin, ``decode`` times its program forced to each of the tree's node counts. Here the
    parts say plain (a gain of 1.14, short of 1.2); timed, the tree pays and the call drafts,
    greedy output still the target's. A forced count runs as asked (the draft is the target
    here, so every drafted node on the path is accepted): one token a cycle at 0 nodes, the
    tree's depth and one more at 6."""
    bigram_pair = specjax.pair(bigram_model(random_table(0, VOCAB)), bigram_model(random_table(0, VOCAB)))
    cycles_by_count, timed = {}, [[1.0, 1.1, 1.2, 1.3, 1.3, 1.4, 1.4]]

    def timed_costs(costs, run, *, lengths=None, **kwargs):
        for n in lengths:
            cycles_by_count[n] = run(costs_lib.forcing(costs, n), 12)[1]
        return costs.replace(measured=jnp.asarray(timed[0], jnp.float32))

    monkeypatch.setattr(costs_lib, "calibrate_costs", timed_costs)
    undecided = tree_costs(first=0.5, step=0.1, verify=[1.0 + 0.2 * n for n in range(7)]).replace(
        cycle=jnp.float32(0.1))
    cheap = tree_costs(first=0.0, step=0.0, verify=np.ones(7))
    costly = tree_costs(first=0.5, verify=np.linspace(1.0, 4.0, 7))
    widths = (1, 2, 3, 5, 7)
    prompts = [[1, 2], [3], [4, 5, 6]]
    kw = dict(max_new_tokens=12, temperature=0.0, buckets=NO_BUCKETS)
    reference = specjax.generate(bigram_pair, prompts, **kw)

    def run(parts, policy):
        monkeypatch.setattr(costs_lib, "cached_costs", lambda *a, **k: parts)
        monkeypatch.setattr(costs_lib, "_CALIBRATED", {})
        cycles_by_count.clear()
        out = specjax.decode(bigram_pair, prompts, drafting=policy, tree=TREE, **kw)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(reference.tokens))
        return sorted(cycles_by_count), int(out.stats.draft_forwards) > 0

    def undecided_parts(parts):
        return costs_lib.parts_undecided(drafting.auto(parts), TREE.depth, 1, tree=TREE, sizes=widths)

    assert undecided_parts(undecided) and not undecided_parts(cheap) and not undecided_parts(costly)
    assert run(undecided, drafting.auto()) == (list(COUNTS), True)  # timed: drafts
    assert (cycles_by_count[0], cycles_by_count[6]) == (11, 3)  # the first token comes from the prefill
    assert run(undecided, drafting.auto(timed=False)) == ([], False)  # the parts alone: plain
    # timed in units of generate's step: the tree beats the drafting program's plain cycle (1.3)
    # but not generate's own step by timed_margin (at most 1.03 tokens per unit): generate's program
    timed[0] = [1.3, 1.6, 1.9, 2.5, 2.5, 2.9, 2.9]
    assert run(undecided, drafting.auto()) == (list(COUNTS), False)
    assert run(cheap, drafting.auto()) == ([], True)
    assert run(costly, drafting.auto()) == ([], False)


def test_the_slots_engine_sizes_its_trees_and_stays_exact(bigram_pair):
    from specjax.engine import Engine
    from test_auto_drafting import engine_greedy_tokens

    prompts = [[1, 2, 3], [4], [6, 5]]
    ref = specjax.generate(bigram_pair.target, prompts, max_new_tokens=12, temperature=0.0)
    engine = Engine(bigram_pair, num_slots=4, capacity=32, tree=TREE, drafting=switching_policy())
    assert engine.cfg.loop.verify_widths == (1, 2, 3, 5, 7)
    for slot, tokens in engine_greedy_tokens(engine, prompts, 12).items():
        assert tokens == np.asarray(ref.tokens)[slot].tolist()
    measured = Engine(bigram_pair, num_slots=2, capacity=32, tree=TREE, drafting=drafting.auto()).drafting
    assert measured.costs is not None and measured.costs.max_draft == TREE.num_kept


def test_auto_needs_a_dynamic_tree(bigram_pair):
    with pytest.raises(ValueError, match="static tree's shape is fixed"):
        specjax.decode(bigram_pair, [[1]], tree=static_tree((2, 1)), drafting=drafting.auto(), temperature=0.0)
    with pytest.raises(ValueError, match="leave drafting unset"):
        specjax.decode(bigram_pair, [[1]], tree=TREE, drafting=drafting.heuristic(), temperature=0.0)
