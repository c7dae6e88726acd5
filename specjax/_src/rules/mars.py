"""MARS: margin-aware speculative verification (mars.txt)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax._src.rules import common
from specjax._src.rules.base import (
    AcceptanceRule,
    Path,
    RuleSpec,
    Verdict,
    VerifyInputs,
    lossless_decision,
    no_state,
    stateless_update,
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


def mars(theta: float = 0.9) -> AcceptanceRule:
    """Accept the target's runner-up token when its logit margin is small.

    Low margin at a slot means ``z(1) > 0`` and ``z(2)/z(1) > theta`` on the
    target logits the engine passes (raw when greedy; warped when sampling —
    dividing by the temperature leaves the ratio unchanged).

    Greedy (the paper's Algorithm 1): accept ``x == top1`` (``EXACT``), or ``x``
    in the top-2 at a low-margin slot (``RELAXED``); otherwise reject and emit
    ``argmax p``. Ties count generously: a token tied with ``z(2)`` is "top-2".

    Sampling (the authors' code): at a low-margin slot a draft token in the
    target's top-2 is accepted; everywhere else standard ``U <= p/q`` rejection
    sampling decides. Acceptances the lossless test (same ``U``) would also
    make are ``EXACT``, the others ``RELAXED``. Correction after a rejection:
    the residual ``norm(max(0, p - q))``, as the authors' code does.

    ``theta >= 1`` can never be exceeded by ``z(2)/z(1) <= 1``, so MARS then is
    exactly the lossless rule.

    Args:
      theta: ratio threshold, ``> 0`` (paper: 0.9).
    """
    theta = common.check_positive("mars: theta", theta)

    def verify(inputs: VerifyInputs, state, *, greedy: bool) -> Verdict:
        del state
        k = inputs.draft_tokens.shape[0]
        logits = inputs.target_logits[:k]
        exact, correction = lossless_decision(inputs, greedy=greedy)
        in_top2 = common.token_rank(logits, inputs.draft_tokens) < 2
        accept = exact | (in_top2 & low_margin(logits, theta))
        return Verdict(accept, common.paths(accept, exact, Path.RELAXED), correction)

    return AcceptanceRule(
        init=no_state,
        verify=verify,
        update=stateless_update,
        spec=RuleSpec("mars", (("theta", theta),)),
    )
