"""One request on an 8-slot engine, as ``specjax serve`` builds it (row buckets 1, 2, 4, 8).

    python benchmarks/auto_row_buckets.py

The real pair (SmolLM2-135M-Instruct float32 and its EAGLE-3-style head), the
first 6 held-out chat prompts, greedy, up to 64 new tokens, one request at a
time in slot 0 (so each step runs one row). Contenders: ``auto()`` with the
costs the engine measures at each row bucket, ``auto()`` given the costs of
8 rows only, and fixed K=3; each compiles once, then 2 rounds alternate.
Printed: the costs by row bucket, then per contender tok/s (median and range
over requests), tokens per cycle and drafts per cycle.
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import specjax  # noqa: E402
from specjax import drafting  # noqa: E402
from specjax.engine import Engine, SlotSettings  # noqa: E402

rows = common.read_prompt_file(common.ROOT / "benchmarks/prompts/heldout_chat_64.jsonl", None)[:6]
target = specjax.load("smollm2-135m-instruct", dtype="float32")
pair = specjax.pair(target, specjax.load("smollm2-135m-instruct-eagle", dtype="float32"))
prompts = [specjax.encode_chat(target, r["prompt"]) for r in rows]
print(common.header("one request on an 8-slot engine: auto's costs by row bucket against 8 rows' only"))
kw = dict(num_slots=8, capacity=512, num_draft=3, row_buckets="powers", prompt_bucket=512)
by_rows = Engine(pair, drafting=drafting.auto(), **kw)
print("costs by row bucket:\n" + by_rows.drafting.costs.describe())
eight = by_rows.drafting.costs.at_batch(8)  # the same measurement, its 8-row entry
engines = {
    "auto, costs by rows": by_rows,
    "auto, 8 rows' costs": Engine(pair, drafting=drafting.auto(costs=eight), **kw),
    "fixed K=3": Engine(pair, drafting=drafting.fixed(), **kw),
}
settings = SlotSettings(temperature=0.0, max_new_tokens=64)


def run(engine, prompt):
    """One request alone in slot 0 to its end: (tokens, cycles, drafts)."""
    state = engine.insert(engine.init(), 0, prompt, settings)
    while True:
        state, out = engine.step(state, num_cycles=4)
        if bool(np.asarray(out.done)[0]):
            break
    s = state.loop.stats
    n = int(np.asarray(out.lengths)[0])
    return n, int(s.cycles[0]), int(np.asarray(s.drafted_at)[0].sum())


for e in engines.values():
    run(e, prompts[0])
res = {k: [] for k in engines}
for _ in range(2):
    for p in prompts:
        for name, e in engines.items():
            start = time.perf_counter()
            n, c, d = run(e, p)
            res[name].append((n / (time.perf_counter() - start), n, c, d))
for name, v in res.items():
    a = np.array(v)
    print(
        f"{name:22s} tok/s {np.median(a[:, 0]):6.1f} [{a[:, 0].min():.1f}-{a[:, 0].max():.1f}]  tokens/cycle {a[:, 1].sum() / a[:, 2].sum():.2f}  drafts/cycle {a[:, 3].sum() / a[:, 2].sum():.2f}"
    )
