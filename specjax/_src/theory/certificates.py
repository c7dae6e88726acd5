"""Acceptance certificates for deterministic, level-set acceptance rules.

Theory (after Sharma, "When Is a Draft Accepted? A Theory of Acceptance in
Speculative Decoding", arXiv:2606.30265; only a
summary of the paper was available, so every formula below was re-derived here
and checked numerically against brute-force minimisation in
``tests/test_theory.py``).

Setting. ``p`` is the target's distribution over ``V`` tokens, ``q`` the
drafter's; the drafter proposes ``argmax q``. A deterministic rule accepts a
draft token ``y`` iff ``y`` lies in an accepted set ``A(p)`` that is an upper
level set of ``p`` (strict greedy breaks ties towards the lower token id, as
``jnp.argmax`` does; see "Conservative choices" for top-m). So ``A(p)`` is a
prefix of the stable descending order of ``p``; its size ``k`` is all a
certificate needs. Certificates are for greedy decoding (the drafter proposes
its argmax); ``speculative_sampling`` is certified in its temperature-0 form.

Certificate. ``C(p) = inf { KL(p || q) : q rejects }``. "q rejects" means the
token it proposes lies outside ``A``; whatever tie-breaking the drafter uses,
such a ``q`` satisfies ``q(y) >= q(z)`` for all ``z`` for some ``y`` not in
``A``. That closed set is the closure of the strict-argmax rejection region and
KL is continuous on it, so the infimum is the same and *soundness holds for any
tie-breaking*: ``KL(p || q) < C(p)`` implies the draft is accepted.

Water-fill (derived; KKT of a convex program). For a fixed rejected ``y`` the
minimiser lowers the accepted tokens above a level ``t`` to ``t``, raises
``y`` to ``t`` and leaves every other token alone::

    t = (p(y) + sum_{z in P} p(z)) / (|P| + 1),   P = {z != y : p(z) > t},
    C_y = sum_{z in P + {y}} p(z) log(p(z) / t).

Swapping ``q(y)`` with ``q(y')`` shows ``C_y`` is smallest for ``y* =`` the
most likely rejected token, and then ``P`` is a subset of ``A`` (every other
rejected ``z`` has ``p(z) <= p(y*) <= t``). With ``s`` sorted descending,
``y* = s[k]`` and ``P`` is the prefix ``s[:n]`` of the first ``n <= k`` sorted
values with ``s[j] > t_j``; that set is a prefix, so it is found in closed form
from prefix sums with masks. The README formula is confirmed.

Conservative choices: where p alone cannot tell what the rule does (top-m ties
at the cut-off, which the rule breaks by logits; zero-probability tokens, which
top-m admits only if their logits are finite) the accepted set is taken smaller.
``C`` is monotone in ``A``, so such a certificate is a lower bound: still sound.

Edge cases: ``A`` = the whole vocabulary -> nothing can be rejected, ``C =
+inf``. Empty ``A`` (or ``y*`` tied with ``s[0]``) -> ``C = 0``. Zeros in
``p`` are fine (``0 log 0 = 0``; a rejected zero-probability token is raised
from nothing). ``C`` is computed as a sum of non-negative Bregman terms
``p log(p/t) - p + t`` (they sum to ``C`` because the moved mass balances), so
near-ties lose no precision to cancellation.

Universal bound (derived): ``C <= log 2`` for every level-set rule, since
``q = (p + e_y) / 2`` rejects and has ``KL(p||q) <= log 2``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.scipy.special import xlogy

from specjax._src.logits import sampling
from specjax._src.foundation.jit_keys import pytree_classes
from specjax._src.rules.base import AcceptanceRule, RuleSpec
from specjax._src.rules.parse import COMBINATORS, RULES, parse_spec, rule_from_spec

Array = jax.Array

# "greedy", "sd" and "lossless" name the strict rule.
_ALIASES = {"greedy": "speculative_sampling", "sd": "speculative_sampling", "lossless": "speculative_sampling"}

_WHY_NOT = {
    "ears": "EARS pardons a rejection with a uniform draw and the draft's probability: it is "
    "stochastic and depends on q, so its accepted set is not a level set of p",
    "adasd": "AdaSD compares a JS distance between p and q against running thresholds carried in "
    "the loop state: it depends on q and on history",
    "pad": "PAD accepts by a learned classifier on hidden states, not by a level set of p",
    "pivot_pardon": "PAD's pardon is a learned classifier on hidden states, not a level set of p",
    "mars": "MARS thresholds the ratio of raw target logits, which p alone does not determine",
}


# ----------------------------------------------------------------------------
# Small numerics.


def _h(u: Array) -> Array:
    """``(1+u) log(1+u) - u`` for ``u >= -1``, accurate near 0 (series) and at -1."""
    u = jnp.asarray(u)
    small = jnp.abs(u) < 0.05
    us = jnp.where(small, u, 0.0)
    # sum_{n>=2} (-1)^n u^n / (n(n-1)); |error| < u^9/72 relative to u^2/2.
    series = us * us * (
        1 / 2 + us * (-1 / 6 + us * (1 / 12 + us * (-1 / 20 + us * (1 / 30 + us * (-1 / 42 + us / 56)))))
    )
    ud = jnp.where(small, 1.0, u)
    direct = xlogy(1.0 + ud, 1.0 + ud) - ud
    return jnp.where(small, series, direct)


def _bregman(p: Array, t: Array) -> Array:
    """``p log(p/t) - p + t >= 0`` for ``p >= 0``, ``t > 0``."""
    return t * _h((p - t) / t)


@jax.jit
def kl_divergence(p: Array, q: Array) -> Array:
    """``KL(p || q) = sum p log(p/q)`` over the last axis, ``[..., V] -> [...]``.

    ``0 log 0 = 0``; ``+inf`` where ``q = 0 < p``. Uses ``log p - log q`` so that
    tiny probabilities (softmax of large logits) do not underflow a ratio.
    """
    p = jnp.asarray(p)
    q = jnp.asarray(q, p.dtype)
    pos = p > 0
    safe_p = jnp.where(pos, p, 1.0)
    terms = jnp.where(pos, p * (jnp.log(safe_p) - jnp.log(q)), 0.0)
    return terms.sum(-1)


entropy = sampling.entropy  # Shannon entropy in nats over the last axis, ``[..., V] -> [...]``


def _sort_desc(p: Array) -> Array:
    return -jnp.sort(-p, axis=-1)


# ----------------------------------------------------------------------------
# Rules as accepted sets.


def as_rule(rule: Any) -> AcceptanceRule:
    """An ``AcceptanceRule`` from a rule, a :class:`RuleSpec` or a spec string
    (``"greedy"``, ``"additive:t=0.3"``, ``"any_of(top_m:m=2,additive:t=0.1)"``)."""
    if isinstance(rule, AcceptanceRule):
        return rule
    if isinstance(rule, str):
        rule = parse_spec(_ALIASES.get(rule, rule))
    if isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str) and not isinstance(rule, RuleSpec):
        rule = RuleSpec(*rule)
    if isinstance(rule, RuleSpec):
        return rule_from_spec(rule._replace(name=_ALIASES.get(rule.name, rule.name)))
    raise TypeError(f"expected an AcceptanceRule, RuleSpec or spec string, got {type(rule).__name__}")


def _not_certifiable(spec: RuleSpec, where: str = "") -> ValueError:
    why = _WHY_NOT.get(spec.name, "it is not a known deterministic level-set criterion")
    return ValueError(
        f"rule {str(spec)!r}{where} has no acceptance certificate: {why}. Certificates exist only "
        "for deterministic rules whose accepted set is an upper level set of the target "
        "distribution p: speculative_sampling (certified in its temperature-0, strict greedy "
        "form), additive(t), multiplicative(alpha), top_m(m), typical(eps, delta), any_of / "
        "all_of combinations of these, and criterion(..., level_set=True)."
    )


def check_certifiable(rule: Any) -> AcceptanceRule:
    """Returns the rule (built from a spec if need be), or raises ``ValueError``
    saying why it has no certificate.

    A rule is certifiable when it declares ``level_set`` (its accepted set is
    an upper level set of p) and answers ``accepted_set(logits, probs)``.
    """
    if isinstance(rule, str):
        rule = parse_spec(_ALIASES.get(rule, rule))
    if isinstance(rule, RuleSpec):
        name = _ALIASES.get(rule.name, rule.name)
        if name in _WHY_NOT or name not in {*RULES, *COMBINATORS}:
            raise _not_certifiable(rule)  # say why before complaining about its parameters
    rule = as_rule(rule)
    children = getattr(rule, "rules", None)
    if children is not None:
        for child in children:
            try:
                check_certifiable(child)
            except ValueError as e:
                raise ValueError(f"{rule.name} contains a non-certifiable rule: {e}") from None
        return rule
    if not getattr(rule, "level_set", False) or not hasattr(rule, "accepted_set"):
        raise _not_certifiable(rule.spec)
    return rule


def normalize_spec(rule: Any) -> RuleSpec:
    """The rule's canonical spec (aliases resolved): for labels and reports."""
    return as_rule(rule).spec


def _rule_fn(fn):
    """Checks the rule, then runs ``fn`` jitted with the rule as a pytree
    argument: its numbers are traced, so a new threshold compiles nothing.

    Jitting here compiles each (rule structure, shape) once instead of
    dispatching dozens of small ops eagerly; inside a caller's jit it inlines.
    """
    # The rule's classes ride along as a static: jit alone may mix up rules with the same fields.
    jitted = jax.jit(lambda rule, *arrays, classes, **named: fn(rule, *arrays, **named), static_argnames="classes")

    @functools.wraps(fn)
    def wrapper(rule, *arrays, **named):
        named = {k: jnp.asarray(v) for k, v in named.items()}
        rule = check_certifiable(rule)
        return jitted(rule, *map(jnp.asarray, arrays), classes=pytree_classes(rule), **named)

    return wrapper


def _rule_set(rule: AcceptanceRule, p: Array) -> Array:
    """``bool[..., V]``: the rule's own accepted set at ``p``, asked of the rule.

    The logits the rule sees are ``-rank`` in the stable descending order of
    ``p`` (``-inf`` where ``p = 0``): they order tokens as the real logits do,
    but with no ties, so a rank rule (greedy, top-m) admits exactly the first
    ``m`` tokens, ties broken towards the lower id. That is the "conservative
    choice" of the module docstring: p alone cannot tell how the rule breaks a
    tie or whether a zero-probability token's logit was finite. Threshold rules
    read ``p`` itself and give their sets exactly.
    """
    order = jnp.argsort(-p, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1)
    logits = jnp.where(p > 0, -rank.astype(p.dtype), -jnp.inf)
    return rule.accepted_set(logits, p)


@_rule_fn
def num_accepted(rule: Any, probs: Array) -> Array:
    """``int32[...]``: size k of the accepted set; it is the first k tokens of the
    stable descending order of ``probs[..., V]``."""
    return _rule_set(rule, jnp.asarray(probs)).sum(-1, dtype=jnp.int32)


@_rule_fn
def accepted_set(rule: Any, probs: Array) -> Array:
    """``bool[..., V]``: the tokens the rule accepts as a greedy draft at ``probs[..., V]``.

    The rule's own set (its ``accepted_set``), asked with rank logits (see
    :func:`_rule_set`). Threshold rules (additive, multiplicative, typical)
    give their sets exactly. Rank rules break ties towards the lower token id,
    as ``argmax`` does: exact for strict greedy; for ``top_m`` (whose rule
    admits every token tied at the cut-off, by logits) it is a subset, exact
    unless ``p(m) = p(m+1)``, and it leaves out zero-probability tokens. A
    subset gives a smaller rejection-free region, so certificates stay sound.
    """
    return _rule_set(rule, jnp.asarray(probs))


# ----------------------------------------------------------------------------
# Certificates.


@jax.jit
def level_set_certificate(probs: Array, k: Array) -> Array:
    """Exact certificate of an accepted set that is the top-``k`` prefix of ``p``.

    Args:
      probs: ``[..., V]`` target distribution p.
      k: ``int[...]`` (broadcastable) accepted-set size.

    Returns:
      ``[...]`` ``C = min KL(p||q)`` over drafters whose argmax is outside the
      top-k: the water-fill between ``y* = s[k]`` and the prefix of ``s`` above
      the common level (module docstring). ``+inf`` where ``k >= V``, ``0`` where
      ``k = 0``.
    """
    s = _sort_desc(jnp.asarray(probs))
    v = s.shape[-1]
    k = jnp.broadcast_to(jnp.asarray(k, jnp.int32), s.shape[:-1])
    y = jnp.take_along_axis(s, jnp.clip(k, 0, v - 1)[..., None], -1)[..., 0]
    # Level if the first j sorted tokens are lowered: t_j = (y + S_j)/(j+1).
    # s_j > t_j <=> s_j > t_{j-1}; once it fails it fails for every later j, so
    # the lowered set P is the prefix where it holds (cumprod guards rounding).
    j = jnp.arange(1, v + 1)
    levels = (y[..., None] + jnp.cumsum(s, -1)) / (j + 1).astype(s.dtype)
    lowered = (j <= k[..., None]) & (s > levels)
    lowered = jnp.cumprod(lowered, axis=-1).astype(bool)
    n = lowered.sum(-1)
    level = (y + jnp.where(lowered, s, 0.0).sum(-1)) / (n + 1).astype(s.dtype)
    level = jnp.maximum(level, jnp.finfo(s.dtype).tiny)  # only an all-zero p reaches 0
    c = jnp.where(lowered, _bregman(s, level[..., None]), 0.0).sum(-1) + _bregman(y, level)
    return jnp.where(k >= v, jnp.inf, c)


@_rule_fn
def certificate(rule: Any, probs: Array) -> Array:
    """Exact acceptance certificate ``C(p)`` of a level-set rule.

    Any drafter ``q`` proposing its argmax with ``KL(p || q) < C(p)`` is accepted
    by ``rule`` at target distribution ``p`` (for any tie-breaking of argmax q).

    Args:
      rule: an ``AcceptanceRule`` or ``RuleSpec``: speculative_sampling (as strict
        greedy), additive(t), multiplicative(alpha), top_m(m), typical(eps, delta),
        or any_of / all_of of these. Other rules raise ``ValueError``.
      probs: ``[..., V]`` target distributions.

    Returns:
      ``[...]`` certificates in nats; ``+inf`` where every token is accepted.
      Jittable and vmappable (the rule is a pytree argument).
    """
    p = jnp.asarray(probs)
    return level_set_certificate(p, num_accepted(rule, p))


@jax.jit
def greedy_certificate(probs: Array) -> Array:
    """Closed form for strict greedy (derived): with ``a = p(1)``, ``b = p(2)``,
    ``C = a log(2a/(a+b)) + b log(2b/(a+b))`` (the water-fill with ``P = {1}``).

    ``[..., V] -> [...]``; ``+inf`` when ``V = 1``.
    """
    p = jnp.asarray(probs)
    if p.shape[-1] < 2:
        return jnp.full(p.shape[:-1], jnp.inf, p.dtype)
    top2 = jax.lax.top_k(p, 2)[0]
    a, b = top2[..., 0], top2[..., 1]
    t = jnp.maximum((a + b) / 2, jnp.finfo(p.dtype).tiny)
    return _bregman(a, t) + _bregman(b, t)


@jax.jit
def top_margin(probs: Array) -> Array:
    """``p(1) - p(2)`` over the last axis (``p(1)`` if ``V = 1``)."""
    p = jnp.asarray(probs)
    if p.shape[-1] < 2:
        return p[..., 0]
    top2 = jax.lax.top_k(p, 2)[0]
    return top2[..., 0] - top2[..., 1]


@jax.jit
def greedy_margin_bounds(margin: Array) -> tuple[Array, Array]:
    """Margin-only bounds on the strict greedy certificate, ``g = p(1) - p(2)``.

    ``((1+g) ln(1+g) + (1-g) ln(1-g)) / 2 <= C <= g log 2`` (README, confirmed).
    Derivation: ``C = s phi(g/s)`` with ``s = a+b`` and ``phi`` the lower bound
    above, a perspective of a convex function that vanishes at 0, hence
    non-increasing in ``s``; ``s`` ranges over ``[g, 1]``. The lower bound is
    attained at ``V = 2``; the upper bound is approached as ``b -> 0`` with the rest
    of the mass spread thinly (and attained at ``g = 1``).

    Returns ``(lower, upper)`` with the shape of ``margin``.
    """
    g = jnp.asarray(margin)
    return (_h(g) + _h(-g)) / 2, g * math.log(2.0)


@functools.partial(jax.jit, static_argnums=1)
def tree_certificate(probs: Array, m: int) -> Array:
    """Exact certificate that the target's top token stays in the drafter's top-m.

    The event fails iff at least ``m`` other tokens weakly beat the target's top
    token ``x1`` under ``q`` (closure of "strictly beat", as for single tokens).
    Derived by the same KKT argument: the cheapest ``m`` challengers are the next
    ``m`` most likely tokens ``s[1..m]``; ``x1`` is lowered to a level ``t`` and
    the challengers below ``t`` (a suffix ``L`` of ``s[1..m]``) are raised to it::

        t = (p(x1) + sum_{z in L} p(z)) / (|L| + 1),  L = {z in s[1..m] : p(z) < t},
        C_tree = sum_{z in L + {x1}} p(z) log(p(z) / t).

    ``m = 1`` recovers strict greedy. ``C_tree <= log(m+1)`` (derived: ``q = (p +
    1_R)/(m+1)`` fails and has ``KL <= log(m+1)``; equality at one-hot p).

    Args:
      probs: ``[..., V]``.
      m: static int >= 1.

    Returns:
      ``[...]``; ``+inf`` when ``m >= V`` (fewer than m challengers exist).
    """
    m = int(m)
    if m < 1:
        raise ValueError(f"tree_certificate needs m >= 1, got {m}")
    s = _sort_desc(jnp.asarray(probs))
    v = s.shape[-1]
    if m >= v:
        return jnp.full(s.shape[:-1], jnp.inf, s.dtype)
    top = s[..., 0]
    up = s[..., m:0:-1]  # challengers, ascending: the cheapest to raise come first
    j = jnp.arange(1, m + 1)
    levels = (top[..., None] + jnp.cumsum(up, -1)) / (j + 1).astype(s.dtype)
    raised = jnp.cumprod(up < levels, axis=-1).astype(bool)
    n = raised.sum(-1)
    level = (top + jnp.where(raised, up, 0.0).sum(-1)) / (n + 1).astype(s.dtype)
    level = jnp.maximum(level, jnp.finfo(s.dtype).tiny)
    return _bregman(top, level) + jnp.where(raised, _bregman(up, level[..., None]), 0.0).sum(-1)


@functools.partial(jax.jit, static_argnums=1)
def tree_margin_bounds(probs: Array, m: int) -> tuple[Array, Array]:
    """Margin-only bounds on ``tree_certificate(probs, m)`` (derived here, not quoted).

    With ``g = p(1) - p(2)`` and ``g_m = p(1) - p(m+1)``::

        ((1 + m g) ln(1 + m g) + m (1 - g) ln(1 - g)) / (m + 1) <= C_tree <= g_m log(m + 1).

    Lower (derived, tight): the worst case for a given ``g`` puts all ``m``
    challengers at ``p(1) - g`` and no mass elsewhere, so ``t = 1/(m+1)``; it is
    the greedy bound at ``m = 1`` and ``log(m+1)`` at ``g = 1``. Upper: a bound
    in ``g`` alone is impossible (``p = (.5, .5, 0)``, ``m = 2`` has ``g = 0`` but
    ``C_tree = log(2)/2``), so it uses the margin to the ``m``-th challenger;
    ``g_m log(m+1)`` was conjectured from the perspective argument of the greedy
    case and verified numerically (no violation on 20k random p, attained at
    one-hot p), not proven.

    Args:
      probs: ``[..., V]``.
      m: static int >= 1.

    Returns:
      ``(lower, upper)``, each ``[...]``; the upper bound is ``+inf`` when ``m >= V``.
    """
    m = int(m)
    s = _sort_desc(jnp.asarray(probs))
    v = s.shape[-1]
    g = s[..., 0] - s[..., min(1, v - 1)]
    lower = (_h(m * g) + m * _h(-g)) / (m + 1)
    if m >= v:
        return jnp.full(g.shape, jnp.inf, g.dtype), jnp.full(g.shape, jnp.inf, g.dtype)
    upper = (s[..., 0] - s[..., m]) * math.log(m + 1.0)
    return lower, upper


def universal_bound(m: int = 1) -> float:
    """``log(m+1)``: no certificate exceeds it (``m = 1``: every single-token
    level-set rule, ``C <= log 2``; ``m``: the greedy tree)."""
    return math.log(m + 1.0)


@_rule_fn
def rejection_margin(rule: Any, probs: Array) -> Array:
    """``p(1) - p(y*)``: the gap between the top token and the most likely rejected
    one (``+inf`` where nothing is rejected). For strict greedy, ``p(1) - p(2)``."""
    p = jnp.asarray(probs)
    s = _sort_desc(p)
    v = s.shape[-1]
    k = num_accepted(rule, p)
    y = jnp.take_along_axis(s, jnp.clip(k, 0, v - 1)[..., None], -1)[..., 0]
    return jnp.where(k >= v, jnp.inf, s[..., 0] - y)


@_rule_fn
def margin_bounds(rule: Any, probs: Array) -> tuple[Array, Array]:
    """Margin-based ``(lower, upper)`` bounds on ``certificate(rule, probs)``.

    With ``g = rejection_margin`` and ``k = num_accepted``:
    ``phi(g) <= C <= min(g log(k+1), log 2)``, ``phi(g) = ((1+g)ln(1+g) +
    (1-g)ln(1-g))/2``. Derived: dropping every constraint but ``q(y*) >= q(x1)``
    gives the greedy certificate of ``(p(1), p(y*))``, which is ``>= phi(g)``;
    ``log 2`` is the universal bound (proven); ``g log(k+1)`` generalises the
    greedy perspective argument and is verified numerically (no violation on 20k
    random p for several rules, attained at one-hot p), not proven. For strict
    greedy (k = 1) these are the README bounds. ``(+inf, +inf)`` where nothing is
    rejected.
    """
    p = jnp.asarray(probs)
    g = rejection_margin(rule, p)
    k = num_accepted(rule, p)
    finite = jnp.isfinite(g)
    gs = jnp.where(finite, g, 0.0)
    lower = (_h(gs) + _h(-gs)) / 2
    upper = jnp.minimum(gs * jnp.log1p(k.astype(p.dtype)), math.log(2.0))
    return jnp.where(finite, lower, jnp.inf), jnp.where(finite, upper, jnp.inf)


# ----------------------------------------------------------------------------
# Live diagnostics.


@_rule_fn
def position_diagnostics(rule: Any, target_probs: Array, draft_probs: Array) -> dict[str, Array]:
    """Per-position certificate diagnostics, cheap and jit/vmap-safe.

    Args:
      rule: a certifiable ``AcceptanceRule`` or ``RuleSpec`` (checked at trace time).
      target_probs: ``[..., V]`` p at each verified position.
      draft_probs: ``[..., V]`` q at the same positions.

    Returns:
      dict of ``[...]`` arrays: ``kl = KL(p||q)``, ``certificate = C(p)`` and
      ``certified = kl < certificate`` (a certified position is accepted when the
      drafter proposes its argmax).
    """
    p = jnp.asarray(target_probs)
    kl = kl_divergence(p, draft_probs)
    cert = certificate(rule, p)
    return {"kl": kl, "certificate": cert, "certified": kl < cert}


def summarize_diagnostics(
    diagnostics: dict[str, Array], valid: Array | None = None, quantiles: Sequence[float] = (0.05, 0.5)
) -> dict[str, Array]:
    """Certified fraction and certificate quantiles over the positions where ``valid``.

    Returns ``certified_fraction``, ``num_positions`` and ``certificate_q{100*q:g}``
    (e.g. ``certificate_q5``, ``certificate_q50``: the paper's 5th percentile and
    median). Quantiles are NaN when no position is valid.
    """
    cert = diagnostics["certificate"]
    valid = jnp.ones(cert.shape, bool) if valid is None else jnp.broadcast_to(valid, cert.shape)
    count = valid.sum()
    frac = jnp.where(valid, diagnostics["certified"], False).sum() / jnp.maximum(count, 1)
    masked = jnp.where(valid, cert, jnp.nan).ravel()
    out = {"certified_fraction": frac, "num_positions": count}
    for q in quantiles:
        out[f"certificate_q{100 * q:g}"] = jnp.nanquantile(masked, q)
    return out
