"""Shape buckets: mixed-length traffic compiles a handful of programs, and the
padding they add never changes a sequence's output (issue 13, issue 14's
batch-invariance row).

The tiny Decoder pair (vocabulary 96) with a 256-position limit, so that prompt
widths up to 90 round up to the plain power-of-two buckets.
"""

from __future__ import annotations


import jax
import numpy as np
import pytest

import specjax
from specjax._src.engine import prepare as prepare_lib
from test_decode import count_compilations
from tiny_models import llama_config, peaked_target_and_draft

VOCAB = 96


@pytest.fixture(scope="module")
def decoder_pair():
    return specjax.pair(*peaked_target_and_draft(llama_config(max_position_embeddings=256)))


def prompts_of_width(rng, batch, width):
    """``batch`` prompts, the longest exactly ``width`` tokens."""
    rows = [rng.integers(0, VOCAB, size=int(rng.integers(1, width + 1))).tolist() for _ in range(batch)]
    rows[0] = rng.integers(0, VOCAB, size=width).tolist()
    return rows


def width_bucket(width):
    """The documented ladder, written out: 16, 32, 64, 128."""
    return next(b for b in (16, 32, 64, 128) if width <= b)


def test_the_ladders():
    assert [prepare_lib.bucket_of(n, 16) for n in (1, 16, 17, 33, 90, 129)] == [16, 16, 32, 64, 128, 256]
    assert [prepare_lib._batch_bucket(n, 1) for n in (1, 2, 3, 5, 8, 9, 25, 64, 65)] == [
        1, 2, 4, 8, 8, 16, 32, 64, 72]
    assert prepare_lib._batch_bucket(3, 3) == 3  # a bucket the mesh's data axis does not divide
    # Near the position limit the padding shrinks to fit; the request never does.
    assert prepare_lib._padded_lengths(prepare_lib.BUCKETS, 90, 16, 3, 128) == (109, 16)
    assert prepare_lib._padded_lengths(prepare_lib.BUCKETS, 4, 9, 4, 17) == (4, 9)
    assert prepare_lib._padded_lengths(None, 5, 7, 3, None) == (5, 7)


def test_mixed_widths_compile_once_per_bucket(decoder_pair):
    """20 calls, prompt widths 3..90, batch sizes 3 and 4, max_new_tokens 9..16:
    one program per prompt-width bucket; a second pass compiles nothing."""
    widths = np.linspace(3, 90, 20).astype(int).tolist()
    batches = [3, 4] * 10
    new_tokens = [9 + (i % 8) for i in range(20)]
    key = jax.random.key(0)
    kw = dict(num_draft=3, temperature=1.0, key=key)
    expected = len({width_bucket(w) for w in widths})  # one batch bucket (4), one N bucket (16)
    assert expected == 4

    def one_pass(seed):
        rng = np.random.default_rng(seed)
        outs = []
        for width, batch, n in zip(widths, batches, new_tokens):
            out = specjax.decode(decoder_pair, prompts_of_width(rng, batch, width), max_new_tokens=n, **kw)
            assert out.tokens.shape == (batch, n)  # cut back to what was asked
            np.testing.assert_array_equal(np.asarray(out.lengths), n)
            outs.append(out)
        return outs

    with count_compilations() as first:
        one_pass(0)
    assert 1 <= first["n"] <= expected
    with count_compilations() as second:
        one_pass(1)
    assert second["n"] == 0


def test_generate_shares_programs_across_widths_and_lengths(decoder_pair):
    target = decoder_pair.target
    rng = np.random.default_rng(3)
    specjax.generate(target, prompts_of_width(rng, 2, 20), max_new_tokens=10, temperature=0.0)
    with count_compilations() as compiled:
        for width, n in ((17, 5), (25, 16), (32, 11)):
            out = specjax.generate(target, prompts_of_width(rng, 2, width), max_new_tokens=n, temperature=0.0)
            assert out.tokens.shape == (2, n)
    assert compiled["n"] == 0


# ---------------------------------------------------------------------------
# Padding is inert
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_buckets_do_not_change_results(decoder_pair, temperature):
    """The same call with and without buckets: identical outputs for the same key."""
    rng = np.random.default_rng(5)
    prompts = prompts_of_width(rng, 5, 23)  # width bucket 32, batch bucket 8, N bucket 16
    kw = dict(num_draft=3, max_new_tokens=11, temperature=temperature, key=jax.random.key(2))
    exact = specjax.decode(decoder_pair, prompts, buckets=None, **kw)
    padded = specjax.decode(decoder_pair, prompts, **kw)
    assert padded.tokens.shape == exact.tokens.shape == (5, 11)
    np.testing.assert_array_equal(np.asarray(padded.tokens), np.asarray(exact.tokens))
    np.testing.assert_array_equal(np.asarray(padded.lengths), np.asarray(exact.lengths))
    np.testing.assert_array_equal(np.asarray(padded.stats.cycles), np.asarray(exact.stats.cycles))
    np.testing.assert_array_equal(np.asarray(padded.stats.accepted_at), np.asarray(exact.stats.accepted_at))
    np.testing.assert_array_equal(np.asarray(padded.stats.reached_at), np.asarray(exact.stats.reached_at))
    np.testing.assert_array_equal(np.asarray(padded.stats.judged), np.asarray(exact.stats.judged))


def test_bad_buckets_raise():
    pair = specjax.pair(*peaked_target_and_draft(llama_config()))
    with pytest.raises(ValueError, match="Buckets.prompt"):
        specjax.decode(pair, [[1]], buckets=prepare_lib.Buckets(prompt=0), temperature=0.0)
    with pytest.raises(TypeError, match="buckets"):
        specjax.decode(pair, [[1]], buckets=16, temperature=0.0)


def cast_pair(dtype):
    """The tiny pair computing in ``dtype`` (bf16 rounds every product, so any
    reduction whose order depends on a padded size shows up in the tokens)."""
    target, draft = peaked_target_and_draft(llama_config(max_position_embeddings=256, dtype=dtype))
    cast = lambda m: specjax.Model(jax.tree.map(lambda x: x.astype(dtype), m.params), m.module)  # noqa: E731
    return specjax.pair(cast(target), cast(draft))


# bfloat16 greedy in the default run (bf16 rounds every product: a reduction whose order followed the
# padded width would show); the other three combinations (about 45 s of compiling) run with -m slow.
# Sampling at T=1 under bucketing is checked by default in test_buckets_do_not_change_results[1.0].
@pytest.mark.parametrize("dtype,temperature", [
    pytest.param("float32", 1.0, marks=pytest.mark.slow), ("bfloat16", 0.0),
    pytest.param("float32", 0.0, marks=pytest.mark.slow), pytest.param("bfloat16", 1.0, marks=pytest.mark.slow),
])
def test_a_sequence_ignores_its_companions_across_buckets(dtype, temperature):
    """Issue 14's first row: only the padded width (16 -> 64) and the batch
    bucket (32 -> 64) change; no sequence's tokens may change, in decode or
    generate, and a few sequences alone (batch bucket 4) agree too."""
    pair = cast_pair(dtype)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, size=int(rng.integers(1, 14))).tolist() for _ in range(30)]
    companions = [rng.integers(0, VOCAB, size=40).tolist() for _ in range(4)]
    keys = jax.random.split(jax.random.key(1), 34)
    kw = dict(max_new_tokens=20, temperature=temperature)
    for run in (
        lambda p, k: specjax.decode(pair, p, key=k, num_draft=3, **kw),
        lambda p, k: specjax.generate(pair, p, key=k, **kw),
    ):
        small = np.asarray(run(prompts, keys[:30]).tokens)
        wide = np.asarray(run(prompts + companions, keys).tokens)[:30]
        alone = np.asarray(run(prompts[:3], keys[:3]).tokens)
        changed = np.flatnonzero((small != wide).any(1)).tolist()
        assert changed == [], f"{len(changed)}/30 sequences changed with the padded width: {changed}"
        np.testing.assert_array_equal(alone, small[:3])


def test_a_wide_padded_array_is_bucketed_by_its_longest_prompt():
    """A client's fixed-width [B, 100] array of short prompts runs in the 16 bucket."""
    pair = specjax.pair(*peaked_target_and_draft(llama_config()))  # 128 positions: 100 + 32 + 3 would not fit
    prompts = [[5, 6, 7], [8, 9]]
    arr = np.zeros((2, 100), np.int32)
    arr[0, :3], arr[1, :2] = prompts[0], prompts[1]
    kw = dict(num_draft=3, max_new_tokens=32, temperature=0.0)
    out = specjax.decode(pair, arr, prompt_lengths=[3, 2], **kw)
    ref = specjax.decode(pair, prompts, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))


def test_a_new_eos_set_or_pad_id_compiles_nothing():
    pair = specjax.pair(*peaked_target_and_draft(llama_config()))
    prompts = [[5, 17, 3], [40, 2]]
    kw = dict(num_draft=3, max_new_tokens=12, temperature=0.0)
    free = specjax.decode(pair, prompts, eos_token_id=(), **kw)
    specjax.generate(pair, prompts, eos_token_id=(), max_new_tokens=12, temperature=0.0)
    eos = int(np.asarray(free.tokens)[0, 3])
    with count_compilations() as compiled:
        out = specjax.decode(pair, prompts, eos_token_id=[eos, 1, 2], pad_token_id=-7, **kw)
        gen = specjax.generate(pair, prompts, eos_token_id=eos, pad_token_id=-7, max_new_tokens=12, temperature=0.0)
    assert compiled["n"] == 0
    for res in (out, gen):
        toks, lens = np.asarray(res.tokens), np.asarray(res.lengths)
        assert lens[0] <= 4 and toks[0, lens[0] - 1] == eos  # stopped at the new EOS
        assert (toks[0, lens[0]:] == -7).all()  # and padded with the new id


@pytest.mark.parametrize("width", [64, 56])  # 56: three full blocks and an 8-token tail
def test_the_prefill_skips_the_buckets_padding_and_changes_nothing_it_keeps(width):
    """Blocks wholly past every sequence's kept prefix are not run: their cache
    rows stay zero, while the kept rows and features equal a prefill that runs
    every block."""
    from specjax._src.engine.ops import PREFILL_BLOCK, prefill

    target, _ = peaked_target_and_draft(llama_config(max_position_embeddings=256))
    prompts = jax.numpy.asarray(np.random.default_rng(3).integers(0, VOCAB, size=(2, width)), jax.numpy.int32)
    keep = jax.numpy.asarray([5, 20], jax.numpy.int32)  # two of the blocks hold a kept position
    run = lambda k: prefill(target.module, target.params, prompts, k, 128, hidden_layers=(0, 1))  # noqa: E731
    cache, hidden, _ = run(keep)
    full_cache, full_hidden, _ = run(jax.numpy.full((2,), width, jax.numpy.int32))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [5, 20])
    for b, n in enumerate([5, 20]):
        for mine, ref in zip(cache.keys + cache.values, full_cache.keys + full_cache.values):
            np.testing.assert_array_equal(np.asarray(mine[b, :, :n]), np.asarray(ref[b, :, :n]))
            assert np.abs(np.asarray(ref[b, :, 2 * PREFILL_BLOCK:width])).max() > 0
            assert not np.asarray(mine[b, :, 2 * PREFILL_BLOCK:]).any(), "a block past every kept position ran"
        np.testing.assert_array_equal(np.asarray(hidden[b, :n]), np.asarray(full_hidden[b, :n]))
    assert hidden.shape == full_hidden.shape == (2, width, 2 * 32)
    # A kept position in the tail runs every block and the tail.
    tail_keep = jax.numpy.asarray([width - 1, 3], jax.numpy.int32)
    tail_cache, tail_hidden, _ = run(tail_keep)
    np.testing.assert_array_equal(np.asarray(tail_hidden[0]), np.asarray(full_hidden[0]))
    np.testing.assert_array_equal(np.asarray(tail_cache.keys[0][0, :, : width - 1]),
                                  np.asarray(full_cache.keys[0][0, :, : width - 1]))


def test_a_prompt_alone_is_prefilled_in_wide_blocks():
    """One prompt runs in blocks of ``prefill_block(1)`` tokens: a 20-token
    prompt in a 128 width runs one 64-token block (its rows past the prompt
    written, then rolled back) and skips the second."""
    from specjax._src.engine.ops import PREFILL_BLOCK, prefill, prefill_block

    block = prefill_block(1)
    assert block > PREFILL_BLOCK == prefill_block(2)
    target, _ = peaked_target_and_draft(llama_config(max_position_embeddings=256))
    prompt = jax.numpy.asarray(np.random.default_rng(4).integers(0, VOCAB, size=(1, 2 * block)), jax.numpy.int32)
    cache = prefill(target.module, target.params, prompt, jax.numpy.asarray([20], jax.numpy.int32), 160).cache
    np.testing.assert_array_equal(np.asarray(cache.lengths), [20])
    keys = np.asarray(cache.keys[0])[0]  # [kv heads, positions, head dim]
    assert np.abs(keys[:, 20:block]).max(axis=-1).min() > 0, "the first block did not run whole"
    assert not keys[:, block:].any(), "a block past the prompt ran"


@pytest.mark.parametrize("batch", [1, 2])
def test_the_prefill_gives_the_logits_at_each_sequence_s_last_position(batch):
    """``logits_at`` reads each sequence's logits from the block that holds that position (64-token
    blocks alone, 16 in a batch, the second block here): they are a whole forward's logits there."""
    from specjax._src.engine.ops import prefill

    target, _ = peaked_target_and_draft(llama_config(max_position_embeddings=256))
    prompts = jax.numpy.asarray(np.random.default_rng(5).integers(0, VOCAB, size=(batch, 80)), jax.numpy.int32)
    lengths = jax.numpy.asarray([70, 23][:batch], jax.numpy.int32)
    done = prefill(target.module, target.params, prompts, lengths, 128, logits_at=lengths - 1)
    whole = target.module.apply(target.params, prompts, target.module.init_cache(batch, 128)).logits
    for b, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(np.asarray(done.logits[b]), np.asarray(whole[b, n - 1]), rtol=1e-4, atol=1e-4)
        assert np.abs(np.asarray(whole[b, n - 2]) - np.asarray(done.logits[b])).max() > 1e-2  # not its neighbour's
    assert prefill(target.module, target.params, prompts, lengths, 128).logits is None


@pytest.mark.parametrize("dtype,temperature", [
    ("bfloat16", 0.0), pytest.param("float32", 1.0, marks=pytest.mark.slow),
])
def test_a_prompt_alone_decodes_as_it_does_beside_a_companion(dtype, temperature):
    """A prompt alone (64-token prefill blocks) gives the tokens it gives in a
    wider width bucket and beside a companion (16-token blocks)."""
    pair = cast_pair(dtype)
    rng = np.random.default_rng(6)
    kw = dict(max_new_tokens=16, temperature=temperature, num_draft=3)
    for length in (9, 51):
        prompt = rng.integers(0, VOCAB, size=length).tolist()
        key = jax.random.key(length)
        alone = np.asarray(specjax.decode(pair, [prompt], key=key, **kw).tokens)[0]
        wide = specjax.decode(pair, [prompt], key=key, buckets=prepare_lib.Buckets(prompt=128), **kw)
        paired = specjax.decode(pair, [prompt, prompt[:3]], key=key, **kw)
        np.testing.assert_array_equal(np.asarray(wide.tokens)[0], alone)
        np.testing.assert_array_equal(np.asarray(paired.tokens)[0], alone)


# float32 at T=1 is slow-only (about 7 s): bfloat16 rounds every product, so a reduction that
# changed with the verification width shows in its greedy tokens; each sequence's own key across
# a batch's shapes is checked by default in test_a_sequence_ignores_its_companions_across_buckets.
@pytest.mark.parametrize("dtype,temperature", [pytest.param("float32", 1.0, marks=pytest.mark.slow),
                                               ("bfloat16", 0.0)])
def test_a_sequence_ignores_the_verification_width_its_companions_need(dtype, temperature):
    """With a drafting policy that stops early, a cycle verifies only as wide
    as the batch's longest draft: companions that draft more widen the
    forward. A sequence's tokens must not change with it."""
    pair = cast_pair(dtype)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, size=int(rng.integers(1, 14))).tolist() for _ in range(8)]
    keys = jax.random.split(jax.random.key(2), 8)
    kw = dict(num_draft=6, max_new_tokens=24, temperature=temperature, drafting=specjax.drafting.confidence(0.6))
    together = specjax.decode(pair, prompts, key=keys, **kw)
    for b in range(2):
        alone = specjax.decode(pair, prompts[b:b + 1], key=keys[b:b + 1], **kw)
        np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(together.tokens)[b])
        if b == 0:  # the batch did run wider than the sequence alone
            width = lambda out, i: float(out.stats.verified[i]) / float(out.stats.cycles[i])  # noqa: E731
            assert width(together, 0) > width(alone, 0)
