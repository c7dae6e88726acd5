"""Few-row float32 matrix products on the CPU, as XLA FFI custom calls.

Verifying ``K + 1`` drafted tokens multiplies ``K + 1`` rows by every weight
matrix of the target. At batch 1 that should cost what one row costs (the
weights are read once either way), which is the premise of speculative
decoding. On the CPU, XLA hands every product of two or more rows to a GEMM
library that first copies the weight matrix into a packed layout; at
SmolLM2-135M's sizes that copy doubles the product's time, so a 4-token
forward cost 1.8 one-token forwards (BENCHMARKS.md).
``cpu_matmul.cc`` reads the weights in place, once, for any number of rows up
to :data:`MAX_ROWS`.

The library is compiled on first use with the system's C++ compiler (``$CXX``,
else ``c++``) against the FFI headers that jaxlib ships, and cached under
``$SPECJAX_CACHE_DIR`` (default ``~/.cache/specjax``). Where it cannot be
built, ``matmul="auto"`` falls back to XLA's dot with one warning.

Each output element is summed in the same order whatever the number of rows,
so a row's result does not depend on the rows it is batched with: a
verification block's logits for a token are the same whether it verifies 2
or 16 tokens. (One row goes to XLA's dot, which sums in another order.)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from specjax._src.kernels import platforms

Array = jax.Array

#: Rows (the product of every dimension but the last) that ``applies`` sends
#: to the kernels. One row stays with XLA, whose own matrix-vector loop is as
#: fast; from 24 rows on, XLA's packed GEMM is (``benchmarks/cpu_matmul.py``).
MIN_ROWS, MAX_ROWS = 2, 16

#: ``"pallas"``: quantized products by the Pallas kernels on a GPU or TPU (kernels/pallas_qmatmul.py);
#: on a CPU it is ``"auto"``.
MATMUL_MODES = ("auto", "xla", "kernel", "pallas")

# cpu_qmatmul.cc: the same products with int8 and 4-bit weights
# (specjax._src.kernels.quant); both are built into one library.
_HERE = Path(__file__).parent
_SOURCES = (_HERE / "cpu_matmul.cc", _HERE / "cpu_qmatmul.cc")
_HEADERS = (_HERE / "parallel_columns.h", _HERE / "cpu_qmatmul_body.inc")
_TARGETS = {
    "nn": ("specjax_matmul", "SpecjaxMatmul"),
    "nt": ("specjax_matmul_nt", "SpecjaxMatmulNt"),
    "int8": ("specjax_qmatmul_int8", "SpecjaxQMatmulInt8"),
    "q4": ("specjax_qmatmul_q4", "SpecjaxQMatmulQ4"),
    "expert": ("specjax_matmul_expert", "SpecjaxMatmulExpert"),
    "int8_expert": ("specjax_qmatmul_int8_expert", "SpecjaxQMatmulInt8Expert"),
    "q4_expert": ("specjax_qmatmul_q4_expert", "SpecjaxQMatmulQ4Expert"),
}
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")

_lock = threading.Lock()
_state: dict = {}  # "error": None once loaded, else why not; "warned"
_registered: list = []  # the loaded library, once its targets are registered (once per process)


class KernelUnavailableError(RuntimeError):
    """The CPU matmul library could not be built or loaded."""


def cache_dir() -> Path:
    """Where the compiled library is kept: ``$SPECJAX_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/specjax``, else ``~/.cache/specjax``."""
    if os.environ.get("SPECJAX_CACHE_DIR"):
        return Path(os.environ["SPECJAX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specjax"


def _compiler() -> list[str]:
    cxx = os.environ.get("CXX")
    if cxx:
        return shlex.split(cxx)
    found = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if found is None:
        raise KernelUnavailableError(
            "no C++ compiler found (set $CXX, or install g++ or clang++) to build specjax's CPU matmul kernels"
        )
    return [found]


def _library_path(cxx: list[str]) -> Path:
    digest = hashlib.sha256()
    parts = [f.read_bytes() for f in (*_SOURCES, *_HEADERS)]
    for part in (*parts, jaxlib.__version__.encode(), " ".join(cxx + list(_FLAGS)).encode()):
        digest.update(part)
        digest.update(b"\0")
    return cache_dir() / "kernels" / f"cpu_matmul-{digest.hexdigest()[:16]}.so"


def _build(cxx: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compiled in a private directory beside the target, then renamed:
    # concurrent processes (pytest workers) never load a half-written library,
    # and the compiler creates the file itself, with the user's umask (a
    # cache shared between users stays readable by the next one).
    with tempfile.TemporaryDirectory(prefix=out.stem + ".", dir=out.parent) as tmp_dir:
        tmp = os.path.join(tmp_dir, out.name)
        cmd = [*cxx, *_FLAGS, "-I", jax.ffi.include_dir(), *map(str, _SOURCES), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelUnavailableError(
                f"compiling specjax's CPU matmul kernels failed ({shlex.join(cmd)}):\n{done.stderr.strip()[-2000:]}"
            )
        os.replace(tmp, out)


def _load() -> None:
    """Builds (once per source and jaxlib version) and registers the kernels."""
    cxx = _compiler()
    path = _library_path(cxx)
    if not path.exists():
        _build(cxx, path)
    if _registered:  # XLA refuses a second registration of a name
        return
    # Any failure to bind (not a shared library, another architecture, a
    # library without the kernels' symbols) means the kernels are unavailable,
    # never an error in decode.
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
        handlers = {target: jax.ffi.pycapsule(getattr(lib, symbol)) for target, symbol in _TARGETS.values()}
    except (OSError, AttributeError) as e:
        raise KernelUnavailableError(
            f"loading {path} failed ({e}); it is not the library specjax builds: delete it to rebuild"
        ) from e
    for target, handler in handlers.items():
        jax.ffi.register_ffi_target(target, handler, platform="cpu")
    _registered.append(lib)


def ensure_loaded() -> None:
    """Builds and registers the kernels if they are not yet.

    Raises:
      KernelUnavailableError: with the reason, where they cannot be built.
    """
    with _lock:
        if "error" not in _state:
            try:
                _load()
                _state["error"] = None
            except KernelUnavailableError as e:
                _state["error"] = str(e)
            except (OSError, subprocess.SubprocessError) as e:
                _state["error"] = f"building specjax's CPU matmul kernels failed: {e}"
        error = _state["error"]
    if error is not None:
        raise KernelUnavailableError(error)


def is_available() -> bool:
    """Whether the kernels are built and registered (building them if needed)."""
    try:
        ensure_loaded()
    except KernelUnavailableError:
        return False
    return True


def ffi_target(kind: str) -> str:
    """The FFI target name of a kernel: ``"nn"``, ``"nt"`` (float), ``"int8"`` or ``"q4"`` (quantized)."""
    return _TARGETS[kind][0]


def check_mode(matmul: str) -> str:
    if matmul not in MATMUL_MODES:
        raise ValueError(f"matmul must be one of {', '.join(map(repr, MATMUL_MODES))}, got {matmul!r}.")
    return matmul


def kernel_wanted(matmul: str) -> bool:
    if matmul == "xla":
        return False
    if matmul == "kernel":
        ensure_loaded()
        return True
    if is_available():
        return True
    with _lock:
        if not _state.get("warned"):
            _state["warned"] = True
            warnings.warn(
                f"{_state['error']}\nspecjax falls back to XLA's dot on the CPU, which is slower for "
                "speculative verification; pass matmul='xla' to silence this.",
                RuntimeWarning,
                stacklevel=4,
            )
    return False


def _ffi(kind: str, x: Array, w: Array) -> Array:
    n = w.shape[0] if kind == "nt" else w.shape[1]
    call = jax.ffi.ffi_call(
        _TARGETS[kind][0], jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), vmap_method="sequential"
    )
    return call(x, w)


def _xla(kind: str, x: Array, w: Array) -> Array:
    dims = (((1,), (1,)), ((), ())) if kind == "nt" else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rows_matmul(kind: str, x: Array, w: Array) -> Array:
    # The kernel on the CPU; XLA's dot wherever else the program is lowered.
    return platforms.platform_dependent(x, w, cpu=functools.partial(_ffi, kind), default=functools.partial(_xla, kind))


def _rows_matmul_fwd(kind, x, w):
    return _rows_matmul(kind, x, w), (x, w)


def _rows_matmul_bwd(kind, residuals, g):
    x, w = residuals
    if kind == "nt":  # y = x @ w.T
        return g @ w, g.T @ x
    return g @ w.T, x.T @ g


_rows_matmul.defvjp(_rows_matmul_fwd, _rows_matmul_bwd)


def applies(x: Array, w: Array, matmul: str) -> bool:
    """Whether ``x[..., K] @ w`` goes to the kernel: float32 operands,
    :data:`MIN_ROWS` to :data:`MAX_ROWS` rows, ``matmul`` not ``"xla"`` and
    the kernels built."""
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    if x.dtype != jnp.float32 or w.dtype != jnp.float32 or w.ndim != 2 or not MIN_ROWS <= rows <= MAX_ROWS:
        return False
    return kernel_wanted(matmul)


def matmul(x: Array, w: Array, *, transpose_w: bool = False) -> Array:
    """``x[..., K] @ w[K, N]`` (or ``@ w[N, K].T``) as one few-row product.

    Float32 only, at most :data:`MAX_ROWS` rows; on other platforms the same
    product by XLA's dot. Differentiable (the gradient uses XLA's dots).
    """
    ensure_loaded()
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise TypeError(f"the CPU matmul kernels take float32 operands, got {x.dtype} and {w.dtype}.")
    if w.ndim != 2 or x.shape[-1] != w.shape[1 if transpose_w else 0]:
        raise ValueError(f"cannot multiply x {x.shape} by w {w.shape} (transpose_w={transpose_w}).")
    if not 0 < rows <= MAX_ROWS:
        raise ValueError(f"the CPU matmul kernels take 1 to {MAX_ROWS} rows, got {rows} (x {x.shape}).")
    out = _rows_matmul("nt" if transpose_w else "nn", x.reshape(rows, x.shape[-1]), w)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def dense_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, matmul_mode="auto"):
    """A ``lax.dot_general`` for ``flax.linen.Dense`` that sends few-row
    float32 products (``matmul_mode`` permitting) to the kernel."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    plain = (
        tuple(lhs_contract) == (lhs.ndim - 1,)
        and tuple(rhs_contract) == (0,)
        and not lhs_batch
        and not rhs_batch
        and precision is None
    )
    if plain and applies(lhs, rhs, matmul_mode):
        return matmul(lhs, rhs).astype(preferred_element_type or lhs.dtype)
    return jax.lax.dot_general(
        lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type
    )


def _expert_ffi(x: Array, stack: Array, index: Array) -> Array:
    call = jax.ffi.ffi_call(_TARGETS["expert"][0], jax.ShapeDtypeStruct((x.shape[0], stack.shape[2]), jnp.float32),
                            vmap_method="sequential")
    return call(x, stack, index.astype(jnp.int32))


def _expert_xla(x: Array, stack: Array, index: Array) -> Array:
    return _xla("nn", x, jax.lax.dynamic_index_in_dim(stack, index, keepdims=False))


@jax.custom_vjp
def _expert_matmul(x: Array, stack: Array, index: Array) -> Array:
    return platforms.platform_dependent(x, stack, index, cpu=_expert_ffi, default=_expert_xla)


def _expert_matmul_fwd(x, stack, index):
    return _expert_matmul(x, stack, index), (x, stack, index)


def _expert_matmul_bwd(residuals, g):
    x, stack, index = residuals
    w = jax.lax.dynamic_index_in_dim(stack, index, keepdims=False)
    grad_stack = jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(stack), x.T @ g, index, 0)
    return g @ w.T, grad_stack, np.zeros(np.shape(index), jax.dtypes.float0)


_expert_matmul.defvjp(_expert_matmul_fwd, _expert_matmul_bwd)


def expert_dot(x: Array, stack: Array, index: Array, *, preferred_element_type=None, matmul_mode: str = "auto"):
    """``x[R, K] @ stack[index]``, one expert's ``[K, N]`` matrix of a stack ``[E, K, N]``.

    With float32 operands and 1 to :data:`MAX_ROWS` rows (``matmul_mode``
    permitting), the kernel reads the expert's matrix inside the stack: a
    dynamic index would copy it out first, doubling the bytes a routed
    expert's product moves. Otherwise (and on other platforms) the index and
    :func:`dense_dot_general`. ``index`` is clamped into the stack.
    """
    if x.ndim != 2 or stack.ndim != 3 or x.shape[1] != stack.shape[1]:
        raise ValueError(f"expert_dot multiplies rows x[R, K] by one expert of a stack [E, K, N]; got x {x.shape} "
                         f"and a stack {stack.shape}.")
    rows = x.shape[0]
    if x.dtype == jnp.float32 and stack.dtype == jnp.float32 and 0 < rows <= MAX_ROWS and kernel_wanted(matmul_mode):
        return _expert_matmul(x, stack, jnp.asarray(index, jnp.int32)).astype(preferred_element_type or x.dtype)
    w = jax.lax.dynamic_index_in_dim(stack, index, keepdims=False)
    return dense_dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=preferred_element_type,
                             matmul_mode=matmul_mode)


def _reset_for_tests(error: Optional[str] = None) -> None:
    """Forgets the load state (not the registration); with ``error``, pretends
    the build failed."""
    with _lock:
        _state.clear()
        if error is not None:
            _state["error"] = error
