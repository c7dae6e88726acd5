"""Train an EAGLE-3-shaped head for SmolLM2-135M-Instruct: ``python -m training.smollm2_head``.

EAGLE-3 ("EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test", arXiv:2503.01840) drafts from a fusion of low, middle
and high target blocks, is trained on its own unrolled predictions
(training-time test), and drafts over a reduced vocabulary. This recipe trains
such a head for the ``smollm2`` pair: it reads blocks ``FEATURE_LAYERS``, is
unrolled ``UNROLL`` draft steps in training, and drafts over the 8,192 ids the
data uses most. Its stages each resume after an interrupt:

1. **data**: the target's answers that ship with specjax
   (``training/answers/smollm2-passes-1-3.npz``, 1.85M answer tokens), rebuilt
   by teacher forcing; with ``--self-prompts N``, N requests the target writes
   itself (:func:`training.distill_data.self_written_prompts`), answered by it:
   free-form requests that the template-built training prompts lack; with
   ``--gather-passes 4,5,...`` the target also answers the training prompts
   again at those passes' temperatures. Generation costs about 17 s per 32
   answers on 2 CPU cores, far less on a GPU.
2. **head**: ``python -m training.eagle`` with ``HEAD_SETTINGS``, for ``--steps``
   steps or as many as fit ``--minutes`` of training, then the held-out
   agreement and the export (``--export``, default ``OUT/export``).

The settings are sized for one GPU (batch 64 rows of 256 tokens; 128 with
``--batch 128``); there, one command makes the data and trains. The shipped
head came from that command on one H200 (in two calls: ``--time-limit`` ended
the first, the same command resumed), then ``training.eagle --init-from
runs/smollm2-head3/export --head-vocab 7168 --weights-format int8 --steps 0``::

    python -m training.smollm2_head --self-prompts 24576 --self-batch 256 --batch 128 --online-features --minutes 6

What each stage took there is in the head's MODEL_CARD.md and in
``docs/heads.md`` ("An EAGLE-3-shaped SmolLM2 head"). It runs on a CPU as well,
with ``--batch 8`` and stored features, at 3.4 s a step on 2 cores
(``benchmarks/head_training_step.py``): 4.4 hours a pass over the shipped head's data.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from training import common, distill_data, draft, eagle

TARGET = "smollm2-135m-instruct"
ANSWERS = pathlib.Path(__file__).resolve().parent / "answers" / "smollm2-passes-1-3.npz"
# Requests the target wrote with another seed, held out to measure heads on
# (benchmarks/acceptance.py --prompt-file).
SELF_WRITTEN_EVAL = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "prompts" / "self_written_64.jsonl"
SELF_WRITTEN_SEED = 0
FEATURE_LAYERS = "2,15,-1"  # low, middle and high blocks of the target's 30
UNROLL = 3  # the draft steps of a K=3 chain, each reading the head's own features from step 2 on
HEAD_SETTINGS = ("--feature-layers", FEATURE_LAYERS, "--unroll", str(UNROLL), "--seq-len", "256", "--lr", "1e-3",
                 "--eval-every", "500")
VOCAB_SETTINGS = ("--head-vocab-from", "", "--head-vocab", "8192")  # a fresh head's; an --init-from head keeps its own


def _passes(text: str) -> list[int]:
    try:
        passes = [int(x) for x in text.split(",") if x]
    except ValueError:
        passes = [-1]
    if not passes or min(passes) < 4:
        raise argparse.ArgumentTypeError(
            f"expected gather passes 4 or higher, comma-separated (1-3 ship as answers); got {text!r}")
    return passes


def answer_self_written(out: pathlib.Path, n: int, batch_size: int = 32) -> None:
    """``n`` requests the target writes itself (kept in ``OUT/self_written.json``, so a
    rerun answers the same ones), written ``2 * batch_size`` at a time and answered
    ``batch_size`` at a time into ``OUT/data`` from shard ``SELF_WRITTEN_SHARDS`` on,
    at the training prompts' temperatures. A GPU answers far more per batch in the
    same time; a rerun must keep the batch (gather refuses shards made with another)."""
    import specjax

    target = specjax.load(TARGET)
    log = lambda m: common._log(m, out / "log.txt")  # noqa: E731
    kept = out / "self_written.json"
    prompts = json.loads(kept.read_text()) if kept.exists() else []
    if len(prompts) < n:
        held = [row["prompt"] for row in map(json.loads, SELF_WRITTEN_EVAL.read_text().splitlines())]
        prompts = distill_data.self_written_prompts(target, n, seed=SELF_WRITTEN_SEED, batch_size=2 * batch_size,
                                                    exclude=held, log=log)
        kept.write_text(json.dumps(prompts, indent=0))
    distill_data.gather(target, prompts[:n], out / "data", batch_size=batch_size, new_tokens=192,
                        first_shard=distill_data.SELF_WRITTEN_SHARDS, log=log)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.smollm2_head", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/smollm2-head3", help="run directory (default: %(default)s)")
    p.add_argument("--export", default=None, help="write the head here (default: OUT/export)")
    p.add_argument("--force", action="store_true", help="replace an existing head at --export")
    p.add_argument("--self-prompts", type=eagle._int_at_least(0, "a number of requests"), default=0,
                   help="also answer N requests the target writes itself (none of benchmarks/prompts/"
                        "self_written_64.jsonl, which measures heads on such requests)")
    p.add_argument("--self-batch", type=eagle._int_at_least(1, "a batch size"), default=32,
                   help="self-written requests answered per batch, twice as many written (default: %(default)s; "
                        "a GPU takes 128 or more)")
    p.add_argument("--gather-passes", type=_passes, default=[],
                   help="also answer the training prompts again at these passes (4 or higher), e.g. 4,5")
    # Checked here, not only by training.eagle: that runs after the data stages, which take minutes.
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=eagle._step_count, help="optimizer steps")
    budget.add_argument("--minutes", type=eagle._minutes, help="train as many steps as fit this many minutes (training.eagle --minutes)")
    p.add_argument("--time-limit", type=eagle._minutes, default=None, metavar="MINUTES",
                   help="stop training early if need be once this many minutes have passed since this command "
                        "started (training.eagle --time-limit); leave a few for the evaluation and export")
    p.add_argument("--batch", type=eagle._int_at_least(1, "a batch size"), default=64, help="training rows per step (default: %(default)s)")
    p.add_argument("--data-only", action="store_true",
                   help="stop after the data and the target's features (a machine lent for a fixed time can "
                        "train in a second call)")
    p.add_argument("--online-features", action="store_true",
                   help="compute the target's features in each training step rather than storing them "
                        "(training.eagle --online-features): for a GPU or TPU")
    p.add_argument("--init-from", default=None, help="start from an exported head (default: the target's last block)")
    p.add_argument("--no-progress", action="store_true")
    return p


def _head_argv(args, out: pathlib.Path, time_limit: float | None) -> list[str]:
    """``training.eagle``'s arguments for the head stage."""
    if args.data_only:
        budget = ["--features-only"]
    elif args.steps is not None:
        budget = ["--steps", str(args.steps)]
    else:
        budget = ["--minutes", repr(args.minutes)]
    return ["--target", TARGET, "--data", str(out / "data"), "--out", str(out / "head"),
            "--export", str(args.export or out / "export"), *HEAD_SETTINGS, *budget,
            "--batch", str(args.batch), "--feature-batch", str(args.batch), "--eval-batch", str(args.batch),
            *(["--init-from", args.init_from] if args.init_from else VOCAB_SETTINGS),
            *(["--online-features"] if args.online_features else []),
            *(["--time-limit", f"{time_limit:.4f}"] if time_limit is not None else []),
            *(["--force"] if args.force else []), *(["--no-progress"] if args.no_progress else [])]


def main(argv=None) -> int:
    started = time.monotonic()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.data_only and args.steps is None and args.minutes is None:
        parser.error("give the training budget: --steps N or --minutes M (or --data-only)")
    out = pathlib.Path(args.out)
    if not args.data_only:  # training.eagle checks it too, but only after the data stages' minutes
        common.check_outside_package(out, "--out")
        head_out = out / "head"
        head_out.mkdir(parents=True, exist_ok=True)
        common.check_export(pathlib.Path(args.export or out / "export"), force=args.force,
                            run_id=common.run_id(head_out),
                            command=eagle.command_line(_head_argv(args, out, None)))
    progress = ["--no-progress"] if args.no_progress else []
    stages = [["--answers-from", str(ANSWERS)]]
    # Batches of 32, as the shipped answers: a pass numbers its shards by the batch, and other
    # numbers would land on the shipped passes' shards.
    stages += [["--gather-pass", str(p), "--gather-batch", "32"] for p in args.gather_passes]
    for stage in stages:
        rc = draft.main(["--target", TARGET, "--out", str(out), "--gather-only", *stage, *progress])
        if rc:
            return rc
    if args.self_prompts:
        answer_self_written(out, args.self_prompts, args.self_batch)
    time_limit = (None if args.time_limit is None
                  else max(args.time_limit - (time.monotonic() - started) / 60, 1e-3))
    return eagle.main(_head_argv(args, out, time_limit))

if __name__ == "__main__":
    sys.exit(main())
