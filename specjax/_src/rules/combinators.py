"""Combinators: new acceptance rules from old ones (like ``optax.chain``).

A combination is itself a rule value: its sub-rules are pytree children, so
their traced hyper-parameters stay traced and their static settings shape the
program, exactly as for the rules on their own.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax._src.foundation.checks import as_integer
from specjax._src.rules.base import AcceptanceRule, Path, RuleSpec, Verdict, VerifyInputs, spec_value

Array = jax.Array


def _check_rules(name: str, rules) -> tuple[AcceptanceRule, ...]:
    if not rules:
        raise ValueError(f"{name}() needs at least one rule")
    for r in rules:
        if not isinstance(r, AcceptanceRule):
            raise ValueError(f"{name}() takes AcceptanceRules, got {r!r}")
    return tuple(rules)


def _union_hidden_layers(rules) -> tuple[int, ...]:
    """Every member's ``hidden_layers``, each once, in the members' order."""
    layers: list[int] = []
    for r in rules:
        layers += [layer for layer in r.hidden_layers if layer not in layers]
    return tuple(layers)


def _any_exact(verdicts) -> Array:
    return functools.reduce(jnp.logical_or, [v.path == Path.EXACT for v in verdicts])


class _Combination(AcceptanceRule):
    """Shared plumbing: state is the tuple of sub-states; every sub-rule sees
    the same inputs (hence the same uniforms) and, in ``update``, the combined
    verdict and the number of tokens actually accepted."""

    rules: tuple

    def init(self):
        return tuple(r.init() for r in self.rules)

    def verify(self, inputs: VerifyInputs, state, *, greedy: bool) -> Verdict:
        return self.decide([r.verify(inputs, s, greedy=greedy) for r, s in zip(self.rules, state)])

    def update(self, state, inputs, verdict, num_accepted, *, greedy):
        return tuple(r.update(s, inputs, verdict, num_accepted, greedy=greedy) for r, s in zip(self.rules, state))

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return _union_hidden_layers(self.rules)

    @property
    def spec(self) -> RuleSpec:
        return RuleSpec(self.name, (("rules", tuple(r.spec for r in self.rules)),))

    @property
    def level_set(self) -> bool:
        return all(getattr(r, "level_set", False) for r in self.rules)

    def decide(self, verdicts) -> Verdict:
        raise NotImplementedError


@struct.dataclass
class AnyOf(_Combination):
    """Accept a slot if any rule accepts it; see :func:`any_of`."""

    rules: tuple
    name = "any_of"

    def decide(self, verdicts) -> Verdict:
        accept = functools.reduce(jnp.logical_or, [v.accept for v in verdicts])
        path = jnp.full_like(verdicts[0].path, Path.REJECTED)
        for v in reversed(verdicts):  # the first accepting rule wins
            path = jnp.where(v.accept, v.path, path)
        path = jnp.where(accept & _any_exact(verdicts), Path.EXACT, path).astype(jnp.int32)
        return Verdict(accept, path, verdicts[0].correction)

    def accepted_set(self, logits: Array, probs: Array) -> Array:
        """The union of the sub-rules' sets (level-set rules only)."""
        return functools.reduce(jnp.logical_or, [r.accepted_set(logits, probs) for r in self.rules])


@struct.dataclass
class AllOf(_Combination):
    """Accept a slot only if every rule accepts it; see :func:`all_of`."""

    rules: tuple
    name = "all_of"

    def decide(self, verdicts) -> Verdict:
        accept = functools.reduce(jnp.logical_and, [v.accept for v in verdicts])
        path = jnp.where(_any_exact(verdicts), Path.EXACT, verdicts[0].path)
        path = jnp.where(accept, path, Path.REJECTED).astype(jnp.int32)
        correction = verdicts[0].correction
        for v in reversed(verdicts):  # the first rejecting rule wins
            correction = jnp.where(v.accept[:, None], correction, v.correction)
        return Verdict(accept, path, correction)

    def accepted_set(self, logits: Array, probs: Array) -> Array:
        """The intersection of the sub-rules' sets (level-set rules only)."""
        return functools.reduce(jnp.logical_and, [r.accepted_set(logits, probs) for r in self.rules])


def any_of(*rules: AcceptanceRule) -> AnyOf:
    """Accept a slot if any rule accepts it.

    Path: ``EXACT`` if an accepting rule says the lossless test accepts (every
    built-in rule reports ``EXACT`` exactly then), else the path of the first
    accepting rule, in argument order. Correction after a rejection: the first
    rule's (so put the rule whose correction you want first, e.g.
    ``any_of(speculative_sampling(), mars(0.9))`` resamples from the residual).
    State: the tuple of the rules' states.
    """
    return AnyOf(rules=_check_rules("any_of", rules))


def all_of(*rules: AcceptanceRule) -> AllOf:
    """Accept a slot only if every rule accepts it.

    Path: ``EXACT`` if any rule reports ``EXACT``, else the first rule's path.
    Correction after a rejection: that of the first rule that rejected the
    slot (the rule that vetoed it decides what replaces it). State: the tuple
    of the rules' states.
    """
    return AllOf(rules=_check_rules("all_of", rules))


def _as_verdict(verdict) -> Verdict:
    """A member's verdict in the dtypes every branch of :class:`OneOf` must share."""
    return Verdict(jnp.asarray(verdict.accept, bool), jnp.asarray(verdict.path, jnp.int32),
                   jnp.asarray(verdict.correction, jnp.float32))


@struct.dataclass
class OneOf(AcceptanceRule):
    """One of several rules judges, chosen by a traced ``index``; see :func:`one_of`."""

    rules: tuple
    index: Any = 0  # traced: an int32 scalar (or [S] in the slots engine's per-slot rules)
    name = "one_of"

    def _chosen(self) -> Array:
        return jnp.asarray(self.index, jnp.int32)

    def init(self):
        return tuple(r.init() for r in self.rules)

    def verify(self, inputs: VerifyInputs, state, *, greedy: bool) -> Verdict:
        branches = [functools.partial(lambda r, i, s: _as_verdict(r.verify(inputs, s[i], greedy=greedy)), r, i)
                    for i, r in enumerate(self.rules)]
        if len(branches) == 1:
            return branches[0](state)
        # A scalar index runs one member; a batched one (the engine's vmap over
        # slots, each with its own index) computes every member and selects.
        return jax.lax.switch(self._chosen(), branches, state)

    def update(self, state, inputs, verdict, num_accepted, *, greedy):
        if not jax.tree_util.tree_leaves(state):
            return state  # no member keeps a state: nothing to advance

        def advance(i, s):
            new = list(s)
            new[i] = self.rules[i].update(s[i], inputs, verdict, num_accepted, greedy=greedy)
            return tuple(new)

        branches = [functools.partial(advance, i) for i in range(len(self.rules))]
        if len(branches) == 1:
            return branches[0](state)
        return jax.lax.switch(self._chosen(), branches, state)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return _union_hidden_layers(self.rules)

    @property
    def spec(self) -> RuleSpec:
        params = (("rules", tuple(r.spec for r in self.rules)),)
        index = spec_value(self.index)
        if isinstance(index, jax.core.Tracer) or jnp.ndim(index) != 0 or index != 0:
            params += (("index", index),)
        return RuleSpec(self.name, params)

    @property
    def level_set(self) -> bool:
        return all(getattr(r, "level_set", False) for r in self.rules)

    @property
    def lossless(self) -> bool:
        """Every member is: whichever a row picks, the lossless test judges it."""
        return all(r.lossless for r in self.rules)

    def accepted_set(self, logits: Array, probs: Array) -> Array:
        """The chosen member's set (level-set members only)."""
        branches = [functools.partial(lambda r, lg, pr: r.accepted_set(lg, pr), r) for r in self.rules]
        return jax.lax.switch(self._chosen(), branches, logits, probs)

    @property
    def chosen(self) -> AcceptanceRule:
        """The member that judges (a concrete ``index`` only)."""
        return self.rules[int(self.index)]


def one_of(*rules: AcceptanceRule, index: int = 0) -> OneOf:
    """The rule ``rules[index]``, where ``index`` is traced: one compiled
    program serves every choice, and the slots engine holds an index per slot,
    so each request may pick its own member (``Engine.rule_for``).

    ``verify`` returns the chosen member's verdict (its acceptances, paths and
    correction, exactly). State: the tuple of the members' states; ``update``
    advances only the chosen member's (AdaSD's running means see only the
    cycles AdaSD judged). ``hidden_layers``: the union of the members'.

    Cost: with a scalar index only the chosen member runs; vmapped over rows
    with an index per row (the slots engine), every member's verdict is
    computed and the row's selected (``lax.switch`` under ``vmap``).

    Spec: ``one_of(sd,mars:theta=0.9)``, with ``:index=1`` after the closing
    parenthesis when the index is not 0.
    """
    rules = _check_rules("one_of", rules)
    number = as_integer(index)
    if number is None or not 0 <= number < len(rules):
        raise ValueError(f"one_of(): index must be an integer in 0 .. {len(rules) - 1} (one per rule), got {index!r}.")
    return OneOf(rules=rules, index=number)
