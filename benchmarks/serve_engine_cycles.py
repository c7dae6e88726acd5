"""What a draft-verify cycle costs in `specjax serve`'s engine against `specjax.decode`, at each draft length.

    python benchmarks/serve_engine_cycles.py                        # the server's defaults, 3 cycles a step
    python benchmarks/serve_engine_cycles.py --cycles-per-step 8 --flags "--no-penalties --slots 1"

The engine is built as ``specjax serve --pair smollm2-eagle --quantize gguf`` builds it (8 slots,
row buckets, the logits processors compiled in; ``--flags`` adds server flags), and driven as its
scheduler drives one client: the request in slot 0 (a step runs one row), steps of
``--cycles-per-step`` cycles until it finishes. ``decode`` runs the same prompt ids with the same
pair at batch 1. Both are forced to draft ``k`` tokens every cycle (``auto`` with costs under which
only ``k`` pays, ``LiveCosts.forced_costs``), so each contender's cycles are the same in number.
Per ``k``: the median over (prompt, round) of milliseconds per cycle, the engine's whole steps
(with their host work: dispatch, reading back what each step made) over its cycles, and
``decode``'s wall time less its prefill and first cycle over its other cycles. Contenders alternate
prompt by prompt. Greedy, ``--max-new-tokens`` tokens, no end of sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HELDOUT_64 = common.ROOT / "benchmarks" / "prompts" / "heldout_chat_64.jsonl"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=3, help="the first N held-out chat prompts (default 3)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--cycles-per-step", type=int, default=3, help="the engine's cycles a step (default 3: what "
                   "the server's admission wait gives one client on a 2-core CPU)")
    p.add_argument("--flags", default="", help="more `specjax serve` flags for the engine, e.g. \"--slots 1\"")
    p.add_argument("--markdown")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import jax

    import specjax
    from specjax.cli import common as cli_common
    from specjax.cli import serve as cli_serve
    from specjax.engine import LiveCosts, SlotSettings

    cli_serve.use_compilation_cache(None)
    parser = argparse.ArgumentParser()
    cli_serve.add_arguments(parser)
    flags = ["--pair", "smollm2-eagle", "--quantize", "gguf", *shlex.split(args.flags)]
    engine = cli_serve.build(parser.parse_args(flags))[1].engine
    forcing = LiveCosts(engine.costs).forced_costs  # the costs under which auto drafts k, every step
    target, draft = cli_common.load_pair(argparse.Namespace(pair="smollm2-eagle", target=None, draft=None,
                                                            dtype="float32"), quantize="gguf")
    pair = specjax.pair(target, draft)
    rows = [json.loads(line)["prompt"] for line in HELDOUT_64.read_text().splitlines()[: args.prompts]]
    prompts = [specjax.encode_chat(target, [{"role": "user", "content": r}]) for r in rows]
    n, per_step = args.max_new_tokens, args.cycles_per_step
    settings = SlotSettings(temperature=0.0, max_new_tokens=n, eos_token_id=(), seed=0)
    state = engine.init()

    def served(k: int, prompt) -> tuple[float, int]:
        nonlocal state
        state = engine.insert(state, 0, prompt, settings)
        jax.block_until_ready(state.occupied)
        plan, forced = engine.plan({0: settings}), forcing(k)
        t0 = time.perf_counter()
        while True:
            state, out = engine.step(state, per_step, until_first_finish=True, plan=plan, costs=forced)
            out, cycles = jax.device_get((out, state.loop.stats.cycles))
            if out.done[0]:
                break
        seconds = time.perf_counter() - t0
        state = engine.release(state, 0)
        return seconds, int(cycles[0])

    def decoded(k: int, prompt, tokens: int = n) -> tuple[float, int]:
        policy = specjax.drafting.auto(costs=forcing(k), timed=False)
        t0 = time.perf_counter()
        out = specjax.decode(pair, [prompt], num_draft=engine.num_draft, drafting=policy, max_new_tokens=tokens,
                             temperature=0.0, eos_token_id=())
        jax.block_until_ready(out.tokens)
        return time.perf_counter() - t0, int(np.sum(out.stats.cycles))

    lengths = range(engine.num_draft + 1)
    for k in lengths:  # compile every program
        served(k, prompts[0])
        decoded(k, prompts[0])
    decoded(0, prompts[0], 1)
    first = common.median([decoded(0, prompts[0], 1)[0] for _ in range(3)])  # prefill and one cycle

    report = common.Report("`specjax serve`'s engine against `decode`, per draft-verify cycle at each draft length")
    report.text(common.machine())
    report.text(f"`specjax serve {' '.join(flags)}`'s engine, one request in slot 0, {per_step} cycles a step; "
                f"{len(prompts)} held-out chat prompts, {args.rounds} rounds, {n} tokens, greedy. `decode`'s "
                f"prefill and first cycle: {1e3 * first:.0f} ms (median of 3).")
    table = []
    for k in lengths:
        engine_ms, decode_ms, cycles = [], [], []
        for _ in range(args.rounds):
            for prompt in prompts:
                seconds, c = served(k, prompt)
                engine_ms.append(1e3 * seconds / c)
                cycles.append(c)
                seconds, c = decoded(k, prompt)
                decode_ms.append(1e3 * (seconds - first) / max(c - 1, 1))
        e, d = common.median(engine_ms), common.median(decode_ms)
        table.append([k, f"{e:.1f}", f"{d:.1f}", f"{e - d:+.1f}", f"{e / d:.2f}", f"{common.median(cycles):.0f}"])
        print(f"k={k}: engine {e:.1f} ms a cycle, decode {d:.1f}", flush=True)
    report.table("ms per cycle (median over prompts and rounds)",
                 ["drafts k", "engine", "decode", "engine - decode", "engine / decode", "cycles"], table)
    report.write(args.markdown)


if __name__ == "__main__":
    main()
