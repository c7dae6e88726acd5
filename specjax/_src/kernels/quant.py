"""Quantized weights: int8 and 4-bit matrices, their products, their Flax modules.

Decoding at batch 1 reads every weight once per generated token (or per
verified block), so its speed is set by how many bytes a weight takes. A
quantized model stores each matrix in one of two formats, both ``[N, K]`` (one
output per row, contiguous along the input, the layout of GGUF files) with a
float16 scale per group of ``G`` inputs:

======================  ==================================  ==================
format                  a weight is                          bytes per weight
======================  ==================================  ==================
``int8``                ``q * d``, ``q`` int8, one ``d``     1 (+ 2 per row)
                        per output row (per channel)
``int8/32``             the same, one ``d`` per 32 inputs    1.0625
                        (GGUF's Q8_0)
``q4`` (= ``q4/32``)    ``q * d + m``, ``q`` in 0..15, a     0.625
                        ``d`` and ``m`` per 32 inputs
                        (GGUF's Q4_1; Q4_0 is ``m = -8 d``)
``q4/64``, ...          the same per 64 (any multiple of 32)
======================  ==================================  ==================

A 4-bit block of 32 inputs is 16 bytes, byte ``i`` holding input ``i`` in its
low nibble and input ``i + 16`` in its high nibble, as in GGUF. A model's
:class:`Quantization` names a format for its matrices (attention and MLP) and
one for its vocabulary matrices (the token embedding and the LM head):
``"q4"`` is q4 for both, ``"q4,embedding=int8/32"`` what llama.cpp's Q4_1
files hold. Norms, biases and GPT-2's position table stay in the compute dtype.

A quantized matrix is a :class:`QArray`: its stored arrays and its
:class:`Format`, a static field (part of the pytree's structure, as Qwix's
``QArray`` and AQT's ``QTensor``), so no code re-derives the format from which
arrays exist. Its pytree keys are the arrays' stored names, so a params tree
flattens (and saves to Orbax) to the same paths as the dicts of arrays it
replaces: ``.../kernel/qweight``, ``.../kernel/qscale``, ``.../kernel/qmin``.

Products (:func:`qdot`, kernels in :mod:`specjax._src.kernels`): on the CPU,
the few-row kernels of ``kernels/cpu_qmatmul.cc`` dequantize exactly (``q * d
[+ m]`` in float32) in registers (every row count, so a row's result never
depends on the rows beside it); elsewhere (GPU, TPU, an export) XLA's
``dot_general`` reads the int8 or 4-bit weights as its operand, with the scales
applied to its output (a grouped format: the group axis a batch axis of the
dot), or, with ``matmul="pallas"``, the Pallas kernels of
``kernels/pallas_qmatmul.py`` (TPU Mosaic; GPU Triton for 1-16 rows). A
quantized model is one model whatever computes it: speculative decoding
reproduces its own greedy output.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import Any, Optional, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.kernels import cpu_matmul, pallas_qmatmul, platforms, qmatmul

Array = jax.Array

KINDS = ("int8", "q4")
#: Inputs per 4-bit block: a 4-bit group is a whole number of blocks.
Q4_BLOCK = 32
#: An int8 group must be a whole number of the CPU kernel's vectors.
INT8_GROUP_MULTIPLE = 16
_INT8_MAX = 127
_Q4_MAX = 15


@dataclasses.dataclass(frozen=True)
class Format:
    """One matrix format: ``kind`` (``"int8"`` or ``"q4"``) and ``group``,
    the inputs per scale (``None``: one scale per output row, int8 only)."""

    kind: str
    group: Optional[int] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Unknown weight format {self.kind!r}; use one of {', '.join(KINDS)}.")
        if self.kind == "q4" and self.group is None:
            object.__setattr__(self, "group", Q4_BLOCK)
        if self.group is not None:
            multiple = Q4_BLOCK if self.kind == "q4" else INT8_GROUP_MULTIPLE
            if self.group <= 0 or self.group % multiple:
                raise ValueError(
                    f"A {self.kind} group must be a positive multiple of {multiple} inputs, got {self.group}."
                )

    def __str__(self) -> str:
        if self.kind == "q4" and self.group == Q4_BLOCK:
            return "q4"
        return self.kind if self.group is None else f"{self.kind}/{self.group}"

    def group_of(self, inputs: int) -> int:
        return inputs if self.group is None else self.group

    def check(self, shape: tuple[int, int], name: str) -> None:
        """Raises a ValueError naming ``name`` when ``[N, K]`` cannot take this format."""
        n, k = shape
        group = self.group_of(k)
        if k % group:
            raise ValueError(
                f"Cannot quantize {name} ({n} x {k} inputs) as {self}: its {k} inputs are not a whole "
                f"number of groups of {group}. Pick a group that divides {k}"
                + (" (e.g. int8 per channel)" if self.kind == "int8" else " (q4 needs a multiple of 32)")
                + ", or leave this model unquantized."
            )
        if self.kind == "int8" and k % INT8_GROUP_MULTIPLE:
            raise ValueError(
                f"Cannot quantize {name} ({n} x {k}) as {self}: int8 needs inputs in multiples of "
                f"{INT8_GROUP_MULTIPLE}."
            )

    def leaf_shapes(self, n: int, k: int) -> dict[str, jax.ShapeDtypeStruct]:
        """The arrays that hold an ``[N, K]`` matrix in this format."""
        groups = k // self.group_of(k)
        if self.kind == "int8":
            return {
                "qweight": jax.ShapeDtypeStruct((n, k), jnp.int8),
                "qscale": jax.ShapeDtypeStruct((n, groups), jnp.float16),
            }
        return {
            "qweight": jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
            "qscale": jax.ShapeDtypeStruct((n, groups), jnp.float16),
            "qmin": jax.ShapeDtypeStruct((n, groups), jnp.float16),
        }


@dataclasses.dataclass(frozen=True)
class Quantization:
    """A model's weight formats: ``weights`` for the attention and MLP
    matrices, ``embedding`` for the vocabulary matrices (embedding, LM head)."""

    weights: Format
    embedding: Format

    def __str__(self) -> str:
        if self.embedding == self.weights:
            return str(self.weights)
        return f"{self.weights},embedding={self.embedding}"


_FORMAT = re.compile(r"^(int8|q4)(?:/(\d+))?$")


def parse_format(text: str) -> Format:
    match = _FORMAT.match(text.strip().lower())
    if match is None:
        raise ValueError(f"Unknown weight format {text!r}: use int8 (per channel), int8/G, q4 (4 bits per 32) or q4/G.")
    return Format(match.group(1), int(match.group(2)) if match.group(2) else None)


def parse_quantization(spec: Union[None, str, Quantization]) -> Optional[Quantization]:
    """``"int8"``, ``"q4"``, ``"q4/64"``, ``"q4,embedding=int8/32"`` (or a
    :class:`Quantization`, or None) as a :class:`Quantization` (or None)."""
    if spec is None or isinstance(spec, Quantization):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"quantize must be a string such as 'int8' or 'q4', got {type(spec).__name__}.")
    parts = [p.strip() for p in spec.split(",")]
    weights = parse_format(parts[0])
    embedding = weights
    for part in parts[1:]:
        key, _, value = part.partition("=")
        if key.strip() != "embedding" or not value:
            raise ValueError(f"Unknown quantization option {part!r} in {spec!r}; the one option is embedding=FORMAT.")
        embedding = parse_format(value)
    return Quantization(weights, embedding)


_PARTS = ("qweight", "qscale", "qmin")


@jax.tree_util.register_pytree_with_keys_class
class QArray:
    """A quantized ``[..., N, K]`` matrix (or stack of matrices: a mixture of experts' ``[E, N, K]``).

    Attributes:
      qweight: int8 ``[..., N, K]`` (``int8``) or uint8 ``[..., N, K/2]`` (``q4``: two inputs a byte).
      qscale: float16 ``[..., N, K/G]``, a scale per group of ``G`` inputs.
      qmin: float16 ``[..., N, K/G]``, the minimum added per group (``q4``), else None.
      fmt: the :class:`Format`, static: two formats are two pytree structures (two programs).

    A pytree whose children are the arrays under their stored names (``DictKey("qweight")``, ...),
    so tree paths and Orbax files are those of the dict layout; ``q["qweight"]`` reads a part by
    that name. NumPy, JAX or ``ShapeDtypeStruct`` leaves alike.
    """

    __slots__ = ("qweight", "qscale", "qmin", "fmt")

    def __init__(self, qweight, qscale, qmin=None, *, fmt: "Format"):
        if (qmin is None) != (fmt.kind == "int8"):
            raise ValueError(f"A {fmt} matrix {'has no' if fmt.kind == 'int8' else 'needs a'} qmin array.")
        self.qweight, self.qscale, self.qmin, self.fmt = qweight, qscale, qmin, fmt

    @classmethod
    def from_parts(cls, parts: Mapping, fmt: Optional["Format"] = None) -> "QArray":
        """A matrix from its stored arrays by name (a safetensors file's or an old params dict's);
        ``fmt`` None: the format the arrays' names and shapes imply (the one place it is derived)."""
        if fmt is None:
            n, groups = parts["qscale"].shape[-2:]
            kind = "q4" if "qmin" in parts else "int8"
            k = parts["qweight"].shape[-1] * (2 if kind == "q4" else 1)
            fmt = Format(kind, None if groups == 1 and kind == "int8" else k // groups)
        return cls(parts["qweight"], parts["qscale"], parts.get("qmin"), fmt=fmt)

    def tree_flatten_with_keys(self):
        children = [(jax.tree_util.DictKey(name), getattr(self, name)) for name in self.names]
        return children, self.fmt

    def tree_flatten(self):
        # Without it jax flattens through the keyed form, building a DictKey per part on every
        # jitted call: a quantized model's step call spent about 1 ms of its dispatch there.
        if self.fmt.kind == "q4":  # by the format, as ``names``: jax rebuilds trees with None leaves
            return (self.qweight, self.qscale, self.qmin), self.fmt
        return (self.qweight, self.qscale), self.fmt

    @classmethod
    def tree_unflatten(cls, fmt, children):
        q = object.__new__(cls)  # no check: jax rebuilds trees with placeholder leaves
        q.qweight, q.qscale, q.fmt = children[0], children[1], fmt
        q.qmin = children[2] if len(children) > 2 else None
        return q

    @property
    def names(self) -> tuple[str, ...]:
        """The stored arrays' names: ``qweight``, ``qscale`` (and ``qmin`` for 4-bit)."""
        return _PARTS if self.fmt.kind == "q4" else _PARTS[:2]

    def parts(self) -> dict:
        """``{stored name: array}``, the layout on disk."""
        return {name: getattr(self, name) for name in self.names}

    def __getitem__(self, name: str):
        if name not in self.names:
            raise KeyError(f"a {self.fmt} matrix stores {', '.join(self.names)}, not {name!r}")
        return getattr(self, name)

    @property
    def shape(self) -> tuple[int, ...]:
        """``[..., N, K]`` of the matrix the arrays hold."""
        *lead, n, k = self.qweight.shape
        return (*lead, n, k * 2 if self.fmt.kind == "q4" else k)

    def dequantize(self, dtype: Any = jnp.float32) -> Array:
        """The ``[..., N, K]`` matrix, exactly in float32, then cast to ``dtype``."""
        return qmatmul.dequantize(self.qweight, self.qscale, self.qmin, dtype)

    def __repr__(self) -> str:
        return f"QArray({self.fmt}, shape={self.shape})"


# --------------------------------------------------------------------------- #
# Host-side (NumPy) quantization
# --------------------------------------------------------------------------- #


def _grouped(w: np.ndarray, group: int) -> np.ndarray:
    n, k = w.shape
    return w.reshape(n, k // group, group)


def quantize_matrix(w: np.ndarray, fmt: Format, name: str = "a matrix") -> QArray:
    """An ``[N, K]`` float matrix in ``fmt`` (round to nearest; the scales are
    rounded to float16 first, so each weight is rounded against the scale it
    will be read with)."""
    w = np.asarray(w, np.float32)
    fmt.check(w.shape, name)
    if not np.all(np.isfinite(w)):
        raise ValueError(f"Cannot quantize {name}: it holds NaN or infinite values.")
    g = _grouped(w, fmt.group_of(w.shape[1]))
    if fmt.kind == "int8":
        d = (np.abs(g).max(axis=-1) / _INT8_MAX).astype(np.float16)
        inv = _safe_inverse(d)
        q = np.clip(np.rint(g * inv[..., None]), -_INT8_MAX, _INT8_MAX).astype(np.int8)
        return QArray(q.reshape(w.shape), d, fmt=fmt)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    d = ((hi - lo) / _Q4_MAX).astype(np.float16)
    m = lo.astype(np.float16)
    q = np.clip(np.rint((g - m.astype(np.float32)[..., None]) * _safe_inverse(d)[..., None]), 0, _Q4_MAX)
    return QArray(pack_nibbles(q.astype(np.uint8).reshape(w.shape)), d, m, fmt=fmt)


def _safe_inverse(d: np.ndarray) -> np.ndarray:
    d = d.astype(np.float32)
    return np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """``[N, K]`` values in 0..15 -> ``[N, K/2]`` bytes in GGUF's block order."""
    n, k = q.shape
    blocks = q.reshape(n, k // Q4_BLOCK, 2, Q4_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).astype(np.uint8).reshape(n, k // 2)


def as_qarray(leaf: Union[QArray, Mapping]) -> QArray:
    """``leaf`` as a :class:`QArray` (a mapping of stored arrays by name: see :meth:`QArray.from_parts`)."""
    return leaf if isinstance(leaf, QArray) else QArray.from_parts(leaf)


def dequantize_matrix(leaf: Union[QArray, Mapping], dtype: Any = jnp.float32) -> Array:
    """The ``[..., N, K]`` matrix (or stack of matrices: a mixture of experts'
    ``[E, N, K]``) that ``leaf`` holds, in ``dtype``.

    Works on NumPy and JAX arrays alike (jnp ops), inside or outside jit."""
    return as_qarray(leaf).dequantize(dtype)


def format_of(leaf: Union[QArray, Mapping]) -> Format:
    """The format that a quantized matrix (or stack) is stored in."""
    return as_qarray(leaf).fmt


def matrix_shape(leaf) -> tuple[int, ...]:
    """``[..., N, K]`` of a quantized matrix (else the array's shape)."""
    return leaf.shape if is_quantized(leaf) else tuple(leaf.shape)


def is_quantized_part(path) -> bool:
    """Whether a flattened params path ends in one of a quantized matrix's arrays."""
    return str(getattr(path[-1], "key", path[-1])) in _PARTS


def is_quantized(leaf) -> bool:
    """Whether ``leaf`` is a quantized matrix (a :class:`QArray`)."""
    return isinstance(leaf, QArray)


def nbytes(tree) -> int:
    """Bytes held by a params tree's arrays (what stays resident)."""
    return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree.leaves(tree)))


# --------------------------------------------------------------------------- #
# Which params are quantized
# --------------------------------------------------------------------------- #


#: A mixture of experts' stacked matrices (``[E, in, out]``), stored as ``[E, out, in]`` stacks.
EXPERT_PARAMS = ("experts_gate", "experts_up", "experts_down")


#: A feature head's fusion layers (``reduce`` mixes target blocks, ``fuse`` the token and feature), never quantized.
FEATURE_MIXING = ("reduce", "fuse")


def quantized_role(names: tuple[str, ...], ndim: int) -> Optional[str]:
    """``"weights"`` or ``"embedding"`` for a float param that a quantized
    model stores quantized (with ``transpose``d into ``[N, K]`` where it is
    ``[K, N]``; a mixture of experts' ``[E, K, N]`` stacks into ``[E, N, K]``),
    else None."""
    if ndim == 3 and names[-1] in EXPERT_PARAMS:
        return "weights"
    # A feature head's fusion layers stay float: they start as scaled identities
    # (diagonal 1 / rms(embedding), about 7.4 for SmolLM2) and learn off-diagonal
    # weights a hundred times smaller, which one int8 scale per output channel
    # rounds away (a SmolLM2 head lost 16% of its held-out expected acceptance).
    if ndim != 2 or names[0] in FEATURE_MIXING:
        return None
    if names[-1] == "kernel":
        return "weights"
    if names[-2:] == ("embed", "embedding") or names == ("lm_head",):
        return "embedding"
    return None


def stored_transposed(names: tuple[str, ...]) -> bool:
    """Dense kernels, an untied head and each expert are ``[in, out]``; stored ``[out, in]``."""
    return names[-1] in ("kernel", "lm_head") + EXPERT_PARAMS


def _out_in(w, names: tuple[str, ...]):
    """A float param in the stored ``[..., out, in]`` order (its last two axes swapped where
    :func:`stored_transposed`); also the way back, the swap being its own inverse."""
    return jnp.swapaxes(w, -1, -2) if stored_transposed(names) else w


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(p, "key", p)) for p in path)


def quantize_leaf(names: tuple[str, ...], value: np.ndarray, quantization: Quantization):
    """``value`` as the quantized model stores it: a :class:`QArray`, or ``value``."""
    role = quantized_role(names, np.ndim(value))
    if role is None:
        return value
    w = np.asarray(value, np.float32)
    if stored_transposed(names):
        w = np.swapaxes(w, -1, -2)
    fmt, name = getattr(quantization, role), "/".join(names)
    if w.ndim == 3:  # a mixture of experts: each expert's matrix in the format, stacked
        return stack_matrices([quantize_matrix(m, fmt, f"{name} (expert {e})") for e, m in enumerate(w)])
    return quantize_matrix(w, fmt, name)


def stack_matrices(matrices: list) -> QArray:
    """Quantized matrices of one format as one ``[E, ...]`` stack (NumPy arrays)."""
    return jax.tree.map(lambda *parts: np.stack([np.asarray(p) for p in parts]), *matrices)


def quantize_params(params, quantization: Quantization, keep=()):
    """A float params tree as ``quantization`` stores it (on the host, one
    matrix at a time); the params at paths in ``keep`` (name tuples) as they are."""

    def leaf(path, value):
        names = _names(path)
        if names in keep or is_quantized(value) or quantized_role(names, np.ndim(value)) is None:
            return value
        out = quantize_leaf(names, np.asarray(jax.device_get(value)), quantization)
        return jax.tree.map(jnp.asarray, out) if is_quantized(out) else value

    return _map_with_path(leaf, params)


def dequantize_params(params, dtype: Any):
    """The float params tree a quantized one stands for (``dtype`` for the matrices)."""

    def leaf(path, value):
        if not is_quantized(value):
            return value
        return _out_in(dequantize_matrix(value, jnp.float32), _names(path)).astype(dtype)

    return _map_with_path(leaf, params)


def _map_with_path(fn, tree, path=()):
    """Maps ``fn(path, value)`` over a nested dict, a quantized matrix being one value."""
    if isinstance(tree, Mapping):
        return {k: _map_with_path(fn, v, path + (jax.tree_util.DictKey(k),)) for k, v in tree.items()}
    return fn(path, tree)


# GGUF's block types that a format holds exactly: bytes per 32-input block.
_GGUF_BLOCKS = {"Q4_0": ("q4", 18), "Q4_1": ("q4", 20), "Q8_0": ("int8", 34)}


def gguf_format(type_name: str) -> Optional[Format]:
    """The format nearest a GGUF tensor type: exact for Q4_0, Q4_1 (q4) and
    Q8_0 (int8/32); re-quantized from the dequantized values for the other
    quantized types (4-bit K-quants to q4, 5- and 6-bit ones to int8/32);
    None for float types."""
    if type_name in _GGUF_BLOCKS:
        kind = _GGUF_BLOCKS[type_name][0]
        return Format(kind, Q4_BLOCK)
    if type_name in ("F32", "F16", "BF16", "F64"):
        return None
    return Format("q4") if type_name.startswith(("Q4", "IQ4", "Q3", "Q2", "IQ3", "IQ2", "IQ1")) else Format("int8", 32)


def from_gguf_blocks(type_name: str, blocks: np.ndarray, fmt: Format) -> Optional[QArray]:
    """A GGUF tensor's raw blocks ``[N, row_bytes]`` (uint8) as ``fmt``'s
    arrays, bit for bit, where ``fmt`` holds the type exactly; else None."""
    kind, size = _GGUF_BLOCKS.get(type_name, (None, 0))
    if kind != fmt.kind or fmt.group != Q4_BLOCK:
        return None
    n = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(n, -1, size)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    if type_name == "Q8_0":
        return QArray(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, -1), d, fmt=fmt)
    if type_name == "Q4_1":
        m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0]
        return QArray(np.ascontiguousarray(b[..., 4:]).reshape(n, -1), d, m, fmt=fmt)
    # Q4_0: d * (q - 8) = q * d + (-8 d); -8 d is exact in float16 below its overflow.
    m = d.astype(np.float32) * -8.0
    if not np.all(np.isfinite(m.astype(np.float16))):
        return None
    return QArray(np.ascontiguousarray(b[..., 2:]).reshape(n, -1), d, m.astype(np.float16), fmt=fmt)


# --------------------------------------------------------------------------- #
# Products
# --------------------------------------------------------------------------- #


def kernel_applies(x: Array, matmul: str) -> bool:
    """Whether ``x @ W^T`` goes to the CPU kernel on a CPU (float32 activations and
    ``matmul`` not ``"xla"``)."""
    if x.dtype != jnp.float32:
        return False
    return cpu_matmul.kernel_wanted(matmul)


def _accelerator(q: QArray, matmul: str):
    """The product on a GPU or TPU: XLA's ``dot_general`` on the quantized weights, or with
    ``matmul="pallas"`` the Pallas kernel of the platform where it takes the shape."""

    def xla(a, w):
        return qmatmul.xla_qmatmul(a, w.qweight, w.qscale, w.qmin)

    if matmul != "pallas":
        return {"default": xla}

    def gpu(a, w):
        rows, (n, k) = a.shape[0], w.shape
        if not pallas_qmatmul.gpu_fits(rows, n, k, w.fmt.group_of(k), w.fmt.kind):
            return xla(a, w)
        return pallas_qmatmul.gpu_qmatmul(a, w.qweight, w.qscale, w.qmin)

    def tpu(a, w):
        return pallas_qmatmul.tpu_qmatmul(a, w.qweight, w.qscale, w.qmin)

    return {"cuda": gpu, "tpu": tpu, "default": xla}


def qdot(x: Array, q: QArray, matmul: str = "auto") -> Array:
    """``x[..., K] @ W[N, K]^T`` in float32, ``W`` a quantized matrix.

    On a CPU the few-row kernel (float32 ``x``, ``matmul`` not ``"xla"``), else XLA's
    ``dot_general`` on the quantized weights; on a GPU or TPU that formulation, or with
    ``matmul="pallas"`` the Pallas kernels (:mod:`specjax._src.kernels.pallas_qmatmul`)."""
    if not is_quantized(q):
        raise TypeError(f"qdot needs a QArray (a quantized matrix), got {type(q).__name__}.")
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    flat = x.reshape(rows, x.shape[-1])
    branches = _accelerator(q, matmul)
    if rows and kernel_applies(x, matmul):
        branches = {**branches, "cpu": lambda a, w: qmatmul.cpu_qmatmul(a, w.qweight, w.qscale, w.qmin)}
    out = platforms.platform_dependent(flat, q, **branches) if len(branches) > 1 else branches["default"](flat, q)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def qdot_expert(x: Array, stack: QArray, index: Array, matmul: str = "auto") -> Array:
    """``x[R, K] @ W[index]^T`` in float32, one matrix of a quantized stack ``W[E, N, K]``.

    On a CPU the few-row kernel reads the expert's arrays inside the stack (a dynamic
    index would copy them out first, as many bytes again as the product reads); else
    the indexed matrix's :func:`qdot`. ``index`` is clamped into the stack."""

    if x.ndim != 2 or len(stack.shape) != 3 or x.shape[1] != stack.shape[2]:
        raise ValueError(f"qdot_expert multiplies rows x[R, K] by one matrix of a quantized stack [E, N, K]; got x "
                         f"{x.shape} and a stack {stack.shape}.")

    def indexed(a, w, e):
        return qdot(a, jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, e, keepdims=False), w), matmul)

    if not x.shape[0] or not kernel_applies(x, matmul):
        return indexed(x, stack, index)

    def cpu(a, w, e):
        return qmatmul.cpu_qmatmul_expert(a, w.qweight, w.qscale, w.qmin, e)

    return platforms.platform_dependent(x, stack, jnp.asarray(index, jnp.int32), cpu=cpu, default=indexed)


def qdot_experts(x: Array, q: QArray, matmul: str = "auto", *, per_expert: bool = False) -> Array:
    """Every expert's product with the stack ``W[E, N, K]``: ``[E, ..., N]`` in float32,
    from ``x[..., K]`` (one input for every expert) or, with ``per_expert``, ``x[E, ..., K]``.

    One expert at a time (``lax.map``): each is the product :func:`qdot` computes,
    with the CPU kernel where it applies, so a stack costs what its matrices cost."""
    if per_expert:
        return jax.lax.map(lambda args: qdot(args[0], args[1], matmul), (x, q))
    return jax.lax.map(lambda w: qdot(x, w, matmul), q)


def embed_rows(q: QArray, ids: Array, dtype: Any) -> Array:
    """Rows ``ids`` of a quantized ``[V, H]`` table, dequantized: ``[..., H]``."""
    flat = ids.reshape(-1)
    picked = jax.tree.map(lambda v: jnp.take(v, flat, axis=0), q)
    return picked.dequantize(dtype).reshape(*ids.shape, -1)


def _zeros(fmt: Format, n: int, k: int, experts: Optional[int] = None):
    lead = () if experts is None else (experts,)

    def init(key):
        del key
        parts = {name: jnp.zeros(lead + s.shape, s.dtype) for name, s in fmt.leaf_shapes(n, k).items()}
        return QArray.from_parts(parts, fmt)

    return init


def quant_experts(module: nn.Module, name: str, fmt: Format, experts: int, inputs: int, outputs: int) -> QArray:
    """A mixture of experts' stacked matrices stored in ``fmt`` (``[E, outputs, inputs]``)."""
    fmt.check((outputs, inputs), f"{name} (each expert)")
    return module.param(name, _zeros(fmt, outputs, inputs, experts))


class QuantDense(nn.Module):
    """``nn.Dense`` with its kernel stored in ``fmt`` (param ``kernel``: a
    :class:`QArray`, ``[features, inputs]``)."""

    features: int
    fmt: Format
    use_bias: bool
    dtype: Any
    matmul: str = "auto"

    @nn.compact
    def __call__(self, x: Array) -> Array:
        k = x.shape[-1]
        self.fmt.check((self.features, k), self.name or "a dense layer")
        kernel = self.param("kernel", _zeros(self.fmt, self.features, k))
        y = qdot(x.astype(self.dtype), kernel, self.matmul)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
            y = y + bias.astype(jnp.float32)
        return y.astype(self.dtype)


class QuantEmbed(nn.Module):
    """``nn.Embed`` with its table stored in ``fmt`` (param ``embedding``:
    a :class:`QArray`, ``[V, H]``); :meth:`attend` is the tied LM head."""

    num_embeddings: int
    features: int
    fmt: Format
    dtype: Any
    matmul: str = "auto"

    def setup(self):
        self.fmt.check((self.num_embeddings, self.features), "the embedding table")
        self.embedding = self.param("embedding", _zeros(self.fmt, self.num_embeddings, self.features))

    def __call__(self, ids: Array) -> Array:
        return embed_rows(self.embedding, ids, self.dtype)

    def attend(self, x: Array) -> Array:
        """``x[..., H] @ table^T`` in float32."""
        return qdot(x.astype(self.dtype), self.embedding, self.matmul)


def quant_head(module: nn.Module, name: str, fmt: Format, hidden: int, vocab: int) -> QArray:
    """An untied LM head's param stored in ``fmt`` (``[vocab, hidden]``)."""
    fmt.check((vocab, hidden), "the LM head")
    return module.param(name, _zeros(fmt, vocab, hidden))


@functools.lru_cache(maxsize=None)
def check_kernels_for(platform: str) -> None:
    """Quantized weights on the CPU need the kernels; raises a clear error where
    they cannot be built (XLA's dequantize-and-dot would reread every weight as
    float32, slower than the float model)."""
    if platform != "cpu":
        return
    try:
        cpu_matmul.ensure_loaded()
    except cpu_matmul.KernelUnavailableError as e:
        raise ValueError(
            f"Quantized weights on the CPU need specjax's kernels, which cannot be built here: {e}\n"
            "Install a C++ compiler (g++ or clang++), or load the model without quantize."
        ) from e
