"""Sharded decoding: the same ``decode`` on one device, a GPU box or a TPU slice.

JAX's SPMD partitioner is the distributed engine. specjax only says where
things live — ``NamedSharding``\\ s over a :class:`jax.sharding.Mesh` with axes
``('data', 'model')`` — and XLA inserts the collectives, in every layer but
one: a mixture of experts' routed experts, whose data-dependent choice the
partitioner cannot split, run under ``shard_map`` with one all-reduce
(:func:`~specjax._src.models.moe.mesh_routed_experts`).

Layout (Megatron-style tensor parallelism over ``'model'``, data parallelism
over ``'data'``):

=============================  ==================  ==============================
tensor                         shape               spec
=============================  ==================  ==============================
``embed/embedding``            ``[V, H]``          ``('model', None)`` (vocab)
``lm_head``                    ``[H, V]``          ``(None, 'model')`` (vocab)
``attn/{q,k,v}/kernel``        ``[H, heads*D]``    ``(None, 'model')`` (heads)
``attn/qkv/kernel`` (GPT-2)    ``[H, 3*heads*D]``  ``(None, 'model')``
``attn/{q_b,kv_b}/kernel``     ``[r, heads*D]``    ``(None, 'model')`` (latent attention)
``attn/o/kernel``              ``[heads*D, H]``    ``('model', None)``
``mlp/{gate,up,fc}/kernel``    ``[H, I]``          ``(None, 'model')``
``mlp/{down,proj}/kernel``     ``[I, H]``          ``('model', None)``
``mlp/experts_*`` (MoE)        ``[E, ..]``         ``('model', None, None)``
``mlp/experts_*_bias``         ``[E, F]``          ``('model', None)`` (gpt-oss)
norms, biases, ``pos_embed``   any                 replicated
KV cache (per layer)           ``[B, KVH, S, D]``  ``('data', 'model', None, None)``
tokens, lengths, loop state    ``[B, ...]``        ``('data', ...)``
=============================  ==================  ==============================

A column-parallel projection followed by a row-parallel one (q/k/v then o;
gate/up then down) needs one all-reduce of activations per pair and never
moves a weight. The embedding and the LM head are split over the vocabulary
(over the hidden axis when the vocabulary does not divide the ``'model'``
axis, e.g. GPT-2's 50257). Heads, kv heads and the MLP width must divide the
``'model'`` axis and the batch must divide the ``'data'`` axis; otherwise a
``ValueError`` says which and by what, before anything is traced.

Inside the jitted loop, :class:`DecodeLayout` pins the caches and the loop
carry to that layout with ``with_sharding_constraint`` (a ``while_loop``
carry otherwise takes whatever layout propagation settles on) and makes the
outputs replicated, so every host of a multi-host job can read them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from specjax._src.models.lm import KVCache, Model
from specjax._src.models.config import ModelConfig
from specjax._src.models.decoder import Decoder
from specjax._src.models.moe import ExpertMesh
from specjax._src.foundation.checks import check_positive_int
from specjax._src.models.pairing import ModelPair

DATA = "data"
MODEL = "model"

_COLUMN = ("q", "k", "v", "qkv", "gate", "up", "fc", "q_b", "kv_b")  # kernels split on their output axis
_ROW = ("o", "down", "proj")  # kernels split on their input axis


# ---------------------------------------------------------------------------
# Meshes
# ---------------------------------------------------------------------------


def make_mesh(data: Optional[int] = None, model: int = 1, *, devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A ``('data', 'model')`` mesh of ``data * model`` devices.

    Args:
      data: sequences are split over this many devices; default: all devices
        not used by ``model``.
      model: tensor-parallel degree (heads, MLP width, vocabulary).
      devices: default ``jax.devices()`` (every device of every host in a
        multi-host job). The first ``data * model`` are used.

    The axes are ``AxisType.Auto`` (the SPMD partitioner places collectives),
    unlike ``jax.make_mesh``'s default of explicit axes. With all devices, the
    order is ``jax.make_mesh``'s (topology-aware on TPU); with fewer, the first
    ``data * model`` in order.
    """
    devices = list(jax.devices() if devices is None else devices)
    model = check_positive_int("model", model)
    if data is None:
        if len(devices) % model:
            raise ValueError(
                f"make_mesh(model={model}): {len(devices)} devices are not a multiple of {model}; "
                "pass data= explicitly."
            )
        data = len(devices) // model
    data = check_positive_int("data", data)
    if data * model > len(devices):
        raise ValueError(
            f"make_mesh(data={data}, model={model}) needs {data * model} devices; "
            f"only {len(devices)} are available."
        )
    auto = (AxisType.Auto, AxisType.Auto)
    if data * model == len(devices):  # topology-aware order (TPU rings), as jax.make_mesh does
        return jax.make_mesh((data, model), (DATA, MODEL), axis_types=auto, devices=devices)
    grid = np.array(devices[: data * model], dtype=object).reshape(data, model)
    return Mesh(grid, (DATA, MODEL), axis_types=auto)


def _check_mesh(mesh: Mesh) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (specjax.sharding.make_mesh), got {type(mesh).__name__}.")
    missing = [a for a in (DATA, MODEL) if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"the mesh needs axes named 'data' and 'model' (size 1 is fine), it has {mesh.axis_names}; "
            "build it with specjax.sharding.make_mesh(data=, model=)."
        )
    if any(t != AxisType.Auto for t in getattr(mesh, "axis_types", ())):
        # Explicit axes put shardings into types, which Flax's einsums do not annotate.
        return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return mesh


def _axis(mesh: Mesh, name: str) -> int:
    return int(mesh.shape[name])


# ---------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------


def check_divisible(config: ModelConfig, mesh: Mesh, *, batch: Optional[int] = None, name: str = "model") -> None:
    """Raises ``ValueError`` unless ``mesh`` can shard ``config`` (and ``batch``).

    The ``'model'`` axis must divide ``num_heads``, ``num_kv_heads``,
    ``intermediate_size`` and a mixture's ``num_experts`` (and shared expert width); the ``'data'``
    axis must divide ``batch``. The message names the model (``name``), the
    quantity and the axis size.
    """
    mesh = _check_mesh(mesh)
    m = _axis(mesh, MODEL)
    problems = []
    moe = ("num_experts",) + (("shared_expert_intermediate_size",) if config.shared_expert_intermediate_size else ())
    for field in ("num_heads", "num_kv_heads", "intermediate_size") + (moe if config.num_experts else ()):
        value = getattr(config, field)
        if value % m:
            problems.append(f"{field}={value} is not divisible by it ({value} % {m} = {value % m})")
    if problems:
        raise ValueError(
            f"{name}: the mesh's 'model' axis has {m} devices and " + "; ".join(problems) + ". "
            "Use a 'model' axis size that divides them, or keep this model replicated "
            "(specjax.sharding.replicate)."
        )
    if batch is not None:
        check_batch(batch, mesh)


def check_batch(batch: int, mesh: Mesh) -> None:
    """Raises ``ValueError`` unless the ``'data'`` axis divides ``batch``."""
    d = _axis(_check_mesh(mesh), DATA)
    if batch % d:
        raise ValueError(
            f"batch of {batch} sequences is not divisible by the mesh's 'data' axis of {d} devices "
            f"({batch} % {d} = {batch % d}); pad the batch to a multiple of {d} (e.g. {-(-batch // d) * d}) "
            "or use a smaller 'data' axis."
        )


def _vocab_spec(config: ModelConfig, m: int, vocab_axis: int) -> P:
    if config.vocab_size % m == 0:
        spec = [None, None]
        spec[vocab_axis] = MODEL
        return P(*spec)
    if config.hidden_size % m == 0:
        spec = [None, None]
        spec[1 - vocab_axis] = MODEL
        return P(*spec)
    return P()


def _leaf_spec(names: tuple[str, ...], ndim: int, config: ModelConfig, m: int) -> P:
    if ndim < 2:  # norm scales, biases
        return P()
    if names == ("embed", "embedding"):
        return _vocab_spec(config, m, 0)
    if names == ("lm_head",):
        return _vocab_spec(config, m, 1)
    if any(n.startswith("experts_") for n in names[-2:]) and ndim == 3:  # experts over 'model' (quantized too)
        return P(MODEL, None, None)
    if names[-1].startswith("experts_") and names[-1].endswith("_bias") and ndim == 2:  # gpt-oss's [E, F] biases
        return P(MODEL, None)  # split with their experts (ExpertMesh gives every stack leaf P(axis))
    if len(names) >= 2 and names[-1] == "kernel":
        if names[-2] in _COLUMN:
            return P(None, MODEL)
        if names[-2] in _ROW:
            return P(MODEL, None)
    return P()  # pos_embed and anything unknown: replicated


def param_specs(config: ModelConfig, model_axis_size: int = 1):
    """``PartitionSpec``\\ s for a :class:`~specjax.Decoder`'s params (same tree).

    ``model_axis_size`` only decides the vocabulary fallback (see the module
    docstring); divisibility is checked by :func:`check_divisible`.
    """
    shapes = Decoder(config).param_shapes()

    def spec(path, leaf):
        names = tuple(str(getattr(k, "key", k)) for k in path)
        return _leaf_spec(names, len(leaf.shape), config, model_axis_size)

    return jax.tree_util.tree_map_with_path(spec, shapes)


def param_shardings(model_or_config, mesh: Mesh, *, name: str = "model"):
    """``NamedSharding``\\ s for a decoder's params over ``mesh`` (same tree as the params).

    Args:
      model_or_config: a :class:`~specjax.Model` with a :class:`~specjax.Decoder`
        module, a ``Decoder``, or a :class:`~specjax.ModelConfig`.
      mesh: a ``('data', 'model')`` mesh (:func:`make_mesh`).
      name: names the model in error messages.

    Raises:
      ValueError: the ``'model'`` axis does not divide heads, kv heads or the MLP width.
    """
    config = _config_of(model_or_config)
    mesh = _check_mesh(mesh)
    check_divisible(config, mesh, name=name)
    specs = param_specs(config, _axis(mesh, MODEL))
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def cache_spec(config: ModelConfig, mesh: Mesh) -> P:
    """KV buffers ``[B, KVH, S, D]``: ``('data', 'model', None, None)``, or
    ``('data', None, None, None)`` when the kv heads do not divide the ``'model'`` axis
    (a replicated draft with few kv heads)."""
    kv_split = config.num_kv_heads % _axis(mesh, MODEL) == 0
    return P(DATA, MODEL if kv_split else None, None, None)


def _config_of(x) -> ModelConfig:
    if isinstance(x, ModelConfig):
        return x
    module = x.module if isinstance(x, Model) else x
    if isinstance(module, Decoder):
        return module.config
    raise TypeError(
        "sharding rules exist for specjax Decoder models: pass a specjax.Model from specjax.load, "
        f"a Decoder or a ModelConfig, got {type(x).__name__}. For another LanguageModel, place its "
        "params yourself with jax.device_put(params, shardings)."
    )


# ---------------------------------------------------------------------------
# Placing params
# ---------------------------------------------------------------------------


def _is_pair(x) -> bool:
    return isinstance(x, ModelPair)


def _on_mesh(leaf, mesh: Mesh) -> bool:
    s = getattr(leaf, "sharding", None)
    return isinstance(s, NamedSharding) and s.mesh == mesh


def _place(params, shardings, *, keep_placed: bool, mesh: Mesh):
    def put(leaf, sharding):
        if keep_placed and _on_mesh(leaf, mesh):
            return leaf
        return jax.device_put(leaf, sharding)

    return jax.tree_util.tree_map(put, params, shardings)


def shard_params(x, mesh: Mesh, *, config: Optional[ModelConfig] = None, name: Optional[str] = None):
    """Places a decoder's params tensor-parallel over ``mesh`` (see the module docstring).

    Args:
      x: a :class:`~specjax.Model`, a :class:`~specjax.ModelPair` (both
        models are sharded; replicate the draft with :func:`replicate` first
        to keep it whole: leaves already on ``mesh`` are kept), or a raw params
        dict together with ``config=``.
      mesh: a ``('data', 'model')`` mesh.

    Returns:
      the same kind of object with its params as sharded ``jax.Array``\\ s.

    Raises:
      ValueError: the ``'model'`` axis does not divide heads, kv heads or the MLP width.
    """
    mesh = _check_mesh(mesh)
    if _is_pair(x):
        keep = lambda m: all(_on_mesh(l, mesh) for l in jax.tree_util.tree_leaves(m.params))  # noqa: E731
        target = x.target if keep(x.target) else shard_params(x.target, mesh, name="target")
        draft = x.draft if keep(x.draft) else shard_params(x.draft, mesh, name="draft")
        return x.replace(target=target, draft=draft)
    if isinstance(x, Model):
        shardings = param_shardings(x, mesh, name=name or "model")
        return x.replace(params=_place(x.params, shardings, keep_placed=False, mesh=mesh))
    if config is None:
        raise TypeError("shard_params(params, mesh) needs config= (a ModelConfig) for a raw params tree.")
    return _place(x, param_shardings(config, mesh, name=name or "model"), keep_placed=False, mesh=mesh)


def replicate(x, mesh: Mesh):
    """Places every param of ``x`` (a Model, a ModelPair or any pytree) whole on every device of ``mesh``."""
    mesh = _check_mesh(mesh)
    rep = NamedSharding(mesh, P())
    if _is_pair(x):
        return x.replace(target=replicate(x.target, mesh), draft=replicate(x.draft, mesh))
    if isinstance(x, Model):
        return x.replace(params=jax.device_put(x.params, rep))
    return jax.device_put(x, rep)


# ---------------------------------------------------------------------------
# What decode / generate use
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodeLayout:
    """Static (hashable) description of a sharded decode: the mesh and the caches' specs.

    Part of the engine's jit static config, so a sharded and an unsharded call
    are two programs and repeated sharded calls reuse one.
    """

    mesh: Mesh
    target_cache: Optional[P]  # None: a non-Decoder cache, split over 'data' only
    draft_cache: Optional[P]

    def named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def batch(self, x):
        """``P('data', None, ...)`` for an array whose first axis is the batch."""
        return self.named(P(DATA, *([None] * (x.ndim - 1))))

    def constrain_cache(self, cache: KVCache, which: str = "target") -> KVCache:
        spec = self.target_cache if which == "target" else self.draft_cache
        con = jax.lax.with_sharding_constraint

        def buf(x):
            return con(x, self.batch(x) if spec is None else self.named(spec))

        return KVCache(
            keys=tuple(buf(k) for k in cache.keys),
            values=tuple(buf(v) for v in cache.values),
            lengths=con(cache.lengths, self.named(P(DATA))),
        )

    def constrain_batch(self, tree, batch: int):
        """Pins every leaf whose first axis has length ``batch`` to ``('data', ...)``;
        KV caches get their own spec (set them with :meth:`constrain_cache` first)."""

        def con(x):
            if hasattr(x, "ndim") and x.ndim >= 1 and x.shape[0] == batch:
                return jax.lax.with_sharding_constraint(x, self.batch(x))
            return x

        return jax.tree_util.tree_map(con, tree)

    def replicated(self, tree):
        rep = self.named(P())
        return jax.tree_util.tree_map(lambda x: jax.lax.with_sharding_constraint(x, rep), tree)

    def put_inputs(self, *arrays):
        """Host inputs onto the mesh: batch-leading arrays split over ``'data'``,
        scalars replicated. ``make_array_from_callback`` works on every host of a
        multi-host job given the same global value."""
        out = []
        for a in arrays:
            a = np.asarray(a) if not isinstance(a, jax.Array) else a
            if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
                # Keys travel as their uint32 data (host-side, like the other inputs).
                data = np.asarray(jax.random.key_data(a))
                spec = P() if a.ndim == 0 else P(DATA, *([None] * (data.ndim - 1)))
                placed = jax.make_array_from_callback(data.shape, self.named(spec), lambda idx, h=data: h[idx])
                out.append(jax.random.wrap_key_data(placed, impl=jax.random.key_impl(a)))
                continue
            sharding = self.named(P()) if a.ndim == 0 else self.batch(a)
            host = np.asarray(a)
            out.append(jax.make_array_from_callback(host.shape, sharding, lambda idx, h=host: h[idx]))
        return tuple(out)


def _find_mesh(*trees) -> Optional[Mesh]:
    meshes = []
    for tree in trees:
        for leaf in jax.tree_util.tree_leaves(tree):
            s = getattr(leaf, "sharding", None)
            if isinstance(s, NamedSharding) and s.mesh not in meshes:
                meshes.append(s.mesh)
    if len(meshes) > 1:
        raise ValueError(
            f"params are placed on {len(meshes)} different meshes; place the target and the draft "
            "on one mesh (or pass mesh= to decode)."
        )
    return meshes[0] if meshes else None


def _check_matmul_on_mesh(model: Model, name: str) -> None:
    if isinstance(model.module, Decoder) and model.module.matmul == "kernel":
        raise ValueError(
            f"{name}: matmul='kernel' runs on one device; decode on a mesh with matmul='auto' or 'xla' "
            "(dataclasses.replace(model.module, matmul='auto'))."
        )


def _xla_matmuls(model: Model) -> Model:
    """The model with XLA's dots: the CPU kernels are opaque custom calls that
    XLA's partitioner would run on gathered, unsharded weights."""
    module = model.module
    if isinstance(module, Decoder) and module.matmul != "xla":
        return model.replace(module=dataclasses.replace(module, matmul="xla"))
    return model


def _mesh_experts(model: Model, mesh: Mesh) -> Model:
    """A mixture of experts whose experts a 'model' axis splits computes, on each device, the
    routed tokens of the experts it holds, then one all-reduce (:class:`moe.ExpertMesh`). Left
    to the partitioner, the routed path's traced expert ids would gather every expert onto
    every device."""
    module = model.module
    if isinstance(module, Decoder) and module.config.num_experts and _axis(mesh, MODEL) > 1:
        return model.replace(module=dataclasses.replace(module, experts=ExpertMesh(mesh, MODEL, DATA)))
    return model


def prepare(models: dict, batch: int, mesh: Optional[Mesh]):
    """Resolves the mesh of a decode call and places what is not yet on it.

    Args:
      models: ``{"target": Model, "draft": Model}`` (``"draft"`` optional).
      batch: number of sequences.
      mesh: the ``mesh=`` argument, or None to use the params' own mesh (none
        when no param is a ``NamedSharding``: the single-device program).

    Returns:
      ``(models with placed params, DecodeLayout or None)``.

    Raises:
      ValueError: (before tracing) the mesh does not divide the batch, or the
        heads / kv heads / MLP width of a model it has to shard.
    """
    if mesh is None:
        mesh = _find_mesh(*[m.params for m in models.values()])
        if mesh is None:
            return models, None
    mesh = _check_mesh(mesh)
    check_batch(batch, mesh)
    # Every check first, so that nothing is moved when a later model fails.
    plans = {}
    for name, m in models.items():
        _check_matmul_on_mesh(m, name)
        leaves = jax.tree_util.tree_leaves(m.params)
        if leaves and all(_on_mesh(l, mesh) for l in leaves):
            plans[name] = None  # the user's layout (sharded or replicated) is kept
        elif isinstance(m.module, Decoder):
            plans[name] = param_shardings(m, mesh, name=name)
        else:  # another LanguageModel: replicated
            plans[name] = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), m.params)
    placed = {
        name: _mesh_experts(_xla_matmuls(m if plans[name] is None
                                         else m.replace(params=_place(m.params, plans[name], keep_placed=True,
                                                                      mesh=mesh))), mesh)
        for name, m in models.items()
    }

    def spec(m) -> Optional[P]:
        if isinstance(m.module, Decoder):
            return cache_spec(m.module.config, mesh)
        return None

    layout = DecodeLayout(
        mesh=mesh,
        target_cache=spec(placed["target"]),
        draft_cache=spec(placed["draft"]) if "draft" in placed else None,
    )
    return placed, layout
