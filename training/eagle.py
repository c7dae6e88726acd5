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

Reproduce the shipped head (see its MODEL_CARD.md for the exact command)::

    python -m training.eagle --export specjax/assets/models/smollm2-eagle
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import pathlib
import platform
import shutil
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import specjax
from specjax import Model, heads
from specjax.heads import FeatureHead, FeatureHeadModule
from training import chat_prompts, common, distill_data, draft

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_VOCAB_FROM = "specjax/assets/models/smollm2-draft"
FROZEN = ("embed", "head_vocab_ids")


# ----------------------------------------------------------------------------- features


def feature_fn(target: Model, layers=(-1,)):
    """``jit(params, tokens [B, S]) -> features [B, S, n * H] bfloat16``: the
    outputs of the target blocks ``layers``, concatenated (no LM head)."""
    module = target.module
    layers = tuple(layers)

    @jax.jit
    def run(params, tokens):
        out = module.apply(params, tokens, hidden_layers=layers,
                           logits_at=jnp.zeros((tokens.shape[0],), jnp.int32))
        return jnp.concatenate(out.hidden, axis=-1).astype(jnp.bfloat16)

    return run


def _machine() -> str:
    """The machine that trained, for the model card: the accelerator where there is one."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        return f"one {device.device_kind} ({device.platform.upper()})"
    return f"{platform.machine()} CPU, {os.cpu_count()} cores (shared)"


def online_features(target: Model, layers, batch_fn):
    """``batch_fn`` with each batch's ``features`` computed by the target then and
    there (:func:`feature_fn`, the values :func:`extract_features` stores) rather
    than read from disk: on an accelerator the target's forward costs little
    beside the head's step, and nothing of ``[N, seq_len, n * H]`` is stored or loaded."""
    run = feature_fn(target, layers)
    params = jax.device_put(target.params)

    def batch(step: int):
        b = batch_fn(step)
        return {**b, "features": run(params, b["tokens"])}

    return batch


def _shard_rows(shard: dict, head_ids: np.ndarray, seq_len: int, vocab_size: int) -> dict:
    return draft.build_rows(shard, head_ids, seq_len, vocab_size)


def extract_features(target: Model, shard_files: list, out_dir: pathlib.Path, head_ids: np.ndarray, *,
                     seq_len: int, batch: int, layers=(-1,), log=print) -> int:
    """Writes ``out_dir/<shard name>.npz`` (``features`` as uint16 bits of bfloat16
    ``[N, seq_len, n * H]`` for the n target blocks ``layers``, ``tokens [N, seq_len]``)
    for every shard not done yet.

    Returns the number of shards computed by this call (0 when all existed).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    run = feature_fn(target, layers)
    vocab = target.module.config.vocab_size
    done = 0
    for i, f in enumerate(shard_files):
        dest = out_dir / f"{pathlib.Path(f).stem}.npz"
        if dest.exists():
            continue
        t0 = time.monotonic()
        rows = _shard_rows(dict(np.load(f)), head_ids, seq_len, vocab)
        tokens = rows["tokens"]
        n = tokens.shape[0]
        parts = []
        for s in range(0, n, batch):
            chunk = tokens[s:s + batch]
            pad = batch - chunk.shape[0]  # the last chunk reuses the compiled program
            if pad:
                chunk = np.concatenate([chunk, np.zeros((pad, seq_len), np.int32)])
            parts.append(np.asarray(jax.device_get(run(target.params, jnp.asarray(chunk))))[: batch - pad])
        feats = np.concatenate(parts).view(np.uint16)
        tmp = out_dir / f".{dest.stem}.tmp.npz"
        np.savez(tmp, features=feats, tokens=tokens)
        os.replace(tmp, dest)  # a feature file exists only once it is complete
        done += 1
        dt = time.monotonic() - t0
        log(f"[features] {dest.name} ({i + 1}/{len(shard_files)}): {n} rows, {dt:.1f} s "
            f"({n * seq_len / dt:.0f} tok/s)")
    return done


def load_rows(shard_files: list, feat_dir: pathlib.Path | None, head_ids: np.ndarray, seq_len: int,
              vocab_size: int, width: int | None = None) -> dict:
    """Distillation rows (:func:`training.draft.build_rows`) plus their features
    (bfloat16, ``width`` wide when given); without ``feat_dir``, the rows alone
    (:func:`online_features` adds the features per batch)."""
    parts = []
    for f in shard_files:
        rows = _shard_rows(dict(np.load(f)), head_ids, seq_len, vocab_size)
        if feat_dir is None:
            parts.append(rows)
            continue
        name = f"{feat_dir}/{pathlib.Path(f).stem}.npz"
        z = np.load(name)
        if not np.array_equal(z["tokens"], rows["tokens"]):
            raise ValueError(f"{name} was computed for other rows; delete it.")
        if width is not None and z["features"].shape[-1] != width:
            raise ValueError(f"{name} holds {z['features'].shape[-1]}-wide features, not the {width} these "
                             "feature layers need; use another --out (or delete that features directory).")
        rows["features"] = z["features"].view(ml_dtypes.bfloat16)
        parts.append(rows)
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def gather_heldout(target: Model, prompts: list[str], out_dir: pathlib.Path, *, new_tokens: int,
                   batch: int, log=print) -> pathlib.Path:
    """Greedy answers of the target to ``prompts`` in the distill_data shard format
    (one shard; reused when present)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "shard_00000.npz"
    if path.exists():
        return path
    encoded = distill_data.encode_prompts(target, prompts)
    width = -(-max(len(p) for p in encoded) // 8) * 8
    eos = target.module.config.eos_token_ids or (target.module.config.eos_token_id,)
    eos_ids = jnp.asarray(eos, jnp.int32)
    keep = {k: [] for k in ("tokens", "answer_lengths", "top_ids", "top_logprobs")}
    t0 = time.monotonic()
    for s in range(0, len(encoded), batch):
        rows = encoded[s:s + batch]
        padded = np.zeros((batch, width), np.int32)
        lengths = np.ones((batch,), np.int32)
        for j, r in enumerate(rows):
            padded[j, :len(r)] = r
            lengths[j] = len(r)
        temps = jnp.zeros((batch,), jnp.float32)
        tokens, top_i, top_lp, ans = jax.device_get(distill_data._answer(
            target.module, target.params, jnp.asarray(padded), jnp.asarray(lengths),
            (jax.random.key(0), temps, eos_ids), new_tokens, 32))
        n = len(rows)
        keep["tokens"].append(np.concatenate([padded, tokens], axis=1)[:n])
        keep["answer_lengths"].append(ans[:n].astype(np.int32))
        keep["top_ids"].append(top_i[:n].astype(np.int32))
        keep["top_logprobs"].append(top_lp[:n].astype(np.float16))
    tmp = out_dir / ".shard_00000.tmp.npz"
    np.savez(tmp, **{k: np.concatenate(v) for k, v in keep.items()},
             prompt_lengths=np.asarray([len(p) for p in encoded], np.int32),
             temperatures=np.zeros((len(encoded),), np.float32),
             prompt_index=np.arange(len(encoded), dtype=np.int32))
    os.replace(tmp, path)
    log(f"[heldout] {len(encoded)} greedy answers of up to {new_tokens} tokens in {time.monotonic() - t0:.0f} s")
    return path


# ----------------------------------------------------------------------------- the head, unrolled


def chain_mask(t: int, steps: int, step: int) -> np.ndarray:
    """``[T, steps * T]`` bool: what head position ``j`` at draft step ``step`` (1-based) sees.

    The head's KV buffer holds the target-feature pass (step 1) in slots
    ``[0, T)`` and step ``m``'s pass in ``[(m - 1) T, m T)``. A chain drafted
    from the target's feature at position ``j - step + 1`` sees the step-1
    keys up to that position and its own later keys at ``j - step + m``
    (step ``m``), exactly as when drafting with a cache.
    """
    j = np.arange(t)[:, None]
    s = np.arange(t)[None, :]
    mask = np.zeros((t, steps * t), bool)
    mask[:, :t] = s <= j - step + 1
    for m in range(2, step + 1):
        mask[:, (m - 1) * t:m * t] = s == j - (step - m)
    return mask


def make_unrolled(cfg, steps: int, num_feature_layers: int = 1):
    """``f(params, tokens [B, T], features [B, T, n H]) -> [(reduced logits [B, T, V'], f_hat [B, T, H])] * steps``.

    Step 1 reads the given target features (mixed by ``reduce`` when the head
    reads n > 1 blocks); step ``m > 1`` reads step ``m - 1``'s
    ``f_hat`` shifted one position right (position ``j`` reads the prediction
    made at ``j - 1``), attending as :func:`chain_mask` says. Logits are over
    the reduced head only (``lm_head`` columns, in ``head_vocab_ids`` order).
    """
    module = FeatureHeadModule(cfg)
    eps = cfg.norm_eps

    def run(params, tokens, features):
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        size = steps * t
        dtype = jnp.dtype(cfg.dtype)
        zeros = jnp.zeros((b, cfg.num_kv_heads, size, cfg.head_dim), dtype)
        caches = tuple((zeros, zeros) for _ in range(cfg.num_layers))
        out = []
        features = heads.reduce_features(params, features, num_feature_layers, eps)
        feats = features
        for m in range(1, steps + 1):
            lengths = jnp.full((b,), (m - 1) * t, jnp.int32)
            mask = jnp.asarray(chain_mask(t, steps, m))[None]
            _, f_hat, caches = module.apply({"params": params}, tokens, feats, positions, caches, lengths, None, mask)
            x = f_hat.astype(jnp.float32)
            x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
            x = params["final_norm"]["scale"].astype(jnp.float32) * x.astype(dtype).astype(jnp.float32)
            logits = jnp.einsum("bth,hv->btv", x.astype(dtype), params["lm_head"],
                                preferred_element_type=jnp.float32)
            out.append((logits, f_hat))
            feats = jnp.concatenate([features[:, :1].astype(f_hat.dtype), f_hat[:, :-1]], axis=1)
        return out

    return run


def _rms_normalise(x):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def head_inputs(batch: dict) -> dict:
    """Row arrays -> head positions: position ``i`` reads ``(f_i, x_{i+1})`` and
    predicts ``x_{i+2}`` (the teacher at row position ``i + 1``) and ``f_{i+1}``."""
    return {
        "tokens": batch["tokens"][:, 1:],
        "features": batch["features"][:, :-1],
        "next_features": batch["features"][:, 1:],
        "teacher_ids": batch["teacher_ids"][:, 1:],
        "teacher_logp": batch["teacher_logp"][:, 1:],
        "mask": batch["mask"][:, 1:],
    }


def _ce(logits, ids, logp):
    logq = jax.nn.log_softmax(logits, axis=-1)
    in_head = ids >= 0
    teacher = jnp.where(in_head, logp.astype(jnp.float32), -jnp.inf)
    p = jnp.where(in_head, jax.nn.softmax(teacher, axis=-1), 0.0)
    p = jnp.where(in_head.any(-1, keepdims=True), p, 0.0)
    logq_t = jnp.take_along_axis(logq, jnp.maximum(ids, 0), axis=-1)
    return -jnp.sum(p * logq_t, axis=-1), in_head.any(-1)


def _overlap(logits, ids, logp):
    """``sum_v min(p_v, q_v)`` over the target's top-k ids in the head: the chance
    that speculative sampling at T=1 accepts a draft sampled from ``q``
    (Leviathan et al., arXiv:2211.17192, Corollary 3.6), short of the mass
    outside the top-k. Unlike the cross-entropy, it rewards a sharper ``q``
    where the head is unsure (DistillSpec, arXiv:2310.08461, trains on this
    total variation distance)."""
    q = jax.nn.softmax(logits, axis=-1)
    in_head = ids >= 0
    q_t = jnp.take_along_axis(q, jnp.maximum(ids, 0), axis=-1)
    p = jnp.exp(logp.astype(jnp.float32))
    return jnp.sum(jnp.where(in_head, jnp.minimum(p, q_t), 0.0), axis=-1)


def _smooth_l1(a, b):
    d = jnp.abs(a - b)
    return jnp.mean(jnp.where(d < 1.0, 0.5 * d * d, d - 0.5), axis=-1)


def make_loss(cfg, *, unroll: int, reg_weight: float, unroll_weight: float = 1.0, num_feature_layers: int = 1,
              tv_weight: float = 0.0):
    """``loss_fn(trainable, batch) -> (loss, aux)``; ``batch`` carries the frozen
    ``embed`` / ``head_vocab_ids`` params under ``"frozen"``.

    With several feature blocks the regression target is the next position's
    ``reduce`` mixture (what ``f_hat`` stands in for at the next draft step),
    held constant: ``reduce`` learns from the cross-entropy alone.

    ``tv_weight`` adds ``tv_weight * (1 - overlap)`` per step (:func:`_overlap`):
    the T=1 rejection chance itself, next to the cross-entropy that serves T=0.
    """
    run = make_unrolled(cfg, unroll, num_feature_layers)

    def loss_fn(trainable, batch):
        params = {**trainable, **batch["frozen"]}
        h = head_inputs(batch)
        outs = run(params, h["tokens"], h["features"])
        ans = h["mask"]
        total, aux = 0.0, {}
        for m, (logits, f_hat) in enumerate(outs, start=1):
            ce, in_head = _ce(logits, h["teacher_ids"], h["teacher_logp"])
            mask = ans & in_head
            ce = jnp.sum(jnp.where(mask, ce, 0.0)) / jnp.maximum(mask.sum(), 1)
            agree = (jnp.argmax(logits, -1) == h["teacher_ids"][..., 0]) & ans
            aux[f"ce_{m}"] = ce
            aux[f"top1_{m}"] = agree.sum() / jnp.maximum(ans.sum(), 1)
            step_loss = ce
            if tv_weight:
                overlap = jnp.sum(jnp.where(ans, _overlap(logits, h["teacher_ids"], h["teacher_logp"]), 0.0))
                overlap = overlap / jnp.maximum(ans.sum(), 1)
                aux[f"overlap_{m}"] = overlap
                step_loss = step_loss + tv_weight * (1.0 - overlap)
            total = total + (1.0 if m == 1 else unroll_weight) * step_loss
        next_features = jax.lax.stop_gradient(
            heads.reduce_features(params, h["next_features"], num_feature_layers, cfg.norm_eps))
        reg = _smooth_l1(_rms_normalise(outs[0][1]), _rms_normalise(next_features))
        reg = jnp.sum(jnp.where(ans, reg, 0.0)) / jnp.maximum(ans.sum(), 1)
        aux["reg"] = reg
        return total + reg_weight * reg, aux

    return loss_fn


def step_seconds(loss_fn, trainable: dict, batch_fn, *, probe_steps: int = 10) -> float:
    """Wall seconds of one optimizer step (after compiling), timed over ``probe_steps``
    steps on a copy of ``trainable`` that is then discarded."""
    optimizer = common.adamw(1e-9, probe_steps + 1, warmup_steps=0, weight_decay=0.0)
    train_step = common.make_train_step(loss_fn, optimizer)
    state = common.init_state(jax.tree.map(jnp.copy, trainable), optimizer)
    state, metrics = train_step(state, batch_fn(0))  # compiles
    float(metrics["loss"])
    t0 = time.monotonic()
    for step in range(1, probe_steps + 1):  # as train_loop does: a host sync every step
        state, metrics = train_step(state, batch_fn(step))
        float(metrics["loss"])
    return (time.monotonic() - t0) / probe_steps


def balance_fuse(head: Model) -> Model:
    """``fuse``'s token half set to ``I / rms(embedding)``: the token enters the block
    at the same (unit) scale as the normalised feature from the first step.

    ``init_from_target`` leaves it at small noise, so the head starts blind to
    ``x_{i+1}`` and AdamW needs ~1000 steps at lr 5e-4 to grow it (measured:
    held-out step-1 agreement 0.15 after 100 steps, loss still ~10 at 160).
    """
    params = dict(head.params)
    table = params["embed"]["embedding"]
    h = head.module.config.hidden_size
    rms = float(jnp.sqrt(jnp.mean(jnp.square(table.astype(jnp.float32)))))
    kernel = params["fuse"]["kernel"]
    params["fuse"] = {"kernel": kernel.at[:h].set(jnp.eye(h, dtype=kernel.dtype) / rms)}
    return head.replace(params=params)


def split_params(params: dict) -> tuple[dict, dict]:
    """(trainable, frozen): the target's embedding and the head ids are frozen."""
    return ({k: v for k, v in params.items() if k not in FROZEN},
            {k: v for k, v in params.items() if k in FROZEN})


@functools.lru_cache(maxsize=8)
def _jitted_unrolled(cfg, steps: int, num_feature_layers: int):
    return jax.jit(make_unrolled(cfg, steps, num_feature_layers))


def agreement(cfg, params: dict, rows: dict, *, steps: int = 3, batch: int = 16,
              num_feature_layers: int = 1) -> dict:
    """Offline top-1 agreement of the head with the target at draft steps 1..``steps``.

    Step ``k`` at head position ``j`` is the k-th draft of a chain started at
    ``j - k + 1`` (both inside the answer), tokens being the target's own.
    ``chain_k``: the share of chains whose first ``k`` drafts all agree (the
    chance that K >= k drafts are all accepted at T=0); ``expected_accepted``
    sums them (mean accepted drafts per chain for K = ``steps``).
    ``overlap_k``: the mean of ``sum_v min(p_v, q_v)`` at step ``k``, the
    acceptance chance of speculative sampling at T=1 (:func:`_overlap`; the
    held-out text is the target's greedy answers).
    """
    run = _jitted_unrolled(cfg, steps, num_feature_layers)
    n = rows["tokens"].shape[0]
    correct, overlap, valid = [], [], []
    for s in range(0, n, batch):
        b = {k: v[s:s + batch] for k, v in rows.items()}
        pad = batch - b["tokens"].shape[0]
        if pad:
            b = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in b.items()}
        h = head_inputs(b)
        outs = run(params, jnp.asarray(h["tokens"]), jnp.asarray(h["features"]))
        ids = h["teacher_ids"][..., 0]
        correct.append(np.stack([np.asarray(jnp.argmax(lg, -1)) == ids for lg, _ in outs])[:, : batch - pad])
        overlap.append(np.stack([np.asarray(_overlap(lg, h["teacher_ids"], h["teacher_logp"]))
                                 for lg, _ in outs])[:, : batch - pad])
        valid.append(h["mask"][: batch - pad])
    correct = np.concatenate(correct, axis=1)  # [steps, N, T]
    overlap = np.concatenate(overlap, axis=1)
    ans = np.concatenate(valid)  # [N, T]
    out = {"rows": int(n), "answer_positions": int(ans.sum())}
    t = ans.shape[1]
    chain = np.ones_like(ans)
    chain_valid = ans.copy()
    expected = 0.0
    for k in range(1, steps + 1):
        # step k at j, chain start j - k + 1 in the answer
        start_ok = np.zeros_like(ans)
        start_ok[:, k - 1:] = ans[:, : t - k + 1]
        m = ans & start_ok
        out[f"step{k}"] = float((correct[k - 1] & m).sum() / max(m.sum(), 1))
        out[f"overlap{k}"] = float(np.where(m, overlap[k - 1], 0.0).sum() / max(m.sum(), 1))
        # chains started at i: drafts k at i + k - 1 all correct
        if k == 1:
            chain = correct[0].copy()
        else:
            nxt = np.zeros_like(ans)
            nxt[:, : t - k + 1] = correct[k - 1][:, k - 1:] & ans[:, k - 1:]
            chain = chain & nxt
            chain_valid = chain_valid & np.pad(ans[:, k - 1:], ((0, 0), (0, k - 1)))
        out[f"chain{k}"] = float((chain & chain_valid).sum() / max(chain_valid.sum(), 1))
        expected += out[f"chain{k}"]
    out["expected_accepted"] = expected
    return out


# ----------------------------------------------------------------------------- draft temperature


DRAFT_TEMPERATURES = tuple(round(0.5 + 0.05 * i, 2) for i in range(15))  # 0.5 .. 1.2


def fit_draft_temperature(cfg, params: dict, rows: dict, *, steps: int = 3, batch: int = 16,
                          num_feature_layers: int = 1, grid=DRAFT_TEMPERATURES) -> tuple[float, dict]:
    """The draft temperature ``t`` that maximises the mean T=1 overlap
    ``sum_v min(p_v, softmax(logits / t)_v)`` over draft steps ``1..steps`` on ``rows``.

    A head trained by cross-entropy is as unsure as the target at each
    position, but sampling acceptance ``sum min(p, q)`` rewards a ``q`` sharper
    than that where the head is often wrong about the top token. The rows
    hold the target's top 32 only, and beyond them a flatter ``q`` would
    overlap too, so this fit leans sharp: on the real pair's held-out rows the
    shipped head's step-1 overlap against the target's full distribution was
    0.567 at ``t = 1`` and 0.581 at 0.8, against the top-32 figures' 0.547 and
    0.569 (BENCHMARKS.md). Returns ``(t, {t: mean overlap})``.
    """
    run = _jitted_unrolled(cfg, steps, num_feature_layers)
    totals = {t: 0.0 for t in grid}
    count = 0
    for s in range(0, rows["tokens"].shape[0], batch):
        b = {k: v[s:s + batch] for k, v in rows.items()}
        h = head_inputs(b)
        mask = jnp.asarray(h["mask"])
        outs = run(params, jnp.asarray(h["tokens"]), jnp.asarray(h["features"]))
        ids, logp = jnp.asarray(h["teacher_ids"]), jnp.asarray(h["teacher_logp"])
        sums = jnp.stack([sum(jnp.sum(jnp.where(mask, _overlap(lg / t, ids, logp), 0.0)) for lg, _ in outs)
                          for t in grid])
        for t, v in zip(grid, np.asarray(sums).tolist()):  # one host transfer per batch
            totals[t] += v
        count += int(mask.sum()) * steps
    table = {t: v / max(count, 1) for t, v in totals.items()}
    return max(table, key=table.get), table


def with_draft_temperature(head: Model, t: float) -> Model:
    """``head`` with its logits divided by ``t``: ``final_norm``'s scale times
    ``1 / t`` (the reduced LM head is linear in it), so nothing else changes:
    the same argmax (greedy drafts), a sharper (``t < 1``) sampling law."""
    params = dict(head.params)
    norm = params["final_norm"]
    params["final_norm"] = {**norm, "scale": (norm["scale"].astype(jnp.float32) / t).astype(norm["scale"].dtype)}
    return head.replace(params=params)


# ----------------------------------------------------------------------------- export


def as_bfloat16(head: Model) -> Model:
    cfg = head.module.config.replace(dtype="bfloat16")
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x if (str(getattr(p[-1], "key", p[-1])) == "head_vocab_ids" or
                           str(getattr(p[0], "key", p[0])) == "embed") else jnp.asarray(x, jnp.bfloat16),
        head.params)
    return head.replace(params=params, module=FeatureHead(cfg, feature_layers=head.module.feature_layers))


def export(head: Model, dest: pathlib.Path, *, extra: dict, weights_format: str = "bfloat16") -> pathlib.Path:
    """Writes the head in bfloat16, or its matrices as int8 (``weights_format``;
    :func:`specjax.heads.save_head`), without the borrowed embedding, into a
    temporary sibling of ``dest`` (returned); ``common.swap_in`` puts it in
    place once its card and logs are written too."""
    tmp = dest.with_name(dest.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    heads.save_head(as_bfloat16(head), str(tmp), extra=extra,
                    weights_format=None if weights_format == "bfloat16" else weights_format)
    return tmp


def _stored_as(s: dict) -> str:
    if s.get("weights_format", "bfloat16") == "int8":
        return "int8 (a float16 scale per output channel)"
    return "bfloat16"


def _describe_layers(layers) -> str:
    if list(layers) == [-1]:
        return "its target's last-block features (before its final norm)"
    named = ["the last" if x == -1 else str(x) for x in layers]
    return (f"a learned mixture of its target's block outputs {', '.join(named[:-1])} and {named[-1]} "
            "(EAGLE-3's low, middle and high features; the last before the final norm)")


def _temperature_note(s: dict) -> str:
    t = s.get("draft_temperature", 1.0)
    fit = s.get("draft_temperature_fit")
    if t == 1.0 and not fit:
        return ""
    how = (f"fitted by `--draft-temperature fit`: the mean T=1 overlap of draft steps 1-3 on "
           f"{s.get('calibration_rows')} training rows went from {fit['1.0']:.4f} at 1.0 to {fit[str(t)]:.4f}"
           if fit else "given by `--draft-temperature`")
    return (f"\nDraft temperature: the exported head's logits are divided by {t} (its final norm's scale "
            f"times 1/{t}; greedy drafts are unchanged, sampled drafts are sharper), {how}. The held-out "
            "figures above are the exported head's.\n")


def _vocab_source(args, init, head_ids, coverage: float) -> str:
    """Where the head's reduced vocabulary came from, for its card."""
    if init is not None:
        if head_ids.size < init.module.config.head_vocab_size:
            return "the ones of its source head's vocabulary the training shards use most"
        return "its source head's vocabulary"
    if args.head_vocab_from:
        return f"the same vocabulary as `{pathlib.Path(args.head_vocab_from).name}`"
    return f"the ids the training answers use most, {100 * coverage:.2f}% of the target's top-1 tokens there"


def _block_kind(model_type: str) -> str:
    """The family name of a head's blocks (they copy the target's layout)."""
    return {"gemma": "Gemma", "gemma2": "Gemma 2", "gemma3_text": "Gemma 3", "qwen2": "Qwen2", "qwen3": "Qwen3",
            "mistral": "Mistral"}.get(model_type, "Llama")


def _blocks_word(n: int) -> str:
    return {1: "one", 2: "two", 3: "three", 4: "four"}.get(n, str(n))


def write_card(path: pathlib.Path, s: dict) -> None:
    ev = s["heldout"]
    ev0 = s["heldout_init"]
    evals = s.get("evals") or []
    curve = "\n".join(f"| {e['step']} | {e['step1']:.3f} | {e['step2']:.3f} | {e['step3']:.3f} |" for e in evals)
    text = f"""# {s['name']}: an EAGLE-style feature head for {s['target']}

A {_blocks_word(s['config']['num_layers'])}-block draft head that reads {_describe_layers(s.get('feature_layers', [-1]))} and the next token, predicts the next feature and, through a
final norm and a reduced LM head ({s['config']['head_vocab_size']} tokens, {s.get('vocab_source') or 'the same vocabulary as `smollm2-draft`'}), the token after it
(`specjax/_src/models/feature_head.py`). It borrows the target's embedding
table: the checkpoint stores only the head's own weights; pair it with the
target (`specjax.pair(target, specjax.load(...))`).

Trained by `python -m training.eagle` on the target's own answers gathered by
`python -m training.draft --gather-only` (`training/distill_data.py`: greedy / T=0.7 / T=1
answers to generated chat prompts, top-32 log-probabilities per token):
{s['train_rows']:,} rows from {s['num_shards']} shards, {s['train_answer_tokens']:,} answer tokens.

Command: `{s['command']}`

Loss per head position on answer tokens: cross-entropy to the target's
renormalised top-32 within the head vocabulary (KL up to a constant), plus
{s['reg_weight']} x smooth-L1 between RMS-normalised predicted and true next
features (EAGLE-1), {"plus the same cross-entropy for a second draft step that reads the head's own predicted features, attending as when drafting (EAGLE-3's training-time test, " + str(s['unroll']) + " steps)" if s['unroll'] > 1 else "no unrolled steps"}{", plus " + str(s['tv_weight']) + " x (1 - sum min(p, q)) per step, the T=1 rejection chance (total variation, DistillSpec arXiv:2310.08461)" if s.get('tv_weight') else ""}. Embedding frozen.

| | |
|---|---|
| head | {'reduce [' + str(len(s.get('feature_layers', [-1]))) + 'H -> H] over the RMS-normalised blocks, ' if len(s.get('feature_layers', [-1])) > 1 else ''}fuse [2H -> H], feature norm, {s['config']['num_layers']} {s.get('block_kind', 'Llama')} block{'s' if s['config']['num_layers'] > 1 else ''} (the target's width: hidden {s['config']['hidden_size']}, {s['config']['num_heads']} / {s['config']['num_kv_heads']} heads, MLP {s['config']['intermediate_size']}), final norm, LM head over {s['config']['head_vocab_size']} tokens |
| init | the target's last block, final norm and embedding rows; fuse = identity on the feature half{', I / rms(embedding) on the token half (`balance_fuse`)' if s.get('balanced_fuse') else ''}{'; then ' + s['init_note'] if s.get('init_note') else ''} |
| params (without the borrowed embedding) | {s['params']:,} ({s['bytes']:,} bytes of {_stored_as(s)} safetensors) |
| steps / batch | {s['steps']}{f" (of {s['planned_steps']} planned: the time limit came first)" if s.get('planned_steps', s['steps']) > s['steps'] else ''} / {s['batch']} rows x {s['seq_len']} tokens, AdamW lr {s['lr']} (warmup, cosine) |
| wall time | {'features computed in each step, ' if s.get('online_features') else f"features {s['feature_minutes']:.1f} min, "}training {s['train_minutes']:.1f} min on {s['machine']} |
| final train loss | {s['final_loss']:.4f} |

Offline top-1 agreement with the target on {ev['rows']} held-out chat prompts
(subjects no training prompt uses; the target's greedy answers, up to
{s['heldout_new_tokens']} tokens, {ev['answer_positions']:,} answer positions),
float32 evaluation of the exported {s.get('weights_format', 'bfloat16')} weights. Step 1 reads the target's
feature (= first-slot acceptance at T=0); steps 2 and 3 read the head's own
predicted features with the target's tokens. `chain k`: share of chains whose
first k drafts all agree. `T=1 overlap`: mean `sum_v min(p_v, q_v)` over the
target's top 32 (the acceptance chance of speculative sampling at T=1).

| | step 1 | step 2 | step 3 | chain 2 | chain 3 | expected accepted of 3 | T=1 overlap, step 1 / 3 |
|---|---|---|---|---|---|---|---|
| {s['init_label']} | {ev0['step1']:.3f} | {ev0['step2']:.3f} | {ev0['step3']:.3f} | {ev0['chain2']:.3f} | {ev0['chain3']:.3f} | {ev0['expected_accepted']:.2f} | {ev0['overlap1']:.3f} / {ev0['overlap3']:.3f} |
| **this head** | **{ev['step1']:.3f}** | **{ev['step2']:.3f}** | **{ev['step3']:.3f}** | {ev['chain2']:.3f} | {ev['chain3']:.3f} | {ev['expected_accepted']:.2f} | {ev['overlap1']:.3f} / {ev['overlap3']:.3f} |

{s.get('compare_note', '')}End-to-end acceptance and speed with the engine are not measured here.

Held-out agreement during training:

| step | step 1 | step 2 | step 3 |
|---|---|---|---|
{curve}
{_temperature_note(s)}
{s.get('notes', '')}
Training log in `train_log.json`.
"""
    path.write_text(text)


def write_derived_card(path: pathlib.Path, s: dict, source_card: Optional[str]) -> None:
    """The card of an untrained export (``--steps 0``): what was done to the
    ``--init-from`` head, both heads' held-out agreement, then the source
    head's own card (how it was trained), one heading level down."""
    ev, ev0 = s["heldout"], s["heldout_source"]
    row = lambda label, e: (f"| {label} | {e['step1']:.3f} | {e['step2']:.3f} | {e['step3']:.3f} | "  # noqa: E731
                            f"{e['chain3']:.3f} | {e['expected_accepted']:.2f} | {e['overlap1']:.3f} / {e['overlap3']:.3f} |")
    source = ""
    if source_card:
        demoted = "\n".join("#" + line if line.startswith("#") else line for line in source_card.splitlines())
        source = f"\n## The head it comes from: its own card\n\n{demoted}\n"
    text = f"""# {s['name']}: an EAGLE-style feature head for {s['target']}

{s['init_note'][0].upper() + s['init_note'][1:]}; not trained further. The LM head
scores {s['config']['head_vocab_size']:,} tokens ({100 * s['head_coverage']:.2f}% of the target's top-1 tokens on the
training shards), {s['params']:,} parameters ({s['bytes']:,} bytes of {_stored_as(s)} safetensors) without the
embedding it borrows from the target.

Command: `{s['command']}`

Offline top-1 agreement with the target on {ev['rows']} held-out chat prompts ({ev['answer_positions']:,} answer
positions; step 1 reads the target's feature, steps 2 and 3 the head's own; float32 evaluation of the exported
{s.get('weights_format', 'bfloat16')} weights):

| | step 1 | step 2 | step 3 | chain 3 | expected accepted of 3 | T=1 overlap, step 1 / 3 |
|---|---|---|---|---|---|---|
{row(f"the head it comes from ({s['init_from']})", ev0)}
{row("**this head**", ev)}
{source}"""
    path.write_text(text)


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
        "machine": _machine(), "online_features": bool(args.online_features), "weights_format": args.weights_format,
        "final_loss": float(meta.get("last_loss", float("nan"))),
        "heldout": res, "heldout_init": res0, "balanced_fuse": bool(meta.get("balanced_fuse", args.balanced_fuse)),
        "init_note": (f"{'made from' if args.steps == 0 else 'continued from'} {args.init_from}" + (
            f", grown from {init_blocks} to {num_blocks} blocks by `heads.with_num_layers` (each new block a copy "
            "of the top one with zero output projections: the grown head starts as the old one)"
            if num_blocks > init_blocks else "") + (
            f", its vocabulary narrowed from {init.module.config.head_vocab_size:,} to the {head_ids.size:,} ids the "
            "training shards use most by `heads.with_head_vocab`"
            if head_ids.size < init.module.config.head_vocab_size else "")) if args.init_from else None,
        "vocab_source": _vocab_source(args, init, head_ids, coverage),
        "block_kind": _block_kind(cfg_t.model_type),
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
