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
   rollouts of ``2 * rollout_chunk`` such sides at once in one jitted
   :func:`specjax.generate` call (fixed shape, one key per row), not a Python
   loop per rollout — and each is scored by the utility (a side whose
   utility is already decided is scored without rollouts, see below);
3. ``pivot = util(draft) < thr * util(target)`` (``mode="mul"``) or
   ``util(draft) < util(target) - thr`` (``mode="add"``);
4. the trajectory continues with ``x_d`` if it is not a pivot, else ``x_t``.

Decode budget. A trajectory runs ``max_new_tokens`` tokens and stops early
only at ``eos_token_ids`` (for the task: the model's EOS, *not* the newline
that ends the answer), like a fixed-budget decode of ``specjax compare``.
When the budget extends past the answer, the text after it is decoded — and
labelled — too: rejections there cannot change a first-line utility, so
they come out as genuine non-pivots (PAD's premise: most tokens do not
affect the outcome). A rollout continues a candidate prefix for the rest of
the budget (``max_new_tokens`` minus the prefix; longer rollouts are cut
there) and stops early at ``rollout_eos_token_ids`` (for the task: a
newline, after which nothing can change the score).

The authors' training filter (:func:`training_filter`) keeps positives whose
``util(draft)`` is low (``<= pos_max_draft_util``), negatives whose
``util(draft) >= neg_min_draft_util`` (0.8) and drops rows with
``util(target) = 0`` (the target fails from there anyway: no signal).

Utility is pluggable: ``utility(example_ids [R], completions: list[list[int]]) ->
float [R]`` in ``[0, 1]``, where a completion is every token generated after the
example's prompt (the trajectory so far, the candidate token, the rollout).
:func:`task_utility` is the embedded arithmetic task's exact match;
:class:`ChatTaskUtility` the real pair's short-answer task.

Optional shortcut: a utility may also have a method
``is_final(example_ids [R], completions) -> bool [R]`` that is True only where
the value is already decided by the completion so far — ``utility(c + s) ==
utility(c)`` for every continuation ``s``. A candidate side (``prefix + x_d``
or ``prefix + x_t``) that is final is scored directly, ``utility(c)``, with no
rollouts (its rollouts' mean would be that value anyway). A side with no budget
left is final too. The shortcut changes no label: rollout keys are derived
per (trajectory row, side), not from how sides are packed into calls
(``tests/test_pivot.py`` checks the labels are identical with and without it).
For the task, a completion is final once it holds the newline that ends the
answer (:class:`TaskUtility`); ``LabelConfig.use_is_final=False`` turns the
shortcut off.

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
from specjax import ModelPair
from specjax.rules import pivot_features, residual_distribution, resolve_layer

Utility = Callable[[np.ndarray, list], np.ndarray]  # optionally with .is_final (see module doc)


@dataclasses.dataclass
class LabelConfig:
    """Labelling settings (defaults: the authors')."""

    num_rollouts: int = 20  # N per side
    rollout_temperature: float = 0.7  # 0: one greedy rollout per side (what a T=0 decode would write)
    thr: float = 1.0
    mode: str = "mul"  # "mul": u_d < thr * u_t; "add": u_d < u_t - thr
    temperature: float = 0.0  # the labelled trajectory: 0 greedy, > 0 SD sampling
    max_new_tokens: int = 32  # decode budget of a trajectory; a rollout gets what its prefix leaves
    hidden_layer: int = -8  # clamped to the target's depth
    all_layers: bool = False  # also keep every block's hidden state (choose the layer when training)
    batch_size: int = 32  # prompts per trajectory batch
    rollout_chunk: int = 8  # candidates per generate call (rows: 2 * N * chunk sides)
    pos_max_draft_util: float = 0.5
    neg_min_draft_util: float = 0.8
    seed: int = 0
    use_is_final: bool = True  # score finished prefixes directly (utility.is_final), no rollouts

    def __post_init__(self):
        if self.mode not in ("mul", "add"):
            raise ValueError(f"mode must be 'mul' or 'add', got {self.mode!r}")
        if self.num_rollouts < 1:
            raise ValueError(f"num_rollouts must be >= 1, got {self.num_rollouts}")
        if self.rollout_temperature < 0:
            raise ValueError(f"rollout_temperature must be >= 0, got {self.rollout_temperature}")
        if self.rollout_temperature == 0 and self.num_rollouts != 1:
            raise ValueError(f"rollout_temperature 0 rolls out greedily: its {self.num_rollouts} rollouts per side "
                             "would all be the same; use num_rollouts=1 (--rollouts 1).")
        if self.rollout_chunk < 1:
            raise ValueError(f"rollout_chunk must be >= 1, got {self.rollout_chunk}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


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


class TaskUtility:
    """Exact match of the embedded arithmetic task (:func:`training.data.score_answer`:
    the first line of the completion, stripped, equals the answer).

    ``is_final``: a completion that already contains a newline has its first
    line fixed, so nothing generated after it can change the score.
    """

    def __init__(self, tokenizer, answers: Sequence[str]):
        self.tokenizer = tokenizer
        self.answers = list(answers)

    def _text(self, completion) -> str:
        from training import tokenizer as tokenizer_lib

        return tokenizer_lib.decode(self.tokenizer, list(completion))

    def __call__(self, example_ids, completions) -> np.ndarray:
        from training import data

        return np.array([float(data.score_answer(self._text(c), self.answers[int(e)]))
                         for e, c in zip(example_ids, completions)], np.float32)

    def is_final(self, example_ids, completions) -> np.ndarray:
        del example_ids
        return np.array(["\n" in self._text(c) for c in completions], bool)


def task_utility(tokenizer, answers: Sequence[str]) -> TaskUtility:
    """The arithmetic task's utility, with its ``is_final`` shortcut."""
    return TaskUtility(tokenizer, answers)


class ChatTaskUtility:
    """The real pair's short-answer task (``specjax compare --pair smollm2``):
    1.0 where the answer occurs in the reply as a whole word, case-insensitive
    (:func:`specjax.evaluation.answer_in_reply`), else 0.0.

    ``is_final``: the answer already occurs *and* a non-word character follows
    it, so no continuation can take it back ("Paris" at the very end could
    still become "Parisian"). A reply without the answer is never final.
    """

    def __init__(self, tokenizer, answers: Sequence[str]):
        self.tokenizer = tokenizer
        self.answers = [str(a).strip() for a in answers]

    def _text(self, completion) -> str:
        return self.tokenizer.decode([int(t) for t in completion])

    def __call__(self, example_ids, completions) -> np.ndarray:
        from specjax.evaluation import answer_in_reply

        return np.array([float(answer_in_reply(self._text(c), self.answers[int(e)]))
                         for e, c in zip(example_ids, completions)], np.float32)

    def is_final(self, example_ids, completions) -> np.ndarray:
        import re

        return np.array([re.search(rf"(?<![\w]){re.escape(self.answers[int(e)])}(?=[^\w])", self._text(c),
                                   re.IGNORECASE) is not None for e, c in zip(example_ids, completions)], bool)


def final_mask(utility: Utility, example_ids, completions) -> np.ndarray:
    """``utility.is_final(...)`` as a bool array, or all False for a utility without one."""
    fn = getattr(utility, "is_final", None)
    if fn is None:
        return np.zeros((len(completions),), bool)
    out = np.asarray(fn(np.asarray(example_ids), completions), bool).reshape(-1)
    if out.shape[0] != len(completions):
        raise ValueError(f"utility.is_final returned {out.shape[0]} values for {len(completions)} completions")
    return out


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
    rollout_eos_token_ids: Optional[Sequence[int]] = None,
    progress: bool = True,
    return_trajectories: bool = False,
):
    """Labels SD-rejected draft tokens on trajectories from ``prompts``.

    Args:
      pair: ``specjax.pair(target, draft)``.
      prompts: token lists (each with its BOS if the models use one).
      utility: ``utility(example_ids, completions) -> float array`` (see module doc).
      config: :class:`LabelConfig`.
      eos_token_ids: tokens that end a trajectory (and a rollout); the task: the model's EOS.
      rollout_eos_token_ids: tokens that end a rollout (default: ``eos_token_ids``); the
        task: newline tokens too, after which the score cannot change.
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
    roll_eos = eos if rollout_eos_token_ids is None else tuple(int(i) for i in rollout_eos_token_ids)
    n_roll, m = int(config.num_rollouts), int(config.max_new_tokens)
    bsz = int(min(config.batch_size, len(prompts)))
    p_max = max(len(p) for p in prompts)
    width = p_max + m + 1
    key = jax.random.key(config.seed)
    parts, trajectories = [], []
    num_batches = (len(prompts) + bsz - 1) // bsz
    bar = tqdm(total=len(prompts), desc="label", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    stats = {"steps": 0, "candidates": 0, "pivots": 0, "sides_rolled_out": 0, "sides_final": 0}
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
                u_d, u_t, n_rolled, n_final = _rollout_utilities(
                    pair, buf, lengths, plen, idx, x_d, x_t, cand, utility, k_roll, n_roll, m,
                    float(config.rollout_temperature), roll_eos, chunk=config.rollout_chunk,
                    use_is_final=config.use_is_final)
                stats["sides_rolled_out"] += n_rolled
                stats["sides_final"] += n_final
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
        "rollout_eos_token_ids": list(roll_eos),
        **stats,
    }
    out = LabelledSet.concat(parts, hidden_size, meta)
    return (out, trajectories) if return_trajectories else out


@partial(jax.jit, static_argnames=("n",))
def _unit_keys(key, rows, sides, *, n: int):
    """``[U, n]`` rollout keys of each (trajectory row, side) unit: a function of the
    unit only, so which units share a generate call changes no rollout."""
    return jax.vmap(lambda r, s: jax.random.split(jax.random.fold_in(jax.random.fold_in(key, r), s), n))(
        rows, sides)


def _rollout_utilities(pair, buf, lengths, plen, idx, x_d, x_t, cand, utility, key, n_roll, m,
                       temperature, eos, chunk: int = 8, use_is_final: bool = True):
    """Mean utility of ``n_roll`` target rollouts from ``prefix + x_d`` (side 0)
    and ``prefix + x_t`` (side 1) for the candidate rows of the batch.

    A side whose completion is final (``utility.is_final``, when
    ``use_is_final``, or no budget left) is scored directly. The other sides
    are packed ``2 * chunk`` at a time (the last pack padded by repeating a
    side) into ``[2 * chunk * n_roll, W]`` prompt rows, so every call of
    :func:`specjax.generate` has one shape: one compile, one jitted on-device
    loop per pack with one PRNG key per row. Each rollout is cut at the
    decode budget ``m`` (counted from the prompt).

    Returns ``(util_draft [B], util_target [B], sides rolled out, sides scored directly)``.
    """
    bsz, width = buf.shape
    util = np.zeros((bsz, 2), np.float64)
    rows_c = np.flatnonzero(cand)
    if len(rows_c) == 0:
        return util[:, 0], util[:, 1], 0, 0
    # every (row, side) unit: its completion so far (trajectory + candidate token)
    u_rows = np.repeat(rows_c, 2)
    u_sides = np.tile(np.arange(2), len(rows_c))
    u_tok = np.where(u_sides == 0, x_d[u_rows], x_t[u_rows])
    comps = [buf[r, plen[r]: lengths[r]].tolist() + [int(t)] for r, t in zip(u_rows, u_tok)]
    final = np.array([len(c) >= m for c in comps], bool)
    if use_is_final:
        final |= final_mask(utility, idx[u_rows], comps)
    if final.any():
        f = np.flatnonzero(final)
        util[u_rows[f], u_sides[f]] = np.asarray(
            utility(np.asarray(idx[u_rows[f]]), [comps[j] for j in f]), np.float64)
    todo = np.flatnonzero(~final)
    if len(todo):
        keys_all = _unit_keys(key, jnp.asarray(u_rows[todo], jnp.int32), jnp.asarray(u_sides[todo], jnp.int32),
                              n=n_roll)
        pack = 2 * int(min(chunk, bsz))
        new = max(m - 1, 1)  # the most any rollout can use (the candidate sits at position >= 0)
        for c0 in range(0, len(todo), pack):
            sel = todo[c0: c0 + pack]
            real = len(sel)
            sel_k = np.arange(c0, c0 + real)
            sel = np.concatenate([sel, np.full((pack - real,), sel[0])])
            sel_k = np.concatenate([sel_k, np.full((pack - real,), sel_k[0])])
            r_of, t_of = u_rows[sel], u_tok[sel]
            starts = buf[r_of].copy()
            starts[np.arange(pack), lengths[r_of]] = t_of
            prompts = np.repeat(starts, n_roll, axis=0)  # [pack * n_roll, W]
            plens = np.repeat(lengths[r_of] + 1, n_roll)
            keys = keys_all[jnp.asarray(sel_k)].reshape(-1)
            out = specjax.generate(
                pair, prompts, prompt_lengths=plens, max_new_tokens=new, temperature=temperature,
                eos_token_id=list(eos) if eos else None, key=keys,
            )
            toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
            n_used = real * n_roll
            owner = np.repeat(sel, n_roll)[:n_used]
            rcomps = []
            for j in range(n_used):
                c = comps[owner[j]]
                rcomps.append(c + toks[j, : min(int(lens[j]), m - len(c))].tolist())
            u = np.asarray(utility(np.asarray(idx[u_rows[owner]]), rcomps), np.float64)
            util[u_rows[sel[:real]], u_sides[sel[:real]]] = u.reshape(real, n_roll).mean(-1)
    return util[:, 0], util[:, 1], int(len(todo)), int(final.sum())
