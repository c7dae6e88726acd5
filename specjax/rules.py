"""Acceptance rules: composable pure functions that verify a draft block.

A rule is an :class:`AcceptanceRule` — ``init``, ``verify``, ``update`` and a
``spec`` — built by a lowercase factory and combined with :func:`any_of` /
:func:`all_of`::

    from specjax.rules import any_of, mars, speculative_sampling, parse_rule

    rule = any_of(speculative_sampling(), mars(theta=0.9))
    rule = parse_rule("any_of(sd,mars:theta=0.9)")        # the same rule

Every rule documents its correction distribution (what replaces the first
rejected draft token) and labels each acceptance with a :class:`Path`.
"""

from specjax._src.rules.adasd import AdaSDState, adasd, adasd_threshold
from specjax._src.rules.base import (
    NUM_PATHS,
    AcceptanceRule,
    Path,
    RuleSpec,
    Verdict,
    VerifyInputs,
    lossless_decision,
    no_state,
    one_hot_argmax,
    residual_distribution,
    speculative_sampling,
    stateless_update,
    token_prob,
)
from specjax._src.rules.combinators import all_of, any_of
from specjax._src.rules.common import entropy, js_distance
from specjax._src.rules.criteria import criterion, additive, multiplicative, top_m, typical
from specjax._src.rules.ears import ears
from specjax._src.rules.mars import mars
from specjax._src.rules.pad import PivotHead, PivotHeadConfig, load_head, pad, pivot_features, pivot_pardon
from specjax._src.rules.parse import parse_rule, parse_spec, rule_from_spec

__all__ = (
    # interface
    "AcceptanceRule",
    "VerifyInputs",
    "Verdict",
    "Path",
    "NUM_PATHS",
    "RuleSpec",
    # rules
    "speculative_sampling",
    "ears",
    "mars",
    "adasd",
    "AdaSDState",
    "adasd_threshold",
    "typical",
    "additive",
    "multiplicative",
    "top_m",
    "pad",
    "pivot_pardon",
    "PivotHead",
    "PivotHeadConfig",
    "load_head",
    "pivot_features",
    # combinators and building blocks for custom rules
    "any_of",
    "all_of",
    "criterion",
    "lossless_decision",
    "residual_distribution",
    "one_hot_argmax",
    "token_prob",
    "no_state",
    "stateless_update",
    "entropy",
    "js_distance",
    # strings and specs
    "parse_rule",
    "parse_spec",
    "rule_from_spec",
)
