"""Context lookup: draft tokens copied from the sequence's own earlier text.

Prompt lookup decoding (Saxena, 2023; Hugging Face's
``prompt_lookup_num_tokens``, vLLM's ``ngram`` speculator) drafts by finding
the sequence's last few tokens earlier in its context (prompt and answer so
far) and proposing what followed them there. Chat answers repeat names,
phrases and list structure, and a small model's greedy text repeats itself,
so where such a match exists the copy is often right: on SmolLM2-135M's
greedy answers to held-out chat prompts, a match of 3+ tokens exists at 24%
of positions and its next token is the target's own 82% of the time, against
59% for the trained feature head over all positions.

Here the lookup is combined with the draft model or head, slot by slot: a
cycle's draft slot ``j`` takes the copied token where the match has one
(``valid[:, j]``), else the drafter's own token. The drafter runs every slot
as usual and its next step reads the token actually proposed, copied or its
own, so the mixture is one chain. A copied token is proposed as a point
mass ``q = delta(token)``: speculative sampling accepts it with probability
``p(token)`` and resamples from ``p`` without it, so the output law is the
target's at any temperature (Leviathan et al., arXiv:2211.17192).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax._src.foundation.checks import check_positive_int

Array = jax.Array


class _NgramLookupFields(NamedTuple):
    min_match: int
    max_match: int


class NgramLookup(_NgramLookupFields):
    """Static settings of the context lookup (part of the compiled program's key).

    Checked when made, however it is made (``NgramLookup(...)``, ``ngram_lookup``
    or ``_replace``): positive integers with ``max_match >= min_match``.

    Attributes:
      min_match: the fewest trailing tokens that must match earlier context.
      max_match: the longest trailing n-gram tried; the longest match wins,
        the most recent one among equals.
    """

    __slots__ = ()

    def __new__(cls, min_match: int = 2, max_match: int = 8):
        min_match = check_positive_int("ngram_lookup min_match", min_match)
        max_match = check_positive_int("ngram_lookup max_match", max_match)
        if max_match < min_match:
            raise ValueError(f"ngram_lookup: max_match ({max_match}) must be >= min_match ({min_match}).")
        return super().__new__(cls, min_match, max_match)

    @classmethod
    def _make(cls, iterable):  # namedtuple's _make (and so _replace) would skip __new__
        return cls(*iterable)


def ngram_lookup(min_match: int = 2, max_match: int = 8) -> NgramLookup:
    """Draft from the context where its last ``min_match..max_match`` tokens
    occurred before: ``specjax.decode(..., lookup=ngram_lookup())``.

    Shorter matches are found more often and are wrong more often. On the
    real pair (SmolLM2-135M-Instruct with its feature head, greedy, 64
    held-out chat prompts) ``min_match=2`` raised tau the most (+0.109 per
    prompt, against +0.083 for 4); at T=1 no setting changed it measurably
    (BENCHMARKS.md).
    """
    return NgramLookup(min_match, max_match)


def lookup_drafts(tokens: Array, num_committed: Array, num_draft: int, lookup: NgramLookup) -> tuple[Array, Array]:
    """The copied continuation of each sequence's longest trailing n-gram match.

    Args:
      tokens: ``int32 [B, L]``; row ``b``'s context is ``tokens[b, :num_committed[b]]``
        (what lies past it is ignored).
      num_committed: ``int32 [B]``, ``n``.
      num_draft: K, the slots to fill.
      lookup: the match lengths to try.

    Returns:
      ``(drafts int32 [B, K], valid bool [B, K])``: with a match of length ``m``
      (``min_match <= m <= max_match``) ending at ``e < n - 1``, i.e.
      ``tokens[e - m + 1 : e + 1] == tokens[n - m : n]``, slot ``j`` holds
      ``tokens[e + 1 + j]``, valid while ``e + 1 + j < n``; no slot is valid
      without a match.
    """
    batch, length = tokens.shape
    n = num_committed[:, None]
    ends = jnp.arange(length)[None, :]  # e: where a candidate match ends
    run = jnp.ones((batch, length), bool)
    match_len = jnp.zeros((batch, length), jnp.int32)
    # Static: compare the k-th token back. No match is longer than the buffer,
    # so a larger max_match would only unroll (and compile) more of the same.
    for k in range(min(lookup.max_match, length)):
        here = jnp.take_along_axis(tokens, jnp.clip(ends - k, 0, length - 1), axis=1)
        suffix = jnp.take_along_axis(tokens, jnp.clip(n - 1 - k, 0, length - 1), axis=1)
        run = run & (here == suffix) & (ends - k >= 0) & (n - 1 - k >= 0)
        match_len = match_len + run
    usable = (ends < n - 1) & (match_len >= lookup.min_match)
    # Longest match first, then the latest: one integer score per candidate end.
    score = jnp.where(usable, match_len * length + ends, -1)
    best = jnp.argmax(score, axis=1)
    found = jnp.max(score, axis=1) >= 0
    slots = best[:, None] + 1 + jnp.arange(num_draft)[None, :]
    drafts = jnp.take_along_axis(tokens, jnp.minimum(slots, length - 1), axis=1)
    valid = found[:, None] & (slots < n)
    return jnp.where(valid, drafts, 0), valid
