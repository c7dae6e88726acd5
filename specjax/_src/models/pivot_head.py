"""PAD's pivot head: the classifier network, its parameters and its files.

The pivot head of "Reject Only Critical Tokens: Pivot-Aware Speculative
Decoding" (Ziashahabi et al.) scores a draft token from the target's hidden
state at the token and two scalars of the target's distribution (see
:func:`specjax.rules.pivot_features`); :func:`specjax.rules.pad` is the rule
that reads its ``P(pivot)``. This module holds the network (a Flax module plus
params, with the feature standardisation from the training split folded in),
the heads shipped in the package, and the directory format. Architectures:

* ``"pad"`` (default, the authors'): ``Linear(H->64)`` on the hidden state,
  ``Linear(2->16)`` on the two scalars, concat, ``Linear(80->128)``, ReLU,
  ``Linear(128->2)``;
* ``"linear"``: ``Linear(H+2 -> 2)``;
* ``"mlp"``: ``Linear(H+2 -> w)``, ReLU, ``Linear(w -> w)``, ReLU, ``Linear(w -> 2)``.

A head directory holds ``config.json`` and ``params.npz``; ``python -m
training.pivot`` writes one.
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
    """Fresh ``{"net", "norm"}`` params for ``config`` (identity standardisation unless ``norm``)."""
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

    @classmethod
    def init(cls, config: PivotHeadConfig, key: Array, hidden: Optional[np.ndarray] = None,
             scalars: Optional[np.ndarray] = None) -> "PivotHead":
        """A fresh head for ``config``: random network params from ``key``, and
        the feature standardisation fitted to a training split (``hidden
        [N, H]``, ``scalars [N, 2]``, see :func:`pivot_features`) or, without
        one, the identity."""
        if (hidden is None) != (scalars is None):
            raise ValueError("PivotHead.init: pass both hidden and scalars (the training split's features), "
                             "or neither for the identity standardisation.")
        norm = None if hidden is None else fit_norm(hidden, scalars)
        return cls(config, init_head_params(config, key, norm))

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def layer(self) -> int:
        return int(self.config.layer)

    def logits(self, hidden: Array, scalars: Array) -> Array:
        """``[..., 2]`` classifier logits (index 1 = pivot) for ``hidden [..., H]``, ``scalars [..., 2]``."""
        return head_logits(self.config, self.params, hidden, scalars)

    def prob_pivot(self, hidden: Array, scalars: Array) -> Array:
        """``P(pivot)`` for ``hidden [..., H]``, ``scalars [..., 2]``."""
        return jax.nn.softmax(self.logits(hidden, scalars), axis=-1)[..., 1]

    def save(self, directory: Union[str, os.PathLike]) -> pathlib.Path:
        """Writes ``config.json`` and ``params.npz`` into ``directory``."""
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / CONFIG_FILE).write_text(json.dumps(self.config.to_json(), indent=2, sort_keys=True) + "\n")
        np.savez_compressed(d / PARAMS_FILE, **_flatten(jax.device_get(self.params)))  # deflate: float32 weights take about 8% less
        return d

    @classmethod
    def load(cls, directory: Union[str, os.PathLike]) -> "PivotHead":
        """The head in ``directory`` (:func:`load_pivot_head`)."""
        return load_pivot_head(directory)

    def __repr__(self) -> str:
        c = self.config
        return (f"PivotHead(arch={c.arch}, hidden_size={c.hidden_size}, layer={c.layer}, "
                f"source={self.source!r})")


jax.tree_util.register_pytree_node(
    PivotHead,
    lambda head: ((head.params,), head.config),
    lambda config, children: PivotHead(config, children[0]),
)


def load_pivot_head(directory: Union[str, os.PathLike]) -> PivotHead:
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



def as_pivot_head(head: Union["PivotHead", str, os.PathLike], caller: str = "pad()") -> "PivotHead":
    """``head`` itself if it is a :class:`PivotHead`, else the head a shipped name
    (:data:`NAMED_HEADS`) or a directory names.

    Raises:
      FileNotFoundError: a directory without its files.
      TypeError: anything else.
    """
    if isinstance(head, PivotHead):
        return head
    if isinstance(head, str) and head in NAMED_HEADS:
        return load_pivot_head(NAMED_HEADS[head])
    if isinstance(head, (str, os.PathLike)):
        return load_pivot_head(head)
    raise TypeError(
        f"{caller}: head must be a PivotHead or a directory written by `python -m training.pivot`, "
        f"got {type(head).__name__}."
    )
