"""MARS: margin-aware speculative verification.

"MARS: Unleashing the Power of Speculative Decoding via Margin-Aware
Verification" (Song, Wang et al.; the paper's Algorithm 1 is greedy); the sampling form comes in two named variants, see :func:`mars`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax._src.foundation.checks import check_positive
from specjax._src.rules import common
from flax import struct

from specjax._src.rules.base import (
    AcceptanceRule,
    Path,
    Verdict,
    VerifyInputs,
    lossless_decision,
    static_field,
    token_prob,
    traced_field,
)

Array = jax.Array


def low_margin(logits: Array, theta: float) -> Array:
    """``[...]`` bool: ``z(1) > 0`` and ``r = z(2)/z(1) > theta`` over the last axis.

    The logit ratio is undefined at ``z(1) = 0`` and flips meaning for
    ``z(1) < 0`` (it is not shift invariant), so a non-positive top logit never
    counts as low-margin: MARS then verifies losslessly. The test is written as
    ``z(2) > theta * z(1)``, which never divides and is False when top-k/top-p
    masked ``z(2)`` to ``-inf``.
    """
    top2 = common.largest_values(logits, 2)
    z1, z2 = top2[..., 0], top2[..., 1]
    return (z1 > 0) & (z2 > theta * z1)


VARIANTS = ("paper", "authors")


def authors_low_margin(logits: Array, theta: float) -> Array:
    """The authors' ratio test, float for float: ``z(2) / (z(1) + 1e-10) > theta``.

    No ``z(1) > 0`` guard: with a negative top logit the ratio can exceed
    theta although the margin is large. A zero denominator gives ``inf`` or
    ``nan`` (never a crash); ``nan > theta`` is False.
    """
    top2 = common.largest_values(logits, 2)
    return top2[..., 1] / (top2[..., 0] + 1e-10) > theta


def authors_correction(inputs: VerifyInputs) -> Array:
    """``[K, V]``: p with only the rejected draft token's entry lowered to
    ``max(0, p(x) - q(x))``, renormalised (the authors' standard branch)."""
    k = inputs.draft_tokens.shape[0]
    p = inputs.target_probs[:k]
    q_x = token_prob(inputs.draft_probs, inputs.draft_tokens)
    hit = jnp.arange(p.shape[-1])[None, :] == inputs.draft_tokens[:, None]
    adjusted = jnp.where(hit, jnp.maximum(p - q_x[:, None], 0.0), p)
    return adjusted / jnp.maximum(adjusted.sum(-1, keepdims=True), 1e-30)


@struct.dataclass
class Mars(AcceptanceRule):
    """MARS; build it with :func:`mars`. ``theta`` is traced, ``variant`` static."""

    theta: float = traced_field(0.9)
    variant: str = static_field("paper", omit_default=True)
    name = "mars"

    def verify(self, inputs: VerifyInputs, state, *, greedy: bool) -> Verdict:
        del state
        k = inputs.draft_tokens.shape[0]
        logits = inputs.target_logits[:k]
        exact, correction = lossless_decision(inputs, greedy=greedy)
        in_top2 = common.token_rank(logits, inputs.draft_tokens) < 2
        if greedy or self.variant == "paper":
            accept = exact | (in_top2 & low_margin(logits, self.theta))
            return Verdict(accept, common.paths(accept, exact, Path.RELAXED), correction)
        relax = authors_low_margin(logits, self.theta)
        accept = jnp.where(relax, in_top2, exact)
        correction = jnp.where(relax[:, None], inputs.target_probs[:k], authors_correction(inputs))
        return Verdict(accept, common.paths(accept, exact & accept, Path.RELAXED), correction)


def mars(theta: float = 0.9, variant: str = "paper") -> "Mars":
    """Accept the target's runner-up token when its logit margin is small.

    Greedy, both variants (the paper's Algorithm 1): low margin at a slot means
    ``z(1) > 0`` and ``z(2)/z(1) > theta`` on the raw target logits; accept
    ``x == top1`` (``EXACT``), or ``x`` in the top-2 at a low-margin slot
    (``RELAXED``); otherwise reject and emit ``argmax p``. Ties count
    generously: a token tied with ``z(2)`` is "top-2". (The authors' code
    verifies greedy strictly, without MARS; the paper's algorithm is used.)

    Sampling, ``variant="paper"`` (the default; consistent with the lossless
    rule): on the warped logits (dividing by the temperature leaves the ratio
    unchanged), a draft in the top-2 at a low-margin slot is accepted, and
    everywhere else -- including non-top-2 drafts at low-margin slots -- the
    standard test ``U <= p/q`` decides. Correction after a rejection: the
    residual ``norm(max(0, p - q))``. Every token the lossless rule would
    accept, MARS accepts.

    Sampling, ``variant="authors"`` (``evaluate_posterior`` in the authors'
    code, 5SSjw/MARS ``mars/model/utils.py``, chain drafts): at a slot whose
    ratio ``z(2)/(z(1) + 1e-10) > theta`` (no sign guard) the draft is accepted
    iff it is in the top-2 and rejected outright otherwise, the correction
    being ``p`` itself; at other slots ``U <= min(1, p/q)`` decides and a
    rejection corrects with ``p`` whose draft-token entry alone is lowered to
    ``max(0, p(x) - q(x))``, renormalised. This is not the lossless residual:
    even at ``theta >= 1`` the output distribution differs from the target's.

    Paths: ``EXACT`` where the lossless test (same ``U``) also accepts, else
    ``RELAXED``. ``theta >= 1`` with ``variant="paper"`` is exactly the
    lossless rule (``z(2)/z(1) <= 1`` never exceeds it).

    On a token tree (``decode(tree=...)``): greedy, each node is accepted by
    the test above at its parent; sampling, a node's children are tried in
    turn, the margin read from the target's logits at the node and the
    lossless test from the residual the earlier siblings left. A node's
    runner-up is thus accepted at a low-margin node even after its top token
    was drafted and rejected. ``theta >= 1`` (paper variant) is the exact
    lossless tree.

    Args:
      theta: ratio threshold, ``> 0`` (paper: 0.9).
      variant: ``"paper"`` or ``"authors"``, the sampling form (see above).
    """
    theta = check_positive("mars: theta", theta)
    if variant not in VARIANTS:
        raise ValueError(f"mars: variant must be one of {', '.join(VARIANTS)}, got {variant!r}.")
    return Mars(theta=theta, variant=variant)
