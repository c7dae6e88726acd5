"""Verification as wide as the drafts: drafting that stops early, with and without a narrow forward.

    python benchmarks/verify_width.py                                  # the head, T=0, batch 1
    python benchmarks/verify_width.py --temperatures 0 1 --lookup 2 --thresholds 0.3 0.6

A chain's verification forward scores ``[last, d_1 .. d_K]``. With a drafting
policy that stops early (here ``confidence(threshold)``: stop after a token the
drafter proposed with probability below it), the default ``Buckets`` run that
forward only as wide as the batch's longest draft needs (2, 4, ..., K + 1);
``Buckets(verify=None)`` runs all K + 1 tokens as before. The gain depends on how
a forward's cost grows with its width, which this script measures first.

Contenders, per temperature, on held-out chat prompts (as ``real_pair.py``):
``target-only`` (specjax ``generate``); ``fixed K=F`` (``--fixed``, every slot
drafted); for each threshold, ``conf T`` (K = ``--num-draft``, narrow
verification) and ``conf T full`` (the same drafts verified at K + 1). At T=0
the last two give identical tokens, so their ratio is the width's alone.
Every program compiles first; then the contenders alternate over the prompt
groups ``--rounds`` times; speedups are medians of per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from real_pair import CHAT, DRAFTERS, TARGET, _blocking  # noqa: E402


def width_costs(target, widths, repeats: int) -> dict[int, float]:
    """Median ms of one cached target forward of ``w`` tokens, batch 1, after a 64-token prefix."""
    from training.draft import forward_costs

    return {w: forward_costs(target, None, num_draft=w - 1, repeats=repeats)["c_verify_ms"] for w in widths}


def main(argv=None):
    import jax

    import specjax
    from specjax.drafting import confidence, fixed, ngram_lookup

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="eagle", choices=sorted(DRAFTERS))
    ap.add_argument("--num-draft", type=int, default=6, help="K of the confidence-stopped chains")
    ap.add_argument("--fixed", type=int, default=3, help="K of the fixed chain (every slot drafted)")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.5])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    ap.add_argument("--lookup", type=int, default=None, metavar="MIN", help="also copy drafts (ngram_lookup(MIN))")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cost-repeats", type=int, default=20)
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)

    report = common.Report(f"verify_width: drafting that stops early, narrow vs full verification ({args.drafter})")
    target = specjax.load(TARGET)
    pair = specjax.pair(target, specjax.load(DRAFTERS[args.drafter], dtype="float32"))
    K, N = args.num_draft, args.max_new_tokens
    costs = width_costs(target, range(1, max(K, args.fixed) + 2), args.cost_repeats)
    report.text("target forward, batch 1, ms by width (tokens): "
                + ", ".join(f"{w}: {c:.2f} ({c / costs[1]:.2f}x)" for w, c in costs.items()))
    lookup = None if args.lookup is None else ngram_lookup(args.lookup)
    eos = tuple(target.module.config.eos_token_ids)
    texts = [r["prompt"] for r in common.read_jsonl(CHAT)][: args.prompts]
    prompts = [specjax.encode_chat(target, t) for t in texts]
    groups = [prompts[i:i + args.batch] for i in range(0, len(prompts) - args.batch + 1, args.batch)]
    report.text(f"K={K} (fixed chain K={args.fixed}), lookup {lookup}, {len(groups)} groups of {args.batch}, "
                f"up to {N} new tokens, EOS {eos}, {args.rounds} rounds")

    contenders = {"target-only": None, f"fixed K={args.fixed}": (fixed(), args.fixed, specjax.BUCKETS)}
    for t in args.thresholds:
        contenders[f"conf {t:g}"] = (confidence(t), K, specjax.BUCKETS)
        contenders[f"conf {t:g} full"] = (confidence(t), K, specjax.Buckets(verify=None))

    for temperature in args.temperatures:
        def call(name, group, i, temperature=temperature):
            kw = dict(max_new_tokens=N, temperature=temperature, eos_token_id=eos, key=jax.random.key(100 + i))
            if contenders[name] is None:
                return lambda: specjax.generate(target, group, **kw)
            policy, k, buckets = contenders[name]
            return lambda: specjax.decode(pair, group, drafting=policy, num_draft=k, buckets=buckets,
                                          lookup=lookup, **kw)

        fns = {(c, i): call(c, g, i) for i, g in enumerate(groups) for c in contenders}
        for fn in fns.values():
            jax.block_until_ready(fn().tokens)
        times = {c: [] for c in contenders}
        outs = {}
        for _ in range(args.rounds):
            for c in contenders:
                times[c].append(0.0)
            for i in range(len(groups)):
                for c in contenders:
                    out, dt = common.timed_once(lambda: _blocking(fns[(c, i)]))
                    times[c][-1] += dt
                    outs[(c, i)] = out
        rows = []
        base_tokens = sum(int(np.sum(outs[("target-only", i)].lengths)) for i in range(len(groups)))
        for c in contenders:
            emitted = sum(int(np.sum(outs[(c, i)].lengths)) for i in range(len(groups)))
            tok_s = [emitted / t for t in times[c]]
            ratios = [a / (base_tokens / b) for a, b in zip(tok_s, times["target-only"])]
            if contenders[c] is None:
                rows.append([c, f"{common.median(tok_s):.1f}", "1.00x", "-", "-", "-", emitted])
                continue
            stats = [outs[(c, i)].stats for i in range(len(groups))]
            cycles = sum(int(np.sum(s.cycles)) for s in stats)
            tau = sum(int(np.sum(s.tokens)) for s in stats) / cycles
            drafted = sum(int(np.sum(s.drafted)) for s in stats) / cycles
            verified = sum(int(np.sum(s.verified)) for s in stats) / cycles
            same = ""
            if temperature == 0:
                agree = all(np.array_equal(np.asarray(outs[(c, i)].tokens),
                                           np.asarray(outs[("target-only", i)].tokens)) for i in range(len(groups)))
                same = "" if agree else " (GREEDY OUTPUT DIFFERS)"
            rows.append([c + same, f"{common.median(tok_s):.1f}", common.ratio_cell(ratios), f"{tau:.2f}",
                         f"{drafted:.2f}", f"{verified:.2f}", emitted])
        report.table(f"batch {args.batch}, T={temperature:g}",
                     ["contender", "tok/s", "speedup vs target-only", "tau", "drafted/cycle", "verified/cycle",
                      "tokens"], rows)
        for t in args.thresholds:  # tok/s, not time: sampled texts differ in length between contenders
            narrow, full = ([sum(int(np.sum(outs[(c, i)].lengths)) for i in range(len(groups))) / x for x in times[c]]
                            for c in (f"conf {t:g}", f"conf {t:g} full"))
            report.text(f"T={temperature:g}, conf {t:g}: narrow / full verification, tok/s per round "
                        f"{common.ratio_cell([a / b for a, b in zip(narrow, full)])}"
                        + (" (identical tokens)" if temperature == 0 else " (different sampled texts)"))
    if not args.markdown:  # write() adds it to the file
        report.text(common.load_average() + " (at end)")
    report.write(args.markdown)


if __name__ == "__main__":
    main()
