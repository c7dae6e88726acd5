"""Quantized products for a GPU or TPU, checked on the CPU.

* The :class:`~specjax._src.kernels.quant.QArray` type: a pytree whose paths are the
  stored arrays' names and whose format is static.
* XLA's formulation (``dot_general`` on the int8 / 4-bit weights, scales on
  the output) and the Pallas kernels (TPU Mosaic, GPU Triton) in Pallas's
  interpret mode, against the float product of the dequantized weights.
* What the cuda and tpu lowerings hold (``jax.export`` on this CPU): the
  Pallas kernel's custom call, the quantized weights as the dot's operand, and
  no float weight matrix computed outside the dot. Whether the device's
  compiler then fuses the convert into the product is decided on the device
  (``benchmarks/accelerator.py``); these tests cannot see it.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax._src.kernels import quant
from specjax._src.kernels import pallas_qmatmul, qmatmul
from specjax.models import exporting_for

FORMATS = ["int8", "int8/32", "q4", "q4/64"]
S = jax.ShapeDtypeStruct


def _matrix(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 0.2, size=(n, 1)).astype(np.float32)
    w[np.arange(n), rng.integers(0, k, n)] *= 8.0  # an outlier per row: per-group scales matter
    return w


def _q(n: int, k: int, fmt: str, seed: int = 0) -> quant.QArray:
    return jax.tree.map(jnp.asarray, quant.quantize_matrix(_matrix(n, k, seed), quant.parse_format(fmt)))


def _close(got, x: np.ndarray, q: quant.QArray, rtol: float = 1e-5) -> bool:
    """``got`` is ``x @ W^T`` within float32 rounding of the float64 product of the dequantized weights."""
    w = np.asarray(q.dequantize(), np.float64)
    want = x.astype(np.float64) @ w.T
    bound = rtol * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-6
    return bool(np.all(np.abs(np.asarray(got, np.float64) - want) <= bound))


def _shifted_scales(q: quant.QArray) -> quant.QArray:
    """Each row's scales read from the next row: a product that must fail :func:`_close`."""
    return quant.QArray(q.qweight, jnp.roll(q.qscale, 1, axis=0), q.qmin, fmt=q.fmt)


# --------------------------------------------------------------------------- #
# the type
# --------------------------------------------------------------------------- #


def test_a_quantized_matrix_flattens_to_the_paths_of_its_stored_arrays():
    params = {"mlp": {"up": {"kernel": _q(32, 64, "q4")}, "down": {"kernel": _q(64, 32, "int8")}}}
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert paths == [
        "['mlp']['down']['kernel']['qweight']",
        "['mlp']['down']['kernel']['qscale']",
        "['mlp']['up']['kernel']['qweight']",
        "['mlp']['up']['kernel']['qscale']",
        "['mlp']['up']['kernel']['qmin']",
    ]
    q = params["mlp"]["up"]["kernel"]
    assert q.shape == (32, 64) and q.fmt == quant.Format("q4") and q["qmin"] is q.qmin
    with pytest.raises(KeyError, match="int8 matrix stores qweight, qscale, not 'qmin'"):
        params["mlp"]["down"]["kernel"]["qmin"]


def test_the_format_is_static_and_survives_jit_and_tree_maps():
    a, b = _q(32, 64, "int8"), _q(32, 64, "int8/32")
    # Same arrays' shapes would not tell int8/32 from int8/64: the format is part of the structure.
    assert jax.tree.structure(a) != jax.tree.structure(b)
    again = jax.jit(lambda q: jax.tree.map(lambda v: v, q))(b)
    assert isinstance(again, quant.QArray) and again.fmt == b.fmt
    stacked = quant.stack_matrices([b, b])
    assert stacked.shape == (2, 32, 64) and stacked.fmt == b.fmt
    shapes = jax.eval_shape(lambda: b)
    assert isinstance(shapes, quant.QArray) and shapes.qweight.shape == (32, 64)


def test_the_format_is_derived_from_stored_arrays_only_where_they_come_from_a_file():
    for fmt in FORMATS:
        q = _q(16, 128, fmt)
        assert quant.QArray.from_parts(q.parts()).fmt == q.fmt
        np.testing.assert_array_equal(np.asarray(quant.dequantize_matrix(q.parts())), np.asarray(q.dequantize()))
    with pytest.raises(ValueError, match="q4 matrix needs a qmin"):
        quant.QArray(jnp.zeros((4, 16), jnp.uint8), jnp.zeros((4, 1), jnp.float16), fmt=quant.Format("q4"))
    with pytest.raises(TypeError, match="qdot needs a QArray"):
        quant.qdot(jnp.ones((1, 128)), _q(16, 128, "int8").parts())


# --------------------------------------------------------------------------- #
# the products against the float reference
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 5])
def test_xla_product_on_the_quantized_weights_matches_the_float_product(fmt, rows):
    q = _q(48, 256, fmt, seed=rows)
    x = np.random.default_rng(rows).standard_normal((rows, 256)).astype(np.float32)
    product = jax.jit(qmatmul.xla_qmatmul)
    assert _close(product(jnp.asarray(x), q.qweight, q.qscale, q.qmin), x, q)
    wrong = _shifted_scales(q)
    assert not _close(product(jnp.asarray(x), wrong.qweight, wrong.qscale, wrong.qmin), x, q)
    # In bfloat16 activations (an accelerator's compute dtype) it is the bf16 rounding of x, exactly multiplied.
    xb = jnp.asarray(x, jnp.bfloat16)
    assert _close(product(xb, q.qweight, q.qscale, q.qmin), np.asarray(xb, np.float32), q)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_tpu_kernel_in_interpret_mode_matches_the_float_product(fmt):
    # 256 x 1024 in 128 x 512 tiles: two tiles each way, so the accumulation over input tiles runs.
    q = _q(256, 1024, fmt, seed=1)
    x = np.random.default_rng(1).standard_normal((3, 1024)).astype(np.float32)
    run = lambda w: pallas_qmatmul.tpu_qmatmul(  # noqa: E731
        jnp.asarray(x), w.qweight, w.qscale, w.qmin, interpret=True, block_n=128, block_k=512
    )
    assert _close(run(q), x, q)
    assert not _close(run(_shifted_scales(q)), x, q)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 16])
def test_the_gpu_kernel_in_interpret_mode_matches_the_float_product(fmt, rows):
    q = _q(64, 512, fmt, seed=2)  # per channel: two steps of 256 inputs, the scale applied after both
    x = np.random.default_rng(rows).standard_normal((rows, 512)).astype(np.float32)
    run = lambda w: pallas_qmatmul.gpu_qmatmul(  # noqa: E731
        jnp.asarray(x), w.qweight, w.qscale, w.qmin, interpret=True, block_n=32
    )
    assert _close(run(q), x, q)
    assert not _close(run(_shifted_scales(q)), x, q)


def test_the_gpu_kernel_refuses_what_it_cannot_tile():
    q = _q(48, 96, "int8/32")
    assert not pallas_qmatmul.gpu_fits(17, 48, 96, 32, "int8") and not pallas_qmatmul.gpu_fits(1, 40, 96, 32, "int8")
    with pytest.raises(ValueError, match="1-16 rows"):
        pallas_qmatmul.gpu_qmatmul(jnp.ones((17, 96)), q.qweight, q.qscale, interpret=True)


# --------------------------------------------------------------------------- #
# the lowerings for a GPU and a TPU
# --------------------------------------------------------------------------- #

_N, _K = 512, 2048  # a weight matrix no activation or partial product has the size of
_TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def _abstract(fmt: str) -> quant.QArray:
    """An ``N x K`` matrix's arrays as shapes: nothing is quantized to lower it."""
    fmt = quant.parse_format(fmt)
    return quant.QArray.from_parts(fmt.leaf_shapes(_N, _K), fmt)


def _lowered(fn, platform: str, fmt: str, rows: int = 8) -> str:
    checks = [_TRITON] if platform == "cuda" else []
    with exporting_for(platform):
        exported = jax.export.export(jax.jit(fn), platforms=(platform,), disabled_checks=checks)(
            S((rows, _K), jnp.bfloat16), _abstract(fmt)
        )
    return exported.mlir_module()


_OP = re.compile(
    r"=\s*stablehlo\.(\w+)[^\n]*?->\s*tensor<([0-9x]+)x(bf16|f16|f32)>|"
    r"=\s*stablehlo\.(\w+)[^\n]*?:\s*tensor<([0-9x]+)x(bf16|f16|f32)>\s*(?:loc|$)",
    re.M,
)


def float_weight_ops(text: str) -> list[str]:
    """The ops of a StableHLO module whose result is a float array with as many elements as the
    weight matrix (``N x K``), the dot's own operand conversions aside: a dequantized matrix."""
    found = []
    for match in _OP.finditer(text):
        op, dims = (match.group(1), match.group(2)) if match.group(1) else (match.group(4), match.group(5))
        if int(np.prod([int(d) for d in dims.split("x")])) == _N * _K and op != "convert":
            found.append(f"{op} {dims}")
    return found


def dot_weight_operands(text: str) -> list[str]:
    """The second operand's element type of each ``dot_general``."""
    return re.findall(r"stablehlo\.dot_general[^\n]*?:\s*\(tensor<[^>]*>,\s*tensor<[0-9x]+x(\w+)>\)", text)


def test_the_checks_catch_a_dequantized_weight_matrix():
    """Negative control: dequantize-then-dot, what the accelerator path did before, is caught."""

    def dequantized(x, q):
        return jax.lax.dot_general(
            x, q.dequantize(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    for platform in ("cuda", "tpu"):
        text = _lowered(dequantized, platform, "q4")
        assert float_weight_ops(text), text[:2000]
        assert dot_weight_operands(text) == ["bf16"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_on_a_tpu_the_dot_reads_the_quantized_weights_themselves(fmt):
    text = _lowered(lambda x, q: quant.qdot(x, q), "tpu", fmt)
    assert not float_weight_ops(text)
    assert dot_weight_operands(text)[0] == ("i8" if fmt.startswith("int8") else "ui4")


@pytest.mark.parametrize("fmt", FORMATS)
def test_on_a_gpu_the_dot_takes_the_quantized_weights_converted_beside_it(fmt):
    """The convert to bf16 is the dot's operand, for XLA:GPU to fuse into the product: no scale or
    minimum is applied to a weight matrix, and no float weight matrix is made by anything else."""
    text = _lowered(lambda x, q: quant.qdot(x, q), "cuda", fmt)
    assert not float_weight_ops(text)
    assert dot_weight_operands(text)[0] == "bf16"
    stored = "i8" if fmt.startswith("int8") else "ui4"
    assert re.search(rf"stablehlo\.convert [^\n]*\(tensor<[0-9x]+x{stored}>\) -> tensor<[0-9x]+xbf16>", text)


@pytest.mark.parametrize("fmt", ["int8", "int8/32", "q4"])
def test_with_matmul_pallas_the_lowerings_hold_the_kernels(fmt):
    tpu = _lowered(lambda x, q: quant.qdot(x, q, "pallas"), "tpu", fmt)
    assert "tpu_custom_call" in tpu and f"specjax_qmatmul_{quant.parse_format(fmt).kind}_tpu" in tpu
    assert "stablehlo.dot_general" not in tpu and not float_weight_ops(tpu)
    gpu = _lowered(lambda x, q: quant.qdot(x, q, "pallas"), "cuda", fmt)
    assert "__gpu$xla.gpu.triton" in gpu and "stablehlo.dot_general" not in gpu and not float_weight_ops(gpu)
    # Past 16 rows the GPU takes XLA's product; the default ("auto") never calls a Pallas kernel.
    many = _lowered(lambda x, q: quant.qdot(x, q, "pallas"), "cuda", fmt, rows=32)
    assert "triton" not in many and "stablehlo.dot_general" in many
    auto = _lowered(lambda x, q: quant.qdot(x, q), "tpu", fmt)
    assert "tpu_custom_call" not in auto
