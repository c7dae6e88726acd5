"""Static configuration of the decoder family (Llama, Mistral, Qwen2, Qwen3, GPT-2, Gemma 1/2/3,
the mixtures of experts, DeepSeek-V3 and gpt-oss).

A frozen, hashable dataclass: it is closed over by jitted functions as a
static, so two models with equal configs share compiled programs.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma", "gemma2", "gemma3_text", "mixtral",
                         "qwen2_moe", "qwen3_moe", "dots1", "deepseek_v3", "gpt_oss")
# Layouts whose MLP is a mixture of experts (num_experts > 0).
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "dots1", "deepseek_v3", "gpt_oss")
# Layouts whose attention is multi-head latent attention (``kv_lora_rank`` set).
LATENT_ATTENTION_MODEL_TYPES = ("deepseek_v3",)
ROPE_TYPES = ("llama3", "linear", "yarn")
# Layouts that take YaRN rope scaling (``rope_type: yarn``).
YARN_MODEL_TYPES = LATENT_ATTENTION_MODEL_TYPES + ("gpt_oss",)
# How a router turns its logits into expert scores: a softmax over all experts, sigmoids, or a
# softmax over the top k logits only (gpt-oss).
ROUTER_SCORES = ("softmax", "sigmoid", "topk_softmax")
GEMMA_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
# Per-layer attention kinds (``ModelConfig.layer_types``), named as in Hugging Face configs.
LAYER_TYPES = ("sliding_attention", "full_attention")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# "gelu_new" / "gelu_pytorch_tanh" are the tanh approximation GPT-2 uses; "gelu" is exact.
# "swiglu_oai": gpt-oss's clamped SwiGLU of its experts (``swiglu_alpha``, ``swiglu_limit``).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu", "swiglu_oai")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rope scaling: ``rope_type`` ``"llama3"`` (Llama 3.1: low frequencies
    divided by ``factor``, high ones kept, a blend between), ``"linear"``
    (every frequency divided by ``factor``: positions interpolated, as Gemma 3's
    larger models do on their global layers; the other fields unused) or
    ``"yarn"`` (YaRN, arXiv:2309.00071, as DeepSeek-V2/V3 use it: frequencies
    that turn fewer than ``beta_slow`` times over ``original_max_position_embeddings``
    divided by ``factor``, those that turn more than ``beta_fast`` times kept, a
    linear ramp between (its ends rounded outwards when ``truncate``); cos and sin
    times ``attention_factor`` (None: from ``factor``, ``mscale`` and
    ``mscale_all_dim`` as transformers infers it); and with ``mscale_all_dim``,
    DeepSeek's softmax scale times ``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2``.
    Only ``YARN_MODEL_TYPES`` (``deepseek_v3``, ``gpt_oss``) take yarn)."""

    factor: float
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    original_max_position_embeddings: Optional[int] = None
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"Unsupported rope scaling type {self.rope_type!r}; use one of {', '.join(ROPE_TYPES)}.")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}.")
        if self.rope_type == "llama3" and None in (self.low_freq_factor, self.high_freq_factor,
                                                    self.original_max_position_embeddings):
            raise ValueError("llama3 rope scaling needs low_freq_factor, high_freq_factor and "
                             "original_max_position_embeddings.")
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            raise ValueError("yarn rope scaling needs original_max_position_embeddings.")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything that decides the decoder's shapes and layout.

    Attributes:
      model_type: one of ``SUPPORTED_MODEL_TYPES``; the layout follows from it.
      vocab_size: rows of the embedding table (may include padding rows).
      hidden_size: model width H.
      num_layers: number of decoder blocks.
      num_heads: query heads.
      num_kv_heads: key/value heads (GQA when < num_heads).
      head_dim: per-head width (Qwen3 sets it explicitly; else H / num_heads).
      intermediate_size: MLP width.
      max_position_embeddings: positions the model supports (GPT-2: table size).
      rope_theta: RoPE base (rotary layouts only).
      rope_scaling: a ``RopeScaling`` (Llama 3, linear or YaRN), or None.
      norm_eps: RMSNorm / LayerNorm epsilon.
      tie_word_embeddings: the LM head reuses the embedding table.
      attention_bias: q/k/v projections carry biases (Qwen2; GPT-2 has all biases).
      attention_out_bias: the attention output projection carries a bias (Llama
        and Qwen3 with ``attention_bias=True`` in their HF config; not Qwen2).
      mlp_bias: the gated MLP's projections carry biases (Llama ``mlp_bias``).
      qk_norm: RMSNorm on q and k per head (Qwen3).
      sliding_window: attend to at most this many previous positions (Mistral), or None.
      activation: MLP activation: "silu" (gated MLP) or "gelu_new" (GPT-2 MLP).
      bos_token_id / eos_token_id / pad_token_id: from the HF config, if set.
        ``eos_token_id`` is the first one when the HF config lists several.
      eos_token_ids: every end-of-sequence id (Llama 3 lists several); ``()``
        when none is set.
      dtype: parameter and compute dtype name: "float32" or "bfloat16"
        (with ``quantization``: the dtype of the norms, biases and activations)
        ("float16" is accepted for checkpoints stored that way).
      head_vocab_size: if set, the LM head scores only this many tokens (a
        draft's reduced, frequency-ranked vocabulary): an untied ``lm_head
        [H, head_vocab_size]`` plus ``head_vocab_ids [head_vocab_size]``
        mapping its columns to token ids. Logits come back over the full
        ``vocab_size`` with ``-inf`` for every other token, so the model pairs
        with a full-vocabulary target and speculative sampling stays lossless
        (the residual ``max(0, p - q)`` covers the tokens the draft never proposes).
      query_pre_attn_scalar: attention scores are scaled by its ``** -0.5``
        (Gemma 2/3); None: ``head_dim ** -0.5``.
      attn_logit_softcapping / final_logit_softcapping: ``c * tanh(x / c)`` on
        the attention scores / the logits (Gemma 2), or None.
      layer_types: one of ``LAYER_TYPES`` per layer (Gemma 2/3): only
        ``"sliding_attention"`` layers use ``sliding_window``. ``()``: every
        layer does (Mistral's layout).
      rope_local_theta: RoPE base of the sliding layers (Gemma 3's
        ``rope_local_base_freq``; never scaled); None: ``rope_theta``.
      num_experts / num_experts_per_tok: a mixture-of-experts MLP (Mixtral,
        Qwen3-MoE): the router's softmax picks the top ``num_experts_per_tok``
        of ``num_experts`` gated MLPs of width ``moe_intermediate_size``
        (default ``intermediate_size``), their weights renormalised to sum to 1
        when ``norm_topk_prob``. 0: a dense MLP.
      shared_expert_intermediate_size: a shared expert (Qwen2-MoE) every
        token goes through beside its routed ones, a gated MLP of this width;
        ``shared_expert_gate``: its output scaled by ``sigmoid(x W)``.
      dense_mlp_layers: layers of a mixture of experts whose MLP is dense
        (``intermediate_size`` wide; Qwen2-MoE's ``mlp_only_layers``).
      router_scores: ``"softmax"`` or ``"sigmoid"`` (DeepSeek-V3's routing,
        ``dots1``): each expert's score. ``router_bias``: a learned per-expert
        bias added to the scores for the choice only (DeepSeek-V3's
        ``e_score_correction_bias``). ``router_groups`` / ``router_top_groups``:
        the experts split into groups, the choice limited to the
        ``router_top_groups`` groups whose two best scores sum highest.
        ``routed_scaling_factor``: the chosen weights' factor, after any
        renormalisation. ``"topk_softmax"`` (gpt-oss): the top ``k`` raw logits
        chosen, their weights a softmax over those ``k`` logits only.
        ``router_logit_bias``: the router is a linear layer with a bias
        (``router/bias [E]``, gpt-oss), added to the logits.
      expert_bias: each expert's three products add a bias (gpt-oss):
        ``experts_gate_bias`` / ``experts_up_bias [E, I]``, ``experts_down_bias [E, H]``.
      swiglu_alpha / swiglu_limit: the ``"swiglu_oai"`` activation's (gpt-oss's
        experts): ``gate = min(gate, limit)``, ``up = clip(up, -limit, limit)``,
        ``h = (up + 1) * gate * sigmoid(alpha * gate)``; ``swiglu_limit`` None: no clamp.
      attention_sinks: a learned logit per query head (``attn/sinks [num_heads]``,
        gpt-oss) joins each query's softmax denominator and is dropped after.
      quantization: how the matrices are stored (``specjax._src.kernels.quant``):
        ``"int8"``, ``"q4"``, ``"q4,embedding=int8/32"``, ...; None: in ``dtype``.
      kv_lora_rank: multi-head latent attention (DeepSeek-V2/V3, ``deepseek_v3``)
        when set: keys and values come from a ``kv_lora_rank``-wide latent
        (``kv_a`` then ``kv_a_norm`` then ``kv_b``), queries through a
        ``q_lora_rank``-wide one (``q_a``, ``q_a_norm``, ``q_b``; None: one
        ``q`` projection). Each head's query and key are ``qk_nope_head_dim``
        unrotated features then ``qk_rope_head_dim`` rotated ones (the key's
        rotated part one head shared by all), its value ``v_head_dim`` wide.
        The cache holds the per-head keys and the values zero-padded to the
        same width: ``head_dim = qk_nope_head_dim + qk_rope_head_dim``,
        ``num_kv_heads = num_heads``. ``rope_interleave``: the rotated features
        come in interleaved pairs (DeepSeek's checkpoints) rather than halves.

    The Gemma layouts (``GEMMA_MODEL_TYPES``) also scale the embeddings by
    ``sqrt(hidden_size)``, use ``(1 + weight)`` RMSNorms and a GeGLU MLP;
    Gemma 2/3 add post-attention and post-MLP norms (``sandwich_norms``).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: Optional[int] = None
    activation: str = "silu"
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    head_vocab_size: Optional[int] = None
    query_pre_attn_scalar: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: Optional[float] = None
    quantization: Optional[str] = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: Optional[int] = None
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: Optional[int] = None
    shared_expert_gate: bool = False
    dense_mlp_layers: tuple[int, ...] = ()
    router_scores: str = "softmax"
    router_bias: bool = False
    router_groups: int = 1
    router_top_groups: int = 1
    routed_scaling_factor: float = 1.0
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    router_logit_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: Optional[float] = 7.0
    attention_sinks: bool = False

    def __post_init__(self):
        if self.quantization is not None:
            from specjax._src.kernels import quant

            object.__setattr__(self, "quantization", str(quant.parse_quantization(self.quantization)))
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"Unsupported model_type {self.model_type!r}; specjax supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}."
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})."
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"Unsupported dtype {self.dtype!r}; use one of {', '.join(SUPPORTED_DTYPES)}."
            )
        if self.activation not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"Unsupported activation {self.activation!r}; specjax supports "
                f"{', '.join(SUPPORTED_ACTIVATIONS)}."
            )
        if self.head_vocab_size is not None and not 0 < self.head_vocab_size <= self.vocab_size:
            raise ValueError(
                f"head_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.head_vocab_size}."
            )
        if (self.num_experts > 0) != (self.model_type in MOE_MODEL_TYPES):
            raise ValueError(f"{self.model_type} {'needs' if self.model_type in MOE_MODEL_TYPES else 'has no'} "
                             f"experts (num_experts={self.num_experts}).")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}.")
        if not isinstance(self.dense_mlp_layers, tuple):
            object.__setattr__(self, "dense_mlp_layers", tuple(int(i) for i in self.dense_mlp_layers))
        if (self.shared_expert_intermediate_size or self.dense_mlp_layers) and not self.num_experts:
            raise ValueError("shared_expert_intermediate_size and dense_mlp_layers need a mixture of experts "
                             "(num_experts > 0).")
        if self.router_scores not in ROUTER_SCORES:
            raise ValueError(f"router_scores must be one of {', '.join(ROUTER_SCORES)}, got {self.router_scores!r}.")
        if self.num_experts and (self.num_experts % self.router_groups
                                 or not 1 <= self.router_top_groups <= self.router_groups
                                 or self.num_experts_per_tok > self.router_top_groups * self.num_experts
                                 // self.router_groups):
            raise ValueError(f"router_groups={self.router_groups} must divide num_experts={self.num_experts}, and "
                             f"router_top_groups={self.router_top_groups} groups (of at most router_groups) must "
                             f"hold num_experts_per_tok={self.num_experts_per_tok} experts.")
        if any(not 0 <= i < self.num_layers for i in self.dense_mlp_layers):
            raise ValueError(f"dense_mlp_layers must name layers in [0, {self.num_layers}), "
                             f"got {self.dense_mlp_layers}.")
        self._check_latent_attention()
        if self.activation == "swiglu_oai" and (not self.num_experts or self.dense_mlp_layers
                                                or self.shared_expert_intermediate_size):
            raise ValueError("activation 'swiglu_oai' is gpt-oss's expert activation: it needs a mixture of "
                             "experts with no dense layers and no shared expert.")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be positive or None, got {self.swiglu_limit}.")
        if self.expert_bias and not self.num_experts:
            raise ValueError("expert_bias needs a mixture of experts (num_experts > 0).")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}.")
        if not isinstance(self.layer_types, tuple):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types:
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if bad:
                raise ValueError(
                    f"layer_types has unknown entry {bad[0]!r}; each layer must be one of "
                    f"{', '.join(LAYER_TYPES)}."
                )
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries but the model has "
                    f"{self.num_layers} layers (num_hidden_layers)."
                )

    def _check_latent_attention(self) -> None:
        """Raises ``ValueError`` naming the field unless the latent-attention fields agree."""
        latent = self.kv_lora_rank is not None
        if latent != (self.model_type in LATENT_ATTENTION_MODEL_TYPES):
            raise ValueError(f"{self.model_type} {'has no' if latent else 'needs'} multi-head latent attention "
                             f"(kv_lora_rank={self.kv_lora_rank}).")
        if (self.rope_scaling is not None and self.rope_scaling.rope_type == "yarn"
                and self.model_type not in YARN_MODEL_TYPES):
            raise ValueError("rope scaling type 'yarn' is supported for multi-head latent attention (deepseek_v3) "
                             f"and gpt_oss only, not {self.model_type}.")
        if not latent:
            return
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"multi-head latent attention needs {name} >= 1, got {getattr(self, name)!r}.")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be >= 1 or None, got {self.q_lora_rank}.")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rotated in pairs), got {self.qk_rope_head_dim}.")
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if (self.head_dim, self.num_kv_heads) != (qk, self.num_heads):
            raise ValueError(f"multi-head latent attention caches one key per head: head_dim must be "
                             f"qk_nope_head_dim + qk_rope_head_dim = {qk} and num_kv_heads num_heads = "
                             f"{self.num_heads}, got {self.head_dim} and {self.num_kv_heads}.")
        if self.v_head_dim > qk:  # values share the keys' cache width, zero-padded up to it
            raise ValueError(f"v_head_dim={self.v_head_dim} wider than the query/key head ({qk}) is not "
                             "supported: the cache holds values padded to the key width.")

    @property
    def latent_attention(self) -> bool:
        """Whether attention is multi-head latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    @property
    def rope_dim(self) -> int:
        """The rotated width of a head: ``qk_rope_head_dim`` under latent attention, else ``head_dim``."""
        return self.qk_rope_head_dim if self.latent_attention else self.head_dim

    @property
    def quant(self):
        """The parsed ``quantization`` (a ``specjax._src.kernels.quant.Quantization``), or None."""
        if self.quantization is None:
            return None
        from specjax._src.kernels import quant

        return quant.parse_quantization(self.quantization)

    @property
    def has_reduced_head(self) -> bool:
        return self.head_vocab_size is not None

    @property
    def is_gpt2(self) -> bool:
        return self.model_type == "gpt2"

    @property
    def is_gemma(self) -> bool:
        return self.model_type in GEMMA_MODEL_TYPES

    @property
    def sandwich_norms(self) -> bool:
        """Norms after attention and after the MLP as well as before (Gemma 2/3)."""
        return self.model_type in ("gemma2", "gemma3_text")

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends through ``sliding_window`` (False without one)."""
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of ``layer``, or None for full attention."""
        return self.sliding_window if self.is_sliding(layer) else None

    def representative_layer(self, layer: int) -> int:
        """The first layer built as ``layer`` is: the same attention kind (its window and
        RoPE base) and the same MLP kind. Layers with one representative compute the
        same function of their own weights."""
        def kind(i: int):
            return (self.is_sliding(i), self.layer_types[i] if self.layer_types else None, self.is_moe_layer(i))

        return next(i for i in range(layer + 1) if kind(i) == kind(layer))

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return bool(self.num_experts) and layer not in self.dense_mlp_layers

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The fields as JSON-able values (what checkpoints store); :meth:`from_dict` reads them back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> "ModelConfig":
        """The config whose :meth:`to_dict` gave ``fields``."""
        fields = dict(fields)
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        fields["eos_token_ids"] = tuple(fields.get("eos_token_ids") or ())
        fields["layer_types"] = tuple(fields.get("layer_types") or ())
        fields["dense_mlp_layers"] = tuple(fields.get("dense_mlp_layers") or ())
        return cls(**fields)
