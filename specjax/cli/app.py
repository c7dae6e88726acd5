"""The ``specjax`` command: its options and the dispatch to one module per command.

Options are all here, so ``specjax --help`` needs neither jax nor the models;
each command's ``run(args)`` (``specjax/cli/{compare,generate,certify}.py``)
is imported only when that command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from specjax.cli import common


def _command(name: str):
    """``specjax.cli.<name>.run``, imported when called (that module loads jax)."""

    def run(args) -> int:
        return importlib.import_module(f"specjax.cli.{name}").run(args)

    return run


def _models(args) -> int:
    """``specjax models``: the names ``specjax.load`` knows and where each is found."""
    from specjax._src.models import registry

    del args
    for name, description in registry.describe().items():
        where = registry.location(name)
        print(f"{name:30s} {description}\n{'':30s} {where}")
    return 0


def _add_compare(sub) -> None:
    p = sub.add_parser(
        "compare", help="what speculative decoding buys: acceptance rules against target-only decoding",
        description="Times target-only decoding and speculative decoding with acceptance rules on one model pair "
                    "(default: SmolLM2-135M-Instruct with its EAGLE-style head, about 8 minutes on 2 CPU cores), "
                    "alternating the rows on each prompt over rounds, and scores their output. Without --rules, "
                    "--tree, --lookup or --drafting the smollm2 pairs run, at T=0: target-only, lossless "
                    "speculative sampling alone, with context lookup, and with lookup and drafting auto (the draft "
                    "length chosen each cycle from measured costs), MARS with lookup, PAD and FLy, and the "
                    "target-only and lookup rows on the GGUF's own 4-bit weights; at T=1: target-only, speculative "
                    "sampling, block verification fixed and auto, EARS, AdaSD and the typical-set criterion.")
    common.add_model_args(p, default_pair="smollm2-eagle", default_num_draft=None)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="few prompts and rules (smoke run)")
    size.add_argument("--full", action="store_true", help="more prompts and rules (the embedded pair: a third "
                      "temperature)")
    p.add_argument("--rules", help='";"-separated rule specs, e.g. "mars:theta=0.9;ears:beta=0.2": each at every '
                   "temperature, instead of the preset's rows")
    p.add_argument("--rounds", type=int, help="timed rounds, each running every row on every prompt in turn "
                   "(default: the preset's: 2; 1 for --quick)")
    p.add_argument("--max-new-tokens", type=int, help="override the preset's generation length")
    p.add_argument("--batch", type=int, help="prompts per decode call (default: the preset's: 1 for a plain run, "
                   "8 for smollm2 --full, all prompts in one batch for the embedded --quick / --full)")
    p.add_argument("--eval-dir", help="evaluation directory: task.jsonl + heldout_prompts.jsonl (chat pairs) or "
                   "arith_heldout.jsonl + code_prompts.jsonl (embedded pair)")
    p.add_argument("--chat-eval", action="store_true", help="with --target/--draft: evaluate on chat prompts")
    p.add_argument("--quantize", default=None, metavar="FORMAT",
                   help="weights of the quantized rows: gguf (a GGUF target's own formats; the smollm2 pairs' "
                        "default rows), int8, q4, ...; none: leave them out. With --rules, adds every row again "
                        "with the target quantized so and the draft in int8")
    p.add_argument("--out", default="compare_out", help="where compare.csv/.json/.png go (default compare_out/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_command("compare"))


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with one rule and print its stats")
    common.add_model_args(p)
    p.add_argument("--rule", default="speculative_sampling", help='rule spec, e.g. "mars:theta=0.9"')
    p.add_argument("--prompt", help="plain text to continue")
    p.add_argument("--chat", help="a user message, rendered with the target's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--quantize", metavar="FORMAT", help=common.QUANTIZE_HELP)
    p.set_defaults(func=_command("generate"))


def _add_certify(sub) -> None:
    # No abbreviations: --tree (a chain's shape in compare / generate) would silently mean --trees here.
    p = sub.add_parser("certify", help="acceptance-certificate quantiles per criterion next to the paper's figures",
                       allow_abbrev=False)
    common.add_model_args(p, drafting=False)
    p.add_argument("--prompts", action="append", help="JSONL prompts ({\"prompt\": str} or {\"ids\": [int]}); "
                   "repeatable; default: the embedded held-out task and code prompts")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts read per file (default 32)")
    p.add_argument("--rules", help='";"-separated certifiable rule specs (default: speculative_sampling, '
                   'additive:t=0.3, multiplicative:alpha=0.1, typical:eps=0.09,delta=0.3, top_m:m=2)')
    p.add_argument("--trees", help='comma-separated tree widths m recorded on the first run (default "2,4,8"; '
                   '"" for none)')
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--out", default="certify_out", help="where certify.json/.txt/.png go (default certify_out/)")
    p.add_argument("--no-progress", action="store_true", help="no per-rule progress lines")
    p.set_defaults(func=_command("certify"))


def _add_serve(sub) -> None:
    from specjax.cli import serve

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching, speculative decoding)")
    serve.add_arguments(p)
    p.set_defaults(func=_command("serve"))


def _add_cache_args(p, directory: bool = True) -> None:
    """The persistent compilation cache's options (on by default; specjax._src.kernels.compile_cache)."""
    if directory:
        p.add_argument("--compilation-cache", metavar="DIR",
                       help="keep compiled programs here for the next run (default: $SPECJAX_COMPILATION_CACHE, else "
                            "$JAX_COMPILATION_CACHE_DIR, else ~/.cache/specjax/jax; \"none\": off)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile every program afresh, keeping none on disk (also: SPECJAX_COMPILATION_CACHE=none)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description="Speculative decoding with composable acceptance rules.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_compare(sub)
    _add_generate(sub)
    _add_certify(sub)
    _add_serve(sub)
    for name, p in sub.choices.items():
        _add_cache_args(p, directory=name != "serve")  # serve has its own --compilation-cache
    p = sub.add_parser("models", help="list the models specjax.load knows by name and where they are")
    p.set_defaults(func=_models)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return parser


def main(argv=None) -> int:
    """Runs ``specjax ARGV``; returns the exit status (2 for a user error, printed as one line)."""
    args = build_parser().parse_args(argv)
    try:
        if not hasattr(args, "no_compile_cache"):  # `specjax models` compiles nothing
            return args.func(args)
        from specjax._src.kernels import compile_cache

        compile_cache.enable(compile_cache.resolve(args.compilation_cache, enabled=not args.no_compile_cache))
        with compile_cache.count_programs() as programs:
            status = args.func(args)
        print(f"programs: {programs.describe()}")
        return status
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
