"""decode(tree=dynamic_tree(...)): EAGLE-2 dynamic draft trees (issue 15).

The expansion and rerank must pick the candidates EAGLE-2's definition picks
(a subtree, in drafting order); greedy decoding must return the target's
greedy output token for token, with a draft model and with a feature head;
sampling must follow the target's law exactly, with sampled children
(recursive rejection sampling) and with top-k ones (point-mass
verification), and the statistic must reject a subtly wrong verification
and a tree shaped by its drawn tokens' own probabilities; a dynamic tree
must accept more than a chain of its depth; and a second call compiles
nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax._src.logits import sampling
from specjax._src.proposals import trees as trees_lib
from specjax._src.proposals.drafting import fixed
from specjax._src.engine import tree_drafting
from specjax._src.engine.tree_drafting import draft_dynamic
from specjax.engine import CycleInputs, LoopConfig, init_state
from specjax.rules import mars, speculative_sampling
from specjax.testing import bigram_model, random_table
from specjax.trees import (DynamicTree, children_table, dynamic_tree, rerank, top_ranked,
                           verify_dynamic_tree)
from test_decode import count_compilations, exact_two_token_distribution, goodness_of_fit, random_prompts
from test_feature_head import _exact_two_tokens, _sampled_two_tokens, _small_head_pair
from test_tree_decode import tree_two_token_counts


@pytest.fixture(scope="module")
def head_pair(llama_pair):
    target = llama_pair.target
    return specjax.pair(target, specjax.heads.init_from_target(target, jax.random.key(1), np.arange(80)[::-1]))


@pytest.fixture
def fresh_programs():
    """For a test that patches the engine: its programs are traced afresh, and
    dropped afterwards, so no later test reuses a program built patched."""
    jax.clear_caches()
    yield
    jax.clear_caches()


PROMPTS = random_prompts(21, 50, 96, 14)
GREEDY = dict(max_new_tokens=24, temperature=0.0, eos_token_id=5)
TREE = dynamic_tree(3, 3, 10)  # one program shared by the greedy tests (batch 50, the same buckets)


@pytest.fixture(scope="module")
def greedy_reference(llama_pair):
    return specjax.generate(llama_pair.target, PROMPTS, **GREEDY)


# ---------------------------------------------------------------------------
# Expansion and rerank
# ---------------------------------------------------------------------------


def test_top_ranked_breaks_ties_by_index_and_counts_nan_as_minus_inf():
    scores = jnp.asarray([1.0, 3.0, 3.0, jnp.nan, 2.0, -jnp.inf])
    np.testing.assert_array_equal(np.asarray(top_ranked(scores, 4)), [1, 2, 4, 0])
    np.testing.assert_array_equal(np.asarray(top_ranked(scores[None], 6))[0], [1, 2, 4, 0, 3, 5])


def test_slot_scores_read_q_not_the_draws():
    log_q = jnp.log(jnp.asarray([0.1, 0.5, 0.15, 0.25]))
    drawn = jnp.asarray([2, 0, 3])  # a draw order that is not q's ranking
    np.testing.assert_allclose(np.asarray(trees_lib.slot_scores(log_q, drawn)), np.asarray(log_q)[[2, 0, 3]])
    full = jnp.exp(log_q)
    np.testing.assert_allclose(np.asarray(trees_lib.slot_scores(log_q, drawn, full)), np.log([0.5, 0.25, 0.15]),
                               rtol=1e-6)
    top2 = jnp.asarray([0.0, 0.6, 0.0, 0.4])  # warping left two tokens with mass: the third slot ranks last
    scores = np.asarray(trees_lib.slot_scores(log_q, drawn, top2))
    np.testing.assert_allclose(scores[:2], np.log([0.5, 0.25]), rtol=1e-6)
    assert scores[2] == -np.inf


def test_rerank_keeps_a_subtree_in_drafting_order():
    # candidates (drafting order): score, parent candidate (-1: the root)
    scores = jnp.asarray([-0.1, -0.5, -0.3, -0.5, -0.9, -0.35])
    parents = jnp.asarray([-1, -1, 0, 1, 0, 2], jnp.int32)
    kept, tree = rerank(scores, parents, 4)
    # best (score, -index): 0, 2, 5, then 1 and 3 tie at -0.5: 1 (3's parent) wins
    np.testing.assert_array_equal(np.asarray(kept), [0, 1, 2, 5])
    np.testing.assert_array_equal(np.asarray(tree), [-1, 0, 0, 1, 3])
    kept, tree = rerank(scores, parents, 5)
    np.testing.assert_array_equal(np.asarray(kept), [0, 1, 2, 3, 5])
    np.testing.assert_array_equal(np.asarray(tree), [-1, 0, 0, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(children_table(tree, 2)),
                                  [[1, 2], [3, -1], [4, -1], [5, -1], [-1, -1], [-1, -1]])


def _reference_expansion(logq_of, prefix: list, depth: int, k: int, m: int):
    """EAGLE-2's expansion and rerank in plain Python: ``logq_of(tokens)`` is
    the draft's log-probabilities after the token list ``tokens``. Returns
    ``(tokens [m + 1], parents [m + 1], scores of all candidates)``."""
    best = lambda row: sorted(range(len(row)), key=lambda t: (-row[t], t))[:k]  # noqa: E731
    root = logq_of(prefix)
    cands = [((t,), root[t], -1) for t in best(root)]  # (root path, score, parent candidate)
    front = list(range(k))
    for _ in range(1, depth):
        level = []
        for f in front:
            row = logq_of(prefix + list(cands[f][0]))
            level += [(cands[f][0] + (c,), np.float32(cands[f][1] + row[c]), f) for c in best(row)]
        base = len(cands)
        cands += level
        front = [base + i for i in sorted(range(len(level)), key=lambda i: (-level[i][1], i))[:k]]
    kept = sorted(sorted(range(len(cands)), key=lambda i: (-cands[i][1], i))[:m])
    node = {c: j + 1 for j, c in enumerate(kept)}
    tokens = [prefix[-1]] + [cands[c][0][-1] for c in kept]
    parents = [-1] + [0 if cands[c][2] < 0 else node[cands[c][2]] for c in kept]
    return tokens, parents, [c[1] for c in cands]


def _state(pair, tree, prompts):
    cfg = LoopConfig(diagnostics=None, num_draft=tree.depth, max_new_tokens=16, cache_length=64, greedy=True,
                     top_k=None, use_top_p=False, tree=tree)
    arr = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        arr[i, : len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    return cfg, lengths, init_state(cfg, pair, speculative_sampling(), fixed(), jnp.asarray(arr), lengths,
                                    jnp.full((len(prompts),), 16))


@pytest.mark.parametrize("depth, k, m", [(4, 3, 9)])
def test_expansion_is_eagle2s(depth, k, m):
    """The engine's expansion (a bigram draft: its logits depend on the node's
    token only) picks EAGLE-2's nodes: the kept nodes form a subtree in
    topological order, and are the best ``m`` of all drafted candidates by
    cumulative draft log-probability."""
    vocab = 12
    table = random_table(3, vocab) * 2.0
    pair = specjax.pair(bigram_model(table), bigram_model(table))
    tree = dynamic_tree(depth, k, m)
    cfg, _, state = _state(pair, tree, [[1, 4, 7], [2, 9], [5]])
    drafts, _ = jax.jit(lambda s: draft_dynamic(cfg, tree, pair, s, need_logits=False))(state)
    logq = np.asarray(jax.nn.log_softmax(jnp.asarray(table, jnp.float32), axis=-1))
    for b, root in enumerate([7, 9, 5]):
        tokens, parents, scores = _reference_expansion(lambda toks: logq[toks[-1]], [root], depth, k, m)
        np.testing.assert_array_equal(np.asarray(drafts.tokens[b]), tokens)
        np.testing.assert_array_equal(np.asarray(drafts.parents[b]), parents)
        par = np.asarray(drafts.parents[b])
        assert (par[1:] < np.arange(1, m + 1)).all() and (par[1:] >= 0).all()  # topological, one tree
        path_score = np.zeros(m + 1, np.float32)
        for j in range(1, m + 1):
            path_score[j] = path_score[par[j]] + logq[tokens[par[j]], tokens[j]]
        assert (path_score[1:] <= path_score[par[1:]]).all()
        # the kept nodes are the m best candidates
        np.testing.assert_allclose(np.sort(path_score[1:]), np.sort(scores)[::-1][:m][::-1], rtol=1e-6)


def test_transformer_draft_expands_from_its_cache_after_each_commit(llama_pair):
    """With a real draft model (traced tree attention over the fed frontier
    nodes), cycle after cycle with ragged acceptance, the engine's tree equals
    the reference expansion from cache-free forwards over the committed
    prefix: after each commit the draft cache holds exactly the committed
    tokens, moved from the accepted path's fed slots. The draft is the target
    itself: long accepted paths, whose fed slots differ from their verified
    node indices (keeping the verified indices fails this test)."""
    pair = specjax.pair(llama_pair.target, llama_pair.target)
    tree, batch = dynamic_tree(5, 2, 7), 6
    cfg, lengths, state = _state(pair, tree, random_prompts(4, batch, 96, 9, min_len=2))
    draft, width = pair.draft, 48
    forward = jax.jit(lambda toks: jax.nn.log_softmax(draft.module.apply(draft.params, toks[None]).logits[0], -1))

    def logq_of(tokens):  # causal: the padding after the read position is inert
        return np.asarray(forward(jnp.asarray(tokens + [0] * (width - len(tokens)), jnp.int32))[len(tokens) - 1])

    # one program: this state's tree, and the cycle that drafts, verifies and commits it
    step = jax.jit(lambda s: (
        draft_dynamic(cfg, tree, pair, s, need_logits=False)[0],
        specjax.engine.TREE.run(cfg, pair, speculative_sampling(), None,
                                CycleInputs(lengths, jnp.full((batch,), 16), jnp.asarray([-1]),
                                            jax.random.split(jax.random.key(0), batch), 1.0, 1.0), s)[0],
    ))
    accepted = set()
    for _ in range(3):
        drafts, new_state = step(state)
        for b in range(batch):
            prefix = np.asarray(state.tokens[b, : int(state.num_committed[b])]).tolist()
            tokens, parents, _ = _reference_expansion(logq_of, prefix, tree.depth, tree.top_k, tree.num_kept)
            np.testing.assert_array_equal(np.asarray(drafts.tokens[b]), tokens)
            np.testing.assert_array_equal(np.asarray(drafts.parents[b]), parents)
        accepted |= set((np.asarray(new_state.num_committed) - np.asarray(state.num_committed)).tolist())
        state = new_state
    assert len(accepted) >= 2, f"acceptance was not ragged: {accepted}"


def test_point_mass_verification_follows_p():
    """One node, three chosen children: the first token's law is exactly p."""
    p = jnp.asarray([0.1, 0.3, 0.05, 0.4, 0.15])
    parents, tokens = jnp.asarray([-1, 0, 0, 0]), jnp.asarray([0, 3, 1, 4])
    logits, probs = jnp.log(p)[None].repeat(4, 0), p[None].repeat(4, 0)
    n = 200_000
    u = jax.random.uniform(jax.random.key(0), (n, 5), minval=1e-7)
    verdict = jax.vmap(lambda uu: verify_dynamic_tree(parents, tokens, logits, probs, uu[:4], uu[4], depth=1,
                                                      width=3, greedy=False))(u)
    first = np.where(np.asarray(verdict.num_accepted) > 0, np.asarray(tokens)[np.asarray(verdict.path[:, 1])],
                     np.asarray(verdict.token))
    freq = np.bincount(first, minlength=5) / n
    np.testing.assert_allclose(freq, np.asarray(p), atol=4e-3)
    # a child is accepted with probability p(children) = 0.85, as its token's law is p
    assert abs(float(np.mean(np.asarray(verdict.num_accepted))) - 0.85) < 5e-3


# ---------------------------------------------------------------------------
# Greedy: the target's greedy output
# ---------------------------------------------------------------------------


def test_greedy_dynamic_tree_decoding_is_target_greedy(llama_pair, greedy_reference):
    out = specjax.decode(llama_pair, PROMPTS, tree=TREE, **GREEDY)
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(greedy_reference.lengths))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(greedy_reference.tokens))
    assert int(np.sum(out.stats.accepted)) > 0


def test_greedy_dynamic_tree_with_a_head_is_target_greedy(head_pair, greedy_reference):
    # 9 fed frontier nodes for 5 verified drafts: the draft's tree outgrows the target's
    tree = dynamic_tree(4, 3, 5)
    assert tree.num_fed > tree.num_kept
    out = specjax.decode(head_pair, PROMPTS, tree=tree, **GREEDY)
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(greedy_reference.lengths))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(greedy_reference.tokens))
    assert int(np.sum(out.stats.accepted)) > 0


def test_a_second_call_compiles_nothing(llama_pair):
    specjax.decode(llama_pair, PROMPTS, tree=TREE, **GREEDY)
    with count_compilations() as compiled:
        out = specjax.decode(llama_pair, PROMPTS[::-1], tree=TREE, **{**GREEDY, "eos_token_id": 7})
        jax.block_until_ready(out.tokens)
    assert compiled["n"] == 0


def test_dynamic_tree_accepts_more_than_a_chain_of_its_depth(llama_pair):
    kw = dict(max_new_tokens=24, temperature=0.0, eos_token_id=())
    chain = specjax.decode(llama_pair, PROMPTS, num_draft=3, **kw)
    dynamic = specjax.decode(llama_pair, PROMPTS, tree=TREE, **kw)
    print(f"\ntau (50 prompts, 24 tokens, greedy): chain K=3 {chain.stats.tau:.3f}, "
          f"dynamic (3,3,10) {dynamic.stats.tau:.3f}")
    assert dynamic.stats.tau > chain.stats.tau
    np.testing.assert_array_equal(np.asarray(dynamic.tokens), np.asarray(chain.tokens))


def test_relaxed_greedy_rules_on_dynamic_trees(llama_pair):
    kw = dict(tree=TREE, max_new_tokens=24, temperature=0.0, eos_token_id=())
    lossless = specjax.decode(llama_pair, PROMPTS, **kw)
    limit = specjax.decode(llama_pair, PROMPTS, rule=mars(1.0), **kw)
    np.testing.assert_array_equal(np.asarray(limit.tokens), np.asarray(lossless.tokens))
    assert limit.stats.accepted_by_path_total["relaxed"] == 0
    relaxed = specjax.decode(llama_pair, PROMPTS, rule=mars(0.5), **kw)
    assert relaxed.stats.tau > lossless.stats.tau
    assert relaxed.stats.accepted_by_path_total["relaxed"] > 0


# ---------------------------------------------------------------------------
# Sampling: lossless
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature, top_k, top_p, sampled", [
    (1.0, None, None, True), (0.7, None, 0.8, True), pytest.param(1.3, 5, None, True, marks=pytest.mark.slow),
    (1.0, None, None, False), pytest.param(0.7, None, 0.8, False, marks=pytest.mark.slow), (1.3, 5, None, False),
])
def test_dynamic_tree_sampling_is_lossless_bigram(bigram_pair, temperature, top_k, top_p, sampled):
    """6 of 12 candidates kept: whether a node's later children are verified
    depends on its cousins' draws (sampled) or scores (top-k)."""
    table = np.asarray(bigram_pair.target.params["table"])
    expected = exact_two_token_distribution(table, 3, temperature, top_k, top_p)
    counts = tree_two_token_counts(bigram_pair, dynamic_tree(2, 3, 6, sampled=sampled), temperature, top_k, top_p)
    pvalue, tv = goodness_of_fit(counts, expected)
    assert pvalue > 1e-3, f"chi-square p={pvalue:.2e}, TV={tv:.4f}"
    assert tv < 0.03


def test_the_statistic_rejects_a_wrong_point_mass_residual(bigram_pair, monkeypatch, fresh_programs):
    """Negative control: after a rejected child, keep p as it was (the child
    may come back) instead of p without it: the law is off, and the test sees it."""
    monkeypatch.setattr(trees_lib, "_without_or_same", lambda p, token: p)
    table = np.asarray(bigram_pair.target.params["table"])
    expected = exact_two_token_distribution(table, 3, 1.0, None, None)
    counts = tree_two_token_counts(bigram_pair, dynamic_tree(2, 3, 5, sampled=False), 1.0)
    pvalue, tv = goodness_of_fit(counts, expected)
    assert pvalue < 1e-6 and tv > 0.05, f"chi-square p={pvalue:.2e}, TV={tv:.4f}"


def test_the_statistic_rejects_a_tree_shaped_by_its_draws(bigram_pair, monkeypatch, fresh_programs):
    """Negative control: score each sampled child by its own ``log q`` (EAGLE-2's
    score, read off the drawn token) instead of its slot's: a low draw is then
    dropped from the verified tree more often than a likely one, the verified
    children are no longer draws from ``q``, and the law is off."""
    monkeypatch.setattr(tree_drafting, "slot_scores",
                        lambda log_q, children, draw_probs=None: jnp.take_along_axis(log_q, children, axis=-1))
    table = np.asarray(bigram_pair.target.params["table"])
    expected = exact_two_token_distribution(table, 3, 1.0, None, None)
    counts = tree_two_token_counts(bigram_pair, dynamic_tree(2, 3, 4), 1.0)
    pvalue, tv = goodness_of_fit(counts, expected)
    print(f"\ndraw-shaped tree: chi-square p={pvalue:.2e}, TV={tv:.4f}")
    assert pvalue < 1e-6, f"chi-square p={pvalue:.2e}, TV={tv:.4f}"


def test_a_sampled_trees_shape_never_reads_its_draws():
    """A draft whose distribution is the same after every token: the slot
    scores are then the same whatever was drawn, so every key must give the
    greedy tree's shape, with different tokens, each node's children distinct."""
    vocab, k = 12, 3
    row = np.asarray(random_table(5, vocab)[0]) * 2.0
    table = np.tile(row, (vocab, 1))
    pair = specjax.pair(bigram_model(random_table(6, vocab)), bigram_model(table))
    tree = dynamic_tree(3, k, 7)
    prompts = [[1, 4, 7], [2, 9], [5]]
    cfg, _, state = _state(pair, tree, prompts)
    greedy, _ = jax.jit(lambda s: draft_dynamic(cfg, tree, pair, s, need_logits=False))(state)
    cfg = cfg._replace(greedy=False)
    draw = jax.jit(lambda s, key: draft_dynamic(cfg, tree, pair, s, need_logits=False, sampled=True,
                                                 draft_keys=jax.random.split(key, len(prompts)))[0])
    seen = set()
    for seed in range(6):
        drafts = draw(state, jax.random.key(seed))
        np.testing.assert_array_equal(np.asarray(drafts.parents), np.asarray(greedy.parents))
        tokens, parents = np.asarray(drafts.tokens), np.asarray(drafts.parents)
        for b in range(len(prompts)):
            for node in range(tree.num_kept + 1):
                kids = tokens[b][parents[b] == node]
                assert len(set(kids.tolist())) == len(kids)
        fed = np.asarray(drafts.fed) >= 0  # nodes with children were fed: the rows their children came from
        np.testing.assert_allclose(np.asarray(drafts.probs)[fed],
                                   np.broadcast_to(np.exp(jax.nn.log_softmax(row)), (fed.sum(), vocab)), rtol=1e-5)
        seen.add(tokens.tobytes())
    assert len(seen) == 6  # the draws differ; the shape does not


@pytest.mark.parametrize("depth, k, m", [(3, 3, 6), (4, 2, 9)])
def test_each_node_keeps_the_distribution_its_children_were_drawn_from(depth, k, m):
    """A bigram draft (its distribution follows the node's token), top-k 2
    warping: every node with children carries the warped row of its own token,
    at every depth, and no kept child is a zero-mass filler (each node has
    only 2 tokens with mass for its ``k`` slots; fillers rank last)."""
    vocab, top_k = 12, 2
    table = np.asarray(random_table(7, vocab)) * 2.0
    pair = specjax.pair(bigram_model(random_table(8, vocab)), bigram_model(table))
    tree = dynamic_tree(depth, k, m)
    prompts = [[1, 4, 7], [2, 9], [5], [3, 3]]
    cfg, _, state = _state(pair, tree, prompts)
    cfg = cfg._replace(greedy=False, top_k=top_k)
    warped = np.asarray(jax.nn.softmax(sampling.warp_logits(jnp.asarray(table), 1.0, top_k), -1))
    draw = jax.jit(lambda s, key: draft_dynamic(cfg, tree, pair, s, need_logits=False, sampled=True,
                                                 draft_keys=jax.random.split(key, len(prompts)))[0])
    for seed in range(4):
        drafts = draw(state, jax.random.key(seed))
        tokens, parents = np.asarray(drafts.tokens), np.asarray(drafts.parents)
        probs, fed = np.asarray(drafts.probs), np.asarray(drafts.fed)
        for b in range(len(prompts)):
            for j in range(1, m + 1):
                assert warped[tokens[b, parents[b, j]], tokens[b, j]] > 0, "a zero-mass filler was kept"
            has_children = np.isin(np.arange(m + 1), parents[b, 1:])
            assert (fed[b][has_children] >= 0).all()
            np.testing.assert_allclose(probs[b][has_children], warped[tokens[b][has_children]], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("sampled", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_dynamic_tree_sampling_with_a_head_is_lossless(sampled):
    """The target's tree attention with traced parents, on a real decoder: the
    first two tokens' joint law against exact enumeration (vocabulary 16)."""
    vocab, prompt, samples = 16, [5, 3], 20000
    pair = _small_head_pair(vocab)
    counts, stats = _sampled_two_tokens(pair, prompt, vocab, samples, tree=dynamic_tree(2, 3, 6, sampled=sampled),
                                        key=jax.random.key(8))
    pvalue, tv = goodness_of_fit(counts, _exact_two_tokens(pair.target, prompt, vocab))
    # TV of an exact sampler at 20000 draws over these 256 cells: about 0.045.
    assert pvalue > 1e-3 and tv < 0.06, f"chi-square p={pvalue:.2e}, TV={tv:.4f}"
    assert int(np.sum(stats.accepted)) > samples // 10  # the drafts took part


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


def test_clear_errors(llama_pair):
    with pytest.raises(ValueError, match="depth must be a positive integer"):
        dynamic_tree(0, 2, 3)
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        dynamic_tree(2, 2.0, 3)
    with pytest.raises(ValueError, match="exceeds the 6 candidates"):
        dynamic_tree(2, 2, 7)
    with pytest.raises(ValueError, match="num_nodes must be a positive integer"):
        specjax.decode(llama_pair, PROMPTS[:2], tree=DynamicTree(2, 2, 0), temperature=0.0)
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        specjax.decode(llama_pair, PROMPTS[:2], tree=DynamicTree(1, 97, 3), temperature=0.0)
    with pytest.raises(ValueError, match="num_draft=4 but the tree's depth is 3"):
        specjax.decode(llama_pair, PROMPTS[:2], tree=dynamic_tree(3, 2, 4), num_draft=4, temperature=0.0)
    with pytest.raises(TypeError, match="sampled must be True, False or None"):
        specjax.decode(llama_pair, PROMPTS[:2], tree=DynamicTree(2, 2, 3, "yes"), temperature=1.0)
    with pytest.raises(TypeError, match="DynamicTree"):
        specjax.decode(llama_pair, PROMPTS[:2], tree=(3, 2, 4), temperature=0.0)
    assert hash(dynamic_tree(3, 2, 4)) == hash(dynamic_tree(np.int64(3), 2, 4))
