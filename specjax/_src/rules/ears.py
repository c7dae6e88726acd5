"""EARS: "Efficient Adaptive Rejection Sampling for Accelerating Speculative
Decoding in Large Language Models" (Sun, Mao, Xu, Chen)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from specjax._src.foundation.checks import check_nonnegative
from specjax._src.rules import common
from specjax._src.rules.base import (
    AcceptanceRule,
    Path,
    Verdict,
    VerifyInputs,
    lossless_decision,
    static_field,
    position_probs,
    token_prob,
    traced_field,
)


@struct.dataclass
class Ears(AcceptanceRule):
    """EARS; build it with :func:`ears`. ``beta`` is traced."""

    beta: float = traced_field(0.1)
    allow_excluded: bool = static_field(False, omit_default=True)
    name = "ears"

    def verify(self, inputs: VerifyInputs, state, *, greedy: bool) -> Verdict:
        del state
        exact, correction = lossless_decision(inputs, greedy=greedy)
        if greedy:
            return Verdict(exact, common.paths(exact, exact, Path.PARDON), correction)
        p = token_prob(inputs.target_probs, inputs.draft_tokens)
        q = token_prob(inputs.draft_probs, inputs.draft_tokens)
        # The tolerance reads the target's confidence at the position, not a
        # tree sibling's residual (VerifyInputs).
        tolerance = self.beta * (1.0 - position_probs(inputs).max(-1))
        # p / max(q, 1e-10) >= thr, written without a division.
        threshold = jnp.maximum(inputs.uniforms - tolerance, 0.0)
        pardon = p >= threshold * jnp.maximum(q, 1e-10)
        if not self.allow_excluded:
            pardon &= p > 0
        accept = exact | pardon
        return Verdict(accept, common.paths(accept, exact, Path.PARDON), correction)


def ears(beta: float = 0.1, allow_excluded: bool = False) -> Ears:
    """Speculative sampling with an uncertainty-scaled tolerance on the coin.

    Sampling: accept ``x`` iff ``p(x) / max(q(x), 1e-10) >= max(U - beta * (1 - max p), 0)``.
    Slots the lossless test ``U <= p(x)/q(x)`` accepts are ``EXACT``; slots only
    the tolerance accepts are ``PARDON``. Correction after a rejection: the
    residual ``norm(max(0, p - q))``, as in standard SD (the paper's choice).

    Greedy (temperature 0): exact match, no pardons. EARS relaxes the random
    threshold ``U``, and greedy verification has none; the paper evaluates
    T > 0 only. Correction: ``argmax p``.

    ``beta = 0`` is standard speculative sampling, token for token: the pardon
    test is only consulted where the lossless test (computed exactly as
    :func:`speculative_sampling` does) rejects, and then cannot pass.

    Support guard: when top-k / top-p excluded the draft token from the
    target's distribution (``p(x) = 0``), the pardon test would still pass
    for ``U < beta * (1 - max p)``; by default such a token is never pardoned,
    so EARS only emits tokens the warped target allows, like every other
    rule. ``allow_excluded=True`` applies the paper's formula literally.

    On a token tree sampled at ``T > 0``: each child in turn, the tolerance
    from the target's confidence at the node and the ratio ``p_i / q_i`` from
    what the earlier siblings left; ``beta = 0`` is the exact lossless tree.

    Args:
      beta: base tolerance, ``>= 0``; the paper uses 0.05-0.2.
      allow_excluded: pardon tokens with ``p(x) = 0`` too (the formula as written).
    """
    beta = check_nonnegative("ears: beta", beta)
    return Ears(beta=beta, allow_excluded=bool(allow_excluded))
