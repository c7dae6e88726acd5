"""Products with quantized weights, on raw arrays: the CPU kernel's binding and XLA's formulation.

Every function here takes one ``[N, K]`` matrix as its stored arrays (the
layout of :mod:`specjax._src.kernels.quant`; a GGUF file's) and rows ``x[M, K]``, and
returns ``x @ W^T`` as ``[M, N]`` float32, ``W = q * d (+ m)``:

* ``qweight``: int8 ``[N, K]`` (``int8``), or uint8 ``[N, K/2]`` (``q4``: a
  32-input block is 16 bytes, byte ``i`` holding input ``i`` in its low nibble
  and input ``i + 16`` in its high one);
* ``qscale``: float16 ``[N, K/G]``, one ``d`` per group of ``G`` inputs
  (``G = K``: one per output row);
* ``qmin``: float16 ``[N, K/G]`` (``q4`` only), the ``m`` added to each weight.

:func:`cpu_qmatmul` calls the few-row kernels of ``cpu_qmatmul.cc`` (built and
registered by :mod:`specjax._src.kernels.cpu_matmul`). :func:`xla_qmatmul` is the formulation for a GPU or a TPU:
the dot reads the int8 (or 4-bit) weights themselves, converted to the
activations' dtype as its operand, where the device's compiler can fuse the
convert into the product, and the scales multiply the dot's output, never a
dequantized weight matrix. A grouped format is a dot with the group axis as a
batch axis (``[G, M, N]`` partial products), each group's partial scaled by
its ``d`` and summed; a 4-bit minimum adds ``m`` times the group's sum of
``x``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax._src.kernels import cpu_matmul, platforms

Array = jax.Array

#: Inputs per 4-bit block (16 bytes).
Q4_BLOCK = 32


def cpu_qmatmul(x: Array, qweight: Array, qscale: Array, qmin: Array | None = None) -> Array:
    """``x[M, K] @ W^T`` on the CPU kernel (float32 rows, any ``M``); ``qmin`` given: 4-bit.

    The caller makes sure the kernels are loaded (:func:`cpu_matmul.ensure_loaded`)."""
    kind = "int8" if qmin is None else "q4"
    call = jax.ffi.ffi_call(
        cpu_matmul.ffi_target(kind),
        jax.ShapeDtypeStruct((x.shape[0], qweight.shape[0]), jnp.float32),
        vmap_method="sequential",
    )
    return call(x, qweight, qscale, *(() if qmin is None else (qmin,)))


def cpu_qmatmul_expert(x: Array, qweight: Array, qscale: Array, qmin: Array | None, index: Array) -> Array:
    """``x[M, K] @ W[index]^T`` for one matrix of stacked arrays (``[E, N, ...]`` each), on the CPU
    kernel that reads it inside the stack; the index is clamped into the stack."""
    kind = "int8_expert" if qmin is None else "q4_expert"
    call = jax.ffi.ffi_call(
        cpu_matmul.ffi_target(kind),
        jax.ShapeDtypeStruct((x.shape[0], qweight.shape[1]), jnp.float32),
        vmap_method="sequential",
    )
    return call(x, qweight, qscale, *(() if qmin is None else (qmin,)), jnp.asarray(index, jnp.int32))


def unpack_q4(qweight: Array) -> Array:
    """uint8 ``[..., N, K/2]`` blocks as 4-bit values ``[..., N, K/32, 16, 2]``, without moving a byte:
    element ``[n, b, j, h]`` is input ``32 b + 16 h + j`` (a bitcast to ``uint4``, low nibble first)."""
    *lead, n, half = qweight.shape
    nibbles = jax.lax.bitcast_convert_type(qweight, jnp.uint4)  # [..., N, K/2, 2]
    return nibbles.reshape(*lead, n, half // (Q4_BLOCK // 2), Q4_BLOCK // 2, 2)


def _dot(x: Array, w: Array, dims) -> Array:
    """``dot_general`` of activations and quantized integers, float32 out: on a TPU with the integers
    as its operand (it takes bf16 x int8 / uint4), elsewhere with them converted to the activations'
    dtype next to the dot, where the compiler can fuse the convert into the product."""

    def mixed(a, b):
        return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    def converted(a, b):
        return jax.lax.dot_general(a, b.astype(a.dtype), dims, preferred_element_type=jnp.float32)

    return platforms.platform_dependent(x, w, tpu=mixed, default=converted)


def xla_qmatmul(x: Array, qweight: Array, qscale: Array, qmin: Array | None = None) -> Array:
    """``x[M, K] @ W^T`` as ``[M, N]`` float32 by XLA, reading the quantized weights in the dot."""
    m, k = x.shape
    n, groups = qscale.shape
    group = k // groups
    d = qscale.astype(jnp.float32)
    if qmin is None and groups == 1:  # per channel: the scale factors out of the whole dot
        return _dot(x, qweight, (((1,), (1,)), ((), ()))) * d[:, 0]
    if qmin is None:
        xg = x.reshape(m, groups, group)
        wg = qweight.reshape(n, groups, group)
        contract = ((2,), (2,))
    else:
        # x in the blocks' nibble order: [M, G, blocks per group, 16, 2], inputs j and j + 16 side by side.
        blocks = group // Q4_BLOCK
        xg = x.reshape(m, groups, blocks, 2, Q4_BLOCK // 2).swapaxes(-1, -2)
        wg = unpack_q4(qweight).reshape(n, groups, blocks, Q4_BLOCK // 2, 2)
        contract = ((2, 3, 4), (2, 3, 4))
    # One partial product per group (the group axis a batch axis), scaled by its d: [G, M, N].
    partial = _dot(xg, wg, (contract, ((1,), (1,))))
    # Elementwise and a sum, not a dot: a TPU's default precision would round f32 dot operands to bf16.
    y = (partial * d.T[:, None, :]).sum(0)
    if qmin is not None:  # sum_k x_k (q_k d + m) = d (x . q) + m sum_k x_k, per group
        sums = x.astype(jnp.float32).reshape(m, groups, group).sum(-1)
        y = y + jax.lax.dot_general(
            sums, qmin.astype(jnp.float32), (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST
        )
    return y


def dequantize(qweight: Array, qscale: Array, qmin: Array | None = None, dtype=jnp.float32) -> Array:
    """The ``[..., N, K]`` matrix (or stack of matrices) the arrays hold, exactly in float32, then ``dtype``."""
    q, d = jnp.asarray(qweight), jnp.asarray(qscale).astype(jnp.float32)
    *lead, n, groups = d.shape
    if qmin is not None:
        b = q.reshape(*lead, n, -1, Q4_BLOCK // 2)
        values = jnp.concatenate([b & 0xF, b >> 4], axis=-1).reshape(*lead, n, groups, -1).astype(jnp.float32)
        w = values * d[..., None] + jnp.asarray(qmin).astype(jnp.float32)[..., None]
    else:
        w = q.reshape(*lead, n, groups, -1).astype(jnp.float32) * d[..., None]
    return w.reshape(*lead, n, -1).astype(dtype)
