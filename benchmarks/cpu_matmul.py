"""specjax's few-row CPU matmul kernels against XLA's dot, and what they do to a verification forward.

    python benchmarks/cpu_matmul.py                      # both parts, the real target if installed
    python benchmarks/cpu_matmul.py --rows 1 2 4 8 16 24 --skip-model

Part 1, products alone: ``rows x 576`` times thirty distinct ``576 x 1536``
matrices (SmolLM2-135M's MLP shape, chained as in a forward so XLA cannot
overlap them), and the tied LM head ``rows x 576`` times a ``49152 x 576``
table transposed. Part 2: one cached forward of SmolLM2-135M-Instruct
(float32, batch 1, after a 64-token prompt) at each width, with
``Decoder(matmul="xla")`` and with the default ``matmul="auto"``; every cost
is also given as a multiple of XLA's one-token forward, the ``c_verify /
c_AR`` that decides speculative decoding's speed. Contenders alternate
(``common.alternate``); figures are medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

LAYERS, HIDDEN, MLP, VOCAB = 30, 576, 1536, 49152


def _chain(form):
    import jax
    import jax.numpy as jnp

    @jax.jit
    def run(x, ws):
        acc = jnp.zeros((x.shape[0], ws[0].shape[1]), jnp.float32)
        for w in ws:
            acc = acc + form(x, w)
            x = x + 1e-3 * acc[:, : x.shape[1]]
        return acc

    return run


def products(report: common.Report, rows: list[int], rounds: int) -> None:
    import jax
    import jax.numpy as jnp

    from specjax.models import CPU_MATMUL_MAX_ROWS, cpu_matmul

    rng = np.random.default_rng(0)
    mats = [jnp.asarray(rng.standard_normal((HIDDEN, MLP), np.float32) * 0.02) for _ in range(LAYERS)]
    table = jnp.asarray(rng.standard_normal((VOCAB, HIDDEN), np.float32) * 0.02)
    mlp = {"xla": _chain(lambda x, w: x @ w), "kernel": _chain(cpu_matmul)}
    head = {
        "xla": jax.jit(lambda x, t: jnp.einsum("vh,th->vt", t, x).T),
        "kernel": jax.jit(lambda x, t: cpu_matmul(x, t, transpose_w=True)),
    }
    out = []
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, HIDDEN), np.float32))
        fns = {f"{part} {name}": (lambda f=f, a=a: jax.block_until_ready(f(x, a)))
               for part, group, a in (("mlp", mlp, mats), ("head", head, table))
               for name, f in group.items() if name == "xla" or m <= CPU_MATMUL_MAX_ROWS}
        times = common.alternate(fns, rounds)
        ms = {k: 1e3 * common.median(v) for k, v in times.items()}
        cell = lambda part: (f"{ms[part + ' xla']:.2f}", f"{ms[part + ' kernel']:.2f}" if part + " kernel" in ms  # noqa: E731
                             else "-", common.ratio_cell(common.pair_ratios(times[part + " xla"], times[part + " kernel"]))
                             if part + " kernel" in ms else "-")
        out.append([m, *cell("mlp"), *cell("head")])
    report.table(
        f"products alone (ms, median of {rounds}): 30 chained [rows x 576] @ [576 x 1536]; tied head "
        "[rows x 576] @ [49152 x 576]^T",
        ["rows", "mlp xla", "mlp kernel", "xla / kernel", "head xla", "head kernel", "xla / kernel"], out,
    )


def forwards(report: common.Report, widths: list[int], rounds: int, target: str) -> None:
    import jax
    import jax.numpy as jnp

    import specjax

    model = specjax.load(target)
    params = model.params
    modules = {"xla": dataclasses.replace(model.module, matmul="xla"),
               "auto": dataclasses.replace(model.module, matmul="auto")}
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, model.vocab_size, (1, 64)), jnp.int32)
    cache = modules["xla"].apply(params, prompt, modules["xla"].init_cache(1, 128)).cache
    fns = {}
    for name, module in modules.items():
        step = jax.jit(lambda p, c, t, module=module: module.apply(p, t, c).logits)
        for w in widths:
            tokens = jnp.asarray(np.random.default_rng(w).integers(0, model.vocab_size, (1, w)), jnp.int32)
            fns[name, w] = lambda step=step, tokens=tokens: jax.block_until_ready(step(params, cache, tokens))
    times = common.alternate({f"{n} {w}": f for (n, w), f in fns.items()}, rounds)
    ms = {k: 1e3 * common.median(v) for k, v in times.items()}
    one = ms["xla 1"]
    rows = [[w, f"{ms[f'xla {w}']:.1f}", f"{ms[f'xla {w}'] / one:.2f}", f"{ms[f'auto {w}']:.1f}",
             f"{ms[f'auto {w}'] / one:.2f}"] for w in widths]
    report.table(
        f"{target}, one cached forward, float32, batch 1 (ms, median of {rounds}; c/c_AR: over XLA's 1-token forward)",
        ["tokens", "matmul='xla'", "c/c_AR", "matmul='auto'", "c/c_AR"], rows,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 5, 7, 9, 13])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)

    from specjax.models import build_cpu_kernels

    report = common.Report("few-row CPU matmul kernels against XLA's dot")
    build_cpu_kernels()
    products(report, args.rows, args.rounds)
    if not args.skip_model:
        forwards(report, args.widths, args.rounds, args.target)
    report.write(args.markdown)


if __name__ == "__main__":
    main()
