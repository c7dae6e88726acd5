"""PAD's labels: which rejected draft tokens are pivots, decided by target rollouts.

For every prompt, a trajectory is decoded token by token with the draft
proposing and the target judging (pad.txt, the authors' labelling):

1. the draft proposes ``x_d`` (its argmax at ``temperature=0``, else a sample);
   one target forward over ``prefix + x_d`` gives, at the judging slot, the
   target's distribution ``p`` and, at ``x_d``'s own position, the hidden
   state at ``layer`` — exactly what the engine's verification forward hands
   the rule, and the features come out of the same
   :func:`specjax.rules.pivot_features`;
2. where standard SD rejects ``x_d`` (greedy: ``x_d != argmax p``; sampling:
   the coin ``U * q(x) > p(x)``, with the correction ``x_t`` drawn from the
   residual), ``N`` target continuations at ``rollout_temperature`` are
   sampled from ``prefix + x_d`` and ``N`` from ``prefix + x_t`` — the
   rollouts of ``rollout_chunk`` candidates at once in one jitted
   :func:`specjax.generate` call (fixed shape, one key per row), not a Python
   loop per rollout — and each is scored by the utility;
3. ``pivot = util(draft) < thr * util(target)`` (``mode="mul"``) or
   ``util(draft) < util(target) - thr`` (``mode="add"``);
4. the trajectory continues with ``x_d`` if it is not a pivot, else ``x_t``.

The authors' training filter (:func:`training_filter`) keeps positives whose
``util(draft)`` is low (``<= pos_max_draft_util``), negatives whose
``util(draft) >= neg_min_draft_util`` (0.8) and drops rows with
``util(target) = 0`` (the target fails from there anyway: no signal).

Utility is pluggable: ``utility(example_ids [R], completions: list[list[int]]) ->
float [R]`` in ``[0, 1]``, where a completion is every token generated after the
example's prompt (the trajectory so far, the candidate token, the rollout).
:func:`task_utility` is the embedded arithmetic task's exact match.

Features are computed from ``softmax(raw target logits)``: what the rule sees
at temperature 0 and at temperature 1 (no top-k / top-p).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
from functools import partial
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import specjax
from specjax._src.decode import ModelPair
from specjax._src.rules.base import residual_distribution
from specjax._src.rules.pad import pivot_features, resolve_layer

Utility = Callable[[np.ndarray, list], np.ndarray]


@dataclasses.dataclass
class LabelConfig:
    """Labelling settings (defaults: the authors')."""

    num_rollouts: int = 20  # N per side
    rollout_temperature: float = 0.7
    thr: float = 1.0
    mode: str = "mul"  # "mul": u_d < thr * u_t; "add": u_d < u_t - thr
    temperature: float = 0.0  # the labelled trajectory: 0 greedy, > 0 SD sampling
    max_new_tokens: int = 6  # trajectory length; rollouts get the same budget
    hidden_layer: int = -8  # clamped to the target's depth
    all_layers: bool = False  # also keep every block's hidden state (choose the layer when training)
    batch_size: int = 32  # prompts per trajectory batch
    rollout_chunk: int = 8  # candidates per generate call (rows: 2 * N * chunk)
    pos_max_draft_util: float = 0.5
    neg_min_draft_util: float = 0.8
    seed: int = 0

    def __post_init__(self):
        if self.mode not in ("mul", "add"):
            raise ValueError(f"mode must be 'mul' or 'add', got {self.mode!r}")
        if self.num_rollouts < 1:
            raise ValueError(f"num_rollouts must be >= 1, got {self.num_rollouts}")
        if self.rollout_temperature <= 0:
            raise ValueError("rollout_temperature must be > 0 (rollouts are samples)")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


def decide_pivot(u_draft, u_target, thr: float, mode: str = "mul") -> np.ndarray:
    """``u_d < thr * u_t`` (mul) or ``u_d < u_t - thr`` (add), elementwise."""
    u_draft, u_target = np.asarray(u_draft, np.float64), np.asarray(u_target, np.float64)
    if mode == "mul":
        return u_draft < thr * u_target
    if mode == "add":
        return u_draft < u_target - thr
    raise ValueError(f"mode must be 'mul' or 'add', got {mode!r}")


def training_filter(u_draft, u_target, pivot, pos_max_draft_util: float = 0.5,
                    neg_min_draft_util: float = 0.8) -> np.ndarray:
    """The authors' filter: which labelled rows to train on."""
    u_draft, u_target, pivot = np.asarray(u_draft), np.asarray(u_target), np.asarray(pivot, bool)
    pos = pivot & (u_draft <= pos_max_draft_util)
    neg = ~pivot & (u_draft >= neg_min_draft_util)
    return (u_target > 0) & (pos | neg)


# ----------------------------------------------------------------------------- dataset


@dataclasses.dataclass
class LabelledSet:
    """Labelled candidate tokens (one row per SD rejection on a trajectory).

    ``labels`` is 1 for a pivot. ``keep`` marks rows that pass the training
    filter. ``meta`` records how the set was made (JSON-able).
    """

    hidden: np.ndarray  # [N, H] float32
    scalars: np.ndarray  # [N, 2] float32: target entropy, p(draft token)
    labels: np.ndarray  # [N] int32
    keep: np.ndarray  # [N] bool
    u_draft: np.ndarray  # [N] float32
    u_target: np.ndarray  # [N] float32
    example: np.ndarray  # [N] int32: index of the prompt
    position: np.ndarray  # [N] int32: generated tokens before the candidate
    draft_token: np.ndarray  # [N] int32
    target_token: np.ndarray  # [N] int32
    meta: dict = dataclasses.field(default_factory=dict)
    hidden_by_layer: Optional[np.ndarray] = None  # [N, L, H], layers -L .. -1 (LabelConfig.all_layers)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def training_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(hidden, scalars, labels)`` of the rows the filter keeps."""
        k = self.keep.astype(bool)
        return self.hidden[k], self.scalars[k], self.labels[k]

    def hidden_at(self, layer: int) -> np.ndarray:
        """``[N, H]`` hidden states of ``layer`` (clamped like the rule does)."""
        n_layers = int(self.meta.get("target_num_layers", 0)) or None
        want = resolve_layer(layer, n_layers) if n_layers else int(layer)
        if want == int(self.meta.get("layer", want)):
            return self.hidden
        if self.hidden_by_layer is None:
            raise ValueError(
                f"this labelled set holds layer {self.meta.get('layer')} only, not {layer}; gather with "
                "--all-layers to choose the layer when training."
            )
        return self.hidden_by_layer[:, want + self.hidden_by_layer.shape[1]]

    def save(self, path: str | os.PathLike) -> pathlib.Path:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name != "meta" and getattr(self, f.name) is not None}
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, meta=np.asarray(json.dumps(self.meta)), **arrays)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LabelledSet":
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"labelled dataset {path} not found; create it with `python -m training.pivot --gather "
                f"--dataset {path}`."
            )
        with np.load(path) as z:
            kw = {f.name: z[f.name] for f in dataclasses.fields(cls) if f.name != "meta" and f.name in z.files}
            meta = json.loads(str(z["meta"])) if "meta" in z.files else {}
        return cls(**kw, meta=meta)

    @classmethod
    def concat(cls, parts: Sequence["LabelledSet"], hidden_size: int, meta: dict) -> "LabelledSet":
        if not parts:
            return cls(
                hidden=np.zeros((0, hidden_size), np.float32), scalars=np.zeros((0, 2), np.float32),
                labels=np.zeros((0,), np.int32), keep=np.zeros((0,), bool),
                u_draft=np.zeros((0,), np.float32), u_target=np.zeros((0,), np.float32),
                example=np.zeros((0,), np.int32), position=np.zeros((0,), np.int32),
                draft_token=np.zeros((0,), np.int32), target_token=np.zeros((0,), np.int32), meta=meta,
            )
        kw = {f.name: np.concatenate([getattr(p, f.name) for p in parts])
              for f in dataclasses.fields(cls)
              if f.name != "meta" and all(getattr(p, f.name) is not None for p in parts)}
        return cls(**kw, meta=meta)


# ----------------------------------------------------------------------------- utility


def task_utility(tokenizer, answers: Sequence[str]) -> Utility:
    """Exact match of the embedded arithmetic task (:func:`training.data.score_answer`)."""
    from training import data
    from training import tokenizer as tokenizer_lib

    def utility(example_ids, completions):
        return np.array(
            [float(data.score_answer(tokenizer_lib.decode(tokenizer, c), answers[int(e)]))
             for e, c in zip(example_ids, completions)],
            np.float32,
        )

    return utility


def newline_token_ids(tokenizer, vocab_size: int) -> list[int]:
    """Every token whose text contains a newline: the task's answer ends at one."""
    from training import tokenizer as tokenizer_lib

    return [i for i in range(vocab_size) if "\n" in tokenizer_lib.decode(tokenizer, [i])]


# ----------------------------------------------------------------------------- the jitted pieces


@partial(jax.jit, static_argnames=("layer", "greedy", "all_layers"))
def propose_and_judge(pair: ModelPair, buf, lengths, key, temperature, *, layer: int, greedy: bool,
                      all_layers: bool = False):
    """One labelling step for a batch: the draft proposes, one target forward judges.

    ``buf[B, W]`` right-padded token rows with ``lengths[B]`` valid tokens
    (causal attention: padding after a row never influences it).

    Returns ``dict(draft, target, reject, hidden [B, H], scalars [B, 2])``:
    ``target`` is the target's token (argmax, or the residual sample when SD
    rejects), ``reject`` whether standard SD rejects ``draft``.
    """
    vocab = pair.vocab_size
    b = buf.shape[0]
    rows = jnp.arange(b)
    k_draft, k_coin, k_resid = jax.random.split(key, 3)
    q_raw = pair.draft.module.apply(pair.draft.params, buf).logits[rows, lengths - 1, :vocab]
    if greedy:
        x_d = jnp.argmax(q_raw, -1).astype(jnp.int32)
    else:
        x_d = jax.random.categorical(k_draft, q_raw / temperature, axis=-1).astype(jnp.int32)
    buf2 = buf.at[rows, lengths].set(x_d)
    n_layers = pair.target.module.num_layers
    extra = tuple(range(-n_layers, 0)) if all_layers else ()
    out = pair.target.module.apply(pair.target.params, buf2, hidden_layers=(layer,) + extra)
    raw = out.logits[rows, lengths - 1, :vocab]
    hidden = out.hidden[0][rows, lengths]
    h, scalars = pivot_features(hidden[:, None], jax.nn.softmax(raw, -1)[:, None], x_d[:, None])
    if greedy:
        x_t = jnp.argmax(raw, -1).astype(jnp.int32)
        reject = x_d != x_t
    else:
        p = jax.nn.softmax(raw / temperature, -1)
        q = jax.nn.softmax(q_raw / temperature, -1)
        px, qx = p[rows, x_d], q[rows, x_d]
        u = jax.random.uniform(k_coin, (b,))
        reject = ~(u * qx <= px)
        resid = residual_distribution(p, q)
        x_t = jax.random.categorical(k_resid, jnp.log(jnp.maximum(resid, 1e-30)), axis=-1).astype(jnp.int32)
        x_t = jnp.where(reject, x_t, x_d)
    res = dict(draft=x_d, target=x_t, reject=reject, hidden=h[:, 0], scalars=scalars[:, 0])
    if all_layers:
        res["hidden_by_layer"] = jnp.stack([x[rows, lengths] for x in out.hidden[1:]], axis=1)
    return res


# ----------------------------------------------------------------------------- gathering


def gather_labels(
    pair: ModelPair,
    prompts: Sequence[Sequence[int]],
    utility: Utility,
    config: LabelConfig = LabelConfig(),
    *,
    eos_token_ids: Sequence[int] = (),
    progress: bool = True,
    return_trajectories: bool = False,
):
    """Labels SD-rejected draft tokens on trajectories from ``prompts``.

    Args:
      pair: ``specjax.pair(target, draft)``.
      prompts: token lists (each with its BOS if the models use one).
      utility: ``utility(example_ids, completions) -> float array`` (see module doc).
      config: :class:`LabelConfig`.
      eos_token_ids: tokens that end a trajectory / rollout (the task: newline tokens).
      return_trajectories: also return the labelled trajectories (completions).

    Returns:
      :class:`LabelledSet` (and the list of completions if asked).
    """
    if len(prompts) == 0:
        raise ValueError("gather_labels(): no prompts.")
    target_module = pair.target.module
    num_layers = int(target_module.num_layers)
    layer = resolve_layer(config.hidden_layer, num_layers)
    hidden_size = int(target_module.hidden_size)
    greedy = float(config.temperature) == 0.0
    eos = tuple(int(i) for i in eos_token_ids)
    eos_arr = np.asarray(eos, np.int64)
    n_roll, m = int(config.num_rollouts), int(config.max_new_tokens)
    bsz = int(min(config.batch_size, len(prompts)))
    p_max = max(len(p) for p in prompts)
    width = p_max + m + 1
    key = jax.random.key(config.seed)
    parts, trajectories = [], []
    num_batches = (len(prompts) + bsz - 1) // bsz
    bar = tqdm(total=len(prompts), desc="label", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    stats = {"steps": 0, "candidates": 0, "pivots": 0}
    for bi in range(num_batches):
        idx = np.arange(bi * bsz, min((bi + 1) * bsz, len(prompts)))
        real = len(idx)
        buf = np.zeros((bsz, width), np.int32)
        plen = np.ones((bsz,), np.int32)
        for r, i in enumerate(idx):
            buf[r, : len(prompts[i])] = prompts[i]
            plen[r] = len(prompts[i])
        lengths = plen.copy()
        done = np.zeros((bsz,), bool)
        done[real:] = True
        rows: list[dict] = []
        for step in range(m):
            if done.all():
                break
            key, k_step, k_roll = jax.random.split(key, 3)
            res = jax.device_get(propose_and_judge(
                pair, jnp.asarray(buf), jnp.asarray(lengths), k_step, np.float32(max(config.temperature, 1e-6)),
                layer=layer, greedy=greedy, all_layers=bool(config.all_layers)))
            x_d, x_t = res["draft"].astype(np.int32), res["target"].astype(np.int32)
            cand = res["reject"].astype(bool) & ~done
            chosen = x_d.copy()
            stats["steps"] += 1
            if cand.any():
                u_d, u_t = _rollout_utilities(pair, buf, lengths, plen, idx, x_d, x_t, cand, utility,
                                              k_roll, n_roll, m, float(config.rollout_temperature), eos,
                                              chunk=config.rollout_chunk)
                pivot = decide_pivot(u_d, u_t, config.thr, config.mode)
                keep = training_filter(u_d, u_t, pivot, config.pos_max_draft_util, config.neg_min_draft_util)
                chosen = np.where(cand & pivot, x_t, x_d)
                for r in np.flatnonzero(cand):
                    rows.append(dict(
                        hidden=res["hidden"][r], scalars=res["scalars"][r], labels=int(pivot[r]),
                        hidden_by_layer=res["hidden_by_layer"][r] if config.all_layers else None,
                        keep=bool(keep[r]), u_draft=u_d[r], u_target=u_t[r], example=int(idx[r]),
                        position=int(lengths[r] - plen[r]), draft_token=int(x_d[r]), target_token=int(x_t[r])))
                stats["candidates"] += int(cand.sum())
                stats["pivots"] += int((cand & pivot).sum())
            live = ~done
            buf[np.arange(bsz)[live], lengths[live]] = chosen[live]
            lengths = np.where(live, lengths + 1, lengths)
            hit_eos = live & np.isin(chosen, eos_arr) if eos else np.zeros_like(live)
            done = done | hit_eos | (lengths - plen >= m)
        if rows:
            parts.append(LabelledSet(
                hidden=np.stack([r["hidden"] for r in rows]).astype(np.float32),
                scalars=np.stack([r["scalars"] for r in rows]).astype(np.float32),
                hidden_by_layer=(np.stack([r["hidden_by_layer"] for r in rows]).astype(np.float32)
                                 if config.all_layers else None),
                **{k: np.asarray([r[k] for r in rows], dt) for k, dt in (
                    ("labels", np.int32), ("keep", bool), ("u_draft", np.float32), ("u_target", np.float32),
                    ("example", np.int32), ("position", np.int32), ("draft_token", np.int32),
                    ("target_token", np.int32))},
            ))
        for r in range(real):
            trajectories.append(buf[r, plen[r]: lengths[r]].tolist())
        bar.update(real)
        bar.set_postfix(cand=stats["candidates"], pivots=stats["pivots"], refresh=False)
    bar.close()
    meta = {
        "config": dataclasses.asdict(config),
        "layer": layer,
        "target_num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_prompts": len(prompts),
        "eos_token_ids": list(eos),
        **stats,
    }
    out = LabelledSet.concat(parts, hidden_size, meta)
    return (out, trajectories) if return_trajectories else out


def _rollout_utilities(pair, buf, lengths, plen, idx, x_d, x_t, cand, utility, key, n_roll, m,
                       temperature, eos, chunk: int = 8):
    """Mean utility of ``n_roll`` target rollouts from ``prefix + x_d`` and ``prefix + x_t``
    for the candidate rows of the batch.

    Candidates are packed ``chunk`` at a time (the last chunk padded by
    repeating a candidate) into ``[chunk * 2 * n_roll, W]`` prompt rows, so
    every call of :func:`specjax.generate` has one shape: one compile, one
    jitted on-device loop per chunk with one PRNG key per row.
    """
    bsz, width = buf.shape
    util_d = np.zeros((bsz,), np.float64)
    util_t = np.zeros((bsz,), np.float64)
    rows_c = np.flatnonzero(cand)
    chunk = int(min(chunk, bsz))
    for ci, c0 in enumerate(range(0, len(rows_c), chunk)):
        sel = rows_c[c0: c0 + chunk]
        real = len(sel)
        sel = np.concatenate([sel, np.full((chunk - real,), sel[0])])
        starts = np.repeat(buf[sel][:, None, :], 2, axis=1)  # [C, 2, W]
        starts[np.arange(chunk), 0, lengths[sel]] = x_d[sel]
        starts[np.arange(chunk), 1, lengths[sel]] = x_t[sel]
        prompts = np.repeat(starts[:, :, None, :], n_roll, axis=2).reshape(-1, width)
        plens = np.repeat(lengths[sel] + 1, 2 * n_roll)
        keys = jax.random.split(jax.random.fold_in(key, ci), prompts.shape[0])
        out = specjax.generate(
            pair, prompts, prompt_lengths=plens, max_new_tokens=m, temperature=temperature,
            eos_token_id=list(eos) if eos else None, key=keys,
        )
        toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
        n_used = real * 2 * n_roll
        owner = np.repeat(sel, 2 * n_roll)[:n_used]
        comps = [prompts[j, plen[owner[j]]: plens[j]].tolist() + toks[j, : lens[j]].tolist()
                 for j in range(n_used)]
        u = np.asarray(utility(np.asarray(idx[owner]), comps), np.float64).reshape(real, 2, n_roll).mean(-1)
        util_d[sel[:real]] = u[:, 0]
        util_t[sel[:real]] = u[:, 1]
    return util_d, util_t
