"""The building blocks every decoder layout shares: norms, dense layers
(float or quantized), activations and the dense MLP.

:mod:`~specjax._src.models.decoder` assembles them into attention blocks and
:mod:`~specjax._src.models.moe` into mixtures of experts.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax._src.kernels import quant
from specjax._src.kernels import cpu_matmul
from specjax._src.models.lm import Array
from specjax._src.models.config import ModelConfig

INIT_STD = 0.02  # Hugging Face's initializer_range default for all five families.


def activation(name: str):
    if name == "silu":
        return jax.nn.silu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: jax.nn.gelu(x, approximate=True)
    return lambda x: jax.nn.gelu(x, approximate=False)


class RMSNorm(nn.Module):
    """HF-style RMSNorm: normalise in float32, cast back, then scale.

    ``gemma``: Gemma's form, ``y * (1 + scale)`` all in float32, then cast
    back (the stored weight is the offset from 1).
    """

    eps: float
    dtype: Any
    gemma: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.initializers.zeros if self.gemma else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.gemma:
            return (y * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
        return scale * y.astype(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with bias (GPT-2), statistics in float32."""

    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x: Array) -> Array:
        h = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (h,), self.dtype)
        bias = self.param("bias", nn.initializers.zeros, (h,), self.dtype)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def norm(config: ModelConfig, name: str) -> nn.Module:
    if config.is_gpt2:
        return LayerNorm(eps=config.norm_eps, dtype=jnp.dtype(config.dtype), name=name)
    return RMSNorm(eps=config.norm_eps, dtype=jnp.dtype(config.dtype), gemma=config.is_gemma, name=name)


def float_embed(rows: int, features: int, dtype, name: str) -> nn.Embed:
    """A float ``[rows, features]`` table in ``dtype`` (token or GPT-2 position embeddings)."""
    return nn.Embed(
        rows, features, dtype=dtype, param_dtype=dtype, embedding_init=nn.initializers.normal(INIT_STD), name=name
    )


def dense(config: ModelConfig, features: int, use_bias: bool, name: str, matmul: str = "auto") -> nn.Module:
    dtype = jnp.dtype(config.dtype)
    if config.quantization is not None:
        return quant.QuantDense(features, config.quant.weights, use_bias, dtype, matmul, name=name)
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=nn.initializers.normal(INIT_STD),
        dot_general=functools.partial(cpu_matmul.dense_dot_general, matmul_mode=matmul),
        name=name,
    )


class MLP(nn.Module):
    """The dense feed-forward layer: gated (``act(x W_gate) * x W_up`` then ``W_down``) or,
    for GPT-2, ``fc`` then ``proj``. ``width``: the inner width when not
    ``config.intermediate_size`` (a mixture of experts' shared expert)."""

    config: ModelConfig
    matmul: str = "auto"
    width: Optional[int] = None

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        act = activation(cfg.activation)
        inner = self.width or cfg.intermediate_size
        if cfg.is_gpt2:
            h = act(dense(cfg, inner, True, "fc", self.matmul)(x))
            return dense(cfg, cfg.hidden_size, True, "proj", self.matmul)(h)
        gate = dense(cfg, inner, cfg.mlp_bias, "gate", self.matmul)(x)
        up = dense(cfg, inner, cfg.mlp_bias, "up", self.matmul)(x)
        return dense(cfg, cfg.hidden_size, cfg.mlp_bias, "down", self.matmul)(act(gate) * up)
