"""Target-feature (EAGLE-style) draft heads in the decode loop (issue 16).

The head must draft exactly what a cache-free forward over the target's true
features would draft (the engine's feature correction after ragged
acceptance), greedy decoding with it must equal target greedy output, and
lossless sampling with it must follow the target's law.
"""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import jax.numpy as jnp
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import specjax
from specjax._src.engine.chain import draft_chain
from specjax._src.proposals.drafting import fixed
from specjax._src.models import feature_head as fh
from specjax._src.models import feature_head_build as fhb
from specjax.engine import CHAIN, CycleInputs, LoopConfig, init_state
from specjax.rules import Verdict, from_functions, mars, speculative_sampling
from specjax.testing import llama_config, peaked_target_and_draft
from specjax.trees import dynamic_tree, static_tree
from test_decode import NO_BUCKETS, count_compilations, goodness_of_fit, random_prompts


@pytest.fixture(scope="module")
def target():
    return peaked_target_and_draft(llama_config())[0]


@pytest.fixture(scope="module")
def head(target):
    return fhb.init_from_target(target, jax.random.key(1), np.arange(80)[::-1])


@pytest.fixture(scope="module")
def head_pair(target, head):
    return specjax.pair(target, head)


def _mixed(head, layers=(0, -1)):
    """``head`` grown to read several target blocks, its ``reduce`` perturbed so
    that every block counts (grown as it is, it would read the last only)."""
    grown = fhb.with_feature_layers(head, layers)
    kernel = grown.params["reduce"]["kernel"]
    noise = 0.3 * jax.random.normal(jax.random.key(5), kernel.shape, kernel.dtype)
    return grown.replace(params={**grown.params, "reduce": {"kernel": kernel + noise}})


@pytest.fixture(scope="module")
def mixed_pair(target, head):
    return specjax.pair(target, _mixed(head))


def test_head_forward_in_blocks_equals_one_forward(head):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 96, (2, 9)), jnp.int32)
    feats = jnp.asarray(rng.normal(size=(2, 9, 32)), jnp.float32)
    full = head.module.apply(head.params, tokens, features=feats)
    cache = head.module.init_cache(2, 16)
    a = head.module.apply(head.params, tokens[:, :4], cache, features=feats[:, :4])
    b = head.module.apply(head.params, tokens[:, 4:], a.cache, features=feats[:, 4:])
    np.testing.assert_allclose(np.concatenate([a.logits, b.logits], 1), full.logits, atol=1e-5)
    np.testing.assert_allclose(np.concatenate([a.hidden[0], b.hidden[0]], 1), full.hidden[0], atol=1e-5)
    # the reduced head: exactly its 80 tokens are finite
    assert int(np.isfinite(np.asarray(full.logits[0, 0])).sum()) == 80


def test_save_load_roundtrip_needs_the_target(tmp_path, target, head):
    path = str(tmp_path / "head")
    fh.save_head(head, path)
    with pytest.raises(ValueError, match="Refusing"):
        fh.save_head(head, path)  # nothing overwritten without being asked
    loaded = specjax.load(path)
    assert "embed" not in loaded.params  # the target's table is not shipped
    tokens, feats = jnp.ones((1, 3), jnp.int32), jnp.ones((1, 3, 32))
    with pytest.raises(ValueError, match="specjax.pair"):
        loaded.module.apply(loaded.params, tokens, features=feats)
    paired = specjax.pair(target, loaded).draft
    np.testing.assert_array_equal(
        np.asarray(paired.module.apply(paired.params, tokens, features=feats).logits),
        np.asarray(head.module.apply(head.params, tokens, features=feats).logits),
    )


def test_pair_refuses_a_head_of_another_width(head):
    other = specjax.Decoder(llama_config(hidden_size=48, num_heads=6, num_kv_heads=2))
    with pytest.raises(ValueError, match="hidden size"):
        specjax.pair(specjax.Model(other.init(jax.random.key(0)), other), head)


@functools.partial(jax.jit, static_argnums=(0, 1, 6))
def _reference_drafts(target_module, head_module, target_params, head_params, tokens, n, k):
    """The head's K greedy draft logits for the committed prefix ``tokens[:n]``
    (``tokens [W]`` padded), from cache-free forwards: the target's true
    features at positions 0 .. n-2, then the head's own predicted features.
    Causal attention makes the padding past each read position inert."""
    x = tokens[None]
    hidden = target_module.apply(target_params, x, hidden_layers=head_module.feature_layers).hidden
    feats = head_module.target_features(head_params, jnp.concatenate(hidden, axis=-1))  # f_i at position i
    inputs_tok = jnp.roll(x, -1, axis=1)  # position i reads x_{i+1}
    out = []
    for s in range(k):
        pos = n - 2 + s
        h = head_module.apply(head_params, inputs_tok, features=feats)
        logits, f_hat = h.logits[0, pos], h.hidden[0][0, pos]
        out.append(logits)
        inputs_tok = inputs_tok.at[0, pos + 1].set(jnp.argmax(logits).astype(jnp.int32))
        feats = feats.at[0, pos + 1].set(f_hat)
    return jnp.stack(out)


@pytest.mark.parametrize("blocks", ["last", "mixed"])
def test_engine_drafts_equal_cache_free_drafts_after_ragged_acceptance(target, head_pair, mixed_pair, blocks):
    """Cycle after cycle (acceptance ragged across the batch: a rule accepting
    by the drafted token's parity), each sequence's K draft logits equal the
    head's cache-free forward over its committed prefix with the target's true
    features: the head's cache holds true-feature entries only, and the
    last cycle's own-feature entries were rewritten. ``mixed``: a head that
    reads two target blocks through ``reduce``."""
    head_pair = head_pair if blocks == "last" else mixed_pair

    def verify(inputs, state, *, greedy):
        del state, greedy
        accept = inputs.draft_tokens % 3 != 0
        correction = jax.nn.one_hot(jnp.argmax(inputs.target_logits[:-1], -1), inputs.target_logits.shape[-1])
        return Verdict(accept=accept, path=jnp.where(accept, 1, 0).astype(jnp.int32), correction=correction)

    rule, policy, k = from_functions(verify, name="parity"), fixed(), 3
    prompts = random_prompts(3, 4, 96, 9, min_len=2)
    width = max(map(len, prompts))
    arr = np.zeros((4, width), np.int32)
    for i, p in enumerate(prompts):
        arr[i, : len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    cfg = LoopConfig(diagnostics=None, num_draft=k, max_new_tokens=24, cache_length=64, greedy=True, top_k=None,
                     use_top_p=False)
    max_new = jnp.full((4,), 24, jnp.int32)
    state = init_state(cfg, head_pair, rule, policy, jnp.asarray(arr), lengths, max_new)
    draft = jax.jit(lambda pair, s: draft_chain(cfg, pair, policy, s, None, 1.0, 1.0)[0].logits)
    inputs = CycleInputs(lengths, max_new, jnp.asarray([-1]), jax.random.split(jax.random.key(0), 4), 1.0, 1.0)
    cycle = jax.jit(lambda pair, s: CHAIN.run(cfg, pair, rule, policy, inputs, s)[0])
    hd = head_pair.draft
    accepted = set()
    for _ in range(5):
        logits = draft(head_pair, state)
        for b in range(4):
            ref = _reference_drafts(target.module, hd.module, target.params, hd.params, state.tokens[b],
                                    state.num_committed[b], k)
            np.testing.assert_allclose(np.asarray(logits[b]), np.asarray(ref), rtol=1e-4, atol=1e-4)
        before = np.asarray(state.num_committed)
        state = cycle(head_pair, state)
        accepted |= set((np.asarray(state.num_committed) - before).tolist())
    assert len(accepted) >= 2, f"acceptance was not ragged: {accepted}"


# The greedy tests of this file decode GREEDY_PROMPTS with the same settings, so that they share
# compiled programs (a chain of K = 3 and the tree (3, 2, 1) each compile once here).
GREEDY_PROMPTS = random_prompts(21, 50, 96, 14)


def test_greedy_with_a_head_is_target_greedy(head_pair):
    prompts = GREEDY_PROMPTS
    ref = specjax.generate(head_pair.target, prompts, max_new_tokens=24, temperature=0.0, eos_token_id=5)
    for k in (1, 3):
        out = specjax.decode(head_pair, prompts, num_draft=k, max_new_tokens=24, temperature=0.0, eos_token_id=5)
        np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
        assert int(np.sum(out.stats.accepted)) > 0  # the head's drafts were used


def test_relaxed_rule_with_a_head_collapses_to_lossless(head_pair):
    prompts = GREEDY_PROMPTS
    kw = dict(num_draft=3, max_new_tokens=24, temperature=0.0, eos_token_id=5)
    lossless = specjax.decode(head_pair, prompts, **kw)
    limit = specjax.decode(head_pair, prompts, rule=mars(theta=1.0), **kw)
    np.testing.assert_array_equal(np.asarray(limit.tokens), np.asarray(lossless.tokens))


def _exact_two_tokens(target, prompt, vocab):
    """The target's joint law of the next two tokens after ``prompt``, from one
    forward over ``prompt + [x]`` for every ``x`` (row ``len(prompt) - 1``
    gives the first token's law, the last row the second's)."""
    seqs = jnp.asarray([prompt + [x] for x in range(vocab)], jnp.int32)
    logits = target.module.apply(target.params, seqs).logits
    p1 = np.asarray(jax.nn.softmax(logits[0, len(prompt) - 1]), np.float64)
    p2 = np.asarray(jax.nn.softmax(logits[:, -1], -1), np.float64)
    joint = p1[:, None] * p2
    return joint / joint.sum()


def _sampled_two_tokens(pair, prompt, vocab, samples, **decode_kw):
    """``(counts [V, V] of the first two tokens, stats)`` over ``samples`` decodes of ``prompt`` at T=1."""
    out = specjax.decode(pair, [prompt] * samples, max_new_tokens=2, temperature=1.0, buckets=NO_BUCKETS, **decode_kw)
    toks = np.asarray(out.tokens)
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
    return counts, out.stats


def _small_head_pair(vocab):
    target = peaked_target_and_draft(llama_config(vocab_size=vocab))[0]
    # x0.1 on the target's head: flatter laws, so many cells are tested
    target = target.replace(params={**target.params, "lm_head": target.params["lm_head"] * 0.1})
    return specjax.pair(target, fhb.init_from_target(target, jax.random.key(2), np.arange(12)))


# The two-token prompt in the default run; the one-token one runs with -m slow.
@pytest.mark.parametrize("prompt", [[5, 3], pytest.param([3], marks=pytest.mark.slow)])
def test_lossless_sampling_with_a_head_follows_the_target(prompt):
    vocab = 16
    pair = _small_head_pair(vocab)
    small_target = pair.target
    samples = 40000
    counts, stats = _sampled_two_tokens(pair, prompt, vocab, samples, num_draft=3, key=jax.random.key(7),
                                        rule=speculative_sampling())
    pvalue, tv = goodness_of_fit(counts, _exact_two_tokens(small_target, prompt, vocab))
    assert pvalue > 1e-3 and tv < 0.04, f"chi-square p={pvalue:.2e}, TV={tv:.4f}"
    assert int(np.sum(stats.accepted)) > samples // 10  # the head's drafts took part
    # The same statistic rejects the law of another context: it can fail.
    other = [7] if prompt != [7] else [8]
    pvalue, tv = goodness_of_fit(counts, _exact_two_tokens(small_target, other, vocab))
    assert pvalue < 1e-6 and tv > 0.04


def test_a_second_call_compiles_nothing(head_pair):
    kw = dict(num_draft=3, max_new_tokens=24, temperature=0.0, eos_token_id=5)
    specjax.decode(head_pair, GREEDY_PROMPTS, **kw)
    with count_compilations() as counter:
        specjax.decode(head_pair, random_prompts(2, 50, 96, 14), **kw)
    assert counter["n"] == 0


@pytest.mark.parametrize("branching", [(3, 2, 1), (3, 1)])
def test_greedy_tree_decoding_with_a_head_is_target_greedy(head_pair, branching):
    prompts = GREEDY_PROMPTS
    ref = specjax.generate(head_pair.target, prompts, max_new_tokens=24, temperature=0.0, eos_token_id=5)
    out = specjax.decode(head_pair, prompts, tree=static_tree(branching), max_new_tokens=24, temperature=0.0,
                         eos_token_id=5)
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert int(np.sum(out.stats.accepted)) > 0


def test_a_tree_of_head_drafts_accepts_more_than_a_chain(head_pair):
    prompts = GREEDY_PROMPTS  # EOS ids are traced: eos_token_id=() runs the programs the greedy tests compiled
    kw = dict(max_new_tokens=24, temperature=0.0, eos_token_id=())
    chain = specjax.decode(head_pair, prompts, num_draft=3, **kw)
    tree = specjax.decode(head_pair, prompts, tree=static_tree((3, 2, 1)), **kw)
    assert tree.stats.tau > chain.stats.tau


# A head on a dynamic tree keeps its law in the default run (test_dynamic_trees.py), and static
# trees with a draft model (test_tree_decode.py): this pairing of the two runs with -m slow.
@pytest.mark.slow
def test_lossless_tree_sampling_with_a_head_follows_the_target():
    vocab, prompt, samples = 16, [5, 3], 40000
    pair = _small_head_pair(vocab)
    counts, stats = _sampled_two_tokens(pair, prompt, vocab, samples, tree=static_tree((3, 2)), key=jax.random.key(8))
    pvalue, tv = goodness_of_fit(counts, _exact_two_tokens(pair.target, prompt, vocab))
    assert pvalue > 1e-3 and tv < 0.04, f"chi-square p={pvalue:.2e}, TV={tv:.4f}"
    assert int(np.sum(stats.accepted)) > samples // 10


def test_bad_head_inputs_get_clear_errors(head_pair):
    head = head_pair.draft
    with pytest.raises(ValueError, match=r"features \[B, T, 32\]"):
        head.module.apply(head.params, jnp.ones((1, 3), jnp.int32), features=jnp.ones((1, 3, 16)))


def test_growing_a_head_to_more_blocks_keeps_its_drafts(target, head, head_pair):
    """with_feature_layers: the grown head's reduce passes the old block through,
    so it drafts what the one-block head drafted, until training moves it."""
    grown = fhb.with_feature_layers(head, (0, -1))
    assert grown.module.feature_layers == (0, -1) and grown.params["reduce"]["kernel"].shape == (64, 32)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 96, (2, 9)), jnp.int32)
    hidden = target.module.apply(target.params, tokens, hidden_layers=(0, -1)).hidden
    one = head.module.apply(head.params, tokens, features=hidden[1])
    two = grown.module.apply(grown.params, tokens,
                             features=grown.module.target_features(grown.params, jnp.concatenate(hidden, -1)))
    np.testing.assert_allclose(np.asarray(two.logits), np.asarray(one.logits), rtol=1e-3, atol=1e-3)  # eps of the extra norm
    prompts = GREEDY_PROMPTS
    kw = dict(num_draft=3, max_new_tokens=24, temperature=0.0, eos_token_id=5)
    a = specjax.decode(head_pair, prompts, **kw)
    b = specjax.decode(specjax.pair(target, grown), prompts, **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.stats.accepted), np.asarray(b.stats.accepted))
    with pytest.raises(ValueError, match="cannot be grown"):
        fhb.with_feature_layers(grown, (0, 1, -1))  # already mixes blocks
    with pytest.raises(ValueError, match="cannot be grown"):
        fhb.with_feature_layers(head, (0, 1))  # its block (-1) is not among them
    with pytest.raises(ValueError, match="distinct"):
        fh.FeatureHead(head.module.config, feature_layers=(0, 0))


@pytest.mark.parametrize("tree", [None, dynamic_tree(3, 2, 5)], ids=["chain", "dynamic"])
def test_greedy_with_a_mixed_block_head_is_target_greedy(mixed_pair, tree):
    prompts = GREEDY_PROMPTS
    ref = specjax.generate(mixed_pair.target, prompts, max_new_tokens=24, temperature=0.0, eos_token_id=5)
    kw = dict(num_draft=3) if tree is None else dict(tree=tree)
    out = specjax.decode(mixed_pair, prompts, max_new_tokens=24, temperature=0.0, eos_token_id=5, **kw)
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert int(np.sum(out.stats.accepted)) > 0


# Greedy equality with a mixed-block head runs by default; its sampled law with -m slow.
@pytest.mark.slow
def test_lossless_sampling_with_a_mixed_block_head_follows_the_target():
    vocab, prompt, samples = 16, [5, 3], 40000
    pair = _small_head_pair(vocab)
    pair = specjax.pair(pair.target, _mixed(pair.draft))
    counts, stats = _sampled_two_tokens(pair, prompt, vocab, samples, num_draft=3, key=jax.random.key(9),
                                        rule=speculative_sampling())
    pvalue, tv = goodness_of_fit(counts, _exact_two_tokens(pair.target, prompt, vocab))
    assert pvalue > 1e-3 and tv < 0.04, f"chi-square p={pvalue:.2e}, TV={tv:.4f}"
    assert int(np.sum(stats.accepted)) > samples // 10


def test_a_mixed_block_head_saves_loads_and_old_configs_still_load(tmp_path, target, head):
    mixed = _mixed(head)
    path = tmp_path / "mixed"
    fh.save_head(mixed, str(path))
    loaded = specjax.pair(target, specjax.load(str(path))).draft
    assert loaded.module.feature_layers == (0, -1)
    tokens, hidden = jnp.ones((1, 3), jnp.int32), jnp.ones((1, 3, 64))
    feats = mixed.module.target_features(mixed.params, hidden)
    np.testing.assert_array_equal(np.asarray(loaded.module.target_features(loaded.params, hidden)),
                                  np.asarray(feats))
    np.testing.assert_array_equal(np.asarray(loaded.module.apply(loaded.params, tokens, features=feats).logits),
                                  np.asarray(mixed.module.apply(mixed.params, tokens, features=feats).logits))
    # a head saved before feature_layers existed names one block as "feature_layer"
    old = tmp_path / "old"
    fh.save_head(head, str(old))
    meta = json.loads((old / "config.json").read_text())
    meta[fh.CONFIG_KEY].pop("feature_layers")
    meta[fh.CONFIG_KEY]["feature_layer"] = -1
    (old / "config.json").write_text(json.dumps(meta))
    assert specjax.load(str(old)).module.feature_layers == (-1,)


def test_pair_refuses_a_head_reading_a_block_the_target_lacks(target, head):
    head = fhb.with_feature_layers(head, (0, -1))
    far = head.replace(module=fh.FeatureHead(head.module.config, feature_layers=(5, -1)))
    with pytest.raises(ValueError, match=r"block\(s\) \[5\]"):
        specjax.pair(target, far)


def test_pair_refuses_a_head_naming_one_block_twice(target, head):
    grown = fhb.with_feature_layers(head, (0, -1))
    twice = grown.replace(module=fh.FeatureHead(grown.module.config, feature_layers=(1, -1)))  # 2 blocks: 1 is -1
    with pytest.raises(ValueError, match="twice"):
        specjax.pair(target, twice)


def test_head_helpers_name_what_they_were_given(tmp_path, target, head, head_pair):
    """A target, a pair or a malformed block list gets an error saying what the helper needs."""
    calls = {"with_num_layers": lambda m: fhb.with_num_layers(m, 2),
             "with_feature_layers": lambda m: fhb.with_feature_layers(m, (0, -1)),
             "with_head_vocab": lambda m: fhb.with_head_vocab(m, np.arange(4)),
             "save_head": lambda m: fh.save_head(m, str(tmp_path / "h"))}
    for name, call in calls.items():
        with pytest.raises(TypeError, match=f"{name} needs a feature head.*got a Decoder"):
            call(target)
        with pytest.raises(TypeError, match=r"pair\.draft"):
            call(head_pair)
    for bad in (("a", -1), 3, (1.5, -1), (True, -1), (0, 0, -1), ()):
        with pytest.raises(ValueError, match="distinct int block indices"):
            fhb.with_feature_layers(head, bad)
    with pytest.raises(ValueError, match="draft head.*specjax.pair"):
        specjax.generate(head_pair.draft, [[1, 2]], max_new_tokens=2, temperature=0.0)


def test_a_saved_head_with_corrupt_ids_or_foreign_tensors_is_refused(tmp_path, head):
    """head_vocab_ids out of range, repeated or not integers, and tensors of another layout, by name;
    the untouched file loads (the control)."""
    fh.save_head(head, str(tmp_path / "ok"))
    assert specjax.load(str(tmp_path / "ok")).params["head_vocab_ids"].shape == (80,)
    tensors = {}
    with safe_open(str(tmp_path / "ok" / fh.WEIGHTS_FILE), "np") as f:
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    ids = tensors["head_vocab_ids"]
    for label, change, message in (
            ("range", {"head_vocab_ids": ids + 50}, "outside the target vocabulary"),
            ("negative", {"head_vocab_ids": ids - 60}, "outside the target vocabulary"),
            ("twice", {"head_vocab_ids": np.zeros_like(ids)}, "twice"),
            ("float", {"head_vocab_ids": ids.astype(np.float32) + 0.5}, "integer target ids"),
            ("extra", {"junk": np.zeros(3, np.float32)}, r"\['junk'\]")):
        dest = tmp_path / label
        dest.mkdir()
        (dest / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
        save_file({**tensors, **change}, str(dest / fh.WEIGHTS_FILE))
        with pytest.raises(ValueError, match=message):
            specjax.load(str(dest))
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    del config[fh.CONFIG_KEY]["config"]
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "noconfig" / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "noconfig" / fh.WEIGHTS_FILE))
    with pytest.raises(ValueError, match="must be the head's model config"):
        fh.load_feature_head(str(tmp_path / "noconfig"))


def test_narrowing_a_heads_vocabulary_keeps_its_logits_on_the_ids_it_keeps(target, head, head_pair):
    """with_head_vocab: the kept ids score as before, the dropped ones as tokens
    outside the vocabulary always did; decoding with the narrow head stays
    lossless; ids it lacks get a clear error."""
    keep = np.arange(0, 80, 2)[::-1]  # any order: stored sorted
    narrow = fhb.with_head_vocab(head, keep)
    assert narrow.module.config.head_vocab_size == 40 and narrow.params["lm_head"].shape == (32, 40)
    np.testing.assert_array_equal(np.asarray(narrow.params["head_vocab_ids"]), np.sort(keep))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 96, (2, 7)), jnp.int32)
    features = target.module.apply(target.params, tokens, hidden_layers=(-1,)).hidden[0]
    wide = np.asarray(head.module.apply(head.params, tokens, features=features).logits)
    thin = np.asarray(narrow.module.apply(narrow.params, tokens, features=features).logits)
    np.testing.assert_array_equal(thin[..., keep], wide[..., keep])
    dropped = np.setdiff1d(np.arange(80), keep)
    np.testing.assert_array_equal(thin[..., dropped], np.broadcast_to(wide[..., 90:91], thin[..., dropped].shape))
    assert np.all(thin[..., dropped] < wide[..., keep].min())
    prompts = GREEDY_PROMPTS
    kw = dict(max_new_tokens=24, temperature=0.0, eos_token_id=5)
    ref = specjax.generate(target, prompts, **kw)
    out = specjax.decode(specjax.pair(target, narrow), prompts, num_draft=3, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    with pytest.raises(ValueError, match="not in the head's vocabulary"):
        fhb.with_head_vocab(head, [1, 2, 85])
    with pytest.raises(ValueError, match="repeat"):
        fhb.with_head_vocab(head, [1, 2, 2])
    with pytest.raises(ValueError, match="non-empty"):
        fhb.with_head_vocab(head, [])


def test_a_reduced_head_returns_its_own_columns_beside_their_scatter(target, head):
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, 96, (2, 5)), jnp.int32)
    features = target.module.apply(target.params, tokens, hidden_layers=(-1,)).hidden[0]
    out = head.module.apply(head.params, tokens, features=features)
    logits, ids = (np.asarray(x) for x in out.reduced)
    assert logits.shape == (2, 5, 80)
    np.testing.assert_array_equal(ids, np.arange(80)[::-1])
    full = np.full((2, 5, 96), -np.inf, np.float32)
    full[..., ids] = logits
    np.testing.assert_array_equal(np.asarray(out.logits), full)
    # Columns whose ids the pair cannot use (padding past its vocab_size) never rank.
    from specjax._src.engine.cycle import usable_reduced

    usable = np.asarray(usable_reduced(out, 70).logits)
    np.testing.assert_array_equal(usable[..., ids >= 70], -np.inf)
    np.testing.assert_array_equal(usable[..., ids < 70], logits[..., ids < 70])


@pytest.mark.parametrize("tree", [pytest.param(static_tree((3, 2, 1)), marks=pytest.mark.slow), dynamic_tree(3, 2, 5)],
                         ids=["static", "dynamic"])
def test_greedy_trees_draft_the_same_from_a_reduced_heads_own_columns(head_pair, tree, monkeypatch):
    """Greedy tree drafting ranks a reduced head's 80 columns (ids in reverse
    order) instead of the 96-token scatter: the same children, the same
    acceptance, the target's greedy text."""
    from specjax._src.engine import cycle, tree_drafting

    prompts = random_prompts(34, 8, 96, 12)
    kw = dict(tree=tree, max_new_tokens=20, temperature=0.0, eos_token_id=())
    jax.clear_caches()
    fast = specjax.decode(head_pair, prompts, **kw)
    for module in (cycle, tree_drafting):  # the scatter's path: every rank over the full vocabulary
        monkeypatch.setattr(module, "usable_reduced", lambda out, vocab: None)
    jax.clear_caches()
    full = specjax.decode(head_pair, prompts, **kw)
    monkeypatch.undo()
    jax.clear_caches()
    np.testing.assert_array_equal(np.asarray(fast.tokens), np.asarray(full.tokens))
    np.testing.assert_array_equal(np.asarray(fast.stats.accepted), np.asarray(full.stats.accepted))
    assert int(np.sum(fast.stats.accepted)) > 0
    ref = specjax.generate(head_pair.target, prompts, max_new_tokens=20, temperature=0.0, eos_token_id=())
    np.testing.assert_array_equal(np.asarray(fast.tokens), np.asarray(ref.tokens))


@pytest.mark.parametrize("group", [None, 16])
def test_an_int8_stored_head_holds_its_rounded_float_weights(tmp_path, target, head, group):
    mixed = _mixed(head)
    path = tmp_path / "int8"
    fh.save_head(mixed, str(path), weights_format="int8" if group is None else f"int8/{group}")
    fh.save_head(mixed, str(tmp_path / "float"))
    with safe_open(str(path / fh.WEIGHTS_FILE), "np") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert stored["lm_head.qweight"].dtype == np.int8 and "lm_head" not in stored
    assert stored["layer_0.mlp.up.kernel.qweight"].dtype == np.int8 and stored["fuse.kernel"].dtype == np.float32
    assert (path / fh.WEIGHTS_FILE).stat().st_size < 0.7 * (tmp_path / "float" / fh.WEIGHTS_FILE).stat().st_size
    loaded = fh.load_feature_head(str(path), "float32")
    assert loaded.module.config.quantization is None  # float in memory
    originals = dict(jax.tree_util.tree_flatten_with_path(mixed.params)[0])
    for key, value in jax.tree_util.tree_flatten_with_path(loaded.params)[0]:
        w, got = np.asarray(originals[key], np.float32), np.asarray(value)
        if w.ndim != 2 or jax.tree_util.keystr(key).startswith(("['fuse']", "['reduce']")):
            np.testing.assert_array_equal(got, w)  # the fusion layers as they were
            continue
        # an int8 multiple of one float16 scale per output channel (column), or per group of its
        # inputs: max|w| / 127 there
        g = group or w.shape[0]
        scale = (np.abs(w.reshape(-1, g, w.shape[1])).max(axis=1) / 127).astype(np.float16).astype(np.float32)
        scale = np.repeat(scale, g, axis=0)
        steps = got / scale
        np.testing.assert_allclose(steps, np.rint(steps), atol=1e-3)
        assert np.abs(np.rint(steps)).max() <= 127
        assert np.all(np.abs(got - w) <= scale / 2 * 1.001 + 1e-7), jax.tree_util.keystr(key)
    # a pair with it drafts nearly as the float head does
    tokens, hidden = jnp.ones((1, 3), jnp.int32), jnp.ones((1, 3, 64))
    paired = specjax.pair(target, loaded).draft
    feats = mixed.module.target_features(mixed.params, hidden)
    np.testing.assert_allclose(np.asarray(paired.module.apply(paired.params, tokens, features=feats).logits),
                               np.asarray(mixed.module.apply(mixed.params, tokens, features=feats).logits),
                               atol=0.05, rtol=0.05)


@pytest.mark.parametrize("group", [None, 16])
def test_specjax_load_keeps_an_int8_stored_head_int8(tmp_path, target, head, group):
    fmt = "int8" if group is None else f"int8/{group}"
    path = tmp_path / "int8"
    fh.save_head(_mixed(head), str(path), weights_format=fmt)
    with safe_open(str(path / fh.WEIGHTS_FILE), "np") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    as_float = fh.load_feature_head(str(path), "float32")
    loaded = specjax.load(str(path), dtype="float32")
    assert loaded.module.config.quantization == fmt and loaded.module.config.dtype == "float32"
    kernel = loaded.params["layer_0"]["mlp"]["up"]["kernel"]
    assert kernel["qweight"].dtype == jnp.int8
    # the stored integers and scales themselves, up to the kernels' layout
    np.testing.assert_array_equal(np.sort(np.asarray(kernel["qweight"]).ravel()),
                                  np.sort(stored["layer_0.mlp.up.kernel.qweight"].ravel()))
    assert loaded.params["fuse"]["kernel"].dtype == jnp.float32  # the fusion layers stay float
    # dequantized, exactly the float weights load_feature_head reads
    back = dict(jax.tree_util.tree_flatten_with_path(specjax.dequantize(loaded, "float32").params)[0])
    for key, value in jax.tree_util.tree_flatten_with_path(as_float.params)[0]:
        np.testing.assert_array_equal(np.asarray(back[key]), np.asarray(value), err_msg=jax.tree_util.keystr(key))
    assert specjax.load(str(path)).module.config.dtype == "float32"  # the head's own dtype by default
    # asked for its own format, the same integers; for another, quantized from the exact float weights
    again = specjax.load(str(path), dtype="float32", quantize=fmt).params["layer_0"]["mlp"]["up"]["kernel"]
    np.testing.assert_array_equal(np.asarray(again["qweight"]), np.asarray(kernel["qweight"]))
    q4 = specjax.load(str(path), quantize="q4")
    assert q4.module.config.quantization == "q4" and q4.module.config.dtype == "float32"
    assert specjax.load(str(path), dtype="bfloat16").params["fuse"]["kernel"].dtype == jnp.bfloat16
    # it drafts what the float head drafts, and greedy decoding with it is the target's
    tokens, hidden = jnp.ones((1, 3), jnp.int32), jnp.ones((1, 3, 64))
    feats = as_float.module.target_features(specjax.pair(target, as_float).draft.params, hidden)
    logits = [np.asarray(d.module.apply(d.params, tokens, features=feats).logits)
              for d in (specjax.pair(target, m).draft for m in (loaded, as_float))]
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    prompts = random_prompts(34, 4, 96, 10)
    kw = dict(max_new_tokens=12, temperature=0.0)
    out = specjax.decode(specjax.pair(target, loaded), prompts, num_draft=3, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(specjax.generate(target, prompts, **kw).tokens))
    # narrowed, it keeps its int8 rows of the kept ids; grown, it asks for its float version
    keep = np.arange(0, 80, 3)
    narrow = specjax.pair(target, fhb.with_head_vocab(loaded, keep)).draft
    assert narrow.module.config.quantization == fmt
    thin = np.asarray(narrow.module.apply(narrow.params, tokens, features=feats).logits)
    np.testing.assert_allclose(thin[..., keep], logits[0][..., keep], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"quantized \(int8.*specjax.dequantize\(head\)"):
        fhb.with_num_layers(loaded, 2)


def test_an_int8_stored_head_runs_float_where_the_kernels_cannot_be_built(tmp_path, head, monkeypatch, request):
    from specjax._src.kernels import quant
    from specjax._src.kernels import cpu_matmul

    path = tmp_path / "int8"
    fh.save_head(_mixed(head), str(path), weights_format="int8")

    def unavailable():
        raise cpu_matmul.KernelUnavailableError("no C++ compiler")

    monkeypatch.setattr(cpu_matmul, "ensure_loaded", unavailable)
    quant.check_kernels_for.cache_clear()  # it remembers the machine's answer
    request.addfinalizer(quant.check_kernels_for.cache_clear)
    with pytest.warns(UserWarning, match="stores its matrices in int8, which run as float here.*no C\\+\\+ compiler"):
        loaded = specjax.load(str(path), dtype="float32")
    assert loaded.module.config.quantization is None
    with pytest.raises(ValueError, match="need specjax's kernels"):  # asked for by name: an error, not a fallback
        specjax.load(str(path), quantize="int8")
    want = fh.load_feature_head(str(path), "float32").params["lm_head"]
    np.testing.assert_array_equal(np.asarray(loaded.params["lm_head"]), np.asarray(want))


def test_int8_storage_refuses_what_it_cannot_read_back(tmp_path, head):
    with pytest.raises(ValueError, match="weights_format must be None.*int8 format"):
        fh.save_head(head, str(tmp_path / "a"), weights_format="int4")
    path = tmp_path / "b"
    fh.save_head(head, str(path), weights_format="int8")
    meta = json.loads((path / "config.json").read_text())
    meta[fh.CONFIG_KEY]["weights_format"] = "fp4"
    (path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="config.json: this version of specjax reads.*'fp4'"):
        specjax.load(str(path))
    meta[fh.CONFIG_KEY]["weights_format"] = "int8"
    (path / "config.json").write_text(json.dumps(meta))
    with safe_open(str(path / fh.WEIGHTS_FILE), "np") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    for broken, match in (({k: v for k, v in stored.items() if k != "lm_head.qscale"}, "lacks tensor 'lm_head.qscale'"),
                          ({**stored, "lm_head.qweight": stored["lm_head.qweight"].astype(np.int16)},
                           "do not store an int8 matrix")):
        save_file(broken, str(path / fh.WEIGHTS_FILE))
        with pytest.raises(ValueError, match=match):
            specjax.load(str(path))
