"""Rules from strings ("mars:theta=0.9") and from specs; ``str(rule.spec)`` inverts it.

Grammar::

    rule    := NAME [":" KEY "=" VALUE ("," KEY "=" VALUE)*]
             | ("any_of" | "all_of") "(" rule ("," rule)* ")"
             | "one_of" "(" rule ("," rule)* ")" [":index=" INT]

Inside a combinator a comma followed by ``KEY=`` continues the parameter list;
any other comma starts the next rule, so
``any_of(typical:eps=0.09,delta=0.3,mars:theta=0.9)`` reads as expected.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable

from specjax._src.rules.adasd import adasd
from specjax._src.rules.base import AcceptanceRule, RuleSpec, speculative_sampling
from specjax._src.rules.block import block_verification
from specjax._src.rules.combinators import all_of, any_of, one_of
from specjax._src.rules.criteria import additive, multiplicative, top_m, typical
from specjax._src.rules.ears import ears
from specjax._src.rules.fly import fly
from specjax._src.rules.mars import mars
from specjax._src.rules.pad import pad_from_spec

RULES: dict[str, Callable[..., AcceptanceRule]] = {
    "speculative_sampling": speculative_sampling,
    "block_verification": block_verification,
    "ears": ears,
    "mars": mars,
    "fly": fly,
    "adasd": adasd,
    "typical": typical,
    "additive": additive,
    "multiplicative": multiplicative,
    "top_m": top_m,
    "pad": pad_from_spec,  # "pad:head=specjax/assets/pivot,sigma=0.7"
}
ALIASES = {"sd": "speculative_sampling", "lossless": "speculative_sampling", "block": "block_verification"}
COMBINATORS = {"any_of": any_of, "all_of": all_of, "one_of": one_of}
COMBINATOR_PARAMS = {"one_of": ("index",)}  # keys a combinator takes after its rules
STRING_PARAMS = {"head", "variant"}  # values kept as text (a path, a name), not parsed as numbers

_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*")
_KEY_EQ = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=")
_VALUE = re.compile(r"\s*([^,()\s]+)\s*")


def _valid_names() -> str:
    return ", ".join([*RULES, *COMBINATORS, *ALIASES])


def _params_of(name: str) -> list[str]:
    return list(inspect.signature(RULES[name]).parameters)


def rule_from_spec(spec: RuleSpec) -> AcceptanceRule:
    """The rule a :class:`RuleSpec` describes (the inverse of ``rule.spec``)."""
    name = ALIASES.get(spec.name, spec.name)
    if name in COMBINATORS:
        keys = [k for k, _ in spec.params]
        extra = COMBINATOR_PARAMS.get(name, ())
        if keys[:1] != ["rules"] or any(k not in extra for k in keys[1:]) or len(set(keys)) != len(keys):
            allowed = " and ".join(repr(k) for k in ("rules",) + extra)
            raise ValueError(f"{name} takes only {allowed}, got {keys}")
        return COMBINATORS[name](*(rule_from_spec(s) for s in spec.params[0][1]), **dict(spec.params[1:]))
    if name not in RULES:
        raise ValueError(f"unknown rule {spec.name!r}; valid rules: {_valid_names()}")
    valid = _params_of(name)
    keys = [k for k, _ in spec.params]
    dup = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if dup is not None:
        raise ValueError(f"{name}: parameter {dup!r} given twice; give each parameter once")
    kwargs = dict(spec.params)
    unknown = [k for k in kwargs if k not in valid]
    if unknown:
        raise ValueError(
            f"{name} has no parameter {unknown[0]!r}; valid parameters: {', '.join(valid) or 'none'}"
        )
    missing = [
        k for k, p in inspect.signature(RULES[name]).parameters.items()
        if p.default is inspect.Parameter.empty and k not in kwargs
    ]
    if missing:
        raise ValueError(f"{name} needs parameter(s) {', '.join(missing)}")
    return RULES[name](**kwargs)


def _number(text: str, where: str) -> Any:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    raise ValueError(f"{where}: {text!r} is not a number")


class _Parser:
    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"cannot parse rule {self.text!r} at position {self.pos}: {what}")

    def match(self, pattern: re.Pattern):
        m = pattern.match(self.text, self.pos)
        if m:
            self.pos = m.end()
        return m

    def peek(self, char: str) -> bool:
        rest = self.text[self.pos:].lstrip()
        return rest.startswith(char)

    def take(self, char: str) -> None:
        if not self.peek(char):
            raise self.error(f"expected {char!r}")
        self.pos = self.text.index(char, self.pos) + 1

    def rule(self) -> RuleSpec:
        m = self.match(_NAME)
        if not m:
            raise self.error(f"expected a rule name (one of: {_valid_names()})")
        name = m.group(1)
        if name in COMBINATORS:
            self.take("(")
            subs = [self.rule()]
            while self.peek(","):
                self.take(",")
                subs.append(self.rule())
            self.take(")")
            return RuleSpec(name, (("rules", tuple(subs)),) + tuple(self.params(name)))
        return RuleSpec(name, tuple(self.params(name)))

    def params(self, name: str) -> list:
        params = []
        if self.peek(":"):
            self.take(":")
            while True:
                key_at = self.pos
                key = self.match(_KEY_EQ)
                if not key:
                    raise self.error("expected key=value")
                value = self.match(_VALUE)
                if not value:
                    raise self.error(f"expected a value for {key.group(1)!r}")
                text = value.group(1)
                if any(k == key.group(1) for k, _ in params):
                    self.pos = key_at
                    raise self.error(
                        f"{name}: parameter {key.group(1)!r} given twice; give each parameter once"
                    )
                params.append((key.group(1), text if key.group(1) in STRING_PARAMS
                               else _number(text, f"{name}: {key.group(1)}")))
                # A comma continues the parameters only if "key=" follows it.
                if not (self.peek(",") and _KEY_EQ.match(self.text, self.text.index(",", self.pos) + 1)):
                    break
                self.take(",")
        return params


def parse_spec(text: str) -> RuleSpec:
    """Parse ``text`` into a :class:`RuleSpec` without building the rule."""
    if not isinstance(text, str):
        raise ValueError(f"a rule spec must be a string, got {text!r}")
    parser = _Parser(text)
    spec = parser.rule()
    if parser.text[parser.pos:].strip():
        raise parser.error("unexpected trailing text")
    return spec


def parse_rule(text: str) -> AcceptanceRule:
    """Build a rule from a string, e.g. ``"mars:theta=0.9"``, ``"ears:beta=0.2"``,
    ``"typical:eps=0.09,delta=0.3"``, ``"sd"`` (aliases: ``lossless``,
    ``speculative_sampling``), ``"any_of(sd,mars:theta=0.9)"``.

    ``parse_rule(str(rule.spec)).spec == rule.spec`` for every built-in rule.
    Unknown rules or parameters raise ``ValueError`` listing the valid ones.
    """
    return rule_from_spec(parse_spec(text))
