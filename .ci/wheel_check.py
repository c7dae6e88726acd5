"""The installed wheel on its own: run by .ci/run from outside the repo, in a
virtual environment holding only the wheel (its dependencies come from the
system's site-packages).

It checks what the tests, run against the source tree, cannot: that the wheel
ships every file its CPU kernels' build reads (a wheel without the headers
once gave a specjax whose float products fell back to XLA and that refused
quantized models). So it

1. asserts that ``import specjax`` is the wheel's copy, not the checkout's;
2. builds the kernels from the wheel's sources into an empty cache and checks
   a float, an int8 and a 4-bit product, each lowered to its kernel, against
   numpy in float64;
3. decodes a tiny random quantized pair (``specjax.testing``, nothing
   downloaded) and checks that greedy speculative decoding reproduces the
   quantized target's own ``generate``.

Exits non-zero with the reason on any failure. Not a pytest module (it needs
the wheel installed, and must not import from the checkout).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# An empty kernel cache: the library is compiled from the wheel's own files,
# not taken from a build of the checkout's.
os.environ["SPECJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="specjax-wheel-check-")

start = time.perf_counter()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax._src.kernels import quant  # noqa: E402
from specjax._src.kernels import cpu_matmul  # noqa: E402
from specjax.testing import llama_config, peaked_target_and_draft  # noqa: E402

# A fallback to XLA's dot would hide a kernel that did not build.
warnings.filterwarnings("error", message=".*falls back to XLA", category=RuntimeWarning)


def check(condition: bool, what: str) -> None:
    if not condition:
        sys.exit(f"wheel check FAILED: {what}")
    print(f"ok  {what}")


def close_to_float64(got, x, w_t, what: str) -> None:
    """``got`` is ``x @ w_t`` up to float32 rounding."""
    want = np.asarray(x, np.float64) @ np.asarray(w_t, np.float64)
    bound = 1e-5 * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w_t, np.float64))) + 1e-6
    err = np.abs(np.asarray(got, np.float64) - want)
    check(bool(np.all(err <= bound)), f"{what}: max error {err.max():.2e} within float32 rounding")


# 1. the wheel's specjax
prefix = Path(sys.prefix).resolve()
where = Path(specjax.__file__).resolve()
check(
    where.is_relative_to(prefix) and prefix != Path(sys.base_prefix).resolve(),
    f"specjax is imported from the virtual environment ({where})",
)
kernels_dir = Path(cpu_matmul.__file__).parent
for f in (*cpu_matmul._SOURCES, *cpu_matmul._HEADERS):
    check(f.is_file() and f.parent == kernels_dir, f"the wheel ships {f.name}")

# 2. the kernels, built from the wheel's sources
t = time.perf_counter()
try:
    cpu_matmul.ensure_loaded()
except cpu_matmul.KernelUnavailableError as e:
    sys.exit(f"wheel check FAILED: the CPU kernels did not build from the wheel:\n{e}")
built = list(Path(os.environ["SPECJAX_CACHE_DIR"]).rglob("*.so"))
check(len(built) == 1, f"the kernels compiled into the empty cache in {time.perf_counter() - t:.1f} s")

rng = np.random.default_rng(0)
x = rng.standard_normal((5, 96)).astype(np.float32)  # 5 rows: within the kernels' 2-16
w = rng.standard_normal((96, 70)).astype(np.float32)
product = jax.jit(cpu_matmul.matmul)
check("specjax_matmul" in product.lower(x, w).as_text(), "the float product lowers to the kernel")
close_to_float64(product(x, w), x, w, "float32 product")

for fmt in ("int8", "q4"):
    w_q = (rng.standard_normal((70, 128)) * 0.1).astype(np.float32)  # [N, K]
    leaves = jax.tree_util.tree_map(jnp.asarray, quant.quantize_matrix(w_q, quant.parse_format(fmt)))  # a QArray
    w_hat = np.asarray(quant.dequantize_matrix(leaves))
    xq = rng.standard_normal((4, 128)).astype(np.float32)
    qdot = jax.jit(quant.qdot)
    check("specjax_qmatmul" in qdot.lower(jnp.asarray(xq), leaves).as_text(), f"the {fmt} product lowers to the kernel")
    close_to_float64(qdot(jnp.asarray(xq), leaves), xq, w_hat.T, f"{fmt} product (dequantized weights)")
    check(float(np.abs(w_hat - w_q).max()) > 0, f"{fmt} weights are rounded (the check is not of float weights)")

# 3. a tiny quantized decode
t = time.perf_counter()
target, draft = peaked_target_and_draft(llama_config())
qt, qd = specjax.quantize(target, "q4"), specjax.quantize(draft, "int8")
prompts = [[5, 17, 3], [40, 2, 9, 11, 60]]
kw = dict(max_new_tokens=16, temperature=0.0, eos_token_id=())
alone = np.asarray(specjax.generate(qt, prompts, **kw).tokens)
out = specjax.decode(specjax.pair(qt, qd), prompts, num_draft=3, **kw)
check(
    np.array_equal(np.asarray(out.tokens), alone),
    f"greedy speculative decoding of the q4 target equals its generate ({time.perf_counter() - t:.1f} s)",
)
check(float(out.stats.tau) > 1.0, f"drafts were accepted (tau {float(out.stats.tau):.2f}): verification ran")

print(f"wheel check passed in {time.perf_counter() - start:.1f} s")
