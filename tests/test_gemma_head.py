"""A feature head for a Gemma 3 target: its blocks are Gemma blocks of the target's kinds.

A head copies its target's last blocks (``init_from_target``), so it must keep
those blocks' attention kinds (a Gemma 3 target interleaves sliding and full
layers with their own rope bases). Greedy decoding with it must equal the
target's greedy output and lossless sampling must follow the target's law.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax import Decoder, Model
from specjax._src.models import feature_head_build as fhb
from specjax.rules import speculative_sampling
from specjax.testing import llama_config
from specjax.trees import dynamic_tree
from test_decode import goodness_of_fit, random_prompts
from test_feature_head import _exact_two_tokens, _sampled_two_tokens

LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention")


def gemma3_target(vocab: int = 96, scale: float = 30.0) -> Model:
    """A random three-layer Gemma 3 target (sliding, sliding, full; rope bases 10 and 1000),
    its tied table scaled by ``scale`` for peaked laws without greedy near-ties."""
    cfg = llama_config(model_type="gemma3_text", vocab_size=vocab, num_layers=3, head_dim=16, activation="gelu_pytorch_tanh",
                       tie_word_embeddings=True, qk_norm=True, sliding_window=4, layer_types=LAYER_TYPES,
                       rope_theta=1000.0, rope_local_theta=10.0, query_pre_attn_scalar=16)
    params = Decoder(cfg).init(jax.random.key(0))
    params["embed"] = {"embedding": params["embed"]["embedding"] * scale}
    return Model(params, Decoder(cfg))


@pytest.fixture(scope="module")
def target():
    return gemma3_target()


@pytest.fixture(scope="module")
def head_pair(target):
    return specjax.pair(target, fhb.init_from_target(target, jax.random.key(1), np.arange(80)))


def test_a_heads_blocks_keep_the_kinds_of_the_target_blocks_they_copy(target):
    head = fhb.init_from_target(target, jax.random.key(1), np.arange(80))
    assert head.module.config.layer_types == ("full_attention",)
    two = fhb.init_from_target(target, jax.random.key(1), np.arange(80), num_layers=2)
    assert two.module.config.layer_types == LAYER_TYPES[1:]
    assert two.module.config.layer_window(0) == 4 and two.module.config.layer_window(1) is None
    grown = fhb.with_num_layers(head, 3)
    assert grown.module.config.layer_types == ("full_attention",) * 3
    # grown blocks start as the identity: the same drafts
    tokens = np.random.default_rng(3).integers(0, 96, (2, 9))
    feats = np.asarray(jax.random.normal(jax.random.key(2), tokens.shape + (32,)))
    a = head.module.apply(head.params, tokens, features=feats).logits
    b = grown.module.apply(grown.params, tokens, features=feats).logits
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("drafts", [dict(num_draft=3), dict(tree=dynamic_tree(3, 2, 4))])
def test_greedy_with_a_head_on_a_gemma3_target_is_target_greedy(head_pair, drafts):
    prompts = random_prompts(21, 8, 96, 14)
    ref = specjax.generate(head_pair.target, prompts, max_new_tokens=20, temperature=0.0, eos_token_id=5)
    out = specjax.decode(head_pair, prompts, max_new_tokens=20, temperature=0.0, eos_token_id=5, **drafts)
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert int(np.sum(out.stats.accepted)) > 0  # the head's drafts were used


# Slow-only (about 17 s): the head's sampling law is checked by default on a Llama target
# (test_feature_head.py::test_lossless_sampling_with_a_head_follows_the_target), and a head on a
# Gemma 3 target drafts by default in test_greedy_with_a_head_on_a_gemma3_target_is_target_greedy.
@pytest.mark.slow
def test_lossless_sampling_with_a_head_on_a_gemma3_target_follows_the_target():
    vocab, prompt, samples = 16, [5, 3], 20000
    target = gemma3_target(vocab, scale=3.0)  # flatter laws: many cells are tested
    pair = specjax.pair(target, fhb.init_from_target(target, jax.random.key(2), np.arange(12)))
    counts, stats = _sampled_two_tokens(pair, prompt, vocab, samples, num_draft=3, key=jax.random.key(7),
                                        rule=speculative_sampling())
    exact = _exact_two_tokens(target, prompt, vocab)
    pvalue, tv = goodness_of_fit(counts, exact)
    assert pvalue > 1e-3 and tv < 0.05, f"chi-square p={pvalue:.2e}, TV={tv:.4f}"
    assert int(np.sum(stats.accepted)) > samples // 10  # the head's drafts took part
    # the same statistic rejects another context's law: it can fail
    pvalue, _ = goodness_of_fit(counts, _exact_two_tokens(target, [7], vocab))
    assert pvalue < 1e-6


@pytest.mark.slow
def test_the_gemma3_pairs_built_head_decodes_the_targets_greedy_text():
    """Where the Gemma 3 package is installed and ``python -m training.gemma3_head`` has built the
    head: lossless greedy decoding with it returns the target's own greedy tokens, and the head's
    drafts are accepted."""
    from specjax._src.models import registry

    for name in (registry.GEMMA3_TARGET, registry.GEMMA3_EAGLE):
        if not registry.is_available(name):
            pytest.skip(f"{name} is not on this machine: {registry.location(name)}")
    target = specjax.load(registry.GEMMA3_TARGET)
    pair = specjax.pair(target, specjax.load(registry.GEMMA3_EAGLE, dtype="float32"))
    prompts = [specjax.encode_chat(target, q) for q in ("Name three rivers in Europe.", "What is 7 times 8?")]
    eos = tuple(target.module.config.eos_token_ids)
    ref = specjax.generate(target, prompts, max_new_tokens=32, temperature=0.0, eos_token_id=eos)
    out = specjax.decode(pair, prompts, num_draft=3, max_new_tokens=32, temperature=0.0, eos_token_id=eos)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert out.stats.tau > 1.5
