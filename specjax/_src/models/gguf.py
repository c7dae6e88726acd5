"""GGUF files in: config, dequantized weights and tokenizer from one file.

A GGUF file (llama.cpp's format) holds the weights, often quantized, plus
metadata from which a Hugging Face ``config.json`` and ``tokenizer.json`` can
be rebuilt. :func:`read_gguf` maps it onto the Hugging Face tensor names and
config keys that :mod:`specjax._src.models.hf` already understands, so one
loader (``load_hf``'s tensor loop) serves both formats.

Weights are dequantized to float32 with the ``gguf`` package, one tensor at a
time. llama.cpp's converter permutes the rows of Llama's q/k projections (its
rotary layout interleaves the two halves of each head); they are permuted back
here, as transformers' GGUF loader does.

Mixtures of experts: llama.cpp writes Mixtral as a ``llama`` file with
``llama.expert_count`` and Qwen3-MoE as ``qwen3moe``; each block's experts are
three stacked tensors ``blk.N.ffn_{gate,up,down}_exps.weight`` (``[E, out, in]``
in NumPy order) and its router ``blk.N.ffn_gate_inp.weight``. Each stack is
read back one expert at a time under the Hugging Face per-expert names, so the
one tensor loop fills specjax's stacked expert params. llama.cpp's Mixtral and
Qwen3-MoE graphs renormalise the top-k routing weights (``build_moe_ffn(...,
norm_w=true)``), which the file does not record: ``norm_topk_prob`` is on for
them. Qwen2-MoE (``qwen2moe``) adds a shared expert,
``blk.N.ffn_{gate,up,down}_shexp.weight`` of width
``qwen2moe.expert_shared_feed_forward_length``, behind the sigmoid gate
``blk.N.ffn_gate_inp_shexp.weight`` (a vector of ``n_embd``; Hugging Face's
``[1, H]``); its graph does not renormalise (``norm_topk_prob`` off, as the
Hugging Face config's default).

DeepSeek-V3 (``deepseek2``, llama.cpp's architecture for DeepseekV2/V3ForCausalLM) loads as
``deepseek_v3``: the latent attention's tensors map one to one, except that the current converter
splits ``kv_b_proj`` per head into ``attn_k_b`` (transposed) and ``attn_v_b``, joined again here
(:func:`_kv_b_of`); its rotary rows are not permuted (llama.cpp's NORM rope on ``deepseek2`` is
DeepSeek's interleaved layout, ``rope_interleave``). DeepSeek-V2's softmax routing is refused.

gpt-oss (``gpt-oss``, llama.cpp's architecture for GptOssForCausalLM) loads as ``gpt_oss``
(:func:`_gpt_oss_config`): the converter de-interleaves Hugging Face's ``gate_up_proj`` into
``ffn_gate_exps`` and ``ffn_up_exps`` (``[E, I, H]``; or, with ``--fuse-gate-up-exps``, one
``ffn_gate_up_exps`` of the gate rows then the up rows) plus their ``.bias`` stacks, transposes
``down_proj`` into ``ffn_down_exps`` (``[E, H, I]``), keeps MXFP4 experts as GGML's MXFP4 blocks,
and writes the sinks as ``attn_sinks.weight``; they are read back as the per-expert slices
:func:`specjax._src.models.gpt_oss.expert_specs` names (:func:`_gpt_oss_experts`). The file does not
record what llama.cpp hard-codes: sliding and full layers alternating, sliding first
(``set_swa_pattern(2)``), and the clamped SwiGLU's alpha 1.702 and limit 7.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable, Iterator, NamedTuple, Optional

import numpy as np

# Architectures whose GGUF tensor names and metadata map onto ours.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma", "gemma2", "gemma3",
                           "deepseek2", "gpt-oss")
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
# Hugging Face model_type of each GGUF architecture where the two differ.
_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "deepseek2": "deepseek_v3",
               "gpt-oss": "gpt_oss"}
# The Hugging Face model_type of an architecture whose blocks hold experts
# (llama.cpp writes Mixtral as ``llama`` with an expert count).
_MOE_MODEL_TYPES = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
_STACKED_EXPERT_TYPES = (*_MOE_MODEL_TYPES.values(), "deepseek_v3")
# A block's stacked experts, one tensor per projection: [E, out, in] in NumPy order.
_EXPERT_STACK = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_MIXTRAL_EXPERT_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}
# deepseek2 block tensors by GGUF kind (attn_k_b + attn_v_b, newer files' split of attn_kv_b: _kv_b_of).
_DEEPSEEK2_NAMES = {
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj", "ffn_gate_inp": "mlp.gate", "exp_probs_b": "mlp.gate.e_score_correction_bias",
    **{f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")},
}
# gpt-oss's expert stacks and their biases (gate_up: the converter's --fuse-gate-up-exps, gate rows then up).
_GPT_OSS_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.(weight|bias)")
# llama.cpp's gpt-oss graph: swiglu_oai with these constants (the file has no key for them).
_GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
_KV_B_SPLIT = re.compile(r"blk\.(\d+)\.attn_([kv])_b\.weight")
_log = logging.getLogger(__name__)
# What llama.cpp hard-codes for Gemma 2 and 3 rather than storing it in the
# file: which layers attend globally (every 2nd, every 6th), Gemma 3's local
# rope base, and the 27B models' score scale (they have 46 and 62 layers).
_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp stores Gemma's norm weights as 1 + w, the factor its plain RMSNorm
# multiplies by; specjax's Gemma norms add the 1 themselves.
_NORM_SHIFT = {"gemma": 1.0, "gemma2": 1.0, "gemma3": 1.0}

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer regexes by ``tokenizer.ggml.pre``: how the text is split before
# byte-level BPE. The GPT-2 split is ByteLevel's own (``use_regex=True``).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek-V3's three splits in turn (llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM, tokenizer.json's Sequence).
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# GPT-4o's (o200k; gpt-oss's tokenizer.json, llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O).
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
           "deepseek-v3": _DEEPSEEK3_SPLITS, "gpt-4o": _GPT4O_SPLIT}
# Vocabularies trained with single-digit pre-splitting before GPT-2's regex
# (SmolLM's tokenizer.json: Digits(individual_digits=True), ByteLevel).
_DIGIT_SPLIT = ("smollm", "starcoder")
# Pre-tokenizers that are GPT-2's own regex ("default": files written before
# llama.cpp recorded one, which it reads the same way).
_GPT2_SPLIT = ("default", "gpt-2", "gpt2")


class GGUFCheckpoint(NamedTuple):
    """What :func:`read_gguf` gets from a file.

    Attributes:
      hf_config: a Hugging Face ``config.json`` dict for the model.
      tensors: a function returning ``(hf_name, read, hf_shape)`` triples, as
        ``hf.iter_tensors`` does; ``read()`` dequantizes to float32.
      num_tensors: how many triples ``tensors()`` yields.
      tokenizer: a ``tokenizers.Tokenizer`` built from the metadata, or None.
      chat_template: the Jinja chat template, or None.
    """

    hf_config: dict
    tensors: Callable[[], Iterator[tuple[str, Callable[[], np.ndarray], tuple[int, ...]]]]
    num_tensors: int
    tokenizer: Any
    chat_template: Optional[str]


def _require_gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - gguf is a core dependency
        raise ImportError("Reading GGUF files needs the gguf package: pip install gguf") from e
    return gguf


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def _config(reader, path: str) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        shared = {"deepseek": " (a mixture of experts with shared experts, which specjax does not run)"}.get(arch, "")
        raise ValueError(
            f"GGUF file {path} holds a {arch!r} model{shared}; specjax reads GGUF architectures "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}."
        )

    def get(key: str, default: Any = None, required: bool = True):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None and required:
            raise ValueError(f"GGUF file {path} lacks the metadata key {arch}.{key}.")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(_field(reader, "tokenizer.ggml.tokens", []))
    if not vocab:  # neither key: the embedding table's rows are the vocabulary
        embedding = [t for t in reader.tensors if t.name == "token_embd.weight"]
        if not embedding:
            raise ValueError(f"GGUF file {path} gives no vocabulary size ({arch}.vocab_size, "
                             "tokenizer.ggml.tokens) and holds no token_embd.weight tensor.")
        vocab = int(embedding[0].shape[-1])  # GGUF lists dimensions innermost first
    cfg = {
        "model_type": _MODEL_TYPES.get(arch, arch),
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "intermediate_size": int(get("feed_forward_length", 0, required=arch != "gpt-oss")),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "dtype": "float32",
    }
    head_dim = get("attention.key_length", None, required=False)
    if head_dim is not None:
        cfg["head_dim"] = int(head_dim)
    scaling = get("rope.scaling.type", None, required=False)
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none") and arch not in ("deepseek2", "gpt-oss"):  # their yarn: _*_config
        raise ValueError(
            f"GGUF file {path} uses rope scaling {scaling!r}, which specjax's GGUF reader does "
            "not map; convert the original Hugging Face checkpoint instead."
        )
    _check_rope_freqs(reader, path)
    if arch == "qwen2":
        cfg["attention_bias"] = True
    elif arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in names
    elif arch in _GEMMA_ARCHITECTURES:
        cfg.update(_gemma_config(arch, get, cfg))
    elif arch == "deepseek2":
        cfg.update(_deepseek2_config(get, names, path, cfg))
    elif arch == "gpt-oss":
        cfg.update(_gpt_oss_config(get, names, path, cfg))
    if arch in _MOE_MODEL_TYPES and (arch != "llama" or get("expert_count", 0, required=False)):
        cfg.update(_moe_config(arch, get, names, path, cfg["num_hidden_layers"]))
    return cfg


def _moe_config(arch: str, get, names: set, path: str, layers: int) -> dict:
    """A mixture of experts' config fields (Mixtral from ``llama``, Qwen2-MoE from ``qwen2moe``,
    Qwen3-MoE from ``qwen3moe``); the variants specjax's ``MoE`` does not run are refused by name."""
    experts = int(get("expert_count"))
    used = int(get("expert_used_count"))
    shared = [f"{arch}.{key}" for key in ("expert_shared_count", "expert_shared_feed_forward_length")
              if get(key, None, required=False)]
    shared += sorted(n for n in names if "_shexp" in n)[:1]
    if arch == "qwen2moe":  # one shared expert behind a sigmoid gate; llama.cpp's graph does not renormalise
        return {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": False,
                "moe_intermediate_size": int(get("expert_feed_forward_length")),
                "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length"))}
    if shared:
        raise ValueError(f"GGUF file {path} has shared experts ({shared[0]}), which specjax's mixture of "
                         "experts does not run (it reads Mixtral, Qwen2-MoE and Qwen3-MoE layouts).")
    scale = get("expert_weights_scale", None, required=False)
    if scale not in (None, 0.0, 1.0):  # llama.cpp scales the routing weights unless 0 or 1
        raise ValueError(f"GGUF file {path} scales its routing weights ({arch}.expert_weights_scale = "
                         f"{scale}), which specjax's mixture of experts does not do.")
    if get("leading_dense_block_count", 0, required=False):
        raise ValueError(f"GGUF file {path} has dense blocks before its expert ones "
                         f"({arch}.leading_dense_block_count), which specjax does not run.")
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    if dense:
        raise ValueError(f"GGUF file {path} has {experts} experts per block but block {dense[0]} has no "
                         f"router (blk.{dense[0]}.ffn_gate_inp.weight): dense blocks among expert ones "
                         "are not run by specjax.")
    if arch == "llama":  # Mixtral: the expert width is the file's feed_forward_length
        return {"model_type": "mixtral", "num_local_experts": experts, "num_experts_per_tok": used,
                "sliding_window": None}
    return {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": True,
            "moe_intermediate_size": int(get("expert_feed_forward_length"))}


def _deepseek2_config(get, names: set, path: str, cfg: dict) -> dict:
    """DeepSeek-V3's config fields from a ``deepseek2`` file (llama.cpp's converter for
    DeepseekV2/V3ForCausalLM). Newer files write the absorbed form's widths as
    ``attention.key_length`` / ``value_length`` (``kv_lora_rank + rope``, ``kv_lora_rank``, with
    ``head_count_kv`` 1) and the per-head ones as ``key_length_mla`` / ``value_length_mla``; older
    files only the per-head ones, as ``key_length`` / ``value_length``."""
    gating = get("expert_gating_func", None, required=False)
    if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID; absent: DeepSeek-V2's softmax
        raise ValueError(f"GGUF file {path} routes its experts with {'softmax' if gating in (None, 1) else gating!r} "
                         "scores (deepseek2.expert_gating_func, DeepSeek-V2's routing); specjax's deepseek2 "
                         "reader runs DeepSeek-V3's sigmoid routing (expert_gating_func 2) only.")
    rope = int(get("rope.dimension_count"))
    mla = get("attention.key_length_mla", None, required=False) is not None
    key = int(get("attention.key_length_mla" if mla else "attention.key_length"))
    out = {
        "num_key_value_heads": cfg["num_attention_heads"], "head_dim": key, "rope_interleave": True,
        "q_lora_rank": get("attention.q_lora_rank", None, required=False),
        "kv_lora_rank": int(get("attention.kv_lora_rank")), "qk_rope_head_dim": rope, "qk_nope_head_dim": key - rope,
        "v_head_dim": int(get("attention.value_length_mla" if mla else "attention.value_length")),
        "n_routed_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "n_shared_experts": int(get("expert_shared_count", 0, required=False)),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0, required=False)),
        "n_group": int(get("expert_group_count", 1, required=False) or 1),
        "topk_group": int(get("expert_group_used_count", 1, required=False) or 1),
        # llama.cpp scales the routing weights only when the factor is set (and not 0)
        "routed_scaling_factor": float(get("expert_weights_scale", 0.0, required=False) or 1.0),
        "norm_topk_prob": bool(get("expert_weights_norm", False, required=False)),
    }
    if out["q_lora_rank"] is not None:
        out["q_lora_rank"] = int(out["q_lora_rank"])
    missing = [n for n in (f"blk.{out['first_k_dense_replace']}.exp_probs_b.bias",) if n not in names]
    if out["first_k_dense_replace"] < cfg["num_hidden_layers"] and missing:
        raise ValueError(f"GGUF file {path} lacks the tensor {missing[0]} (DeepSeek-V3's expert score correction "
                         "bias); specjax runs DeepSeek-V3's routing, which adds it.")
    scaling = get("rope.scaling.type", None, required=False)
    if scaling == "yarn":
        # llama.cpp's deepseek2 graph multiplies the softmax scale by (1 + yarn_log_multiplier * ln(factor))^2
        # and leaves the rotation unscaled: transformers' DeepSeek yarn with mscale = mscale_all_dim =
        # yarn_log_multiplier / 0.1 (the converter writes 0.1 * mscale_all_dim).
        mscale = float(get("rope.scaling.yarn_log_multiplier")) / 0.1
        out["rope_scaling"] = {
            "rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
            "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0, required=False)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0, required=False)),
            "mscale": mscale, "mscale_all_dim": mscale, "rope_theta": cfg["rope_theta"]}
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF file {path} uses rope scaling {scaling!r}, which specjax's deepseek2 reader does "
                         "not map (it maps yarn).")
    return out


def _gpt_oss_config(get, names: set, path: str, cfg: dict) -> dict:
    """gpt-oss's config fields from a ``gpt-oss`` file (llama.cpp's converter for GptOssForCausalLM),
    with what llama.cpp's graph hard-codes: the layer pattern and the SwiGLU constants."""
    layers = cfg["num_hidden_layers"]
    for i in range(layers):  # what the gpt_oss layout needs beyond a llama block, named by its GGUF name
        fused = f"blk.{i}.ffn_gate_up_exps.weight" in names
        need = ["attn_sinks.weight", "ffn_gate_inp.weight", "ffn_gate_inp.bias", "ffn_down_exps.weight",
                "ffn_down_exps.bias", *([f"ffn_gate_up_exps.{k}" for k in ("weight", "bias")] if fused else
                                        [f"ffn_{p}_exps.{k}" for p in ("gate", "up") for k in ("weight", "bias")])]
        missing = [f"blk.{i}.{n}" for n in need if f"blk.{i}.{n}" not in names]
        if missing:
            raise ValueError(f"GGUF file {path} lacks the tensor {missing[0]}, which every gpt-oss block has.")
    theta = cfg["rope_theta"]
    scaling = get("rope.scaling.type", None, required=False)
    if scaling == "yarn":  # as transformers' gpt-oss YaRN (its attention factor 0.1 ln(factor) + 1, llama.cpp's too)
        rope = {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
                "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
                "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0, required=False)),
                "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0, required=False)),
                "truncate": False, "rope_theta": theta}
    elif scaling in (None, "none"):  # named, or transformers' gpt_oss default YaRN would fill it in
        rope = {"rope_type": "default", "rope_theta": theta}
    else:
        raise ValueError(f"GGUF file {path} uses rope scaling {scaling!r}, which specjax's gpt-oss reader does "
                         "not map (it maps yarn).")
    return {
        "intermediate_size": int(get("expert_feed_forward_length")), "rope_scaling": rope,
        "num_local_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
        "sliding_window": int(get("attention.sliding_window")), "attention_bias": True,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")), **_GPT_OSS_SWIGLU,
    }


def _gemma_config(arch: str, get, cfg: dict) -> dict:
    """Gemma's config fields from its GGUF metadata and llama.cpp's fixed choices."""
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    out = {"head_dim": head_dim, "hidden_act": "gelu_pytorch_tanh"}
    if arch == "gemma":
        return out
    window = get("attention.sliding_window", None, required=False)
    layers = cfg["num_hidden_layers"]
    out.update(
        sliding_window=None if window is None else int(window),
        layer_types=["full_attention" if (i + 1) % _GLOBAL_EVERY[arch] == 0 else "sliding_attention"
                     for i in range(layers)],
        # llama.cpp scales scores by 1/sqrt(head_dim), by 1/sqrt(hidden / heads) for the 27B models.
        query_pre_attn_scalar=float(cfg["hidden_size"] // cfg["num_attention_heads"]
                                    if layers == _GEMMA_27B_LAYERS[arch] else head_dim),
    )
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = get(key, None, required=False)
            out[key] = None if value is None else float(value)
    else:
        out["rope_local_base_freq"] = _GEMMA3_LOCAL_ROPE_BASE
    return out


def _expert_name(model_type: str, layer: str, proj: str, expert: int) -> str:
    """The Hugging Face name of one expert's ``proj`` ("gate", "up", "down") matrix."""
    if model_type == "mixtral":
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{_MIXTRAL_EXPERT_NAMES[proj]}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"


def _hf_name(gguf_name: str, arch: str = "llama", model_type: str = "") -> Optional[str]:
    """The Hugging Face name of a GGUF tensor name (None: not a weight we use).

    ``model_type`` "mixtral" or "qwen3_moe": the router, and the per-expert
    matrices of files written before llama.cpp stacked them
    (``blk.N.ffn_gate.J.weight``); stacked experts are split in :func:`_tensor_iter`.
    """
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")
    moe = model_type in _MOE_MODEL_TYPES.values()
    if (moe and len(parts) == 5 and parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down")
            and parts[3].isdigit()):
        return _expert_name(model_type, parts[1], parts[2][4:], int(parts[3]))
    if parts[0] != "blk" or len(parts) != 4:
        return None
    layer, kind, suffix = parts[1], parts[2], parts[3]
    if moe and kind == "ffn_gate_inp":
        router = "block_sparse_moe.gate" if model_type == "mixtral" else "mlp.gate"
        return f"model.layers.{layer}.{router}.{suffix}"
    if moe and kind in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"):
        shared = {"ffn_gate_inp_shexp": "shared_expert_gate"}.get(kind, f"shared_expert.{kind[4:-6]}_proj")
        return f"model.layers.{layer}.mlp.{shared}.{suffix}"
    if arch == "deepseek2":  # multi-head latent attention, DeepSeek-V3's router and shared experts
        inner = _DEEPSEEK2_NAMES.get(kind)
        if inner is not None:
            return f"model.layers.{layer}.{inner}" + ("" if kind == "exp_probs_b" else f".{suffix}")
    if arch == "gpt-oss":  # the norm before the MLP, the sinks and the biased router
        inner = {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router",
                 "attn_sinks": "self_attn.sinks"}.get(kind)
        if inner is not None:
            return f"model.layers.{layer}.{inner}" + ("" if kind == "attn_sinks" else f".{suffix}")
    if arch in ("gemma2", "gemma3"):  # norms before and after attention and the MLP
        inner = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}.get(kind)
        if inner is not None:
            return f"model.layers.{layer}.{inner}.{suffix}"
    inner = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }.get(kind)
    if inner is None:
        return None
    return f"model.layers.{layer}.{inner}.{suffix}"


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation for a ``[heads * head_dim, ...]`` tensor.

    llama.cpp stores each head's rows as interleaved (even, odd) pairs; Hugging
    Face's rotary layout wants the two halves of the head one after the other.
    """
    dim = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, dim, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def permute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of :func:`unpermute_rotary` (Hugging Face -> llama.cpp layout)."""
    dim = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, 2, dim, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def _dequantize(gguf, tensor, path: str) -> np.ndarray:
    qtype = tensor.tensor_type
    try:
        out = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise ValueError(
            f"Tensor {tensor.name!r} in {path} is stored as {qtype.name}, which the installed "
            f"gguf package ({getattr(gguf, '__version__', '?')}) cannot dequantize. Re-quantize "
            "the model to Q8_0, Q4_0/Q4_1, a K-quant or F16, or upgrade gguf."
        ) from e
    return np.asarray(out, dtype=np.float32)


def _check_rope_freqs(reader, path: str) -> None:
    """llama.cpp stores Llama-3.1-style rope scaling as per-dimension frequency
    divisors (a ``rope_freqs.weight`` tensor), not as ``rope.scaling`` metadata;
    ignoring them would rotate long-range dimensions at the wrong frequencies."""
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight" and not np.all(np.asarray(tensor.data, np.float32) == 1.0):
            raise ValueError(
                f"GGUF file {path} scales its rotary frequencies per dimension (a rope_freqs.weight "
                "tensor, llama.cpp's form of Llama-3.1 rope scaling), which specjax's GGUF reader does "
                "not map; load the original Hugging Face checkpoint, whose config.json gives rope_scaling."
            )


def _tensor_iter(reader, cfg: dict, path: str):
    gguf = _require_gguf()
    arch = cfg["model_type"]
    reader_arch = _field(reader, "general.architecture")
    norm_shift = _NORM_SHIFT.get(reader_arch, 0.0)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def iterate():
        for tensor in reader.tensors:
            experts = _GPT_OSS_EXPERTS.fullmatch(tensor.name) if arch == "gpt_oss" else None
            if experts is not None:
                yield from _gpt_oss_experts(gguf, tensor, experts.group(1), experts.group(2), experts.group(3), path)
                continue
            stack = _EXPERT_STACK.fullmatch(tensor.name) if arch in _STACKED_EXPERT_TYPES else None
            if stack is not None:
                yield from _experts_of(gguf, tensor, arch, stack.group(1), stack.group(2), path)
                continue
            split = _KV_B_SPLIT.fullmatch(tensor.name) if reader_arch == "deepseek2" else None
            if split is not None:
                if split.group(2) == "k":  # read once, with its v half, as kv_b_proj
                    yield _kv_b_of(gguf, reader, split.group(1), cfg, path)
                continue
            name = _hf_name(tensor.name, reader_arch, arch)
            if name is None:
                if tensor.name == "rope_freqs.weight":  # all ones: no scaling (checked in read_gguf)
                    continue
                yield tensor.name, (lambda: None), tuple(int(d) for d in reversed(tensor.shape))
                continue

            def rows_in_hf_order(w, name=name):
                # Mixtral too: its file is a `llama` one, permuted as Llama's
                if reader_arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                    return unpermute_rotary(w, heads)
                if reader_arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                    return unpermute_rotary(w, kv_heads)
                return w

            def read(tensor=tensor, rows_in_hf_order=rows_in_hf_order, name=name):
                w = rows_in_hf_order(_dequantize(gguf, tensor, path))
                if norm_shift and name.endswith("norm.weight"):
                    w = w - norm_shift
                return w

            def blocks(tensor=tensor, rows_in_hf_order=rows_in_hf_order):
                # The stored bytes, one row of blocks per output ([N, row_bytes]).
                raw = np.asarray(tensor.data)
                return tensor.tensor_type.name, rows_in_hf_order(raw.reshape(raw.shape[0], -1).view(np.uint8))

            if len(tensor.shape) == 2:
                read.blocks = blocks
            shape = tuple(int(d) for d in reversed(tensor.shape))
            if name.endswith("shared_expert_gate.weight") and len(shape) == 1:  # llama.cpp keeps [H], HF [1, H]
                yield name, (lambda read=read: read().reshape(1, -1)), (1,) + shape
                continue
            yield name, read, shape

    return iterate


def _experts_of(gguf, tensor, model_type: str, layer: str, proj: str, path: str):
    """One stacked expert tensor as ``(hf_name, read, hf_shape)`` triples, one per
    expert: ``read()`` dequantizes that expert's rows only, and ``read.blocks()``
    gives its stored bytes (``[out, row_bytes]``), which a quantized load copies
    where its format holds the block type exactly."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # [E, out, in]
    for j in range(shape[0]):
        def read(j=j):
            return _dequantize(gguf, _Slice(tensor, j), path)

        def blocks(j=j):
            raw = np.asarray(tensor.data[j])
            return tensor.tensor_type.name, raw.reshape(raw.shape[0], -1).view(np.uint8)

        read.blocks = blocks
        yield _expert_name(model_type, layer, proj, j), read, shape[1:]


def _gpt_oss_experts(gguf, tensor, layer: str, proj: str, kind: str, path: str):
    """One gpt-oss expert stack (``[E, out, in]``) or bias stack (``[E, out]``) as the per-expert
    slices of Hugging Face's fused tensors that :func:`specjax._src.models.gpt_oss.expert_specs`
    names: each expert's gate and up ``[H, I]`` (``gate_up_proj[j][:, 0::2]`` / ``[:, 1::2]``, the
    columns the converter de-interleaved) and down ``[I, H]``; the bias stacks whole."""
    base = f"model.layers.{layer}.mlp.experts."
    shape = tuple(int(d) for d in reversed(tensor.shape))
    halves = {"gate": ("[:, 0::2]",), "up": ("[:, 1::2]",), "gate_up": ("[:, 0::2]", "[:, 1::2]"), "down": ()}[proj]
    if kind == "bias":
        if proj == "down":
            yield f"{base}down_proj_bias", (lambda: _dequantize(gguf, tensor, path)), shape
        for k, columns in enumerate(halves):  # fused: the gate half, then the up half
            def read_bias(k=k, n=len(halves)):
                w = _dequantize(gguf, tensor, path)
                return w[:, k * w.shape[1] // n:(k + 1) * w.shape[1] // n]
            yield f"{base}gate_up_proj_bias{columns}", read_bias, (shape[0], shape[1] // len(halves))
        return
    for j in range(shape[0]):
        def blocks(j=j):
            raw = np.asarray(tensor.data[j])
            return tensor.tensor_type.name, raw.reshape(raw.shape[0], -1).view(np.uint8)

        if proj == "down":
            def read(j=j):
                return _dequantize(gguf, _Slice(tensor, j), path).T

            read.blocks = blocks
            yield f"{base}down_proj[{j}]", read, (shape[2], shape[1])
        for k, columns in enumerate(halves):
            def read_half(j=j, k=k, n=len(halves)):
                w = _dequantize(gguf, _Slice(tensor, j), path)
                return w[k * w.shape[0] // n:(k + 1) * w.shape[0] // n].T

            if len(halves) == 1:
                read_half.blocks = blocks
            yield f"{base}gate_up_proj[{j}]{columns}", read_half, (shape[2], shape[1] // len(halves))


def _kv_b_of(gguf, reader, layer: str, cfg: dict, path: str):
    """Hugging Face's ``kv_b_proj`` (``[heads * (nope + v), kv_lora_rank]``, each head's key rows
    then its value rows) from the two tensors llama.cpp's converter splits it into for its
    absorbed attention: ``attn_k_b`` (``[heads, kv_lora_rank, nope]``, each head's key rows
    transposed) and ``attn_v_b`` (``[heads, v, kv_lora_rank]``)."""
    by_name = {t.name: t for t in reader.tensors if t.name in (f"blk.{layer}.attn_k_b.weight",
                                                               f"blk.{layer}.attn_v_b.weight")}
    for half in ("k", "v"):
        if f"blk.{layer}.attn_{half}_b.weight" not in by_name:
            raise ValueError(f"GGUF file {path} lacks the tensor blk.{layer}.attn_{half}_b.weight (the other half "
                             f"of blk.{layer}.attn_{'v' if half == 'k' else 'k'}_b.weight).")
    heads, rank = cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]

    def read():
        k_b = _dequantize(gguf, by_name[f"blk.{layer}.attn_k_b.weight"], path).reshape(heads, rank, nope)
        v_b = _dequantize(gguf, by_name[f"blk.{layer}.attn_v_b.weight"], path).reshape(heads, v, rank)
        return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(heads * (nope + v), rank)

    return f"model.layers.{layer}.self_attn.kv_b_proj.weight", read, (heads * (nope + v), rank)


class _Slice(NamedTuple):
    """Expert ``j`` of a stacked GGUF tensor, as :func:`_dequantize` reads a tensor."""

    whole: Any
    j: int

    @property
    def data(self):
        return self.whole.data[self.j]

    @property
    def tensor_type(self):
        return self.whole.tensor_type

    @property
    def name(self):
        return self.whole.name


def _with_special_tokens(tokenizer, reader, tokens: list[str]):
    """``tokenizer`` with the file's control tokens special, its user-defined
    ones added (both matched whole in text), and BOS prepended where the file
    says so."""
    from tokenizers import AddedToken, processors

    types = _field(reader, "tokenizer.ggml.token_type") or [0] * len(tokens)
    special = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == _CONTROL]
    added = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    if special:
        tokenizer.add_special_tokens(special)
    if added:
        tokenizer.add_tokens(added)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        token = tokens[int(bos)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{token} $A", pair=f"{token} $A {token} $B", special_tokens=[(token, int(bos))]
        )
    return tokenizer


def _byte_level_tokenizer(reader, path: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    merges = _field(reader, "tokenizer.ggml.merges") or []  # none: a bytes-only vocabulary
    vocab = {token: i for i, token in enumerate(tokens)}
    try:
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    except Exception as e:  # tokenizers raises a bare Exception
        raise ValueError(f"GGUF file {path} has an inconsistent BPE vocabulary/merges: {e}") from e
    tokenizer = Tokenizer(bpe)
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    known = (*_SPLITS, *_DIGIT_SPLIT, *_GPT2_SPLIT)
    if pre not in known:
        # Another regex would split text into other pieces, so every id sequence could differ.
        raise ValueError(
            f"GGUF file {path} uses the pre-tokenizer {pre!r}, which specjax's GGUF reader does not "
            f"know (known: {', '.join(known)}); load the original Hugging Face checkpoint, whose "
            "tokenizer.json says how to split text."
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLITS)
    if pre in _SPLITS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [*(pre_tokenizers.Split(Regex(split), behavior="isolated")
               for split in ((_SPLITS[pre],) if isinstance(_SPLITS[pre], str) else _SPLITS[pre])), byte_level]
        )
    elif pre in _DIGIT_SPLIT:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    return _with_special_tokens(tokenizer, reader, tokens)


def _merges_in_order(tokens: list[str], rank: dict) -> list[tuple[str, str]]:
    """A SentencePiece BPE vocabulary's merges, which GGUF files do not store:
    every split of a token into two tokens of the vocabulary, best first by
    the merged token's ``rank`` (then the longer left piece)."""
    index = {token: i for i, token in enumerate(tokens)}
    found = []
    for token in tokens:
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in index and token[k:] in index]
        pairs.sort(key=lambda pair: (index[pair[0]], index[pair[1]]))
        found.extend((rank[token], len(left), len(right), left, right) for left, right in pairs)
    found.sort(key=lambda m: m[:3], reverse=True)
    return [(left, right) for *_, left, right in found]


def _gemma_tokenizer(reader, path: str):
    """Gemma's SentencePiece BPE (byte fallback, spaces as "▁", no prefix
    space) from the token list alone: the file stores no merges, and Gemma's
    scores do not follow its merge order, which is the order of the tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    # A token of spaces only is stored with real spaces; the model sees "▁"s.
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    try:
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                         merges=_merges_in_order(tokens, {t: -i for i, t in enumerate(tokens)}),
                         unk_token=None if unk is None else tokens[int(unk)], fuse_unk=True, byte_fallback=True)
    except Exception as e:  # tokenizers raises a bare Exception
        raise ValueError(f"GGUF file {path} has an inconsistent SentencePiece vocabulary: {e}") from e
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return _with_special_tokens(tokenizer, reader, tokens)


def _tokenizer(reader, path: str):
    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        return None
    if kind == "llama" and _field(reader, "general.architecture") in _GEMMA_ARCHITECTURES:
        if _field(reader, "tokenizer.ggml.tokens") is None:
            raise ValueError(f"GGUF file {path} names a SentencePiece tokenizer but lacks its token list "
                             "(the metadata key tokenizer.ggml.tokens).")
        return _gemma_tokenizer(reader, path)
    if kind != "gpt2":
        raise ValueError(
            f"GGUF file {path} has a {kind!r} tokenizer; specjax builds byte-level BPE ('gpt2') "
            "tokenizers, and Gemma's SentencePiece one, from GGUF metadata. Load the model from its "
            "Hugging Face directory instead."
        )
    if _field(reader, "tokenizer.ggml.tokens") is None:
        raise ValueError(f"GGUF file {path} names a {kind!r} tokenizer but lacks its token list "
                         "(the metadata key tokenizer.ggml.tokens).")
    return _byte_level_tokenizer(reader, path)


def file_quantization(path: str) -> Optional[str]:
    """The quantization nearest a GGUF file's own (``specjax._src.kernels.quant``):
    the format of its most common matrix type for the attention and MLP
    matrices, the token embedding's (or the output head's) for the vocabulary
    ones; None for a float file."""
    from collections import Counter

    from specjax._src.kernels import quant

    gguf = _require_gguf()
    reader = gguf.GGUFReader(path)
    matrices = Counter(t.tensor_type.name for t in reader.tensors
                       if t.name.startswith("blk.") and len(t.shape) == 2)
    vocab = {t.name: t.tensor_type.name for t in reader.tensors}
    weights = quant.gguf_format(matrices.most_common(1)[0][0]) if matrices else None
    embedding_type = vocab.get("output.weight") or vocab.get("token_embd.weight")
    embedding = quant.gguf_format(embedding_type) if embedding_type else None
    if weights is None and embedding is None:
        return None
    weights = weights or quant.Format("int8", 32)
    return str(quant.Quantization(weights, embedding or weights))


def read_gguf(path: str) -> GGUFCheckpoint:
    """Reads a GGUF file's metadata and prepares its tensors for streaming.

    Raises:
      ValueError: not a readable GGUF file, an architecture or tokenizer specjax
        does not map, or missing metadata (each named).
    """
    gguf = _require_gguf()
    path = os.fspath(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError, ...
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}).") from e
    cfg = _config(reader, path)
    end_of_turn = _gemma_end_of_turn(reader)
    if end_of_turn is not None:
        # llama.cpp ends generation at <end_of_turn> too (an end-of-generation token by
        # its text), as google/gemma-3-*-it's generation_config.json does: [<eos>, <end_of_turn>]
        eos = cfg["eos_token_id"]
        cfg["eos_token_id"] = [eos, end_of_turn] if eos not in (None, end_of_turn) else end_of_turn
    return GGUFCheckpoint(
        hf_config=cfg,
        tensors=_tensor_iter(reader, cfg, path),
        # a stacked expert tensor is read as one tensor per expert
        # (and a deepseek2 file's attn_k_b + attn_v_b as one kv_b_proj)
        num_tensors=sum(2 * int(t.shape[-1]) if t.name.endswith("_gate_up_exps.weight") else
                        2 if t.name.endswith("_gate_up_exps.bias") else
                        int(t.shape[-1]) if _EXPERT_STACK.fullmatch(t.name) else
                        0 if re.fullmatch(r"blk\.\d+\.attn_v_b\.weight", t.name) else 1 for t in reader.tensors),
        tokenizer=_tokenizer(reader, path),
        chat_template=_chat_template(reader, path, end_of_turn is not None),
    )


def _gemma_end_of_turn(reader) -> Optional[int]:
    """The id of ``<end_of_turn>`` in a Gemma file whose vocabulary has Gemma's two
    turn tokens (``<start_of_turn>``, ``<end_of_turn>``); else None."""
    if _field(reader, "general.architecture") not in _GEMMA_ARCHITECTURES:
        return None
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    if "<start_of_turn>" not in tokens or "<end_of_turn>" not in tokens:
        return None
    return tokens.index("<end_of_turn>")


def _chat_template(reader, path: str, gemma_turns: bool) -> Optional[str]:
    """The file's own chat template; for a Gemma file without one whose vocabulary
    has Gemma's turn tokens, Gemma's (:data:`specjax._src.models.chat.GEMMA_CHAT_TEMPLATE`),
    marked as specjax's at its start and logged. Any other file without one: None."""
    from specjax._src.models import chat

    template = _field(reader, "tokenizer.chat_template")
    if template is not None or not gemma_turns:
        return template
    # Released Gemma GGUFs without a template are often the pretrained (not -it) models:
    # the template gives them Gemma's turn format, not instruction following.
    _log.info("%s carries no chat template; using specjax's built-in Gemma template "
              "(google/gemma-3-*-it's).", path)
    return chat.builtin_gemma_template(os.path.basename(path))
