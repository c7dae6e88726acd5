"""gpt-oss checkpoints (``model_type`` ``"gpt_oss"``, transformers' ``GptOssForCausalLM``): the
config fields, and the fused expert tensors split on load and joined on export.

The architecture ("gpt-oss-120b & gpt-oss-20b Model Card", arXiv:2508.10925) is the decoder's
with attention sinks, q/k/v/o biases, alternating sliding (128) and full layers, YaRN rope,
and a mixture of experts whose router is a linear layer with a bias (a softmax over the top
``k`` logits) and whose experts carry biases and a clamped SwiGLU. transformers stores each
layer's experts fused: ``mlp.experts.gate_up_proj [E, H, 2I]`` with gate and up interleaved
on the last axis (gate ``[..., 0::2]``, up ``[..., 1::2]``), ``gate_up_proj_bias [E, 2I]``,
``down_proj [E, I, H]`` and ``down_proj_bias [E, H]``; the Hub's checkpoints hold the two
matrices as MXFP4 (``*_blocks`` and ``*_scales``, dequantized here as transformers'
``convert_moe_packed_tensors`` does).

specjax's expert params are separate stacks (``experts_gate``, ``experts_up``, ``experts_down``
and their ``*_bias``), filled one expert at a time: :func:`split_tensors` turns the fused
tensors into the per-expert slices :func:`expert_specs` names (names with a NumPy-style index,
such as ``model.layers.0.mlp.experts.gate_up_proj[3][:, 0::2]``, which no checkpoint holds), and
:func:`fused_entries` writes them back fused.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator

import numpy as np

from specjax._src.models.config import LAYER_TYPES, ModelConfig

# transformers' GptOssConfig defaults, for keys a config.json lacks.
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
DEFAULT_THETA = 150000.0

# MXFP4's 4-bit values (E2M1), indexed by the nibble (transformers' ``FP4_VALUES``).
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)

_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_blocks|_scales)?$")
_FUSED_BIAS = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)gate_up_proj_bias$")
_HALVES = (("gate", "[:, 0::2]"), ("up", "[:, 1::2]"))  # gate and up interleave on the last axis


# --------------------------------------------------------------------------- #
# Config
# --------------------------------------------------------------------------- #


def hf_rope(hf: dict) -> dict:
    """``hf`` with gpt-oss's default YaRN and base where it names no rope (as transformers fills them)."""
    if hf.get("rope_parameters") or hf.get("rope_scaling"):
        return hf
    return {**hf, "rope_parameters": {**DEFAULT_ROPE, "rope_theta": float(hf.get("rope_theta") or DEFAULT_THETA)}}


def _positive(hf: dict, key: str, default: float) -> float:
    value = hf.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"gpt_oss config.json field {key!r} must be a positive number, got {value!r}.")
    return float(value)


def config_fields(hf: dict) -> dict:
    """The :class:`ModelConfig` layout fields of a gpt-oss ``config.json`` (transformers' defaults
    where a key is missing). Raises ``ValueError`` naming a field specjax cannot run."""
    layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types")
    if layer_types is None:  # transformers' default: sliding and full layers alternate, sliding first
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not isinstance(layer_types, (list, tuple)) or any(t not in LAYER_TYPES for t in layer_types):
        raise ValueError(f"gpt_oss config.json field 'layer_types' must list {' or '.join(LAYER_TYPES)} per layer, "
                         f"got {layer_types!r}.")
    quantization = hf.get("quantization_config")
    if quantization is not None and (quantization or {}).get("quant_method") != "mxfp4":
        raise ValueError(f"gpt_oss config.json field 'quantization_config' has quant_method "
                         f"{(quantization or {}).get('quant_method')!r}; specjax reads float and mxfp4 gpt-oss "
                         "checkpoints only.")
    count = hf.get("num_local_experts", hf.get("num_experts"))
    if count is None:
        raise ValueError("gpt_oss config.json is missing field 'num_local_experts' (the number of experts).")
    bias = bool(hf.get("attention_bias", True))
    window = hf.get("sliding_window", 128)
    return dict(
        attention_bias=bias, attention_out_bias=bias, attention_sinks=True,
        sliding_window=None if window is None else int(window), layer_types=tuple(layer_types),
        num_experts=int(count), num_experts_per_tok=int(hf.get("num_experts_per_tok", 4)),
        moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True,
        router_scores="topk_softmax", router_logit_bias=True, expert_bias=True,
        activation="swiglu_oai", swiglu_alpha=_positive(hf, "swiglu_alpha", 1.702),
        swiglu_limit=_positive(hf, "swiglu_limit", 7.0),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 131072)),
    )


def expressible_problems(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as its Hugging Face family (gpt-oss's features elsewhere, or a
    gpt-oss without them); ``[]`` when it can."""
    features = (cfg.attention_sinks, cfg.expert_bias, cfg.router_logit_bias, cfg.router_scores == "topk_softmax",
                cfg.activation == "swiglu_oai")
    if cfg.model_type != "gpt_oss":
        return ["attention sinks, expert biases, a biased router, top-k softmax routing and the clamped SwiGLU "
                "are gpt_oss's only"] if any(features) else []
    problems = []
    if not all(features) or cfg.swiglu_limit is None:
        problems.append("gpt_oss has attention sinks, expert biases, a biased router with a softmax over the top-k "
                        "logits, and a clamped SwiGLU (swiglu_limit set)")
    if cfg.attention_bias != cfg.attention_out_bias or cfg.qk_norm:
        problems.append("gpt_oss biases q/k/v/o together and has no q/k norms")
    if cfg.dense_mlp_layers or cfg.shared_expert_intermediate_size or cfg.router_groups != 1:
        problems.append("gpt_oss has experts on every layer, no shared expert and no expert groups")
    if cfg.routed_scaling_factor != 1.0 or cfg.router_bias:
        problems.append("gpt_oss does not scale or bias the routing weights")
    return problems


def hf_fields(cfg: ModelConfig) -> dict:
    """The gpt-oss keys of ``config.json`` (what :func:`config_fields` reads back)."""
    sliding = "sliding_attention" if cfg.sliding_window is not None else "full_attention"
    return dict(
        num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        intermediate_size=cfg.moe_intermediate_size or cfg.intermediate_size, attention_bias=cfg.attention_bias,
        sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types or [sliding] * cfg.num_layers),
        swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit, hidden_act="silu",  # the experts' GLU is fixed
    )


# --------------------------------------------------------------------------- #
# Tensors
# --------------------------------------------------------------------------- #


def expert_specs(cfg: ModelConfig, h: str, layer: tuple[str, ...]) -> list[tuple]:
    """``(path, hf_name, transpose, integer, expert)`` of one layer's router and experts: the
    router ``[E, H]`` (a ``Linear``, transposed) and its bias, each expert's gate and up
    ``[H, I]`` (columns of the fused ``gate_up_proj``) and down ``[I, H]``, and the bias stacks."""
    moe, mlp = f"{h}mlp.", (*layer, "mlp")
    specs = [((*mlp, "router", "kernel"), f"{moe}router.weight", True, False, None),
             ((*mlp, "router", "bias"), f"{moe}router.bias", False, False, None),
             ((*mlp, "experts_down_bias"), f"{moe}experts.down_proj_bias", False, False, None)]
    for name, columns in _HALVES:
        specs.append(((*mlp, f"experts_{name}_bias"), f"{moe}experts.gate_up_proj_bias{columns}", False, False, None))
    for j in range(cfg.num_experts):
        for name, columns in _HALVES:
            specs.append(((*mlp, f"experts_{name}"), f"{moe}experts.gate_up_proj[{j}]{columns}", False, False, j))
        specs.append(((*mlp, "experts_down"), f"{moe}experts.down_proj[{j}]", False, False, j))
    return specs


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 expert matrices to float32, as transformers' ``convert_moe_packed_tensors``.

    Args:
      blocks: ``[E, R, G, 16]`` uint8, two 4-bit values a byte (the low nibble first), 32 a group.
      scales: ``[E, R, G]`` uint8, each group's power of two plus 127.

    Returns:
      ``[E, G * 32, R]`` float32 (``[E, in, out]``: rows and columns swapped, as transformers
      stores ``gate_up_proj`` / ``down_proj``). Exact: every value is a 4-bit value times a power of two.
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16 or blocks.ndim != 4:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} must be [E, R, G, 16] and [E, R, G].")
    blocks = np.asarray(blocks, np.uint8)
    values = np.empty(blocks.shape[:-1] + (32,), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, (np.asarray(scales).astype(np.int32) - 127)[..., None])
    e, r, g = scales.shape
    return np.swapaxes(values.reshape(e, r, g * 32), 1, 2)


def _lazy(read: Callable) -> Callable:
    """``read`` called once, on first use, its result kept (one fused tensor serves many slices)."""
    held: list = []

    def get():
        if not held:
            held.append(read())
        return held[0]

    return get


def _expert_reader(parts: dict) -> tuple[Callable[[int], np.ndarray], tuple]:
    """``(expert j -> [in, out] float array, shape [E, in, out])`` of a fused expert tensor:
    ``parts`` maps ``""`` (float) or ``"_blocks"`` and ``"_scales"`` (MXFP4) to ``(read, shape)``."""
    if "" in parts:
        read, shape = parts[""]
        whole = _lazy(read)
        return lambda j: whole()[j], tuple(shape)
    (blocks, blocks_shape), (scales, _) = parts["_blocks"], parts["_scales"]
    blocks, scales = _lazy(blocks), _lazy(scales)
    e, r, g = blocks_shape[:3]
    # One expert at a time: a whole layer in float32 would be 8 times the packed bytes at once.
    return lambda j: dequantize_mxfp4(blocks()[j:j + 1], scales()[j:j + 1])[0], (e, g * 32, r)


def _slices(base: str, fused: str, parts: dict) -> Iterator[tuple[str, Any, tuple]]:
    """The per-expert slices :func:`expert_specs` names, of one fused matrix."""
    expert, (e, rows, cols) = _expert_reader(parts)
    last: dict = {}

    def one(j):  # gate and up read the same expert's matrix, one after the other
        if j not in last:
            last.clear()
            last[j] = expert(j)
        return last[j]

    for j in range(e):
        if fused == "down_proj":
            yield f"{base}down_proj[{j}]", (lambda j=j: one(j)), (rows, cols)
            continue
        for k, (_, columns) in enumerate(_HALVES):
            yield (f"{base}gate_up_proj[{j}]{columns}", (lambda j=j, k=k: one(j)[:, k::2]),
                   (rows, len(range(k, cols, 2))))


def split_tensors(tensors: Iterator[tuple[str, Any, tuple]], cfg: ModelConfig) -> Iterator[tuple[str, Any, tuple]]:
    """A gpt-oss checkpoint's ``(name, read, shape)`` stream with the fused expert tensors replaced
    by the slices :func:`expert_specs` names (MXFP4 pairs dequantized once both are read); every
    other tensor passes as it is.

    Raises:
      ValueError: an MXFP4 ``*_blocks`` tensor without its ``*_scales`` (or the reverse), named.
    """
    del cfg  # the shapes come from the tensors; the loader checks them against the config
    pending: dict[tuple[str, str], dict] = {}
    for name, read, shape in tensors:
        bias = _FUSED_BIAS.match(name)
        if bias:
            whole = _lazy(read)
            for k, (_, columns) in enumerate(_HALVES):
                yield (f"{name}{columns}", (lambda k=k: whole()[:, k::2]),
                       tuple(shape[:-1]) + (len(range(k, shape[-1], 2)),))
            continue
        fused = _FUSED.match(name)
        if not fused:
            yield name, read, shape
            continue
        base, matrix, part = fused.group(1), fused.group(2), fused.group(3) or ""
        parts = pending.setdefault((base, matrix), {})
        parts[part] = (read, tuple(shape))
        if part == "" or {"_blocks", "_scales"} <= parts.keys():
            del pending[(base, matrix)]
            yield from _slices(base, matrix, parts)
    for (base, matrix), parts in pending.items():
        have, lack = next(iter(parts)), ({"_blocks", "_scales"} - parts.keys()).pop()
        raise ValueError(f"The checkpoint holds the MXFP4 tensor '{base}{matrix}{have}' but not "
                         f"'{base}{matrix}{lack}': an MXFP4 matrix needs both its blocks and its scales. "
                         "Download the checkpoint's missing shard, or load a dequantized (float) copy.")


def fused_entries(cfg: ModelConfig, params: dict, entries: list) -> list:
    """The ``(name, shape, dtype, make)`` export entries with the per-expert slices (names holding
    ``[``) replaced by the fused tensors transformers reads: gate and up interleaved again."""
    out = [entry for entry in entries if "[" not in entry[0]]
    for i in range(cfg.num_layers):
        mlp, base = params[f"layer_{i}"]["mlp"], f"model.layers.{i}.mlp.experts."
        gate, up = mlp["experts_gate"], mlp["experts_up"]
        e, hidden, inner = gate.shape
        out.append((f"{base}gate_up_proj", (e, hidden, 2 * inner), gate.dtype,
                    lambda g=gate, u=up: _interleave(np.asarray(g), np.asarray(u))))
        out.append((f"{base}gate_up_proj_bias", (e, 2 * inner), gate.dtype,
                    lambda g=mlp["experts_gate_bias"], u=mlp["experts_up_bias"]: _interleave(np.asarray(g),
                                                                                             np.asarray(u))))
        down = mlp["experts_down"]
        out.append((f"{base}down_proj", tuple(down.shape), down.dtype, lambda d=down: np.asarray(d)))
    return out


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``[..., 2I]`` with ``gate`` at the even and ``up`` at the odd positions of the last axis."""
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])
