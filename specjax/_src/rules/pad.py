"""PAD: "Reject Only Critical Tokens: Pivot-Aware Speculative Decoding"
(Ziashahabi et al.; the authors' code: amir-zsh/PAD).

Accept a draft token iff the lossless test accepts it, OR a small classifier
(the *pivot head*) says the token is not a pivot — ``P(pivot) <= sigma`` — and
the target gives it at least ``min_prob``. A pivot is a token whose acceptance
would lower the task's expected utility (labels come from target rollouts, see
``training/rollouts.py``; the head is fitted by ``python -m training.pivot``).

Features (:func:`pivot_features`, shared by the labelling code and the rule so
the two cannot drift), per draft slot ``k`` judging draft token ``x_k``:

* the target's block output at layer ``layer`` at ``x_k``'s own position —
  in the engine, ``inputs.features["hidden"][layer][k]``, produced by the
  verification forward itself (no second forward);
* the entropy of the target's distribution at the preceding position (the
  slot that judges ``x_k``), ``H(p_k)`` in nats;
* the target's probability of the draft token there, ``p_k(x_k)``.

``p`` is the target's distribution at the position,
``softmax(inputs.target_logits)`` (:func:`position_probs`): at
temperature 0 the engine passes ``softmax(raw logits)`` and at temperature 1
(no top-k / top-p) the same thing, so a head trained on ``softmax(raw)``
features (what the labelling code uses) sees identical features at T=0 and
T=1. At other temperatures the features shift with the warp.

The head (:class:`PivotHead`: the network, its parameters and its files) lives
in the models layer (``specjax/_src/models/pivot_head.py``); this module is the
rule: pure functions over the target's distribution, the draft tokens and the
head's ``P(pivot)``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

import jax
import jax.numpy as jnp
from flax import struct

from specjax._src.foundation.checks import check_interval
from specjax._src.models.pivot_head import DEFAULT_LAYER, NAMED_HEADS, PivotHead, as_pivot_head, resolve_layer
from specjax._src.rules import common
from specjax._src.rules.base import (
    AcceptanceRule,
    Path,
    RuleSpec,
    SpeculativeSampling,
    Verdict,
    VerifyInputs,
    lossless_decision,
    static_field,
    position_probs,
    token_prob,
    traced_field,
)
from specjax._src.rules.combinators import AnyOf

Array = jax.Array


# ---------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------


def pivot_features(hidden: Array, target_probs: Array, draft_tokens: Array) -> tuple[Array, Array]:
    """The head's inputs for ``K`` draft slots.

    Args:
      hidden: ``[..., K, H]`` target block output at each draft token's own position.
      target_probs: ``[..., K(+1), V]`` target distribution; row ``k`` judges
        draft token ``k`` (extra rows, e.g. the bonus slot, are ignored).
      draft_tokens: ``[..., K]`` int draft tokens.

    Returns:
      ``(hidden [..., K, H] float32, scalars [..., K, 2] float32)`` with
      ``scalars = (entropy of p_k in nats, p_k(x_k))``.
    """
    k = draft_tokens.shape[-1]
    p = target_probs[..., :k, :].astype(jnp.float32)
    ent = common.entropy(p)
    prob = jnp.take_along_axis(p, draft_tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return hidden.astype(jnp.float32), jnp.stack([ent, prob], axis=-1)


# ---------------------------------------------------------------------------
# The rule
# ---------------------------------------------------------------------------


def _check_layer(head: PivotHead, hidden_layer) -> int:
    if hidden_layer is None:
        return head.layer
    n = head.config.target_num_layers
    want = resolve_layer(hidden_layer, n) if n else int(hidden_layer)
    if n:
        same = (want % n) == (head.layer % n)
    else:
        same = want == head.layer
    if not same:
        raise ValueError(
            f"pad(): hidden_layer={hidden_layer} but this head was trained on layer {head.layer}"
            + (f" of a {n}-layer target" if n else "")
            + "; leave hidden_layer unset to use the head's layer, or train a head for that layer."
        )
    return head.layer


def _hidden_for(inputs: VerifyInputs, layer: int, head: PivotHead) -> Array:
    """``[K, H]`` the target's hidden states at ``layer``, checked against the head."""
    feats = inputs.features.get("hidden") if isinstance(inputs.features, dict) else None
    if feats is None or layer not in feats:
        raise ValueError(
            f"pad(): no target hidden states for layer {layer} in inputs.features['hidden'] "
            f"(got {None if feats is None else sorted(feats)}). The rule declares it in "
            "rule.hidden_layers, which specjax.decode provides; a custom engine must do the same."
        )
    hidden = feats[layer]
    if hidden.shape[-1] != head.hidden_size:
        raise ValueError(
            f"pad(): the pivot head reads hidden states of size {head.hidden_size}, but the "
            f"target's layer {layer} gives size {hidden.shape[-1]}: this head was trained "
            "for a different target model."
        )
    return hidden


@struct.dataclass
class PivotPardon(AcceptanceRule):
    """The relaxed half of PAD on its own: accept iff the lossless test accepts
    (``EXACT``) or ``P(pivot) <= sigma`` and ``p(x) >= min_prob`` (``PARDON``).
    Correction: the lossless one (residual, or argmax when greedy).

    ``head`` (its params), ``sigma`` and ``min_prob`` are traced; ``layer``
    is static and declared in :attr:`hidden_layers`.
    """

    head: PivotHead
    sigma: float = traced_field(0.5)
    min_prob: float = traced_field(1e-4)
    layer: int = static_field(DEFAULT_LAYER)
    name = "pivot_pardon"

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return (self.layer,)

    @property
    def spec(self) -> RuleSpec:
        return RuleSpec(self.name, (("sigma", float(self.sigma)), ("min_prob", float(self.min_prob)),
                                    ("hidden_layers", self.layer)))

    def verify(self, inputs: VerifyInputs, state, *, greedy: bool) -> Verdict:
        del state
        exact, correction = lossless_decision(inputs, greedy=greedy)
        hidden = _hidden_for(inputs, self.layer, self.head)
        # The head was trained on the target's distribution at the position.
        p = position_probs(inputs)
        h, scalars = pivot_features(hidden, p, inputs.draft_tokens)
        p_pivot = self.head.prob_pivot(h, scalars)
        p_x = token_prob(p, inputs.draft_tokens)
        pardon = (p_pivot <= self.sigma) & (p_x >= self.min_prob)
        accept = exact | pardon
        return Verdict(accept, common.paths(accept, exact, Path.PARDON), correction)


def pivot_pardon(head: PivotHead, sigma: float, min_prob: float, layer: int) -> PivotPardon:
    """:class:`PivotPardon` (the relaxed half of :func:`pad`)."""
    return PivotPardon(head=as_pivot_head(head), sigma=check_interval("pivot_pardon: sigma", sigma, 0.0, 1.0),
                       min_prob=check_interval("pivot_pardon: min_prob", min_prob, 0.0, 1.0),
                       layer=int(layer))


@struct.dataclass
class Pad(AcceptanceRule):
    """PAD: ``any_of(speculative_sampling(), pivot_pardon(...))`` with its own
    spec; build it with :func:`pad`."""

    pardon: PivotPardon
    name = "pad"

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.pardon.hidden_layers

    @property
    def spec(self) -> RuleSpec:
        p = self.pardon
        # The head's source is a label outside the pytree (None inside jit).
        label = p.head.source if p.head.source is not None else f"<PivotHead@{id(p.head):x}>"
        return RuleSpec(self.name, (("head", label), ("sigma", float(p.sigma)),
                                    ("min_prob", float(p.min_prob)), ("hidden_layers", p.layer)))

    def _inner(self) -> AnyOf:
        return AnyOf(rules=(SpeculativeSampling(), self.pardon))

    def init(self):
        return self._inner().init()

    def verify(self, inputs: VerifyInputs, state, *, greedy: bool) -> Verdict:
        return self._inner().verify(inputs, state, greedy=greedy)


def pad(
    head: Union[PivotHead, str, os.PathLike],
    sigma: float = 0.5,
    min_prob: float = 1e-4,
    hidden_layer: Optional[int] = None,
) -> Pad:
    """Pivot-aware speculative decoding.

    Accept slot ``k`` iff the lossless test accepts it (path ``EXACT``) or the
    pivot head gives ``P(pivot) <= sigma`` and ``p(x_k) >= min_prob`` (path
    ``PARDON``). It is ``any_of(speculative_sampling(), pivot_pardon(...))``
    with its own spec, so it composes like every rule. Correction after a
    rejection: the residual ``norm(max(0, p - q))`` (greedy: ``argmax p``).

    The head runs inside the jitted decode loop on the hidden states the
    verification forward already produced (the rule declares them in
    ``hidden_layers``, which makes :func:`specjax.decode` return them). The
    head's params, ``sigma`` and ``min_prob`` are traced: another head of the
    same shape or another threshold reuses the compiled loop.

    ``sigma = 0`` with a head that never outputs exactly 0, or any head that
    calls every token a pivot, is the lossless rule token for token.

    On a token tree: the head reads each node's own hidden state and the
    target's distribution at its parent; sampling, the lossless half runs on
    the residual the earlier siblings left. A head that calls every token a
    pivot is the exact lossless tree.

    Args:
      head: a :class:`PivotHead`, a directory written by
        ``python -m training.pivot``, or a shipped head by name: ``"shipped"``
        (``specjax/assets/pivot``, trained for the embedded target/draft pair:
        ``parse_rule("pad:head=shipped,sigma=0.7")``) or
        ``"smollm2-135m-instruct"`` (``specjax/assets/pivot_smollm2``, for
        SmolLM2-135M-Instruct, ``python -m training.pivot --task chat``).
      sigma: pivot-probability threshold in ``[0, 1]``; higher accepts more
        (the paper: 0.5, 0.7).
      min_prob: the target must give the draft token at least this probability.
      hidden_layer: the target block whose output the head reads. Default: the
        layer the head was trained on (the authors' ``-8``, clamped to the
        target's depth); passing another layer raises.

    Raises:
      FileNotFoundError: a head directory without its files.
      ValueError: bad sigma / min_prob / layer; at trace time, a head whose
        hidden size differs from the target's.
    """
    name = head if isinstance(head, str) and head in NAMED_HEADS else None
    head = as_pivot_head(head)
    sigma = check_interval("pad: sigma", sigma, 0.0, 1.0)
    min_prob = check_interval("pad: min_prob", min_prob, 0.0, 1.0)
    layer = _check_layer(head, hidden_layer)
    if name is not None:
        head = dataclasses.replace(head, source=name)
    return Pad(pardon=PivotPardon(head=head, sigma=sigma, min_prob=min_prob, layer=layer))


def pad_from_spec(head, sigma: float = 0.5, min_prob: float = 1e-4, hidden_layers: Optional[int] = None):
    """:func:`pad` under the parameter names of its spec (for ``parse_rule``):
    ``"pad:head=specjax/assets/pivot,sigma=0.7"``."""
    if isinstance(hidden_layers, (tuple, list)):
        if len(hidden_layers) != 1:
            raise ValueError(f"pad takes one hidden layer, got {hidden_layers}")
        hidden_layers = hidden_layers[0]
    return pad(head, sigma=sigma, min_prob=min_prob, hidden_layer=hidden_layers)
