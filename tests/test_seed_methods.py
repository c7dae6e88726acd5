"""The seed methods as published: MARS's two sampling forms against reference
simulations written from the paper and the authors' code, and the support guard
of EARS / AdaSD (never emit a token the warped target excluded)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.rules import adasd, ears, mars, speculative_sampling
from tests.test_rules import batched_verify, block, random_batch


def authors_chain_reference(tl, dp, tokens, uniforms, theta):
    """The authors' ``evaluate_posterior`` (sampling) on one chain, in NumPy:
    returns (number accepted, correction distribution after the last one)."""
    k = len(tokens)
    for i in range(k):
        z = tl[i]
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-z, kind="stable")
        ratio = z[order[1]] / (z[order[0]] + 1e-10)
        x = int(tokens[i])
        if ratio > theta:
            if z[x] >= z[order[1]]:  # in the top-2 (ties generous)
                continue
            return i, p  # rejected outright; sample from unmodified p
        q = max(dp[i, x], 1e-10)
        if uniforms[i] <= min(1.0, p[x] / q):
            continue
        adjusted = p.copy()
        adjusted[x] = max(0.0, p[x] - dp[i, x])
        return i, adjusted / adjusted.sum()
    return k, None


def _prefix(accept):
    return int(np.cumprod(np.asarray(accept)).sum())


def test_mars_authors_variant_matches_the_authors_code():
    inputs = random_batch(0, batch=300, k=5, v=6, scale=1.5)
    for theta in (0.3, 0.9):
        verdict = batched_verify(mars(theta, variant="authors"), inputs, greedy=False)
        relaxed_seen = 0
        for b in range(300):
            tl = np.asarray(inputs.target_logits[b])
            n, correction = authors_chain_reference(tl, np.asarray(inputs.draft_probs[b]),
                                                    np.asarray(inputs.draft_tokens[b]),
                                                    np.asarray(inputs.uniforms[b]), theta)
            got = _prefix(verdict.accept[b])
            assert got == n, (theta, b)
            if correction is not None:
                np.testing.assert_allclose(np.asarray(verdict.correction[b, n]), correction, atol=1e-6)
            relaxed_seen += int((np.asarray(verdict.path[b]) == 1).sum() > 0)
        assert relaxed_seen > 0


def test_mars_variants_differ_where_the_paper_form_keeps_the_lossless_test():
    # Slot 0: low margin (z = [3, 2.9, 0]), draft token 2 is not top-2 but p/q >= U.
    tl = np.array([[3.0, 2.9, 0.0], [1.0, 0.0, 0.0]])
    dl = np.log(np.array([[0.45, 0.45, 0.1], [0.3, 0.3, 0.4]]))
    inputs = block(tl, dl, [2, 0], uniforms=[0.01, 0.5])
    paper = mars(0.9).verify(inputs, (), greedy=False)
    authors = mars(0.9, variant="authors").verify(inputs, (), greedy=False)
    assert bool(paper.accept[0]) and not bool(authors.accept[0])
    p0 = np.asarray(jax.nn.softmax(jnp.asarray(tl[0])))
    np.testing.assert_allclose(np.asarray(authors.correction[0]), p0, atol=1e-6)  # unmodified p


def test_mars_paper_form_is_lossless_at_theta_one_and_the_authors_form_is_not():
    inputs = random_batch(1, batch=200, k=4, v=6)
    sd = batched_verify(speculative_sampling(), inputs, greedy=False)
    paper = batched_verify(mars(1.0), inputs, greedy=False)
    np.testing.assert_array_equal(np.asarray(paper.accept), np.asarray(sd.accept))
    np.testing.assert_allclose(np.asarray(paper.correction), np.asarray(sd.correction), atol=1e-7)
    authors = batched_verify(mars(1.0, variant="authors"), inputs, greedy=False)
    assert not np.allclose(np.asarray(authors.correction), np.asarray(sd.correction), atol=1e-3)


def _excluded_block():
    """Slot 0's draft token 2 was cut by the target's top-k (logit -inf, p = 0)."""
    tl = np.array([[2.0, 1.0, -np.inf, -np.inf], [1.0, 1.0, 1.0, 1.0]])
    dl = np.log(np.array([[0.1, 0.1, 0.7, 0.1], [0.25, 0.25, 0.25, 0.25]]))
    return block(tl, dl, [2, 0], uniforms=[0.001, 0.5])


def test_ears_never_pardons_a_token_the_target_excluded_unless_asked():
    inputs = _excluded_block()
    assert not bool(ears(0.2).verify(inputs, (), greedy=False).accept[0])
    assert bool(ears(0.2, allow_excluded=True).verify(inputs, (), greedy=False).accept[0])


def test_adasd_never_accepts_a_token_the_target_excluded_unless_asked():
    inputs = _excluded_block()
    # A state whose threshold accepts everything (JS distance < 1 always).
    state = adasd().init()._replace(accepted_sum=jnp.float32(1.0), accepted_count=jnp.float32(1.0),
                                    rejected_sum=jnp.float32(1.0), rejected_count=jnp.float32(1.0))
    assert not bool(adasd().verify(inputs, state, greedy=False).accept[0])
    assert bool(adasd(allow_excluded=True).verify(inputs, state, greedy=False).accept[0])
