"""Mixtures of experts that compute only the experts each token is routed to.

A router scores the ``E`` experts for each token and keeps the top ``k``; the
token's output is the weighted sum of those ``k`` experts' gated MLPs (plus a
shared expert's, in the layouts that have one). Decoding at small batch is
bound by the bytes of weights read, so the layer reads only the routed
experts' weights, with static shapes:

1. The ``N * k`` (token, expert) assignments are sorted by expert, and each
   expert's rows are cut into tiles of ``min(N, GROUP_ROWS)`` rows.
2. A loop runs over the tiles that hold rows (a traced trip count, a static
   bound): each multiplies its tile by one expert's matrices of the stacked
   ``[E, ...]`` params. Float experts go to a CPU kernel that reads the
   expert's matrix where it lies in the stack
   (:func:`~specjax._src.kernels.cpu_matmul.expert_dot`): a dynamic index
   would copy it out first, and at batch 1 those copies cost as much as the
   products; quantized experts likewise
   (:func:`~specjax._src.kernels.quant.qdot_expert`).

With ``N <= GROUP_ROWS`` tokens (a decode step, a verification block, a draft
step) every routed expert is one tile: a step reads the distinct experts its
tokens picked, at most ``min(E, N * k)``, each once. With more tokens (prefill,
large batches) it is a grouped matmul over ragged groups, every expert's rows
in tiles of ``GROUP_ROWS`` (experts no token picked are not read). On GPUs and
TPUs, float experts over more than ``GROUP_ROWS`` tokens go to
:func:`jax.lax.ragged_dot` instead, which those platforms lower to grouped
kernels; on the CPU jax lowers ``ragged_dot`` to a dense product of every row
with every group (as costly as computing every expert), so the CPU keeps the
tiles.

:func:`all_experts` is the reference the routed path is checked against:
every expert for every token, the unpicked ones weighted 0.

Layouts (``ModelConfig`` fields): Mixtral and Qwen3-MoE (softmax router, top
``k``, renormalised when ``norm_topk_prob``), Qwen2-MoE (a shared expert of
width ``shared_expert_intermediate_size`` behind a sigmoid gate), DeepSeek-V3's
routing as ``dots1`` uses it (sigmoid scores, a choice bias, group-limited
choice, scaled weights, ungated shared experts), gpt-oss (a router with a bias,
a softmax over the top ``k`` logits, experts with biases and a clamped SwiGLU:
"gpt-oss-120b & gpt-oss-20b Model Card", arXiv:2508.10925).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from specjax._src.kernels import quant
from specjax._src.kernels import cpu_matmul, platforms
from specjax._src.models.lm import Array
from specjax._src.models.config import ModelConfig
from specjax._src.models.layers import INIT_STD, MLP, activation, dense

# Tokens up to which a step reads each routed expert once over all its tokens
# (one tile per expert), and the tile height beyond: the CPU's few-row
# kernels take up to 16 rows (cpu_matmul.MAX_ROWS), and verification blocks
# and draft steps at small batch stay under it.
GROUP_ROWS = cpu_matmul.MAX_ROWS

_NT = (((1,), (0,)), ((), ()))  # x[R, K] @ w[K, N]


# --------------------------------------------------------------------------- #
# Routing
# --------------------------------------------------------------------------- #


def route(
    logits: Array,
    k: int,
    norm_topk_prob: bool,
    *,
    scores: str = "softmax",
    bias: Optional[Array] = None,
    groups: int = 1,
    top_groups: int = 1,
    scale: float = 1.0,
) -> tuple[Array, Array]:
    """The top ``k`` experts of each token and their weights.

    Args:
      logits: ``[N, E]`` router logits.
      k: experts per token.
      norm_topk_prob: renormalise the ``k`` weights to sum to 1.
      scores: ``"softmax"`` (Mixtral, Qwen) or ``"sigmoid"`` (DeepSeek-V3) of the logits, or
        ``"topk_softmax"`` (gpt-oss): the top ``k`` logits chosen, weighted by a softmax over them only.
      bias: ``[E]`` added to the scores to choose the experts, not to weight them (DeepSeek-V3).
      groups, top_groups: the choice limited to the ``top_groups`` of ``groups`` equal groups of
        experts whose two best (biased) scores sum highest (DeepSeek-V3's group-limited routing).
      scale: the weights' factor, after any renormalisation (``routed_scaling_factor``).

    Returns:
      ``(weights [N, k] float32, experts [N, k] int32)``.
    """
    logits = logits.astype(jnp.float32)
    if scores == "topk_softmax":
        top, picked = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1) * scale, picked.astype(jnp.int32)
    probs = jax.nn.softmax(logits, axis=-1) if scores == "softmax" else jax.nn.sigmoid(logits)
    choice = probs if bias is None else probs + bias.astype(jnp.float32)
    if groups > 1:
        n, e = choice.shape
        grouped = choice.reshape(n, groups, e // groups)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, groups]
        _, kept = jax.lax.top_k(group_scores, top_groups)
        keep = jnp.any(jnp.arange(groups)[None, :, None] == kept[:, None, :], axis=-1)  # [N, groups]
        choice = jnp.where(jnp.repeat(keep, e // groups, axis=-1), choice, -jnp.inf)
    _, picked = jax.lax.top_k(choice, k)
    top = jnp.take_along_axis(probs, picked, axis=-1)
    if norm_topk_prob:
        top = top / (jnp.sum(top, axis=-1, keepdims=True) + (1e-20 if scores == "sigmoid" else 0.0))
    if scale != 1.0:
        top = top * scale
    return top, picked.astype(jnp.int32)


# --------------------------------------------------------------------------- #
# Gated units
# --------------------------------------------------------------------------- #


def gated(act: Callable) -> Callable:
    """The gated unit ``(gate, up) -> act(gate) * up`` of Mixtral's, Qwen's and DeepSeek's experts."""
    return lambda gate, up: act(gate) * up


def swiglu_oai(alpha: float, limit: Optional[float]) -> Callable:
    """gpt-oss's clamped SwiGLU ``(gate, up) -> (up + 1) * gate * sigmoid(alpha * gate)``, with
    ``gate`` clipped above and ``up`` on both sides at ``limit`` (None: unclamped), as
    transformers' ``GptOssExperts._apply_gate``."""

    def glu(gate, up):
        if limit is not None:
            gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))

    return glu


def glu_of(config: ModelConfig) -> Callable:
    """The experts' gated unit ``(gate, up) -> h`` that ``config.activation`` names."""
    if config.activation == "swiglu_oai":
        return swiglu_oai(config.swiglu_alpha, config.swiglu_limit)
    return gated(activation(config.activation))


def _biased(y: Array, stack, name: str, e) -> Array:
    """``y`` plus expert ``e``'s row of the bias stack ``stack[name]`` ``[E, F]``, if the stack has one."""
    return y if name not in stack else y + stack[name][e].astype(y.dtype)


# --------------------------------------------------------------------------- #
# Expert compute
# --------------------------------------------------------------------------- #


def tile_schedule(experts: Array, num_experts: int, tile: int):
    """The tiles of a grouped product: the assignments sorted by expert, cut into tiles.

    Args:
      experts: ``[N, k]`` int32, each token's experts; ``E`` marks an assignment to skip.
      num_experts: ``E``.
      tile: rows per tile.

    Returns:
      ``(order [R], tile_expert [M], tile_start [M], tile_rows [M], num_tiles)``
      with ``R = N * k`` and ``M = min(E, R) + R // tile`` (a bound on the
      tiles): ``order`` sorts the flattened assignments by expert; tile ``j <
      num_tiles`` covers sorted rows ``tile_start[j] ...`` of which the first
      ``tile_rows[j]`` are ``tile_expert[j]``'s.
    """
    flat = experts.reshape(-1)
    r = flat.shape[0]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    # Id ``num_experts`` (an expert another device holds) sorts last and gets no tile.
    sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[flat].add(1)[:num_experts]
    ends = jnp.cumsum(sizes)
    tiles = (sizes + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles)
    j = jnp.arange(min(num_experts, r) + r // tile, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(tile_ends, j, side="right"), num_experts - 1).astype(jnp.int32)
    start = ends[expert] - sizes[expert] + (j - (tile_ends[expert] - tiles[expert])) * tile
    rows = jnp.clip(ends[expert] - start, 0, tile)
    return order, expert, start, rows, tile_ends[-1]


def routed_experts(x: Array, weights: Array, experts: Array, stack, expert_mlp: Callable, tile: int) -> Array:
    """``sum_j weights[n, j] * MLP_{experts[n, j]}(x[n])``, reading only the routed experts.

    Args:
      x: ``[N, H]`` tokens.
      weights, experts: ``[N, k]`` from :func:`route`.
      stack: the experts' params, a pytree of ``[E, ...]`` arrays.
      expert_mlp: ``(stack, expert index, rows [T, H]) -> [T, H]`` float32.
      tile: rows per tile (:func:`tile_schedule`).

    Returns:
      ``[N, H]`` float32.
    """
    n, k = experts.shape
    hidden = x.shape[-1]
    num_experts = jax.tree_util.tree_leaves(stack)[0].shape[0]
    order, tile_expert, tile_start, tile_rows, num_tiles = tile_schedule(experts, num_experts, tile)
    r = n * k
    rows = jnp.concatenate([x[order // k], jnp.zeros((tile, hidden), x.dtype)])  # sorted by expert, padded

    def one_tile(j, out):
        e, start = tile_expert[j], tile_start[j]
        y = expert_mlp(stack, e, jax.lax.dynamic_slice_in_dim(rows, start, tile))
        # A tile's last rows may belong to the next expert: keep what they hold.
        keep = jnp.arange(tile)[:, None] < tile_rows[j]
        y = jnp.where(keep, y, jax.lax.dynamic_slice_in_dim(out, start, tile))
        return jax.lax.dynamic_update_slice_in_dim(out, y, start, 0)

    out = jax.lax.fori_loop(0, num_tiles, one_tile, jnp.zeros((r + tile, hidden), jnp.float32))
    per_slot = out[jnp.argsort(order)].reshape(n, k, hidden)  # back to token order
    return jnp.einsum("nkh,nk->nh", per_slot, weights)


@dataclasses.dataclass(frozen=True)
class ExpertMesh:
    """Where a mesh splits the expert stacks: ``Decoder(experts=ExpertMesh(mesh))``.

    Each device holds ``E / mesh.shape[axis]`` experts and computes, from the
    routed assignments, only those of its own experts (the routed tiles on its
    shard, under :func:`jax.shard_map`); one all-reduce over ``axis``
    sums the devices' parts. A step thus reads, on each device, the routed
    experts it holds and nothing else. ``data_axis`` splits the tokens, as the
    batch is split outside the layer.
    """

    mesh: Mesh
    axis: str = "model"
    data_axis: Optional[str] = "data"


def check_experts(experts) -> None:
    """Raises ``ValueError`` unless ``experts`` is ``"routed"``, ``"all"`` or an :class:`ExpertMesh`."""
    if not isinstance(experts, ExpertMesh) and experts not in ("routed", "all"):
        raise ValueError(f"experts must be 'routed', 'all' or a moe.ExpertMesh, got {experts!r}.")


def mesh_routed_experts(compute: Callable, x: Array, weights: Array, experts: Array, stack, where: ExpertMesh) -> Array:
    """``compute`` (routed experts) with the expert stacks split over ``where.axis`` (:class:`ExpertMesh`).

    Each device maps its experts ``[i * E_local, (i + 1) * E_local)`` to local
    ids and the others to ``E_local`` (skipped, weight 0), computes the routed
    tokens of its own experts, and the parts are summed over the axis.

    Args:
      compute: ``(x, weights, experts, stack) -> [N, H]`` float32, e.g. :func:`routed_experts`
        (it must skip id ``E`` of its ``E`` experts).
      x, weights, experts, stack: as :func:`routed_experts`, the stack split or splittable over the axis.

    Returns:
      ``[N, H]`` float32, the same on every device of the axis.
    """
    mesh, axis = where.mesh, where.axis
    data = where.data_axis if where.data_axis in mesh.shape and x.shape[0] % mesh.shape[where.data_axis] == 0 else None
    rows = P(data, None)

    def local(x, weights, experts, stack):
        count = jax.tree_util.tree_leaves(stack)[0].shape[0]
        ids = experts - jax.lax.axis_index(axis) * count
        mine = (ids >= 0) & (ids < count)
        return jax.lax.psum(compute(x, jnp.where(mine, weights, 0.0), jnp.where(mine, ids, count), stack), axis)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, jax.tree_util.tree_map(lambda _: P(axis), stack)),
        out_specs=rows,
        check_vma=False,
    )(x, weights, experts, stack)


def ragged_experts(
    x: Array, weights: Array, experts: Array, gate: Array, up: Array, down: Array, glu: Callable,
    biases: Optional[dict] = None,
) -> Array:
    """:func:`routed_experts` for float experts by :func:`jax.lax.ragged_dot` (the tokens
    sorted by expert, one group per expert): the GPU and TPU path for many tokens.

    ``gate``, ``up``: ``[E, H, I]``; ``down``: ``[E, I, H]``; ``glu``: ``(gate, up) -> h``;
    ``biases``: the bias stacks (``gate_bias``, ``up_bias`` ``[E, I]``, ``down_bias`` ``[E, H]``),
    each optional. Returns ``[N, H]`` float32.
    """
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((gate.shape[0],), jnp.int32).at[flat].add(1)
    rows = x[order // k]
    ids = jnp.minimum(flat[order], gate.shape[0] - 1)  # each sorted row's expert (ids to skip: any row)
    biases = biases or {}

    def biased(y, name):
        return _biased(y, biases, name, ids)

    h = glu(biased(jax.lax.ragged_dot(rows, gate, sizes), "gate_bias"),
            biased(jax.lax.ragged_dot(rows, up, sizes), "up_bias"))
    y = biased(jax.lax.ragged_dot(h, down, sizes, preferred_element_type=jnp.float32), "down_bias")
    y = jnp.where((flat[order] < gate.shape[0])[:, None], y, 0.0)  # rows past the groups: ids to skip
    return jnp.einsum("nkh,nk->nh", y[jnp.argsort(order)].reshape(n, k, -1), weights)


def all_experts(x: Array, weights: Array, experts: Array, stack, expert_mlp: Callable) -> Array:
    """The reference: every expert on every token, the unpicked ones weighted 0 (reads every
    expert's weights). Arguments as :func:`routed_experts`; returns ``[N, H]`` float32."""
    num_experts = jax.tree_util.tree_leaves(stack)[0].shape[0]
    ys = jax.lax.map(lambda e: expert_mlp(stack, e, x), jnp.arange(num_experts))  # [E, N, H]
    dense_weights = jnp.einsum("nk,nke->ne", weights, jax.nn.one_hot(experts, num_experts, dtype=jnp.float32))
    return jnp.einsum("enh,ne->nh", ys, dense_weights)


def all_float_experts(
    x: Array, weights: Array, experts: Array, gate: Array, up: Array, down: Array, glu: Callable,
    biases: Optional[dict] = None,
) -> Array:
    """:func:`all_experts` for float experts as einsums over the expert axis: on a mesh that splits
    the experts, each device computes its own and one all-reduce sums them. Arguments as
    :func:`ragged_experts`; returns ``[N, H]`` float32."""
    dense_weights = jnp.einsum("nk,nke->ne", weights, jax.nn.one_hot(experts, gate.shape[0], dtype=jnp.float32))
    every = jnp.arange(gate.shape[0])
    biases = biases or {}

    def biased(y, name):  # y [N, E, F]: every expert's bias row on its own slice
        return _biased(y, biases, name, every)

    h = glu(biased(jnp.einsum("nh,ehi->nei", x, gate), "gate_bias"), biased(jnp.einsum("nh,ehi->nei", x, up), "up_bias"))
    y = biased(jnp.einsum("nei,eih->neh", h, down, preferred_element_type=jnp.float32), "down_bias")
    return jnp.einsum("neh,ne->nh", y, dense_weights)


def float_expert_mlp(glu: Callable, matmul: str) -> Callable:
    """Expert ``e``'s gated MLP of a float stack ``{"gate", "up": [E, H, I], "down": [E, I, H]}``
    (and the optional bias stacks ``gate_bias``, ``up_bias`` ``[E, I]``, ``down_bias`` ``[E, H]``,
    added after each product), on rows ``[T, H]``; ``glu``: ``(gate, up) -> h`` (:func:`glu_of`).
    Few float32 rows go to the CPU kernel that reads the expert inside the stack
    (:func:`~specjax._src.kernels.cpu_matmul.expert_dot`), without copying it out; a bias row is
    small enough to index out."""

    def mlp(stack, e, x):
        def dot(a, name, out_dtype):
            y = cpu_matmul.expert_dot(a, stack[name], e, preferred_element_type=out_dtype, matmul_mode=matmul)
            return _biased(y, stack, f"{name}_bias", e)

        h = glu(dot(x, "gate", x.dtype), dot(x, "up", x.dtype))
        return dot(h, "down", jnp.float32)

    return mlp


def quantized_expert_mlp(glu: Callable, matmul: str) -> Callable:
    """Expert ``e``'s gated MLP of a quantized stack (each matrix the format's arrays,
    ``[E, out, in]``; the bias stacks float, as :func:`float_expert_mlp`), on rows ``[T, H]``:
    read inside the stack (:func:`quant.qdot_expert`)."""

    def mlp(stack, e, x):
        def dot(a, name):
            return _biased(quant.qdot_expert(a, stack[name], e, matmul), stack, f"{name}_bias", e)

        h = glu(dot(x, "gate"), dot(x, "up"))
        return dot(h.astype(x.dtype), "down")

    return mlp


# --------------------------------------------------------------------------- #
# The layer
# --------------------------------------------------------------------------- #


class MoE(nn.Module):
    """A mixture of gated-MLP experts (Mixtral, Qwen2-MoE, Qwen3-MoE, dots1).

    The router scores the ``num_experts`` (:func:`route`) and picks the top
    ``num_experts_per_tok``; the token's output is their weighted sum, computed
    from the routed experts only (module docstring). With
    ``shared_expert_intermediate_size``, a shared expert (a gated MLP that
    every token goes through) adds ``shared(x)``, times ``sigmoid(x W_gate)``
    with ``shared_expert_gate``.

    Params: ``router/kernel [H, E]``, ``router_bias [E]`` (float32, with ``router_bias``), ``experts_gate`` / ``experts_up``
    ``[E, H, I]`` and ``experts_down [E, I, H]`` (quantized: stacks ``[E, out,
    in]`` of the format's arrays), ``shared_expert/{gate,up,down}`` and
    ``shared_expert_gate/kernel [H, 1]``.

    ``experts="all"`` computes every expert for every token instead (the
    reference, :func:`all_experts`); an :class:`ExpertMesh` computes the routed
    experts on a mesh that splits them (:func:`mesh_routed_experts`).
    """

    config: ModelConfig
    matmul: str = "auto"
    experts: str | ExpertMesh = "routed"

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        check_experts(self.experts)
        dtype = jnp.dtype(cfg.dtype)
        lead, hidden = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, hidden)
        logits = dense(cfg, cfg.num_experts, cfg.router_logit_bias, "router", self.matmul)(x2)
        bias = (
            self.param("router_bias", nn.initializers.zeros, (cfg.num_experts,), jnp.float32)
            if cfg.router_bias
            else None
        )
        weights, picked = route(
            logits,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            scores=cfg.router_scores,
            bias=bias,
            groups=cfg.router_groups,
            top_groups=cfg.router_top_groups,
            scale=cfg.routed_scaling_factor,
        )
        glu = glu_of(cfg)
        stack = self._stack()
        if cfg.quantization is not None:
            expert_mlp = quantized_expert_mlp(glu, self.matmul)
        else:
            expert_mlp = float_expert_mlp(glu, self.matmul)
        xin = x2.astype(dtype)
        if self.experts == "all" and cfg.quantization is None:
            y = all_float_experts(xin, weights, picked, stack["gate"], stack["up"], stack["down"], glu, stack)
        elif self.experts == "all":
            y = all_experts(xin, weights, picked, stack, expert_mlp)
        elif isinstance(self.experts, ExpertMesh):
            # Inside shard_map each device's stack is a local array, so the CPU kernels that read an
            # expert in place serve there even when the model runs XLA's products on the mesh.
            local_mlp = (quantized_expert_mlp if cfg.quantization is not None else float_expert_mlp)(glu, "auto")
            y = mesh_routed_experts(self._routed(local_mlp, glu), xin, weights, picked, stack, self.experts)
        else:
            y = self._routed(expert_mlp, glu)(xin, weights, picked, stack)
        if cfg.shared_expert_intermediate_size:
            shared = MLP(cfg, self.matmul, cfg.shared_expert_intermediate_size, name="shared_expert")(xin)
            if cfg.shared_expert_gate:
                shared = jax.nn.sigmoid(dense(cfg, 1, False, "shared_expert_gate", self.matmul)(xin)) * shared
            y = y + shared.astype(jnp.float32)
        return y.astype(dtype).reshape(*lead, hidden)

    def _routed(self, expert_mlp: Callable, glu: Callable) -> Callable:
        """``(x, weights, experts, stack) -> [N, H]``: the routed experts' tiles, or on GPUs and TPUs
        :func:`ragged_experts` for float experts over more than ``GROUP_ROWS`` tokens."""

        def compute(x, weights, experts, stack):
            y = routed_experts(x, weights, experts, stack, expert_mlp, min(x.shape[0], GROUP_ROWS))
            if self.config.quantization is not None or x.shape[0] <= GROUP_ROWS:
                return y
            return platforms.platform_dependent(
                x,
                weights,
                experts,
                y,
                cpu=lambda a, w, p, tiles: tiles,
                default=lambda a, w, p, tiles: ragged_experts(a, w, p, stack["gate"], stack["up"], stack["down"], glu,
                                                              stack),
            )

        return compute

    def _stack(self) -> dict:
        """The experts' matrices ``{"gate", "up", "down"}``, each ``[E, ...]``, and with
        ``expert_bias`` their float bias stacks ``{"gate_bias", "up_bias": [E, I], "down_bias": [E, H]}``."""
        cfg = self.config
        e, hidden = cfg.num_experts, cfg.hidden_size
        inner = cfg.moe_intermediate_size or cfg.intermediate_size
        init, dtype = nn.initializers.normal(INIT_STD), jnp.dtype(cfg.dtype)
        if cfg.quantization is not None:
            fmt = cfg.quant.weights
            stack = {
                "gate": quant.quant_experts(self, "experts_gate", fmt, e, hidden, inner),
                "up": quant.quant_experts(self, "experts_up", fmt, e, hidden, inner),
                "down": quant.quant_experts(self, "experts_down", fmt, e, inner, hidden),
            }
        else:
            stack = {
                "gate": self.param("experts_gate", init, (e, hidden, inner), dtype),
                "up": self.param("experts_up", init, (e, hidden, inner), dtype),
                "down": self.param("experts_down", init, (e, inner, hidden), dtype),
            }
        if cfg.expert_bias:
            for name, width in (("gate", inner), ("up", inner), ("down", hidden)):
                stack[f"{name}_bias"] = self.param(f"experts_{name}_bias", nn.initializers.zeros, (e, width), dtype)
        return stack
