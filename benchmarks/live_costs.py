"""Served requests with auto's costs refreshed from the server's own steps, against the start-up costs.

    python benchmarks/live_costs.py [--clients 1] [--busy] [--prompts 8] [--rounds 2] [--markdown FILE]

The real pair (SmolLM2-135M-Instruct float32 and its EAGLE-3-style head), the
held-out chat prompts, greedy, up to 64 new tokens: ``--clients N`` requests
(consecutive prompts) are submitted together to a :class:`Scheduler` (the
loop ``specjax serve`` runs, in this process, without HTTP) and all waited for
before the next N; tok/s is their tokens over that wall time. Contenders, each
its own engine and scheduler (``--slots``: 4 slots, row buckets 1 and 4; K=3, a donated
state as the server's; not its specialized steps, which would compile three
programs per bucket):

* ``off``: requests with ``num_draft=0`` on the auto engine (what a client
  gets that turns speculation off): one-token verifications, the draft's
  forwards skipped but for its catch-up every K cycles. (On a fixed-K engine
  such a request still verifies K + 1 positions and runs the draft's first
  step every cycle: at four clients with one core busy, auto drafting
  nothing ran 1.95x such requests, 2026-11-29.)
* ``fixed K=3``;
* ``auto, start-up costs``: ``--no-live-costs``;
* ``auto, live costs``: the server's default.

Every scheduler serves two prompts untimed first (compiles; the live costs
start learning there, as a running server's would). Then, for each round and
prompt, every contender serves it once, in a fresh random order each prompt. With
``--busy`` a Python loop keeps one core busy for the whole run, the engines'
cost measurement included. Printed: the start-up costs, what the live costs
timed, then per contender tok/s (median and range over requests), its ratio
to ``off``'s, tokens and drafts per cycle.
"""

import argparse
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import specjax  # noqa: E402
from specjax import drafting  # noqa: E402
from specjax._src.serve import scheduler as sched  # noqa: E402
from specjax.engine import Engine, SlotSettings  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--clients", type=int, default=1, help="requests served at once (default 1)")
ap.add_argument("--slots", type=int, default=4, help="the engines' slots; row buckets 1 and this (default 4)")
ap.add_argument("--busy", action="store_true", help="keep one core busy with a Python loop for the whole run")
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--max-new-tokens", type=int, default=64)
ap.add_argument("--markdown", help="also write the output to this file")
args = ap.parse_args()

busy = common.keep_a_core_busy() if args.busy else None
lines = []


def say(text=""):
    print(text, flush=True)
    lines.append(text)


try:
    rows = common.read_prompt_file(common.ROOT / "benchmarks/prompts/heldout_chat_64.jsonl", ap)[: args.prompts]
    target = specjax.load("smollm2-135m-instruct", dtype="float32")
    pair = specjax.pair(target, specjax.load("smollm2-135m-instruct-eagle", dtype="float32"))
    prompts = [specjax.encode_chat(target, r["prompt"]) for r in rows]
    say(common.header(f"served requests, {args.clients} at once: auto with live costs against start-up costs"
                      + (" (one core kept busy)" if busy else "")))
    # As specjax serve builds its engine (donated state, row buckets), with fewer slots and one program per bucket.
    kw = dict(num_slots=args.slots, capacity=256, num_draft=3, row_buckets=(1, args.slots), prompt_bucket=64,
              donate_state=True)
    fixed = Engine(pair, drafting=drafting.fixed(), **kw)
    auto_start, auto_live = Engine(pair, drafting=drafting.auto(), **kw), Engine(pair, drafting=drafting.auto(), **kw)
    say("start-up costs by row bucket:\n" + auto_start.costs.describe())
    eos = [target.module.config.eos_token_id]
    settings = SlotSettings(temperature=0.0, max_new_tokens=args.max_new_tokens)
    contenders = {
        "off": (auto_start, False, settings._replace(num_draft=0)),
        "fixed K=3": (fixed, True, settings),
        "auto, start-up costs": (auto_start, False, settings),
        "auto, live costs": (auto_live, True, settings),
    }
    schedulers = {}
    for name, (engine, live, _) in contenders.items():
        key = (id(engine), live)
        if key not in schedulers:
            schedulers[key] = sched.Scheduler(engine, target.tokenizer, num_cycles=4, eos_ids=eos, warmup_widths=(64,),
                                              prefill_groups=[1], live_costs=live).start()

    def serve(name, first):
        """``--clients`` requests from prompt ``first`` on, together, to their ends: (tok/s, and their
        tokens, cycles and drafts summed)."""
        engine, live, s = contenders[name]
        scheduler = schedulers[(id(engine), live)]
        finished = threading.Semaphore(0)
        ends = []

        def emit(event):
            if isinstance(event, (sched.Done, sched.Failed)):
                ends.append(event)
                finished.release()

        start = time.perf_counter()
        for i in range(args.clients):
            scheduler.submit(sched.Request(prompt=prompts[(first + i) % len(prompts)], settings=s, emit=emit))
        for _ in range(args.clients):
            if not finished.acquire(timeout=600):
                raise SystemExit(f"{name}: a request did not finish")
        seconds = time.perf_counter() - start
        if not all(isinstance(d, sched.Done) for d in ends):
            raise SystemExit(f"{name}: a request failed: {ends}")
        tokens = sum(d.completion_tokens for d in ends)
        return tokens / seconds, tokens, sum(d.stats["cycles"] for d in ends), sum(d.stats["drafted"] for d in ends)

    for scheduler in schedulers.values():
        if not scheduler.ready.wait(3600):
            raise SystemExit("a scheduler did not warm up")
    for name in contenders:
        for first in range(2):
            serve(name, first)
    results = {name: [] for name in contenders}
    names = list(contenders)
    # A fresh order each prompt: turning one order keeps each contender behind the same other one
    # (benchmarks/auto_drafting.py measured about 4% lost behind the heaviest program that way).
    shuffle = np.random.default_rng(0)
    for _ in range(args.rounds):
        for first in range(0, len(prompts), args.clients):
            for name in shuffle.permutation(names):
                results[str(name)].append(serve(str(name), first))
    live_scheduler = schedulers[(id(auto_live), True)]
    say("live costs timed (median ms per cycle, samples):\n" + live_scheduler.live_costs.describe())
    say("auto with live costs plans with:\n" + auto_live.costs.describe())
    off = np.array(results["off"])[:, 0]
    say(f"\n{'contender':24s} {'tok/s median [range]':>24s} {'x off':>6s} {'[range]':>14s} {'tok/cyc':>8s} "
        f"{'drafts/cyc':>10s}")
    for name, v in results.items():
        a = np.array(v, np.float64)
        ratio = a[:, 0] / off
        say(f"{name:24s} {np.median(a[:, 0]):10.1f} [{a[:, 0].min():5.1f}-{a[:, 0].max():5.1f}] "
            f"{np.median(ratio):6.2f} [{ratio.min():.2f}-{ratio.max():.2f}] {a[:, 1].sum() / a[:, 2].sum():8.2f} "
            f"{a[:, 3].sum() / a[:, 2].sum():10.2f}")
    for scheduler in schedulers.values():
        scheduler.close(drain_seconds=5)
finally:
    if busy is not None:
        busy.kill()
    if args.markdown and lines:
        with open(args.markdown, "w") as f:
            f.write("```\n" + "\n".join(lines) + "\n```\n")
