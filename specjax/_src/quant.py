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

Every product dequantizes the weights exactly (``q * d [+ m]`` in float32) and
multiplies them with the activations: on the CPU in registers, in the few-row
kernels of ``kernels/cpu_qmatmul.cc`` (every row count, so a row's result never
depends on the rows beside it); elsewhere (GPU, TPU, an export) in XLA, in the
compute dtype. A quantized model is one model whatever computes it: speculative
decoding reproduces its own greedy output.
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

from specjax._src.kernels import cpu_matmul

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
        raise ValueError(
            f"Unknown weight format {text!r}: use int8 (per channel), int8/G, q4 (4 bits per 32) or q4/G."
        )
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


# --------------------------------------------------------------------------- #
# Host-side (NumPy) quantization
# --------------------------------------------------------------------------- #


def _grouped(w: np.ndarray, group: int) -> np.ndarray:
    n, k = w.shape
    return w.reshape(n, k // group, group)


def quantize_matrix(w: np.ndarray, fmt: Format, name: str = "a matrix") -> dict[str, np.ndarray]:
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
        return {"qweight": q.reshape(w.shape), "qscale": d}
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    d = ((hi - lo) / _Q4_MAX).astype(np.float16)
    m = lo.astype(np.float16)
    q = np.clip(np.rint((g - m.astype(np.float32)[..., None]) * _safe_inverse(d)[..., None]), 0, _Q4_MAX)
    return {"qweight": pack_nibbles(q.astype(np.uint8).reshape(w.shape)), "qscale": d, "qmin": m}


def _safe_inverse(d: np.ndarray) -> np.ndarray:
    d = d.astype(np.float32)
    return np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """``[N, K]`` values in 0..15 -> ``[N, K/2]`` bytes in GGUF's block order."""
    n, k = q.shape
    blocks = q.reshape(n, k // Q4_BLOCK, 2, Q4_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).astype(np.uint8).reshape(n, k // 2)


def dequantize_matrix(leaves: dict, dtype: Any = jnp.float32) -> Array:
    """The ``[..., N, K]`` matrix (or stack of matrices: a mixture of experts'
    ``[E, N, K]``) that ``leaves`` (one format's arrays) hold, in ``dtype``.

    Works on NumPy and JAX arrays alike (jnp ops), inside or outside jit."""
    q, d = jnp.asarray(leaves["qweight"]), jnp.asarray(leaves["qscale"]).astype(jnp.float32)
    *lead, n, groups = d.shape
    if "qmin" in leaves:
        b = q.reshape(*lead, n, -1, Q4_BLOCK // 2)
        values = jnp.concatenate([b & 0xF, b >> 4], axis=-1).reshape(*lead, n, groups, -1).astype(jnp.float32)
        w = values * d[..., None] + jnp.asarray(leaves["qmin"]).astype(jnp.float32)[..., None]
    else:
        w = q.reshape(*lead, n, groups, -1).astype(jnp.float32) * d[..., None]
    return w.reshape(*lead, n, -1).astype(dtype)


def format_of(leaves: dict) -> Format:
    """The format that a quantized matrix's (or stack's) arrays are stored in."""
    n, groups = leaves["qscale"].shape[-2:]
    k = leaves["qweight"].shape[-1] * (2 if "qmin" in leaves else 1)
    kind = "q4" if "qmin" in leaves else "int8"
    return Format(kind, None if groups == 1 and kind == "int8" else k // groups)


def matrix_shape(leaf) -> tuple[int, ...]:
    """``[..., N, K]`` of a quantized matrix's arrays (else the array's shape)."""
    if not is_quantized(leaf):
        return tuple(leaf.shape)
    *lead, n, k = leaf["qweight"].shape
    return (*lead, n, k * 2 if "qmin" in leaf else k)


_PARTS = ("qweight", "qscale", "qmin")


def is_quantized_part(path) -> bool:
    """Whether a flattened params path ends in one of a quantized matrix's arrays."""
    return str(getattr(path[-1], "key", path[-1])) in _PARTS


def is_quantized(leaf) -> bool:
    """Whether ``leaf`` is a quantized matrix's arrays (a mapping with ``qweight``)."""
    return isinstance(leaf, Mapping) and "qweight" in leaf


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
    """``value`` as the quantized model stores it: a dict of arrays, or ``value``."""
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


def stack_matrices(matrices: list) -> dict:
    """Quantized matrices of one format (dicts of arrays) as one ``[E, ...]`` stack."""
    return {k: np.stack([np.asarray(m[k]) for m in matrices]) for k in matrices[0]}


def quantize_params(params, quantization: Quantization, keep=()):
    """A float params tree as ``quantization`` stores it (on the host, one
    matrix at a time); the params at paths in ``keep`` (name tuples) as they are."""

    def leaf(path, value):
        names = _names(path)
        if names in keep or is_quantized(value) or quantized_role(names, np.ndim(value)) is None:
            return value
        out = quantize_leaf(names, np.asarray(jax.device_get(value)), quantization)
        return jax.tree.map(jnp.asarray, out) if isinstance(out, dict) else value

    return _map_with_path(leaf, params)


def dequantize_params(params, dtype: Any):
    """The float params tree a quantized one stands for (``dtype`` for the matrices)."""

    def leaf(path, value):
        if not is_quantized(value):
            return value
        return _out_in(dequantize_matrix(value, jnp.float32), _names(path)).astype(dtype)

    return _map_with_path(leaf, params)


def _map_with_path(fn, tree, path=()):
    """Maps ``fn(path, value)`` over a nested dict, a quantized matrix's dict being one value."""
    if isinstance(tree, Mapping) and not is_quantized(tree):
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


def from_gguf_blocks(type_name: str, blocks: np.ndarray, fmt: Format) -> Optional[dict[str, np.ndarray]]:
    """A GGUF tensor's raw blocks ``[N, row_bytes]`` (uint8) as ``fmt``'s
    arrays, bit for bit, where ``fmt`` holds the type exactly; else None."""
    kind, size = _GGUF_BLOCKS.get(type_name, (None, 0))
    if kind != fmt.kind or fmt.group != Q4_BLOCK:
        return None
    n = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(n, -1, size)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    if type_name == "Q8_0":
        return {"qweight": np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, -1), "qscale": d}
    if type_name == "Q4_1":
        m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0]
        return {"qweight": np.ascontiguousarray(b[..., 4:]).reshape(n, -1), "qscale": d, "qmin": m}
    # Q4_0: d * (q - 8) = q * d + (-8 d); -8 d is exact in float16 below its overflow.
    m = (d.astype(np.float32) * -8.0)
    if not np.all(np.isfinite(m.astype(np.float16))):
        return None
    return {"qweight": np.ascontiguousarray(b[..., 2:]).reshape(n, -1), "qscale": d, "qmin": m.astype(np.float16)}


# --------------------------------------------------------------------------- #
# Products
# --------------------------------------------------------------------------- #


def kernel_applies(x: Array, matmul: str) -> bool:
    """Whether ``x @ W^T`` goes to the CPU kernel (float32 activations and
    ``matmul`` not ``"xla"``); elsewhere XLA dequantizes."""
    if x.dtype != jnp.float32:
        return False
    return cpu_matmul.kernel_wanted(matmul)


def _ffi(leaves: dict, x: Array) -> Array:
    n = leaves["qweight"].shape[0]
    kind = "q4" if "qmin" in leaves else "int8"
    call = jax.ffi.ffi_call(
        cpu_matmul._TARGETS[kind][0], jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), vmap_method="sequential"
    )
    args = [x, leaves["qweight"], leaves["qscale"]] + ([leaves["qmin"]] if kind == "q4" else [])
    return call(*args)


def _xla(leaves: dict, x: Array) -> Array:
    dims = (((1,), (1,)), ((), ()))
    if "qmin" not in leaves and leaves["qscale"].shape[1] == 1:
        # Per channel, the scale factors out of the dot: the dot's operand is
        # then the int8 weights converted, which XLA fuses into the product.
        w = leaves["qweight"].astype(x.dtype)
        y = jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
        return y * leaves["qscale"][:, 0].astype(jnp.float32)
    w = dequantize_matrix(leaves, x.dtype)
    return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)


def qdot(x: Array, leaves: dict, matmul: str = "auto") -> Array:
    """``x[..., K] @ W[N, K]^T`` in float32, ``W`` a quantized matrix's arrays."""
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    flat = x.reshape(rows, x.shape[-1])
    if rows and kernel_applies(x, matmul):
        out = jax.lax.platform_dependent(
            flat, leaves, cpu=lambda a, w: _ffi(w, a), default=lambda a, w: _xla(w, a)
        )
    else:
        out = _xla(leaves, flat)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def qdot_experts(x: Array, leaves: dict, matmul: str = "auto", *, per_expert: bool = False) -> Array:
    """Every expert's product with the stack ``W[E, N, K]``: ``[E, ..., N]`` in float32,
    from ``x[..., K]`` (one input for every expert) or, with ``per_expert``, ``x[E, ..., K]``.

    One expert at a time (``lax.map``): each is the product :func:`qdot` computes,
    with the CPU kernel where it applies, so a stack costs what its matrices cost."""
    if per_expert:
        return jax.lax.map(lambda args: qdot(args[0], args[1], matmul), (x, leaves))
    return jax.lax.map(lambda w: qdot(x, w, matmul), leaves)


def embed_rows(leaves: dict, ids: Array, dtype: Any) -> Array:
    """Rows ``ids`` of a quantized ``[V, H]`` table, dequantized: ``[..., H]``."""
    flat = ids.reshape(-1)
    picked = {k: jnp.take(v, flat, axis=0) for k, v in leaves.items()}
    return dequantize_matrix(picked, dtype).reshape(*ids.shape, -1)


def _zeros(fmt: Format, n: int, k: int, experts: Optional[int] = None):
    lead = () if experts is None else (experts,)

    def init(key):
        del key
        return {name: jnp.zeros(lead + s.shape, s.dtype) for name, s in fmt.leaf_shapes(n, k).items()}

    return init


def quant_experts(module: nn.Module, name: str, fmt: Format, experts: int, inputs: int, outputs: int) -> dict:
    """A mixture of experts' stacked matrices stored in ``fmt`` (``[E, outputs, inputs]``)."""
    fmt.check((outputs, inputs), f"{name} (each expert)")
    return module.param(name, _zeros(fmt, outputs, inputs, experts))


class QuantDense(nn.Module):
    """``nn.Dense`` with its kernel stored in ``fmt`` (param ``kernel``: the
    format's arrays, ``[features, inputs]``)."""

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
    the format's arrays, ``[V, H]``); :meth:`attend` is the tied LM head."""

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


def quant_head(module: nn.Module, name: str, fmt: Format, hidden: int, vocab: int) -> dict:
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
