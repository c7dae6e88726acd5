"""Acceptance rules: composable pure functions that verify a draft block.

A rule is a hashable value: a frozen pytree dataclass deriving from
:class:`AcceptanceRule`, with pure ``init`` / ``verify`` / ``update`` methods
and a ``spec``. Its numeric hyper-parameters (and PAD's head) are traced, so a
new ``theta`` compiles nothing. Rules are built by lowercase factories and
combined with :func:`any_of` / :func:`all_of`; :func:`one_of` holds several
rules and a traced index choosing which judges (a rule per request in the
slots engine)::

    from specjax.rules import any_of, mars, speculative_sampling, parse_rule

    rule = any_of(speculative_sampling(), mars(theta=0.9))
    rule = parse_rule("any_of(sd,mars:theta=0.9)")        # the same rule

Every rule documents its correction distribution (what replaces the first
rejected draft token) and labels each acceptance with a :class:`Path`.
"""

import warnings

from specjax._src.rules.adasd import AdaSD, AdaSDState, adasd, adasd_threshold
from specjax._src.rules.base import (
    NUM_PATHS,
    AcceptanceRule,
    Path,
    RuleSpec,
    FunctionRule,
    SpeculativeSampling,
    Verdict,
    VerifyInputs,
    from_functions,
    lossless_decision,
    one_hot_argmax,
    position_probs,
    residual_distribution,
    speculative_sampling,
    static_field,
    token_prob,
    traced_field,
)
from specjax._src.rules.block import BlockVerification, block_verification, stopping_probabilities
from specjax._src.rules.combinators import AllOf, AnyOf, OneOf, all_of, any_of, one_of
from specjax._src.rules.common import entropy, js_distance, paths
from specjax._src.rules.criteria import Criterion, additive, criterion, multiplicative, top_m, typical
from specjax._src.rules.ears import Ears, ears
from specjax._src.rules.fly import Fly, fly
from specjax._src.rules.mars import Mars, mars
from specjax._src.models.pivot_head import (
    ARCHS as PIVOT_HEAD_ARCHS,
    PivotHead,
    PivotHeadConfig,
    load_pivot_head,
    resolve_layer,
)
from specjax._src.rules.pad import Pad, PivotPardon, pad, pivot_features, pivot_pardon
from specjax._src.rules.parse import parse_rule, parse_spec, rule_from_spec

__all__ = (
    # interface
    "AcceptanceRule",
    "VerifyInputs",
    "Verdict",
    "Path",
    "NUM_PATHS",
    "RuleSpec",
    "static_field",
    "traced_field",
    # rules (factories, and the value types they return)
    "speculative_sampling",
    "SpeculativeSampling",
    "block_verification",
    "BlockVerification",
    "stopping_probabilities",
    "ears",
    "Ears",
    "mars",
    "Mars",
    "fly",
    "Fly",
    "adasd",
    "AdaSD",
    "AdaSDState",
    "adasd_threshold",
    "typical",
    "additive",
    "multiplicative",
    "top_m",
    "pad",
    "Pad",
    "pivot_pardon",
    "PivotPardon",
    "PivotHead",
    "PivotHeadConfig",
    "PIVOT_HEAD_ARCHS",
    "load_pivot_head",
    "pivot_features",
    "resolve_layer",
    # combinators and building blocks for custom rules
    "any_of",
    "AnyOf",
    "all_of",
    "AllOf",
    "one_of",
    "OneOf",
    "criterion",
    "Criterion",
    "from_functions",
    "FunctionRule",
    "paths",
    "lossless_decision",
    "residual_distribution",
    "one_hot_argmax",
    "position_probs",
    "token_prob",
    "entropy",
    "js_distance",
    # strings and specs
    "parse_rule",
    "parse_spec",
    "rule_from_spec",
)


def load_head(directory):
    """Deprecated name of :func:`load_pivot_head` (``specjax.heads`` loads feature heads)."""
    warnings.warn("specjax.rules.load_head is deprecated; use specjax.rules.load_pivot_head "
                  "(specjax.heads.load_feature_head loads a feature head).", DeprecationWarning, stacklevel=2)
    return load_pivot_head(directory)
