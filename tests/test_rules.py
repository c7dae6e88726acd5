"""Acceptance rules: hand-built units, numpy references, limits, combinators, parsing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.spatial.distance
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax import rules as R
from specjax.rules import Path, RuleSpec, VerifyInputs

# ----------------------------------------------------------------------------- helpers


def block(target_logits, draft_logits, tokens, uniforms=None, valid=None):
    """VerifyInputs for one sequence from explicit logits (float32)."""
    tl = jnp.asarray(target_logits, jnp.float32)
    dl = jnp.asarray(draft_logits, jnp.float32)
    tokens = jnp.asarray(tokens, jnp.int32)
    k = tokens.shape[0]
    if tl.shape[0] == k:  # add a bonus row when the test does not care about it
        tl = jnp.concatenate([tl, tl[-1:]], 0)
    uniforms = jnp.full((k,), 0.5) if uniforms is None else jnp.asarray(uniforms, jnp.float32)
    valid = jnp.ones((k,), bool) if valid is None else jnp.asarray(valid, bool)
    return VerifyInputs(tokens, dl, jax.nn.softmax(dl), tl, jax.nn.softmax(tl), uniforms, valid, {})


def from_probs(target_probs, draft_probs, tokens, uniforms=None, valid=None):
    return block(np.log(np.asarray(target_probs)), np.log(np.asarray(draft_probs)), tokens,
                 uniforms, valid)


def softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def random_batch(seed, *, batch=256, k=8, v=8, greedy=False, scale=2.0, any_token=False):
    """A batch of random blocks (numpy, so no compilation): draft logits near the
    target's; the draft token is q's argmax (greedy), a sample from q, or
    (``any_token``) uniform over V so that q(x) can be tiny."""
    rng = np.random.default_rng(seed)
    tl = (scale * rng.standard_normal((batch, k + 1, v))).astype(np.float32)
    dl = (tl[:, :k] + scale * rng.standard_normal((batch, k, v))).astype(np.float32)
    dp = softmax(dl)
    if greedy:
        x = dl.argmax(-1)
    elif any_token:
        x = rng.integers(0, v, (batch, k))
    else:
        x = (dp.cumsum(-1) < rng.uniform(size=(batch, k, 1))).sum(-1).clip(0, v - 1)
    u = rng.uniform(size=(batch, k)).astype(np.float32)
    return jax.tree.map(jnp.asarray, VerifyInputs(x.astype(np.int32), dl, dp, tl, softmax(tl), u,
                                                  np.ones((batch, k), bool), {}))


def batched_verify(rule, inputs, greedy, state=None):
    if state is None:
        state = jax.vmap(lambda _: rule.init())(jnp.arange(inputs.draft_tokens.shape[0]))
    return jax.vmap(functools.partial(rule.verify, greedy=greedy))(inputs, state)


@functools.lru_cache(maxsize=None)
def _jitted_verify(rule, greedy):
    return jax.jit(functools.partial(rule.verify, greedy=greedy))


def verify1(rule, inputs, state=(), *, greedy=False):
    """One sequence, jitted: a single compile is cheaper than eager dispatch on a new shape."""
    return _jitted_verify(rule, greedy)(inputs, state)


def assert_same_verdict(a, b):
    np.testing.assert_array_equal(a.accept, b.accept)
    np.testing.assert_array_equal(a.path, b.path)
    np.testing.assert_array_equal(a.correction, b.correction)


def emitted(verdict, inputs, seed):
    """The engine's next step per sequence: accepted-prefix length and the
    correction (or bonus) token, drawn by the Gumbel trick from fixed noise."""
    accept = np.asarray(verdict.accept)
    b, k = accept.shape
    n = np.argmin(np.concatenate([accept, np.zeros((b, 1), bool)], 1), 1)
    rows = np.concatenate([np.asarray(verdict.correction), np.asarray(inputs.target_probs[:, k:])], 1)
    row = rows[np.arange(b), n]
    gumbel = np.random.default_rng(seed).gumbel(size=row.shape)
    with np.errstate(divide="ignore"):
        return n, np.argmax(np.log(row) + gumbel, -1)


ALL_RULES = {
    "sd": R.speculative_sampling(),
    "block": R.block_verification(),
    "ears": R.ears(0.1),
    "mars": R.mars(0.9),
    "adasd": R.adasd(),
    "typical": R.typical(),
    "additive": R.additive(0.2),
    "multiplicative": R.multiplicative(0.3),
    "top_m": R.top_m(3),
    "any_of": R.any_of(R.speculative_sampling(), R.mars(0.9), R.adasd()),
    "all_of": R.all_of(R.top_m(4), R.ears(0.2)),
}

# -------------------------------------------------------------------------------- MARS


def test_mars_greedy_accepts_top2_exactly_when_ratio_passes():
    rule = R.mars(theta=0.9)
    # slot 0: z = [5, 4.6, 1] r = .92 > .9 -> top-2 accepted (RELAXED)
    # slot 1: z = [5, 4.4, 1] r = .88      -> top-2 rejected, correction top-1
    # slot 2: z = [5, 4.6, 4.59] r = .92   -> third token rejected even so
    # slot 3: z = [5, 4.6, 1] draft = top-1 -> EXACT
    # slot 4: z = [-1, -1.05, -3] (z1 < 0; the naive ratio 1.05 would pass) -> rejected
    # slot 5: z = [0, -0.01, -3] (z1 == 0, ratio undefined) -> rejected
    # slot 6: z = [1e-3, 9.5e-4, 0] small positive logits, r = .95 -> accepted
    tl = [[5, 4.6, 1], [5, 4.4, 1], [5, 4.6, 4.59], [5, 4.6, 1],
          [-1, -1.05, -3], [0, -0.01, -3], [1e-3, 9.5e-4, 0]]
    tokens = [1, 1, 2, 0, 1, 1, 1]
    inputs = block(tl, np.zeros((7, 3)), tokens)
    v = jax.jit(functools.partial(rule.verify, greedy=True))(inputs, ())
    np.testing.assert_array_equal(v.accept, [1, 0, 0, 1, 0, 0, 1])
    R_, E, X = Path.RELAXED, Path.EXACT, Path.REJECTED
    np.testing.assert_array_equal(v.path, [R_, X, X, E, X, X, R_])
    np.testing.assert_array_equal(v.correction.argmax(-1), 0)
    np.testing.assert_allclose(v.correction.sum(-1), 1)


@pytest.mark.parametrize("theta", [0.5, 0.8, 0.9, 0.95])
def test_mars_relaxes_iff_ratio_passes_on_random_logits(theta):
    inputs = random_batch(1, greedy=True, scale=3.0)
    v = batched_verify(R.mars(theta), inputs, True)
    z = np.asarray(inputs.target_logits[:, :8])
    x = np.asarray(inputs.draft_tokens)
    srt = -np.sort(-z, -1)
    z1, z2 = srt[..., 0], srt[..., 1]
    zx = np.take_along_axis(z, x[..., None], -1)[..., 0]
    top1 = zx == z1
    relaxed = (zx == z2) & (z1 > 0) & (z2 / np.where(z1 > 0, z1, 1) > theta) & ~top1
    np.testing.assert_array_equal(v.accept, top1 | relaxed)
    np.testing.assert_array_equal(v.path == Path.RELAXED, relaxed)
    assert relaxed.any() and (~(top1 | relaxed)).any()  # both outcomes exercised


def test_mars_sampling_top2_at_low_margin_else_standard():
    rule = R.mars(0.9)
    # Target logits [5, 4.6, 1] (r = .92): p ~ [.59, .40, .01]; the draft put
    # q(x) = .9, so p/q < .45 and U = .9 makes the lossless test reject.
    tl = np.array([[5, 4.6, 1], [5, 4.4, 1], [5, 4.6, 4.59], [5, 4.6, 1]], np.float32)
    dl = np.log(np.array([[.05, .9, .05]] * 2 + [[.05, .05, .9], [.05, .9, .05]], np.float32))
    inputs = block(tl, dl, [1, 1, 2, 1], uniforms=[.9, .9, .9, .1])
    v = verify1(rule, inputs)
    sd = verify1(R.speculative_sampling(), inputs)
    # slot 0 relaxed; slot 1 (r=.88) and slot 2 (not top-2) fall back to p/q;
    # slot 3 passes the lossless test (U=.1) -> EXACT.
    np.testing.assert_array_equal(sd.accept, [0, 0, 0, 1])
    np.testing.assert_array_equal(v.accept, [1, 0, 0, 1])
    np.testing.assert_array_equal(v.path, [Path.RELAXED, 0, 0, Path.EXACT])
    np.testing.assert_allclose(v.correction, sd.correction)  # residual


def test_mars_top_p_masked_runner_up_is_safe():
    # top-p kept one token: z(2) = -inf must not relax, nor produce NaNs.
    tl = np.array([[3.0, -np.inf, -np.inf]], np.float32)
    inputs = block(tl, np.log(np.array([[.5, .5, 1e-9]], np.float32)), [1], uniforms=[.99])
    for greedy in (True, False):
        v = verify1(R.mars(0.5), inputs, greedy=greedy)
        assert not bool(v.accept[0]) and bool(jnp.isfinite(v.correction).all())


# -------------------------------------------------------------------------------- EARS


def test_ears_pardons_by_hand():
    beta = 0.1
    # p(x) = .2, q(x) = .5: ratio .4; max p = .5 -> tolerance .05.
    p = [[.5, .2, .3]] * 4
    q = [[.3, .5, .2]] * 4
    # U = .3: lossless accepts (EXACT). U = .43: .43 - .05 = .38 <= .4 (PARDON).
    # U = .46: .41 > .4 (reject). U = .449: .399 <= .4 (PARDON).
    inputs = from_probs(p, q, [1, 1, 1, 1], uniforms=[.3, .43, .46, .449])
    v = verify1(R.ears(beta), inputs)
    np.testing.assert_array_equal(v.accept, [1, 1, 0, 1])
    np.testing.assert_array_equal(v.path, [Path.EXACT, Path.PARDON, 0, Path.PARDON])
    # residual norm(max(0, p - q)) = [.2, 0, .1] / .3
    np.testing.assert_allclose(v.correction[2], [2 / 3, 0, 1 / 3], atol=1e-5)
    # greedy: exact match, no pardons
    g = verify1(R.ears(beta), inputs, greedy=True)
    np.testing.assert_array_equal(g.accept, [0, 0, 0, 0])


@pytest.mark.parametrize("greedy,any_token", [(False, False), (False, True), (True, False)])
def test_ears_beta0_is_speculative_sampling(greedy, any_token):
    inputs = random_batch(2, greedy=greedy, any_token=any_token,
                          scale=8.0 if any_token else 2.0)
    if any_token:  # q(x) below the 1e-10 floor occurs, where a naive rewrite would differ
        q = jax.vmap(R.token_prob)(inputs.draft_probs, inputs.draft_tokens)
        assert bool((q < 1e-10).any())
    ears0, sd = R.ears(0.0), R.speculative_sampling()
    a = batched_verify(ears0, inputs, greedy)
    b = batched_verify(sd, inputs, greedy)
    assert_same_verdict(a, b)
    np.testing.assert_array_equal(np.stack(emitted(a, inputs, 3)), np.stack(emitted(b, inputs, 3)))


def test_ears_is_sd_plus_pardons():
    inputs = random_batch(4)
    e = batched_verify(R.ears(0.2), inputs, False)
    s = batched_verify(R.speculative_sampling(), inputs, False)
    assert bool((e.accept | ~s.accept).all())  # SD accepts => EARS accepts
    np.testing.assert_array_equal(e.path == Path.PARDON, e.accept & ~s.accept)
    np.testing.assert_array_equal(e.path == Path.EXACT, s.accept)
    assert int((e.path == Path.PARDON).sum()) > 0


# ------------------------------------------------------------------------------- AdaSD


def test_js_distance_matches_scipy():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(7) * .3, size=50).astype(np.float32)
    q = rng.dirichlet(np.ones(7) * .3, size=50).astype(np.float32)
    p[:5, 0], q[:5, 0] = 0, 0  # zeros are fine
    p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
    ref = [scipy.spatial.distance.jensenshannon(a, b, base=2) for a, b in zip(p, q)]
    # identical and disjoint rows: 0 and 1
    p = np.concatenate([p, p[:1], np.eye(7)[:1]])
    q = np.concatenate([q, p[:1], np.eye(7)[1:2]])
    ref = ref + [0.0, 1.0]
    np.testing.assert_allclose(jax.jit(R.js_distance)(p, q), ref, atol=2e-4)


def test_adasd_threshold_follows_running_means():
    rule = R.adasd()
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(5), size=3)
    q = rng.dirichlet(np.ones(5), size=3)
    d = [scipy.spatial.distance.jensenshannon(a, b, base=2) for a, b in zip(p, q)]
    inputs = from_probs(p, q, [0, 1, 2])
    update = jax.jit(functools.partial(rule.update, greedy=False))
    state = rule.init()
    assert float(R.adasd_threshold(state)) < 0  # nothing seen: no relaxation
    # cycle 1: slot 0 accepted, slot 1 rejected, slot 2 never decided
    state = update(state, inputs, None, jnp.int32(1))
    np.testing.assert_allclose(R.adasd_threshold(state), (d[0] + d[1]) / 2, atol=1e-4)
    # cycle 2: all three accepted, nothing rejected
    state = update(state, inputs, None, jnp.int32(3))
    # cycle 3: slot 0 rejected; slot 2 is not valid (not drafted)
    inputs3 = inputs._replace(valid=jnp.array([True, True, False]))
    state = update(state, inputs3, None, jnp.int32(0))
    # cycle 4: both valid slots accepted; slot 2 invalid so nothing is rejected
    state = update(state, inputs3, None, jnp.int32(2))
    acc = [d[0], d[0], d[1], d[2], d[0], d[1]]
    rej = [d[1], d[0]]
    np.testing.assert_allclose(state.accepted_count, 6)
    np.testing.assert_allclose(state.rejected_count, 2)
    np.testing.assert_allclose(R.adasd_threshold(state), (np.mean(acc) + np.mean(rej)) / 2,
                               atol=1e-4)


def test_adasd_accepts_close_slots_whatever_the_token():
    rule = R.adasd()
    # slot 0: q ~ p (d ~ .06) but the draft token is not the argmax and p/q = .67
    # loses to the coin; slot 1: nearly disjoint distributions (d ~ .9).
    p = np.array([[.6, .3, .1], [.98, .01, .01]])
    q = np.array([[.55, .3, .15], [.01, .01, .98]])
    inputs = from_probs(p, q, [2, 2], uniforms=[.999, .999])
    state = R.AdaSDState(*map(jnp.float32, (0.2, 1.0, 0.8, 1.0)))  # threshold .5
    for greedy in (True, False):
        v = verify1(rule, inputs, state, greedy=greedy)
        np.testing.assert_array_equal(v.accept, [1, 0])
        np.testing.assert_array_equal(v.path, [Path.RELAXED, Path.REJECTED])
        # until both means exist, AdaSD is the standard rule
        only_acc = R.AdaSDState(*map(jnp.float32, (0.2, 1.0, 0.0, 0.0)))
        assert_same_verdict(verify1(rule, inputs, only_acc, greedy=greedy),
                            verify1(R.speculative_sampling(), inputs, greedy=greedy))


# ---------------------------------------------------------- level-set criteria vs numpy


def all_token_inputs(logits):
    """One block per distribution whose slot j drafts token j: the verdict is the
    rule's whole accepted set. ``logits[B, V]`` -> batched inputs with K = V."""
    b, v = logits.shape
    tl = np.repeat(logits[:, None, :], v + 1, axis=1)
    tokens = np.tile(np.arange(v, dtype=np.int32), (b, 1))
    u = np.full((b, v), 0.5, np.float32)
    return jax.tree.map(jnp.asarray, VerifyInputs(tokens, tl[:, :v], softmax(tl[:, :v]), tl,
                                                  softmax(tl), u, np.ones((b, v), bool), {}))


def reference_sets(name, param, z):
    """numpy float64 accepted sets; also a mask of entries far from the boundary."""
    z = z.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = p.max(-1, keepdims=True)
    if name == "typical":
        eps, delta = param
        h = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), -1, keepdims=True)
        score, thr = p, np.minimum(eps, delta * np.exp(-h))
        return p > thr, np.abs(score - thr) > 1e-5
    if name == "additive":
        return p >= top - param, (np.abs(p - (top - param)) > 1e-5) | (p == top)
    if name == "multiplicative":
        return p >= param * top, (np.abs(p - param * top) > 1e-5) | (p == top)
    if name == "top_m":
        rank = (z[:, None, :] > z[:, :, None]).sum(-1)
        return rank < param, np.ones_like(p, bool)
    raise ValueError(name)


FACTORIES = {
    "typical": lambda a: R.typical(*a),
    "additive": R.additive,
    "multiplicative": R.multiplicative,
    "top_m": R.top_m,
}
PARAMS = {
    "typical": st.tuples(st.floats(0.01, 0.5), st.floats(0.05, 2.0)),
    "additive": st.floats(0.0, 1.0),
    "multiplicative": st.floats(0.01, 1.0),
    "top_m": st.integers(1, 9),
}


@pytest.mark.parametrize("name", list(FACTORIES))
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_criteria_accept_exactly_their_level_sets(name, data):
    param = data.draw(PARAMS[name])
    seed = data.draw(st.integers(0, 2**31 - 1))
    scale = data.draw(st.sampled_from([0.5, 2.0, 6.0]))
    rng = np.random.default_rng(seed)
    z = (scale * rng.standard_normal((256, 8))).astype(np.float32)
    z[0, :2] = z[0, 2]  # a three-way tie
    rule = FACTORIES[name](param)
    for greedy in (True, False):
        v = jax.vmap(functools.partial(rule.verify, greedy=greedy))(all_token_inputs(z),
                                                                    jnp.zeros(256))
        want, clear = reference_sets(name, param, z)
        np.testing.assert_array_equal(np.asarray(v.accept)[clear], want[clear])
        # the sampling correction is p restricted to the set; greedy: argmax
        corr = np.asarray(v.correction[:, 0])
        np.testing.assert_allclose(corr.sum(-1), 1, rtol=1e-5)
        if not greedy:  # zero outside the set (unless the set is empty: then p)
            acc = np.asarray(v.accept)
            has = acc.any(-1)
            assert (corr[has][~acc[has]] == 0).all()


def test_typical_ignores_the_draft():
    inputs = random_batch(5)
    flipped = inputs._replace(draft_probs=inputs.draft_probs[:, ::-1], uniforms=1 - inputs.uniforms)
    a = batched_verify(R.typical(), inputs, False)
    b = batched_verify(R.typical(), flipped, False)
    np.testing.assert_array_equal(a.accept, b.accept)


@pytest.mark.parametrize("rule", [R.additive(0.0), R.multiplicative(1.0), R.top_m(1)],
                         ids=["additive_t0", "multiplicative_a1", "top_m1"])
def test_strict_limits_are_greedy_exact_match(rule):
    inputs = random_batch(6, greedy=True)
    a = batched_verify(rule, inputs, True)
    assert_same_verdict(a, batched_verify(R.speculative_sampling(), inputs, True))
    assert int(a.accept.sum()) > 0 and int((~a.accept).sum()) > 0
    # ...and at T > 0 they accept only the argmax and correct to it.
    s = batched_verify(rule, random_batch(7), False)
    np.testing.assert_allclose(s.correction.max(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("theta", [1.0, 1.5])
@pytest.mark.parametrize("greedy", [True, False])
def test_mars_theta_ge_1_is_lossless(theta, greedy):
    inputs = random_batch(8, greedy=greedy, scale=3.0)
    # exact ties z(1) == z(2) in part of the batch: r = 1 must not pass theta = 1
    tl = np.array(inputs.target_logits)
    second = np.argsort(-tl, -1)[:64, :, 1]
    np.put_along_axis(tl[:64], second[..., None], tl[:64].max(-1, keepdims=True), -1)
    inputs = inputs._replace(target_logits=jnp.asarray(tl), target_probs=jnp.asarray(softmax(tl)))
    assert_same_verdict(batched_verify(R.mars(theta), inputs, greedy),
                        batched_verify(R.speculative_sampling(), inputs, greedy))


# --------------------------------------------------------------------------- combinators


def stub(accept, path, fill, name):
    """A fixed-verdict rule with a counter state, for combinator semantics."""

    def verify(inputs, state, *, greedy):
        k, v = inputs.draft_probs.shape
        return R.Verdict(jnp.array(accept, bool), jnp.array(path, jnp.int32),
                         jnp.full((k, v), fill, jnp.float32))

    def update(state, inputs, verdict, num_accepted, *, greedy):
        return state + num_accepted

    return R.from_functions(verify, init=lambda: jnp.int32(0), update=update, name=name)


def test_any_of_and_all_of_semantics():
    E, X, P, RL = Path.EXACT, Path.REJECTED, Path.PARDON, Path.RELAXED
    a = stub([1, 1, 0, 0, 1], [RL, E, X, X, P], 1.0, "a")
    b = stub([1, 0, 1, 0, 1], [P, X, RL, X, E], 2.0, "b")
    c = stub([0, 1, 1, 0, 1], [X, RL, E, X, RL], 3.0, "c")
    inputs = block(np.zeros((5, 4)), np.zeros((5, 4)), [0] * 5)
    any_ = R.any_of(a, b, c)
    v = verify1(any_, inputs, any_.init())
    np.testing.assert_array_equal(v.accept, [1, 1, 1, 0, 1])
    np.testing.assert_array_equal(v.path, [RL, E, E, X, E])  # EXACT if any says so, else first
    np.testing.assert_array_equal(v.correction[:, 0], 1.0)  # the first rule's
    all_ = R.all_of(a, b, c)
    w = verify1(all_, inputs, all_.init())
    np.testing.assert_array_equal(w.accept, [0, 0, 0, 0, 1])
    np.testing.assert_array_equal(w.path, [X, X, X, X, E])
    np.testing.assert_array_equal(w.correction[:, 0], [3, 2, 1, 1, 1])  # first rejecter's
    state = all_.update(all_.init(), inputs, w, jnp.int32(4), greedy=False)
    assert tuple(map(int, state)) == (4, 4, 4)
    assert all_.spec == RuleSpec("all_of", (("rules", (a.spec, b.spec, c.spec)),))
    with pytest.raises(ValueError):
        R.any_of()
    with pytest.raises(ValueError):
        R.all_of(R.mars(), "sd")


def test_any_of_sd_mars_equals_mars_and_carries_adasd_state():
    inputs = random_batch(9)
    combo = R.any_of(R.speculative_sampling(), R.mars(0.9))
    assert_same_verdict(batched_verify(combo, inputs, False),
                        batched_verify(R.mars(0.9), inputs, False))
    rule = R.any_of(R.mars(0.9), R.adasd())
    one = jax.tree.map(lambda x: x[0], inputs)
    state = jax.jit(functools.partial(rule.update, greedy=False))(rule.init(), one, None,
                                                                  jnp.int32(2))
    assert state[0] == () and float(state[1].accepted_count) == 2.0
    assert float(state[1].rejected_count) == 1.0


# ------------------------------------------------------------------- specs and parsing


def test_specs_have_the_documented_names_and_keys():
    assert R.speculative_sampling().spec == RuleSpec("speculative_sampling")
    assert R.ears().spec == RuleSpec("ears", (("beta", 0.1),))
    assert R.mars().spec == RuleSpec("mars", (("theta", 0.9),))
    assert R.adasd().spec == RuleSpec("adasd")
    assert R.typical().spec == RuleSpec("typical", (("eps", 0.09), ("delta", 0.3)))
    assert R.additive(0.3).spec == RuleSpec("additive", (("t", 0.3),))
    assert R.multiplicative(0.1).spec == RuleSpec("multiplicative", (("alpha", 0.1),))
    assert R.top_m(4).spec == RuleSpec("top_m", (("m", 4),))


@pytest.mark.parametrize("rule", list(ALL_RULES.values()) + [
    R.any_of(R.all_of(R.typical(0.05, 0.5), R.top_m(2)), R.ears(0.15)),
    R.mars(1), R.additive(0), R.additive(1)], ids=lambda r: str(r.spec))
def test_str_spec_parses_back(rule):
    assert R.parse_rule(str(rule.spec)).spec == rule.spec
    assert R.rule_from_spec(rule.spec).spec == rule.spec


def test_parse_rule_strings():
    assert R.parse_rule("mars:theta=0.9").spec == R.mars(0.9).spec
    assert R.parse_rule("ears:beta=0.2").spec == R.ears(0.2).spec
    assert R.parse_rule("typical:eps=0.09,delta=0.3").spec == R.typical(0.09, 0.3).spec
    assert R.parse_rule(" typical : delta=0.5 ").spec == R.typical(delta=0.5).spec
    for alias in ("speculative_sampling", "sd", "lossless"):
        assert R.parse_rule(alias).spec == R.speculative_sampling().spec
    for alias in ("block_verification", "block"):
        assert R.parse_rule(alias).spec == R.block_verification().spec
    got = R.parse_rule("any_of(typical:eps=0.09,delta=0.3, mars:theta=0.8, sd)")
    assert got.spec == R.any_of(R.typical(), R.mars(0.8), R.speculative_sampling()).spec
    assert R.parse_rule("top_m:m=3").spec.get("m") == 3


@pytest.mark.parametrize("text,message", [
    ("medusa", "valid rules: speculative_sampling"),
    ("mars:beta=0.1", "valid parameters: theta"),
    ("sd:beta=0.1", "valid parameters: none"),
    ("additive", "needs parameter"),
    ("mars:theta=high", "not a number"),
    ("mars:theta=0.9)", "trailing"),
    ("any_of(sd", "expected ')'"),
    ("mars:theta", "key=value"),
    ("top_m:m=2.5", "integer"),
    ("ears:beta=-0.1", ">= 0"),
    ("", "rule name"),
    ("mars:theta=0.9,theta=0.5", "'theta' given twice"),
    ("any_of(sd,typical:eps=0.1,eps=0.2)", "'eps' given twice"),
])
def test_parse_rule_errors(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        R.parse_rule(text)


def test_rule_spec_with_a_duplicate_key_is_refused():
    with pytest.raises(ValueError, match="'theta' given twice"):
        R.rule_from_spec(RuleSpec("mars", (("theta", 0.9), ("theta", 0.5))))


@pytest.mark.parametrize("make", [
    lambda: R.ears(-0.1), lambda: R.ears(float("nan")), lambda: R.mars(0), lambda: R.mars(-1),
    lambda: R.mars(float("inf")), lambda: R.multiplicative(0), lambda: R.multiplicative(1.1),
    lambda: R.additive(-0.1), lambda: R.additive(1.5), lambda: R.top_m(0), lambda: R.top_m(2.0),
    lambda: R.top_m(True), lambda: R.typical(eps=0), lambda: R.typical(delta=-1),
    lambda: R.typical(eps=float("inf")), lambda: R.ears("0.1"),
])
def test_bad_hyperparameters_raise_at_construction(make):
    with pytest.raises(ValueError):
        make()


# ------------------------------------------------------------- jit, vmap, corrections


@pytest.mark.parametrize("name", list(ALL_RULES))
def test_every_rule_jits_vmaps_and_corrects_to_distributions(name):
    rule = ALL_RULES[name]
    batch = 32

    @jax.jit
    def cycle(inputs_by_mode, state):
        out = []
        for greedy, inputs in zip((True, False), inputs_by_mode):
            v = jax.vmap(functools.partial(rule.verify, greedy=greedy))(inputs, state)
            n = jnp.argmin(jnp.append(v.accept, jnp.zeros((batch, 1), bool), 1), 1)
            upd = jax.vmap(functools.partial(rule.update, greedy=greedy))
            out.append((v, upd(state, inputs, v, n.astype(jnp.int32))))
        return out

    state = jax.vmap(lambda _: rule.init())(jnp.arange(batch))
    inputs = (random_batch(10, greedy=True, batch=batch), random_batch(11, batch=batch))
    perm = np.random.default_rng(0).permutation(batch)
    permuted = jax.tree.map(lambda x: x[perm], (inputs, state))
    for (v, new_state), (pv, _) in zip(cycle(inputs, state), cycle(*permuted)):
        assert v.accept.shape == (batch, 8) and v.accept.dtype == jnp.bool_
        assert v.path.shape == (batch, 8) and v.path.dtype == jnp.int32
        assert bool(((v.path != Path.REJECTED) == v.accept).all())
        assert bool((v.correction >= 0).all())
        np.testing.assert_allclose(v.correction.sum(-1), 1.0, rtol=1e-5)
        assert jax.tree.structure(new_state) == jax.tree.structure(state)
        # a sequence's verdict does not depend on its batch companions
        assert_same_verdict(jax.tree.map(lambda x: x[perm], v), pv)


@pytest.mark.parametrize("m", [1, 2, 3, 9])
def test_largest_values_equals_top_k_with_ties(m):
    from specjax._src.rules.common import largest_values

    rng = np.random.default_rng(m)
    # Few distinct values, so rows have many exact ties; -inf entries too.
    logits = rng.integers(-3, 3, size=(64, 12)).astype(np.float32)
    logits[rng.random(logits.shape) < 0.2] = -np.inf
    got = np.asarray(largest_values(jnp.asarray(logits), m))
    want = np.asarray(jax.lax.top_k(jnp.asarray(logits), m)[0])
    np.testing.assert_array_equal(got, want)
