"""decode(tree=...): token-tree speculation in the jitted loop (issue 15, part 3).

Greedy tree decoding must return the target's greedy output token for token;
tree sampling must follow the target distribution exactly (the joint law of
the first two tokens against exact enumeration, as for chains); a tree must
accept more per cycle than a chain of its depth; and a second call compiles
nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import specjax
from specjax.rules import additive, mars, pad, speculative_sampling, top_m
from specjax.testing import Bigram
from specjax.trees import static_tree
from test_decode import NO_BUCKETS, VOCAB, count_compilations, exact_two_token_distribution, goodness_of_fit, random_prompts


PROMPTS = random_prompts(21, 50, 96, 14)
# The greedy tests below decode all of PROMPTS on the tree (2, 2, 1) with 24 new tokens (EOS ids
# are traced), so that their lossless reference is one compiled program.


@pytest.mark.parametrize("branching", [(2, 2, 1), (3, 1)])
def test_greedy_tree_decoding_is_target_greedy(llama_pair, branching):
    ref = specjax.generate(llama_pair, PROMPTS, max_new_tokens=24, temperature=0.0, eos_token_id=5)
    out = specjax.decode(llama_pair, PROMPTS, tree=static_tree(branching), max_new_tokens=24, temperature=0.0,
                         eos_token_id=5)
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert int(np.sum(out.stats.accepted)) > 0  # the drafts were used, not only bonus tokens


def test_a_tree_accepts_more_than_a_chain_of_its_depth(llama_pair):
    kw = dict(max_new_tokens=24, temperature=0.0, eos_token_id=())
    chain = specjax.decode(llama_pair, PROMPTS, num_draft=3, **kw)
    tree = specjax.decode(llama_pair, PROMPTS, tree=static_tree((3, 2, 1)), **kw)
    assert tree.stats.tau > chain.stats.tau
    np.testing.assert_array_equal(np.asarray(tree.tokens), np.asarray(chain.tokens))


def tree_two_token_counts(pair, tree, temperature, top_k=None, top_p=None, samples=20000, seed=0):
    prompts = np.array([[3, 0], [5, 3]] * (samples // 2), np.int32)
    lengths = np.array([1, 2] * (samples // 2), np.int32)
    out = specjax.decode(pair, prompts, prompt_lengths=lengths, tree=tree, max_new_tokens=2,
                         temperature=temperature, top_k=top_k, top_p=top_p, key=jax.random.key(seed),
                         buckets=NO_BUCKETS)
    toks = np.asarray(out.tokens)
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
    return counts


@pytest.mark.parametrize("branching, temperature, top_k, top_p", [
    ((2, 2), 1.0, None, None),
    ((3, 1), 1.0, None, None),
    ((2, 1), 0.7, None, 0.8),
    ((4,), 1.3, 5, None),
])
def test_tree_sampling_is_lossless(bigram_pair, branching, temperature, top_k, top_p):
    table = np.asarray(bigram_pair.target.params["table"])
    expected = exact_two_token_distribution(table, 3, temperature, top_k, top_p)
    counts = tree_two_token_counts(bigram_pair, static_tree(branching), temperature, top_k, top_p)
    pvalue, tv = goodness_of_fit(counts, expected)
    assert pvalue > 1e-3, f"chi-square p={pvalue:.2e}, TV={tv:.4f}"
    assert tv < 0.03


def test_second_call_compiles_nothing(llama_pair):
    kw = dict(tree=static_tree((2, 2)), max_new_tokens=16, temperature=1.0)
    specjax.decode(llama_pair, PROMPTS[:4], key=jax.random.key(0), **kw)
    with count_compilations() as compiled:
        out = specjax.decode(llama_pair, PROMPTS[4:8], key=jax.random.key(1), **kw)
        jax.block_until_ready(out.tokens)
    assert compiled["n"] == 0


def test_streaming_with_a_tree(llama_pair):
    chunks = [[] for _ in range(3)]

    def on_tokens(tokens, counts):
        for b, c in enumerate(counts):
            chunks[b] += tokens[b, :c].tolist()

    out = specjax.decode(llama_pair, PROMPTS[:3], tree=static_tree((2, 2)), max_new_tokens=12, temperature=0.0,
                         on_tokens=on_tokens)
    assert chunks == out.to_lists()


@dataclasses.dataclass(frozen=True)
class ChainOnlyBigram(Bigram):
    supports_trees = False


def test_clear_errors(llama_pair, bigram_pair):
    tree = static_tree((2, 2))
    with pytest.raises(ValueError, match="num_draft=4 but the tree's depth is 2"):
        specjax.decode(llama_pair, PROMPTS[:2], tree=tree, num_draft=4, temperature=0.0)
    with pytest.raises(TypeError, match="TokenTree"):
        specjax.decode(llama_pair, PROMPTS[:2], tree=(2, 2), temperature=0.0)
    table = bigram_pair.target.params
    chain_only = specjax.pair(specjax.Model(table, ChainOnlyBigram(VOCAB)), bigram_pair.draft)
    with pytest.raises(ValueError, match="does not implement"):
        specjax.decode(chain_only, [[1, 2]], tree=tree, temperature=0.0)
    # The chain protocol keeps working for that model.
    assert specjax.decode(chain_only, [[1, 2]], num_draft=2, max_new_tokens=4, temperature=0.0).tokens.shape == (1, 4)
    # A node's children are distinct tokens: no more of them than the vocabulary has.
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match=f"a node has {VOCAB + 1} children, more than the vocabulary's {VOCAB}"):
            specjax.decode(bigram_pair, [[1, 2]], tree=static_tree((VOCAB + 1,)), temperature=temperature,
                           key=jax.random.key(0))
    # Hand-built trees: parents breadth-first, root first, a tuple of ints (a jit static).
    with pytest.raises(ValueError, match=r"node\(s\) \[1\] do not"):
        specjax.decode(bigram_pair, [[1, 2]], tree=specjax.trees.TokenTree((-1, 5)), temperature=0.0)
    with pytest.raises(ValueError, match=r"node\(s\) \[1\] do not"):
        specjax.decode(bigram_pair, [[1, 2]], tree=specjax.trees.TokenTree((-1, -1, 0)), temperature=0.0)
    with pytest.raises(TypeError, match="tuple of ints"):
        specjax.decode(bigram_pair, [[1, 2]], tree=specjax.trees.TokenTree([-1, 0, 0]), temperature=0.0)


@pytest.mark.parametrize("limit", [mars(1.0), top_m(1), additive(0.0)], ids=lambda r: str(r.spec))
def test_relaxed_rules_on_trees_collapse_to_lossless_at_their_limit(llama_pair, limit):
    kw = dict(tree=static_tree((2, 2, 1)), max_new_tokens=24, temperature=0.0, eos_token_id=())
    ref = specjax.decode(llama_pair, PROMPTS, rule=speculative_sampling(), **kw)
    out = specjax.decode(llama_pair, PROMPTS, rule=limit, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert out.stats.accepted_by_path_total["relaxed"] == 0


def test_mars_on_a_tree_relaxes_per_node(llama_pair):
    """MARS's greedy test runs at every node: it accepts at least what the
    lossless tree accepts, labels the extra acceptances RELAXED, and its output
    differs from target greedy only where it relaxed."""
    kw = dict(tree=static_tree((2, 2, 1)), max_new_tokens=24, temperature=0.0, eos_token_id=())
    lossless = specjax.decode(llama_pair, PROMPTS, **kw)
    relaxed = specjax.decode(llama_pair, PROMPTS, rule=mars(0.5), **kw)
    assert relaxed.stats.tau > lossless.stats.tau
    assert relaxed.stats.accepted_by_path_total["relaxed"] > 0


def test_pad_on_a_tree_reads_each_node_hidden_state(llama_pair):
    """PAD with a head that calls every token a pivot is the lossless tree."""
    from test_pad import constant_head

    kw = dict(tree=static_tree((2, 2, 1)), max_new_tokens=24, temperature=0.0, eos_token_id=())
    ref = specjax.decode(llama_pair, PROMPTS, **kw)
    out = specjax.decode(llama_pair, PROMPTS, rule=pad(constant_head(10.0)), **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    loose = specjax.decode(llama_pair, PROMPTS, rule=pad(constant_head(-10.0), min_prob=0.0), **kw)
    assert loose.stats.accepted_by_path_total["pardon"] > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_target_logits_off_the_accepted_path_stop_nothing(temperature):
    """As on a chain, only the nodes the walk entered count: the target's NaN row
    after token 5 (which it never produces itself) stops the one sequence whose
    prompt ends in 5, not those whose trees merely hold 5 as a rejected sibling."""
    from specjax.testing import bigram_model, random_table
    from test_decode import nan_table

    target, draft = bigram_model(nan_table(5)), bigram_model(random_table(1, VOCAB))
    prompts = [[t if t != 5 else 4 for t in p] for p in random_prompts(8, 8, VOCAB, 4)]
    prompts[3] = [2, 5]
    tree = static_tree((3, 2))
    with pytest.raises(FloatingPointError, match=r"in sequence 3 \(target model\); ") as info:
        specjax.decode(specjax.pair(target, draft), prompts, tree=tree, temperature=temperature, max_new_tokens=12,
                       eos_token_id=(), key=jax.random.key(0))
    lengths = np.asarray(info.value.output.lengths)
    assert lengths[3] == 0 and np.all(np.delete(lengths, 3) == 12), lengths
