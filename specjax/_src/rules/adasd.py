"""AdaSD's verification threshold: JS-distance acceptance with running means.

"AdaSD: Adaptive Speculative Decoding for Efficient Language Model Inference".
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

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
)

Array = jax.Array


class AdaSDState(NamedTuple):
    """One sequence's running JS-distance statistics (float32 scalars).

    Counts are float so the state is one dtype; they stay exact up to 2**24.
    """

    accepted_sum: Array
    accepted_count: Array
    rejected_sum: Array
    rejected_count: Array


def adasd_threshold(state: AdaSDState) -> Array:
    """``(mean accepted + mean rejected) / 2``; ``-1`` (relax nothing) until
    at least one accepted and one rejected token have been recorded."""
    both = (state.accepted_count > 0) & (state.rejected_count > 0)
    mean_acc = state.accepted_sum / jnp.maximum(state.accepted_count, 1.0)
    mean_rej = state.rejected_sum / jnp.maximum(state.rejected_count, 1.0)
    return jnp.where(both, 0.5 * (mean_acc + mean_rej), -1.0)


def slot_js_distance(inputs: VerifyInputs) -> Array:
    """``[K]`` JS distance between the draft's and the target's distributions
    at each slot's position (their warped logits' softmax; see :class:`VerifyInputs`)."""
    return common.js_distance(position_probs(inputs), jax.nn.softmax(inputs.draft_logits, axis=-1))


@struct.dataclass
class AdaSD(AcceptanceRule):
    """AdaSD's verification; build it with :func:`adasd`. State: :class:`AdaSDState`."""

    allow_excluded: bool = static_field(False, omit_default=True)
    name = "adasd"

    def init(self) -> AdaSDState:
        zero = jnp.zeros((), jnp.float32)
        return AdaSDState(zero, zero, zero, zero)

    def verify(self, inputs: VerifyInputs, state: AdaSDState, *, greedy: bool) -> Verdict:
        exact, correction = lossless_decision(inputs, greedy=greedy)
        close = slot_js_distance(inputs) < adasd_threshold(state)
        if not self.allow_excluded:
            close &= token_prob(inputs.target_probs, inputs.draft_tokens) > 0
        accept = exact | close
        return Verdict(accept, common.paths(accept, exact, Path.RELAXED), correction)

    def update(self, state: AdaSDState, inputs: VerifyInputs, verdict, num_accepted, *, greedy) -> AdaSDState:
        del verdict, greedy
        d = slot_js_distance(inputs)
        slot = jnp.arange(d.shape[0])
        valid = inputs.valid.astype(bool)
        was_accepted = (valid & (slot < num_accepted)).astype(jnp.float32)
        was_rejected = (valid & (slot == num_accepted)).astype(jnp.float32)
        return AdaSDState(
            accepted_sum=state.accepted_sum + jnp.sum(was_accepted * d),
            accepted_count=state.accepted_count + jnp.sum(was_accepted),
            rejected_sum=state.rejected_sum + jnp.sum(was_rejected * d),
            rejected_count=state.rejected_count + jnp.sum(was_rejected),
        )


def adasd(allow_excluded: bool = False) -> "AdaSD":
    """AdaSD's verification: accept draft tokens whose distributions agree.

    At slot k, ``d_k = JS distance(q_k, p_k)`` (base 2, in [0, 1]) between the
    draft's and the target's whole distributions. If ``d_k < threshold`` the draft
    token is accepted whatever its identity; otherwise the standard rule decides
    (sampling: ``U <= p/q``; greedy: exact match). Acceptances the standard
    rule makes are ``EXACT``; those only the threshold makes are ``RELAXED``.

    Threshold: ``(mean d of accepted tokens + mean d of rejected tokens) / 2``
    over everything this sequence has decided so far (the paper's rule, not its
    appendix variants A-C). Before the sequence has seen both an accepted and a
    rejected token, one of the means does not exist and nothing is relaxed:
    AdaSD starts out as the standard rule. Statistics are per sequence (the
    paper runs one sequence at a time), so batches do not interact.

    ``update`` records the tokens actually decided this cycle: the accepted
    prefix (under "accepted", whichever path accepted it) and the first
    rejected slot, if any, under "rejected"; slots after it and invalid slots are
    not recorded. Greedy decoding uses the models' T=1 distributions.

    Correction after a rejection: the standard rule's — residual
    ``norm(max(0, p - q))`` when sampling, ``argmax p`` when greedy.

    Drafting: the paper pairs this rule with an entropy stop on drafting
    (:func:`specjax.drafting.adasd_entropy`, window 20); ``decode`` drafts with
    fixed K unless given ``drafting=``, and then runs the paper's Verify-Only
    ablation. ``specjax compare`` uses the entropy stop for its AdaSD rows.

    Support guard: a JS-close slot would accept any draft token, also one the
    target's top-k / top-p excluded (``p(x) = 0``); by default such a token is
    not accepted by the threshold, so AdaSD only emits tokens the warped target
    allows. ``allow_excluded=True`` accepts it, as the paper's rule reads.

    On a token tree: a node's child is accepted whatever its identity when
    the draft and target distributions *at the node* are JS-close (so the
    first child is), else the lossless tree test decides; the running means
    record the decided path as a chain's slots (accepted path nodes, then the
    first child rejected where the walk stopped).

    Args:
      allow_excluded: let the threshold accept tokens with ``p(x) = 0``.
    """
    return AdaSD(allow_excluded=bool(allow_excluded))
