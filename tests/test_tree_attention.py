"""Token trees in the LM protocol (issue 15, part 1): tree attention and keeping a path.

A tree verification forward must give, at every node, the logits of a chain
forward over that node's root path; ``KVCache.keep_path`` must leave the cache
exactly as if the accepted path had been run as a chain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import Decoder
from specjax._src.models.decoder import tree_ancestors
from specjax.testing import llama_config

TREES = {
    "chain": [-1, 0, 1, 2],
    "star": [-1, -1, -1],  # three alternatives for the next token
    "binary": [-1, 0, 0, 1, 1, 2, 2],
    "medusa-like": [-1, -1, 0, 0, 1, 2, 3, 5],
}


@pytest.fixture(scope="module")
def model():
    decoder = Decoder(llama_config(vocab_size=64, max_position_embeddings=64))
    params = decoder.init(jax.random.key(0))
    return decoder, params


@pytest.fixture(scope="module")
def sliding_model():
    decoder = Decoder(llama_config(model_type="mistral", vocab_size=64, max_position_embeddings=64,
                                   sliding_window=5))
    return decoder, decoder.init(jax.random.key(1))


# Jitted: op by op, each forward dispatched (and compiled) every primitive for its own path width.
apply = jax.jit(Decoder.apply, static_argnums=0, static_argnames=("hidden_layers", "tree_offset"))


def root_path(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def prefilled(decoder, params, prompts, lengths, cache_len=48):
    """A cache holding each prompt's first ``lengths[b]`` tokens, with stale
    entries beyond them (prefilled wider, then rolled back)."""
    cache = decoder.init_cache(len(prompts), cache_len)
    cache = apply(decoder, params, jnp.asarray(prompts), cache).cache
    return cache.rollback(jnp.asarray(lengths))


def test_ancestors_and_depths():
    anc = np.asarray(tree_ancestors(jnp.asarray(TREES["binary"])))
    assert anc[5].tolist() == [True, False, True, False, False, True, False]
    np.testing.assert_array_equal(anc.sum(-1) - 1, [0, 1, 1, 2, 2, 2, 2])
    chain = np.asarray(tree_ancestors(jnp.asarray(TREES["chain"])))
    np.testing.assert_array_equal(chain, np.tril(np.ones((4, 4), bool)))  # a chain is the causal mask


@pytest.mark.parametrize("name", list(TREES))
def test_tree_forward_matches_chain_per_root_path(model, name):
    decoder, params = model
    parents = TREES[name]
    rng = np.random.default_rng(len(name))
    prompts = rng.integers(0, 64, size=(3, 10))
    lengths = [10, 4, 7]  # ragged, each with stale entries past its length
    cache = prefilled(decoder, params, prompts, lengths)
    nodes = rng.integers(0, 64, size=(3, len(parents)))
    out = apply(decoder, params, jnp.asarray(nodes), cache, tree_parents=jnp.asarray(parents), hidden_layers=(-1,))
    for b in range(3):
        for t in range(len(parents)):
            path = root_path(parents, t)
            chain = apply(decoder, params, jnp.asarray(nodes[b : b + 1, path]),
                          jax.tree_util.tree_map(lambda x: x[b : b + 1], cache))
            np.testing.assert_allclose(np.asarray(out.logits[b, t]), np.asarray(chain.logits[0, -1]),
                                       rtol=2e-5, atol=2e-5, err_msg=f"{name} sequence {b} node {t}")
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), np.asarray(lengths) + len(parents))


def test_per_sequence_trees(model):
    """Each sequence may carry its own tree shape ([B, T] parents)."""
    decoder, params = model
    parents = np.array([TREES["binary"], [-1, 0, 1, 2, 3, 4, 5]])
    prompts = np.random.default_rng(5).integers(0, 64, size=(2, 6))
    cache = prefilled(decoder, params, prompts, [6, 3])
    nodes = np.random.default_rng(6).integers(0, 64, size=(2, 7))
    out = apply(decoder, params, jnp.asarray(nodes), cache, tree_parents=jnp.asarray(parents))
    for b in range(2):
        path = root_path(parents[b].tolist(), 6)
        chain = apply(decoder, params, jnp.asarray(nodes[b : b + 1, path]),
                      jax.tree_util.tree_map(lambda x: x[b : b + 1], cache))
        np.testing.assert_allclose(np.asarray(out.logits[b, 6]), np.asarray(chain.logits[0, -1]), rtol=2e-5, atol=2e-5)


def test_sliding_window_trees(sliding_model):
    decoder, params = sliding_model
    parents = TREES["medusa-like"]
    prompts = np.random.default_rng(7).integers(0, 64, size=(2, 12))
    cache = prefilled(decoder, params, prompts, [12, 8])
    nodes = np.random.default_rng(8).integers(0, 64, size=(2, len(parents)))
    out = apply(decoder, params, jnp.asarray(nodes), cache, tree_parents=jnp.asarray(parents))
    for b in range(2):
        for t in (4, 7):
            path = root_path(parents, t)
            chain = apply(decoder, params, jnp.asarray(nodes[b : b + 1, path]),
                          jax.tree_util.tree_map(lambda x: x[b : b + 1], cache))
            np.testing.assert_allclose(np.asarray(out.logits[b, t]), np.asarray(chain.logits[0, -1]),
                                       rtol=2e-5, atol=2e-5)


def test_keep_path_equals_running_the_path_as_a_chain(model):
    """After a tree forward, keeping one path leaves a cache on which the next
    forward gives what it gives after running that path as a chain."""
    decoder, params = model
    parents = TREES["binary"]
    prompts = np.random.default_rng(9).integers(0, 64, size=(2, 8))
    lengths = np.array([8, 5])
    cache = prefilled(decoder, params, prompts, lengths)
    nodes = np.random.default_rng(10).integers(0, 64, size=(2, len(parents)))
    tree = apply(decoder, params, jnp.asarray(nodes), cache, tree_parents=jnp.asarray(parents)).cache
    accepted = [root_path(parents, 6), root_path(parents, 3)[:2]]  # [0, 2, 6] and [0, 1]
    path = np.zeros((2, 3), np.int32)
    for b, p in enumerate(accepted):
        path[b, : len(p)] = p
    kept = tree.keep_path(jnp.asarray(lengths), jnp.asarray(path), jnp.asarray([len(p) for p in accepted]))
    np.testing.assert_array_equal(np.asarray(kept.lengths), lengths + [3, 2])
    follow = jnp.asarray([[11, 12], [13, 14]])
    after_tree = apply(decoder, params, follow, kept)
    for b, p in enumerate(accepted):
        one = jax.tree_util.tree_map(lambda x: x[b : b + 1], cache)
        chain_cache = apply(decoder, params, jnp.asarray(nodes[b : b + 1, p]), one).cache
        after_chain = apply(decoder, params, follow[b : b + 1], chain_cache)
        np.testing.assert_allclose(np.asarray(after_tree.logits[b]), np.asarray(after_chain.logits[0]),
                                   rtol=2e-5, atol=2e-5)


def test_bad_tree_shape_is_refused(model):
    decoder, params = model
    cache = decoder.init_cache(2, 16)
    with pytest.raises(ValueError, match="tree_parents must be"):
        decoder.apply(params, jnp.zeros((2, 3), jnp.int32), cache, tree_parents=jnp.asarray([-1, 0]))
    with pytest.raises(ValueError, match="tree_offset needs a cache"):
        decoder.apply(params, jnp.zeros((2, 3), jnp.int32), tree_parents=jnp.asarray([-1, 0, 0, 1]), tree_offset=1)


def test_tree_forward_without_cache(model):
    """Training-style forward (no cache): the tree's first node is position 0."""
    decoder, params = model
    parents = TREES["star"]
    nodes = jnp.asarray([[5, 6, 7]])
    out = apply(decoder, params, nodes, tree_parents=jnp.asarray(parents))
    for t in range(3):
        alone = apply(decoder, params, nodes[:, t : t + 1])
        np.testing.assert_allclose(np.asarray(out.logits[0, t]), np.asarray(alone.logits[0, 0]), rtol=2e-5, atol=2e-5)


def test_a_tree_fed_level_by_level_equals_the_whole_tree(model):
    """How a draft model grows a tree: each breadth-first level is one forward
    (``tree_offset``) that attends to earlier levels through the ancestor
    relation; logits and cache equal one forward over the whole tree."""
    decoder, params = model
    parents = TREES["medusa-like"]  # levels: [0, 1], [2, 3, 4], [5, 6], [7]
    levels = [(0, 2), (2, 5), (5, 7), (7, 8)]
    prompts = np.random.default_rng(11).integers(0, 64, size=(2, 9))
    cache = prefilled(decoder, params, prompts, [9, 6])
    nodes = jnp.asarray(np.random.default_rng(12).integers(0, 64, size=(2, len(parents))))
    whole = apply(decoder, params, nodes, cache, tree_parents=jnp.asarray(parents))
    grown = cache
    for lo, hi in levels:
        out = apply(decoder, params, nodes[:, lo:hi], grown, tree_parents=jnp.asarray(parents), tree_offset=lo)
        np.testing.assert_allclose(np.asarray(out.logits), np.asarray(whole.logits[:, lo:hi]), rtol=2e-5, atol=2e-5)
        grown = out.cache
    np.testing.assert_array_equal(np.asarray(grown.lengths), np.asarray(whole.cache.lengths))


@pytest.mark.parametrize("name", list(TREES))
def test_host_and_traced_ancestors_agree(name):
    """A numpy tree shape is folded on the host; a traced one is computed in the program."""
    parents = np.asarray(TREES[name], np.int32)
    host = tree_ancestors(parents)
    assert isinstance(host, np.ndarray)
    np.testing.assert_array_equal(host, np.asarray(tree_ancestors(jnp.asarray(parents))))
    batched = np.stack([parents, np.arange(len(parents)) - 1])  # per-sequence shapes: this tree and a chain
    np.testing.assert_array_equal(tree_ancestors(batched), np.asarray(tree_ancestors(jnp.asarray(batched))))
