"""Block verification: a lossless rule that judges the draft block jointly.

"Block Verification Accelerates Speculative Decoding" (Sun, Mendlovic,
Leviathan, Aharoni, Ro, Beirami, Suresh; arXiv:2403.10444, ICLR 2025).
Token-by-token speculative sampling stops at the first slot whose test
``U <= p/q`` fails. Block verification keeps a running weight
``w_i = min(w_{i-1} p(x_i) / q(x_i), 1)`` (``w_0 = 1``) and, at every prefix
length ``i``, the mass the target still owes there,
``r_i = max(w_i p_i - q_i, 0)`` (``q_v = 0`` after the last draft ``v``). Slot
``i`` is a stopping point with probability ``h_i = |r_i| / (|r_i| + 1 - w_i)``;
the accepted length is the *last* stopping point ``tau``, and the emitted token
is drawn from ``r_tau`` normalised (the target's own ``p_v`` when
``tau = v``). The output follows the target's law exactly, and the expected
number of accepted drafts is the largest any valid verifier reaches from the
same drafts: never fewer than token verification's (the paper's binary example,
``p = (1/3, 2/3)`` and ``q = (2/3, 1/3)`` with two drafts, accepts 11/9 tokens
against 10/9; ``tests/test_block_verification.py`` checks both numbers).

The gain needs a sampled block of two or more drafts: at temperature 0 the
rule is greedy exact match, and a one-draft block (a tree's children, judged
one at a time) is verified exactly as by :func:`speculative_sampling`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax._src.rules.base import AcceptanceRule, Path, Verdict, VerifyInputs, lossless_decision, token_prob

Array = jax.Array


def block_weights(inputs: VerifyInputs) -> Array:
    """``[K + 1]`` the running weights ``w_0 = 1``, ``w_i = min(w_{i-1} p(x_i) / q(x_i), 1)``."""
    p = token_prob(inputs.target_probs, inputs.draft_tokens)
    q = token_prob(inputs.draft_probs, inputs.draft_tokens)
    # q(x) > 0 for a drafted token; invalid slots only need a finite value.
    ratio = jnp.where(q > 0, p / jnp.maximum(q, 1e-30), 1.0)

    def step(w, r):
        w = jnp.minimum(w * r, 1.0)
        return w, w

    _, ws = jax.lax.scan(step, jnp.float32(1.0), ratio.astype(jnp.float32))
    return jnp.concatenate([jnp.ones((1,), jnp.float32), ws])


def stopping_probabilities(inputs: VerifyInputs) -> tuple[Array, Array]:
    """``(h [K], residuals [K, V])``: the chance ``h_i`` that prefix length
    ``i = 1..K`` is a stopping point (0 past the last valid slot), and the
    normalised residual at each prefix length ``0..K-1``, the correction when
    the accepted length is that one. With independent ``U_i``,
    ``P(tau = t) = h_t prod_{i > t} (1 - h_i)``."""
    k = inputs.draft_tokens.shape[0]
    valid = inputs.valid.astype(bool)
    v = jnp.sum(jnp.cumprod(valid.astype(jnp.int32)))  # slots drafted (a leading run)
    w = block_weights(inputs)  # [K + 1]
    positions = jnp.arange(k + 1)
    q_next = jnp.concatenate([inputs.draft_probs, jnp.zeros_like(inputs.draft_probs[:1])], axis=0)
    q_next = jnp.where((positions < v)[:, None], q_next, 0.0)  # no draft after the last one
    residual = jnp.maximum(w[:, None] * inputs.target_probs - q_next, 0.0)  # [K + 1, V]
    mass = residual.sum(-1)
    denominator = mass + 1.0 - w
    # 0/0 only where w = 1 and nothing is owed: never a stopping point there.
    stop = jnp.where(denominator > 1e-12, mass / jnp.maximum(denominator, 1e-30), 0.0)
    stop = jnp.where(positions[1:] <= v, stop[1:], 0.0)
    total = mass[:k, None]
    correction = jnp.where(total > 1e-12, residual[:k] / jnp.maximum(total, 1e-30), inputs.target_probs[:k])
    return stop, correction


def block_decision(inputs: VerifyInputs) -> tuple[Array, Array]:
    """Block verification of one sampled block.

    Returns ``(tau, residuals)``: the accepted length (int32 scalar, ``0..v``
    for ``v`` valid slots), the last prefix length whose ``U_i <= h_i``, and
    ``[K, V]`` the correction at each prefix length
    (:func:`stopping_probabilities`).
    """
    stop, correction = stopping_probabilities(inputs)
    positions = jnp.arange(1, stop.shape[0] + 1)
    tau = jnp.max(jnp.where((inputs.uniforms <= stop) & (stop > 0), positions, 0)).astype(jnp.int32)
    return tau, correction


@struct.dataclass
class BlockVerification(AcceptanceRule):
    """Lossless block verification (arXiv:2403.10444); greedy exact match at T=0.

    Accepts the first ``tau`` drafts, ``tau`` the last stopping point of the
    block (module doc), so slot ``k`` is accepted iff ``k < tau``: unlike the
    other rules its slots are decided jointly, and a slot that token-by-token
    verification would reject can be kept because later drafts restore the
    target's law. Correction: the normalised residual ``max(w_tau p - q, 0)``
    at the accepted length. Combining it with relaxed rules (:func:`any_of`)
    is allowed but gives up exactness, as every relaxation does.
    """

    name = "block_verification"
    lossless = True  # a tree's children are one-draft blocks: the lossless test (module doc)

    def verify(self, inputs: VerifyInputs, state, *, greedy: bool) -> Verdict:
        del state
        if greedy:
            accept, correction = lossless_decision(inputs, greedy=True)
        else:
            tau, correction = block_decision(inputs)
            accept = jnp.arange(inputs.draft_tokens.shape[0]) < tau
        path = jnp.where(accept, Path.EXACT, Path.REJECTED).astype(jnp.int32)
        return Verdict(accept=accept, path=path, correction=correction)


def block_verification() -> BlockVerification:
    """Lossless block verification; see :class:`BlockVerification`."""
    return BlockVerification()
