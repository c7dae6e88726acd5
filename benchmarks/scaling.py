"""Throughput scaling: batch size, prompt length and model size, lossless SD vs target-only.

    python benchmarks/scaling.py                        # default grid (see --cells)
    python benchmarks/scaling.py --markdown out.md

Cells ``pair:prompt_len:batches``:

* ``embedded``: the embedded pair (fp32) on held-out code prompts cut to
  exactly ``prompt_len`` tokens (two ~49-token snippets concatenated), or with
  ``--prompts arith`` solved held-out arithmetic problems followed by one to
  solve (the task the pair was trained on); its context is ~97 tokens, so
  prompt 64 + 32 new tokens.
* ``large``: a random Llama-shaped pair for cost scaling: target vocab 4096,
  hidden 384, 12 layers (~29.7M params); the draft is the target truncated to
  its first layer, sharing its embedding and (perturbed) head (decode_speed's
  ``random_pair`` trick, which gives a non-trivial tau; ~5.4M params, ~3.8M of
  them in matmuls). Random weights: tau says little about real drafts, so read
  the forward costs and the ideal speedup next to the realized one.

Per cell: target-only (``specjax.generate``) and lossless SD
(``specjax.decode``, ``speculative_sampling``, K=4) alternate ``--rounds``
times after a compile call (timed apart); tok/s = batch * max_new_tokens /
wall time (prefill included, no EOS); the SD/target-only ratio per round;
forward costs c_AR, c_draft, c_verify at that batch, and the ideal speedup.
A last table gives throughput relative to batch 1 for each (pair, prompt).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from decode_speed import forward_cost, random_pair  # noqa: E402

DEFAULT_CELLS = "embedded:64:1,4,16,32;large:64:1,4,16,32;large:512:1,4"


def param_count(params) -> int:
    import jax

    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default=DEFAULT_CELLS, help="';'-separated pair:prompt_len:b1,b2,...")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--num-draft", "-K", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", default="code", choices=["code", "arith"],
                    help="embedded pair: held-out code snippets, or solved arithmetic problems + one to solve")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)

    import jax
    import specjax
    from specjax.rules import parse_rule

    rep = common.Report("scaling: lossless SD vs target-only by batch, prompt length and model size")
    K, N, T = args.num_draft, args.max_new_tokens, args.temperature
    rule = parse_rule("speculative_sampling")
    pairs = {}

    def get_pair(name):
        if name not in pairs:
            if name == "embedded":
                t = specjax.load(str(common.MODELS / "target"), dtype="float32")
                d = specjax.load(str(common.MODELS / "draft"), dtype="float32")
            elif name == "large":
                t, d = random_pair(4096, 384, 12, 1, args.seed)
            else:
                raise ValueError(name)
            pairs[name] = (t, d, specjax.pair(t, d))
            rep.text(f"pair {name}: target {param_count(t.params) / 1e6:.2f}M params, "
                     f"draft {param_count(d.params) / 1e6:.2f}M params")
        return pairs[name]

    rep.text(f"embedded-pair prompts: {args.prompts}; K={K}, max_new_tokens {N} (no EOS), temperature {T:g}, {args.rounds} alternating rounds, "
             "tok/s counts generated tokens over the whole call (prefill included)")
    rows, per_batch = [], {}
    for cell in args.cells.split(";"):
        name, plen, batches = cell.split(":")
        plen = int(plen)
        target, draft, params = get_pair(name)
        vocab = params.vocab_size
        for b in (int(x) for x in batches.split(",")):
            if name == "embedded":
                make = common.arith_prompts_of_length if args.prompts == "arith" else common.code_prompts_of_length
                prompts = np.asarray(make(b, plen), np.int32)
            else:
                prompts = np.random.default_rng(args.seed).integers(0, vocab, (b, plen)).astype(np.int32)
            key = jax.random.key(args.seed)
            kw = dict(max_new_tokens=N, temperature=T, key=key, eos_token_id=())

            def ar():
                o = specjax.generate(params, prompts, **kw)
                o.tokens.block_until_ready()
                return o

            def sd():
                o = specjax.decode(params, prompts, rule=rule, num_draft=K, **kw)
                o.tokens.block_until_ready()
                return o

            _, c_ar_compile = common.timed_once(ar)
            out, c_sd_compile = common.timed_once(sd)
            times = common.alternate({"ar": ar, "sd": sd}, args.rounds, warmup=0)
            tau = out.stats.tau
            toks = b * N
            ctx, cl = plen + N // 2, plen + N + K
            steps = 8 if name == "embedded" else 4
            reps = 3
            c_ar = forward_cost(target, b, 1, ctx, cl, vocab, reps, steps)
            c_dr = forward_cost(draft, b, 1, ctx, cl, vocab, reps, steps)
            c_ver = forward_cost(target, b, K + 1, ctx, cl, vocab, reps, steps)
            ideal = tau * c_ar / (K * c_dr + c_ver)
            ratios = common.pair_ratios(times["ar"], times["sd"])
            ar_tps, sd_tps = toks / common.median(times["ar"]), toks / common.median(times["sd"])
            per_batch[(name, plen, b)] = (ar_tps, sd_tps)
            rows.append([name, plen, b, f"{ar_tps:.1f}", f"{sd_tps:.1f}", common.ratio_cell(ratios),
                         f"{tau:.2f}", f"{c_ar * 1e3:.2f}", f"{c_dr * 1e3:.2f}", f"{c_ver * 1e3:.2f}",
                         f"{ideal:.2f}x", f"{common.median(ratios) / ideal:.2f}",
                         f"{c_ar_compile:.0f}/{c_sd_compile:.0f}"])
            print("  " + " | ".join(str(c) for c in rows[-1]), f"| {common.load_average()}", flush=True)
    rep.table("Throughput: target-only vs lossless SD (tok/s medians), per-round SD/AR ratio [min-max], "
              "forward costs in ms at that batch, ideal = tau*c_AR/(K*c_draft+c_verify)",
              ["pair", "prompt", "batch", "AR tok/s", "SD tok/s", "SD/AR", "tau", "c_AR", "c_draft",
               "c_verify", "ideal", "real/ideal", "compile s AR/SD"], rows)
    scale_rows = []
    for (name, plen, b), (ar_tps, sd_tps) in per_batch.items():
        if (name, plen, 1) in per_batch:
            ar1, sd1 = per_batch[(name, plen, 1)]
            scale_rows.append([name, plen, b, f"{ar_tps / ar1:.2f}x", f"{sd_tps / sd1:.2f}x",
                               f"{sd_tps / ar1:.2f}x"])
    rep.table("Throughput relative to batch 1 (same pair and prompt length)",
              ["pair", "prompt", "batch", "AR / AR@1", "SD / SD@1", "SD / AR@1"], scale_rows)
    rep.write(args.markdown)


if __name__ == "__main__":
    main()
