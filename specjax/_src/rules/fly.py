"""FLy: entropy-gated deferred verification.

"Training-Free Loosely Speculative Decoding: Accepting Semantically Correct
Drafts Beyond Exact Match" (Li, Xu, Li, Yang, Xu, Yin, Li, Ngai, Barsoum;
arXiv:2511.22972, ICLR 2026).

The paper's rule. Exact-match verification truncates the block at the first
draft token the target disagrees with, though the target often goes on to
agree with every following draft token: the mismatch was a different wording,
not an error. FLy keeps such a mismatch, in two tiers: an *entropy gate* (the
target is uncertain at the position: the entropy of its top-3 probabilities,
``-sum p log p`` over the three largest ``p``, not renormalised, is at least a
threshold, 0.3 in the paper) and a *deferred window* (the target natively
accepts the next draft tokens, so it "self-corrects" onto the draft's
continuation). A mismatch that fails either tier is rejected as usual. The
window is not a running count across cycles: both the paper's code
(AMD-AGI/FLy ``fly/models/FLy.py``) and vLLM's ``rejection_sample_method="fly"``
(vllm-project/vllm PR #53987, ``vllm/v1/spec_decode/fly.py``) judge it inside
one verified block, from the target's scores of the drafts after the mismatch,
which one target forward already gives. So the rule needs no state and no
look-ahead beyond the block.

This implementation follows vLLM's kernels, the settings the brief names
(``fly_entropy_threshold``, ``fly_window_size``, ``fly_entropy_top_k``). Slot
``i`` is natively accepted by the lossless test (greedy: ``x == argmax p``;
sampling: ``U q(x) <= p(x)``), and a natively rejected valid slot is accepted
(``Path.RELAXED``) iff

* its top-``k`` entropy ``H_k = -sum_{top k} p log p`` of the target's
  processed distribution at the position (temperature, top-k, top-p applied;
  the model's own T=1 distribution when greedy) is ``>= entropy_threshold``;
* the target allows the draft token (``p(x) > 0``: top-k / top-p did not
  exclude it);
* the next ``window`` slots ``i + 1 .. i + window`` are valid drafted slots
  and all natively accepted (with their own uniforms), so a full window fits
  inside the block.

The window reads the *native* decisions: two mismatches closer than
``window + 1`` slots cannot both be deferred (the later sits in the earlier's
window). Correction after a rejection: the lossless one, ``norm(max(0, p -
q))`` sampling and ``argmax p`` greedy (vLLM's native recovered token).

What differs from the paper's own code (all choices vLLM also makes): its
``win_len`` counts the mismatched slot itself (``win_len = 6`` checks five
drafts after it) and it never defers a mismatch whose window reaches the
block's last slot; at T > 0 its native test is "the draft equals one of two
target samples", where this rule (like vLLM) uses ``U <= p/q``; and it reads
the entropy from the raw logits, where this rule reads the processed
distribution the lossless test uses. The paper's multi-level acceleration
(n-gram / layer-skipped drafters) is drafting, not verification, and is not
part of the rule. On a token tree see :func:`fly`.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from specjax._src.foundation.checks import as_integer, check_nonnegative
from specjax._src.rules import common
from specjax._src.rules.base import (
    AcceptanceRule,
    Path,
    Verdict,
    VerifyInputs,
    lossless_decision,
    position_probs,
    static_field,
    token_prob,
    traced_field,
)

Array = jax.Array

DEFAULT_WINDOW = 6  # vLLM's default: min(6, K - 1)


def top_k_entropy(probs: Array, k: int) -> Array:
    """``[...]`` ``-sum p log p`` over the ``k`` largest probabilities of the
    last axis (not renormalised; zero probabilities add nothing). ``k`` is
    capped at the vocabulary size. Its largest value is ``log k`` for ``k >=
    3`` (``k / e`` for ``k = 1, 2``)."""
    top = common.largest_values(probs, min(int(k), probs.shape[-1]))
    return -jnp.sum(jax.scipy.special.xlogy(top, top), axis=-1)


def max_top_k_entropy(k: int) -> float:
    """The largest :func:`top_k_entropy` any distribution reaches: ``log k``
    for ``k >= 3``, else ``k / e`` (``p = 1/e`` each). A threshold above it
    never relaxes."""
    return math.log(k) if k >= 3 else k / math.e


def following_run(ok: Array) -> Array:
    """``[K]`` int32: how many slots right after slot ``i`` are ``ok`` in a
    row (``ok[i + 1], ok[i + 2], ...`` up to the first False or the block's end)."""
    k = ok.shape[0]
    slot = jnp.arange(k)
    # The first not-ok slot at or after j (K if none), then shifted by one.
    first_bad = jax.lax.cummin(jnp.where(ok, k, slot), axis=0, reverse=True)
    after = jnp.concatenate([first_bad[1:], jnp.full((1,), k, first_bad.dtype)])
    return (after - slot - 1).astype(jnp.int32)


@struct.dataclass
class Fly(AcceptanceRule):
    """FLy; build it with :func:`fly`. ``entropy_threshold`` and an integer
    ``window`` are traced; ``top_k`` is static (it shapes the program), and
    ``window=None`` (vLLM's default, ``min(6, K - 1)`` from the block's width)
    is resolved when the program is built."""

    entropy_threshold: float = traced_field(0.3)
    window: Optional[int] = traced_field(None, omit_default=True)
    top_k: int = static_field(3, omit_default=True)
    name = "fly"

    def window_for(self, k: int):
        """The window a ``k``-slot block uses: ``window``, or ``min(6, k - 1)``
        (at least 1, so a one-slot block never defers)."""
        if self.window is None:
            return max(min(DEFAULT_WINDOW, k - 1), 1)
        return self.window

    def deferred(self, inputs: VerifyInputs, native: Array) -> Array:
        """``[K]`` bool: the natively rejected slots FLy accepts (module doc)."""
        k = inputs.draft_tokens.shape[0]
        valid = inputs.valid.astype(bool)
        # The gate reads the target's confidence at the position (a tree's
        # siblings leave a residual in target_probs; see VerifyInputs).
        uncertain = top_k_entropy(position_probs(inputs), self.top_k) >= self.entropy_threshold
        allowed = token_prob(inputs.target_probs, inputs.draft_tokens) > 0
        window_ok = following_run(native & valid) >= self.window_for(k)
        return valid & ~native & uncertain & allowed & window_ok

    def verify(self, inputs: VerifyInputs, state, *, greedy: bool) -> Verdict:
        del state
        native, correction = lossless_decision(inputs, greedy=greedy)
        accept = native | self.deferred(inputs, native)
        return Verdict(accept, common.paths(accept, native, Path.RELAXED), correction)


def fly(entropy_threshold: float = 0.3, window: Optional[int] = None, top_k: int = 3) -> Fly:
    """Keep a mismatched draft token where the target is uncertain and agrees afterwards.

    A slot the lossless test rejects (greedy: ``x != argmax p``; sampling:
    ``U q(x) > p(x)``) is accepted anyway, as ``Path.RELAXED``, when the
    target's top-``top_k`` entropy there is ``>= entropy_threshold``, the
    target allows ``x`` (``p(x) > 0``), and the lossless test accepts each of
    the next ``window`` drafted slots (which must exist in the block). Every
    slot the lossless test accepts is accepted (``Path.EXACT``). Correction
    after a rejection: the lossless one, the residual ``norm(max(0, p - q))``
    when sampling and ``argmax p`` when greedy. The paper's criterion, its
    sources and what differs from them: the module docstring
    (``specjax._src.rules.fly``).

    Limits: the rule is exactly :func:`speculative_sampling` (the same
    verdicts, so greedy output is the target's own greedy output) when
    ``entropy_threshold`` exceeds the top-k entropy's largest value (``log
    top_k`` for ``top_k >= 3``, ``top_k / e`` below), or when ``window`` is at
    least the number of drafted slots (no window fits). ``entropy_threshold =
    0`` drops the gate: every window-confirmed mismatch the target allows is
    kept.

    FLy judges chains; ``decode(tree=...)`` and the slots engine refuse it.
    Greedy trees hand a rule all nodes as one block in breadth-first order
    (each judged as a child of its parent), so the slots after a node are not
    its descendants and the window would read unrelated nodes; on a sampled
    tree a node's children are one-slot blocks, where no window fits, and
    FLy would be the lossless tree anyway.

    Args:
      entropy_threshold: the entropy gate, ``>= 0`` (paper and vLLM: 0.3).
      window: how many natively accepted drafts must follow a mismatch,
        ``>= 1``; ``None`` (default): vLLM's ``min(6, K - 1)`` for a block of
        ``K`` draft slots (``decode``'s ``num_draft``).
      top_k: how many of the target's largest probabilities the entropy sums,
        ``>= 1`` (paper and vLLM: 3).
    """
    threshold = check_nonnegative("fly: entropy_threshold", entropy_threshold)
    if window is not None:
        w = as_integer(window)
        if w is None or w < 1:
            raise ValueError(f"fly: window must be an integer >= 1 (or None for min(6, K - 1)), got {window!r}.")
        window = w
    k = as_integer(top_k)
    if k is None or k < 1:
        raise ValueError(f"fly: top_k must be an integer >= 1, got {top_k!r}.")
    return Fly(entropy_threshold=threshold, window=window, top_k=k)
