"""Relaxed and stateful rules on token trees when sampling (issue 15, part 3).

At ``T > 0`` the walk asks the rule about each child of a node in turn, as a
one-slot block whose ``target_probs`` / ``draft_probs`` are what the earlier
siblings left (the rule's correction, ``q`` without them) and whose logits
are the models' at the node. Checked here:

* the law of the first token under MARS on a static and on a dynamic tree
  against a numpy enumeration of exactly that walk (it fails if the rule saw
  the residual's logits, or if a rejection did not pass the rule's
  correction on);
* each rule at its lossless limit is the lossless tree, token for token;
* a stateful rule (AdaSD) updates from the decided path: on a tree that is a
  chain it decodes exactly as on the chain.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

import specjax
from specjax.rules import adasd, ears, mars, pad, speculative_sampling, top_m
from specjax.trees import dynamic_tree, static_tree
from test_decode import NO_BUCKETS, VOCAB, goodness_of_fit, opening_with, random_prompts

PROMPTS = random_prompts(21, 24, 96, 14)
THETA = 0.5
THETA_LAW = 0.2  # the bigram target's margin after token 3 is low at this theta: z(2)/z(1) = 0.24
STATIC, DYNAMIC = static_tree((2, 2, 1)), dynamic_tree(3, 2, 5)  # DYNAMIC's children: the rule decides
DRAWN, TOPK = dynamic_tree(3, 2, 5, sampled=True), dynamic_tree(3, 2, 5, sampled=False)


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def mars_relaxes(logits, token, theta):
    """MARS's relaxed acceptance at T > 0 (paper variant), on the node's own logits."""
    z1, z2 = np.sort(logits)[::-1][:2]
    in_top2 = np.sum(logits > logits[token]) < 2
    return bool(in_top2 and z1 > 0 and z2 > theta * z1)


def residual(p, q):
    r = np.maximum(p - q, 0.0)
    return r / r.sum() if r.sum() > 1e-12 else p


def walk_law(p, logits, children_and_q, theta):
    """The first token's law when a node's children are tried in order:
    ``children_and_q`` lists ``(child, q_i)``; accept if MARS relaxes, else
    with ``min(1, p_i / q_i)``; a rejection leaves ``residual(p_i, q_i)``."""
    law, left = np.zeros_like(p), 1.0
    for child, q in children_and_q:
        a = 1.0 if mars_relaxes(logits, child, theta) else min(1.0, p[child] / q[child])
        law[child] += left * a
        left *= 1.0 - a
        p = residual(p, q)
    return law + left * p


def static_tree_law(p, q, logits, width, theta):
    """Children drawn from ``q`` without replacement (every ordered draw enumerated)."""
    law = np.zeros_like(p)
    for kids in itertools.permutations(range(len(p)), width):
        weight, qi, tries = 1.0, q.copy(), []
        for c in kids:
            weight *= qi[c]
            tries.append((c, qi.copy()))
            qi[c] = 0.0
            qi = qi / qi.sum()
        law += weight * walk_law(p, logits, tries, theta)
    return law


def dynamic_tree_law(p, draft_logits, logits, width, theta):
    """Children are the draft's top ``width``, each tried as a point mass
    (``dynamic_tree(..., sampled=False)``)."""
    kids = np.argsort(-draft_logits, kind="stable")[:width]
    return walk_law(p, logits, [(c, np.eye(len(p))[c]) for c in kids], theta)


def first_cycle_token_counts(pair, tree, rule, samples=20000, seed=0):
    """How often each first token of the first cycle was sampled, after 3: the prompts' last
    token, 7, leads to 3 alone in the target (the prefill draws the first token, 3)."""
    pair, _ = opening_with(pair, 7, 3)
    prompts = np.array([[7, 0], [5, 7]] * (samples // 2), np.int32)
    lengths = np.array([1, 2] * (samples // 2), np.int32)
    out = specjax.decode(pair, prompts, prompt_lengths=lengths, tree=tree, rule=rule, max_new_tokens=2,
                         temperature=1.0, key=jax.random.key(seed), buckets=NO_BUCKETS)
    assert (np.asarray(out.tokens)[:, 0] == 3).all()
    return np.bincount(np.asarray(out.tokens)[:, 1], minlength=VOCAB).astype(float)


@pytest.mark.parametrize("kind", ["static", "dynamic", "dynamic-topk"])
def test_mars_first_token_law_on_a_tree(bigram_pair, kind):
    """A depth-1 dynamic tree keeping all 3 root children is, sampled, the
    static tree (3,); with its top-k children, three point-mass tries."""
    target = np.asarray(bigram_pair.target.params["table"], np.float64)[3]
    draft = np.asarray(bigram_pair.draft.params["table"], np.float64)[3]
    p, q = softmax(target), softmax(draft)
    if kind == "static":
        tree, expected = static_tree((3,)), static_tree_law(p, q, target, 3, THETA_LAW)
    elif kind == "dynamic":
        tree, expected = dynamic_tree(1, 3, 3, sampled=True), static_tree_law(p, q, target, 3, THETA_LAW)
    else:
        tree, expected = dynamic_tree(1, 3, 3, sampled=False), dynamic_tree_law(p, draft, target, 3, THETA_LAW)
    assert np.abs(expected - p).sum() > 0.1  # MARS moves this law away from the target's
    counts = first_cycle_token_counts(bigram_pair, tree, mars(THETA_LAW))
    pvalue, tv = goodness_of_fit(counts[None], expected[None])
    assert pvalue > 1e-3, f"chi-square p={pvalue:.2e}, TV={tv:.4f}"
    assert tv < 0.02


# MARS on a static tree is slow-only: EARS covers the static tree's collapse; on a top-k tree
# too: test_mars_first_token_law_on_a_tree samples MARS on one by default.
@pytest.mark.parametrize("limit, tree", [pytest.param("mars", STATIC, id="mars-static", marks=pytest.mark.slow),
                                         pytest.param("mars", DRAWN, id="mars-dynamic"),
                                         pytest.param("mars", TOPK, id="mars-dynamic-topk", marks=pytest.mark.slow),
                                         pytest.param("ears", STATIC, id="ears-static"),
                                         pytest.param("pad", DRAWN, id="pad-dynamic")])
def test_relaxed_rules_sampling_on_trees_collapse_to_lossless(llama_pair, tree, limit):
    from test_pad import constant_head

    rule = {"mars": mars(1.0), "ears": ears(0.0), "pad": pad(constant_head(10.0))}[limit]
    kw = dict(tree=tree, max_new_tokens=20, temperature=1.0, eos_token_id=(), key=jax.random.key(3))
    ref = specjax.decode(llama_pair, PROMPTS, rule=speculative_sampling(), **kw)
    out = specjax.decode(llama_pair, PROMPTS, rule=rule, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert out.stats.accepted_by_path_total["exact"] == ref.stats.accepted_by_path_total["exact"] > 0


# On a top-k tree slow-only: static and drawn trees run by default, and
# test_mars_first_token_law_on_a_tree samples MARS on a top-k tree.
@pytest.mark.parametrize("tree", [STATIC, DRAWN, pytest.param(TOPK, marks=pytest.mark.slow)],
                         ids=["static", "dynamic", "dynamic-topk"])
def test_mars_sampling_on_a_tree_accepts_more(llama_pair, tree):
    kw = dict(tree=tree, max_new_tokens=20, temperature=1.0, eos_token_id=(), key=jax.random.key(4))
    lossless = specjax.decode(llama_pair, PROMPTS, **kw)
    relaxed = specjax.decode(llama_pair, PROMPTS, rule=mars(THETA), **kw)
    assert relaxed.stats.accepted_by_path_total["relaxed"] > 0
    assert relaxed.stats.tau > lossless.stats.tau


def test_a_dynamic_trees_children_follow_the_rule_by_default(llama_pair):
    """``sampled=None``: drawn children for the lossless rule, the top-k for a
    relaxed one (the two kinds give different decodes, so each check can fail)."""
    kw = dict(max_new_tokens=20, temperature=1.0, eos_token_id=(), key=jax.random.key(7))
    decode = lambda tree, rule: np.asarray(specjax.decode(llama_pair, PROMPTS, tree=tree, rule=rule, **kw).tokens)  # noqa: E731
    lossless = decode(DYNAMIC, speculative_sampling())
    np.testing.assert_array_equal(lossless, decode(DRAWN, speculative_sampling()))
    assert (lossless != decode(TOPK, speculative_sampling())).any()
    relaxed = decode(DYNAMIC, mars(THETA))
    np.testing.assert_array_equal(relaxed, decode(TOPK, mars(THETA)))
    assert (relaxed != decode(DRAWN, mars(THETA))).any()


def test_top_m_sampling_on_a_tree_emits_only_top_m_tokens(bigram_pair):
    """A criterion's accepted children and its corrections stay in its set.
    (A bonus token after a leaf follows ``p``, as on a chain: with a depth-2
    tree the first cycle's first two tokens are never bonus tokens. The first
    token, the prefill's, follows ``p`` too: it is left out.)"""
    table = np.asarray(bigram_pair.target.params["table"])
    prompts = np.array([[t] for t in range(VOCAB)] * 256, np.int32)
    out = specjax.decode(bigram_pair, prompts, tree=static_tree((3, 2)), rule=top_m(2), max_new_tokens=3,
                         temperature=1.0, eos_token_id=(), key=jax.random.key(5))
    toks = np.asarray(out.tokens)
    prev, nxt = toks[:, :-1].ravel(), toks[:, 1:].ravel()
    rank = (table[prev] > table[prev, nxt][:, None]).sum(-1)
    assert rank.max() < 2
    assert (rank == 1).any()  # the runner-up was emitted too: not greedy


def test_adasd_on_a_chain_shaped_tree_decodes_as_on_the_chain(llama_pair):
    """AdaSD's running means update from the tree's decided path: on the tree
    (1, 1, 1) greedy AdaSD makes the chain's decisions, relaxations included."""
    kw = dict(rule=adasd(), max_new_tokens=24, temperature=0.0, eos_token_id=())
    chain = specjax.decode(llama_pair, PROMPTS, num_draft=3, **kw)
    tree = specjax.decode(llama_pair, PROMPTS, tree=static_tree((1, 1, 1)), **kw)
    assert chain.stats.accepted_by_path_total["relaxed"] > 0  # the threshold moved and relaxed something
    np.testing.assert_array_equal(np.asarray(tree.tokens), np.asarray(chain.tokens))
    assert tree.stats.accepted_by_path_total == chain.stats.accepted_by_path_total


def test_adasd_sampling_on_a_dynamic_tree_relaxes(llama_pair):
    kw = dict(tree=DYNAMIC, max_new_tokens=24, temperature=1.0, eos_token_id=(), key=jax.random.key(6))
    out = specjax.decode(llama_pair, PROMPTS, rule=adasd(), **kw)
    assert out.stats.accepted_by_path_total["relaxed"] > 0


@pytest.mark.parametrize("tree", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_certificate_diagnostics_read_the_decided_path(llama_pair, tree):
    """A diagnostics hook sees each cycle's decided path as a chain block: the
    criterion it recomputes from those rows agrees with every decision the tree
    made (rows off by one node would not), and no certified slot was rejected."""
    from specjax.rules import additive
    from specjax.theory import certified_decode

    out, report = certified_decode(llama_pair, PROMPTS, rule=additive(0.3), trees=(2,), tree=tree,
                                   max_new_tokens=24, eos_token_id=())
    row = report["additive:t=0.3"]
    assert report.positions > 0 and report.rule_mismatches == 0 and row["violations"] == 0
    # The hook counts every decided slot; the stats leave out those cut by the token budget.
    assert report.positions >= int(np.sum(out.stats.judged)) > 0
    assert round(row["accepted_fraction"] * report.positions) >= int(np.sum(out.stats.accepted)) > 0
