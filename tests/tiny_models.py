"""A random Decoder target and a one-layer draft that agrees with it part of the time.

Shared by the decode, PAD, certificate and sharding tests. Random init gives
near-uniform logits, so the LM head is scaled up (peaked distributions, no
greedy near-ties); the draft is the target's first layer with a perturbed head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import Decoder, Model, ModelConfig


def llama_config(**overrides) -> ModelConfig:
    """The tests' small Llama: vocabulary 96, width 32, 2 layers, GQA 4/2."""
    base = dict(model_type="llama", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128)
    return ModelConfig(**{**base, **overrides})


def peaked_target_and_draft(config: ModelConfig) -> tuple[Model, Model]:
    """``(target, draft)``: the target with its head x30, the draft = its layer 0
    and that head plus 0.3 std of noise."""
    params = Decoder(config).init(jax.random.key(0))
    params["lm_head"] = params["lm_head"] * 30.0
    draft_params = {k: v for k, v in params.items() if k != "layer_1"}
    head = draft_params["lm_head"]
    draft_params["lm_head"] = head + 0.3 * jnp.std(head) * jax.random.normal(jax.random.key(5), head.shape)
    return Model(params, Decoder(config)), Model(draft_params, Decoder(config.replace(num_layers=1)))
