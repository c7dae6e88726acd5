"""Pallas kernels for few-row products with quantized weights: a TPU (Mosaic) one and a GPU (Triton) one.

Both compute what :func:`specjax._src.kernels.qmatmul.xla_qmatmul` computes,
``x[M, K] @ W^T`` as ``[M, N]`` float32 from the stored arrays of one matrix
(int8 ``[N, K]`` or 4-bit ``[N, K/2]``, float16 scales ``[N, K/G]``, a 4-bit
minimum), and read the weights from memory as stored: each tile of quantized
bytes is brought into on-chip memory and converted there.

* :func:`tpu_qmatmul` (w8a16, as tpu-inference's ``quantized_matmul``): a grid
  over (output tiles, input tiles), the input axis last and accumulated in a
  float32 VMEM scratch. Per channel, the int8 tile is converted to the
  activations' dtype, multiplied, and the scale applied once after the
  accumulation; a grouped or 4-bit tile is dequantized in VMEM (its scales
  expanded over the tile's columns by a 0/1 matrix product, so every operation
  stays two-dimensional, as Mosaic's layouts want), then multiplied. 4-bit
  weights are multiplied as two nibble planes, the low nibbles (inputs
  ``0..15`` of each block) against those inputs of ``x`` and the high ones
  against ``16..31``, so no nibble is ever moved.
* :func:`gpu_qmatmul` (1-16 rows): one program per output tile, looping over
  the groups; each group's integers (exact in bf16) are multiplied with its
  inputs and the partial product scaled by the group's ``d`` on the output (plus
  ``m`` times the group's sum of ``x`` for 4-bit). Per-channel int8 loops over
  slices of up to 256 inputs and applies its scale once, after the sum.

Both run in Pallas's interpret mode on any backend (``interpret=True``), which
is how they are tested on a CPU. The block sizes are defaults that fit a
matrix's shape, not tuned on a device.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from specjax._src.kernels import qmatmul

Array = jax.Array

#: The most rows :func:`gpu_qmatmul` takes (a Triton dot needs 16 rows; fewer are padded).
GPU_MAX_ROWS = 16
_NT = (((1,), (1,)), ((), ()))  # contract the last axes: x[M, K] . w[N, K] -> [M, N]
_HIGHEST = jax.lax.Precision.HIGHEST


def _dot(x: Array, w: Array) -> Array:
    """``x[M, C] . w[N, C] -> [M, N]`` in float32; float32 operands at full precision (not TF32 or
    one bf16 pass: a float32 model's product is the float32 product, as on the CPU)."""
    precision = _HIGHEST if x.dtype == jnp.float32 else None
    return jax.lax.dot_general(x, w, _NT, precision=precision, preferred_element_type=jnp.float32)


def _block(size: int, candidates: tuple[int, ...]) -> int:
    """The largest candidate that divides ``size``, else ``size`` itself (one block)."""
    return next((c for c in candidates if size % c == 0), size)


def _expand(groups: int, columns: int, per_group: int) -> Array:
    """The 0/1 matrix ``[groups, columns]`` whose row ``g`` is 1 over the columns of group ``g``."""
    col = jax.lax.broadcasted_iota(jnp.int32, (groups, columns), 1)
    row = jax.lax.broadcasted_iota(jnp.int32, (groups, columns), 0)
    start = row * per_group  # comparisons, not a floor division (whose Mosaic lowering asks for the chip)
    return ((col >= start) & (col < start + per_group)).astype(jnp.float32)


def _per_column(scales_t: Array, columns: int, per_group: int) -> Array:
    """Scales ``[groups, tn]`` (transposed) expanded to ``[tn, columns]``: exact (one nonzero term)."""
    expand = _expand(scales_t.shape[0], columns, per_group)
    return jax.lax.dot_general(
        scales_t.astype(jnp.float32),
        expand,
        (((0,), (0,)), ((), ())),
        precision=_HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _tpu_kernel(kind: str, per_channel: bool, group: int, *refs):
    if kind == "q4":
        x_lo, x_hi, w_ref, d_ref, m_ref, o_ref, acc = refs
    else:
        x_ref, w_ref, d_ref, o_ref, acc = refs
    k = pl.program_id(1)

    @pl.when(k == 0)
    def _():
        acc[...] = jnp.zeros_like(acc)

    if kind == "int8" and per_channel:
        x = x_ref[...]
        acc[...] += _dot(x, w_ref[...].astype(x.dtype))
    elif kind == "int8":
        x = x_ref[...]
        d = _per_column(d_ref[...], w_ref.shape[1], group)
        w = (w_ref[...].astype(jnp.float32) * d).astype(x.dtype)
        acc[...] += _dot(x, w)
    else:  # a byte column holds inputs j and j + 16 of its block: group / 2 byte columns a group
        b = w_ref[...].astype(jnp.int32)
        d = _per_column(d_ref[...], w_ref.shape[1], group // 2)
        m = _per_column(m_ref[...], w_ref.shape[1], group // 2)
        lo, hi = x_lo[...], x_hi[...]
        w_lo = ((b & 0xF).astype(jnp.float32) * d + m).astype(lo.dtype)
        w_hi = ((b >> 4).astype(jnp.float32) * d + m).astype(hi.dtype)
        acc[...] += _dot(lo, w_lo)
        acc[...] += _dot(hi, w_hi)

    @pl.when(k == pl.num_programs(1) - 1)
    def _():
        out = acc[...]
        if kind == "int8" and per_channel:
            out = out * d_ref[...].astype(jnp.float32)  # [1, tn]: the scale once, after the sum
        o_ref[...] = out


def split_q4_inputs(x: Array) -> tuple[Array, Array]:
    """``x[M, K]`` as the inputs of the low and of the high nibbles, ``[M, K/2]`` each, in byte order."""
    m, k = x.shape
    blocks = x.reshape(m, k // qmatmul.Q4_BLOCK, 2, qmatmul.Q4_BLOCK // 2)
    return blocks[:, :, 0].reshape(m, k // 2), blocks[:, :, 1].reshape(m, k // 2)


@functools.partial(jax.jit, static_argnames=("interpret", "block_n", "block_k"))
def tpu_qmatmul(
    x: Array,
    qweight: Array,
    qscale: Array,
    qmin: Optional[Array] = None,
    *,
    interpret: bool = False,
    block_n: Optional[int] = None,
    block_k: Optional[int] = None,
) -> Array:
    """``x[M, K] @ W^T`` as ``[M, N]`` float32 by the TPU kernel (``interpret``: on any backend).

    ``block_n`` / ``block_k`` (outputs / inputs per tile): defaults are the largest of 512, 256, 128
    dividing ``N``, and of 2048, 1024, 512 dividing ``K`` (and a multiple of the group), else the
    whole axis.
    """
    from jax.experimental.pallas import tpu as pltpu

    m, k = x.shape
    n, groups = qscale.shape
    group = k // groups
    kind = "int8" if qmin is None else "q4"
    per_channel = kind == "int8" and groups == 1
    tn = block_n or _block(n, (512, 256, 128))
    # Per channel the scale comes after the sum, so any input tile will do; a group must not straddle two.
    tk = block_k or _block(k, tuple(c for c in (2048, 1024, 512) if per_channel or c % group == 0))
    if n % tn or k % tk or (not per_channel and tk % group):
        raise ValueError(f"blocks {tn} x {tk} do not tile a {n} x {k} matrix in groups of {group}.")
    grid = (n // tn, k // tk)
    out_spec = pl.BlockSpec((m, tn), lambda i, j: (0, i))
    scratch = [pltpu.VMEM((m, tn), jnp.float32)]
    # Scales transposed to [G, N]: a tile's block is (tk / G groups, tn outputs), the outputs on the lanes.
    scales_t = qscale.T
    if per_channel:
        args = (x, qweight, scales_t)
        specs = [
            pl.BlockSpec((m, tk), lambda i, j: (0, j)),
            pl.BlockSpec((tn, tk), lambda i, j: (i, j)),
            pl.BlockSpec((1, tn), lambda i, j: (0, i)),
        ]
    elif kind == "int8":
        args = (x, qweight, scales_t)
        specs = [
            pl.BlockSpec((m, tk), lambda i, j: (0, j)),
            pl.BlockSpec((tn, tk), lambda i, j: (i, j)),
            pl.BlockSpec((tk // group, tn), lambda i, j: (j, i)),
        ]
    else:
        x_lo, x_hi = split_q4_inputs(x)
        args = (x_lo, x_hi, qweight, scales_t, qmin.T)
        half = pl.BlockSpec((m, tk // 2), lambda i, j: (0, j))
        scale = pl.BlockSpec((tk // group, tn), lambda i, j: (j, i))
        specs = [half, half, pl.BlockSpec((tn, tk // 2), lambda i, j: (i, j)), scale, scale]
    return pl.pallas_call(
        functools.partial(_tpu_kernel, kind, per_channel, group),
        grid=grid,
        in_specs=specs,
        out_specs=out_spec,
        scratch_shapes=scratch,
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        interpret=interpret,
        name=f"specjax_qmatmul_{kind}_tpu",
    )(*args)


def _gpu_kernel(kind: str, cols: int, steps: int, per_channel: bool, *refs):
    if kind == "q4":
        x_lo, x_hi, sums, w_ref, d_ref, m_ref, o_ref = refs
    else:
        x_ref, w_ref, d_ref, o_ref = refs

    def one_step(g, acc):  # ``cols`` weight columns (bytes): one group, or a slice of a per-channel row
        w = w_ref[:, pl.ds(g * cols, cols)]  # [tn, cols] as stored
        if kind == "int8":
            x = x_ref[:, pl.ds(g * cols, cols)]
            part = _dot(x, w.astype(x.dtype))
            return acc + part if per_channel else acc + part * d_ref[pl.ds(g, 1), :].astype(jnp.float32)
        b = w.astype(jnp.int32)
        lo, hi = x_lo[:, pl.ds(g * cols, cols)], x_hi[:, pl.ds(g * cols, cols)]
        part = _dot(lo, (b & 0xF).astype(lo.dtype))
        part += _dot(hi, (b >> 4).astype(hi.dtype))
        d = d_ref[pl.ds(g, 1), :].astype(jnp.float32)  # [1, tn]
        m = m_ref[pl.ds(g, 1), :].astype(jnp.float32)
        s = sums[:, pl.ds(g, 1)]  # [rows, 1]: the group's sum of x
        return acc + part * d + s * m

    acc = jax.lax.fori_loop(0, steps, one_step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc * d_ref[...].astype(jnp.float32) if per_channel else acc  # per channel: the scale once


def _gpu_columns(k: int, group: int, kind: str) -> Optional[int]:
    """Weight columns per loop step of the GPU kernel: a group's (``group / 2`` bytes for 4-bit), or
    per channel the largest power of two up to 256 dividing ``K``; None where no power of two >= 16
    fits (a Triton dot's smallest side is 16)."""
    if kind == "int8" and group == k:
        return next((c for c in (256, 128, 64, 32, 16) if k % c == 0), None)
    cols = group // 2 if kind == "q4" else group
    return cols if cols >= 16 and cols & (cols - 1) == 0 else None


def gpu_fits(rows: int, n: int, k: int, group: int, kind: str) -> bool:
    """Whether :func:`gpu_qmatmul` takes this product: 1-16 rows, ``N`` a multiple of 16, and
    groups (per channel: inputs) it can step through in powers of two of at least 16 columns."""
    return 0 < rows <= GPU_MAX_ROWS and n % 16 == 0 and _gpu_columns(k, group, kind) is not None


@functools.partial(jax.jit, static_argnames=("interpret", "block_n"))
def gpu_qmatmul(
    x: Array,
    qweight: Array,
    qscale: Array,
    qmin: Optional[Array] = None,
    *,
    interpret: bool = False,
    block_n: Optional[int] = None,
) -> Array:
    """``x[M, K] @ W^T`` as ``[M, N]`` float32 by the GPU (Triton) kernel, ``M`` at most 16
    (``interpret``: on any backend)."""
    from jax.experimental.pallas import triton as pltriton

    m, k = x.shape
    n, groups = qscale.shape
    group = k // groups
    kind = "int8" if qmin is None else "q4"
    if not gpu_fits(m, n, k, group, kind):
        raise ValueError(
            f"the GPU kernel takes 1-{GPU_MAX_ROWS} rows, N a multiple of 16 and groups of a power "
            f"of two >= 16 columns; got {m} rows of a {n} x {k} {kind} matrix in groups of {group}."
        )
    tn = block_n or _block(n, (64, 32, 16))
    rows = GPU_MAX_ROWS
    pad = ((0, rows - m), (0, 0))
    full = lambda shape: pl.BlockSpec(shape, lambda i: (0, 0))  # noqa: E731
    d_t = qscale.T  # [G, N]
    scale = pl.BlockSpec((groups, tn), lambda i: (0, i))
    if kind == "int8":
        args = (jnp.pad(x, pad), qweight, d_t)
        specs = [full((rows, k)), pl.BlockSpec((tn, k), lambda i: (i, 0)), scale]
    else:
        x_lo, x_hi = (jnp.pad(h, pad) for h in split_q4_inputs(x))
        sums = jnp.pad(x.astype(jnp.float32).reshape(m, groups, group).sum(-1), pad)
        args = (x_lo, x_hi, sums, qweight, d_t, qmin.T)
        specs = [
            full((rows, k // 2)),
            full((rows, k // 2)),
            full((rows, groups)),
            pl.BlockSpec((tn, k // 2), lambda i: (i, 0)),
            scale,
            scale,
        ]
    cols = _gpu_columns(k, group, kind)
    per_channel = kind == "int8" and groups == 1
    steps = (k if kind == "int8" else k // 2) // cols
    out = pl.pallas_call(
        functools.partial(_gpu_kernel, kind, cols, steps, per_channel),
        grid=(n // tn,),
        in_specs=specs,
        out_specs=pl.BlockSpec((rows, tn), lambda i: (0, i)),
        out_shape=jax.ShapeDtypeStruct((rows, n), jnp.float32),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        name=f"specjax_qmatmul_{kind}_gpu",
    )(*args)
    return out[:m]
