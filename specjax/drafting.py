"""Drafting policies: how many tokens the draft proposes per cycle.

A separate, composable axis from acceptance rules::

    import specjax
    from specjax import drafting

    out = specjax.decode(params, prompts, drafting=drafting.heuristic(), num_draft=8, key=key)
    hf_default = drafting.combine(drafting.heuristic(), drafting.confidence(0.4))

``num_draft`` (K) is the cap and the shape of every draft buffer; each policy
decides, per sequence, how many of the K slots to fill.

What fills them is the draft model or head, and optionally a context lookup
that copies tokens from earlier in the sequence where its last few tokens
occurred before (prompt lookup decoding), slot by slot ahead of the drafter::

    out = specjax.decode(params, prompts, lookup=drafting.ngram_lookup(min_match=2), num_draft=3)
    out.stats.copied, out.stats.copied_accepted
"""

from specjax._src.proposals.drafting import (
    AdaSDEntropyState,
    Auto,
    AutoState,
    CostModel,
    DraftingPolicy,
    DraftOutcome,
    DraftStep,
    PolicySpec,
    adasd_entropy,
    adasd_entropy_threshold,
    auto,
    best_draft_length,
    combine,
    confidence,
    drafts_before_evidence,
    expected_tokens,
    fixed,
    heuristic,
    parse_drafting,
    stack_costs,
)
from specjax._src.proposals.lookup import NgramLookup, lookup_drafts, ngram_lookup

__all__ = (
    "DraftingPolicy",
    "DraftStep",
    "DraftOutcome",
    "PolicySpec",
    "fixed",
    "auto",
    "Auto",
    "AutoState",
    "CostModel",
    "stack_costs",
    "expected_tokens",
    "best_draft_length",
    "drafts_before_evidence",
    "adasd_entropy",
    "AdaSDEntropyState",
    "adasd_entropy_threshold",
    "heuristic",
    "confidence",
    "combine",
    "parse_drafting",
    "NgramLookup",
    "ngram_lookup",
    "lookup_drafts",
)
