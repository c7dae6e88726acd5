"""Acceptance of the real pair's drafters on many held-out chat prompts (no timing).

    python benchmarks/acceptance.py --drafters draft eagle                # the shipped drafters, K=3
    python benchmarks/acceptance.py --drafters eagle new=runs/x/export    # a head not shipped yet, beside it
    python benchmarks/acceptance.py --drafters eagle --tree dynamic:3,3,8 --temperatures 0
    python benchmarks/acceptance.py --drafters eagle --lookup 2 3        # + eagle with context lookup
    python benchmarks/acceptance.py --drafters eagle --tree chain dynamic-topk:4,4,12 dynamic:4,4,12

Speed figures (``real_pair.py``) can only afford 8 prompts, and tau over 8
prompts x 128 tokens moves by about +-0.05 between drafters that differ by
less. This script measures what decides the speed, tau, where it is cheap:
lossless speculative decoding (``--rule``) of each drafter on ``--prompts``
held-out chat prompts (``--prompt-file``, default
``specjax/assets/chat/heldout_prompts.jsonl``; in the chat template, EOS honoured, up to ``--max-new-tokens``), at ``--batch``, and
reports tau (tokens per cycle), alpha (accepted / judged), the acceptance at
each draft slot and each drafter's tau relative to the first. Standard errors
are over prompts; the paired column compares each prompt's tau with the first
drafter's on the same prompt (mean difference +- its standard error, and on
how many prompts it is higher / lower), which is what tells two close
drafters apart. ``--lookup MIN [MIN ..]`` adds each drafter with
``decode(lookup=specjax.drafting.ngram_lookup(MIN))`` as ``LABEL+lookupMIN``,
and a column with the share of drafts (and of accepted drafts) copied from the
context. ``--tree SPEC [SPEC ..]`` runs every drafter on each shape
(``chain``: the ``--num-draft`` chain), labelled ``DRAFTER @ SPEC``, on the
same prompts and keys.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from real_pair import CHAT, TARGET, drafter_arg  # noqa: E402


def main(argv=None):
    import jax

    import specjax
    from specjax.rules import parse_rule

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafters", nargs="+", default=[drafter_arg("draft"), drafter_arg("eagle")], type=drafter_arg,
                    help="draft, eagle (shipped) or LABEL=DIR (an exported drafter)")
    ap.add_argument("--prompt-file", type=common.Path, default=CHAT,
                    help="JSON lines with a 'prompt' each (default: the held-out chat prompts; "
                         "benchmarks/prompts/self_written_64.jsonl: requests the target wrote itself)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--num-draft", type=int, default=3)
    ap.add_argument("--tree", nargs="+", default=None, metavar="SPEC",
                    help='token trees instead of a K-chain, e.g. "dynamic:3,3,8" ("chain": the K-chain); '
                         'several: each drafter on each')
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rule", default="speculative_sampling")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="compute dtype of the target and the drafters (real_pair.py's default too)")
    ap.add_argument("--lookup", type=int, nargs="+", default=[], metavar="MIN",
                    help="also run every drafter with context lookup drafting, ngram_lookup(MIN) for each MIN")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    drafters = dict(args.drafters)
    if len(drafters) < len(args.drafters):
        ap.error("--drafters: each label once")
    if args.lookup and "chain" not in (args.tree or ["chain"]):
        ap.error("--lookup drafts chains: add \"chain\" to --tree, or drop --tree")
    try:
        lookups = {m: specjax.drafting.ngram_lookup(m) for m in args.lookup}
    except ValueError as e:
        ap.error(f"--lookup: {e}")
    from specjax.trees import parse_tree

    shapes = {}
    for spec in args.tree or ["chain"]:
        try:
            shapes[spec] = dict(num_draft=args.num_draft) if spec == "chain" else dict(tree=parse_tree(spec))
        except ValueError as e:
            ap.error(str(e))

    report = common.Report(f"acceptance on {args.prompt_file.name}: SmolLM2-135M-Instruct + {' / '.join(drafters)}")
    target = specjax.load(TARGET, dtype=args.dtype)
    loaded = {d: specjax.pair(target, specjax.load(path, dtype=args.dtype)) for d, path in drafters.items()}
    label = lambda d, spec: d if len(shapes) == 1 else f"{d} @ {spec}"  # noqa: E731
    pairs = {label(d, spec): (loaded[d], None, kw) for d in drafters for spec, kw in shapes.items()}
    pairs.update({f"{d}+lookup{m}": (loaded[d], lk, shapes["chain"]) for d in drafters for m, lk in lookups.items()})
    texts = [r["prompt"] for r in common.read_prompt_file(args.prompt_file, ap)][: args.prompts]
    prompts = [specjax.encode_chat(target, t) for t in texts]
    eos = tuple(target.module.config.eos_token_ids)
    rule = parse_rule(args.rule)
    shape = " / ".join(f"K={args.num_draft} chain" if s == "chain" else s for s in shapes)
    report.text(f"{args.dtype}, {shape}, rule {args.rule}, {len(prompts)} prompts in batches of {args.batch}, up to "
                f"{args.max_new_tokens} new tokens, EOS {eos}; drafters: "
                + ", ".join(f"{d} = {p}" for d, p in drafters.items()))
    for temperature in args.temperatures:
        rows, first_tau, first_seq = [], None, None
        for name, (pair, lookup, shape_kw) in pairs.items():
            parts = []
            for i in range(0, len(prompts), args.batch):
                out = specjax.decode(pair, prompts[i:i + args.batch], rule=rule, max_new_tokens=args.max_new_tokens,
                                     temperature=temperature, eos_token_id=eos, key=jax.random.key(args.seed + i),
                                     lookup=lookup, **shape_kw)
                parts.append(out.stats)
            stats = specjax.concatenate_stats(parts)
            per_seq = np.asarray(stats.tau_per_sequence)
            tau = stats.tau
            first_tau = first_tau or tau
            first_seq = per_seq if first_seq is None else first_seq
            diff = per_seq - first_seq  # paired by prompt: at T=0 the same text, so acceptance alone
            paired = "-" if np.ptp(diff) == 0 else f"{diff.mean():+.3f} +- {diff.std(ddof=1) / np.sqrt(len(diff)):.3f}"
            slots = " / ".join(f"{a:.3f}" for a in stats.acceptance_at_position)
            rows.append([name, f"{tau:.3f}", f"{per_seq.std(ddof=1) / np.sqrt(len(per_seq)):.3f}", paired,
                         f"{int(np.sum(diff > 0))} / {int(np.sum(diff < 0))}",
                         f"{stats.acceptance_rate:.3f}", slots, f"{tau / first_tau:.3f}",
                         f"{np.sum(stats.copied) / max(np.sum(stats.drafted), 1):.3f} / "
                         f"{np.sum(stats.copied_accepted) / max(np.sum(stats.accepted), 1):.3f}",
                         int(np.sum(stats.tokens))])
        first = next(iter(pairs))
        report.table(f"T={temperature:g}", ["drafter", "tau", "s.e. (prompts)", f"per-prompt tau - {first}'s",
                                            "prompts higher / lower", "alpha", "alpha at slot 1/2/..",
                                            f"tau / {first}'s", "copied: of drafted / of accepted", "tokens"],
                     rows)
    report.write(args.markdown)


if __name__ == "__main__":
    main()
