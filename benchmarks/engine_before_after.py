"""The chain loop's speed before and after an engine change, measured in one run.

Two checkouts of specjax (``--before`` a git worktree of the old commit, and
this one) run the same decode calls in alternating subprocesses (before,
after, after, before, ...: who goes first alternates by round), each
compiling once and then timing ``--calls`` calls. Reported: the median tok/s
of each, and the median and range of the per-round ratios (each round's two
runs back to back, so load drift cancels).

    git worktree add /tmp/specjax-before 16f205f
    python benchmarks/engine_before_after.py --before /tmp/specjax-before
    python benchmarks/engine_before_after.py --before /tmp/specjax-before --configs 3 4 \
        --target smollm2-135m-instruct --draft smollm2-135m-instruct-eagle --num-draft 3 --new-tokens 128
    python benchmarks/engine_before_after.py --before /tmp/specjax-before --configs 3 4 \
        --target smollm2-135m-instruct --draft smollm2-135m-instruct-eagle --tree dynamic:4,2,6 \
        --chat-prompts 16 --new-tokens 128

Prompts: ``--batch``-many random token rows of 24 by default; with
``--chat-prompts N`` the first N held-out chat prompts
(``benchmarks/prompts/heldout_chat_64.jsonl``), one after another at batch 1
with the target's EOS, so that tau is a chat prompt's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs inside the subprocess, with the checkout under test first on sys.path.
CHILD = r"""
import json, sys, time
import jax, numpy as np
import specjax
from specjax.rules import parse_rule
cfg = json.loads(sys.argv[1])
target, draft = specjax.load(cfg["target"]), specjax.load(cfg["draft"])
pair = specjax.pair(target, draft)
rng = np.random.default_rng(0)
kw = dict(max_new_tokens=cfg["new_tokens"], temperature=cfg["temperature"], eos_token_id=(), key=jax.random.key(0))
if cfg["chat_prompts"]:
    rows = [json.loads(line)["prompt"] for line in open(cfg["chat_file"])][: cfg["chat_prompts"]]
    groups = [[specjax.encode_chat(target, text)] for text in rows]
    kw["eos_token_id"] = tuple(target.module.config.eos_token_ids)
else:
    groups = [[rng.integers(5, 1000, size=24).tolist() for _ in range(cfg["batch"])]]
if cfg["rule"] == "target-only":
    one = lambda prompts: specjax.generate(target, prompts, **kw)
else:
    kw.update(rule=parse_rule(cfg["rule"]))
    if cfg["tree"]:
        kw.update(tree=specjax.trees.parse_tree(cfg["tree"]))
    else:
        kw.update(num_draft=cfg["num_draft"])
    one = lambda prompts: specjax.decode(pair, prompts, **kw)

def call():
    outs = [one(prompts) for prompts in groups]
    jax.block_until_ready([o.tokens for o in outs])
    return outs

call()
times = []
for _ in range(cfg["calls"]):
    t0 = time.perf_counter()
    outs = call()
    times.append(time.perf_counter() - t0)
tokens = sum(int(np.sum(o.lengths)) for o in outs)
if getattr(outs[0], "stats", None) is not None:
    tau = sum(float(np.sum(o.stats.tokens)) for o in outs) / sum(float(np.sum(o.stats.cycles)) for o in outs)
else:
    tau = float("nan")
print(json.dumps({"tok_s": tokens / statistics.median(times), "tau": tau, "file": specjax.__file__}))
"""


def run_child(checkout: pathlib.Path, cfg: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    code = "import statistics\n" + CHILD
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], env=env, cwd=checkout,
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not pathlib.Path(result["file"]).resolve().is_relative_to(checkout.resolve()):
        raise RuntimeError(f"{checkout}: the child imported specjax from {result['file']}, not from the checkout")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, type=pathlib.Path, help="checkout of the old commit")
    ap.add_argument("--after", type=pathlib.Path, default=ROOT)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--target", default=str(ROOT / "specjax/assets/models/target"))
    ap.add_argument("--draft", default=str(ROOT / "specjax/assets/models/draft"))
    ap.add_argument("--configs", type=int, nargs="+", default=None, help="run only these rows (0-based)")
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tree", default=None, help='a token tree instead of the K-chain, e.g. "dynamic:4,2,6"')
    ap.add_argument("--chat-prompts", type=int, default=0, metavar="N",
                    help="decode the first N held-out chat prompts one by one (batch 1) instead of random rows")
    args = ap.parse_args()
    k, n = args.num_draft, args.new_tokens
    configs = [
        dict(rule="speculative_sampling", temperature=1.0, batch=1, num_draft=k, new_tokens=n),
        dict(rule="mars:theta=0.9", temperature=0.0, batch=1, num_draft=k, new_tokens=n),
        dict(rule="speculative_sampling", temperature=1.0, batch=8, num_draft=k, new_tokens=n),
        dict(rule="speculative_sampling", temperature=0.0, batch=1, num_draft=k, new_tokens=n),
        dict(rule="target-only", temperature=0.0, batch=1, num_draft=k, new_tokens=n),
    ]
    if args.configs is not None:
        configs = [configs[i] for i in args.configs]
    print(f"load average at start: {os.getloadavg()}")
    print("| rule | T | batch | before tok/s | after tok/s | after/before: median of rounds [min-max] | tau before/after |")
    print("|---|---|---|---|---|---|---|")
    for c in configs:
        cfg = dict(c, calls=args.calls, target=args.target, draft=args.draft, tree=args.tree,
                   chat_prompts=args.chat_prompts, chat_file=str(ROOT / "benchmarks/prompts/heldout_chat_64.jsonl"))
        before, after = [], []
        for i in range(args.rounds):  # who goes first alternates, so that a drift favours neither
            if i % 2:
                after.append(run_child(args.after, cfg))
                before.append(run_child(args.before, cfg))
            else:
                before.append(run_child(args.before, cfg))
                after.append(run_child(args.after, cfg))
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(after, before)]
        print(f"| {c['rule']} | {c['temperature']:g} | {c['batch']} | "
              f"{statistics.median(b['tok_s'] for b in before):.1f} | {statistics.median(a['tok_s'] for a in after):.1f} | "
              f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] | "
              f"{before[0]['tau']:.3f} / {after[0]['tau']:.3f} |", flush=True)
        print("rounds (before, after tok/s): " + ", ".join(f"{b['tok_s']:.1f} / {a['tok_s']:.1f}"
                                                          for a, b in zip(after, before)), flush=True)
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
