"""Train an EAGLE-style target-feature draft head: ``python -m training.eagle``.

The head (:mod:`specjax.heads`) is one decoder block that
reads the target's last-block features ``f_i`` (or, with ``--feature-layers``,
a learned mixture of several blocks' outputs, as EAGLE-3) and the next token ``x_{i+1}``,
predicts ``f_{i+1}`` and, through a final norm and a reduced LM head, the token
``x_{i+2}``. It is trained on the rows :mod:`training.distill_data` gathered
for the separate draft (the target's own answers and its top-32 distributions;
``runs/smollm2-draft/data``), in stages that each resume after an interrupt:

1. **features**: the target (float32) runs over each shard's rows (prompt and
   answer made contiguous, as :func:`training.draft.build_rows` does) and its
   outputs of the ``--feature-layers`` blocks (default: the last) are stored per
   shard as bfloat16 under ``OUT/features``.
2. **heldout**: the target answers held-out chat prompts (subjects no training
   prompt uses) greedily; their features are stored under ``OUT/heldout``.
3. **train**: Optax AdamW with Orbax checkpoints (batches are a pure function
   of the step, so a killed run resumes to the same params). Loss on answer
   positions, per head position ``i``:

   * cross-entropy of the head's reduced-vocabulary distribution for
     ``x_{i+2}`` against the target's renormalised top-32 (KL to the target up
     to a constant, as :func:`training.draft.make_loss`);
   * ``--reg-weight`` x smooth-L1 between RMS-normalised ``f_hat_i`` and
     RMS-normalised ``f_{i+1}`` (EAGLE-1's feature regression; the head is
     scale-free in its features);
   * for ``--unroll K > 1`` ("training-time test", EAGLE-3): the head runs again
     K-1 times on its own predicted features, attending exactly as it does when
     drafting (earlier positions' keys from the target-feature pass, the chain's
     own keys for its later steps), with the same cross-entropy.

   The embedding table is the target's and stays frozen; ``head_vocab_ids`` is
   never trained.
4. **evaluate**: offline top-1 agreement of the head with the target on the
   held-out rows at draft steps 1..3 (step 1 reads the target's features: the
   first-slot acceptance at T=0; steps 2 and 3 read the head's own predicted
   features, tokens are the target's), and the chance that the first k drafts
   all agree.
5. **export**: ``config.json`` + ``head.safetensors`` in bfloat16 (without the
   borrowed embedding), ``MODEL_CARD.md`` and ``train_log.json``, written
   whole into a temporary directory and swapped in; the replaced directory's
   other files (notes, earlier sessions' logs) are kept. Refuses, before any
   work, to replace an existing export without ``--force``, except this
   run's own export by the same command.

An interrupted run (Ctrl-C included) continues with the same command. If
every checkpoint is damaged, the run stops and says so; ``--fresh`` discards
them and trains from step 0. The run directory ``--out`` may not lie inside
the installed package (``--export`` may: that is how the shipped head is made).

The stages' code lives beside this module, which parses the options and runs them:
:mod:`training.eagle_features` (1, 2), :mod:`training.eagle_head` (3, 4) and
:mod:`training.eagle_export` (5).

Reproduce the shipped head (see its MODEL_CARD.md for the exact command)::

    python -m training.eagle --export specjax/assets/models/smollm2-eagle
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax import Model, heads
from specjax.heads import FeatureHead
from training import chat_prompts, common, distill_data, draft
from training.eagle_export import block_kind, export, vocab_source, write_card, write_derived_card
from training.eagle_features import extract_features, feature_fn, gather_heldout, load_rows, machine, online_features
from training.eagle_head import (agreement, balance_fuse, fit_draft_temperature, make_loss, split_params, step_seconds,
                                 with_draft_temperature)
DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_VOCAB_FROM = "specjax/assets/models/smollm2-draft"


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.eagle", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model (default: %(default)s)")
    p.add_argument("--data", default="runs/smollm2-draft/data", help="distill_data shards (default: %(default)s)")
    p.add_argument("--out", default="runs/smollm2-eagle", help="run directory (default: %(default)s)")
    p.add_argument("--export", default=None, help="write the trained head here")
    p.add_argument("--weights-format", choices=("bfloat16", "int8"), default="bfloat16",
                   help="how the export stores the head's matrices: bfloat16 (default), or int8 with a float16 scale "
                        "per output channel (half the bytes; loads back as bfloat16 weights)")
    p.add_argument("--force", action="store_true", help="replace an existing --export directory")
    p.add_argument("--fresh", action="store_true",
                   help="discard the checkpoints in OUT/ckpt (and damaged steps set aside in OUT/ckpt.damaged) and "
                        "train from step 0; features already extracted are kept")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--shards", type=_int_at_least(1, "a number of shards"), default=None, help="use the first N shards (recorded; resume uses the same)")
    p.add_argument("--seq-len", type=_int_at_least(8, "a row length in tokens"), default=256,
                   help="tokens per training row, prompt and answer (default: %(default)s); more than the longest "
                        "prompt of the shards")
    p.add_argument("--feature-batch", type=_int_at_least(1, "a batch size"), default=16)
    p.add_argument("--features-only", action="store_true", help="stop after the features stages")
    p.add_argument("--online-features", action="store_true",
                   help="compute the target's features in each training step instead of storing them first: "
                        "for an accelerator, where the target's forward is cheap and stored features are large "
                        "(25 GB for 4.4M answer tokens at three 576-wide blocks); on a CPU every step then runs "
                        "the target")
    p.add_argument("--head-vocab-from", default=DEFAULT_VOCAB_FROM,
                   help="take head_vocab_ids from this exported draft ('' : rank the shards' tokens) "
                        "(default: %(default)s)")
    p.add_argument("--head-vocab", type=_vocab_size, default=None,
                   help="head vocabulary size: when ranking the shards' tokens (default 8192), or, with --init-from, "
                        "narrow that head to its N ids the shards use most (heads.with_head_vocab: a cheaper step)")
    p.add_argument("--feature-layers", type=_layers, default=None,
                   help="target blocks the head reads, comma-separated, e.g. 2,15,-1 (EAGLE-3's low, middle and "
                        "high); must include -1. A list that starts with a minus sign takes '=': "
                        "--feature-layers=-1,2. Default: the --init-from head's, else -1 (the last block)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=_step_count, default=600,
                   help="optimizer steps (default: %(default)s); 0 exports the --init-from head as grown or narrowed, "
                        "untrained")
    p.add_argument("--time-limit", type=_minutes, default=None, metavar="MINUTES",
                   help="stop training early if need be once this many minutes have passed since the command "
                        "started; the evaluation and export follow, so leave them time (on a machine lent for a "
                        "fixed time, with --minutes or --steps as the plan)")
    g.add_argument("--minutes", type=_minutes, default=None,
                   help="instead of --steps: as many steps as fit this many minutes of training, from a step's time "
                        "measured before training starts (recorded: a resumed run keeps that count); evaluation "
                        "and the features stages come on top")
    g.add_argument("--batch", type=_int_at_least(1, "a batch size"), default=8)
    g.add_argument("--lr", type=_positive_float("a learning rate"), default=5e-4)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--unroll", type=_int_at_least(1, "a number of draft steps"), default=2, help="draft steps trained per position (1: no unrolling)")
    g.add_argument("--unroll-weight", type=float, default=1.0)
    g.add_argument("--init-from", default=None,
                   help="start from an exported head (its vocabulary and weights; a fresh AdamW and schedule), "
                        "e.g. to continue training on more shards in a later session")
    g.add_argument("--layers", type=_block_count, default=None,
                   help="the head's decoder blocks (default: the --init-from head's, else 1); an --init-from head "
                        "with fewer grows new blocks on top that start as the identity (with_num_layers)")
    g.add_argument("--no-balanced-fuse", dest="balanced_fuse", action="store_false",
                   help="keep init_from_target's small-noise token half of fuse (see balance_fuse)")
    g.add_argument("--reg-weight", type=float, default=1.0)
    g.add_argument("--tv-weight", type=float, default=0.0,
                   help="weight of 1 - sum(min(p, q)), the T=1 rejection chance, next to the cross-entropy")
    g.add_argument("--eval-every", type=_int_at_least(0, "a number of steps (0: none)"), default=100)
    g.add_argument("--checkpoint-seconds", type=_positive_float("a number of seconds", zero=True), default=180.0)
    g.add_argument("--train-only", action="store_true", help="skip the final evaluation and export")
    g.add_argument("--draft-temperature", default=None, metavar="fit|T",
                   help="before export, divide the head's logits by T ('fit': the T in 0.5..1.2 with the best T=1 "
                        "acceptance on --calibration-rows training rows); greedy drafts do not change")
    g.add_argument("--calibration-rows", type=_int_at_least(1, "a number of rows"), default=512)
    g.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: simulate a kill
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-prompts", type=_int_at_least(1, "a number of prompts"), default=64)
    g.add_argument("--eval-new-tokens", type=_int_at_least(1, "a number of tokens"), default=128)
    g.add_argument("--eval-batch", type=_int_at_least(1, "a batch size"), default=32)
    return p


def _int_at_least(minimum: int, what: str):
    """An argparse type: an int >= ``minimum``, else a message naming ``what``."""
    return common.number_arg(int, what, minimum)


def _positive_float(what: str, zero: bool = False):
    """An argparse type: a finite number > 0 (>= 0 with ``zero``), else a message naming ``what``."""
    return common.number_arg(float, what, 0, open_low=not zero)


_block_count = _int_at_least(1, "a number of decoder blocks")
_step_count = _int_at_least(0, "a number of steps")
_vocab_size = _int_at_least(2, "a head vocabulary size")


def _minutes(text: str) -> float:
    try:
        minutes = float(text)
    except ValueError:
        minutes = float("nan")
    if not minutes > 0 or minutes == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of minutes; got {text!r}")
    return minutes


def _layers(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated block indices such as 2,15,-1; got {text!r}")
    if -1 not in layers or len(set(layers)) != len(layers):
        raise argparse.ArgumentTypeError(f"the blocks must be distinct and include -1 (the last); got {text!r}")
    return layers


def _load_for(parser, flag: str, path: str, **kwargs):
    """``specjax.load(path)``, or an argparse error naming ``flag`` where the path holds no model."""
    try:
        return specjax.load(path, **kwargs)
    except (ValueError, OSError) as e:
        parser.error(f"{flag} {path}: {e}")


def _check_blocks(parser, layers, num_layers: int, what: str) -> None:
    """Each block index within the target's ``num_layers`` blocks, and no block twice."""
    bad = [x for x in layers if not -num_layers <= x < num_layers]
    if bad:
        parser.error(f"{what} {','.join(map(str, layers))}: the target has {num_layers} blocks (indices "
                     f"{-num_layers} .. {num_layers - 1}); {bad} is not one of them.")
    if len({x % num_layers for x in layers}) != len(layers):
        parser.error(f"{what} {','.join(map(str, layers))} name one of the target's {num_layers} blocks twice.")


def _target_fingerprint(target: Model) -> str:
    """A short hash of the target's config and its vector (norm) weights: tells
    another model, a fine-tune of the same shape included, from this one cheaply."""
    h = hashlib.sha256(json.dumps(target.module.config.to_dict(), sort_keys=True, default=str).encode())
    for leaf in jax.tree.leaves(target.params):
        if np.ndim(leaf) <= 1:
            h.update(np.asarray(leaf, np.float32).tobytes())
    return h.hexdigest()[:16]


def _vocab_from(parser, args, vocab_size: int) -> np.ndarray:
    """``head_vocab_ids`` of ``--head-vocab-from``, checked against the target's vocabulary."""
    source = _load_for(parser, "--head-vocab-from", args.head_vocab_from)
    if "head_vocab_ids" not in source.params:
        parser.error(f"--head-vocab-from {args.head_vocab_from} has no head_vocab_ids (not a reduced-vocabulary "
                     "draft or head); pass --head-vocab-from '' to rank the shards' tokens.")
    ids = np.asarray(source.params["head_vocab_ids"], np.int32)
    if ids.size and int(ids.max()) >= vocab_size:
        parser.error(f"--head-vocab-from {args.head_vocab_from} holds token id {int(ids.max())}, beyond the "
                     f"target's {vocab_size} tokens: it was made for another target. Pass --head-vocab-from '' "
                     "to rank the shards' tokens.")
    if args.head_vocab is not None and args.head_vocab != ids.size:  # else silently ignored
        parser.error(f"--head-vocab {args.head_vocab} sizes a vocabulary ranked from the shards, but "
                     f"--head-vocab-from {args.head_vocab_from} gives its {ids.size} ids; pass --head-vocab-from '' "
                     "with --head-vocab.")
    return ids


def command_line(argv) -> str:
    """The command an export records (``train_log.json``): how a rerun knows its own export."""
    return "python -m training.eagle " + " ".join(argv)


def main(argv=None) -> int:
    started = time.monotonic()  # --time-limit counts from here
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.draft_temperature not in (None, "fit"):
        try:
            ok = float(args.draft_temperature) > 0
        except ValueError:
            ok = False
        if not ok:
            parser.error(f"--draft-temperature must be 'fit' or a positive number, got {args.draft_temperature!r}")
    command = command_line(argv if argv is not None else sys.argv[1:])
    out = pathlib.Path(args.out)
    common.check_outside_package(out, "--out")
    common.check_resumable(out / "ckpt", fresh=args.fresh)
    out.mkdir(parents=True, exist_ok=True)
    log_file = out / "log.txt"
    log = lambda m: common._log(m, log_file)  # noqa: E731
    run_id = common.run_id(out)
    export_dir = pathlib.Path(args.export) if args.export else out / "export"
    force = args.force or not args.export  # the run's own out/export is always replaced
    if not (args.features_only or args.train_only or args.stop_after is not None):  # now, not after training
        if common.check_export(export_dir, force=force, run_id=run_id, command=command):
            log(f"[eagle] {export_dir} holds this run's export by this command: it is made again")
    target = _load_for(parser, "--target", args.target)
    if not isinstance(target.module, specjax.Decoder):
        parser.error(f"--target {args.target} is a {type(target.module).__name__}, not a model a head can read.")
    cfg_t = target.module.config
    if args.feature_layers:
        _check_blocks(parser, args.feature_layers, cfg_t.num_layers, "--feature-layers")
    if args.head_vocab is not None and args.head_vocab > cfg_t.vocab_size:
        parser.error(f"--head-vocab {args.head_vocab} is more than the target's {cfg_t.vocab_size} tokens.")
    if args.steps == 0 and args.init_from is None and args.minutes is None:  # before any features are made
        raise SystemExit("error: --steps 0 exports an --init-from head untrained; without --init-from there is "
                         "nothing to export.")

    meta_file = out / "run.json"
    run = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    # Features and checkpoints in --out belong to one target and one row length: another
    # target's stored features (same width) or other rows would be trained on silently.
    fingerprint = _target_fingerprint(target)
    if run.get("target_fingerprint", fingerprint) != fingerprint:
        raise SystemExit(f"error: {out} was started with --target {run.get('target')}, another model than "
                         f"--target {args.target}; resume with that target or use another --out.")
    if args.shards is not None and run.get("num_shards", args.shards) != args.shards:
        raise SystemExit(f"error: {out} was started with --shards {run['num_shards']}; resume with that or use "
                         "another --out.")
    if args.head_vocab is not None and "head_vocab_ids" in run and len(run["head_vocab_ids"]) != args.head_vocab:
        raise SystemExit(f"error: {out} was started with --head-vocab {len(run['head_vocab_ids'])}; resume with "
                         "that or use another --out.")
    # The rows' length shapes the stored features; the held-out answers are made once
    # (OUT/heldout) with the eval settings and every evaluation reads them.
    for key, flag in (("seq_len", "--seq-len"), ("eval_prompts", "--eval-prompts"),
                      ("eval_new_tokens", "--eval-new-tokens")):
        if run.get(key, getattr(args, key)) != getattr(args, key):
            raise SystemExit(f"error: {out} was started with {flag} {run[key]}; resume with that or use another "
                             "--out.")
    run.update(target=args.target, target_fingerprint=fingerprint, seq_len=args.seq_len,
               eval_prompts=args.eval_prompts, eval_new_tokens=args.eval_new_tokens)
    all_files = sorted(pathlib.Path(args.data).glob("shard_*.npz"))
    if not all_files:
        raise SystemExit(f"error: no distillation shards in {args.data}; run python -m training.draft --gather-only")
    num_shards = run.get("num_shards") or min(args.shards or len(all_files), len(all_files))
    run["num_shards"] = num_shards
    shard_files = all_files[:num_shards]
    longest, n_rows = 0, 0
    for f in shard_files:
        z = np.load(f)
        longest, n_rows = max(longest, int(z["prompt_lengths"].max())), n_rows + z["tokens"].shape[0]
        top = int(z["tokens"].max())  # not top_ids: decompressing them all costs seconds per GB of shards
        if top >= cfg_t.vocab_size:  # else an IndexError deep in build_rows, or an embedding lookup clamped silently
            parser.error(f"--data {args.data}: {f.name} holds token id {top}, beyond --target {args.target}'s "
                         f"{cfg_t.vocab_size} tokens: these shards are another model's. Pass the --data its own "
                         "answers were gathered into.")
    if args.batch > n_rows:
        parser.error(f"--batch {args.batch} is more than the {n_rows} rows of the {num_shards} shards used; "
                     f"pass --batch {n_rows} or less, or gather more data.")
    if longest >= args.seq_len:
        parser.error(f"--seq-len {args.seq_len} leaves no room for an answer after the shards' longest prompt "
                     f"({longest} tokens); pass --seq-len {max(256, longest + 64)} or more.")

    init = None
    if args.init_from:
        init = _load_for(parser, "--init-from", args.init_from, dtype="float32")
        if not (isinstance(init.module, FeatureHead) and init.module.variant == "specjax"):
            variant = getattr(init.module, "variant", None)
            kind = f"a published {variant!r} head" if variant else f"a {type(init.module).__name__}"
            parser.error(f"--init-from {args.init_from} holds {kind}, not a head saved by training.eagle or "
                         "heads.save_head; training.eagle continues specjax's own feature heads only.")
        got = (init.module.config.hidden_size, init.module.config.vocab_size)
        if got != (cfg_t.hidden_size, cfg_t.vocab_size):  # a head of another target: it cannot read this one's features
            parser.error(f"--init-from {args.init_from} is a head for a target of hidden size {got[0]} and "
                         f"{got[1]} tokens; --target {args.target} has {cfg_t.hidden_size} and {cfg_t.vocab_size}. "
                         "Continue a head of this target, or drop --init-from.")
        init = specjax.dequantize(init)  # trained in float: an int8-stored head's matrices dequantized (exactly)
        _check_blocks(parser, init.module.feature_layers, cfg_t.num_layers, f"--init-from {args.init_from}'s blocks")
    default_layers = init.module.feature_layers if init is not None else (-1,)
    feature_layers = tuple(run.get("feature_layers") or args.feature_layers or default_layers)
    if args.feature_layers and tuple(args.feature_layers) != feature_layers:
        raise SystemExit(f"error: {out} was started with --feature-layers {','.join(map(str, feature_layers))}; "
                         "resume with those or use another --out.")
    run["feature_layers"] = list(feature_layers)
    init_blocks = init.module.config.num_layers if init is not None else 1
    num_blocks = int(run.get("layers") or args.layers or init_blocks)
    if args.layers is not None and args.layers != num_blocks:
        raise SystemExit(f"error: {out} was started with --layers {num_blocks}; resume with that or use another --out.")
    if num_blocks < init_blocks:
        raise SystemExit(f"error: --layers {num_blocks} is fewer than the {init_blocks} blocks of {args.init_from}; "
                         "a head can grow, not shrink.")
    run["layers"] = num_blocks
    width = len(feature_layers) * cfg_t.hidden_size
    if "head_vocab_ids" in run:
        head_ids = np.asarray(run["head_vocab_ids"], np.int32)
    elif init is not None:
        head_ids = np.asarray(init.params["head_vocab_ids"], np.int32)
        if args.head_vocab is not None and args.head_vocab > head_ids.size:
            raise SystemExit(f"error: --head-vocab {args.head_vocab} is more than the {head_ids.size} ids of "
                             f"{args.init_from}; a head's vocabulary can narrow, not grow.")
        if args.head_vocab is not None and args.head_vocab < head_ids.size:  # narrow it to its most frequent ids
            head_ids = draft.head_vocabulary(distill_data.load_shards(args.data, limit=num_shards), args.head_vocab,
                                             cfg_t.vocab_size, tuple(cfg_t.eos_token_ids), among=head_ids)
    elif args.head_vocab_from:
        head_ids = _vocab_from(parser, args, cfg_t.vocab_size)
    else:
        head_ids = draft.head_vocabulary(distill_data.load_shards(args.data, limit=num_shards),
                                         args.head_vocab or 8192, cfg_t.vocab_size, tuple(cfg_t.eos_token_ids))
    run["head_vocab_ids"] = head_ids.tolist()
    meta_file.write_text(json.dumps(run))

    t0 = time.monotonic()
    n_new = 0 if args.online_features else extract_features(
        target, shard_files, out / "features", head_ids, seq_len=args.seq_len, batch=args.feature_batch,
        layers=feature_layers, log=log)
    if n_new:
        run["feature_seconds"] = run.get("feature_seconds", 0.0) + time.monotonic() - t0
        meta_file.write_text(json.dumps(run))
    heldout_prompts = chat_prompts.heldout_prompts()[: args.eval_prompts]
    held_shard = gather_heldout(target, heldout_prompts, out / "heldout", new_tokens=args.eval_new_tokens,
                                batch=args.eval_batch, log=log)
    extract_features(target, [held_shard], out / "heldout" / "features", head_ids, seq_len=args.seq_len,
                     batch=args.feature_batch, layers=feature_layers, log=log)
    if args.features_only:
        return 0

    train = load_rows(shard_files, None if args.online_features else out / "features", head_ids, args.seq_len,
                      cfg_t.vocab_size, width)
    held = load_rows([held_shard], out / "heldout" / "features", head_ids, args.seq_len, cfg_t.vocab_size, width)
    answer_tokens = int(train["mask"].sum())
    coverage = float(np.mean(train["teacher_ids"][..., 0][train["mask"]] >= 0))
    log(f"[eagle] {num_shards} shards: {train['tokens'].shape[0]} rows ({answer_tokens:,} answer tokens), head "
        f"covers {100 * coverage:.2f}% of the target's top-1; {held['tokens'].shape[0]} held-out rows")

    if init is not None:  # continue from an exported head (fresh optimizer and schedule)
        head0 = heads.with_feature_layers(heads.attach_embedding(init, target), feature_layers)
        head0 = heads.with_num_layers(head0, num_blocks)
        if head_ids.size < head0.module.config.head_vocab_size:
            head0 = heads.with_head_vocab(head0, head_ids)
    else:
        head0 = heads.init_from_target(target, jax.random.key(args.seed), head_ids, num_layers=num_blocks)
        if args.balanced_fuse:
            head0 = balance_fuse(head0)
        head0 = heads.with_feature_layers(head0, feature_layers)
    n_layers = len(feature_layers)
    cfg = head0.module.config
    trainable, frozen = split_params(head0.params)
    loss_fn = make_loss(cfg, unroll=args.unroll, reg_weight=args.reg_weight, unroll_weight=args.unroll_weight,
                        num_feature_layers=n_layers, tv_weight=args.tv_weight)
    inner = draft.batch_fn_for(train, args.batch, args.seed)
    if args.online_features:
        inner = online_features(target, feature_layers, inner)
    frozen_dev = jax.tree.map(jnp.asarray, frozen)
    batch_fn = lambda step: {**inner(step), "frozen": frozen_dev}  # noqa: E731
    if args.minutes is not None:  # the count is measured once and recorded: a resumed run keeps its schedule
        if "steps_for_minutes" not in run:
            secs = step_seconds(loss_fn, trainable, batch_fn)
            run["steps_for_minutes"] = max(1, int(args.minutes * 60 / secs))
            meta_file.write_text(json.dumps(run))
            log(f"[eagle] a training step takes {secs * 1e3:.1f} ms: {run['steps_for_minutes']} steps fit "
                f"{args.minutes:g} minutes")
        args.steps = run["steps_for_minutes"]
    optimizer = common.adamw(args.lr, max(args.steps, 1), warmup_steps=min(50, args.steps // 10), weight_decay=0.01)
    train_step = common.make_train_step(loss_fn, optimizer)
    state = common.init_state(jax.tree.map(jnp.copy, trainable), optimizer)  # the step donates its state
    ckpt = common.Checkpointer(out / "ckpt", every_seconds=args.checkpoint_seconds, log=log)
    meta = {"config": cfg.to_dict(), "num_shards": num_shards, "seed": args.seed,
            "unroll": args.unroll, "unroll_weight": args.unroll_weight, "reg_weight": args.reg_weight, "tv_weight": args.tv_weight, "lr": args.lr, "steps": args.steps,
            "batch": args.batch, "balanced_fuse": args.balanced_fuse, "feature_layers": list(feature_layers),
            "init_from": args.init_from}
    try:  # --steps may grow to continue a run; the rest defines the saved weights and their batches
        restored = ckpt.restore(state, settings={k: v for k, v in meta.items() if k != "steps"}, advice=(
            "rerun with the checkpoint's settings to resume it, or choose another --out to start a new run"),
            start_over="rerun with --fresh")
    except ValueError as e:  # CheckpointMismatch, or every step damaged
        ckpt.close()
        raise SystemExit(f"error: {e}") from None
    if restored is not None:
        state, meta = restored
        log(f"[eagle] resumed at step {int(state['step'])}")

    def eval_fn(step, state):
        res = agreement(cfg, {**state["params"], **frozen_dev}, held, num_feature_layers=n_layers)
        return {k: res[k] for k in ("step1", "step2", "step3", "expected_accepted", "overlap1", "overlap3")}

    state, meta = common.train_loop(
        state, train_step, batch_fn, args.steps, checkpointer=ckpt, meta=meta,
        tokens_per_step=args.batch * (args.seq_len - 1), eval_fn=eval_fn, eval_every=args.eval_every,
        log_every=10, desc="eagle", log_file=str(log_file), progress=not args.no_progress,
        stop_after=args.stop_after,
        deadline=None if args.time_limit is None else started + args.time_limit * 60,
    )
    ckpt.close()
    if args.train_only or args.stop_after is not None:
        return 0

    head = head0.replace(params={**jax.device_get(state["params"]), **frozen})
    draft_temperature, fit_table = 1.0, None
    if args.draft_temperature == "fit":
        calib = {k: v[: args.calibration_rows] for k, v in train.items()}
        if args.online_features:
            run_features = feature_fn(target, feature_layers)
            calib["features"] = np.concatenate([np.asarray(run_features(target.params, jnp.asarray(
                calib["tokens"][i:i + args.feature_batch]))) for i in range(0, len(calib["tokens"]), args.feature_batch)])
        draft_temperature, fit_table = fit_draft_temperature(cfg, head.params, calib, num_feature_layers=n_layers)
        log(f"[eagle] draft temperature {draft_temperature} (mean T=1 overlap of steps 1-3 on "
            f"{calib['tokens'].shape[0]} training rows: " + ", ".join(f"{t}: {v:.4f}" for t, v in fit_table.items())
            + ")")
    elif args.draft_temperature is not None:
        draft_temperature = float(args.draft_temperature)
    if draft_temperature != 1.0:
        head = with_draft_temperature(head, draft_temperature)
    extra = {"target": args.target, "head_vocab_from": args.head_vocab_from or None,
             "trained_by": "python -m training.eagle"}
    # Evaluated, carded and logged in the temporary directory, then swapped in
    # whole: an interruption leaves the old export or the complete new one.
    tmp = export(head, export_dir, extra=extra, weights_format=args.weights_format)
    # what users load, as float for agreement's own forward (an int8-stored head's exact weights)
    loaded = heads.attach_embedding(specjax.dequantize(specjax.load(tmp, dtype="float32")), target)
    res = agreement(loaded.module.config, loaded.params, held, num_feature_layers=n_layers)
    res0 = agreement(cfg, head0.params, held, num_feature_layers=n_layers)
    log(f"[eagle] held-out agreement (exported {args.weights_format}): {json.dumps(res)}; before training: {json.dumps(res0)}")
    n_params = common.param_count(trainable)
    evals = meta.get("evals", [])
    summary = {
        "name": export_dir.name, "target": args.target, "command": command, "run_id": run_id,
        "num_shards": num_shards, "train_rows": int(train["tokens"].shape[0]),
        "train_answer_tokens": answer_tokens, "head_coverage": coverage,
        "config": cfg.to_dict(), "params": n_params, "feature_layers": list(feature_layers),
        "bytes": (tmp / heads.WEIGHTS_FILE).stat().st_size,
        "steps": int(state["step"]), "planned_steps": int(args.steps),
        "batch": args.batch, "seq_len": args.seq_len, "lr": meta.get("lr", args.lr),
        "unroll": int(meta.get("unroll", args.unroll)), "reg_weight": meta.get("reg_weight", args.reg_weight),
        "tv_weight": meta.get("tv_weight", 0.0), "draft_temperature": draft_temperature,
        "draft_temperature_fit": None if fit_table is None else {str(t): v for t, v in fit_table.items()},
        "calibration_rows": min(args.calibration_rows, int(train["tokens"].shape[0])),
        "feature_minutes": float(run.get("feature_seconds", 0.0)) / 60,
        "train_minutes": float(meta.get("train_seconds", 0.0)) / 60,
        "tokens_seen": int(meta.get("tokens_seen", 0)),
        "machine": machine(), "online_features": bool(args.online_features), "weights_format": args.weights_format,
        "final_loss": float(meta.get("last_loss", float("nan"))),
        "heldout": res, "heldout_init": res0, "balanced_fuse": bool(meta.get("balanced_fuse", args.balanced_fuse)),
        "init_note": (f"{'made from' if args.steps == 0 else 'continued from'} {args.init_from}" + (
            f", grown from {init_blocks} to {num_blocks} blocks by `heads.with_num_layers` (each new block a copy "
            "of the top one with zero output projections: the grown head starts as the old one)"
            if num_blocks > init_blocks else "") + (
            f", its vocabulary narrowed from {init.module.config.head_vocab_size:,} to the {head_ids.size:,} ids the "
            "training shards use most by `heads.with_head_vocab`"
            if head_ids.size < init.module.config.head_vocab_size else "")) if args.init_from else None,
        "vocab_source": vocab_source(args, init, head_ids, coverage),
        "block_kind": block_kind(cfg_t.model_type),
        "compare_note": ("For comparison the separate draft `smollm2-draft` has first-slot acceptance 0.413 at T=0 "
                         "(measured by decoding). " if args.target == DEFAULT_TARGET else ""),
        "init_label": f"at the start of this run (--init-from {args.init_from})" if args.init_from
        else "initialised from the target (before training)", "heldout_new_tokens": args.eval_new_tokens, "evals": evals,
    }
    (tmp / "train_log.json").write_text(json.dumps({"summary": summary, "evals": evals}, indent=1))
    if args.steps == 0:
        source_rows = load_rows([held_shard], out / "heldout" / "features", np.asarray(init.params["head_vocab_ids"]),
                                args.seq_len, cfg_t.vocab_size, width)
        source = heads.with_feature_layers(heads.attach_embedding(init, target), feature_layers)
        summary["heldout_source"] = agreement(source.module.config, source.params, source_rows,
                                              num_feature_layers=n_layers)
        summary["init_from"] = args.init_from
        card = pathlib.Path(args.init_from) / "MODEL_CARD.md"
        (tmp / "train_log.json").write_text(json.dumps({"summary": summary, "evals": evals}, indent=1))
        write_derived_card(tmp / "MODEL_CARD.md", summary, card.read_text() if card.is_file() else None)
    else:
        write_card(tmp / "MODEL_CARD.md", summary)
    common.check_export(export_dir, force=force, run_id=run_id, command=command)  # filled while we trained?
    kept = common.swap_in(tmp, export_dir)
    if kept:
        log(f"[eagle] kept from the replaced {export_dir}: {', '.join(kept)} (files the export does not write)")
    log(f"[eagle] wrote {export_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(common.exit_on_interrupt("python -m training.eagle")(main)())
