"""Writes ``heldout_chat_64.jsonl``: 64 held-out chat prompts of varied kinds.

    python benchmarks/prompts/select_heldout_chat.py           # rewrites the file (deterministic)
    python benchmarks/prompts/select_heldout_chat.py --check   # exits 1 if the file differs

The prompts come from ``specjax/assets/chat/heldout_prompts.jsonl``: chat
prompts on subjects the shipped draft model and head never saw in training.
Each is classified by its wording into one of seven kinds and one of the
kind's templates (``KINDS``: code, arithmetic, lists, writing, comparisons,
advice, explanations); each kind gets the number of prompts in ``QUOTA``
(all six code prompts there are; more for the kinds with more templates),
taken round-robin over the kind's templates so that every template is
represented, each template's prompts in the order of the SHA-256 of their
text. The kinds are then interleaved (a code prompt, an arithmetic one, a
list, ...), so the first N lines are a varied sample too. No randomness, no
model: the same input file always gives the same 64 prompts. Each output
line is ``{"prompt": str, "kind": str}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "specjax" / "assets" / "chat" / "heldout_prompts.jsonl"
OUT = Path(__file__).resolve().parent / "heldout_chat_64.jsonl"

# kind -> its templates, as patterns on the prompt; the first kind and template that match win.
KINDS = {
    "code": (r"^How do I .* in Python\?", r"^Show me a short example of code", r"^Write a Python function"),
    "arithmetic": (r"^Calculate \d+", r"^If I have \d+", r"^What is \d+ \+", r"^What is \d+ plus"),
    "list": (r"^List five key points", r"^Give me three interesting facts", r"^What questions would a student ask",
             r"^Give me a step-by-step guide"),
    "writing": (r"^Write a haiku", r"^Write a short poem", r"^Write a short story", r"^Write a tweet",
                r"^Write an email", r"^Write a short paragraph"),
    "comparison": (r"^Compare ", r"^What do .* have in common", r"^What are the main advantages"),
    "advice": (r"^I am curious about", r"^Give me a simple tip", r"^What are some common misconceptions",
               r"^Summarize what people should know"),
    "explanation": (r"^Explain .* in simple terms", r"^Explain .* to a ten-year-old", r"^What is ", r"^Why is ",
                    r"^How does .* affect everyday life", r"^How would you describe", r"^Can you tell me about",
                    r"^Describe the history"),
}
QUOTA = {"code": 6, "arithmetic": 8, "list": 10, "writing": 10, "comparison": 8, "advice": 10, "explanation": 12}


def classify(prompt: str) -> tuple[str, int]:
    """``(kind, template index)`` of a prompt."""
    for kind, templates in KINDS.items():
        for i, pattern in enumerate(templates):
            if re.search(pattern, prompt):
                return kind, i
    raise ValueError(f"no template matches {prompt!r}: extend KINDS")


def select(prompts: list[str]) -> list[dict]:
    """``QUOTA[kind]`` prompts of each kind, round-robin over its templates;
    the kinds then interleaved, so that any first few lines are varied too."""
    by_template: dict[tuple[str, int], list[str]] = defaultdict(list)
    for p in sorted(set(prompts), key=lambda p: hashlib.sha256(p.encode()).hexdigest()):
        by_template[classify(p)].append(p)
    picked: dict[str, list[str]] = {}
    for kind, quota in QUOTA.items():
        templates = [by_template[(kind, i)] for i in range(len(KINDS[kind]))]
        if sum(map(len, templates)) < quota:
            raise ValueError(f"only {sum(map(len, templates))} {kind} prompts in {SOURCE}, want {quota}")
        picked[kind], depth = [], 0
        while len(picked[kind]) < quota:
            picked[kind] += [t[depth] for t in templates if depth < len(t)][: quota - len(picked[kind])]
            depth += 1
    rows = []
    for depth in range(max(QUOTA.values())):
        rows += [{"prompt": picked[kind][depth], "kind": kind} for kind in QUOTA if depth < len(picked[kind])]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    args = ap.parse_args(argv)
    rows = [json.loads(line)["prompt"] for line in SOURCE.read_text().splitlines() if line.strip()]
    text = "".join(json.dumps(r) + "\n" for r in select(rows))
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print(f"{OUT}: {'up to date' if same else 'differs from what ' + Path(__file__).name + ' writes'}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT} ({text.count(chr(10))} prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
