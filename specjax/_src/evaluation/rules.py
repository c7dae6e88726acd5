"""The rules a comparison runs by default, and which of them are lossless.

Rules are named by spec strings (the command line's syntax, :func:`specjax.rules.parse_rule`),
so a list of them can be printed, stored in a report and parsed again.
"""

from __future__ import annotations

import functools

from specjax._src.proposals import drafting as drafting_lib
from specjax._src.rules.parse import parse_rule

# Rules of the default comparison, as spec strings (the CLI's syntax).
DEFAULT_RULES = (
    "speculative_sampling",
    "block_verification",
    "ears:beta=0.1",
    "mars:theta=0.9",
    "adasd",
    "typical:eps=0.09,delta=0.3",
    "additive:t=0.3",
    "multiplicative:alpha=0.1",
    "top_m:m=2",
    "pad:head=shipped,sigma=0.5",  # PAD with the pivot head trained for the embedded pair
)
FULL_RULES = DEFAULT_RULES + ("pad:head=shipped,sigma=0.7",)
QUICK_RULES = ("speculative_sampling", "mars:theta=0.9", "ears:beta=0.1")

# Rules that keep the target's output distribution exactly (greedy: its own greedy text).
LOSSLESS_RULES = frozenset({"speculative_sampling", "block_verification"})


# AdaSD drafts until the draft's entropy exceeds its running threshold, up to a
# window of 20 drafts (AdaSD paper): its row uses that policy, not fixed K.
ADASD_WINDOW = 20


def row_drafting(rule_spec: str, num_draft: int, drafting=None):
    """``(drafting policy, num_draft)`` for one row: AdaSD rows draft with the
    paper's entropy stop (cap ``ADASD_WINDOW``), others with ``drafting``
    (fixed K when None)."""
    if drafting is None and rule_spec.split(":", 1)[0].strip() == "adasd":
        return drafting_lib.adasd_entropy(window=ADASD_WINDOW), ADASD_WINDOW
    return drafting, num_draft


@functools.lru_cache(maxsize=None)
def is_lossless(rule_spec: str) -> bool:
    """Whether the rule keeps the target's distribution exactly (``LOSSLESS_RULES``)."""
    return parse_rule(rule_spec).spec.name in LOSSLESS_RULES
