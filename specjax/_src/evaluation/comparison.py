"""A timed comparison of target-only and speculative decoding on one pair: rows, runs and scores.

:func:`run_comparison` decodes an evaluation set (:mod:`.tasks`) with every contender (target-only
decoding, or a rule at a temperature, with its drafting), timed in alternation so a slow spell of
a shared machine slows every row alike, and returns one :class:`Row` of speed and quality figures
per contender. ``specjax compare`` prints and plots them; nothing here prints.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional, Sequence

import jax
import numpy as np

from specjax._src.proposals import drafting as drafting_lib
from specjax._src.engine import stats as stats_lib
from specjax._src.engine.loop import Buckets, decode, generate
from specjax._src.evaluation.rules import is_lossless, row_drafting
from specjax._src.evaluation.scoring import mean_target_nll, percentiles, token_agreement, wilson_interval
from specjax._src.evaluation.tasks import EvalSet, completions
from specjax._src.models.pairing import pair as make_pair
from specjax._src.rules.parse import parse_rule


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
        return (
            (self.rule or "target-only")
            + (" +lookup" if self.lookup else "")
            + (f" K={self.num_draft}" if self.num_draft else "")
            + (f" {self.drafting}" if self.drafting else "")
            + (f" [{self.weights} weights]" if self.weights else "")
        )

    @property
    def lossless(self) -> bool:
        """The float target's law: quantized weights are another model, scored like a relaxed rule."""
        return self.weights is None and (self.rule is None or is_lossless(self.rule))


def grid(
    rules: Sequence[str], temperatures: Sequence[float], lookup: bool = False, weights: Optional[str] = None
) -> tuple[Contender, ...]:
    """Target-only and every rule at each temperature (every rule with the lookup when ``lookup``);
    with ``weights``, each of those rows again with the models quantized."""
    rows = tuple(c for t in temperatures for c in (Contender(t), *(Contender(t, r, lookup) for r in rules)))
    if weights is None:
        return rows
    return rows + tuple(dataclasses.replace(c, weights=weights) for c in rows)


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
    rule: str = ""  # the row's rule spec (Contender.rule), "" for target-only
    # Mean output length over target-only's on the same prompts: a lenient rule can lengthen
    # answers by more than it saves per token.
    length_ratio: float = math.nan

    @property
    def lossless(self) -> bool:
        """A lossless rule's row on the float target (target-only's is not a rule's)."""
        # The method's label also names the row's lookup, K and drafting policy; read the rule itself.
        rule = self.rule or self.method.split(" [", 1)[0].split(" K=", 1)[0].removesuffix(" +lookup")
        return not self.weights and rule != "target-only" and is_lossless(rule)


def _merged_summary(stats_list) -> dict:
    """The summary of several calls' stats pooled by counts (rates do not add)."""
    return stats_lib.concatenate(stats_list).summary()


def _groups(indices: Sequence[int], size: Optional[int]) -> list[tuple[int, ...]]:
    """``indices`` in consecutive groups of ``size`` (one group when None)."""
    size = size or max(len(indices), 1)
    return [tuple(indices[i : i + size]) for i in range(0, len(indices), size)]


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
    if contenders is None:
        contenders = grid(rules, temperatures, lookup=lookup is not None)
    contenders = tuple(contenders)
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}.")
    missing = sorted(
        {c.temperature for c in contenders}
        - {c.temperature for c in contenders if c.rule is None and c.weights is None}
    )
    if missing:
        raise ValueError(f"every temperature needs a target-only contender to compare with; none at T={missing}.")
    if any(c.lookup for c in contenders) and lookup is None:
        raise ValueError("a contender drafts with the lookup, but no lookup was given (pass lookup=ngram_lookup(...)).")
    tokenizer = target.tokenizer
    eos = tuple(target.module.config.eos_token_ids) or None if hasattr(target.module, "config") else None
    absent = sorted({c.weights for c in contenders if c.weights} - set(quantized or {}))
    if absent:
        raise ValueError(f"contenders run quantized weights {absent}, but no quantized models were given for them.")
    models = {None: (target, make_pair(target, draft))}
    for weights, (q_target, q_draft) in (quantized or {}).items():
        models[weights] = (q_target, make_pair(q_target, q_draft))
    key = jax.random.key(seed)
    parsed = {c.rule: parse_rule(c.rule) for c in contenders if c.rule is not None}
    timed = [i for i, t in enumerate(eval_set.timed_mask) if t]
    untimed = [i for i, t in enumerate(eval_set.timed_mask) if not t]
    timed_groups, untimed_groups = _groups(timed, batch_size), _groups(untimed, batch_size)
    scored_temperatures = {c.temperature for c in contenders if not c.lossless}
    # One bucket for every group: the smallest width ladder that starts at the
    # longest prompt, and buffers of exactly max_new_tokens, so each (rule, T)
    # compiles one program whatever the group's own longest prompt.
    buckets = Buckets(prompt=max(len(p) for p in eval_set.prompts), new_tokens=max_new_tokens)

    def call(c: Contender, group):
        prompts = [eval_set.prompts[i] for i in group]
        common = dict(
            max_new_tokens=max_new_tokens,
            temperature=c.temperature,
            eos_token_id=eos,
            key=jax.random.fold_in(key, group[0]),
            buckets=buckets,
        )
        row_target, params = models[c.weights]
        if c.rule is None:
            out = generate(row_target, prompts, **common)
        else:
            policy, k = row_drafting(c.rule, c.num_draft or num_draft, drafting)
            if c.drafting is not None:
                policy = drafting_lib.parse_drafting(c.drafting)
            shape = (
                dict(tree=tree)
                if tree is not None
                else dict(drafting=policy, num_draft=k, lookup=lookup if c.lookup else None)
            )
            out = decode(params, prompts, rule=parsed[c.rule], **shape, **common)
        jax.block_until_ready(out.tokens)
        return out

    def untimed_groups_of(c):
        # A lossless row's answers follow the target's law (greedy: they are its answers), so
        # scoring it would measure nothing but sampling noise: only target-only and relaxed rows run.
        return untimed_groups if c.temperature in scored_temperatures and (c.rule is None or not c.lossless) else []

    shapes = {c: {len(g): g for g in timed_groups + untimed_groups_of(c)}.values() for c in contenders}
    total = (
        sum(len(s) for s in shapes.values())
        + rounds * len(timed_groups) * len(contenders)
        + sum(len(untimed_groups_of(c)) for c in contenders)
    )
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
        rows.append(
            _row(
                c,
                outputs[c],
                seconds[c],
                outputs[base],
                seconds[base],
                eval_set,
                timed,
                tokenizer,
                target,
                width,
                batch_size or len(timed),
            )
        )
    return rows


def _row(
    c: Contender,
    out: _Outputs,
    secs: np.ndarray,
    base: _Outputs,
    base_secs: np.ndarray,
    eval_set: EvalSet,
    timed: Sequence[int],
    tokenizer,
    target,
    width: int,
    batch: int,
) -> Row:
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
    base_accuracy = (
        sum(eval_set.correct(base_texts[i], eval_set.answers[i]) for i in base_scored) / len(base_scored)
        if base_scored
        else math.nan
    )
    low, high = wilson_interval(correct, len(scored))

    agreement = math.nan
    if c.temperature == 0:
        common = [i for i in ran if i in base.tokens]
        agreement = token_agreement(*out.aligned(common, width), *base.aligned(common, width))
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
        rule=c.rule or "",
        temperature=c.temperature,
        batch=batch,
        tokens_per_s=float(tok_s),
        speedup=float(tok_s / base_tok_s),
        tau=float(summary.get("tau", math.nan)),
        drafted_per_cycle=float(summary.get("mean_drafted_per_cycle", math.nan)),
        acceptance_rate=float(summary.get("acceptance_rate", math.nan)),
        task_accuracy=accuracy,
        recovery=(
            1.0
            if c.lossless and not scored  # the target's own law: 1 by construction
            else accuracy / base_accuracy
            if base_accuracy and base_accuracy > 0
            else math.nan
        ),
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
