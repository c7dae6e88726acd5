"""Target features for the EAGLE-style head (:mod:`training.eagle`): stages 1 and 2.

The target's outputs of the chosen blocks, per training shard (stored as bfloat16 and resumed
shard by shard) or computed online per batch, and its greedy answers to held-out chat prompts
with their features, for the evaluation.
"""

from __future__ import annotations

import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax import Model
from training import distill_data, draft


def feature_fn(target: Model, layers=(-1,)):
    """``jit(params, tokens [B, S]) -> features [B, S, n * H] bfloat16``: the
    outputs of the target blocks ``layers``, concatenated (no LM head)."""
    module = target.module
    layers = tuple(layers)

    @jax.jit
    def run(params, tokens):
        out = module.apply(params, tokens, hidden_layers=layers, logits_at=jnp.zeros((tokens.shape[0],), jnp.int32))
        return jnp.concatenate(out.hidden, axis=-1).astype(jnp.bfloat16)

    return run


def machine() -> str:
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


def extract_features(
    target: Model,
    shard_files: list,
    out_dir: pathlib.Path,
    head_ids: np.ndarray,
    *,
    seq_len: int,
    batch: int,
    layers=(-1,),
    log=print,
) -> int:
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
            chunk = tokens[s : s + batch]
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
        log(f"[features] {dest.name} ({i + 1}/{len(shard_files)}): {n} rows, {dt:.1f} s ({n * seq_len / dt:.0f} tok/s)")
    return done


def load_rows(
    shard_files: list,
    feat_dir: pathlib.Path | None,
    head_ids: np.ndarray,
    seq_len: int,
    vocab_size: int,
    width: int | None = None,
) -> dict:
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
            raise ValueError(
                f"{name} holds {z['features'].shape[-1]}-wide features, not the {width} these "
                "feature layers need; use another --out (or delete that features directory)."
            )
        rows["features"] = z["features"].view(ml_dtypes.bfloat16)
        parts.append(rows)
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def gather_heldout(
    target: Model, prompts: list[str], out_dir: pathlib.Path, *, new_tokens: int, batch: int, log=print
) -> pathlib.Path:
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
        rows = encoded[s : s + batch]
        padded = np.zeros((batch, width), np.int32)
        lengths = np.ones((batch,), np.int32)
        for j, r in enumerate(rows):
            padded[j, : len(r)] = r
            lengths[j] = len(r)
        temps = jnp.zeros((batch,), jnp.float32)
        tokens, top_i, top_lp, ans = jax.device_get(
            distill_data._answer(
                target.module,
                target.params,
                jnp.asarray(padded),
                jnp.asarray(lengths),
                (jax.random.key(0), temps, eos_ids),
                new_tokens,
                32,
            )
        )
        n = len(rows)
        keep["tokens"].append(np.concatenate([padded, tokens], axis=1)[:n])
        keep["answer_lengths"].append(ans[:n].astype(np.int32))
        keep["top_ids"].append(top_i[:n].astype(np.int32))
        keep["top_logprobs"].append(top_lp[:n].astype(np.float16))
    tmp = out_dir / ".shard_00000.tmp.npz"
    np.savez(
        tmp,
        **{k: np.concatenate(v) for k, v in keep.items()},
        prompt_lengths=np.asarray([len(p) for p in encoded], np.int32),
        temperatures=np.zeros((len(encoded),), np.float32),
        prompt_index=np.arange(len(encoded), dtype=np.int32),
    )
    os.replace(tmp, path)
    log(f"[heldout] {len(encoded)} greedy answers of up to {new_tokens} tokens in {time.monotonic() - t0:.0f} s")
    return path
