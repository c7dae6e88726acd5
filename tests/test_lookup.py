"""Context lookup drafting (``decode(lookup=...)``, prompt lookup decoding).

The copied drafts must be exactly the continuation of the longest (then
latest) trailing n-gram match, greedy decoding with them must stay the
target's greedy output, and lossless sampling with them (point-mass drafts)
must follow the target's law.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import drafting
from specjax.rules import block_verification, speculative_sampling
from specjax.testing import llama_config, peaked_target_and_draft
from specjax.trees import static_tree
from specjax._src.models import feature_head_build as fhb
from test_decode import goodness_of_fit
from test_feature_head import _exact_two_tokens, _sampled_two_tokens


def _reference(row, n, k, min_match, max_match):
    """The docstring's definition, by brute force over one context."""
    ctx = list(row[:n])
    best = None  # (length, end)
    for e in range(n - 1):
        m = 0
        while m < max_match and e - m >= 0 and ctx[e - m] == ctx[n - 1 - m]:
            m += 1
        if m >= min_match and (best is None or (m, e) > best):
            best = (m, e)
    drafts, valid = [0] * k, [False] * k
    if best is not None:
        for j in range(k):
            if best[1] + 1 + j < n:
                drafts[j], valid[j] = ctx[best[1] + 1 + j], True
    return drafts, valid


@pytest.mark.parametrize("min_match,max_match", [(1, 1), (2, 4), (3, 8)])
def test_lookup_drafts_equal_the_brute_force_definition(min_match, max_match):
    rng = np.random.default_rng(min_match)
    batch, length, k = 64, 40, 4
    tokens = rng.integers(0, 4, size=(batch, length)).astype(np.int32)  # 4 symbols: many matches
    tokens[:8] = np.tile(rng.integers(0, 50, size=(8, 5)), 8)[:, :length]  # periodic rows: long matches
    n = rng.integers(1, length + 1, size=batch).astype(np.int32)
    got, ok = jax.device_get(drafting.lookup_drafts(jnp.asarray(tokens), jnp.asarray(n), k,
                                                    drafting.ngram_lookup(min_match, max_match)))
    for b in range(batch):
        want, want_ok = _reference(tokens[b], n[b], k, min_match, max_match)
        np.testing.assert_array_equal(ok[b], want_ok, err_msg=f"row {b}")
        np.testing.assert_array_equal(np.where(ok[b], got[b], 0), want, err_msg=f"row {b}")
    assert 8 < ok[:, 0].sum() < batch  # rows with and without a match: the comparison had content


def test_lookup_ignores_tokens_past_the_committed_ones():
    tokens = jnp.asarray([[1, 2, 7, 1, 2, 1, 2, 9, 9]], jnp.int32)
    got, ok = drafting.lookup_drafts(tokens, jnp.asarray([5]), 3, drafting.ngram_lookup(2))
    # context [1 2 7 1 2]: [1 2] matched at 0..1, continuation 7 1 2 (all before n = 5)
    np.testing.assert_array_equal(np.asarray(got), [[7, 1, 2]])
    assert np.asarray(ok).all()
    got, ok = drafting.lookup_drafts(tokens, jnp.asarray([3]), 3, drafting.ngram_lookup(2))
    assert not np.asarray(ok).any()  # [2 7] never occurred before


def _repetitive_prompts(seed, count, vocab):
    rng = np.random.default_rng(seed)
    return [np.tile(rng.integers(0, vocab, size=int(rng.integers(2, 6))), 4)[: int(rng.integers(6, 20))].tolist()
            for _ in range(count)]


@pytest.fixture(scope="module")
def pairs():
    target, draft = peaked_target_and_draft(llama_config())
    head = fhb.init_from_target(target, jax.random.key(1), np.arange(80)[::-1])
    return {"draft model": specjax.pair(target, draft), "feature head": specjax.pair(target, head)}


@pytest.mark.parametrize("drafter", ["draft model", "feature head"])
def test_greedy_with_lookup_is_target_greedy(pairs, drafter):
    pair = pairs[drafter]
    prompts = _repetitive_prompts(3, 12, 96)
    kw = dict(max_new_tokens=24, temperature=0.0, eos_token_id=5)
    ref = specjax.generate(pair.target, prompts, **kw)
    out = specjax.decode(pair, prompts, num_draft=4, lookup=drafting.ngram_lookup(2), **kw)
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    s = out.stats
    assert int(np.sum(s.copied)) > 0  # the lookup drafted
    assert np.all(s.copied <= s.drafted) and np.all(s.copied_accepted <= s.accepted)
    assert np.all(s.copied_accepted <= s.copied)
    assert f"copied={int(np.sum(s.copied))} ({int(np.sum(s.copied_accepted))} accepted)" in str(s)
    plain = specjax.decode(pair, prompts, num_draft=4, **kw)
    assert int(np.sum(plain.stats.copied)) == 0 and "copied=" not in str(plain.stats)


# Every slot copied (K = 2) is slow-only: [ss] runs the same rule with copied and drafted slots.
@pytest.mark.parametrize("rule,num_draft", [pytest.param(speculative_sampling(), 3, id="ss"),
                                             # block verification's law with model drafts runs by default
                                             # (test_block_verification.py); with copies, with -m slow
                                             pytest.param(block_verification(), 3, id="block", marks=pytest.mark.slow),
                                             pytest.param(speculative_sampling(), 2, id="ss-all-copied",
                                                          marks=pytest.mark.slow)])
def test_lossless_sampling_with_copied_drafts_follows_the_target(rule, num_draft):
    """K=3: two copies, then the head's own draft; K=2: both slots are copies
    and the head runs no forward after its first."""
    vocab = 16
    target = peaked_target_and_draft(llama_config(vocab_size=vocab))[0]
    target = target.replace(params={**target.params, "lm_head": target.params["lm_head"] * 0.1})
    pair = specjax.pair(target, fhb.init_from_target(target, jax.random.key(2), np.arange(12)))
    # Every token is followed by 3 once: after the first token v (the prefill's), the first two
    # drafts are the copies 3, v + 1.
    prompt, samples = [t for v in range(vocab) for t in (v, 3)], 40000
    counts, stats = _sampled_two_tokens(pair, prompt, vocab, samples, num_draft=num_draft, key=jax.random.key(7),
                                        rule=rule, lookup=drafting.ngram_lookup(1))
    pvalue, tv = goodness_of_fit(counts, _exact_two_tokens(target, prompt, vocab))
    assert pvalue > 1e-3 and tv < 0.04, f"chi-square p={pvalue:.2e}, TV={tv:.4f}"
    assert int(np.sum(stats.copied_accepted)) > samples // 20  # copied drafts were accepted
    assert int(np.sum(stats.copied_accepted)) < int(np.sum(stats.copied))  # and rejected
    other = [7, 5, 7]  # the same statistic rejects another context's law: it can fail
    pvalue, tv = goodness_of_fit(counts, _exact_two_tokens(target, other, vocab))
    assert pvalue < 1e-6 and tv > 0.04


@pytest.mark.parametrize("drafter", ["draft model", "feature head"])
def test_a_head_skips_the_forwards_of_copied_slots(pairs, drafter):
    """Once every remaining slot is a copy, no slot reads the head's next
    forwards: a head skips them (its cache is rewritten from the target's
    features next cycle), a draft model runs them (its cache keeps them).
    Batch 1, so each sequence's own copies decide; the tokens stay the
    target's greedy ones."""
    pair, k = pairs[drafter], 4
    kw = dict(max_new_tokens=24, temperature=0.0, eos_token_id=5)
    skipped = 0
    for prompt in _repetitive_prompts(4, 6, 96):
        out = specjax.decode(pair, [prompt], num_draft=k, lookup=drafting.ngram_lookup(2), **kw)
        ref = specjax.generate(pair.target, [prompt], **kw)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
        s = out.stats
        ran, full = int(s.draft_forwards), int(np.max(s.cycles)) * k
        if drafter == "draft model":
            assert ran == full
        skipped += full - ran
        assert ran <= full
    if drafter == "feature head":
        assert skipped > 0


def test_bad_lookup_arguments_get_clear_errors(pairs):
    pair = pairs["draft model"]
    with pytest.raises(ValueError, match="max_match"):
        drafting.ngram_lookup(4, 2)
    with pytest.raises(ValueError, match="min_match"):
        drafting.ngram_lookup(0)
    with pytest.raises(TypeError, match="ngram_lookup"):
        specjax.decode(pair, [[1, 2]], lookup=3, max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="tree="):
        specjax.decode(pair, [[1, 2]], lookup=drafting.ngram_lookup(), tree=static_tree((2, 1)),
                       max_new_tokens=4, temperature=0.0)


def test_a_max_match_past_the_buffer_traces_no_more_than_the_buffer():
    """No match is longer than the token buffer: max_match=256 over 12 tokens gives
    the program (and the drafts) of max_match=12, not 256 unrolled comparisons."""
    from specjax._src.proposals.lookup import lookup_drafts

    tokens = jnp.asarray([[3, 1, 4, 1, 5, 3, 1, 4, 1, 0, 0, 0]], jnp.int32)
    n = jnp.asarray([9], jnp.int32)

    def program(max_match):
        fn = lambda t, c: lookup_drafts(t, c, 3, drafting.ngram_lookup(1, max_match))  # noqa: E731
        return len(jax.make_jaxpr(fn)(tokens, n).jaxpr.eqns), fn(tokens, n)

    (size_12, (drafts_12, valid_12)), (size_256, (drafts_256, valid_256)) = program(12), program(256)
    assert size_256 == size_12
    np.testing.assert_array_equal(np.asarray(drafts_256), np.asarray(drafts_12))
    np.testing.assert_array_equal(np.asarray(valid_256), np.asarray(valid_12))
    assert np.asarray(valid_12).any()
