"""What chunked prefill does for running streams when long prompts arrive (`specjax serve
--prefill-chunk`), chunking off and on in turn in one run.

The scheduler runs in this process (no HTTP: the times are the scheduler's own events). Per run,
``--short`` sampled requests (short prompts, ``--max-tokens`` each, no EOS) start streaming; once
each has its first text, ``--long`` greedy requests with prompts of ``--long-tokens`` tokens are
submitted at once. Reported per setting (``--prefill-chunk 0``: every prompt prefilled whole, and
each chunk width given): the short requests' gaps between two successive text deltas (what a
reader of the stream waits; a delta holds the tokens of one step) at p50 / p99 / max over all
gaps of all runs, the long requests' time to first text, and each run's wall time. The settings
take turns for ``--rounds`` rounds (a load change on a shared machine hits them alike); each
run has its own scheduler on one engine (its programs compiled once, in the first warm-up).
The short requests' texts are checked equal across settings (chunking changes no output).

    python benchmarks/chunked_prefill.py --pair embedded --rounds 3
    python benchmarks/chunked_prefill.py --pair smollm2-eagle --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

import specjax
from specjax.engine import Engine, SlotSettings
from specjax._src.serve import scheduler as sched

SHORT_TEXTS = ["def fib(n):", "x = 1 + 2", "Write a haiku about the sea.", "class Stack:", "import os\n",
               "The capital of France is", "for i in range(10):", "SELECT * FROM"]
LONG_TEXT = ("The scheduler admits waiting requests into free slots between two steps, releases the "
             "finished ones, and streams each request's new text to its client. A long prompt used to "
             "be prefilled whole. ")


class Consumer:
    def __init__(self):
        self.times, self.text, self.done = [], "", threading.Event()

    def __call__(self, event):
        if isinstance(event, sched.Delta):
            self.times.append(time.perf_counter())
            self.text += event.text
        else:
            self.done.set()


def run_once(engine, tokenizer, eos, chunk: int, args) -> dict:
    scheduler = sched.Scheduler(engine, tokenizer, num_cycles=args.cycles, prefill_chunk=chunk, eos_ids=eos).start()
    try:
        if not scheduler.ready.wait(1800) or scheduler.error is not None:
            raise RuntimeError(f"the scheduler did not start: {scheduler.error}")
        shorts = []
        t0 = time.perf_counter()
        for i in range(args.short):
            c = Consumer()
            ids = tokenizer.encode(SHORT_TEXTS[i % len(SHORT_TEXTS)]).ids
            settings = SlotSettings(temperature=0.7, seed=i, max_new_tokens=args.max_tokens, eos_token_id=())
            scheduler.submit(sched.Request(prompt=ids, settings=settings, emit=c))
            shorts.append(c)
        while not all(c.times for c in shorts):
            time.sleep(0.005)
        longs, submitted = [], time.perf_counter()
        base = tokenizer.encode(LONG_TEXT * 40).ids
        for j in range(args.long):
            c = Consumer()
            ids = base[j * 7: j * 7 + args.long_tokens]
            scheduler.submit(sched.Request(prompt=ids, settings=SlotSettings(temperature=0.0, max_new_tokens=16),
                                           emit=c))
            longs.append(c)
        for c in shorts + longs:
            if not c.done.wait(1800):
                raise RuntimeError("a request did not finish")
        wall = time.perf_counter() - t0
    finally:
        scheduler.close(drain_seconds=1)
    gaps = [b - a for c in shorts for a, b in zip(c.times, c.times[1:])]
    return dict(gaps=gaps, ttft=[c.times[0] - submitted for c in longs], wall=wall,
                texts=[c.text for c in shorts], chunks=scheduler.counters.prefill_chunks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="embedded", choices=["embedded", "smollm2-eagle"])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=None, help="default: 252 (embedded), 512 (smollm2-eagle)")
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--long", type=int, default=2)
    ap.add_argument("--long-tokens", type=int, default=None, help="default: capacity - 24")
    ap.add_argument("--max-tokens", type=int, default=64, help="the short requests' tokens")
    ap.add_argument("--cycles", type=int, default=4, help="cycles per step (specjax serve's default 4)")
    ap.add_argument("--prefill-chunk", type=int, nargs="+", default=[0, 128])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.pair == "embedded":
        target = specjax.load("embedded-target", dtype="float32")
        draft = specjax.load("embedded-draft", dtype="float32")
        capacity, k = args.capacity or 252, 4
    else:
        target = specjax.load("smollm2-135m-instruct", dtype="float32")
        draft = specjax.load("smollm2-135m-instruct-eagle", dtype="float32")
        capacity, k = args.capacity or 512, 3
    args.long_tokens = args.long_tokens or capacity - 24
    # As `specjax serve` builds its engine (cli/serve.py), without the lookup and log-probs.
    engine = Engine(specjax.pair(target, draft), num_slots=args.slots, capacity=capacity, num_draft=k,
                    prompt_bucket=min(capacity, 512), row_buckets="powers", donate_state=True,
                    specialized_steps=True, max_bias=300)
    eos = getattr(target.module.config, "eos_token_id", None)
    eos = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    import jax
    print(f"chunked prefill: pair {args.pair}, {args.slots} slots of {capacity}, K={k}, {args.cycles} cycles a step; "
          f"{args.short} short sampled requests of {args.max_tokens} tokens streaming, then {args.long} greedy "
          f"requests with {args.long_tokens}-token prompts; settings --prefill-chunk {args.prefill_chunk} in turn, "
          f"{args.rounds} rounds; device {jax.devices()[0].platform}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("command: python benchmarks/chunked_prefill.py " + " ".join(sys.argv[1:] if argv is None else argv))
    results = {c: [] for c in args.prefill_chunk}
    for r in range(args.rounds):
        for c in args.prefill_chunk:
            got = run_once(engine, target.tokenizer, eos, c, args)
            results[c].append(got)
            print(f"round {r + 1}, prefill_chunk {c}: max gap {max(got['gaps']) * 1e3:.0f} ms, long TTFT "
                  f"{', '.join(f'{t:.2f}' for t in got['ttft'])} s, wall {got['wall']:.2f} s, "
                  f"{got['chunks']} chunks", flush=True)
    texts = {c: [tuple(run["texts"]) for run in runs] for c, runs in results.items()}
    same = len({t for ts in texts.values() for t in ts}) == 1
    print()
    print(f"| --prefill-chunk | short requests' gap between deltas, ms: p50 | p99 | max | long requests' time "
          f"to first text, s (median) | run wall, s (median) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for c, runs in results.items():
        gaps = np.array([g for run in runs for g in run["gaps"]]) * 1e3
        ttft = statistics.median(t for run in runs for t in run["ttft"])
        wall = statistics.median(run["wall"] for run in runs)
        print(f"| {c or 'off (0)'} | {np.percentile(gaps, 50):.0f} | {np.percentile(gaps, 99):.0f} | "
              f"{gaps.max():.0f} | {ttft:.2f} | {wall:.2f} |")
    print(f"\nThe short requests' texts were the same in every run and setting: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
