"""The EAGLE-style head unrolled for training (:mod:`training.eagle`): stages 3 and 4.

The head run ``steps`` times on its own predicted features with the attention it has when
drafting, the loss (cross-entropy to the target's top-32, feature regression, unrolled steps),
the offline agreement with the target on held-out rows, and the draft temperature fitted on them.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import Model, heads
from specjax.heads import FeatureHeadModule
from training import common


FROZEN = ("embed", "head_vocab_ids")  # the parameters the head borrows from the target and never trains


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
        mask[:, (m - 1) * t : m * t] = s == j - (step - m)
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
            logits = jnp.einsum("bth,hv->btv", x.astype(dtype), params["lm_head"], preferred_element_type=jnp.float32)
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


def make_loss(
    cfg,
    *,
    unroll: int,
    reg_weight: float,
    unroll_weight: float = 1.0,
    num_feature_layers: int = 1,
    tv_weight: float = 0.0,
):
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
            heads.reduce_features(params, h["next_features"], num_feature_layers, cfg.norm_eps)
        )
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
    return ({k: v for k, v in params.items() if k not in FROZEN}, {k: v for k, v in params.items() if k in FROZEN})


@functools.lru_cache(maxsize=8)
def _jitted_unrolled(cfg, steps: int, num_feature_layers: int):
    return jax.jit(make_unrolled(cfg, steps, num_feature_layers))


def agreement(cfg, params: dict, rows: dict, *, steps: int = 3, batch: int = 16, num_feature_layers: int = 1) -> dict:
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
        b = {k: v[s : s + batch] for k, v in rows.items()}
        pad = batch - b["tokens"].shape[0]
        if pad:
            b = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in b.items()}
        h = head_inputs(b)
        outs = run(params, jnp.asarray(h["tokens"]), jnp.asarray(h["features"]))
        ids = h["teacher_ids"][..., 0]
        correct.append(np.stack([np.asarray(jnp.argmax(lg, -1)) == ids for lg, _ in outs])[:, : batch - pad])
        overlap.append(
            np.stack([np.asarray(_overlap(lg, h["teacher_ids"], h["teacher_logp"])) for lg, _ in outs])[
                :, : batch - pad
            ]
        )
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
        start_ok[:, k - 1 :] = ans[:, : t - k + 1]
        m = ans & start_ok
        out[f"step{k}"] = float((correct[k - 1] & m).sum() / max(m.sum(), 1))
        out[f"overlap{k}"] = float(np.where(m, overlap[k - 1], 0.0).sum() / max(m.sum(), 1))
        # chains started at i: drafts k at i + k - 1 all correct
        if k == 1:
            chain = correct[0].copy()
        else:
            nxt = np.zeros_like(ans)
            nxt[:, : t - k + 1] = correct[k - 1][:, k - 1 :] & ans[:, k - 1 :]
            chain = chain & nxt
            chain_valid = chain_valid & np.pad(ans[:, k - 1 :], ((0, 0), (0, k - 1)))
        out[f"chain{k}"] = float((chain & chain_valid).sum() / max(chain_valid.sum(), 1))
        expected += out[f"chain{k}"]
    out["expected_accepted"] = expected
    return out


# ----------------------------------------------------------------------------- draft temperature


DRAFT_TEMPERATURES = tuple(round(0.5 + 0.05 * i, 2) for i in range(15))  # 0.5 .. 1.2


def fit_draft_temperature(
    cfg,
    params: dict,
    rows: dict,
    *,
    steps: int = 3,
    batch: int = 16,
    num_feature_layers: int = 1,
    grid=DRAFT_TEMPERATURES,
) -> tuple[float, dict]:
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
        b = {k: v[s : s + batch] for k, v in rows.items()}
        h = head_inputs(b)
        mask = jnp.asarray(h["mask"])
        outs = run(params, jnp.asarray(h["tokens"]), jnp.asarray(h["features"]))
        ids, logp = jnp.asarray(h["teacher_ids"]), jnp.asarray(h["teacher_logp"])
        sums = jnp.stack(
            [sum(jnp.sum(jnp.where(mask, _overlap(lg / t, ids, logp), 0.0)) for lg, _ in outs) for t in grid]
        )
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
