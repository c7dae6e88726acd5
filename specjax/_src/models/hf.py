"""The Hugging Face side: config mapping, tensor names, streamed safetensors I/O.

Only safetensors are read: pickle-based ``*.bin`` / ``*.pt`` weights can run
arbitrary code when unpickled, so they are refused (see :func:`find_weight_files`).
No code from a checkpoint directory is ever imported (no ``trust_remote_code``).
"""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Any, Iterator, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np

from specjax._src.models import gpt_oss
from specjax._src.models.config import (GEMMA_MODEL_TYPES, SUPPORTED_MODEL_TYPES, YARN_MODEL_TYPES, ModelConfig,
                                        RopeScaling)

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")  # and "yarn" for deepseek_v3 and gpt_oss

# A draft with a reduced-vocabulary head (``ModelConfig.head_vocab_size``)
# stores it under these names; transformers cannot load such a checkpoint.
HEAD_VOCAB_KEY = "specjax_head_vocab_size"
HEAD_VOCAB_IDS = "specjax.head_vocab_ids"

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "dots1": "Dots1ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}

# Buffers some checkpoints carry that are recomputed, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


# --------------------------------------------------------------------------- #
# Config
# --------------------------------------------------------------------------- #


def _rope(hf: dict, default_theta: float = 10000.0) -> tuple[float, Optional[RopeScaling]]:
    """(rope_theta, scaling) from either the transformers 5 ``rope_parameters``
    or the 4.x ``rope_theta`` + ``rope_scaling`` layout."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn" and hf.get("model_type") in YARN_MODEL_TYPES:
        return theta, _yarn(hf, params)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"Unsupported rope scaling type {rope_type!r}; specjax supports "
            f"{', '.join(SUPPORTED_ROPE_TYPES)} (and yarn for {' and '.join(YARN_MODEL_TYPES)})."
        )
    if rope_type == "linear":
        return theta, RopeScaling(factor=float(params["factor"]), rope_type="linear")
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _yarn(hf: dict, params: dict) -> RopeScaling:
    """YaRN scaling from ``rope_parameters`` / ``rope_scaling``, with transformers' defaults."""
    optional = {key: float(params[key]) for key in ("mscale", "mscale_all_dim", "attention_factor")
                if params.get(key) is not None}
    return RopeScaling(
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings")
                                             or hf.get("max_position_embeddings", 4096)),
        rope_type="yarn", beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)), **optional,
    )


def _eos(hf: dict) -> tuple[Optional[int], tuple[int, ...]]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return None, ()
    ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return (ids[0] if ids else None), ids


def _dtype_name(hf: dict) -> str:
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"


# Fields without a default: a config lacking one cannot describe the model.
REQUIRED_FIELDS = {
    "gpt2": ("vocab_size", "n_embd", "n_head", "n_layer", "n_positions"),
    "default": ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers",
                "intermediate_size"),
}
REQUIRED_FIELDS["deepseek_v3"] = REQUIRED_FIELDS["default"] + (
    "moe_intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def check_required_fields(hf: Any, source: str = "config.json") -> None:
    """Raises ``ValueError`` naming ``source`` and the first missing field of
    a ``config.json`` dict (``model_type`` and the fields its family needs)."""
    if not isinstance(hf, dict):
        raise ValueError(f"{source} must hold a JSON object, got {type(hf).__name__}.")
    if "model_type" not in hf:
        raise ValueError(f"{source} has no 'model_type' field; specjax supports "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}.")
    model_type = hf["model_type"]
    needed = REQUIRED_FIELDS.get(model_type, REQUIRED_FIELDS["default"])
    if model_type not in SUPPORTED_MODEL_TYPES:
        return  # from_hf_config names the unsupported type
    missing = [k for k in needed if hf.get(k) is None]
    if missing:
        raise ValueError(
            f"{source} is missing required field(s) {', '.join(repr(m) for m in missing)} "
            f"that a {model_type} config needs; is it a complete Hugging Face config.json?"
        )


def from_hf_config(hf: dict, dtype: Optional[str] = None) -> ModelConfig:
    """Maps a Hugging Face ``config.json`` dict to a :class:`ModelConfig`.

    Args:
      hf: the parsed ``config.json``.
      dtype: params/compute dtype; ``None`` keeps the checkpoint's own.

    Raises:
      ValueError: unknown ``model_type``, a missing required field (named),
        unsupported rope scaling, or a variant of a supported family that
        this decoder does not implement.
    """
    if not isinstance(hf, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(hf).__name__}.")
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"Unsupported model_type {model_type!r} in config.json; specjax supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    check_required_fields(hf)
    try:
        return _from_hf_config(hf, model_type, dtype)
    except KeyError as e:  # e.g. a llama3 rope_scaling without its "factor"
        raise ValueError(
            f"config.json is missing field {e.args[0]!r} that this {model_type} config needs."
        ) from e
    except TypeError as e:  # e.g. "hidden_size": [64]
        raise ValueError(f"config.json has a field of the wrong type: {e}.") from e


def _from_hf_config(hf: dict, model_type: str, dtype: Optional[str]) -> ModelConfig:
    eos, eos_ids = _eos(hf)
    common = dict(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
        eos_token_ids=eos_ids,
        pad_token_id=hf.get("pad_token_id"),
        dtype=dtype or _dtype_name(hf),
    )
    if model_type == "gpt2":
        for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
            if hf.get(flag):
                raise ValueError(f"GPT-2 with {flag}=True is not supported by specjax.")
        if not hf.get("scale_attn_weights", True):
            raise ValueError("GPT-2 with scale_attn_weights=False is not supported by specjax.")
        h, heads = int(hf["n_embd"]), int(hf["n_head"])
        return ModelConfig(
            hidden_size=h,
            num_layers=int(hf["n_layer"]),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=h // heads,
            intermediate_size=int(hf.get("n_inner") or 4 * h),
            max_position_embeddings=int(hf["n_positions"]),
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            activation=hf.get("activation_function", "gelu_new"),
            **common,
        )

    if model_type in GEMMA_MODEL_TYPES:
        return _from_gemma_config(hf, model_type, common)
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and hf.get("use_sliding_window"):
        if "sliding_attention" in (hf.get("layer_types") or ["sliding_attention"]):
            raise ValueError(
                f"{model_type} with use_sliding_window=True (per-layer sliding windows) "
                "is not supported by specjax."
            )
    if model_type == "gpt_oss":
        hf = gpt_oss.hf_rope(hf)
    theta, scaling = _rope(hf, gpt_oss.DEFAULT_THETA if model_type == "gpt_oss" else 10000.0)
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported by specjax.")
    attention_bias = bool(hf.get("attention_bias", False))
    layout = {
        "llama": dict(attention_bias=attention_bias, attention_out_bias=attention_bias,
                      mlp_bias=bool(hf.get("mlp_bias", False))),
        "mistral": dict(sliding_window=hf.get("sliding_window")),
        "qwen2": dict(attention_bias=True),
        "qwen3": dict(attention_bias=attention_bias, attention_out_bias=attention_bias,
                      qk_norm=True),
        "mixtral": lambda: dict(sliding_window=hf.get("sliding_window"), **_experts(hf, "num_local_experts", True)),
        "qwen2_moe": lambda: dict(attention_bias=bool(hf.get("qkv_bias", True)),
                                  moe_intermediate_size=int(hf["moe_intermediate_size"]),
                                  **_experts(hf, "num_experts", bool(hf.get("norm_topk_prob", False)))),
        "qwen3_moe": lambda: dict(attention_bias=attention_bias, attention_out_bias=attention_bias, qk_norm=True,
                                  moe_intermediate_size=int(hf["moe_intermediate_size"]),
                                  **_experts(hf, "num_experts", bool(hf.get("norm_topk_prob", False)))),
        "dots1": lambda: dict(attention_bias=attention_bias, attention_out_bias=attention_bias, qk_norm=True,
                              moe_intermediate_size=int(hf["moe_intermediate_size"]),
                              **_experts(hf, "n_routed_experts", bool(hf.get("norm_topk_prob", False)))),
        "deepseek_v3": lambda: dict(attention_bias=attention_bias, attention_out_bias=attention_bias,
                                    moe_intermediate_size=int(hf["moe_intermediate_size"]),
                                    **_experts(hf, "n_routed_experts", bool(hf.get("norm_topk_prob", True))),
                                    **_latent_attention(hf)),
        "gpt_oss": lambda: gpt_oss.config_fields(hf),
    }[model_type]
    layout = layout() if callable(layout) else layout
    if hf.get(HEAD_VOCAB_KEY) is not None:
        common["head_vocab_size"] = int(hf[HEAD_VOCAB_KEY])
    return ModelConfig(
        **{**_decoder_shape(hf, max_positions=2048, tied=False), "activation": hf.get("hidden_act", "silu"), **layout},
        rope_theta=theta,
        rope_scaling=scaling,
        **common,
    )


def _latent_attention(hf: dict) -> dict:
    """DeepSeek-V3's multi-head latent attention fields; the cache's heads and head width
    follow from them (one key per head, ``qk_nope_head_dim + qk_rope_head_dim`` wide)."""
    heads = int(hf["num_attention_heads"])
    if int(hf.get("num_key_value_heads") or heads) != heads:
        raise ValueError(f"deepseek_v3 with num_key_value_heads={hf['num_key_value_heads']} other than "
                         f"num_attention_heads={heads} is not supported by specjax (nor run by transformers).")
    fields = {k: int(hf[k]) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    q_rank = hf.get("q_lora_rank")
    return dict(**fields, q_lora_rank=None if q_rank is None else int(q_rank), num_kv_heads=heads,
                head_dim=fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"],
                rope_interleave=bool(hf.get("rope_interleave", True)))


def _experts(hf: dict, count_key: str, renormalise: bool) -> dict:
    """A mixture-of-experts config's expert fields: the experts, Qwen2-MoE's shared expert, and the
    layers whose MLP is dense (``mlp_only_layers``, and those ``decoder_sparse_step`` skips)."""
    # transformers 5 writes num_local_experts for every family; 4.x Qwen3-MoE wrote num_experts
    count = hf.get(count_key) if hf.get(count_key) is not None else hf["num_local_experts"]
    step = int(1 if hf.get("decoder_sparse_step") is None else hf["decoder_sparse_step"])
    if step < 1:
        raise ValueError(f"{hf['model_type']}: decoder_sparse_step must be >= 1 (every step-th layer holds "
                         f"experts), got {step}; fix config.json.")
    layers = int(hf["num_hidden_layers"])
    dense = sorted({int(i) for i in hf.get("mlp_only_layers") or ()} | {i for i in range(layers) if (i + 1) % step})
    shared = hf.get("shared_expert_intermediate_size") if hf["model_type"] == "qwen2_moe" else None
    if hf.get("shared_expert_intermediate_size") and not shared:
        raise ValueError(f"{hf['model_type']} with a shared expert is not supported by specjax (Qwen2-MoE's is).")
    out = dict(num_experts=int(count), num_experts_per_tok=int(hf["num_experts_per_tok"]),
               norm_topk_prob=renormalise, dense_mlp_layers=tuple(dense),
               shared_expert_intermediate_size=int(shared) if shared else None, shared_expert_gate=bool(shared))
    if hf["model_type"] in ("dots1", "deepseek_v3"):  # DeepSeek-V3's routing and shared experts
        if "sliding_attention" in (hf.get("layer_types") or ()):
            raise ValueError(f"{hf['model_type']} with sliding-window layers (layer_types) is not supported by "
                             "specjax.")
        # A key missing from config.json takes its transformers config class's default.
        default = dict(n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4,
                       routed_scaling_factor=2.5) if hf["model_type"] == "deepseek_v3" else dict(
                       n_shared_experts=0, first_k_dense_replace=0, n_group=1, topk_group=1, routed_scaling_factor=1.0)
        get = lambda key: default[key] if hf.get(key) is None else hf[key]  # noqa: E731
        shared = int(get("n_shared_experts")) * int(hf["moe_intermediate_size"])
        out.update(dense_mlp_layers=tuple(range(int(get("first_k_dense_replace")))),
                   shared_expert_intermediate_size=shared or None, shared_expert_gate=False,
                   router_scores="sigmoid", router_bias=True, router_groups=int(get("n_group") or 1),
                   router_top_groups=int(get("topk_group") or 1),
                   routed_scaling_factor=float(get("routed_scaling_factor")))
    return out


def _decoder_shape(hf: dict, *, max_positions: int, tied: bool) -> dict:
    """The ``ModelConfig`` fields every Llama-like ``config.json`` gives the same way (the
    defaults where a field is missing differ by family: ``max_positions``, ``tied``)."""
    h, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    return dict(
        hidden_size=h,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or h // heads),
        intermediate_size=int(hf["intermediate_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", max_positions)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", tied)),
    )


def _from_gemma_config(hf: dict, model_type: str, common: dict) -> ModelConfig:
    """Gemma 1 (``gemma``), Gemma 2 (``gemma2``) and Gemma 3 text (``gemma3_text``) configs."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{model_type} with use_bidirectional_attention=True is not supported by specjax.")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported by specjax.")
    layers = int(hf["num_hidden_layers"])
    attention_bias = bool(hf.get("attention_bias", False))
    fields: dict[str, Any] = {}
    if model_type == "gemma":
        theta, scaling = _rope(hf)
        activation = hf.get("hidden_act") or "gelu_pytorch_tanh"  # what transformers' GemmaMLP reads
    else:
        activation = hf.get("hidden_activation") or "gelu_pytorch_tanh"
        layer_types = hf.get("layer_types")
        if layer_types is None:  # older configs: every `pattern`-th layer is global
            pattern = int(hf.get("sliding_window_pattern", 6)) if model_type == "gemma3_text" else 2
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        if not isinstance(layer_types, (list, tuple)):
            raise ValueError(f"config.json field 'layer_types' must be a list, got {layer_types!r}.")
        fields.update(
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
            sliding_window=hf.get("sliding_window"),
            layer_types=tuple(layer_types),
        )
        rope = hf.get("rope_parameters")
        if model_type == "gemma3_text":
            fields["final_logit_softcapping"] = hf.get("final_logit_softcapping")
            fields["attn_logit_softcapping"] = hf.get("attn_logit_softcapping")
            if isinstance(rope, dict) and "full_attention" in rope:  # transformers 5: one entry per layer type
                theta, scaling = _rope({"rope_parameters": rope["full_attention"]}, 1_000_000.0)
                local = rope.get("sliding_attention") or {}
            else:  # 4.x: rope_theta (+ rope_scaling) global, rope_local_base_freq local
                theta, scaling = _rope(hf, 1_000_000.0)
                local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
            local_theta, local_scaling = _rope({"rope_parameters": local}, 10000.0)
            if local_scaling is not None:
                raise ValueError("gemma3_text with a scaled rope on its sliding layers is not supported by specjax.")
            fields["rope_local_theta"] = local_theta
        else:
            fields["final_logit_softcapping"] = hf.get("final_logit_softcapping", 30.0)
            fields["attn_logit_softcapping"] = hf.get("attn_logit_softcapping", 50.0)
            theta, scaling = _rope(hf)
        for key in ("final_logit_softcapping", "attn_logit_softcapping", "sliding_window"):
            if fields[key] is not None:
                fields[key] = (int if key == "sliding_window" else float)(fields[key])
    return ModelConfig(
        **_decoder_shape(hf, max_positions=8192, tied=True),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=attention_bias,
        attention_out_bias=attention_bias,
        qk_norm=model_type == "gemma3_text",
        activation=activation,
        **fields,
        **common,
    )


def _check_expressible(cfg: ModelConfig) -> None:
    """Raises if ``cfg`` has a feature its HF family cannot represent."""
    problems = []
    if cfg.is_gemma:
        if cfg.attention_bias or cfg.attention_out_bias or cfg.mlp_bias:
            problems.append("Gemma has no biases")
        if cfg.qk_norm != (cfg.model_type == "gemma3_text"):
            problems.append("qk_norm is on exactly for gemma3_text")
        if cfg.model_type == "gemma" and (cfg.sliding_window is not None or cfg.attn_logit_softcapping is not None
                                          or cfg.final_logit_softcapping is not None):
            problems.append("Gemma 1 has no sliding window and no softcapping")
        if problems:
            raise ValueError(f"This config cannot be written as a Hugging Face {_ARCHITECTURES[cfg.model_type]}: "
                             + "; ".join(problems) + ".")
        return
    problems += gpt_oss.expressible_problems(cfg)
    if cfg.model_type not in ("mistral", "mixtral", "gpt_oss") and cfg.sliding_window is not None:
        problems.append("sliding_window (only mistral, mixtral and gpt_oss have it)")
    if cfg.model_type == "mixtral" and not cfg.norm_topk_prob:
        problems.append("mixtral always renormalises its top-k weights")
    if cfg.model_type in ("qwen2", "qwen2_moe") and cfg.attention_out_bias:
        problems.append(f"{cfg.model_type} has no o_proj bias")
    if cfg.model_type == "qwen2" and not cfg.attention_bias:
        problems.append("qwen2 needs attention_bias=True")
    if cfg.model_type == "qwen2_moe" and cfg.shared_expert_intermediate_size and not cfg.shared_expert_gate:
        problems.append("qwen2_moe gates its shared expert")
    if cfg.model_type in ("dots1", "deepseek_v3") and (
            cfg.dense_mlp_layers != tuple(range(len(cfg.dense_mlp_layers))) or not cfg.moe_intermediate_size
            or (cfg.shared_expert_intermediate_size or 0) % cfg.moe_intermediate_size or cfg.shared_expert_gate
            or (cfg.router_scores, cfg.router_bias) != ("sigmoid", True)):
        problems.append(f"{cfg.model_type} has its dense layers first, ungated shared experts as wide as a multiple "
                        "of an expert, and sigmoid routing with a score bias")
    if cfg.model_type in ("qwen2_moe", "qwen3_moe", "mixtral") and (
            cfg.router_scores != "softmax" or cfg.router_bias or cfg.router_groups != 1
            or cfg.routed_scaling_factor != 1.0):
        problems.append(f"{cfg.model_type} routes by a plain softmax")
    if cfg.model_type in ("llama", "qwen3", "qwen3_moe", "dots1", "deepseek_v3", "gpt_oss") and (
            cfg.attention_bias != cfg.attention_out_bias):
        problems.append(f"{cfg.model_type} biases q/k/v/o together")
    if cfg.model_type in ("mistral", "mixtral") and (cfg.attention_bias or cfg.attention_out_bias):
        problems.append(f"{cfg.model_type} has no attention biases")
    if cfg.mlp_bias and cfg.model_type != "llama":
        problems.append("mlp_bias (only llama has it)")
    if cfg.qk_norm != (cfg.model_type in ("qwen3", "qwen3_moe", "dots1")):
        problems.append("qk_norm is on exactly for qwen3, qwen3_moe and dots1")
    if cfg.rope_scaling is not None and cfg.model_type == "gpt2":
        problems.append("gpt2 has no rope")
    if cfg.model_type == "gpt2" and (cfg.num_kv_heads != cfg.num_heads
                                     or cfg.head_dim * cfg.num_heads != cfg.hidden_size):
        problems.append("gpt2 has no GQA and head_dim = hidden/heads")
    if problems:
        raise ValueError(
            "This config cannot be written as a Hugging Face "
            f"{_ARCHITECTURES[cfg.model_type]}: " + "; ".join(problems) + "."
        )


def to_hf_config(cfg: ModelConfig) -> dict:
    """The ``config.json`` dict transformers needs to rebuild ``cfg``'s model.

    Writes the rope settings both as transformers 5 ``rope_parameters`` and as
    the 4.x ``rope_theta`` / ``rope_scaling`` keys.
    """
    _check_expressible(cfg)
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "dtype": cfg.dtype,
        "torch_dtype": cfg.dtype,
    }
    if cfg.is_gpt2:
        out.update(
            n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            n_inner=cfg.intermediate_size,
            n_positions=cfg.max_position_embeddings,
            layer_norm_epsilon=cfg.norm_eps,
            activation_function=cfg.activation,
        )
        return out
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "linear":
        rope.update(rope_type="linear", factor=cfg.rope_scaling.factor)
    elif cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "yarn":
        s = cfg.rope_scaling
        rope.update(rope_type="yarn", factor=s.factor, original_max_position_embeddings=s.original_max_position_embeddings,
                    beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate,
                    **{k: getattr(s, k) for k in ("mscale", "mscale_all_dim", "attention_factor")
                       if getattr(s, k) is not None})
    elif cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope.update(
            rope_type="llama3",
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    out.update(
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_eps,
        hidden_act=cfg.activation,
        rope_theta=cfg.rope_theta,
        rope_parameters=rope,
        rope_scaling=dict(rope) if cfg.rope_scaling is not None else None,
    )
    if cfg.has_reduced_head:
        # Not a transformers model any more: its head scores a token subset.
        out[HEAD_VOCAB_KEY] = cfg.head_vocab_size
    if cfg.model_type in ("llama", "qwen3"):
        out["attention_bias"] = cfg.attention_bias
    if cfg.model_type == "llama":
        out["mlp_bias"] = cfg.mlp_bias
    if cfg.model_type == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if cfg.model_type in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
    if cfg.is_gemma:
        out.update(_gemma_fields(cfg, rope))
    if cfg.model_type in ("qwen3", "qwen3_moe"):
        out["attention_bias"] = cfg.attention_bias
    if cfg.model_type == "mixtral":
        out.update(sliding_window=cfg.sliding_window, num_local_experts=cfg.num_experts,
                   num_experts_per_tok=cfg.num_experts_per_tok)
    if cfg.model_type in ("qwen2_moe", "qwen3_moe"):
        out.update(num_experts=cfg.num_experts, num_local_experts=cfg.num_experts,
                   num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size or cfg.intermediate_size,
                   norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_mlp_layers),
                   use_sliding_window=False, sliding_window=None)
    if cfg.model_type == "qwen2_moe":
        out.update(qkv_bias=cfg.attention_bias, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size or 0)
    if cfg.model_type in ("dots1", "deepseek_v3"):
        out.update(attention_bias=cfg.attention_bias, n_routed_experts=cfg.num_experts,
                   num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size,
                   n_shared_experts=(cfg.shared_expert_intermediate_size or 0) // cfg.moe_intermediate_size,
                   first_k_dense_replace=len(cfg.dense_mlp_layers), norm_topk_prob=cfg.norm_topk_prob,
                   n_group=cfg.router_groups, topk_group=cfg.router_top_groups,
                   routed_scaling_factor=cfg.routed_scaling_factor, sliding_window=None,
                   layer_types=["full_attention"] * cfg.num_layers)
    if cfg.latent_attention:  # transformers' DeepseekV3Config names the rotated width head_dim
        out.update(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, head_dim=cfg.qk_rope_head_dim,
                   rope_interleave=cfg.rope_interleave, num_nextn_predict_layers=0)
        del out["layer_types"], out["sliding_window"]
    if cfg.model_type == "gpt_oss":
        out.update(gpt_oss.hf_fields(cfg))
    return out


def _gemma_fields(cfg: ModelConfig, rope: dict) -> dict:
    """The Gemma keys of ``config.json`` (what :func:`_from_gemma_config` reads back)."""
    out: dict[str, Any] = {"hidden_activation": cfg.activation, "attention_bias": False}
    if cfg.model_type == "gemma":
        return out
    out.update(
        # transformers types it an int; Gemma's are whole numbers (head_dim, or hidden / heads)
        query_pre_attn_scalar=(int(cfg.query_pre_attn_scalar) if float(cfg.query_pre_attn_scalar).is_integer()
                               else cfg.query_pre_attn_scalar),
        sliding_window=cfg.sliding_window,
        layer_types=list(cfg.layer_types),
        attn_logit_softcapping=cfg.attn_logit_softcapping,
        final_logit_softcapping=cfg.final_logit_softcapping,
    )
    if cfg.model_type == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
        out.update(rope_parameters={"full_attention": rope, "sliding_attention": local},
                   rope_local_base_freq=local["rope_theta"])
    return out


# --------------------------------------------------------------------------- #
# Tensor names
# --------------------------------------------------------------------------- #


class TensorSpec(NamedTuple):
    """One parameter: where it lives in specjax's tree and in the HF file.

    ``transpose``: the HF tensor is a ``torch.nn.Linear`` weight ``[out, in]``;
    specjax stores ``[in, out]``. (GPT-2's ``Conv1D`` is already ``[in, out]``.)
    ``integer``: token ids (a reduced head's), kept int32 whatever the dtype.
    ``expert``: the HF tensor is this expert's slice of a stacked ``[E, ...]``
    param (a mixture of experts stores one tensor per expert).
    """

    path: tuple[str, ...]
    hf_name: str
    transpose: bool
    integer: bool = False
    expert: Optional[int] = None


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every parameter of ``Decoder(cfg)`` with its Hugging Face tensor name."""
    specs: list[TensorSpec] = []

    def add(path: str, name: str, transpose: bool = False):
        specs.append(TensorSpec(tuple(path.split("/")), name, transpose))

    if cfg.is_gpt2:
        p = "transformer."
        add("embed/embedding", p + "wte.weight")
        add("pos_embed/embedding", p + "wpe.weight")
        for i in range(cfg.num_layers):
            h, l = f"{p}h.{i}.", f"layer_{i}/"
            for ours, theirs in [("attn_norm", "ln_1"), ("mlp_norm", "ln_2")]:
                add(l + ours + "/scale", h + theirs + ".weight")
                add(l + ours + "/bias", h + theirs + ".bias")
            for ours, theirs in [("attn/qkv", "attn.c_attn"), ("attn/o", "attn.c_proj"),
                                 ("mlp/fc", "mlp.c_fc"), ("mlp/proj", "mlp.c_proj")]:
                add(l + ours + "/kernel", h + theirs + ".weight")
                add(l + ours + "/bias", h + theirs + ".bias")
        add("final_norm/scale", p + "ln_f.weight")
        add("final_norm/bias", p + "ln_f.bias")
    else:
        add("embed/embedding", "model.embed_tokens.weight")
        for i in range(cfg.num_layers):
            h, l = f"model.layers.{i}.", f"layer_{i}/"
            add(l + "attn_norm/scale", h + "input_layernorm.weight")
            if cfg.sandwich_norms:  # Gemma 2/3
                add(l + "post_attn_norm/scale", h + "post_attention_layernorm.weight")
                add(l + "mlp_norm/scale", h + "pre_feedforward_layernorm.weight")
                add(l + "post_mlp_norm/scale", h + "post_feedforward_layernorm.weight")
            else:
                add(l + "mlp_norm/scale", h + "post_attention_layernorm.weight")
            for proj in "qkvo" if not cfg.latent_attention else ():
                add(f"{l}attn/{proj}/kernel", f"{h}self_attn.{proj}_proj.weight", True)
                if cfg.attention_out_bias if proj == "o" else cfg.attention_bias:
                    add(f"{l}attn/{proj}/bias", f"{h}self_attn.{proj}_proj.bias")
            if cfg.latent_attention:
                specs.extend(_latent_attention_specs(cfg, h, l))
            if cfg.attention_sinks:
                add(l + "attn/sinks", h + "self_attn.sinks")
            if cfg.qk_norm:
                add(l + "attn/q_norm/scale", h + "self_attn.q_norm.weight")
                add(l + "attn/k_norm/scale", h + "self_attn.k_norm.weight")
            if cfg.is_moe_layer(i):
                specs.extend(_expert_specs(cfg, h, l))
                continue
            for proj in ("gate", "up", "down"):
                add(f"{l}mlp/{proj}/kernel", f"{h}mlp.{proj}_proj.weight", True)
                if cfg.mlp_bias:
                    add(f"{l}mlp/{proj}/bias", f"{h}mlp.{proj}_proj.bias")
        add("final_norm/scale", "model.norm.weight")
    if cfg.has_reduced_head:
        specs.append(TensorSpec(("lm_head",), "lm_head.weight", True))
        specs.append(TensorSpec(("head_vocab_ids",), HEAD_VOCAB_IDS, False, integer=True))
    elif not cfg.tie_word_embeddings:
        specs.append(TensorSpec(("lm_head",), "lm_head.weight", True))
    return specs


def _latent_attention_specs(cfg: ModelConfig, h: str, l: str) -> list[TensorSpec]:
    """Multi-head latent attention's tensors (DeepSeek-V3's ``self_attn``)."""
    layer, attn = tuple(l.rstrip("/").split("/")) + ("attn",), f"{h}self_attn."
    projections = [("q", "q_proj", False)] if cfg.q_lora_rank is None else [
        ("q_a", "q_a_proj", cfg.attention_bias), ("q_b", "q_b_proj", False)]
    projections += [("kv_a", "kv_a_proj_with_mqa", cfg.attention_bias), ("kv_b", "kv_b_proj", False),
                    ("o", "o_proj", cfg.attention_out_bias)]
    specs = []
    for ours, theirs, bias in projections:
        specs.append(TensorSpec((*layer, ours, "kernel"), f"{attn}{theirs}.weight", True))
        if bias:
            specs.append(TensorSpec((*layer, ours, "bias"), f"{attn}{theirs}.bias", False))
    norms = ([] if cfg.q_lora_rank is None else [("q_a_norm", "q_a_layernorm")]) + [("kv_a_norm", "kv_a_layernorm")]
    return specs + [TensorSpec((*layer, ours, "scale"), f"{attn}{theirs}.weight", False) for ours, theirs in norms]


def _expert_specs(cfg: ModelConfig, h: str, l: str) -> list[TensorSpec]:
    """A mixture of experts' tensors: the router, and each expert's three projections
    (Mixtral names them w1 / w3 / w2 under ``block_sparse_moe``)."""
    if cfg.model_type == "gpt_oss":  # fused experts, split into per-expert slices on load (gpt_oss.split_tensors)
        return [TensorSpec(*spec) for spec in gpt_oss.expert_specs(cfg, h, tuple(l.rstrip("/").split("/")))]
    mixtral, dots1 = cfg.model_type == "mixtral", cfg.model_type in ("dots1", "deepseek_v3")
    moe = f"{h}block_sparse_moe." if mixtral else f"{h}mlp."
    names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else {p: f"{p}_proj" for p in ("gate", "up", "down")}
    layer = l.rstrip("/").split("/")
    specs = [TensorSpec((*layer, "mlp", "router", "kernel"), moe + "gate.weight", True)]
    if cfg.router_bias:  # DeepSeek-V3's e_score_correction_bias
        specs.append(TensorSpec((*layer, "mlp", "router_bias"), moe + "gate.e_score_correction_bias", False))
    if cfg.shared_expert_intermediate_size:  # an MLP every token goes through (Qwen2-MoE's behind a sigmoid gate)
        shared = "shared_experts" if dots1 else "shared_expert"
        for proj in ("gate", "up", "down"):
            specs.append(TensorSpec((*layer, "mlp", "shared_expert", proj, "kernel"),
                                    f"{moe}{shared}.{proj}_proj.weight", True))
        if cfg.shared_expert_gate:
            specs.append(TensorSpec((*layer, "mlp", "shared_expert_gate", "kernel"), moe + "shared_expert_gate.weight",
                                    True))
    for j in range(cfg.num_experts):
        for ours, theirs in names.items():
            specs.append(TensorSpec((*l.rstrip("/").split("/"), "mlp", f"experts_{ours}"),
                                    f"{moe}experts.{j}.{theirs}.weight", True, expert=j))
    return specs


def canonical_name(name: str, cfg: ModelConfig) -> str:
    """Original GPT-2 checkpoints omit the ``transformer.`` prefix; add it back."""
    if cfg.is_gpt2 and not name.startswith(("transformer.", "lm_head.")):
        return "transformer." + name
    return name


def is_ignored(name: str, cfg: ModelConfig) -> bool:
    """Tensors we skip: recomputed buffers, and a tied head saved anyway."""
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    if cfg.model_type == "deepseek_v3":  # DeepSeek-V3's multi-token-prediction layers, after the last
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer and int(layer.group(1)) >= cfg.num_layers:
            return True
    return cfg.tie_word_embeddings and name == "lm_head.weight"


# --------------------------------------------------------------------------- #
# Files
# --------------------------------------------------------------------------- #

_PICKLE_PATTERNS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def find_weight_files(path: str) -> list[str]:
    """The safetensors files of an HF directory, in transformers' order of
    preference: ``model.safetensors``, else the shards a
    ``model.safetensors.index.json`` names, else every ``*.safetensors``.

    Raises:
      ValueError: no safetensors, with an explanation if pickle weights exist.
    """
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):  # as transformers does, so both load the same weights
        return [single]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)
        except ValueError as e:
            raise ValueError(f"{index} is not valid JSON ({e}); fix or remove it.") from e
        if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
            raise ValueError(f"{index} has no 'weight_map' object mapping tensor names to shards.")
        files = sorted(set(map(str, weight_map["weight_map"].values())))
        missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise ValueError(
                f"{index} lists shards that are not in the directory: {', '.join(missing)}."
            )
        return [os.path.join(path, f) for f in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        return [os.path.join(path, f) for f in files]
    pickles = sorted(f for f in os.listdir(path) if f.endswith(_PICKLE_PATTERNS))
    if pickles:
        raise ValueError(
            f"{path} holds only pickle-based weights ({', '.join(pickles)}). specjax refuses "
            "them: unpickling can execute arbitrary code from the checkpoint. Convert them "
            "once, in an environment you trust, with transformers: "
            "`AutoModelForCausalLM.from_pretrained(path).save_pretrained(out_dir, "
            "safe_serialization=True)`, then load out_dir."
        )
    raise ValueError(f"No weights found in {path}: expected model.safetensors "
                     "(or a sharded model.safetensors.index.json).")


def _corrupt(file: str, e: Exception) -> ValueError:
    return ValueError(
        f"{file} is truncated or corrupt and cannot be read "
        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
        "download or convert it again."
    )


def open_safetensors(file: str, framework: str):
    """``safetensors.safe_open``, with a damaged file reported by its path."""
    from safetensors import safe_open

    try:
        return safe_open(file, framework=framework)
    except Exception as e:  # SafetensorError, OSError, ...
        raise _corrupt(file, e) from e


def checked_reader(file: str, get):
    """``get(name)`` with a damaged file reported by its path."""
    def read(name):
        try:
            return get(name)
        except Exception as e:
            raise _corrupt(file, e) from e
    return read


def count_tensors(files: list[str]) -> int:
    """Number of tensors in ``files`` (reads headers only).

    Raises:
      ValueError: a file is truncated or corrupt (named).
    """
    total = 0
    for file in files:
        with open_safetensors(file, "np") as f:
            total += len(f.keys())
    return total


def iter_tensors(files: list[str], cfg: ModelConfig) -> Iterator[tuple[str, Any, tuple]]:
    """Yields ``(canonical name, read, shape)`` for every tensor, one file at a time.

    ``read()`` returns the tensor as a NumPy array (bfloat16 via ml_dtypes) and
    reads it only when called, so a caller can check shapes first and hold one
    tensor at a time.
    """
    for file in files:
        # NumPy has no native bfloat16 and safetensors' "np" backend refuses
        # BF16 tensors: read those through the "flax" backend instead.
        with open_safetensors(file, "np") as f, open_safetensors(file, "flax") as fj:
            get_np = checked_reader(file, f.get_tensor)
            get_bf16 = checked_reader(file, lambda n: np.asarray(fj.get_tensor(n)))
            for name in f.keys():
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                if sl.get_dtype() == "BF16":
                    read = lambda n=name: get_bf16(n)  # noqa: E731
                else:
                    read = lambda n=name: get_np(n)  # noqa: E731
                yield canonical_name(name, cfg), read, shape


# safetensors dtype codes.
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int32": "I32", "int8": "I8"}


def write_safetensors(path: str, tensors: list[tuple[str, tuple, Any, Any]]) -> Iterator[str]:
    """Writes a safetensors file, materialising one tensor at a time.

    Args:
      path: output file.
      tensors: ``(name, shape, dtype, make)`` where ``make()`` returns the
        tensor as an array of that shape and dtype.

    Yields:
      each name after it is written (for a progress bar).
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype, _ in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize
        header[name] = {
            "dtype": _ST_DTYPES[jnp.dtype(dtype).name],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, dtype, make in tensors:
            arr = np.ascontiguousarray(np.asarray(make()))
            if arr.shape != tuple(shape) or arr.dtype != jnp.dtype(dtype):
                raise AssertionError(f"{name}: made {arr.shape} {arr.dtype}, declared {shape} {dtype}")
            f.write(arr.tobytes())
            yield name
