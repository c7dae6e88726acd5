"""``specjax certify``: acceptance-certificate quantiles per criterion next to the paper's figures.

The app half of the certificate diagnostics: the job (read prompt files, one
greedy run per rule in :data:`CERTIFY_RULES` with the trees of
:data:`CERTIFY_TREES` on the strict run), its report (the table next to
:data:`PAPER_FIGURES`, the CDF plot, ``certify.json``/``.txt``/``.png``) and
the command, which reads the options, prints, and sets the exit status (1 if
any certified position was rejected). The measurement itself
(:class:`CertificateDiagnostics`, the histograms, :func:`certified_decode`) is
the library, ``specjax._src.theory.certify`` (public as ``specjax.theory``).
"""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from specjax._src.theory import certificates as theory
from specjax._src.theory.certify import certificate_diagnostics, histogram_cdf
from specjax.cli import common

# The paper's Qwen3 figures (papers/README.md). The tree figures are listed with the
# 5th percentiles there, so they are read as 5th percentiles.
PAPER_FIGURES: dict[str, dict[str, float]] = {
    "greedy": {"median": 0.559, "p5": 0.006},
    "additive:t=0.3": {"p5": 0.102},
    "multiplicative:alpha=0.1": {"p5": 0.279},
    "typical:eps=0.09,delta=0.3": {"p5": 0.375},  # the paper's "entropy rule"
    "tree:m=2": {"p5": 0.071},
    "tree:m=4": {"p5": 0.249},
    "tree:m=8": {"p5": 0.531},
}

# `specjax certify`: each rule decodes its own greedy run; trees ride on the strict run.
CERTIFY_RULES = (
    "speculative_sampling",
    "additive:t=0.3",
    "multiplicative:alpha=0.1",
    "typical:eps=0.09,delta=0.3",
    "top_m:m=2",
)
CERTIFY_TREES = (2, 4, 8)


def read_prompts(path: Path, tokenizer, limit: Optional[int] = None) -> list[list[int]]:
    """Token-id prompts from a JSONL file of ``{"prompt": str}`` rows (tokenized
    with ``tokenizer``) or ``{"ids": [int, ...]}`` rows."""
    prompts = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if "ids" in row:
                ids = [int(i) for i in row["ids"]]
            elif "prompt" in row:
                if tokenizer is None:
                    raise ValueError(f"{path}: text prompts need a tokenizer.json in the target directory "
                                     "(or give rows as {\"ids\": [...]})")
                ids = tokenizer.encode(row["prompt"]).ids
            else:
                raise ValueError(f"{path}: each row needs \"prompt\" or \"ids\", got keys {sorted(row)}")
            if ids:
                prompts.append(ids)
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


def default_prompt_files() -> list[Path]:
    """The embedded held-out prompts: ``assets/eval/{task,code}.jsonl``, else
    ``assets/task/{arith_heldout,code_prompts}.jsonl``."""
    assets = Path(__file__).resolve().parent.parent / "assets"
    for names in ((assets / "eval" / "task.jsonl", assets / "eval" / "code.jsonl"),
                  (assets / "task" / "arith_heldout.jsonl", assets / "task" / "code_prompts.jsonl")):
        found = [p for p in names if p.is_file()]
        if found:
            return found
    return []


def run_certify(target, draft, prompts: Sequence[Sequence[int]], *, rules: Sequence[str] = CERTIFY_RULES,
                trees: Sequence[int] = CERTIFY_TREES, num_draft: int = 4, max_new_tokens: int = 48,
                eos_token_id=None, batch_size: int = 64,
                progress: Optional[Callable[[str], None]] = None) -> list[dict[str, Any]]:
    """One greedy run per rule over ``prompts``; trees are recorded on the first
    (strict) run. Returns one row per criterion (the :class:`CertificateReport`
    fields plus ``paper_median`` / ``paper_p5`` where the paper reports them) and
    a last row holding the drafter's KL histogram (``"_kl": True``). Rows keep
    their histograms under ``"_hist"`` for :func:`plot_cdfs`.

    ``progress``: called with one line per rule once its runs are done
    (:func:`run` passes ``print``); nothing else here prints."""
    from specjax._src.engine.loop import decode, pair
    from specjax._src.rules.parse import parse_rule

    if not prompts:
        raise ValueError("no prompts to certify on")
    params = pair(target, draft)
    width = max(len(p) for p in prompts)
    room = min(filter(None, [_max_pos(target), _max_pos(draft)]), default=None)
    if room is not None and width + max_new_tokens + num_draft > room:
        max_new_tokens = max(1, room - width - num_draft)
    rows: list[dict[str, Any]] = []
    kl_row = None
    for i, text in enumerate(rules):
        rule = parse_rule(text)
        diag = certificate_diagnostics(rule, trees=tuple(trees) if i == 0 else ())
        t0 = time.perf_counter()
        extras = []
        for start in range(0, len(prompts), batch_size):
            chunk = [list(p) for p in prompts[start : start + batch_size]]
            padded = np.zeros((len(chunk), width), np.int32)  # one width: one compile per rule
            for j, p in enumerate(chunk):
                padded[j, : len(p)] = p
            out = decode(params, padded, prompt_lengths=[len(p) for p in chunk], rule=rule, temperature=0.0,
                         num_draft=num_draft, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                         diagnostics=diag)
            extras.append(out.stats.extra)
        extra = {k: np.concatenate([np.asarray(e[k]).reshape(-1, *np.shape(e[k])[1:]) for e in extras])
                 for k in extras[0]}
        report = diag.summarize(_Stats(extra))
        seconds = time.perf_counter() - t0
        if progress is not None:
            progress(f"  {text}: {report.positions} verified positions, {seconds:.1f}s")
        for c in diag.criteria:
            row = dict(report[c.label])
            row["decode_rule"] = str(theory.normalize_spec(rule.spec))
            row["kl_median"] = report.kl["kl_median"]
            row["kl_p5"] = report.kl["kl_p5"]
            row["soundness_checked"] = report.soundness_checked
            row["rule_mismatches"] = report.rule_mismatches if c is diag.rule else None
            row["resolution"] = report.resolution
            paper = PAPER_FIGURES.get(c.label, {})
            row["paper_median"] = paper.get("median")
            row["paper_p5"] = paper.get("p5")
            row["seconds"] = seconds
            row["_hist"] = (report.histograms[c.label], report.lo, report.hi)
            rows.append(row)
        if i == 0:
            kl_row = {"criterion": "KL(p||q)", "_kl": True, "_hist": (report.kl_histogram, report.lo, report.kl_hi)}
    rows.append(kl_row)
    return rows


class _Stats(NamedTuple):
    extra: dict


def _max_pos(model) -> Optional[int]:
    cfg = getattr(model.module, "config", None)
    value = getattr(cfg, "max_position_embeddings", None)
    return None if value is None else int(value)


def _fmt(x, digits=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if x != 0 and abs(x) < 0.01:
        return f"{x:.1e}"  # small certificates (near-ties) keep their magnitude
    return f"{x:.{digits}f}"


def format_table(rows: Sequence[dict]) -> str:
    """A plain-text table: per criterion, positions, certified %, accepted %,
    certificate median and 5th percentile next to the paper's, violations."""
    header = ("criterion", "run", "positions", "certified", "accepted", "median", "paper", "p5", "paper",
              "violations")
    lines = [header]
    for r in rows:
        if r.get("_kl"):
            continue
        lines.append((
            r["criterion"],
            "greedy" if r["decode_rule"] == "speculative_sampling" else r["decode_rule"],
            str(r["positions"]),
            f"{100 * r['certified_fraction']:.1f}%" if r["positions"] else "-",
            f"{100 * r['accepted_fraction']:.1f}%" if r["positions"] else "-",
            _fmt(r["certificate_median"]),
            _fmt(r["paper_median"]),
            _fmt(r["certificate_p5"]),
            _fmt(r["paper_p5"]),
            f"{r['violations']}/{r['soundness_checked']}",
        ))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    kl = next((r for r in rows if r["criterion"] == "greedy"), rows[0])
    res = rows[0].get("resolution", float("nan"))
    text.append("")
    text.append(
        "Certificates in nats (min KL(p||q) of a drafter the criterion rejects); certified = KL(p||q) < C. "
        f"Quantiles from log bins, exact to {100 * res:.2f}% + 1e-6. Paper: Qwen3-1.7B/4B; "
        "tree figures read as 5th percentiles. violations = certified yet rejected / slots checked (must be 0). "
        f"Drafter KL median on the strict run: {_fmt(kl.get('kl_median'))}."
    )
    return "\n".join(text)


def plot_cdfs(rows: Sequence[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        h = r.get("_hist")
        if h is None:
            continue
        hist, lo, hi = h
        x, y = histogram_cdf(hist, lo, hi)
        style = dict(color="k", linestyle="--") if r.get("_kl") else {}
        label = r["criterion"] + ("" if r.get("_kl") else f" ({100 * r['certified_fraction']:.0f}% certified)")
        ax.step(x, y, where="post", label=label, **style)
        color = ax.lines[-1].get_color()
        if r.get("paper_p5") is not None:
            ax.plot([r["paper_p5"]], [0.05], marker="x", color=color, linestyle="none")
        if r.get("paper_median") is not None:
            ax.plot([r["paper_median"]], [0.5], marker="o", mfc="none", color=color, linestyle="none")
    ax.set_xscale("log")
    ax.set_xlim(1e-6, 10)
    ax.set_ylim(0, 1)
    ax.set_xlabel("certificate C(p), nats (KL(p||q) dashed)")
    ax.set_ylabel("fraction of verified positions <= x")
    ax.set_title("Acceptance certificate CDFs; paper (Qwen3): x 5th percentile, o median\n"
                 "(a curve ending below 1: the rest are +inf, nothing rejectable)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(rows: Sequence[dict], out_dir: Path, meta: Optional[dict] = None) -> dict[str, Path]:
    """``certify.json`` (rows + meta), ``certify.txt`` (the table), ``certify.png`` (CDFs)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "certify.json", "table": out_dir / "certify.txt", "png": out_dir / "certify.png"}
    table_rows = [{k: _jsonable(v) for k, v in r.items() if not k.startswith("_")} for r in rows if not r.get("_kl")]
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta or {}, "rows": table_rows, "paper": PAPER_FIGURES}, f, indent=2)
    paths["table"].write_text(format_table(rows) + "\n")
    plot_cdfs(rows, paths["png"])
    return paths


def _jsonable(v):
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return _jsonable(float(v))
    return v


def _prompt_files(args) -> list[Path]:
    """--prompts, else the embedded held-out prompts; exits if a file is missing."""
    files = [Path(f) for f in args.prompts] if args.prompts else default_prompt_files()
    if not files:
        raise SystemExit("error: no embedded held-out prompts found; pass --prompts FILE.jsonl.")
    for f in files:
        if not f.is_file():
            raise SystemExit(f"error: prompt file {f} does not exist.")
    return files


def _rule_specs(text: Optional[str]) -> tuple[str, ...]:
    """--rules: ";"-separated specs; not given: :data:`CERTIFY_RULES`."""
    if text is None:
        return CERTIFY_RULES
    rules = tuple(r.strip() for r in text.split(";") if r.strip())
    if not rules:
        raise SystemExit(f"error: --rules {text!r} names no rule; give specs such as \"additive:t=0.3;top_m:m=2\", "
                         "or leave --rules out for the default criteria.")
    return rules


def _tree_widths(text: Optional[str]) -> tuple[int, ...]:
    """--trees: comma-separated widths >= 1; "" for none; not given: :data:`CERTIFY_TREES`."""
    if text is None:
        return CERTIFY_TREES
    try:
        widths = tuple(int(m) for m in text.split(",") if m.strip())
    except ValueError:
        widths = (0,)
    if any(m < 1 for m in widths):
        raise SystemExit(f"error: --trees {text!r}: want comma-separated tree widths, integers >= 1 such as "
                         "\"2,4,8\" (\"\" for none).")
    return widths


def run(args) -> int:
    if args.num_prompts < 1:
        raise SystemExit(f"error: --num-prompts must be a positive integer, got {args.num_prompts}.")
    rules, trees = _rule_specs(args.rules), _tree_widths(args.trees)  # before anything loads
    target, draft = common.load_pair(args)
    files = _prompt_files(args)
    prompts = [p for f in files for p in read_prompts(f, target.tokenizer, args.num_prompts)]
    eos = tuple(getattr(target.module.config, "eos_token_ids", ())) or None
    print(f"certify: {len(prompts)} prompts from {', '.join(str(f) for f in files)}; greedy, K={args.num_draft}, "
          f"up to {args.max_new_tokens} new tokens")
    progress = None if args.no_progress else functools.partial(print, flush=True)
    rows = run_certify(
        target, draft, prompts, rules=rules, trees=trees, num_draft=args.num_draft,
        max_new_tokens=args.max_new_tokens, eos_token_id=eos, progress=progress,
    )
    print(format_table(rows))
    pair = common.pair_name(args)  # what load_pair loaded where --target / --draft are not given
    meta = {"target": str(args.target or pair), "draft": str(args.draft or pair),
            "prompt_files": [str(f) for f in files], "num_prompts": len(prompts), "num_draft": args.num_draft,
            "max_new_tokens": args.max_new_tokens, "temperature": 0.0, "device": common.device_platform()}
    paths = write_outputs(rows, Path(args.out), meta)
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if any(r.get("violations") for r in rows) else 0
