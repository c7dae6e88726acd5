"""The decode loop: losslessness, greedy parity, compilation, invariance, errors, stats.

Small models keep this file fast on CPU: a bigram table with vocabulary 8 for
the exact-distribution tests (its two-token distribution is enumerable), and
tiny random Flax decoders (hidden 32, vocabulary 96) for greedy parity and
batch invariance. Decoder programs are compiled a handful of times only: the
tests share shapes so the compile cache is reused.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import specjax
from tiny_models import llama_config, peaked_target_and_draft
from specjax.rules import (
    Path,
    Verdict,
    from_functions,
    lossless_decision,
    mars,
    speculative_sampling,
)

from bigram import bigram_model, random_table

VOCAB = 8
# The sampled-law tests decode 20,000-40,000 copies of a 1-2 token prompt for 2 tokens.
# Without buckets the cache holds the few positions that needs rather than 16 + 16 + K,
# which more than halved such a decode on the 2-core CPU (2026-11-28); the law is the
# same (test_buckets.py checks that buckets change no result).
NO_BUCKETS = None


# ---------------------------------------------------------------------------
# Models and helpers
# ---------------------------------------------------------------------------


def tiny_decoder_pair():
    """A 2-layer random Llama target and a 1-layer draft sharing its first layer."""
    return specjax.pair(*peaked_target_and_draft(llama_config()))


@pytest.fixture(scope="module")
def decoder_pair():
    return tiny_decoder_pair()


def random_prompts(seed, count, vocab, max_len, min_len=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(count)]


def padded(prompts, width):
    arr = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        arr[i, : len(p)] = p
    return arr, np.array([len(p) for p in prompts], np.int32)


PROGRAM_BUILT_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec")


@contextlib.contextmanager
def count_compilations():
    """Counts jit cache misses: each compiles a program or loads it from the disk cache.

    The suite shares a persistent compilation cache (conftest.py), so a program
    another test compiled first arrives as a cache retrieval, not a compile.
    """
    counter = {"n": 0}

    def listener(event, duration, **kwargs):
        del duration, kwargs
        if event in PROGRAM_BUILT_EVENTS:
            counter["n"] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# ---------------------------------------------------------------------------
# Lossless: the first two tokens follow the target's exact distribution
# ---------------------------------------------------------------------------


def np_warp_probs(logits, temperature, top_k, top_p):
    """An independent numpy reference of temperature -> top-k -> top-p."""
    z = np.asarray(logits, np.float64) / temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = np.sort(z)[::-1][top_k - 1]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p is not None:
        order = np.argsort(-p)
        mass_before = np.cumsum(p[order]) - p[order]
        keep = np.zeros_like(p, bool)
        keep[order[mass_before < top_p]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def opening_with(pair, end: int, first: int):
    """``pair`` with its bigram target's row ``end`` giving ``first`` alone: a prompt ending in
    ``end`` has ``first`` for its first token (the prefill's, which no rule judges), so the first
    cycle drafts after ``first``. Returns ``(pair, target table)``."""
    table = np.array(pair.target.params["table"])
    table[end] = -1e9
    table[end, first] = 10.0
    return specjax.pair(bigram_model(table), pair.draft), table


def exact_two_token_distribution(table, last, temperature, top_k, top_p):
    v = table.shape[0]
    first = np_warp_probs(table[last], temperature, top_k, top_p)
    joint = np.zeros((v, v))
    for x in range(v):
        joint[x] = first[x] * np_warp_probs(table[x], temperature, top_k, top_p)
    return joint


def two_token_counts(pair, *, rule, num_draft, temperature, top_k, top_p, samples=20000, seed=0, drafting=None,
                     stats=None, buckets=NO_BUCKETS):
    """Samples the first two generated tokens for `samples` sequences whose
    prompts all end in token 3 (half are [3], half [5, 3]: both prompt paths).
    ``stats``: a list that receives the decode's stats."""
    prompts = np.array([[3, 0], [5, 3]] * (samples // 2), np.int32)
    lengths = np.array([1, 2] * (samples // 2), np.int32)
    out = specjax.decode(
        pair, prompts, prompt_lengths=lengths, rule=rule, num_draft=num_draft, max_new_tokens=2,
        temperature=temperature, top_k=top_k, top_p=top_p, key=jax.random.key(seed), drafting=drafting,
        buckets=buckets,
    )
    toks = np.asarray(out.tokens)
    assert (np.asarray(out.lengths) == 2).all()
    if stats is not None:
        stats.append(out.stats)
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
    return counts


def goodness_of_fit(counts, expected_probs):
    """Chi-square p-value (cells with expected count < 5 pooled) and TV distance.

    Also asserts that no impossible pair was ever produced.
    """
    n = counts.sum()
    exp = expected_probs.ravel() * n
    obs = counts.ravel()
    impossible = exp == 0
    assert obs[impossible].sum() == 0, "produced a token pair the target gives probability 0"
    big = exp >= 5
    f_obs = np.append(obs[big], obs[~big & ~impossible].sum())
    f_exp = np.append(exp[big], exp[~big & ~impossible].sum())
    if f_exp[-1] == 0:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    pvalue = scipy_stats.chisquare(f_obs, f_exp).pvalue
    tv = 0.5 * np.abs(counts / n - expected_probs).sum()
    return pvalue, tv


def wrong_residual_rule():
    """Deliberately wrong: on rejection, resample from p instead of norm(max(0, p - q))."""

    def verify(inputs, state, *, greedy):
        del state
        accept, _ = lossless_decision(inputs, greedy=greedy)
        k = inputs.draft_tokens.shape[0]
        path = jnp.where(accept, Path.EXACT, Path.REJECTED).astype(jnp.int32)
        return Verdict(accept=accept, path=path, correction=inputs.target_probs[:k])

    base = speculative_sampling()
    return from_functions(verify, init=base.init, update=base.update, name="wrong_residual")


LOSSLESS_CASES = [
    # (num_draft, temperature, top_k, top_p)
    (3, 1.0, None, None),
    (1, 1.0, 3, None),
    (2, 0.7, None, 0.8),
    (4, 1.3, 5, 0.9),
]


@pytest.mark.parametrize("num_draft,temperature,top_k,top_p", LOSSLESS_CASES)
def test_lossless_first_two_tokens(bigram_pair, num_draft, temperature, top_k, top_p):
    table = np.asarray(bigram_pair.target.params["table"])
    expected = exact_two_token_distribution(table, 3, temperature, top_k, top_p)
    counts = two_token_counts(
        bigram_pair, rule=speculative_sampling(), num_draft=num_draft,
        temperature=temperature, top_k=top_k, top_p=top_p,
    )
    pvalue, tv = goodness_of_fit(counts, expected)
    assert pvalue > 1e-3, f"chi-square p={pvalue:.2e}, TV={tv:.4f}"
    assert tv < 0.03


@pytest.mark.parametrize("rule", ["speculative_sampling", "block_verification"])
def test_lossless_with_a_narrow_verification(bigram_pair, rule):
    """confidence(1.0) stops after one draft every cycle, so each verification
    forward scores 2 of the K + 1 = 4 block tokens (the rest come back as zero
    rows): the bonus and correction still follow the target's law."""
    from specjax.drafting import confidence
    from specjax.rules import block_verification

    table = np.asarray(bigram_pair.target.params["table"])
    expected = exact_two_token_distribution(table, 3, 1.0, None, None)
    stats = []
    rule = speculative_sampling() if rule == "speculative_sampling" else block_verification()
    counts = two_token_counts(bigram_pair, rule=rule, num_draft=3, temperature=1.0, top_k=None,
                              top_p=None, drafting=confidence(1.0), stats=stats,
                              buckets=specjax.Buckets())  # the verification buckets narrow the forward
    pvalue, tv = goodness_of_fit(counts, expected)
    assert pvalue > 1e-3 and tv < 0.03, f"chi-square p={pvalue:.2e}, TV={tv:.4f}"
    assert np.sum(stats[0].verified) == 2 * np.sum(stats[0].cycles)


def test_lossless_bound_rejects_a_wrong_residual(bigram_pair):
    """The same statistic and thresholds fail a rule with the wrong correction."""
    table = np.asarray(bigram_pair.target.params["table"])
    expected = exact_two_token_distribution(table, 3, 1.0, None, None)
    counts = two_token_counts(
        bigram_pair, rule=wrong_residual_rule(), num_draft=3, temperature=1.0, top_k=None, top_p=None,
    )
    pvalue, tv = goodness_of_fit(counts, expected)
    assert pvalue < 1e-6 and tv > 0.03, f"wrong residual not detected: p={pvalue:.2e}, TV={tv:.4f}"


def test_lossless_bound_rejects_a_missing_warp(bigram_pair):
    """Samples without the top-k warp are caught against the warped target."""
    table = np.asarray(bigram_pair.target.params["table"])
    expected = exact_two_token_distribution(table, 3, 1.0, 3, None)
    # Plain T=1 samples (the first case's program) judged against the top-3
    # distribution: must be rejected.
    counts = two_token_counts(
        bigram_pair, rule=speculative_sampling(), num_draft=3, temperature=1.0, top_k=None, top_p=None,
    )
    with pytest.raises(AssertionError, match="probability 0"):
        goodness_of_fit(counts, expected)


# ---------------------------------------------------------------------------
# Greedy: decode == generate
# ---------------------------------------------------------------------------


# Greedy bigram runs share one shape: G_BATCH prompts padded to G_WIDTH.
G_BATCH, G_WIDTH, G_KW = 25, 9, dict(max_new_tokens=13, temperature=0.0, eos_token_id=6)


def greedy_bigram(pair, prompts, num_draft=None):
    arr, lens = padded(prompts, G_WIDTH)
    if num_draft is None:
        return specjax.generate(pair.target, arr, prompt_lengths=lens, **G_KW)
    return specjax.decode(pair, arr, prompt_lengths=lens, num_draft=num_draft, **G_KW)


@pytest.mark.parametrize("num_draft", [1, 5])
def test_greedy_matches_generate_bigram(bigram_pair, num_draft):
    """50 prompts of lengths 1..9 in two mixed batches; EOS ends sequences early."""
    prompts = random_prompts(1, 2 * G_BATCH, VOCAB, G_WIDTH)
    eos = G_KW["eos_token_id"]
    for batch in (prompts[:G_BATCH], prompts[G_BATCH:]):
        out = greedy_bigram(bigram_pair, batch, num_draft)
        ref = greedy_bigram(bigram_pair, batch)
        np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
        lens = np.asarray(out.lengths)
        toks = np.asarray(out.tokens)
        assert (lens < 13).any()  # some sequences did stop at EOS
        for b in range(len(batch)):
            row = toks[b, : lens[b]].tolist()
            assert eos not in row[:-1]
            assert lens[b] == 13 or row[-1] == eos
            assert (toks[b, lens[b]:] == 0).all()  # padded after the end
        assert ref.stats.tau == 1.0  # generate: one token per cycle
        # The first token is the prefill's: every later one is a cycle's.
        np.testing.assert_array_equal(np.asarray(ref.stats.cycles), np.asarray(ref.lengths) - 1)


@pytest.mark.parametrize("num_draft", [3])
def test_greedy_matches_generate_decoder(decoder_pair, num_draft):
    """50 prompts of lengths 1..12 in two mixed batches of 25 (one compile)."""
    prompts = random_prompts(7, 50, 96, 12)
    for batch in (prompts[:25], prompts[25:]):
        arr, lens = padded(batch, 12)
        out = specjax.decode(decoder_pair, arr, prompt_lengths=lens, num_draft=num_draft, max_new_tokens=16, temperature=0.0)
        ref = specjax.generate(decoder_pair, arr, prompt_lengths=lens, max_new_tokens=16, temperature=0.0)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
        np.testing.assert_array_equal(np.asarray(out.lengths), 16)
        s = out.stats
        assert 0.0 < s.acceptance_rate < 1.0  # both the accept and the reject paths ran


# ---------------------------------------------------------------------------
# Compilation, invariance, determinism
# ---------------------------------------------------------------------------

# Decoder sampling runs share one shape (one compiled program).
DEC_SHAPE = dict(num_draft=3, max_new_tokens=16)
DEC_BATCH = 25


def test_second_call_compiles_nothing(decoder_pair):
    arr, lens = padded(random_prompts(3, DEC_BATCH, 96, 12), 12)
    specjax.decode(decoder_pair, arr, prompt_lengths=lens, key=jax.random.key(0), **DEC_SHAPE)
    specjax.generate(decoder_pair, arr, prompt_lengths=lens, max_new_tokens=16, temperature=0.0)
    arr2, lens2 = padded(random_prompts(4, DEC_BATCH, 96, 12), 12)
    key = jax.random.key(1)
    rule = speculative_sampling()  # a new, equal rule object
    with count_compilations() as compiled:
        # New prompts, key, rule object and temperature (a traced scalar).
        out = specjax.decode(
            decoder_pair, arr2, prompt_lengths=lens2, key=key, rule=rule, temperature=0.8, **DEC_SHAPE
        )
        ref = specjax.generate(decoder_pair, arr2, prompt_lengths=lens2, max_new_tokens=16, temperature=0.0)
        jax.block_until_ready((out.tokens, ref.tokens))
    assert compiled["n"] == 0


def test_equal_rules_and_temperatures_share_one_program(bigram_pair):
    prompts = [[1, 2], [3]]
    kw = dict(num_draft=2, max_new_tokens=5, top_p=0.9)
    specjax.decode(bigram_pair, prompts, rule=mars(theta=0.9), key=jax.random.key(0), temperature=1.0, **kw)
    key = jax.random.key(1)
    with count_compilations() as compiled:
        specjax.decode(bigram_pair, [[4, 4], [5]], rule=mars(theta=0.9), key=key, temperature=0.7, **kw)
    assert compiled["n"] == 0
    with count_compilations() as compiled:
        specjax.decode(bigram_pair, prompts, rule=mars(theta=0.9, variant="authors"), key=key, temperature=0.7,
                       **kw)
    assert compiled["n"] >= 1  # a static field (the variant) is part of the program


@pytest.mark.parametrize("make, low, high, temperature", [
    (mars, 1.0, 0.01, 0.0),  # theta: 1.0 is lossless, 0.01 accepts nearly any top-2 token
    (lambda t: specjax.rules.ears(beta=t), 0.0, 1.0, 1.0),  # EARS pardons only when sampling
    (lambda t: specjax.rules.additive(t), 0.0, 0.9, 1.0),
])
def test_numeric_hyper_parameters_are_traced(make, low, high, temperature):
    """Another value of a rule's number reuses the program, and is really used."""
    # Shifted up so every logit is positive: MARS's ratio test needs z(1) > 0.
    bigram_pair = specjax.pair(bigram_model(random_table(0, VOCAB) + 8.0), bigram_model(random_table(1, VOCAB) + 8.0))
    prompts = random_prompts(11, 8, VOCAB, 4)
    kw = dict(num_draft=3, max_new_tokens=24, eos_token_id=(), key=jax.random.key(2), temperature=temperature)
    strict = specjax.decode(bigram_pair, prompts, rule=make(low), **kw)
    with count_compilations() as compiled:
        loose = specjax.decode(bigram_pair, prompts, rule=make(high), **kw)
        jax.block_until_ready(loose.tokens)
    assert compiled["n"] == 0
    assert int(np.sum(loose.stats.accepted)) > int(np.sum(strict.stats.accepted))


def test_policy_thresholds_are_traced(bigram_pair):
    from specjax.drafting import confidence

    prompts = random_prompts(12, 8, VOCAB, 4)
    kw = dict(num_draft=4, max_new_tokens=24, eos_token_id=(), temperature=0.0)
    eager = specjax.decode(bigram_pair, prompts, drafting=confidence(0.0), **kw)
    with count_compilations() as compiled:
        timid = specjax.decode(bigram_pair, prompts, drafting=confidence(0.99), **kw)
        jax.block_until_ready(timid.tokens)
    assert compiled["n"] == 0
    assert int(np.sum(timid.stats.drafted)) < int(np.sum(eager.stats.drafted))
    np.testing.assert_array_equal(np.asarray(timid.tokens), np.asarray(eager.tokens))  # greedy: lossless


# Standard bigram sampling runs share one shape: S_BATCH prompts padded to S_WIDTH.
S_BATCH, S_WIDTH, S_KW = 16, 6, dict(num_draft=4, max_new_tokens=20, eos_token_id=7)


def sample_bigram(pair, prompts, key):
    arr, lens = padded(prompts, S_WIDTH)
    return specjax.decode(pair, arr, prompt_lengths=lens, key=key, **S_KW)


def test_batch_invariance_bigram(bigram_pair):
    prompts = random_prompts(5, S_BATCH, VOCAB, S_WIDTH)
    keys = jax.random.split(jax.random.key(3), S_BATCH)
    batch = sample_bigram(bigram_pair, prompts, keys)
    for i in range(0, S_BATCH, 3):
        alone = sample_bigram(bigram_pair, prompts[i : i + 1], keys[i : i + 1])
        np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(batch.tokens)[i])
        assert int(alone.lengths[0]) == int(batch.lengths[i])
        assert int(alone.stats.cycles[0]) == int(batch.stats.cycles[i])
    # One key for the batch means fold_in(key, i) for sequence i.
    single = sample_bigram(bigram_pair, prompts, jax.random.key(9))
    for i in (0, 7):
        alone = sample_bigram(bigram_pair, prompts[i : i + 1], jax.random.fold_in(jax.random.key(9), i)[None])
        np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(single.tokens)[i])
    again = sample_bigram(bigram_pair, prompts, jax.random.key(9))
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(single.tokens))


def test_batch_invariance_and_determinism_decoder(decoder_pair):
    """A sequence's output does not depend on its companions; a key fixes it."""
    n = DEC_BATCH
    a = random_prompts(11, n, 96, 12)
    b = [a[0]] + random_prompts(12, n - 1, 96, 12)
    keys_a = jax.random.split(jax.random.key(5), n)
    keys_b = jnp.concatenate([keys_a[:1], jax.random.split(jax.random.key(6), n - 1)])
    arr_a, lens_a = padded(a, 12)
    arr_b, lens_b = padded(b, 12)
    out_a = specjax.decode(decoder_pair, arr_a, prompt_lengths=lens_a, key=keys_a, **DEC_SHAPE)
    out_b = specjax.decode(decoder_pair, arr_b, prompt_lengths=lens_b, key=keys_b, **DEC_SHAPE)
    np.testing.assert_array_equal(np.asarray(out_a.tokens)[0], np.asarray(out_b.tokens)[0])
    again = specjax.decode(decoder_pair, arr_a, prompt_lengths=lens_a, key=keys_a, **DEC_SHAPE)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(out_a.tokens))
    other = specjax.decode(decoder_pair, arr_a, prompt_lengths=lens_a, key=jax.random.split(jax.random.key(99), n), **DEC_SHAPE)
    assert (np.asarray(other.tokens) != np.asarray(out_a.tokens)).any()


def sample_generate(model, prompts, key):
    arr, lens = padded(prompts, 4)
    return specjax.generate(model, arr, prompt_lengths=lens, max_new_tokens=9, key=key, top_p=0.9)


def test_generate_is_deterministic_and_batch_invariant(bigram_pair):
    prompts = random_prompts(8, 4, VOCAB, 4)
    keys = jax.random.split(jax.random.key(0), 4)
    out = sample_generate(bigram_pair.target, prompts, keys)
    again = sample_generate(bigram_pair.target, prompts, keys)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(again.tokens))
    companions = [prompts[2]] + random_prompts(9, 3, VOCAB, 4)
    other = sample_generate(bigram_pair.target, companions, jnp.concatenate([keys[2:3], keys[:3]]))
    np.testing.assert_array_equal(np.asarray(other.tokens)[0], np.asarray(out.tokens)[2])


# ---------------------------------------------------------------------------
# Stats
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_draft", [3])
def test_stats_when_draft_equals_target(num_draft):
    model = bigram_model(random_table(0, VOCAB))
    pair = specjax.pair(model, model)
    n = 1 + 3 * (num_draft + 1)  # the prefill's first token, then 3 cycles of K + 1
    out = specjax.decode(pair, [[1], [2, 3], [4, 5, 6]], num_draft=num_draft, max_new_tokens=n, key=jax.random.key(0))
    s = out.stats
    np.testing.assert_array_equal(np.asarray(s.cycles), 3)
    np.testing.assert_array_equal(np.asarray(s.drafted), 3 * num_draft)
    np.testing.assert_array_equal(np.asarray(s.accepted), 3 * num_draft)
    np.testing.assert_array_equal(np.asarray(s.judged), 3 * num_draft)
    np.testing.assert_array_equal(np.asarray(s.accepted_at), 3)
    np.testing.assert_array_equal(np.asarray(s.reached_at), 3)
    np.testing.assert_array_equal(np.asarray(s.drafted_at), 3)
    assert s.tau == num_draft + 1
    assert s.acceptance_rate == 1.0 and s.accepted_per_drafted == 1.0
    np.testing.assert_array_equal(s.acceptance_at_position, 1.0)
    np.testing.assert_array_equal(s.prefix_acceptance, 1.0)
    assert s.accepted_by_path_total == {"exact": 9 * num_draft, "relaxed": 0, "pardon": 0}
    assert int(s.target_forwards) == 3 and int(s.draft_forwards) == 3 * num_draft
    summary = s.summary()
    assert all(isinstance(v, float) for v in summary.values())
    assert summary["tau"] == num_draft + 1 and "tau=" in str(s)


def test_stats_when_draft_never_agrees():
    table = random_table(0, VOCAB)
    # Draft table: every row's argmax moved away from the target's argmax.
    draft = table.copy()
    for r in range(VOCAB):
        draft[r, np.argmax(table[r])] = -10.0
        draft[r, (np.argmax(table[r]) + 1) % VOCAB] = 10.0
    pair = specjax.pair(bigram_model(table), bigram_model(draft))
    out = greedy_bigram(pair, random_prompts(3, G_BATCH, VOCAB, G_WIDTH), num_draft=5)
    s = out.stats
    assert s.acceptance_rate == 0.0 and s.tau == 1.0
    np.testing.assert_array_equal(np.asarray(s.cycles), np.asarray(out.lengths) - 1)  # after the prefill's token
    # Each cycle judges slot 0 only (rejected, correction committed).
    np.testing.assert_array_equal(np.asarray(s.judged), np.asarray(s.cycles))
    np.testing.assert_array_equal(np.asarray(s.reached_at)[:, 1:], 0)


def test_the_first_token_comes_from_the_prefill_with_no_forward_of_its_own(bigram_pair):
    """One new token takes no cycle: the prefill's logits at the prompt's last position give it
    (the bigram's row of that token); a second one takes one cycle (the control)."""
    table = np.asarray(bigram_pair.target.params["table"])
    prompts = [[1, 2], [3], [4, 6, 5]]
    one = specjax.decode(bigram_pair, prompts, num_draft=3, max_new_tokens=1, temperature=0.0, eos_token_id=())
    assert one.to_lists() == [[int(np.argmax(table[p[-1]]))] for p in prompts]
    s = one.stats
    assert int(np.sum(s.cycles)) == 0 and int(s.target_forwards) == 0 and int(s.draft_forwards) == 0
    two = specjax.decode(bigram_pair, prompts, num_draft=3, max_new_tokens=2, temperature=0.0, eos_token_id=())
    assert [t[:1] for t in two.to_lists()] == one.to_lists()
    np.testing.assert_array_equal(np.asarray(two.stats.cycles), 1)
    assert int(two.stats.target_forwards) == 1


def test_stats_are_consistent(bigram_pair):
    out = sample_bigram(bigram_pair, random_prompts(2, S_BATCH, VOCAB, S_WIDTH), jax.random.key(1))
    s = out.stats
    cycles, drafted, accepted, judged = (np.asarray(x) for x in (s.cycles, s.drafted, s.accepted, s.judged))
    tokens = np.asarray(s.tokens)
    np.testing.assert_array_equal(tokens, np.asarray(out.lengths) - 1)  # the first token is the prefill's
    assert s.tau == pytest.approx(tokens.sum() / cycles.sum())
    assert s.acceptance_rate == pytest.approx(accepted.sum() / judged.sum())
    assert s.accepted_per_drafted == pytest.approx(accepted.sum() / drafted.sum())
    assert s.acceptance_rate > s.accepted_per_drafted  # drafts after a rejection are not judged
    np.testing.assert_array_equal(np.asarray(s.accepted_at).sum(1), accepted)
    np.testing.assert_array_equal(np.asarray(s.reached_at).sum(1), judged)
    np.testing.assert_array_equal(np.asarray(s.drafted_at).sum(1), drafted)
    np.testing.assert_array_equal(np.asarray(s.accepted_by_path).sum(1), accepted)
    assert (np.diff(np.asarray(s.accepted_at), axis=1) <= 0).all()  # acceptance is a prefix
    assert (np.diff(np.asarray(s.reached_at), axis=1) <= 0).all()
    assert (accepted <= judged).all() and (judged <= accepted + cycles).all()
    # Only committed drafts count: every cycle but a sequence's last commits its
    # correction / bonus token on top of its accepted drafts.
    assert ((tokens - accepted <= cycles) & (tokens - accepted >= cycles - 1)).all()
    assert (tokens >= cycles).all()
    np.testing.assert_allclose(s.tau_per_sequence, tokens / cycles)
    for rates in (s.acceptance_at_position, s.prefix_acceptance):
        assert rates.shape == (4,) and np.all((rates >= 0) & (rates <= 1))
    # Cycles at tau < K + 1 at least once: both paths exercised.
    assert 0.0 < s.acceptance_rate < 1.0


# ---------------------------------------------------------------------------
# Hooks: hidden states for rules, diagnostics into stats
# ---------------------------------------------------------------------------


def test_hidden_state_hook_and_diagnostics(bigram_pair):
    base = speculative_sampling()
    seen = {}

    def verify(inputs, state, *, greedy):
        seen["shape"] = inputs.features["hidden"][-1].shape
        return base.verify(inputs, state, greedy=greedy)

    probe = from_functions(verify, init=base.init, update=base.update, name="probe", hidden_layers=(-1,))

    def diagnostics(inputs, verdict, num_accepted):
        # For the bigram, the hidden state at a draft token's position is the
        # target's raw logits there: the row that judges the next slot.
        err = jnp.abs(inputs.features["hidden"][-1] - inputs.target_logits[1:]).max()
        return {"cycles": jnp.int32(1), "hidden_err": err, "accepted": num_accepted}

    out = specjax.decode(
        bigram_pair, [[1, 2], [3]], rule=probe, num_draft=3, max_new_tokens=9, temperature=0.0,
        diagnostics=diagnostics,
    )
    assert seen["shape"] == (3, VOCAB)
    extra = out.stats.extra
    np.testing.assert_array_equal(np.asarray(extra["cycles"]), np.asarray(out.stats.cycles))
    np.testing.assert_array_equal(np.asarray(extra["accepted"]), np.asarray(out.stats.accepted))
    assert float(np.max(extra["hidden_err"])) == 0.0
    assert "extra_cycles" in out.stats.summary()


def test_rule_state_is_carried_per_sequence():
    """A stateful rule that rejects everything for its first 3 cycles, then is
    lossless; with draft == target every later cycle commits K + 1 tokens."""
    base = speculative_sampling()

    def verify(inputs, state, *, greedy):
        verdict = base.verify(inputs, state, greedy=greedy)
        warm = state >= 3
        return verdict._replace(accept=verdict.accept & warm, path=jnp.where(warm, verdict.path, Path.REJECTED))

    def update(state, inputs, verdict, num_accepted, *, greedy):
        return state + 1

    rule = from_functions(verify, init=lambda: jnp.int32(0), update=update, name="warm_up")
    model = bigram_model(random_table(0, VOCAB))
    k = 3
    # The prefill's first token, 3 one-token cycles, then 2 cycles of K + 1 tokens, for each sequence.
    out = specjax.decode(specjax.pair(model, model), [[1], [2, 3]], rule=rule, num_draft=k,
                         max_new_tokens=1 + 3 + 2 * (k + 1), temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.stats.cycles), 5)
    np.testing.assert_array_equal(np.asarray(out.stats.accepted), 2 * k)
    ref = specjax.generate(model, [[1], [2, 3]], max_new_tokens=1 + 3 + 2 * (k + 1), temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))


def test_defaults_work_with_a_lossy_rule(bigram_pair):
    out = specjax.decode(bigram_pair, [[1, 2, 3], [4]], rule=mars(theta=0.9), key=jax.random.key(0))
    assert out.tokens.shape == (2, 64)
    np.testing.assert_array_equal(np.asarray(out.lengths), 64)


def test_padded_vocab_is_truncated():
    """A draft whose table has padding rows pairs with vocab_size= and never emits them."""
    table = random_table(0, VOCAB)
    big = np.full((VOCAB + 4, VOCAB + 4), 50.0, np.float32)  # padding logits would win
    big[:VOCAB, :VOCAB] = table
    pair = specjax.pair(bigram_model(table), bigram_model(big), vocab_size=VOCAB)
    prompts = random_prompts(4, G_BATCH, VOCAB, G_WIDTH)
    greedy = greedy_bigram(pair, prompts, num_draft=5)
    ref = greedy_bigram(pair, prompts)
    np.testing.assert_array_equal(np.asarray(greedy.tokens), np.asarray(ref.tokens))
    assert greedy.stats.acceptance_rate > 0.0


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


def test_bad_arguments_raise_clear_errors(bigram_pair):
    key = jax.random.key(0)
    p = [[1, 2]]
    with pytest.raises(ValueError, match="num_draft"):
        specjax.decode(bigram_pair, p, num_draft=0, key=key)
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            specjax.decode(bigram_pair, p, temperature=bad, key=key)
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            specjax.generate(bigram_pair.target, p, temperature=bad, key=key)
    with pytest.raises(ValueError, match="top_k"):
        specjax.decode(bigram_pair, p, top_k=0, key=key)
    with pytest.raises(ValueError, match="top_p"):
        specjax.decode(bigram_pair, p, top_p=0.0, key=key)
    with pytest.raises(ValueError, match="top_p"):
        specjax.generate(bigram_pair.target, p, top_p=1.5, key=key)
    with pytest.raises(ValueError, match="max_new_tokens"):
        specjax.decode(bigram_pair, p, max_new_tokens=0, key=key)
    with pytest.raises(ValueError, match=r"empty prompt\(s\) at index \[1\]"):
        specjax.decode(bigram_pair, [[1], []], key=key)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        specjax.decode(bigram_pair, [], key=key)
    with pytest.raises(ValueError, match=r"token id 8 .*outside the vocabulary \[0, 8\)"):
        specjax.decode(bigram_pair, [[1, 8]], key=key)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        specjax.decode(bigram_pair, [[1, -1]], key=key)
    with pytest.raises(ValueError, match="ragged array"):
        specjax.decode(bigram_pair, np.array([[1, 2], [3]], dtype=object), key=key)
    with pytest.raises(ValueError, match="prompt_lengths"):
        specjax.decode(bigram_pair, np.ones((2, 3), np.int32), prompt_lengths=[3], key=key)
    with pytest.raises(TypeError, match="PRNG key"):
        specjax.decode(bigram_pair, p, key=0)
    with pytest.raises(TypeError, match="PRNG key"):
        specjax.decode(bigram_pair, p, key=np.ones(3, np.float32))
    # Sampling without a key now draws a fresh, recorded seed (tests/test_defaults.py).
    with pytest.raises(TypeError, match="specjax.pair"):
        specjax.decode(bigram_pair.target, p, key=key)
    with pytest.raises(TypeError, match="AcceptanceRule"):
        specjax.decode(bigram_pair, p, rule="mars", key=key)
    with pytest.raises(ValueError, match="eos_token_id"):
        specjax.decode(bigram_pair, p, eos_token_id=99, key=key)
    with pytest.raises(ValueError, match="flat list of ids"):
        specjax.decode(bigram_pair, p, eos_token_id=[[1, 2]], key=key)
    for bad in (True, float("nan"), 2.5):  # True is not token 1; nor is a float id
        with pytest.raises(TypeError, match="integer token ids"):
            specjax.decode(bigram_pair, p, eos_token_id=bad, key=key)
    with pytest.raises(TypeError, match="prompt_ids is None"):
        specjax.decode(bigram_pair, None, key=key)
    # Integer arguments may be JAX or numpy scalars: the same call as with Python ints.
    plain = specjax.decode(bigram_pair, p, top_k=3, pad_token_id=-1, max_new_tokens=6, key=key)
    scalars = specjax.decode(bigram_pair, p, top_k=jnp.int32(3), pad_token_id=jnp.int32(-1),
                             max_new_tokens=np.int64(6), key=key)
    np.testing.assert_array_equal(np.asarray(plain.tokens), np.asarray(scalars.tokens))
    with pytest.raises(ValueError, match="top_k"):
        specjax.decode(bigram_pair, p, top_k=jnp.float32(3), key=key)
    with pytest.raises(TypeError, match="prompt_lengths must hold integers"):
        specjax.decode(bigram_pair, np.ones((1, 3), np.int32), prompt_lengths=[2.7], key=key)


def test_length_limits():
    short = bigram_model(random_table(0, VOCAB), max_position_embeddings=16)
    pair = specjax.pair(short, short)
    key = jax.random.key(0)
    # 4 + 8 + 4 = 16 positions fit exactly; one more does not.
    specjax.decode(pair, [[1, 2, 3, 4]], num_draft=4, max_new_tokens=8, key=key)
    with pytest.raises(ValueError, match=r"needs 17 positions .*supports 16.*max_new_tokens"):
        specjax.decode(pair, [[1, 2, 3, 4]], num_draft=4, max_new_tokens=9, key=key)
    with pytest.raises(ValueError, match=r"max_length=10 is too short"):
        specjax.decode(pair, [[1, 2]], num_draft=2, max_new_tokens=8, max_length=10, key=key)
    with pytest.raises(ValueError, match="needs 21 positions"):
        specjax.generate(short, [[1] * 5], max_new_tokens=16, key=key)


def test_pair_vocabulary_checks():
    a = bigram_model(random_table(0, 8))
    b = bigram_model(random_table(1, 10))
    with pytest.raises(ValueError, match="vocab_size 8 and the draft 10.*pass vocab_size="):
        specjax.pair(a, b)
    assert specjax.pair(a, b, vocab_size=8).vocab_size == 8
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        specjax.pair(a, b, vocab_size=9)

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def __len__(self):
            return len(self.vocab)

        def get_vocab(self):
            return dict(self.vocab)

    t1 = Tok({f"t{i}": i for i in range(7)})
    t2 = Tok({f"u{i}": i for i in range(7)})
    a_tok = bigram_model(random_table(0, 8), tokenizer=t1)
    b_tok = bigram_model(random_table(1, 10), tokenizer=Tok({f"t{i}": i for i in range(7)}))
    assert specjax.pair(a_tok, b_tok).vocab_size == 7  # padding rows beyond the tokenizer
    with pytest.raises(ValueError, match="tokenizers have different vocabularies"):
        specjax.pair(a_tok, bigram_model(random_table(1, 10), tokenizer=t2))
    with pytest.raises(TypeError, match="specjax.Model"):
        specjax.pair(a, "draft")


def nan_table(row):
    table = random_table(0, VOCAB)
    table[:, row] = -1e9  # unreachable from other rows
    table[row] = np.nan
    return table


def test_nan_logits_raise_floating_point_error():
    good = bigram_model(random_table(0, VOCAB))
    bad = bigram_model(nan_table(5))
    prompts = [[t if t != 5 else 4 for t in p] for p in random_prompts(6, S_BATCH, VOCAB, S_WIDTH)]
    prompts[3] = [2, 5]
    # The draft proposes 5 at times: the target's NaN row after it is never
    # used (5 is rejected), so only sequence 3 is stopped.
    with pytest.raises(FloatingPointError, match=r"in sequence 3 \(target model\); ") as info:
        sample_bigram(specjax.pair(bad, good), prompts, jax.random.key(0))
    partial = info.value.output
    assert int(partial.lengths[3]) == 0 and int(np.sum(partial.lengths)) > 0
    # The target's first token for sequence 0 is 5 (after 7, which no other sequence reaches): the
    # draft's NaN row after it stops that sequence alone.
    greedy = [[t if t not in (5, 7) else 4 for t in p] for p in random_prompts(7, G_BATCH, VOCAB, G_WIDTH)]
    greedy[0] = [2, 7]
    only_7_to_5 = random_table(0, VOCAB)
    only_7_to_5[:, [5, 7]] = -1e9
    only_7_to_5[7, 5] = 10.0
    with pytest.raises(FloatingPointError, match=r"in sequence 0 \(draft model\); "):
        greedy_bigram(specjax.pair(bigram_model(only_7_to_5), bad), greedy, num_draft=5)
    with pytest.raises(FloatingPointError, match=r"in sequence 1 \(target model\); "):
        sample_generate(bad, [[1], [5], [2], [3]], jax.random.split(jax.random.key(0), 4))
