"""Time to the first token of the 4-bit (or int8) target before and after a change, in one run.

Two checkouts (``--before``, a git worktree of the old commit, and this one) take turns in
subprocesses (who goes first alternates by round). Each loads the target with
``quantize=...``, compiles, then times ``generate(target, [prompt], max_new_tokens=1)`` on each
prompt, ``--calls`` times, keeping each prompt's fastest call: the prompt's prefill (64-row
chunks) and the step that emits its first token. Prompts: the first ``--prompts`` held-out chat
prompts in the chat template (about 40 tokens: one chunk), and ``--long-prompts`` prompts of
about ``--long-tokens`` tokens (several held-out prompts joined). Reported per prompt class:
the median over prompts and rounds of each checkout's milliseconds, and the per-round ratio
before / after (median [min-max]). The first tokens are checked equal between the checkouts.

    git worktree add /tmp/specjax-before HEAD~1
    python benchmarks/prefill_before_after.py --before /tmp/specjax-before
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "benchmarks/prompts/heldout_chat_64.jsonl"

CHILD = r"""
import json, sys, time
import jax, numpy as np
import specjax
cfg = json.loads(sys.argv[1])
target = specjax.load(cfg["target"], quantize=cfg["quantize"])
texts = [json.loads(line)["prompt"] for line in open(cfg["prompts_file"])]
short = [specjax.encode_chat(target, t) for t in texts[: cfg["prompts"]]]
long, at = [], cfg["prompts"]
for _ in range(cfg["long_prompts"]):
    ids = []
    while len(ids) < cfg["long_tokens"]:
        ids += specjax.encode_chat(target, texts[at % len(texts)])
        at += 1
    long.append(ids[: cfg["long_tokens"]])
out = {"file": specjax.__file__}
for name, prompts in (("short", short), ("long", long)):
    ms, firsts, lengths = [], [], []
    for p in prompts:
        one = lambda: jax.block_until_ready(specjax.generate(target, [p], max_new_tokens=1, temperature=0.0).tokens)
        first = one()  # compiles this prompt's width once
        best = float("inf")
        for _ in range(cfg["calls"]):
            t0 = time.perf_counter(); one(); best = min(best, time.perf_counter() - t0)
        ms.append(1e3 * best); firsts.append(int(np.asarray(first)[0, 0])); lengths.append(len(p))
    out[name] = {"ms": ms, "first": firsts, "lengths": lengths}
print(json.dumps(out))
"""


def run_child(checkout: pathlib.Path, cfg: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cfg)], env=env, cwd=checkout, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"{checkout}: {done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not pathlib.Path(result["file"]).resolve().is_relative_to(checkout.resolve()):
        raise RuntimeError(f"{checkout}: the child imported specjax from {result['file']}, not from the checkout")
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, type=pathlib.Path, help="checkout of the old commit")
    ap.add_argument("--after", type=pathlib.Path, default=ROOT)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--quantize", default="gguf", help='load(quantize=...): "gguf" (the file\'s 4-bit blocks), "int8"')
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--long-prompts", type=int, default=2)
    ap.add_argument("--long-tokens", type=int, default=500)
    ap.add_argument("--calls", type=int, default=5, help="timed calls per prompt (the fastest is kept)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    cfg = dict(
        target=args.target,
        quantize=args.quantize,
        prompts=args.prompts,
        long_prompts=args.long_prompts,
        long_tokens=args.long_tokens,
        calls=args.calls,
        prompts_file=str(PROMPTS),
    )
    report = common.Report(f"time to first token, {args.before} against {args.after}")
    report.text(common.machine())
    runs = []
    for i in range(args.rounds):  # who goes first alternates, so that a drift favours neither
        order = ("after", "before") if i % 2 else ("before", "after")
        runs.append({who: run_child(args.before if who == "before" else args.after, cfg) for who in order})
    rows = []
    for name in ("short", "long"):
        if not runs[0]["before"][name]["ms"]:
            continue
        same = all(r["before"][name]["first"] == r["after"][name]["first"] for r in runs)
        before = [x for r in runs for x in r["before"][name]["ms"]]
        after = [x for r in runs for x in r["after"][name]["ms"]]
        ratios = [statistics.median(r["before"][name]["ms"]) / statistics.median(r["after"][name]["ms"]) for r in runs]
        lengths = runs[0]["after"][name]["lengths"]
        rows.append(
            [
                name,
                f"{min(lengths)}-{max(lengths)}",
                f"{statistics.median(before):.1f}",
                f"{statistics.median(after):.1f}",
                f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]",
                "equal" if same else "DIFFER",
            ]
        )
    report.table(
        f"{args.target}, quantize={args.quantize}: ms to the first token (each prompt's fastest of "
        f"{args.calls} calls), {args.rounds} rounds alternating",
        ["prompts", "tokens", "before ms", "after ms", "before / after [rounds]", "first tokens"],
        rows,
    )
    report.write(args.markdown)


if __name__ == "__main__":
    main()
