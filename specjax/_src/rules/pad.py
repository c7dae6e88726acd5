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

The head (:class:`PivotHead`) is a Flax module plus params, with feature
standardisation (mean / std from the training split) folded in. Architectures:

* ``"pad"`` (default, the authors'): ``Linear(H->64)`` on the hidden state,
  ``Linear(2->16)`` on the two scalars, concat, ``Linear(80->128)``, ReLU,
  ``Linear(128->2)``;
* ``"linear"``: ``Linear(H+2 -> 2)``;
* ``"mlp"``: ``Linear(H+2 -> w)``, ReLU, ``Linear(w -> w)``, ReLU, ``Linear(w -> 2)``.

A head directory holds ``config.json`` and ``params.npz``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Optional, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.checks import check_interval
from specjax._src.rules import common
from flax import struct

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

ARCHS = ("pad", "linear", "mlp")
NUM_SCALARS = 2  # target entropy, target probability of the draft token
DEFAULT_LAYER = -8  # the authors' layer; clamped to the target's depth
CONFIG_FILE = "config.json"
PARAMS_FILE = "params.npz"
# The head trained for the embedded target/draft pair; ``pad(head="shipped")``.
SHIPPED_HEAD = pathlib.Path(__file__).resolve().parents[2] / "assets" / "pivot"
# Heads shipped with the package, by name: each reads its own target's hidden states.
NAMED_HEADS = {
    "shipped": SHIPPED_HEAD,
    "smollm2-135m-instruct": SHIPPED_HEAD.parent / "pivot_smollm2",  # the real pair's short-answer task
}


# ---------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------


def resolve_layer(layer: int, num_layers: int) -> int:
    """Clamps a list-style layer index to a model of ``num_layers`` blocks.

    Negative indices count from the end and are clamped to ``-num_layers``
    (the authors' ``-8`` on a 4-layer model is ``-4``, the first block's
    output); non-negative ones to ``num_layers - 1``. Returns a negative index
    (what the head records and the rule asks the engine for).
    """
    layer, num_layers = int(layer), int(num_layers)
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if layer < 0:
        return max(layer, -num_layers)
    return min(layer, num_layers - 1) - num_layers


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
# The head
# ---------------------------------------------------------------------------


class PivotNet(nn.Module):
    """The classifier; returns ``[..., 2]`` logits (index 1 = pivot)."""

    arch: str = "pad"
    hidden_proj: int = 64
    scalar_proj: int = 16
    width: int = 128

    @nn.compact
    def __call__(self, hidden: Array, scalars: Array) -> Array:
        if self.arch == "pad":
            h = nn.Dense(self.hidden_proj, name="hidden_proj")(hidden)
            s = nn.Dense(self.scalar_proj, name="scalar_proj")(scalars)
            z = nn.relu(nn.Dense(self.width, name="fc")(jnp.concatenate([h, s], -1)))
            return nn.Dense(2, name="out")(z)
        x = jnp.concatenate([hidden, scalars], -1)
        if self.arch == "linear":
            return nn.Dense(2, name="out")(x)
        if self.arch == "mlp":
            x = nn.relu(nn.Dense(self.width, name="fc1")(x))
            x = nn.relu(nn.Dense(self.width, name="fc2")(x))
            return nn.Dense(2, name="out")(x)
        raise ValueError(f"unknown pivot head arch {self.arch!r}; valid: {', '.join(ARCHS)}")


@dataclasses.dataclass(frozen=True)
class PivotHeadConfig:
    """What a head was built for (hashable; saved as ``config.json``).

    Attributes:
      hidden_size: width of the target hidden states it reads.
      layer: the (negative) block index its hidden states come from.
      target_num_layers: depth of the target it was trained on (``None`` if unknown).
      arch: ``"pad"``, ``"linear"`` or ``"mlp"``.
      hidden_proj, scalar_proj, width: layer widths (see ``PivotNet``).
      info: free-form JSON-able metadata (training metrics, label settings).
    """

    hidden_size: int
    layer: int = DEFAULT_LAYER
    target_num_layers: Optional[int] = None
    arch: str = "pad"
    hidden_proj: int = 64
    scalar_proj: int = 16
    width: int = 128
    info: Any = dataclasses.field(default=None, compare=False, hash=False)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"unknown pivot head arch {self.arch!r}; valid: {', '.join(ARCHS)}")
        if int(self.hidden_size) < 1:
            raise ValueError(f"hidden_size must be >= 1, got {self.hidden_size}")

    def net(self) -> PivotNet:
        return PivotNet(self.arch, self.hidden_proj, self.scalar_proj, self.width)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _flatten(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(_flatten(v, key))
        else:
            out[key] = np.asarray(v)
    return out


def _unflatten(flat) -> dict:
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        parts = key.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = jnp.asarray(value)
    return tree


def init_norm(hidden_size: int) -> dict:
    """Identity standardisation."""
    return {
        "hidden_mean": jnp.zeros((hidden_size,), jnp.float32),
        "hidden_std": jnp.ones((hidden_size,), jnp.float32),
        "scalar_mean": jnp.zeros((NUM_SCALARS,), jnp.float32),
        "scalar_std": jnp.ones((NUM_SCALARS,), jnp.float32),
    }


def fit_norm(hidden: np.ndarray, scalars: np.ndarray) -> dict:
    """Per-feature mean / std (std floored) of a training split."""
    hidden, scalars = np.asarray(hidden, np.float64), np.asarray(scalars, np.float64)
    return {
        "hidden_mean": jnp.asarray(hidden.mean(0), jnp.float32),
        "hidden_std": jnp.asarray(np.maximum(hidden.std(0), 1e-3), jnp.float32),
        "scalar_mean": jnp.asarray(scalars.mean(0), jnp.float32),
        "scalar_std": jnp.asarray(np.maximum(scalars.std(0), 1e-3), jnp.float32),
    }


def head_logits(config: PivotHeadConfig, params: dict, hidden: Array, scalars: Array) -> Array:
    """``[..., 2]`` logits. ``params = {"net": flax params, "norm": standardisation}``;
    the standardisation is a constant (no gradient flows into it)."""
    norm = jax.lax.stop_gradient(params["norm"])
    h = (hidden - norm["hidden_mean"]) / norm["hidden_std"]
    s = (scalars - norm["scalar_mean"]) / norm["scalar_std"]
    return config.net().apply({"params": params["net"]}, h, s)


def init_head_params(config: PivotHeadConfig, key: Array, norm: Optional[dict] = None) -> dict:
    net = config.net().init(
        key, jnp.zeros((1, config.hidden_size), jnp.float32), jnp.zeros((1, NUM_SCALARS), jnp.float32)
    )["params"]
    return {"net": net, "norm": init_norm(config.hidden_size) if norm is None else norm}


@dataclasses.dataclass(frozen=True, eq=False)
class PivotHead:
    """A trained pivot classifier: config + params (``{"net", "norm"}``).

    A pytree: ``params`` are its leaves (traced inside the decode loop, so a
    retrained head of the same shape reuses the compiled program) and
    ``config`` its static part. ``source`` is the directory it was loaded
    from (``None`` if built in memory); :func:`pad` records it in the rule's
    spec. It is a label, not part of the program: inside ``jit`` it is None.
    """

    config: PivotHeadConfig
    params: Any
    source: Optional[str] = None

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def layer(self) -> int:
        return int(self.config.layer)

    def logits(self, hidden: Array, scalars: Array) -> Array:
        return head_logits(self.config, self.params, hidden, scalars)

    def prob_pivot(self, hidden: Array, scalars: Array) -> Array:
        """``P(pivot)`` for ``hidden [..., H]``, ``scalars [..., 2]``."""
        return jax.nn.softmax(self.logits(hidden, scalars), axis=-1)[..., 1]

    def save(self, directory: Union[str, os.PathLike]) -> pathlib.Path:
        """Writes ``config.json`` and ``params.npz`` into ``directory``."""
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / CONFIG_FILE).write_text(json.dumps(self.config.to_json(), indent=2, sort_keys=True) + "\n")
        np.savez(d / PARAMS_FILE, **_flatten(jax.device_get(self.params)))
        return d

    @classmethod
    def load(cls, directory: Union[str, os.PathLike]) -> "PivotHead":
        return load_head(directory)

    def __repr__(self) -> str:
        c = self.config
        return (f"PivotHead(arch={c.arch}, hidden_size={c.hidden_size}, layer={c.layer}, "
                f"source={self.source!r})")


jax.tree_util.register_pytree_node(
    PivotHead,
    lambda head: ((head.params,), head.config),
    lambda config, children: PivotHead(config, children[0]),
)


def load_head(directory: Union[str, os.PathLike]) -> PivotHead:
    """Loads a head written by :meth:`PivotHead.save` / ``python -m training.pivot``.

    The head's params are traced by the decode loop, so ``pad(head=PATH)``
    built twice, or with a retrained head of the same shape, reuses one
    compiled program.

    Raises:
      FileNotFoundError: no such directory, or ``config.json`` / ``params.npz`` missing.
    """
    d = pathlib.Path(directory)
    cfg_file, params_file = d / CONFIG_FILE, d / PARAMS_FILE
    for f in (cfg_file, params_file):
        if not f.is_file():
            raise FileNotFoundError(
                f"pivot head: {f} not found. A head directory holds {CONFIG_FILE} and "
                f"{PARAMS_FILE}; write one with `python -m training.pivot --out {d}` "
                "(or PivotHead.save)."
            )
    raw = json.loads(cfg_file.read_text())
    known = {f.name for f in dataclasses.fields(PivotHeadConfig)}
    config = PivotHeadConfig(**{k: v for k, v in raw.items() if k in known})
    with np.load(params_file) as z:
        params = _unflatten({k: z[k] for k in z.files})
    if "net" not in params or "norm" not in params:
        raise ValueError(f"pivot head: {params_file} lacks the 'net' / 'norm' groups.")
    return PivotHead(config, params, source=str(d))


# ---------------------------------------------------------------------------
# The rule
# ---------------------------------------------------------------------------


def _as_head(head) -> PivotHead:
    if isinstance(head, PivotHead):
        return head
    if isinstance(head, str) and head in NAMED_HEADS:
        return load_head(NAMED_HEADS[head])
    if isinstance(head, (str, os.PathLike)):
        return load_head(head)
    raise TypeError(
        f"pad(): head must be a PivotHead or a directory written by `python -m training.pivot`, "
        f"got {type(head).__name__}."
    )


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
    return PivotPardon(head=_as_head(head), sigma=check_interval("pivot_pardon: sigma", sigma, 0.0, 1.0),
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
    head = _as_head(head)
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
