"""specjax.theory: exact certificates vs brute-force minimisation, bounds, numerics.

Brute force: for every candidate rejected token y, ``min KL(p||q)`` subject to
``q(y) >= q(z)`` for all z. In logits ``q = softmax(theta)`` with ``theta[y] =
0`` this is a smooth convex problem over a box (``theta[z] <= 0``), which a
bounded truncated-Newton solver (TNC) with an analytic gradient solves to ~1e-12
in the objective; logits are boxed to [-60, 60], which costs < e^-60 where the
optimum puts q = 0. So the exact certificate (float64) must agree within
``1e-5`` relative plus ``1e-9`` absolute (the absolute part covers near-ties
where C itself is ~1e-10); a wrong water-fill level or set is off by far more.
The brute force shares nothing with the water-fill formula, and the accepted
sets are recomputed here in numpy from the rules' definitions.

Runtime: compilations dominate on a shared CPU, so library calls are bundled into
a few jitted functions evaluated on batches padded to one shape.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

from specjax import theory
from specjax._src.rules.base import RuleSpec, speculative_sampling
from specjax.rules import criterion, top_m

RTOL, ATOL = 1e-5, 1e-9

GREEDY = RuleSpec("speculative_sampling")
RULES = [
    GREEDY,
    RuleSpec("additive", (("t", 0.3),)),
    RuleSpec("additive", (("t", 0.05),)),
    RuleSpec("multiplicative", (("alpha", 0.1),)),
    RuleSpec("multiplicative", (("alpha", 0.6),)),
    RuleSpec("top_m", (("m", 2),)),
    RuleSpec("top_m", (("m", 3),)),
    RuleSpec("typical", (("eps", 0.09), ("delta", 0.3))),
    RuleSpec("typical", (("eps", 0.3), ("delta", 0.9))),
    RuleSpec("any_of", (("rules", (RuleSpec("top_m", (("m", 2),)), RuleSpec("additive", (("t", 0.3),)))),)),
    RuleSpec("all_of", (("rules", (RuleSpec("top_m", (("m", 3),)), RuleSpec("multiplicative", (("alpha", 0.2),)))),)),
]


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


# ----------------------------------------------------------------------------
# Independent reference implementations (numpy / scipy).


def np_accepted(spec: RuleSpec, p: np.ndarray) -> np.ndarray:
    top = p.max()
    rank = np.empty(len(p), int)
    rank[np.argsort(-p, kind="stable")] = np.arange(len(p))
    name, kw = spec.name, dict(spec.params)
    if name == "speculative_sampling":
        return rank < 1
    if name == "top_m":  # ties at the cut-off by id, zeros out (see theory.accepted_set)
        return (rank < kw["m"]) & (p > 0)
    if name == "additive":
        return p >= top - kw["t"]
    if name == "multiplicative":
        return p >= kw["alpha"] * top
    if name == "typical":
        h = -np.sum(p[p > 0] * np.log(p[p > 0]))
        return p > min(kw["eps"], kw["delta"] * np.exp(-h))
    masks = [np_accepted(c, p) for c in kw["rules"]]
    return np.logical_or.reduce(masks) if name == "any_of" else np.logical_and.reduce(masks)


def min_kl(p: np.ndarray, top: int, bounds: list[tuple[float, float]]) -> float:
    """``min KL(p || softmax(theta))`` over a box, with ``theta[top] = 0`` fixed.

    The rejection events are order constraints between logits, i.e. boxes once one
    logit is pinned at 0; KL is convex and smooth in the logits, so a bounded
    truncated-Newton solve (TNC: no threaded BLAS, which thrashes a shared CPU)
    finds the global minimum; a second start guards against a stalled search.
    """
    free = [i for i in range(len(p)) if i != top]
    ent = float(np.sum(p[p > 0] * np.log(p[p > 0])))

    def f(x):
        theta = np.zeros(len(p))
        theta[free] = x
        e = np.exp(theta - theta.max())
        lse = theta.max() + math.log(e.sum())
        return ent - float(p @ theta) + lse, (e / e.sum() - p)[free]

    lo, hi = np.array(bounds).T
    best = np.inf
    for x0 in (np.zeros(len(free)), np.log(np.maximum(p[free], 1e-20) / max(p[top], 1e-20))):
        res = minimize(f, np.clip(x0, lo, hi), jac=True, method="TNC", bounds=bounds,
                       options={"ftol": 1e-16, "gtol": 1e-12, "maxfun": 5000})
        best = min(best, float(res.fun))
        if res.success:  # convex: one converged start is the global minimum
            break
    return best


def per_token_costs(p: np.ndarray) -> np.ndarray:
    """``[V]``: min KL over q having token y as a (weak) argmax, for every y."""
    v = len(p)
    return np.array([min_kl(p, y, [(-60.0, 0.0)] * (v - 1)) for y in range(v)])


def brute_certificate(costs: np.ndarray, accepted: np.ndarray) -> float:
    rejected = costs[~accepted]
    return float(rejected.min()) if rejected.size else math.inf


def brute_tree(p: np.ndarray, m: int) -> float:
    """min KL over q where some m tokens other than x1 = argmax p weakly beat x1."""
    x1 = int(np.argmax(p))
    others = [z for z in range(len(p)) if z != x1]
    if len(others) < m:
        return math.inf
    return min(
        min_kl(p, x1, [(0.0, 60.0) if z in r else (-60.0, 60.0) for z in others])
        for r in itertools.combinations(others, m)
    )


def assert_close(c: float, b: float):
    if math.isinf(b):
        assert math.isinf(c) and c > 0
    else:
        assert abs(c - b) <= RTOL * b + ATOL, (c, b)


def random_batch(n: int, v: int, seed: int) -> np.ndarray:
    """``[n, v]`` Dirichlet draws from flat to very peaked, plus zeros, exact ties, near-ties."""
    rng, out = np.random.default_rng(seed), []
    for i in range(n):
        p = rng.dirichlet(np.full(v, rng.choice([0.1, 0.5, 2.0, 20.0])))
        kind = i % 6
        if kind == 1 and v > 2:  # zeros
            p[rng.integers(v, size=rng.integers(1, v - 1))] = 0.0
        elif kind == 2:  # near-tie at the top
            j = np.argsort(-p)
            p[j[1]] = p[j[0]] * (1 - 10.0 ** -rng.integers(2, 8))
        elif kind == 3:  # exact tie somewhere
            j = rng.permutation(v)
            p[j[1]] = p[j[0]]
        elif kind == 4:  # peaked
            p = p**4
        out.append(p / p.sum())
    return np.stack(out)


TREE_MS = (1, 2, 3)


@jax.jit
def _certificates(p, q):
    """Certificates of every rule and greedy diagnostics, compiled once per shape."""
    return {"cert": jnp.stack([theory.certificate(s, p) for s in RULES]),
            **theory.position_diagnostics(GREEDY, p, q)}


@jax.jit
def _everything(p):
    """Every library quantity for every rule, in one compiled call per shape."""
    bounds = [theory.margin_bounds(s, p) for s in RULES]
    trees = [theory.tree_margin_bounds(p, m) for m in TREE_MS]
    glo, gup = theory.greedy_margin_bounds(theory.top_margin(p))
    return {
        "cert": jnp.stack([theory.certificate(s, p) for s in RULES]),
        "acc": jnp.stack([theory.accepted_set(s, p) for s in RULES]),
        "lo": jnp.stack([b[0] for b in bounds]),
        "up": jnp.stack([b[1] for b in bounds]),
        "tree": jnp.stack([theory.tree_certificate(p, m) for m in TREE_MS]),
        "tree_lo": jnp.stack([b[0] for b in trees]),
        "tree_up": jnp.stack([b[1] for b in trees]),
        "greedy": theory.greedy_certificate(p),
        "greedy_lo": glo,
        "greedy_up": gup,
    }


ROWS = 4096


def _pad(p: np.ndarray) -> jax.Array:
    # Every batch is padded to ROWS rows so that shapes, and so compilations
    # (seconds each on a shared CPU), are shared between tests.
    assert p.shape[0] <= ROWS
    return jnp.asarray(np.concatenate([p, np.full((ROWS - p.shape[0], p.shape[1]), 1.0 / p.shape[1], p.dtype)]))


def everything(p: np.ndarray) -> dict[str, np.ndarray]:
    """``_everything`` on ``p[n, V]``; the batch axis is last for per-row scalars,
    second for ``acc``."""
    return _slice(_everything(_pad(p)), p.shape[0])


def certificates(p: np.ndarray, q: np.ndarray) -> dict[str, np.ndarray]:
    """``_certificates`` on ``p[n, V]``, ``q[n, V]``."""
    return _slice(_certificates(_pad(p), _pad(q)), p.shape[0])


def _slice(out, n):
    sliced = {}
    for k, v in out.items():
        v = np.asarray(v)
        sliced[k] = v[:, :n] if k == "acc" else v[..., :n]
    return sliced


def probs_strategy(v: int = 5):
    weights = st.lists(st.one_of(st.just(0.0), st.floats(1e-3, 1.0), st.just(0.5)), min_size=v, max_size=v)
    return weights.filter(lambda w: sum(w) > 0).map(lambda w: np.asarray(w) / np.sum(w))


# ----------------------------------------------------------------------------
# Exactness.


def check_against_brute_force(ps: np.ndarray):
    # The full bundle is compiled for V = 5 only; other vocabularies check certificates.
    out = everything(ps) if ps.shape[1] == 5 else certificates(ps, ps)
    for i, p in enumerate(ps):
        cost = per_token_costs(p)
        # The water-fill raises y* = the most likely rejected token: it is the cheapest.
        order = np.argsort(-p, kind="stable")
        assert np.all(np.diff(cost[order]) >= -1e-9), (p, cost[order])
        for r, spec in enumerate(RULES):
            want = np_accepted(spec, p)
            if "acc" in out:
                np.testing.assert_array_equal(out["acc"][r, i], want, err_msg=f"{spec} {p}")
            assert_close(float(out["cert"][r, i]), brute_certificate(cost, want))


def test_certificates_match_brute_force():
    check_against_brute_force(random_batch(18, 5, seed=0))
    check_against_brute_force(random_batch(6, 2, seed=1))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(probs_strategy())
def test_certificates_match_brute_force_property(p):
    check_against_brute_force(p[None])


def test_greedy_closed_form_and_known_values():
    out = everything(random_batch(64, 5, seed=1))
    np.testing.assert_allclose(out["greedy"], out["cert"][0], rtol=1e-12, atol=1e-15)
    a, b = 0.7, 0.2
    want = a * math.log(2 * a / (a + b)) + b * math.log(2 * b / (a + b))
    np.testing.assert_allclose(theory.certificate(GREEDY, np.array([a, b, 0.1])), want, rtol=1e-12)


def test_tree_certificate_matches_brute_force():
    ps = random_batch(8, 5, seed=2)
    out = everything(ps)
    for i, p in enumerate(ps):
        for j, m in enumerate(TREE_MS[:3]):
            assert_close(float(out["tree"][j, i]), brute_tree(p, m))
    np.testing.assert_allclose(out["tree"][0], out["greedy"], rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------------------
# Bounds.


def test_margin_bounds_bracket_every_certificate():
    out = everything(random_batch(4096, 5, seed=5))
    tol = 1e-12
    c = out["cert"][0]
    assert np.all((out["greedy_lo"] - tol <= c) & (c <= out["greedy_up"] + tol))
    c, lo, up = out["cert"], out["lo"], out["up"]
    assert np.all((lo - tol <= c) & (c <= up + tol))
    assert np.all((c <= theory.universal_bound() + tol) | np.isinf(c))
    c, lo, up = out["tree"], out["tree_lo"], out["tree_up"]
    assert np.all((lo - tol <= c) & (c <= up + tol))
    logm = np.log1p(np.array(TREE_MS))[:, None]
    assert np.all((c <= logm + tol) | np.isinf(c))
    # Not vacuous: many finite, non-trivial certificates were checked.
    assert np.mean(np.isfinite(out["cert"]) & (out["cert"] > 1e-3)) > 0.3


def test_bounds_are_tight_where_derived():
    g = np.linspace(0.0, 1.0, 11)
    lo, up = theory.greedy_margin_bounds(g)
    # Lower bound attained at V = 2; upper approached with the remaining mass spread thinly.
    np.testing.assert_allclose(theory.certificate(GREEDY, np.stack([(1 + g) / 2, (1 - g) / 2], -1)), lo, atol=1e-12)
    thin = np.concatenate([np.stack([g, np.zeros_like(g)], -1), np.repeat((1 - g)[:, None] / 10_000, 10_000, -1)], -1)
    np.testing.assert_allclose(theory.greedy_certificate(thin), up, atol=2e-3)
    for m in (2, 4):
        b = (1 - g) / (m + 1)
        worst = np.concatenate([(b + g)[:, None], np.repeat(b[:, None], m, -1), np.zeros((11, 1))], -1)
        np.testing.assert_allclose(theory.tree_certificate(worst, m), theory.tree_margin_bounds(worst, m)[0], atol=1e-12)
    # Universal bounds are attained at one-hot p.
    one_hot = np.eye(8)[2]
    np.testing.assert_allclose(theory.certificate(GREEDY, one_hot), math.log(2))
    for m in (1, 3, 7):
        np.testing.assert_allclose(theory.tree_certificate(one_hot, m), math.log(m + 1))


def test_tree_upper_bound_needs_the_mth_margin():
    # Why the tree upper bound is not in p(1) - p(2) alone: a top tie, yet C_tree = log(2)/2.
    p = np.array([0.5, 0.5, 0.0])
    np.testing.assert_allclose(theory.tree_certificate(p, 2), math.log(2) / 2)
    assert float(theory.tree_margin_bounds(p, 2)[1]) >= math.log(2) / 2


# ----------------------------------------------------------------------------
# Soundness: a certified drafter is accepted.


def test_certified_drafters_are_accepted():
    rng = np.random.default_rng(5)
    p = np.repeat(random_batch(64, 5, seed=4), 64, 0)
    # Drafters near p: mixtures with Dirichlet noise at geometric distances.
    w = np.tile(np.geomspace(1e-3, 0.9, 64), 64)[:, None]
    q = (1 - w) * p + w * rng.dirichlet(np.ones(5), len(p))
    kl = np.asarray(theory.kl_divergence(p, q))
    cert = everything(p)["cert"]
    proposed = np.argmax(q, -1)
    for r, spec in enumerate(RULES):
        certified = kl < cert[r]
        assert certified.sum() > 100, spec  # not vacuous
        accepted = [np_accepted(spec, pi)[y] for pi, y in zip(p[certified], proposed[certified])]
        assert all(accepted), spec
    d = theory.position_diagnostics(GREEDY, p[:64], q[:64])
    np.testing.assert_allclose(d["kl"], kl[:64], rtol=1e-12)
    np.testing.assert_array_equal(d["certified"], kl[:64] < cert[0, :64])


# ----------------------------------------------------------------------------
# Numerics, shapes, transforms.


EDGE_CASES = {
    2: [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [1 - 1e-30, 1e-30]],
    5: [
        [1.0, 0.0, 0.0, 0.0, 0.0],
        [0.2, 0.2, 0.2, 0.2, 0.2],
        [0.4, 0.4, 0.2, 0.0, 0.0],
        [0.6, 0.2, 0.2, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 1.0],
        [1 - 2e-30, 1e-30, 1e-30, 0.0, 0.0],
    ],
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_no_nan_on_edge_cases(dtype):
    # float64 checks every quantity; float32 (what the engine runs) the certificates
    # and diagnostics, whose compilations it shares with test_float32_agrees_with_float64.
    with jax.enable_x64(dtype == np.float64):
        for cases in EDGE_CASES.values():
            p = np.asarray(cases, dtype)
            out = everything(p) if dtype == np.float64 and p.shape[1] == 5 else {}
            out.update(certificates(p, p))
            for name, x in out.items():
                assert not np.isnan(x).any(), (name, p)
                assert (x >= 0).all(), (name, p)
            np.testing.assert_array_equal(out["certified"], out["cert"][0] > 0)
            np.testing.assert_array_equal(out["kl"], 0.0)


def test_edge_case_values():
    top2 = RuleSpec("top_m", (("m", 2),))
    assert float(theory.certificate(GREEDY, np.array([1.0, 0.0]))) == pytest.approx(math.log(2))
    assert float(theory.certificate(GREEDY, np.array([0.5, 0.5]))) == 0.0  # tie: the argmax may lose
    assert float(theory.certificate(GREEDY, np.array([0.4, 0.4, 0.2]))) == 0.0
    assert float(theory.certificate(top2, np.array([0.4, 0.4, 0.2]))) > 0
    # A tie at the top-m cut-off is not free: the rejected 0.3 must still beat the 0.4.
    np.testing.assert_allclose(theory.certificate(top2, np.array([0.4, 0.3, 0.3])),
                               theory.greedy_certificate(np.array([0.4, 0.3])), rtol=1e-12)
    # Everything accepted: nothing can be rejected (vocab 1 included).
    one = np.array([[1.0]])
    assert np.isinf(theory.certificate(GREEDY, one)).all() and np.isinf(theory.greedy_certificate(one)).all()
    assert np.isinf(theory.tree_certificate(one, 1)).all() and np.isinf(theory.tree_certificate(np.eye(5), 5)).all()
    assert not np.isnan(theory.margin_bounds(GREEDY, one)).any() and not np.isnan(theory.kl_divergence(one, one)).any()
    # Vocab 2: bounds and trees stay finite and ordered at one-hot, tie and tiny mass.
    two = np.array(EDGE_CASES[2])
    lo, up = theory.margin_bounds(RULES[1], two)
    assert np.all(np.isfinite(lo) | np.isinf(up)) and np.all(lo <= up)
    np.testing.assert_allclose(theory.tree_certificate(two, 1), theory.greedy_certificate(two))
    assert not np.isnan(np.stack(theory.tree_margin_bounds(two, 1))).any()
    assert math.isinf(float(theory.certificate(RuleSpec("additive", (("t", 1.0),)), np.array([0.9, 0.1, 0.0]))))
    assert math.isinf(float(theory.certificate(RuleSpec("top_m", (("m", 3),)), np.array([0.5, 0.5]))))
    assert math.isinf(float(theory.tree_certificate(np.array([0.5, 0.5]), 2)))
    # Raising a zero-probability token costs only the lowering of the accepted ones.
    np.testing.assert_allclose(theory.certificate(top2, np.array([0.5, 0.5, 0.0])), math.log(1.5))
    # An empty accepted set certifies nothing.
    nothing = criterion(lambda logits, probs: jnp.zeros(probs.shape, bool), name="nothing", level_set=True)
    assert float(theory.certificate(nothing, np.array([0.6, 0.4]))) == 0.0
    # The theory asks the rule itself: a user's level-set criterion is certified like a built-in.
    half = criterion(lambda logits, probs, *, t: probs >= probs.max(-1, keepdims=True) - t, hyper={"t": 0.3},
                     name="mine", level_set=True)
    p = np.array([0.5, 0.3, 0.15, 0.05])
    assert float(theory.certificate(half, p)) == float(theory.certificate(RuleSpec("additive", (("t", 0.3),)), p))
    with pytest.raises(ValueError, match="no acceptance certificate"):
        theory.certificate(criterion(lambda logits, probs: probs > 0.1, name="undeclared"), p)


def test_float32_agrees_with_float64():
    ps = random_batch(4096, 5, seed=5)
    c64 = certificates(ps, ps)["cert"]
    with jax.enable_x64(False):
        c32 = certificates(ps.astype(np.float32), ps.astype(np.float32))["cert"]
    fin = np.isfinite(c64)
    np.testing.assert_array_equal(np.isfinite(c32), fin)
    # float32 inputs perturb near-tie certificates by ~eps * p; compare accordingly.
    np.testing.assert_allclose(c32[fin], c64[fin], rtol=1e-4, atol=1e-6)


def test_jit_vmap_and_batch_shapes():
    ps = jnp.asarray(random_batch(24, 6, seed=7)).reshape(2, 12, 6)
    qs = jnp.roll(ps, 1, axis=1)
    for spec in (RULES[9],):
        direct = theory.certificate(spec, ps)
        assert direct.shape == (2, 12)
        mapped = jax.vmap(jax.vmap(lambda p: theory.certificate(spec, p)))(ps)
        np.testing.assert_allclose(mapped, direct, rtol=1e-12)
        d = jax.jit(jax.vmap(lambda p, q: theory.position_diagnostics(spec, p, q)))(ps, qs)
        assert {k: v.shape for k, v in d.items()} == {"kl": (2, 12), "certificate": (2, 12), "certified": (2, 12)}
        np.testing.assert_allclose(d["certificate"], direct, rtol=1e-12)
        np.testing.assert_array_equal(d["certified"], d["kl"] < d["certificate"])
    # Variable accepted-set sizes inside one jitted call.
    ks = jnp.arange(24).reshape(2, 12) % 8
    out = jax.jit(theory.level_set_certificate)(ps, ks)
    assert out.shape == (2, 12) and bool(jnp.all(jnp.isinf(out) == (ks >= 6)))
    np.testing.assert_allclose(out[ks == 1], theory.greedy_certificate(ps)[ks == 1], rtol=1e-12)


def test_kl_divergence():
    from scipy.stats import entropy

    p = random_batch(20, 5, seed=8)
    q = np.random.default_rng(0).dirichlet(np.ones(5), 20)
    np.testing.assert_allclose(theory.kl_divergence(p, q), entropy(p, q, axis=-1), rtol=1e-12)
    assert float(theory.kl_divergence(np.array([0.0, 1.0]), np.array([0.0, 1.0]))) == 0.0
    assert float(theory.kl_divergence(np.array([0.5, 0.5]), np.array([0.0, 1.0]))) == math.inf
    np.testing.assert_allclose(theory.kl_divergence(np.array([0.0, 1.0]), np.array([0.5, 0.5])), math.log(2))


def test_summarize_diagnostics():
    p = random_batch(64, 5, seed=9)
    d = theory.position_diagnostics(GREEDY, p, np.roll(p, 1, 0))
    valid = jnp.arange(64) < 40
    s = jax.jit(theory.summarize_diagnostics)(d, valid)
    cert = np.asarray(d["certificate"])[:40]
    np.testing.assert_allclose(s["certificate_q50"], np.quantile(cert, 0.5))
    np.testing.assert_allclose(s["certificate_q5"], np.quantile(cert, 0.05))
    np.testing.assert_allclose(s["certified_fraction"], np.asarray(d["certified"])[:40].mean())
    assert int(s["num_positions"]) == 40


# ----------------------------------------------------------------------------
# Rule handling.


@pytest.mark.parametrize("name", ["ears", "adasd", "pad", "mars", "something_new"])
def test_non_certifiable_rules_raise(name):
    with pytest.raises(ValueError, match="no acceptance certificate.*additive.*typical"):
        theory.certificate(RuleSpec(name, (("beta", 0.1),)), np.array([0.6, 0.4]))


def test_combinator_with_stochastic_rule_raises():
    spec = RuleSpec("any_of", (("rules", (RuleSpec("additive", (("t", 0.3),)), RuleSpec("ears", (("beta", 0.1),)))),))
    with pytest.raises(ValueError, match="any_of contains a non-certifiable rule.*ears"):
        theory.position_diagnostics(spec, np.array([0.6, 0.4]), np.array([0.5, 0.5]))
    with pytest.raises(ValueError, match=r"additive needs parameter\(s\) t"):
        theory.certificate(RuleSpec("additive"), np.array([0.6, 0.4]))


def test_accepts_rule_objects_and_specs():
    p = np.array([0.5, 0.3, 0.2])
    rule = top_m(2)
    assert float(theory.certificate(rule, p)) == float(theory.certificate(rule.spec, p)) > 0
    assert float(theory.certificate("top_m:m=2", p)) == float(theory.certificate(rule, p))
    assert float(theory.certificate(speculative_sampling(), p)) == float(theory.greedy_certificate(p))
    combo = RuleSpec("any_of", (("rules", (rule.spec, speculative_sampling().spec)),))
    assert float(theory.certificate(combo, p)) == float(theory.certificate(rule, p))
    # numpy-valued params become traced numbers like Python ones.
    np_spec = RuleSpec("additive", (("t", np.float64(0.3)),))
    assert float(theory.certificate(np_spec, p)) == float(theory.certificate(RULES[1], p))


def real_accepted_set(rule, p: np.ndarray) -> np.ndarray:
    """What the real rule's ``verify`` accepts at target ``p[V]`` (greedy): one slot
    per candidate draft token, every slot with target distribution ``p``."""
    from specjax.rules import VerifyInputs

    v = len(p)
    logits = np.where(p > 0, np.log(np.maximum(p, 1e-300)), -np.inf)
    rows = np.repeat(p[None], v + 1, 0)
    inputs = VerifyInputs(
        draft_tokens=jnp.arange(v, dtype=jnp.int32),
        draft_logits=jnp.asarray(rows[:v]),
        draft_probs=jnp.asarray(rows[:v]),
        target_logits=jnp.asarray(np.repeat(logits[None], v + 1, 0)),
        target_probs=jnp.asarray(rows),
        uniforms=jnp.full((v,), 0.5),
        valid=jnp.ones((v,), bool),
        features={},
    )
    return np.asarray(rule.verify(inputs, rule.init(), greedy=True).accept)


def test_real_rules_accept_what_theory_says():
    rules = pytest.importorskip("specjax.rules")
    made = [
        rules.speculative_sampling(),
        rules.additive(t=0.3),
        rules.multiplicative(alpha=0.1),
        rules.top_m(m=2),
        rules.typical(eps=0.09, delta=0.3),
        rules.any_of(rules.speculative_sampling(), rules.top_m(m=3)),
    ]
    ps = random_batch(12, 5, seed=10)
    for rule in made:
        mine = np.asarray(theory.accepted_set(rule, ps))
        for p, ours in zip(ps, mine):
            real = real_accepted_set(rule, p)
            # Ours may be smaller only where p alone is ambiguous (top-m ties at the cut-off).
            assert np.all(real[ours]), (rule.spec, p)
            if len(set(p[p > 0])) == np.sum(p > 0):  # no exact ties: the sets agree
                np.testing.assert_array_equal(ours, real, err_msg=f"{rule.spec} {p}")
    for bad in (rules.ears(beta=0.1), rules.mars(theta=0.9), rules.adasd(),
                rules.any_of(rules.speculative_sampling(), rules.mars(theta=0.9))):
        with pytest.raises(ValueError, match="no acceptance certificate"):
            theory.certificate(bad, ps)
