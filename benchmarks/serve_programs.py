"""What the programs `specjax serve` picks cost, side by side in one run.

Two comparisons on the real pair (SmolLM2-135M-Instruct + its EAGLE head, float32, the context
lookup, K=3, 8 slots of 384 positions), each contender compiled first, then the contenders in
turn for ``--rounds`` rounds (so a load change on a shared machine hits them alike):

* **a step of 8 requests**, greedy and at T=0.7 (a temperature only, each its own seed): ms per
  cycle of one-cycle steps in the general program (the logits processors and the top-k / top-p
  filters compiled in, every request at its defaults) and in the program that
  ``Engine(specialized_steps=True)`` runs for them (``"greedy"``, ``"sampled"``); with the tokens
  each committed (equal: the same requests decode the same tokens in both);
* **prefilling 8 chat prompts** (the held-out chat prompts with the chat template, 35-51 tokens):
  one ``insert_many`` of 8, two of 4, and eight single inserts, in an engine with prompt width
  buckets of 16, 32, 64, ... and in one with a single width (``prompt_bucket=capacity``, as
  ``specjax serve`` builds it up to 512 positions);
* **a cycle in the slot engine against one in ``decode``** (``--cycles``): the 8 requests at T=0.7,
  each its own seed, without EOS, to 96 new tokens: ms per cycle of the server's steps (up to 4
  cycles each, in 384-position slots) against ``decode``'s cycles of the same batch (its cache
  sized to the batch: 195 positions), prefills left out of both. Both commit the same tokens in
  the same number of cycles; a ratio above 1 is what the engine's slots cost over a batch's
  tight cache;
* **the target's forward by rows** (``--forward-rows``: ``[1, n]`` tokens into a fresh cache of
  the slots' length, as a prefill block runs it): what one pass over the weights costs and what
  each more row adds, which bounds what a prefill sharing the step's forward (chunked prefill)
  could save on this machine.

    python benchmarks/serve_programs.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

import specjax
from specjax.drafting import ngram_lookup
from specjax.engine import Engine, SlotSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SLOTS, CAPACITY, K = 8, 384, 3
PROMPTS = Path(__file__).resolve().parent / "prompts" / "heldout_chat_64.jsonl"


def engine(pair, **kw) -> Engine:
    return Engine(pair, num_slots=SLOTS, capacity=CAPACITY, num_draft=K, lookup=ngram_lookup(2),
                  donate_state=True, **kw)


def step_contender(eng: Engine, prompts, temperature: float, counted: list):
    """A ``run()``: one one-cycle step of 8 requests (inserted once, stepped on and on)."""
    settings = [SlotSettings(temperature=temperature, seed=slot, max_new_tokens=CAPACITY - max(map(len, prompts)),
                             eos_token_id=()) for slot in range(SLOTS)]
    box = [eng.insert_many(eng.init(), list(range(SLOTS)), prompts, settings)]

    def run():
        box[0], out = eng.step(box[0], 1)
        counted.append(int(np.asarray(out.counts).sum()))
    return run


def step_state(eng: Engine, prompts, temperature: float):
    """A state of 8 requests at ``temperature``, to ask which program a step would run."""
    return eng.insert_many(eng.init(), list(range(SLOTS)), prompts,
                           [SlotSettings(temperature=temperature, max_new_tokens=8)] * SLOTS)


def prefill_contender(eng: Engine, prompts, group: int):
    """A ``run()``: the 8 prompts inserted ``group`` at a time into free slots, then released."""
    settings = SlotSettings(temperature=0.0, max_new_tokens=16)
    box = [eng.init()]

    def run():
        state = box[0]
        for start in range(0, SLOTS, group):
            slots = list(range(start, start + group))
            state = eng.insert_many(state, slots, prompts[start:start + group], [settings] * group)
        jax.block_until_ready(state)
        for slot in range(SLOTS):
            state = eng.release(state, slot)
        box[0] = state
    return run


def forward_contender(model, tokens: int):
    """A ``run()``: the model's forward of ``[1, tokens]`` tokens into a fresh cache of the slots'
    length, keeping the cache alone, as a prefill block runs it."""
    fn = jax.jit(lambda params, ids: model.module.apply(params, ids, model.module.init_cache(1, CAPACITY)).cache)
    ids = np.ones((1, tokens), np.int32)
    return lambda: jax.block_until_ready(fn(model.params, ids))


def cycle_comparison(eng: Engine, pair, prompts, rounds: int, new_tokens: int = 96):
    """Per round, ``(engine ms per cycle, decode ms per cycle, cycles, tokens equal)`` for the 8
    requests at T=0.7 to ``new_tokens`` tokens, without EOS, prefills left out of both."""
    settings = [SlotSettings(temperature=0.7, seed=i, max_new_tokens=new_tokens, eos_token_id=()) for i in range(SLOTS)]
    keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), 0))(np.arange(SLOTS))
    kw = dict(num_draft=K, temperature=0.7, lookup=ngram_lookup(2), eos_token_id=())

    def decode(n):
        t0 = time.perf_counter()
        out = specjax.decode(pair, prompts, key=keys, max_new_tokens=n, **kw)
        jax.block_until_ready(out.tokens)
        return time.perf_counter() - t0, out

    def slots():
        state = eng.insert_many(eng.init(), list(range(SLOTS)), prompts, settings)
        jax.block_until_ready(state)
        got, elapsed = [[] for _ in range(SLOTS)], 0.0
        while True:
            t0 = time.perf_counter()
            state, out = eng.step(state, 4)
            out = jax.device_get(out)
            elapsed += time.perf_counter() - t0
            for i in range(SLOTS):
                got[i] += out.tokens[i, : out.counts[i]].tolist()
            if out.done.all():
                return elapsed, got, int(np.asarray(state.loop.stats.cycles).max())

    decode(new_tokens), decode(1), slots()  # compile
    results = []
    for _ in range(rounds):
        full, out = decode(new_tokens)
        first, _ = decode(1)
        cycles = int(np.asarray(out.stats.cycles).max())
        elapsed, got, engine_cycles = slots()
        equal = got == out.to_lists() and engine_cycles == cycles
        results.append((elapsed / engine_cycles, (full - first) / (cycles - 1), cycles, equal))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--forward-rows", type=int, nargs="*", default=[4, 16, 32, 64],
                    help="token counts of the [1, n] target forwards to time (none: skip them)")
    ap.add_argument("--cycles", action=argparse.BooleanOptionalAction, default=True,
                    help="compare a cycle in the slot engine with one in decode (default on)")
    args = ap.parse_args(argv)
    print(common.header("serve_programs: the programs specjax serve picks"))
    target = specjax.load("smollm2-135m-instruct", dtype="float32")
    draft = specjax.load("smollm2-135m-instruct-eagle", dtype="float32")
    pair = specjax.pair(target, draft)
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()][:SLOTS]
    prompts = [specjax.encode_chat(target, t) for t in texts]
    print(f"prompt lengths: {sorted(map(len, prompts))}")

    general, specialized = engine(pair), engine(pair, specialized_steps=True)
    steps, tokens = {}, {}
    for temperature, program in ((0.0, "greedy"), (0.7, "sampled")):
        for eng in (general, specialized):
            name = f"T={temperature}, {eng.step_program(step_state(eng, prompts, temperature))} program"
            tokens[name] = []
            steps[name] = step_contender(eng, prompts, temperature, tokens[name])
    step_times = common.alternate(steps, args.rounds, warmup=2)

    bucketed, one_width = engine(pair), engine(pair, prompt_bucket=CAPACITY)
    prefills = {f"{label}, {'one group of 8' if g == 8 else f'groups of {g}' if g > 1 else 'one by one'}":
                prefill_contender(eng, prompts, g)
                for label, eng in (("width buckets", bucketed), ("one width", one_width)) for g in (8, 4, 1)}
    prefill_times = common.alternate(prefills, args.rounds)
    cycles = cycle_comparison(engine(pair, specialized_steps=True), pair, prompts, args.rounds) if args.cycles else []
    forwards = {f"[1, {n}]": forward_contender(target, n) for n in args.forward_rows}
    forward_times = common.alternate(forwards, args.rounds) if forwards else {}
    print(common.load_average() + " (at end)")

    rows = [[name, f"{1e3 * statistics.median(ts):.0f}", f"{1e3 * min(ts):.0f} .. {1e3 * max(ts):.0f}",
             sum(tokens[name][2:])] for name, ts in step_times.items()]
    print("\nA one-cycle step of 8 requests:")
    print(common.table(["requests, program", f"ms, median of {args.rounds}", "min .. max", "tokens committed"], rows,
                       markdown=True))
    for temperature, program in ((0.0, "greedy"), (0.7, "sampled")):
        ratios = common.pair_ratios(step_times[f"T={temperature}, general program"],
                                    step_times[f"T={temperature}, {program} program"])
        print(f"T={temperature}: general / {program}: {common.ratio_cell(ratios)}")
    rows = [[name, f"{1e3 * statistics.median(ts):.0f}", f"{1e3 * min(ts):.0f} .. {1e3 * max(ts):.0f}"]
            for name, ts in prefill_times.items()]
    print("\nPrefilling the 8 prompts:")
    print(common.table(["engine, inserts", f"ms, median of {args.rounds}", "min .. max"], rows, markdown=True))
    if forward_times:
        rows = [[name, f"{1e3 * statistics.median(ts):.1f}", f"{1e3 * min(ts):.1f} .. {1e3 * max(ts):.1f}"]
                for name, ts in forward_times.items()]
        print("\nThe target's forward as a prefill block runs it:")
        print(common.table(["tokens", f"ms, median of {args.rounds}", "min .. max"], rows, markdown=True))
        ones = sorted((n, statistics.median(forward_times[f"[1, {n}]"])) for n in args.forward_rows)
        if len(ones) > 1:
            (n0, t0), (n1, t1) = ones[0], ones[-1]
            per_row = (t1 - t0) / (n1 - n0)
            print(f"each row from {n0} to {n1}: {1e3 * per_row:.2f} ms; a pass at no rows (extrapolated): "
                  f"{1e3 * (t0 - n0 * per_row):.1f} ms")
    if cycles:
        print("\nA cycle of the 8 requests at T=0.7 (96 new tokens, no EOS), prefills left out:")
        rows = [[i, f"{1e3 * e:.1f}", f"{1e3 * d:.1f}", f"{e / d:.2f}x", c, "yes" if eq else "NO"]
                for i, (e, d, c, eq) in enumerate(cycles)]
        print(common.table(["round", "slot engine ms/cycle", "decode ms/cycle", "engine / decode", "cycles",
                            "same tokens"], rows, markdown=True))
        print(f"slot engine / decode per cycle: {common.ratio_cell([e / d for e, d, _, _ in cycles])}")
    one = prefill_times["one width, one by one"]
    for name in ("one width, one group of 8", "one width, groups of 4"):
        print(f"one by one / {name.split(', ')[1]}: {common.ratio_cell(common.pair_ratios(one, prefill_times[name]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
