"""One client served by `specjax serve`'s scheduler, every step traced: where a drafting policy's time goes.

    python benchmarks/serve_step_trace.py                                          # auto, 4-bit
    python benchmarks/serve_step_trace.py --flags "--quantize gguf --drafting fixed --num-draft 3"
    python benchmarks/serve_step_trace.py --also "--quantize gguf --drafting fixed --num-draft 3"

The scheduler is built as ``specjax serve --pair smollm2-eagle --slots 8 --capacity 512 FLAGS``
builds it, run in this process without HTTP, warmed up as the server warms up. One client: each
held-out chat prompt is sent alone, greedy, up to ``--max-tokens`` tokens (EOS honoured), and
waited for, ``--rounds`` rounds. One contender a run by default: two warmed-up schedulers of the real pair
in one process need more memory maps than Linux allows by default (``vm.max_map_count`` 65,530:
XLA's CPU runtime maps each compiled kernel's sections), and the second one's compile aborts with
"LLVM ERROR: Unable to allocate section memory"; the run prints the maps each one holds. Where the
limit is raised (``sudo sysctl -w vm.max_map_count=262144``), ``--also FLAGS`` adds contenders
served in turns with the first, prompt by prompt, which a comparison should prefer. Every step the scheduler
runs is recorded: its cycles, the draft lengths they ran (from the slots' counters) and its
seconds (the step and reading its output back). Printed per contender: tok/s over its requests
(median and range over requests), tokens per cycle, the draft lengths its cycles chose, the steps
auto forced to time other lengths, and milliseconds per cycle of the full steps whose cycles all
drafted the same length, by that length (what a cycle costs each program, served).
"""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PROMPTS = common.ROOT / "benchmarks" / "prompts" / "heldout_chat_64.jsonl"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="the first N held-out chat prompts (default 8)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--flags", default="--quantize gguf", help="`specjax serve` flags of the first contender")
    p.add_argument("--also", action="append", default=[], metavar="FLAGS",
                   help="another contender's flags, served in turns with the first per prompt (needs "
                        "vm.max_map_count raised: see above)")
    p.add_argument("--markdown")
    return p.parse_args(argv)


class Traced:
    """A scheduler whose steps are recorded: ``(cycles run, cycles asked, drafted-slot counts [K], seconds)``
    of the first live slot, and the draft lengths auto forced to time them."""

    def __init__(self, scheduler):
        self.scheduler, self.steps, self.forced = scheduler, [], collections.Counter()
        since, observe = scheduler._since_last_step, scheduler.step_length.observe
        last = {}

        def since_last_step(cycles, drafted_at):
            ran, lengths = since(cycles, drafted_at)
            last["lengths"] = lengths[0] if len(lengths) else None
            return ran, lengths

        def observed(rows, asked, ran, seconds):
            if ran.size and last.get("lengths") is not None:
                self.steps.append((int(ran[0]), int(asked), np.asarray(last["lengths"]), float(seconds)))
            return observe(rows, asked, ran, seconds)

        scheduler._since_last_step, scheduler.step_length.observe = since_last_step, observed
        if scheduler.live_costs is not None:
            explore = scheduler.live_costs.explore

            def explored(*a, **k):
                forced = explore(*a, **k)
                if forced is not None:
                    self.forced[int(forced)] += 1
                return forced

            scheduler.live_costs.explore = explored


def _samples_by_width(live) -> str:
    """The one-row bucket's samples held at the end, by draft length and key width index: median ms
    per cycle and count (what each length is priced against: plain samples of the same width)."""
    by = collections.defaultdict(list)
    for k, samples in enumerate(live._samples[0]):
        for _, seconds, width, *_ in samples:
            by[(k, width)].append(1e3 * seconds)
    return "rows 1 by (length, key width): " + ", ".join(
        f"k={k} w{w}: {common.median(v):.1f} ms x{len(v)}" for (k, w), v in sorted(by.items()))


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except OSError:
        return 0


def _resident_gb() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 2**20


def _memory_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def main(argv=None):
    args = parse_args(argv)
    import specjax
    from specjax._src.serve import scheduler as sched
    from specjax.cli import serve as cli_serve
    from specjax.engine import SlotSettings

    cli_serve.use_compilation_cache(None)
    if args.also and _max_map_count() < 200_000:
        raise SystemExit(f"--also holds two real-pair schedulers in one process, which needs more memory maps than "
                         f"vm.max_map_count ({_max_map_count()}) allows; raise it (sudo sysctl -w "
                         "vm.max_map_count=262144) or run one contender per run.")
    contenders = {flags: ["--pair", "smollm2-eagle", "--slots", "8", "--capacity", "512", *shlex.split(flags)]
                  for flags in [args.flags, *args.also]}
    report = common.Report("one client served in process, every step traced")
    report.text(common.machine())
    traced = {}
    for name, flags in contenders.items():
        parser = argparse.ArgumentParser()
        cli_serve.add_arguments(parser)
        t0 = time.perf_counter()
        scheduler = cli_serve.build(parser.parse_args(flags))[1].start()
        if not scheduler.ready.wait(3600):
            raise SystemExit(f"{name}: the scheduler did not warm up")
        traced[name] = Traced(scheduler)
        report.text(f"`specjax serve {' '.join(flags)}`: ready after {time.perf_counter() - t0:.0f} s, holding "
                    f"{_resident_gb():.1f} GB in {_memory_maps()} memory maps")
    chat = specjax.load("smollm2-135m-instruct", dtype="float32")  # the chat template only
    rows = common.read_prompt_file(PROMPTS, None)[: args.prompts]
    prompts = [specjax.encode_chat(chat, r["prompt"]) for r in rows]

    def serve(scheduler, prompt):
        finished, ends = threading.Semaphore(0), []

        def emit(event):
            if isinstance(event, (sched.Done, sched.Failed)):
                ends.append(event)
                finished.release()

        t0 = time.perf_counter()
        scheduler.submit(sched.Request(prompt=prompt, settings=SlotSettings(temperature=0.0,
                                                                            max_new_tokens=args.max_tokens),
                                       emit=emit))
        if not finished.acquire(timeout=600) or not isinstance(ends[0], sched.Done):
            raise SystemExit(f"a request did not finish: {ends}")
        return ends[0], time.perf_counter() - t0

    for t in traced.values():  # a first request each, untimed (the live costs start learning there)
        serve(t.scheduler, prompts[0])
        t.steps.clear()
        t.forced.clear()
    results = {name: [] for name in traced}
    for _ in range(args.rounds):
        for prompt in prompts:
            for name, t in traced.items():
                done, seconds = serve(t.scheduler, prompt)
                results[name].append((done.completion_tokens, seconds, done.stats["cycles"]))
    table = []
    for name, t in traced.items():
        r = np.array(results[name], np.float64)
        rates = r[:, 0] / r[:, 1]
        lengths = collections.Counter()
        by_length = collections.defaultdict(list)
        for ran, asked, drafted, seconds in t.steps:
            uniform = all(int(x) in (0, ran) for x in drafted)
            if uniform:
                k = int(np.sum(drafted) // ran)
                lengths[k] += ran
                if ran == asked > 1:  # not a new request's one-cycle first step
                    by_length[k].append(1e3 * seconds / ran)
            else:
                lengths["mixed"] += ran
        cells = ", ".join(f"k={k}: {common.median(v):.1f} [{min(v):.1f}-{max(v):.1f}] x{len(v)}"
                          for k, v in sorted(by_length.items()))
        table.append([name, f"{r[:, 0].sum() / r[:, 1].sum():.1f}", f"{common.median(rates):.1f} "
                      f"[{rates.min():.1f}-{rates.max():.1f}]", f"{r[:, 0].sum() / r[:, 2].sum():.2f}",
                      " ".join(f"{k}:{v}" for k, v in sorted(lengths.items(), key=str)),
                      " ".join(f"{k}:{v}" for k, v in sorted(t.forced.items())) or "-", cells])
        if t.scheduler.live_costs is not None:
            report.text(f"{name}: live costs at the end (ms per cycle, samples):\n"
                        + t.scheduler.live_costs.describe() + "\n" + _samples_by_width(t.scheduler.live_costs))
    report.table(f"{len(prompts)} prompts x {args.rounds} rounds, one at a time, greedy, up to {args.max_tokens} "
                 "tokens", ["contender", "tok/s (all)", "tok/s per request [range]", "tokens / cycle",
                            "cycles by draft length", "forced steps by length",
                            "ms per cycle, full steps of one length [range] x steps"], table)
    for t in traced.values():
        t.scheduler.close(drain_seconds=5)
    report.write(args.markdown)


if __name__ == "__main__":
    main()
