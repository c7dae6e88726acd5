"""Block verification (arXiv:2403.10444): the paper's example, the exact output law
of one block, the engine's output law, and what it gains over token verification."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.rules import (
    Verdict,
    VerifyInputs,
    block_verification,
    from_functions,
    lossless_decision,
    parse_rule,
    speculative_sampling,
)
from test_decode import exact_two_token_distribution, goodness_of_fit, two_token_counts

GRID = 240  # uniforms on a midpoint grid per slot: exact up to O(1 / GRID)


def _grid_uniforms(k: int) -> np.ndarray:
    axis = (np.arange(GRID) + 0.5) / GRID
    return np.stack(np.meshgrid(*([axis] * k), indexing="ij"), -1).reshape(-1, k).astype(np.float32)


def _block_outcomes(rule, draft, q_rows, p_rows):
    """For one draft block: ``(P(n = t) for t = 0..K, correction rows [K, V])``,
    averaging the rule over the uniform grid."""
    k = len(draft)
    inputs = VerifyInputs(
        draft_tokens=jnp.asarray(draft, jnp.int32),
        draft_logits=jnp.log(jnp.asarray(q_rows, jnp.float32)),
        draft_probs=jnp.asarray(q_rows, jnp.float32),
        target_logits=jnp.log(jnp.asarray(p_rows, jnp.float32)),
        target_probs=jnp.asarray(p_rows, jnp.float32),
        uniforms=jnp.zeros((k,), jnp.float32),
        valid=jnp.ones((k,), bool),
        features={},
    )

    @jax.jit
    def accepted(u):
        verdict = rule.verify(inputs._replace(uniforms=u), (), greedy=False)
        return jnp.cumprod(verdict.accept.astype(jnp.int32)).sum(), verdict.correction

    n, corrections = jax.vmap(accepted)(jnp.asarray(_grid_uniforms(k)))
    n = np.asarray(n)
    # The correction at a given n does not depend on the uniforms (the rules here).
    return np.bincount(n, minlength=k + 1) / len(n), np.asarray(corrections[0], np.float64)


def _tables(vocab, depth, seed, power=2.0):
    """Context-dependent target and draft laws: prefix tuple -> distribution."""
    rng = np.random.default_rng(seed)
    p, q = {}, {}
    for length in range(depth + 2):
        for prefix in itertools.product(range(vocab), repeat=length):
            a, b = rng.random(vocab) ** power + 1e-3, rng.random(vocab) ** power + 1e-3
            p[prefix], q[prefix] = a / a.sum(), b / b.sum()
    return p, q


def _output_law(rule, p, q, vocab, k):
    """Exact law of the first K + 1 tokens: one block verified by ``rule``, the rest
    sampled from the target (what the next cycles do); and E[accepted drafts]."""

    def target_prob(seq):
        return float(np.prod([p[tuple(seq[:i])][seq[i]] for i in range(len(seq))]))

    law, mean_accepted = {}, 0.0
    for draft in itertools.product(range(vocab), repeat=k):
        q_draft = float(np.prod([q[draft[:i]][draft[i]] for i in range(k)]))
        q_rows = np.stack([q[draft[:i]] for i in range(k)])
        p_rows = np.stack([p[draft[:i]] for i in range(k + 1)])
        probs_n, corrections = _block_outcomes(rule, draft, q_rows, p_rows)
        mean_accepted += q_draft * float(np.dot(probs_n, np.arange(k + 1)))
        for n, pn in enumerate(probs_n):
            if pn == 0:
                continue
            emit = p_rows[k] if n == k else corrections[n]
            for y in range(vocab):
                prefix = draft[:n] + (y,)
                for tail in itertools.product(range(vocab), repeat=k + 1 - len(prefix)):
                    seq = prefix + tail
                    rest = target_prob(seq) / target_prob(prefix)
                    law[seq] = law.get(seq, 0.0) + q_draft * pn * emit[y] * rest
    err = max(abs(law.get(seq, 0.0) - target_prob(seq)) for seq in itertools.product(range(vocab), repeat=k + 1))
    return err, mean_accepted


def test_the_papers_binary_example():
    """p = (1/3, 2/3), q = (2/3, 1/3), two drafts: token verification accepts 10/9
    tokens per block, block verification 11/9 (the paper's section 3 example)."""
    p = {pre: np.array([1 / 3, 2 / 3]) for k in range(4) for pre in itertools.product(range(2), repeat=k)}
    q = {pre: np.array([2 / 3, 1 / 3]) for pre in p}
    err_token, token = _output_law(speculative_sampling(), p, q, 2, 2)
    err_block, block = _output_law(block_verification(), p, q, 2, 2)
    assert abs(token - 10 / 9) < 0.01 and abs(block - 11 / 9) < 0.01, (token, block)
    assert err_token < 0.01 and err_block < 0.01


# The three-draft block takes 30 s of the default run's time: slow-only.
@pytest.mark.parametrize("vocab,k,seed", [(3, 2, 0), (3, 2, 1), pytest.param(2, 3, 2, marks=pytest.mark.slow)])
def test_one_block_follows_the_targets_law_and_accepts_more(vocab, k, seed):
    p, q = _tables(vocab, k, seed)
    err, block = _output_law(block_verification(), p, q, vocab, k)
    _, token = _output_law(speculative_sampling(), p, q, vocab, k)
    assert err < 0.01, err
    assert block >= token - 0.005, (block, token)


def test_the_law_check_catches_a_wrong_correction():
    """The same exact-law check fails a block rule that resamples from p on rejection."""
    rule = block_verification()

    def verify(inputs, state, *, greedy):
        verdict = rule.verify(inputs, state, greedy=greedy)
        return Verdict(verdict.accept, verdict.path, inputs.target_probs[: inputs.draft_tokens.shape[0]])

    p, q = _tables(3, 2, 0)
    err, _ = _output_law(from_functions(verify, name="wrong"), p, q, 3, 2)
    assert err > 0.02, err


def _random_inputs(seed, vocab, k, *, over_drafted=False, valid=None):
    """One block of random target / draft logits: random draft tokens, or with
    ``over_drafted`` each slot's most over-drafted token (p < q: not always accepted)."""
    rng = np.random.default_rng(seed)
    logits_p = jnp.asarray(rng.normal(size=(k + 1, vocab)), jnp.float32)
    logits_q = jnp.asarray(rng.normal(size=(k, vocab)), jnp.float32)
    if over_drafted:
        tokens = jnp.argmax(jax.nn.softmax(logits_q) - jax.nn.softmax(logits_p[:k]), -1)
    else:
        tokens = jnp.asarray(rng.integers(0, vocab, k))
    return VerifyInputs(
        draft_tokens=tokens.astype(jnp.int32), draft_logits=logits_q, draft_probs=jax.nn.softmax(logits_q),
        target_logits=logits_p, target_probs=jax.nn.softmax(logits_p),
        uniforms=jnp.asarray(rng.random(k), jnp.float32),
        valid=jnp.ones((k,), bool) if valid is None else jnp.asarray(valid), features={},
    )


def _first_slots(inputs, n):
    """The block cut to its first ``n`` draft slots (and the ``n + 1`` target rows)."""
    return inputs._replace(draft_tokens=inputs.draft_tokens[:n], draft_logits=inputs.draft_logits[:n],
                           draft_probs=inputs.draft_probs[:n], target_logits=inputs.target_logits[:n + 1],
                           target_probs=inputs.target_probs[:n + 1], uniforms=inputs.uniforms[:n],
                           valid=inputs.valid[:n])


def test_greedy_is_exact_match_and_a_one_draft_block_is_token_verification():
    inputs = _random_inputs(3, 6, 4)
    got = block_verification().verify(inputs, (), greedy=True)
    want, correction = lossless_decision(inputs, greedy=True)
    np.testing.assert_array_equal(np.asarray(got.accept), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got.correction), np.asarray(correction))
    one = _first_slots(inputs, 1)
    for u in np.linspace(0.01, 0.99, 25):
        a = block_verification().verify(one._replace(uniforms=jnp.asarray([u], jnp.float32)), (), greedy=False)
        b = speculative_sampling().verify(one._replace(uniforms=jnp.asarray([u], jnp.float32)), (), greedy=False)
        assert bool(a.accept[0]) == bool(b.accept[0])
        np.testing.assert_allclose(np.asarray(a.correction), np.asarray(b.correction), atol=1e-6)


def test_slots_the_drafting_policy_left_empty_are_never_accepted():
    """With v < K valid slots the block ends at v: the last valid slot is judged
    with nothing drafted after it, and empty slots are never accepted."""
    k = 4
    inputs = _random_inputs(4, 5, k, over_drafted=True, valid=[True, True, False, False])
    u = jnp.asarray(np.random.default_rng(5).random((2000, k)), jnp.float32)
    verdicts = jax.vmap(lambda u: block_verification().verify(inputs._replace(uniforms=u), (), greedy=False))(u)
    accept = np.asarray(verdicts.accept)
    assert not accept[:, 2:].any()
    assert accept[:, 1].any() and (~accept[:, 1]).any()
    # the same as a two-slot block
    two = _first_slots(inputs, 2)
    short = jax.vmap(lambda u: block_verification().verify(two._replace(uniforms=u), (), greedy=False))(u[:, :2])
    np.testing.assert_array_equal(accept[:, :2], np.asarray(short.accept))


@pytest.mark.parametrize("num_draft,temperature,top_k", [(3, 1.0, None), (4, 1.3, 5)])
def test_decoding_follows_the_targets_law(bigram_pair, num_draft, temperature, top_k):
    table = np.asarray(bigram_pair.target.params["table"])
    expected = exact_two_token_distribution(table, 3, temperature, top_k, None)
    counts = two_token_counts(bigram_pair, rule=parse_rule("block"), num_draft=num_draft,
                              temperature=temperature, top_k=top_k, top_p=None)
    pvalue, tv = goodness_of_fit(counts, expected)
    assert pvalue > 1e-3, f"chi-square p={pvalue:.2e}, TV={tv:.4f}"
    assert tv < 0.03


def test_decoding_accepts_more_than_token_verification(bigram_pair):
    prompts = [[3, 1, 4], [1, 5], [2, 6, 5, 3]] * 64
    kw = dict(num_draft=4, max_new_tokens=24, temperature=1.0, key=jax.random.key(0))
    token = specjax.decode(bigram_pair, prompts, rule=speculative_sampling(), **kw).stats
    block = specjax.decode(bigram_pair, prompts, rule=block_verification(), **kw).stats
    tau = [float(np.sum(s.tokens) / np.sum(s.cycles)) for s in (token, block)]
    assert tau[1] > tau[0] * 1.02, tau
    greedy = dict(kw, temperature=0.0)
    a = specjax.decode(bigram_pair, prompts, rule=speculative_sampling(), **greedy)
    b = specjax.decode(bigram_pair, prompts, rule=block_verification(), **greedy)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
