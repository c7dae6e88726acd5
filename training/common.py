"""Reusable training pieces: AdamW schedule, jitted train step, resumable loop.

Shared by :mod:`training.lm` (the shipped pair) and the PAD head trainer.

* :func:`adamw` -- AdamW with linear warmup and cosine decay, global-norm
  clipping, and no weight decay on vectors (norm scales, biases).
* :func:`make_train_step` -- ``jit(state, batch) -> (state, metrics)`` from a
  ``loss_fn(params, batch) -> (loss, aux)``; the state is a plain dict
  ``{"step", "params", "opt_state"}`` (a pytree Orbax saves as is).
* :class:`Checkpointer` -- an Orbax ``CheckpointManager`` that saves the state
  plus a JSON ``meta`` dict (data seed, config, tokens seen, wall time ...)
  every ``every_seconds`` (and/or ``every_steps``), keeps the last few, and
  restores the latest one.
* :func:`train_loop` -- runs steps ``state["step"] .. num_steps`` with a tqdm
  bar showing the loss, periodic log lines, optional periodic evaluation and
  checkpointing. Batches come from ``batch_fn(step)``, which must be a pure
  function of the step (see :func:`training.data.make_batch`): then a run
  killed at any point resumes from its last checkpoint and reproduces the
  uninterrupted run exactly.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

State = dict  # {"step": int32[], "params": pytree, "opt_state": pytree}


# ----------------------------------------------------------------------------- optimizer


def adamw(
    peak_lr: float,
    total_steps: int,
    *,
    warmup_steps: int = 100,
    end_lr_fraction: float = 0.1,
    weight_decay: float = 0.1,
    b1: float = 0.9,
    b2: float = 0.95,
    clip_norm: Optional[float] = 1.0,
) -> optax.GradientTransformation:
    """AdamW, linear warmup to ``peak_lr`` then cosine to ``end_lr_fraction * peak_lr``."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak_lr,
        warmup_steps=warmup_steps,
        decay_steps=max(total_steps, warmup_steps + 1),
        end_value=peak_lr * end_lr_fraction,
    )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    parts = []
    if clip_norm is not None:
        parts.append(optax.clip_by_global_norm(clip_norm))
    parts.append(
        optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask)
    )
    return optax.chain(*parts)


def init_state(params: Any, optimizer: optax.GradientTransformation) -> State:
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": optimizer.init(params),
    }


def make_train_step(
    loss_fn: Callable[[Any, Any], tuple[jax.Array, Mapping[str, jax.Array]]],
    optimizer: optax.GradientTransformation,
    *,
    donate: bool = True,
) -> Callable[[State, Any], tuple[State, dict]]:
    """A jitted optimizer step. ``loss_fn(params, batch) -> (loss, aux dict)``."""

    def step(state: State, batch: Any):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), **aux}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    return jax.jit(step, donate_argnums=(0,) if donate else ())


# ----------------------------------------------------------------------------- checkpoints


class Checkpointer:
    """Periodic, resumable Orbax checkpoints of ``(state, meta)``.

    Args:
      directory: checkpoint root (one sub-directory per saved step).
      every_seconds: save when this much wall time passed since the last save.
      every_steps: also save every this many steps (``None``: time only).
      max_to_keep: how many recent checkpoints to keep.
    """

    def __init__(
        self,
        directory: str | pathlib.Path,
        *,
        every_seconds: float = 180.0,
        every_steps: Optional[int] = None,
        max_to_keep: int = 2,
    ):
        self.directory = pathlib.Path(directory).absolute()
        self.every_seconds = every_seconds
        self.every_steps = every_steps
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )
        self._last_save = time.monotonic()

    def latest_step(self) -> Optional[int]:
        return self._manager.latest_step()

    def restore(self, like: State, step: Optional[int] = None) -> Optional[tuple[State, dict]]:
        """The latest (or given) checkpoint, shaped like ``like``; ``None`` if there is none."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        return out["state"], dict(out["meta"])

    def due(self, step: int) -> bool:
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return time.monotonic() - self._last_save >= self.every_seconds

    def save(self, step: int, state: State, meta: Mapping[str, Any]) -> None:
        if self._manager.latest_step() == step:
            return
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))
            ),
            force=True,
        )
        self._last_save = time.monotonic()

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


# ----------------------------------------------------------------------------- loop


def _log(msg: str, log_file=None) -> None:
    tqdm.write(msg, file=sys.stdout)
    sys.stdout.flush()
    if log_file is not None:
        with open(log_file, "a") as f:
            f.write(msg + "\n")


def train_loop(
    state: State,
    train_step: Callable[[State, Any], tuple[State, dict]],
    batch_fn: Callable[[int], Any],
    num_steps: int,
    *,
    checkpointer: Optional[Checkpointer] = None,
    meta: Optional[dict] = None,
    tokens_per_step: int = 0,
    eval_fn: Optional[Callable[[int, State], Mapping[str, float]]] = None,
    eval_every: int = 0,
    log_every: int = 50,
    desc: str = "train",
    log_file: Optional[str] = None,
    progress: bool = True,
    stop_after: Optional[int] = None,
) -> tuple[State, dict]:
    """Runs the optimizer from ``state["step"]`` up to ``num_steps``.

    ``meta`` is the JSON-able run description saved with every checkpoint;
    the loop keeps ``meta["tokens_seen"]``, ``meta["train_seconds"]`` (wall
    time summed over resumed segments) and ``meta["last_loss"]`` up to date.
    ``stop_after`` ends the loop early after that many steps of this call
    (to simulate a kill in tests), saving nothing extra.

    Returns ``(state, meta)``.
    """
    meta = dict(meta or {})
    meta.setdefault("tokens_seen", 0)
    meta.setdefault("train_seconds", 0.0)
    start = int(state["step"])
    bar = tqdm(
        total=num_steps,
        initial=start,
        desc=desc,
        disable=not progress,
        dynamic_ncols=True,
        mininterval=2.0,
        file=sys.stderr,
    )
    t_seg = time.monotonic()
    secs_before = float(meta["train_seconds"])
    window, t_window, done = [], time.monotonic(), 0
    step = start
    while step < num_steps:
        batch = batch_fn(step)
        state, metrics = train_step(state, batch)
        step += 1
        done += 1
        loss = float(metrics["loss"])
        if not np.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}")
        window.append(loss)
        meta["tokens_seen"] = int(meta["tokens_seen"]) + tokens_per_step
        meta["train_seconds"] = secs_before + (time.monotonic() - t_seg)
        meta["last_loss"] = loss
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if log_every and step % log_every == 0:
            dt = time.monotonic() - t_window
            tps = tokens_per_step * len(window) / max(dt, 1e-9)
            _log(
                f"[{desc}] step {step}/{num_steps} loss {np.mean(window):.4f} "
                f"grad_norm {float(metrics['grad_norm']):.3f} tok/s {tps:.0f} "
                f"elapsed {meta['train_seconds'] / 60:.1f} min",
                log_file,
            )
            window, t_window = [], time.monotonic()
        if eval_fn is not None and eval_every and step % eval_every == 0 and step < num_steps:
            t_eval = time.monotonic()
            res = eval_fn(step, state)
            _log(f"[{desc}] eval step {step}: " + json.dumps(res), log_file)
            meta.setdefault("evals", []).append({"step": step, **res})
            t_seg += time.monotonic() - t_eval  # eval time is not training time
            meta["train_seconds"] = secs_before + (time.monotonic() - t_seg)
        if checkpointer is not None and (step == num_steps or checkpointer.due(step)):
            checkpointer.save(step, state, meta)
        if stop_after is not None and done >= stop_after:
            break
    bar.close()
    if checkpointer is not None:
        checkpointer.wait()
    return state, meta


def param_count(params: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
