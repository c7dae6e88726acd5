"""Combinators: new acceptance rules from old ones (like ``optax.chain``)."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from specjax._src.rules.base import AcceptanceRule, Path, RuleSpec, Verdict, VerifyInputs


def _check_rules(name: str, rules) -> tuple[AcceptanceRule, ...]:
    if not rules:
        raise ValueError(f"{name}() needs at least one rule")
    for r in rules:
        if not isinstance(r, AcceptanceRule):
            raise ValueError(f"{name}() takes AcceptanceRules, got {r!r}")
    return tuple(rules)


def _combine(name: str, rules, decide) -> AcceptanceRule:
    """Shared plumbing: state is the tuple of sub-states; every sub-rule sees
    the same inputs (hence the same uniforms) and, in ``update``, the combined
    verdict and the number of tokens actually accepted."""
    rules = _check_rules(name, rules)

    def init():
        return tuple(r.init() for r in rules)

    def verify(inputs: VerifyInputs, state, *, greedy: bool) -> Verdict:
        verdicts = [r.verify(inputs, s, greedy=greedy) for r, s in zip(rules, state)]
        return decide(verdicts)

    def update(state, inputs, verdict, num_accepted, *, greedy):
        return tuple(
            r.update(s, inputs, verdict, num_accepted, greedy=greedy) for r, s in zip(rules, state)
        )

    spec = RuleSpec(name, (("rules", tuple(r.spec for r in rules)),))
    return AcceptanceRule(init=init, verify=verify, update=update, spec=spec)


def _any_exact(verdicts) -> bool:
    return functools.reduce(jnp.logical_or, [v.path == Path.EXACT for v in verdicts])


def any_of(*rules: AcceptanceRule) -> AcceptanceRule:
    """Accept a slot if any rule accepts it.

    Path: ``EXACT`` if an accepting rule says the lossless test accepts (every
    built-in rule reports ``EXACT`` exactly then), else the path of the first
    accepting rule, in argument order. Correction after a rejection: the first
    rule's (so put the rule whose correction you want first, e.g.
    ``any_of(speculative_sampling(), mars(0.9))`` resamples from the residual).
    State: the tuple of the rules' states.
    """

    def decide(verdicts) -> Verdict:
        accept = functools.reduce(jnp.logical_or, [v.accept for v in verdicts])
        path = jnp.full_like(verdicts[0].path, Path.REJECTED)
        for v in reversed(verdicts):  # the first accepting rule wins
            path = jnp.where(v.accept, v.path, path)
        path = jnp.where(accept & _any_exact(verdicts), Path.EXACT, path).astype(jnp.int32)
        return Verdict(accept, path, verdicts[0].correction)

    return _combine("any_of", rules, decide)


def all_of(*rules: AcceptanceRule) -> AcceptanceRule:
    """Accept a slot only if every rule accepts it.

    Path: ``EXACT`` if any rule reports ``EXACT``, else the first rule's path.
    Correction after a rejection: that of the first rule that rejected the
    slot (the rule that vetoed it decides what replaces it). State: the tuple
    of the rules' states.
    """

    def decide(verdicts) -> Verdict:
        accept = functools.reduce(jnp.logical_and, [v.accept for v in verdicts])
        path = jnp.where(_any_exact(verdicts), Path.EXACT, verdicts[0].path)
        path = jnp.where(accept, path, Path.REJECTED).astype(jnp.int32)
        correction = verdicts[0].correction
        for v in reversed(verdicts):  # the first rejecting rule wins
            correction = jnp.where(v.accept[:, None], correction, v.correction)
        return Verdict(accept, path, correction)

    return _combine("all_of", rules, decide)
