"""Command line: ``specjax compare``, ``specjax generate`` and ``specjax certify``.

    specjax compare                       # every rule on the embedded pair, ~5 min on 2 CPU cores
    specjax compare --quick               # a smoke run
    specjax generate --rule mars:theta=0.9 --prompt "def fib(n):"
    specjax certify                       # certificate quantiles per criterion vs the paper (greedy)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _load_pair(args):
    import specjax
    from specjax._src import compare

    target_dir = Path(args.target) if args.target else compare.DEFAULT_TARGET
    draft_dir = Path(args.draft) if args.draft else compare.DEFAULT_DRAFT
    for name, path in (("target", target_dir), ("draft", draft_dir)):
        if not path.is_dir():
            raise SystemExit(f"error: {name} model directory {path} does not exist; pass --{name} DIR.")
    return specjax.load(target_dir, dtype=args.dtype), specjax.load(draft_dir, dtype=args.dtype)


def _compare(args) -> int:
    from specjax._src import compare

    preset = compare.PRESETS["quick" if args.quick else "full" if args.full else "default"]
    rules = tuple(args.rules.split(";")) if args.rules else preset.rules
    target, draft = _load_pair(args)
    if target.tokenizer is None:
        raise SystemExit("error: the target directory has no tokenizer.json; compare needs it to score text.")
    eval_dir = Path(args.eval_dir) if args.eval_dir else compare.DEFAULT_EVAL
    eval_set = compare.load_eval_set(target.tokenizer, eval_dir, preset.num_task, preset.num_code)
    rows = compare.run_comparison(
        target,
        draft,
        eval_set,
        rules=rules,
        temperatures=preset.temperatures,
        max_new_tokens=args.max_new_tokens or preset.max_new_tokens,
        num_draft=args.num_draft,
        seed=args.seed,
        progress=not args.no_progress,
    )
    print(compare.format_table(rows))
    paths = compare.write_outputs(rows, Path(args.out))
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _generate(args) -> int:
    import jax

    import specjax
    from specjax.rules import parse_rule

    rule = parse_rule(args.rule)
    target, draft = _load_pair(args)
    if target.tokenizer is None:
        raise SystemExit("error: the target directory has no tokenizer.json; pass token ids from Python instead.")
    ids = target.tokenizer.encode(args.prompt).ids
    eos = getattr(target.module.config, "eos_token_id", None)
    out = specjax.decode(
        specjax.pair(target, draft),
        [ids],
        rule=rule,
        num_draft=args.num_draft,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        eos_token_id=eos,
        key=jax.random.key(args.seed),
    )
    n = int(out.lengths[0])
    print(args.prompt + target.tokenizer.decode(list(map(int, out.tokens[0, :n]))))
    print()
    print(out.stats)
    return 0


def _certify(args) -> int:
    import specjax
    from specjax._src import certify

    target, draft = _load_pair(args)
    limit = args.num_prompts
    if args.prompts:
        files = [Path(f) for f in args.prompts]
    else:
        files = certify.default_prompt_files()
        if not files:
            raise SystemExit("error: no embedded held-out prompts found; pass --prompts FILE.jsonl.")
    prompts = []
    for f in files:
        if not f.is_file():
            raise SystemExit(f"error: prompt file {f} does not exist.")
        prompts += certify.read_prompts(f, target.tokenizer, limit)
    rules = tuple(r for r in args.rules.split(";") if r) if args.rules else certify.CERTIFY_RULES
    trees = tuple(int(m) for m in args.trees.split(",") if m) if args.trees is not None else certify.CERTIFY_TREES
    eos = getattr(target.module.config, "eos_token_id", None)
    print(f"certify: {len(prompts)} prompts from {', '.join(str(f) for f in files)}; greedy, K={args.num_draft}, "
          f"up to {args.max_new_tokens} new tokens")
    rows = certify.run_certify(
        target, draft, prompts, rules=rules, trees=trees, num_draft=args.num_draft,
        max_new_tokens=args.max_new_tokens, eos_token_id=eos, progress=not args.no_progress,
    )
    print(certify.format_table(rows))
    meta = {"target": str(args.target or "embedded"), "draft": str(args.draft or "embedded"),
            "prompt_files": [str(f) for f in files], "num_prompts": len(prompts), "num_draft": args.num_draft,
            "max_new_tokens": args.max_new_tokens, "temperature": 0.0, "device": specjax_device()}
    paths = certify.write_outputs(rows, Path(args.out), meta)
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if any(r.get("violations") for r in rows) else 0


def specjax_device() -> str:
    import jax

    return jax.devices()[0].platform


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description="Speculative decoding with composable acceptance rules.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_models(p):
        p.add_argument("--target", help="target model directory (Hugging Face or Orbax); default: the embedded pair")
        p.add_argument("--draft", help="draft model directory; default: the embedded pair")
        p.add_argument("--num-draft", type=int, default=4, help="draft tokens per cycle, K (default 4)")
        p.add_argument("--seed", type=int, default=0)
        # bf16 storage keeps the embedded pair small, but bf16 compute lets the K+1-token verify
        # forward and the 1-token forward round differently, so greedy near-ties can flip (measured:
        # 0.98 token agreement of lossless greedy with target-only in bf16, 1.0 in float32).
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                       help="compute dtype the models are loaded in (default float32)")

    p = sub.add_parser("compare", help="compare every acceptance rule against target-only decoding")
    add_models(p)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="few prompts and rules (smoke run)")
    size.add_argument("--full", action="store_true", help="more prompts and a third temperature")
    p.add_argument("--rules", help='";"-separated rule specs, e.g. "mars:theta=0.9;ears:beta=0.2"')
    p.add_argument("--max-new-tokens", type=int, help="override the preset's generation length")
    p.add_argument("--eval-dir", help="directory with arith_heldout.jsonl and code_prompts.jsonl (default: embedded)")
    p.add_argument("--out", default="compare_out", help="where compare.csv/.json/.png go (default compare_out/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_compare)

    p = sub.add_parser("generate", help="generate text with one rule and print its stats")
    add_models(p)
    p.add_argument("--rule", default="speculative_sampling", help='rule spec, e.g. "mars:theta=0.9"')
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.set_defaults(func=_generate)

    p = sub.add_parser("certify", help="acceptance-certificate quantiles per criterion next to the paper's figures")
    add_models(p)
    p.add_argument("--prompts", action="append", help="JSONL prompts ({\"prompt\": str} or {\"ids\": [int]}); "
                   "repeatable; default: the embedded held-out task and code prompts")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts read per file (default 32)")
    p.add_argument("--rules", help='";"-separated certifiable rule specs (default: greedy, additive:t=0.3, '
                   'multiplicative:alpha=0.1, typical, top_m:m=2)')
    p.add_argument("--trees", help='comma-separated tree widths m recorded on the first run (default "2,4,8"; "" for none)')
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--out", default="certify_out", help="where certify.json/.txt/.png go (default certify_out/)")
    p.add_argument("--no-progress", action="store_true", help="no per-rule progress lines")
    p.set_defaults(func=_certify)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad rule specs and other user errors: no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
