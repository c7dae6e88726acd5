"""Distillation data: text the target writes for chat prompts, with its next-token distributions.

``gather`` renders each training prompt with the target's chat template,
lets the target answer (greedy or sampled, per sequence), and records at
every generated position the target's top-k next-token log-probabilities
(untempered). A draft trained on these rows learns both what the target
writes and how it spreads its probability: the two things acceptance depends
on. Rows are written in shards (``shard_00000.npz`` ...) so an interrupted
gather continues where it stopped.

More data from the same prompts: gather pass ``p`` gives prompt ``i`` the
temperature ``TEMPERATURE_CYCLE[(i + p) % 3]`` and writes its shards after
those of the earlier passes, with their own keys; passes 0, 1 and 2 together
answer every prompt once greedily and twice sampled. Training reads every
shard of the directory (or the first ``N``).

Shard contents (``N`` sequences, prompt width ``P``, ``L`` new tokens, top-``k``):
  ``tokens [N, P + L] int32``: the prompt right-padded to ``P``, then the answer.
  ``prompt_lengths [N]``, ``answer_lengths [N]`` (EOS included when reached).
  ``top_ids [N, L, k] int32``, ``top_logprobs [N, L, k] float16``: the target's
  distribution *before* answer token ``t`` (so it predicts ``tokens[P + t]``).
  ``temperatures [N] float32``, ``prompt_index [N]`` (into the prompt list).
"""

from __future__ import annotations

import functools
import os
import pathlib
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.chat import encode_chat

# Greedy rows teach the T=0 path, sampled rows the T=1 one and variety.
TEMPERATURE_CYCLE = (0.0, 0.7, 1.0)


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _answer(module, params, prompts, prompt_lengths, key_temps, new_tokens: int, top_k: int):
    """Greedy/sampled answers with top-k log-probs, one jitted scan.

    ``key_temps = (key, temperatures [N], eos_ids [E])``.
    """
    key, temperatures, eos_ids = key_temps
    n, width = prompts.shape
    cache = module.init_cache(n, width + new_tokens)
    out = module.apply(params, prompts, cache, logits_at=prompt_lengths - 1)
    cache = out.cache.rollback(prompt_lengths)

    def step(carry, step_key):
        cache, logits, done = carry
        logp = jax.nn.log_softmax(logits)
        top_lp, top_i = jax.lax.top_k(logp, top_k)
        safe_t = jnp.where(temperatures > 0, temperatures, 1.0)
        sampled = jax.random.categorical(step_key, logits / safe_t[:, None], axis=-1)
        token = jnp.where(temperatures > 0, sampled, jnp.argmax(logits, -1)).astype(jnp.int32)
        token = jnp.where(done, eos_ids[0], token)
        nxt = module.apply(params, token[:, None], cache)
        is_eos = jnp.any(token[:, None] == eos_ids[None, :], axis=-1)
        return (nxt.cache, nxt.logits[:, 0], done | is_eos), (token, top_i, top_lp, done)

    keys = jax.random.split(key, new_tokens)
    init = (cache, out.logits[:, 0], jnp.zeros((n,), bool))
    _, (tokens, top_i, top_lp, was_done) = jax.lax.scan(step, init, keys)
    lengths = jnp.sum(~was_done, axis=0)
    return tokens.T, jnp.swapaxes(top_i, 0, 1), jnp.swapaxes(top_lp, 0, 1), lengths


def encode_prompts(target, prompts: Sequence[str]) -> list[list[int]]:
    return [encode_chat(target, p) for p in prompts]


def gather(
    target,
    prompts: Sequence[str],
    out_dir: str | os.PathLike,
    *,
    batch_size: int = 32,
    new_tokens: int = 256,
    top_k: int = 32,
    seed: int = 0,
    max_prompts: int | None = None,
    pass_index: int = 0,
    log=print,
) -> int:
    """Writes shards of distillation rows under ``out_dir``; returns rows written in total.

    Shard ``i`` holds prompts ``[i * batch_size, (i + 1) * batch_size)`` of
    ``prompts``: an interrupted gather resumes at the first missing shard and
    produces the same rows as an uninterrupted one (keys are per shard). Pass
    ``p`` numbers its shards from ``p`` times the shards of all ``prompts``
    (see the module docstring).
    """
    if pass_index < 0:
        raise ValueError(f"pass_index must be >= 0, got {pass_index}")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = list(prompts)
    per_pass = -(-len(prompts) // batch_size)  # of the whole list: --prompts limits never shift a pass
    prompts = prompts[: max_prompts or None]
    encoded = encode_prompts(target, prompts)
    width = -(-max(len(p) for p in encoded) // 8) * 8
    eos = target.module.config.eos_token_ids or (target.module.config.eos_token_id,)
    eos_ids = jnp.asarray(eos, jnp.int32)
    num_shards = -(-len(prompts) // batch_size)
    total = 0
    for local in range(num_shards):
        shard = pass_index * per_pass + local
        path = out / f"shard_{shard:05d}.npz"
        if path.exists():
            total += int(np.load(path)["prompt_lengths"].shape[0])
            continue
        idx = np.arange(local * batch_size, min((local + 1) * batch_size, len(prompts)))
        rows = [encoded[i] for i in idx]
        n = len(rows)
        # Pad the last shard to the batch so it reuses the compiled program.
        padded = np.zeros((batch_size, width), np.int32)
        lengths = np.ones((batch_size,), np.int32)
        for j, r in enumerate(rows):
            padded[j, : len(r)] = r
            lengths[j] = len(r)
        temps = np.asarray([TEMPERATURE_CYCLE[(i + pass_index) % len(TEMPERATURE_CYCLE)] for i in
                            np.arange(local * batch_size, (local + 1) * batch_size)], np.float32)
        key = jax.random.fold_in(jax.random.key(seed), shard)
        t0 = time.monotonic()
        tokens, top_i, top_lp, ans_len = jax.device_get(
            _answer(target.module, target.params, jnp.asarray(padded), jnp.asarray(lengths),
                    (key, jnp.asarray(temps), eos_ids), new_tokens, top_k)
        )
        dt = time.monotonic() - t0
        tmp = out / f".shard_{shard:05d}.tmp.npz"
        np.savez(
            tmp,
            tokens=np.concatenate([padded, tokens], axis=1)[:n],
            prompt_lengths=lengths[:n],
            answer_lengths=ans_len[:n].astype(np.int32),
            top_ids=top_i[:n].astype(np.int32),
            top_logprobs=top_lp[:n].astype(np.float16),
            temperatures=temps[:n],
            prompt_index=idx.astype(np.int32),
        )
        os.replace(tmp, path)  # a shard exists only once it is complete
        written = int(ans_len[:n].sum())
        total += n
        log(f"[gather] pass {pass_index}, shard {local + 1}/{num_shards}: {n} answers, {written} tokens, "
            f"{dt:.1f} s ({written / dt:.0f} answer tok/s)")
    return total


def load_shards(data_dir: str | os.PathLike, limit: int | None = None) -> dict[str, np.ndarray]:
    """The first ``limit`` (default: all) complete shards of ``data_dir``, concatenated."""
    files = sorted(pathlib.Path(data_dir).glob("shard_*.npz"))[: limit or None]
    if not files:
        raise ValueError(f"No distillation shards (shard_*.npz) in {data_dir}; run the gather step first.")
    parts = [dict(np.load(f)) for f in files]
    width = max(p["tokens"].shape[1] for p in parts)
    for p in parts:  # prompt widths may differ between gathers: pad answers' left side
        if p["tokens"].shape[1] != width:
            raise ValueError(f"Shards in {data_dir} have different widths; gather them into separate dirs.")
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
