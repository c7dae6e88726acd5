"""Reusable training pieces: AdamW schedule, jitted train step, resumable loop.

Shared by :mod:`training.lm` (the shipped pair) and the PAD head trainer.

* :func:`adamw` -- AdamW with linear warmup and cosine decay, global-norm
  clipping, and no weight decay on vectors (norm scales, biases).
* :func:`make_train_step` -- ``jit(state, batch) -> (state, metrics)`` from a
  ``loss_fn(params, batch) -> (loss, aux)``; the state is a plain dict
  ``{"step", "params", "opt_state"}`` (a pytree Orbax saves as is).
* :class:`Checkpointer` -- an Orbax ``CheckpointManager`` that saves the state
  plus a JSON ``meta`` dict (data seed, config, tokens seen, wall time ...)
  every ``every_seconds`` (and/or ``every_steps``) with a CRC32 per state leaf,
  keeps the last few, and restores the latest intact one (a damaged step is
  reported in one line and set aside; the previous one is used). A step
  written with other settings or shapes is not damage: :class:`CheckpointMismatch`
  names the differences and nothing is moved.
* :func:`train_loop` -- runs steps ``state["step"] .. num_steps`` with a tqdm
  bar showing the loss, periodic log lines, optional periodic evaluation and
  checkpointing. Batches come from ``batch_fn(step)``, which must be a pure
  function of the step (see :func:`training.data.make_batch`): then a run
  killed at any point resumes from its last checkpoint and reproduces the
  uninterrupted run exactly.
* :func:`check_export` / :func:`swap_in` -- an export directory checked before
  any slow work, written whole into a temporary sibling and swapped in,
  keeping the files of the replaced one that the export does not write.
* :func:`check_outside_package`, :func:`check_resumable` and
  :func:`exit_on_interrupt` -- the trainers' command-line manners: no run
  directory inside the installed package, no silent restart at step 0 after
  every checkpoint was damaged (``--fresh`` starts over), and a short message
  instead of a traceback on Ctrl-C.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import json
import os
import pathlib
import re
import shutil
import sys
import time
import uuid
import zlib
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


CHECKSUM_KEY = "_specjax_checksums"  # inside the saved meta JSON; hidden from callers


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def state_checksums(state: Any) -> dict:
    """``{leaf path: [shape, dtype, CRC32 of its bytes]}`` of a pytree.

    Orbax / TensorStore read a flipped byte in an uncompressed chunk back
    without complaint; :meth:`Checkpointer.restore` compares these.
    """
    out = {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        key = "/".join(_key_name(k) for k in kp)
        if not getattr(leaf, "is_fully_addressable", True):
            continue  # multi-host: this host holds only its slices
        arr = np.ascontiguousarray(np.asarray(leaf))
        out[key] = [list(arr.shape), arr.dtype.name, zlib.crc32(arr.view(np.uint8).reshape(-1))]
    return out


def _meta_checksum(meta: Mapping[str, Any]) -> int:
    return zlib.crc32(json.dumps(meta, sort_keys=True).encode())


_TENSORSTORE_CAUSES = (
    (("OUT_OF_RANGE", "byte range", "Truncated"), "a truncated data file"),
    (("DATA_LOSS", "checksum"), "a corrupted data file (its checksum fails)"),
    (("NOT_FOUND",), "a missing data file"),
)


def _describe(e: BaseException, root: pathlib.Path) -> str:
    """One short line for an Orbax / TensorStore / JSON error: the cause and
    the file, without TensorStore's multi-kilobyte specs."""
    text = str(e).split("See full TensorStore")[0].split(" [tensorstore_spec")[0].strip()
    files = re.findall(r'local file "([^"]+)"', text)
    if files:
        file = files[-1]
        try:
            file = str(pathlib.Path(file).relative_to(root))
        except ValueError:
            pass
        for needles, cause in _TENSORSTORE_CAUSES:
            if any(n in text for n in needles):
                return f"{cause}: {file}"
        return f"an unreadable data file: {file}"
    line = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {line[:200]}"


class CheckpointDamaged(ValueError):
    """A saved step that cannot be restored as it was written."""


class CheckpointMismatch(ValueError):
    """A saved step written by a run with other settings or shapes.

    Not damage: the step is intact and left where it is; the run that wrote
    it can resume it. ``differences`` holds one line per differing setting
    (``"config.hidden_size: 64 in the checkpoint, 48 now"``) or state leaf.
    """

    def __init__(self, directory: pathlib.Path, step: int, differences: list[str],
                 advice: Optional[str] = None):
        self.directory, self.step, self.differences = directory, step, differences
        shown = "; ".join(differences[:6]) + (f"; and {len(differences) - 6} more" if len(differences) > 6 else "")
        advice = advice or ("rerun with the settings it was made with to resume it, "
                            "or use another checkpoint directory")
        super().__init__(f"the checkpoint in {directory} (step {step}) was made with different settings: "
                         f"{shown}. Nothing was moved or deleted; {advice}.")


def setting_differences(saved: Any, now: Any, path: str = "") -> list[str]:
    """``"path: saved in the checkpoint, now now"`` per differing JSON value.

    Dicts are compared key by key; a key only one side records (a checkpoint
    of an older version, a setting added since) is not a difference.
    """
    if isinstance(saved, Mapping) and isinstance(now, Mapping):
        return [d for k in sorted(set(saved) & set(now), key=str)
                for d in setting_differences(saved[k], now[k], f"{path}.{k}" if path else str(k))]
    if saved == now:
        return []
    return [f"{path or 'value'}: {json.dumps(saved)} in the checkpoint, {json.dumps(now)} now"]


def _leaf_specs(tree: Any) -> dict:
    """``{leaf path: (shape, dtype name)}``, paths as :func:`state_checksums` writes them."""
    return {"/".join(_key_name(k) for k in kp): (tuple(leaf.shape), np.dtype(leaf.dtype).name)
            for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def tree_differences(saved: Mapping[str, tuple], now: Mapping[str, tuple]) -> list[str]:
    """One line per leaf missing on one side or with another shape or dtype."""
    out = []
    for key in sorted(set(saved) | set(now), key=lambda k: (not k.startswith("params"), k)):  # the weights first
        if key not in now:
            out.append(f"{key}: in the checkpoint, not in this run")
        elif key not in saved:
            out.append(f"{key}: not in the checkpoint")
        elif saved[key] != now[key]:
            (s_shape, s_dtype), (n_shape, n_dtype) = saved[key], now[key]
            out.append(f"{key}: {s_dtype}{list(s_shape)} in the checkpoint, {n_dtype}{list(n_shape)} now")
    return out


class Checkpointer:
    """Periodic, resumable Orbax checkpoints of ``(state, meta)``, with checksums.

    Every save records a CRC32 per state leaf and one of the meta in the meta
    JSON (under ``CHECKSUM_KEY``, removed again on restore). :meth:`restore`
    verifies them: a damaged step (truncated, flipped or missing file, garbage
    or edited metadata, a missing item) is reported in one line, moved aside to
    ``<directory>.damaged/<step>`` (kept, not deleted) and the previous step is
    tried instead. A step whose meta differs from the ``settings`` passed to
    :meth:`restore`, or whose state has other leaves, shapes or dtypes than the
    new run's, is intact but not this run's: :class:`CheckpointMismatch` is
    raised and nothing is moved.

    Args:
      directory: checkpoint root (one sub-directory per saved step).
      every_seconds: save when this much wall time passed since the last save.
      every_steps: also save every this many steps (``None``: time only).
      max_to_keep: how many recent checkpoints to keep (at least 2, so that a
        damaged latest step has a previous one to fall back to).
      log: where the one-line damage reports go (default: stdout).
    """

    def __init__(
        self,
        directory: str | pathlib.Path,
        *,
        every_seconds: float = 180.0,
        every_steps: Optional[int] = None,
        max_to_keep: int = 2,
        log: Optional[Callable[[str], Any]] = None,
    ):
        self.directory = pathlib.Path(directory).absolute()
        self.every_seconds = every_seconds
        self.every_steps = every_steps
        self._log = log if log is not None else _log
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max(max_to_keep, 2), create=True),
        )
        self._last_save = time.monotonic()

    @property
    def damaged_directory(self) -> pathlib.Path:
        return _damaged_directory(self.directory)

    def latest_step(self) -> Optional[int]:
        return self._manager.latest_step()

    def restore(self, like: State, step: Optional[int] = None, *,
                settings: Optional[Mapping[str, Any]] = None,
                advice: Optional[str] = None,
                start_over: str = "use another checkpoint directory") -> Optional[tuple[State, dict]]:
        """The latest intact (or the given) checkpoint, shaped like ``like``;
        ``None`` if there is none (a new run).

        ``settings``: meta entries the checkpoint must hold as they are now
        (what defines the model and the run); ``advice`` ends the
        :class:`CheckpointMismatch` message (which flags to rerun with);
        ``start_over`` says how to start at step 0 when no step is intact.

        Raises:
          CheckpointMismatch: the latest intact step was written with other
            settings or shapes (names each difference; nothing is moved).
          ValueError: ``step`` is damaged, or every saved step is (names each
            step and what is wrong with it), now or when an earlier attempt
            set them aside: a rerun does not silently start at step 0.
        """
        if step is not None:
            try:
                return self._restore_step(step, like, settings, advice)
            except CheckpointDamaged as e:
                raise ValueError(f"checkpoint step {step} in {self.directory} is damaged: {e}") from e
        if not self._manager.all_steps():
            problem = damage_only(self.directory)
            if problem:
                raise ValueError(f"{problem} To start over at step 0, {start_over}.")
            return None
        problems = []
        for s in sorted(self._manager.all_steps(), reverse=True):
            try:
                out = self._restore_step(s, like, settings, advice)
            except CheckpointDamaged as e:
                problems.append(f"step {s}: {e}")
                self._log(f"[checkpoint] step {s} in {self.directory} is damaged ({e}); "
                          f"moved to {self._set_aside(s)}, trying the previous step")
                continue
            return out
        raise ValueError(
            f"no intact checkpoint in {self.directory} ({'; '.join(problems)}); the damaged "
            f"steps are in {self.damaged_directory}. To start over at step 0, {start_over}."
        )

    def _restore_step(self, step: int, like: State, settings: Optional[Mapping[str, Any]] = None,
                      advice: Optional[str] = None) -> tuple[State, dict]:
        step_dir = self.directory / str(step)
        for item in ("state", "meta"):
            if not (step_dir / item).is_dir():
                raise CheckpointDamaged(f"its {item!r} item is missing")
        parsed = {}
        for file in (step_dir / "meta" / "metadata", step_dir / "state" / "_METADATA"):
            try:
                parsed[file.parent.name] = json.loads(file.read_text())
            except (OSError, ValueError) as e:
                raise CheckpointDamaged(
                    f"{file.relative_to(self.directory)} is missing or not valid JSON ({e})"
                ) from e
        # The meta is read (and verified) first: it tells a run with other
        # settings from damage before Orbax fails on their other shapes.
        meta = parsed["meta"]
        if not isinstance(meta, Mapping):
            raise CheckpointDamaged(f"its meta is a {type(meta).__name__}, not a JSON object")
        meta = dict(meta)
        sums = meta.pop(CHECKSUM_KEY, None)
        if sums is not None and (not isinstance(sums, Mapping) or sums.get("meta") != _meta_checksum(meta)):
            raise CheckpointDamaged("its meta does not match its checksum")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        differences = setting_differences(meta, json.loads(json.dumps(dict(settings or {}))))
        saved = self._saved_leaves(step_dir)
        if not differences and saved is not None:
            differences = tree_differences(saved, _leaf_specs(abstract))
        if differences:
            raise CheckpointMismatch(self.directory, step, differences, advice)
        try:
            out = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
            )
            state = jax.block_until_ready(out["state"])  # read everything now
        except Exception as e:  # orbax / tensorstore raise many types for damaged files
            raise CheckpointDamaged(_describe(e, self.directory)) from e
        if sums is None:
            self._log(f"[checkpoint] step {step} in {self.directory} has no checksums "
                      "(written by an older version); restored unverified")
            return state, meta
        want, got = sums.get("state") or {}, state_checksums(state)
        bad = sorted(k for k in set(want) | set(got) if k in got and want.get(k) != got[k])
        if bad:
            raise CheckpointDamaged(
                f"state leaf/leaves {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} "
                "do not match their checksums"
            )
        return state, meta

    @staticmethod
    def _saved_leaves(step_dir: pathlib.Path) -> Optional[dict]:
        """``{leaf path: (shape, dtype)}`` of a step's saved state, from Orbax's
        metadata; ``None`` if unreadable (the restore then reports the damage)."""
        handler = ocp.StandardCheckpointHandler()
        try:
            tree = handler.metadata(step_dir / "state")
            return _leaf_specs(getattr(tree, "tree", tree))
        except Exception:  # noqa: BLE001 -- any failure here is the restore's to describe
            return None
        finally:
            handler.close()

    def _set_aside(self, step: int) -> pathlib.Path:
        """Moves a damaged step out of the manager's way (a later save of the
        same step number must not collide with it); nothing is deleted."""
        dest = self.damaged_directory / str(step)
        n = 1
        while dest.exists():
            dest, n = self.damaged_directory / f"{step}.{n}", n + 1
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(self.directory / str(step)), str(dest))
        self._manager.reload()
        return dest

    def due(self, step: int) -> bool:
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return time.monotonic() - self._last_save >= self.every_seconds

    def save(self, step: int, state: State, meta: Mapping[str, Any]) -> None:
        if self._manager.latest_step() == step:
            return
        meta = dict(meta)
        meta.pop(CHECKSUM_KEY, None)
        meta = json.loads(json.dumps(meta))  # as it will read back
        sums = {"state": state_checksums(state), "meta": _meta_checksum(meta)}
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave({**meta, CHECKSUM_KEY: sums}),
            ),
            force=True,
        )
        self._last_save = time.monotonic()

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _damaged_directory(directory: pathlib.Path) -> pathlib.Path:
    return directory.with_name(directory.name + ".damaged")


def damage_only(directory: str | pathlib.Path) -> Optional[str]:
    """Why ``directory`` cannot be resumed although a run used it: it holds no
    step and every step it held was damaged and set aside
    (:meth:`Checkpointer.restore`); ``None`` if that is not so."""
    directory = pathlib.Path(directory).absolute()
    damaged = _damaged_directory(directory)
    steps = [p for p in directory.iterdir() if p.name.isdigit()] if directory.is_dir() else []
    if steps or not damaged.is_dir() or not any(damaged.iterdir()):
        return None
    return (f"no intact checkpoint in {directory}: every step saved there was damaged and set aside in "
            f"{damaged} ({', '.join(sorted(p.name for p in damaged.iterdir()))}).")


def discard_checkpoints(directory: str | pathlib.Path) -> None:
    """Deletes a checkpoint directory and the damaged steps set aside beside it
    (what ``--fresh`` asks for)."""
    directory = pathlib.Path(directory).absolute()
    for path in (directory, _damaged_directory(directory)):
        if path.exists():
            shutil.rmtree(path)


def check_resumable(directory: str | pathlib.Path, *, fresh: bool, flag: str = "--fresh") -> None:
    """Exits, before any slow work, where ``directory`` holds only damaged steps
    (rerunning would otherwise train from step 0 without a word); with
    ``fresh``, discards its checkpoints so that training starts at step 0."""
    if fresh:
        discard_checkpoints(directory)
        return
    problem = damage_only(directory)
    if problem:
        raise SystemExit(f"error: {problem} Pass {flag} to discard them and train from step 0 (data and "
                         "features already made are kept).")


def package_directory() -> pathlib.Path:
    """Where the ``specjax`` package is installed (its shipped models included)."""
    import specjax

    return pathlib.Path(specjax.__file__).resolve().parent


def check_outside_package(path: str | pathlib.Path, flag: str) -> None:
    """Exits if ``path`` lies inside the installed ``specjax`` package: a
    trainer's run directory (checkpoints, data, logs) there would land among
    the shipped models. An export into a shipped directory is its own option."""
    package = package_directory()
    resolved = pathlib.Path(path).resolve()
    if resolved == package or package in resolved.parents:
        raise SystemExit(f"error: {flag} {path} is inside the installed package ({package}); a run writes "
                         "checkpoints, data and logs there. Choose a directory outside it, e.g. runs/NAME.")


def exit_on_interrupt(command: str):
    """Wraps a trainer's ``main`` for the command line: Ctrl-C (SIGINT) ends it
    with a short message saying how to resume, and exit status 130, instead
    of a traceback. (``main`` itself lets ``KeyboardInterrupt`` through to a
    Python caller.)"""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except KeyboardInterrupt:
                print(f"\n{command}: interrupted. Finished stages and the last checkpoint are kept: run the "
                      "same command again to resume (--fresh starts training over).", file=sys.stderr)
                return 130

        return run

    return wrap


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
    deadline: Optional[float] = None,
) -> tuple[State, dict]:
    """Runs the optimizer from ``state["step"]`` up to ``num_steps``.

    ``meta`` is the JSON-able run description saved with every checkpoint;
    the loop keeps ``meta["tokens_seen"]``, ``meta["train_seconds"]`` (wall
    time summed over resumed segments) and ``meta["last_loss"]`` up to date.
    ``stop_after`` ends the loop early after that many steps of this call
    (to simulate a kill in tests), saving nothing extra. ``deadline`` (a
    ``time.monotonic()`` value) ends it before ``num_steps`` once that time has
    come, checkpointing the step reached and recording it as
    ``meta["stopped_at_deadline"]``, so that a run on a machine lent for a fixed
    time still evaluates and exports what it trained.

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
        if deadline is not None and time.monotonic() >= deadline:
            meta["stopped_at_deadline"] = step
            _log(f"[{desc}] time limit reached: stopped at step {step} of {num_steps}", log_file)
            if checkpointer is not None and step > start:
                checkpointer.save(step, state, meta)
            break
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


# ----------------------------------------------------------------------------- exports


# Weights of a replaced model: never carried into a new export, where they would
# sit beside (or be read instead of) the new weights.
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.gguf", "*.bin")


def run_id(out: pathlib.Path) -> str:
    """The id of the run in ``out`` (made on its first start, kept in ``run.json``);
    its export records it, so a rerun can tell its own export from another's."""
    meta_file = pathlib.Path(out) / "run.json"
    run = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    if "run_id" not in run:
        run["run_id"] = uuid.uuid4().hex
        meta_file.write_text(json.dumps(run))
    return run["run_id"]


def _old(dest: pathlib.Path) -> pathlib.Path:
    return dest.with_name(dest.name + ".old-export")


def _without_time_limit(command: str) -> list[str]:
    # --time-limit only decides when a call stops, not what the run trains; a recipe passes the
    # minutes it has left, so the same command resumed differs there on every call.
    words, out = command.split(), []
    skip = False
    for w in words:
        if skip:
            skip = False
        elif w == "--time-limit":
            skip = True
        elif not w.startswith("--time-limit="):
            out.append(w)
    return out


def own_export(dest: pathlib.Path, run_id: str, command: str) -> bool:
    """Whether ``dest`` is a complete export of run ``run_id`` by this very ``command``
    (its ``train_log.json``, written before the swap, records both), ``--time-limit`` aside."""
    try:
        summary = json.loads((dest / "train_log.json").read_text())["summary"]
        return summary["run_id"] == run_id and _without_time_limit(summary["command"]) == _without_time_limit(command)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def check_export(dest: pathlib.Path, *, force: bool, run_id: str, command: str) -> bool:
    """Exits unless an export may replace ``dest`` (call it before any slow work);
    True when ``dest`` holds this run's own export of this command."""
    if not dest.exists() and _old(dest).is_dir():  # killed between the two renames of swap_in
        os.replace(_old(dest), dest)
    if dest.exists() and not dest.is_dir():
        raise SystemExit(f"error: --export {dest} is a file, not a directory; choose another path.")
    if not dest.is_dir() or not any(dest.iterdir()):
        return False
    if own_export(dest, run_id, command):
        # Swapped in whole, so complete; the same run's data and final checkpoint
        # rebuild it, and files beside it are carried over again: replacing it
        # loses nothing, so the documented way to continue (the same command)
        # needs no --force. Another run's export, or this run's by another
        # command (e.g. fewer --steps), could not be rebuilt: --force.
        return True
    if not force:
        raise SystemExit(f"error: {dest} exists and is not empty; pass --force to replace it.")
    return False


def carry_over(old: pathlib.Path, new: pathlib.Path, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Copies into ``new`` each entry of ``old`` that ``new`` lacks and no ``skip``
    pattern matches: what the new export does not write itself (hand-written
    notes, earlier sessions' logs) outlives a forced replacement. Copied, not
    moved, so ``old`` stays whole until the swap. The names copied."""
    if not old.is_dir():
        return []
    kept = []
    for entry in sorted(old.iterdir()):
        if (new / entry.name).exists() or any(fnmatch.fnmatch(entry.name, p) for p in skip):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True)
        else:
            shutil.copy2(entry, new / entry.name, follow_symlinks=False)
        kept.append(entry.name)
    return kept


def swap_in(tmp: pathlib.Path, dest: pathlib.Path) -> list[str]:
    """Replaces ``dest`` by the complete export in ``tmp`` (card and logs
    included), after carrying over what only ``dest`` has (not its weights), by
    two renames: an interruption leaves the old directory or the new one
    (``check_export`` puts back one caught between the renames). The names kept."""
    kept = carry_over(dest, tmp, skip=WEIGHT_FILES)
    if dest.exists():
        shutil.rmtree(_old(dest), ignore_errors=True)
        os.replace(dest, _old(dest))
        os.replace(tmp, dest)
        shutil.rmtree(_old(dest))
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)
    return kept


def number_arg(kind, what: str, low=None, high=None, *, open_low: bool = False, open_high: bool = False):
    """An argparse type: a finite ``kind`` (int or float) within ``low .. high`` (bounds
    excluded where open), else an error naming ``what``: a nan learning rate, a negative
    weight or zero steps would otherwise train (or gather for minutes) before failing or
    silently misleading."""
    def parse(text: str):
        try:
            x = kind(text)
        except ValueError:
            x = None
        ok = x is not None and np.isfinite(x) and (
            low is None or (x > low if open_low else x >= low)) and (high is None or (x < high if open_high else x <= high))
        if not ok:
            lo = "" if low is None else f"{'>' if open_low else '>='} {low}"
            hi = "" if high is None else f"{'<' if open_high else '<='} {high}"
            raise argparse.ArgumentTypeError(f"expected {what}, {' and '.join(b for b in (lo, hi) if b)}; got {text!r}")
        return x
    return parse
