"""``specjax certify``: acceptance-certificate quantiles per criterion next to the paper's figures.

The measurement (greedy runs with :class:`CertificateDiagnostics`, the table
and the CDF plot) is ``specjax._src.certify``; this module reads the options
and prompt files, prints, and sets the exit status (1 if any certified
position was rejected).
"""

from __future__ import annotations

import functools
from pathlib import Path

from specjax.cli import common


def _prompt_files(args) -> list[Path]:
    """--prompts, else the embedded held-out prompts; exits if a file is missing."""
    from specjax._src import certify

    files = [Path(f) for f in args.prompts] if args.prompts else certify.default_prompt_files()
    if not files:
        raise SystemExit("error: no embedded held-out prompts found; pass --prompts FILE.jsonl.")
    for f in files:
        if not f.is_file():
            raise SystemExit(f"error: prompt file {f} does not exist.")
    return files


def run(args) -> int:
    from specjax._src import certify

    target, draft = common.load_pair(args)
    files = _prompt_files(args)
    prompts = [p for f in files for p in certify.read_prompts(f, target.tokenizer, args.num_prompts)]
    rules = tuple(r for r in args.rules.split(";") if r) if args.rules else certify.CERTIFY_RULES
    trees = tuple(int(m) for m in args.trees.split(",") if m) if args.trees is not None else certify.CERTIFY_TREES
    eos = tuple(getattr(target.module.config, "eos_token_ids", ())) or None
    print(f"certify: {len(prompts)} prompts from {', '.join(str(f) for f in files)}; greedy, K={args.num_draft}, "
          f"up to {args.max_new_tokens} new tokens")
    progress = None if args.no_progress else functools.partial(print, flush=True)
    rows = certify.run_certify(
        target, draft, prompts, rules=rules, trees=trees, num_draft=args.num_draft,
        max_new_tokens=args.max_new_tokens, eos_token_id=eos, progress=progress,
    )
    print(certify.format_table(rows))
    meta = {"target": str(args.target or "embedded"), "draft": str(args.draft or "embedded"),
            "prompt_files": [str(f) for f in files], "num_prompts": len(prompts), "num_draft": args.num_draft,
            "max_new_tokens": args.max_new_tokens, "temperature": 0.0, "device": common.device_platform()}
    paths = certify.write_outputs(rows, Path(args.out), meta)
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if any(r.get("violations") for r in rows) else 0
