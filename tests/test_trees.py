"""Tree verification (issue 15, part 2): greedy identity and exact multi-draft sampling.

The models are bigram tables: the target's next-token distribution after token
``a`` is ``P[a]``, the draft's ``Q[a]``, so the exact law of any output prefix
is a product of table rows and can be compared with what tree speculative
decoding emits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from specjax._src.proposals import trees
from specjax._src.proposals.trees import TokenTree, sample_children, static_tree, verify_tree

V = 4


def tables(seed: int, vocab: int = V, sharp: float = 2.0, noise: float = 1.0):
    """``(P, Q)`` bigram tables; the draft's logits are the target's plus noise,
    so it agrees with the target part of the time."""
    rng = np.random.default_rng(seed)
    logits = sharp * rng.normal(size=(vocab, vocab))
    p = jax.nn.softmax(logits, -1)
    q = jax.nn.softmax(logits + noise * sharp * rng.normal(size=(vocab, vocab)), -1)
    return jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32)


def draft(tree: TokenTree, key, root, q_table, greedy: bool):
    """Node tokens ``[N]``: each node's children drawn from ``Q[its token]``
    (greedy: the draft's top children; sampling: without replacement)."""
    kids = tree.children
    tokens = jnp.zeros((tree.num_nodes,), jnp.int32).at[0].set(root)
    for node, children in enumerate(kids):
        if not children:
            continue
        q = q_table[tokens[node]]
        if greedy:
            chosen = jax.lax.top_k(q, len(children))[1].astype(jnp.int32)
        else:
            chosen = sample_children(jax.random.fold_in(key, node), q, len(children))
        tokens = tokens.at[jnp.asarray(children)].set(chosen)
    return tokens


def cycle(tree: TokenTree, key, root, p_table, q_table, greedy: bool):
    """One draft-verify cycle from ``root``: ``(output tokens [D + 1], count)``."""
    k_draft, k_u, k_e = jax.random.split(key, 3)
    tokens = draft(tree, k_draft, root, q_table, greedy)
    p = p_table[tokens]
    logits = jnp.log(p)
    verdict = verify_tree(tree, tokens, logits, p, q_table[tokens],
                          jax.random.uniform(k_u, (tree.num_nodes,)), jax.random.uniform(k_e, ()), greedy=greedy)
    out = tokens[verdict.path[1:]]  # accepted draft tokens, then the emitted one
    out = jnp.where(jnp.arange(tree.max_depth) < verdict.num_accepted, out, verdict.token)
    out = jnp.concatenate([out, verdict.token[None]])
    return out, verdict.num_accepted + 1


def first_tokens(tree, key, root, p_table, q_table, greedy, count=2):
    """The first ``count`` output tokens (running as many cycles as needed)."""
    got, last = [], root
    for c in range(count):
        out, m = cycle(tree, jax.random.fold_in(key, c), last, p_table, q_table, greedy)
        got.append((out, m))
        last = out[m - 1]
    flat = jnp.concatenate([o for o, _ in got])
    valid = jnp.concatenate([jnp.arange(o.shape[0]) < m for o, m in got])
    order = jnp.argsort(~valid, stable=True)  # valid tokens first, in order
    return flat[order][:count]


def test_static_tree_shapes():
    tree = static_tree((4, 2, 2, 1))
    assert tree.num_nodes == 1 + 4 + 8 + 16 + 16
    assert tree.max_depth == 4 and tree.max_children == 4
    assert tree.children[0] == (1, 2, 3, 4)
    assert tree.depths[-1] == 4
    assert static_tree((1, 1, 1)).parents == (-1, 0, 1, 2)  # a chain
    assert static_tree((1, 1, 1)).draft_parents() == (-1, 0, 1)
    table = tree.children_table()
    assert table.shape == (45, 4) and (table[-1] == -1).all()
    with pytest.raises(ValueError, match=r"branching\[1\] must be a positive integer"):
        static_tree((2, 0))
    with pytest.raises(ValueError, match="at least one depth"):
        static_tree(())


@pytest.mark.parametrize("branching", [(1, 1, 1), (3, 2), (2, 2, 2), (4, 1, 1)])
def test_greedy_tree_emits_the_target_greedy_chain(branching):
    tree = static_tree(branching)
    depth = len(branching)
    accepted = []
    for seed in range(6):
        p, q = tables(seed, vocab=16, sharp=3.0)
        run = jax.jit(lambda root: cycle(tree, jax.random.key(0), root, p, q, True))
        for root in range(16):
            out, m = run(jnp.int32(root))
            want, tok = [], root
            for _ in range(depth + 1):
                tok = int(jnp.argmax(p[tok]))
                want.append(tok)
            np.testing.assert_array_equal(np.asarray(out)[: int(m)], want[: int(m)])
            accepted.append(int(m) - 1)
    assert max(accepted) == depth and min(accepted) == 0  # whole paths and rejections both ran


def test_wider_trees_accept_more_greedy():
    """A tree's accepted length is at least its chain's, and larger on average."""
    p, q = tables(3, vocab=16, sharp=1.0)
    lengths = {}
    for name, branching in {"chain": (1, 1, 1), "tree": (3, 2, 1)}.items():
        tree = static_tree(branching)
        run = jax.jit(jax.vmap(lambda root: cycle(tree, jax.random.key(0), root, p, q, True)[1]))
        lengths[name] = np.asarray(run(jnp.arange(16)))
    assert (lengths["tree"] >= lengths["chain"]).all()
    assert lengths["tree"].mean() > lengths["chain"].mean()


def joint_counts(tree, p, q, root, samples, seed):
    keys = jax.random.split(jax.random.key(seed), samples)
    fn = jax.jit(jax.vmap(functools.partial(first_tokens, tree, root=root, p_table=p, q_table=q, greedy=False)))
    pairs = np.asarray(fn(keys))
    return np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)


def exact_joint(p, root):
    p = np.asarray(p, np.float64)
    return (p[root][:, None] * p).ravel()


@pytest.mark.parametrize("branching", [(1, 1), (3,), (2, 2), (3, 2, 1)])
def test_tree_sampling_is_lossless(branching):
    """The joint law of the first two output tokens is the target's, exactly."""
    tree = static_tree(branching)
    p, q = tables(11)
    samples = 40_000
    counts = joint_counts(tree, p, q, root=1, samples=samples, seed=len(branching))
    expected = exact_joint(p, 1) * samples
    keep = expected > 5
    stat, pvalue = scipy_stats.chisquare(counts[keep], expected[keep] * counts[keep].sum() / expected[keep].sum())
    assert pvalue > 1e-3, (branching, pvalue)


def test_a_wrong_residual_update_is_caught(monkeypatch):
    """The same check fails when rejections leave p unchanged (no residual)."""
    monkeypatch.setattr(trees, "_residual", lambda p, q: p)
    tree = static_tree((3,))
    p, q = tables(11)
    samples = 40_000
    counts = joint_counts(tree, p, q, root=1, samples=samples, seed=3)
    expected = exact_joint(p, 1) * samples
    keep = expected > 5
    _, pvalue = scipy_stats.chisquare(counts[keep], expected[keep] * counts[keep].sum() / expected[keep].sum())
    assert pvalue < 1e-6


@pytest.mark.parametrize("m", [2, 3])
def test_tree_certificates_hold_for_tree_verification(m):
    """specjax.theory's tree certificate against what tree verification does:
    wherever KL(p || q) < C_tree(p, m), a greedy tree whose root has the draft's
    top-m children accepts its first level (the target's argmax is among them)."""
    from specjax import theory

    tree = static_tree((m,))
    rng = np.random.default_rng(m)
    vocab, count = 8, 4000
    logits = 2.5 * rng.normal(size=(count, vocab))
    p = jax.nn.softmax(jnp.asarray(logits, jnp.float32), -1)
    q = jax.nn.softmax(jnp.asarray(logits + 1.2 * rng.normal(size=(count, vocab)), jnp.float32), -1)
    certified = np.asarray(theory.kl_divergence(p, q) < theory.tree_certificate(p, m))

    def first_level_accepted(p_row, q_row):
        tokens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jax.lax.top_k(q_row, m)[1].astype(jnp.int32)])
        rows = lambda r: jnp.broadcast_to(r, (tree.num_nodes, vocab))  # noqa: E731
        verdict = verify_tree(tree, tokens, rows(jnp.log(p_row)), rows(p_row), rows(q_row),
                              jnp.zeros((tree.num_nodes,)), jnp.float32(0.0), greedy=True)
        return verdict.num_accepted

    accepted = np.asarray(jax.vmap(first_level_accepted)(p, q)) == 1
    assert certified.sum() > 200 and (~certified).sum() > 200  # neither side vacuous
    assert accepted[certified].all()
    assert not accepted.all()  # and the certificate is not a tautology here


def test_parse_tree_reads_static_and_dynamic_trees():
    from specjax.trees import DynamicTree, dynamic_tree, parse_tree

    assert parse_tree("3,1,1") == static_tree((3, 1, 1))
    assert parse_tree(" dynamic:4,3,9") == DynamicTree(4, 3, 9) == DynamicTree(4, 3, 9, sampled=None)
    assert parse_tree("dynamic-topk:4,3,9") == DynamicTree(4, 3, 9, sampled=False)
    assert parse_tree("dynamic-sampled:4,3,9") == DynamicTree(4, 3, 9, sampled=True)
    with pytest.raises(ValueError, match="dynamic:DEPTH,TOP_K,NUM_NODES"):
        parse_tree("dynamic:4,3")
    with pytest.raises(ValueError, match="dynamic:DEPTH,TOP_K,NUM_NODES"):
        parse_tree("dynamic-topk:4,3,9,1")
    with pytest.raises(TypeError, match="sampled must be True, False or None"):
        dynamic_tree(2, 2, 3, sampled="no")
    with pytest.raises(ValueError, match="exceeds the 6 candidates"):
        parse_tree("dynamic:2,2,7")
