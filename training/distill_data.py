"""Distillation data: text the target writes for chat prompts, with its next-token distributions.

``gather`` renders each training prompt with the target's chat template,
lets the target answer (greedy or sampled, per sequence), and records at
every generated position the target's top-k next-token log-probabilities
(untempered). A draft trained on these rows learns both what the target
writes and how it spreads its probability: the two things acceptance depends
on. Rows are written in shards (``shard_00000.npz`` ...) so an interrupted
gather continues where it stopped.

More varied prompts: :func:`self_written_prompts` lets the target write user
turns itself (its chat template up to the user's message, sampled), and
``gather(..., first_shard=SELF_WRITTEN_SHARDS)`` answers them in shards
numbered apart from the training prompts'. A head trained on the template
prompts alone agrees with its target far less on such free-form requests.

More data from the same prompts: gather pass ``p`` gives prompt ``i`` the
temperature ``TEMPERATURE_CYCLE[(i + p) % 3]`` and writes its shards after
those of the earlier passes, with their own keys; passes 0, 1 and 2 together
answer every prompt once greedily and twice sampled. From pass 3 on, a greedy
answer would repeat an earlier pass's token for token, so those prompts are
sampled at ``NEAR_GREEDY_TEMPERATURE`` instead: text close to the greedy
path that still departs from it. Training reads every shard of the directory
(or the first ``N``).

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

from specjax import encode_chat, generate, render_chat

# Greedy rows teach the T=0 path, sampled rows the T=1 one and variety.
TEMPERATURE_CYCLE = (0.0, 0.7, 1.0)
# A greedy answer is the same in every pass; passes past the first cycle sample these rows at this instead.
NEAR_GREEDY_TEMPERATURE = 0.3


def pass_temperature(prompt_index: int, pass_index: int) -> float:
    """The temperature gather pass ``pass_index`` answers prompt ``prompt_index`` at."""
    t = TEMPERATURE_CYCLE[(prompt_index + pass_index) % len(TEMPERATURE_CYCLE)]
    return NEAR_GREEDY_TEMPERATURE if t == 0.0 and pass_index >= len(TEMPERATURE_CYCLE) else t


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


# Shards of answers to self-written prompts start here: past any pass of the training prompts.
SELF_WRITTEN_SHARDS = 100_000
_SENTINEL = "\u2063SPECJAX_USER\u2063"


def self_written_prompts(target, n: int, *, seed: int = 0, batch_size: int = 64, max_tokens: int = 64,
                         temperature: float = 1.0, min_words: int = 3, exclude: Sequence[str] = (),
                         log=print) -> list[str]:
    """``n`` distinct user requests that ``target`` writes itself: its chat template
    rendered up to the user's message, then sampled until the end of the turn.

    Requests cut off at ``max_tokens``, shorter than ``min_words`` words, repeated,
    or in ``exclude`` are dropped, and sampling goes on until ``n`` are kept (a pure
    function of ``seed``). Raises ``ValueError`` if the template has no user message
    to cut at, or if 20 batches in a row add nothing.
    """
    chat = render_chat(target, [{"role": "user", "content": _SENTINEL}])
    if _SENTINEL not in chat:
        raise ValueError("the target's chat template does not show the user's message; it cannot write prompts")
    prefix = target.tokenizer.encode(chat.split(_SENTINEL)[0]).ids
    eos = tuple(target.module.config.eos_token_ids or (target.module.config.eos_token_id,))
    kept, seen, barren, key = [], set(exclude), 0, jax.random.key(seed)
    while len(kept) < n:
        key, sub = jax.random.split(key)
        out = generate(target, [prefix] * batch_size, max_new_tokens=max_tokens, temperature=temperature,
                       eos_token_id=eos, key=sub)
        before = len(kept)
        for row, length in zip(np.asarray(out.tokens), np.asarray(out.lengths)):
            row = row[:length].tolist()
            if not row or row[-1] not in eos:  # no end of turn: cut off
                continue
            text = target.tokenizer.decode(row[:-1]).strip()
            if len(text.split()) >= min_words and text not in seen:
                seen.add(text)
                kept.append(text)
        barren = 0 if len(kept) > before else barren + 1
        if barren == 20:
            raise ValueError(f"the target wrote no new usable request in 20 batches ({len(kept)} of {n} kept)")
        log(f"[prompts] {min(len(kept), n)}/{n} self-written requests")
    return kept[:n]


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
    first_shard: int = 0,
    log=print,
) -> int:
    """Writes shards of distillation rows under ``out_dir``; returns rows written in total.

    Shard ``i`` holds prompts ``[i * batch_size, (i + 1) * batch_size)`` of
    ``prompts``: an interrupted gather resumes at the first missing shard and
    produces the same rows as an uninterrupted one (keys are per shard). Pass
    ``p`` numbers its shards from ``first_shard`` plus ``p`` times the shards of all
    ``prompts`` (see the module docstring).
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
        shard = first_shard + pass_index * per_pass + local
        path = out / f"shard_{shard:05d}.npz"
        idx = np.arange(local * batch_size, min((local + 1) * batch_size, len(prompts)))
        if path.exists():
            done = np.load(path)
            if "prompt_index" in done.files and not np.array_equal(done["prompt_index"], idx):
                raise ValueError(
                    f"{path} holds answers to prompts {done['prompt_index'].min()}-{done['prompt_index'].max()}, "
                    f"not to prompts {idx[0]}-{idx[-1]} as this gather numbers its shards: it was written with "
                    "another batch size or shard numbering. Gather with that batch size, or into another directory.")
            total += int(done["prompt_lengths"].shape[0])
            continue
        rows = [encoded[i] for i in idx]
        n = len(rows)
        # Pad the last shard to the batch so it reuses the compiled program.
        padded = np.zeros((batch_size, width), np.int32)
        lengths = np.ones((batch_size,), np.int32)
        for j, r in enumerate(rows):
            padded[j, : len(r)] = r
            lengths[j] = len(r)
        temps = np.asarray([pass_temperature(int(i), pass_index)
                            for i in np.arange(local * batch_size, (local + 1) * batch_size)], np.float32)
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
    answers = {p["top_ids"].shape[1:] for p in parts}
    if len(answers) > 1:
        raise ValueError(f"Shards in {data_dir} were gathered with different answer lengths or top-k "
                         f"({sorted(answers)}); gather them into separate directories.")
    width = max(p["tokens"].shape[1] for p in parts)
    for p in parts:  # prompt widths differ between gathers: widen the prompt part, answers stay last
        tokens, answer = p["tokens"], p["top_ids"].shape[1]
        if tokens.shape[1] != width:
            pad = np.zeros((tokens.shape[0], width - tokens.shape[1]), tokens.dtype)
            p["tokens"] = np.concatenate([tokens[:, :-answer], pad, tokens[:, -answer:]], axis=1)
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


# ----------------------------------------------------------------------------- answers, kept small
#
# Generating answers is the slow part of a gather (one target forward per token, one token
# per row at a time); the distributions are not: one teacher-forced forward scores a whole
# answer. So the answers alone (token ids, under 2 bytes a token compressed) are what is
# worth keeping, in the repository if need be, and the top-k log-probabilities are
# recomputed from them.

ANSWERS_FORMAT = 1


def pack_answers(data_dir: str | os.PathLike, dest: str | os.PathLike, *, force: bool = False) -> dict:
    """Writes every shard's prompts and answers (token ids only) to one compressed ``.npz``.

    Returns a summary (shards, rows, answer tokens). :func:`unpack_answers` rebuilds the
    shards from it. ``dest`` is never overwritten unless ``force``.
    """
    dest = pathlib.Path(dest)
    if dest.suffix != ".npz":
        raise ValueError(f"{dest}: packed answers are a .npz file; give a path ending in .npz")
    if dest.exists() and not force:
        raise FileExistsError(f"{dest} exists; pass force=True (--force) to replace it")
    files = sorted(pathlib.Path(data_dir).glob("shard_*.npz"))
    if not files:
        raise ValueError(f"No distillation shards (shard_*.npz) in {data_dir}; run the gather step first.")
    rows = {k: [] for k in ("shard", "prompt_lengths", "answer_lengths", "temperatures", "prompt_index")}
    flat, shard_meta, vocab_max = [], [], 0
    for f in files:
        z = dict(np.load(f))  # an NpzFile re-reads an array from the zip on every access
        shard_no = int(f.stem.split("_")[1])
        n, total = z["tokens"].shape
        new_tokens = z["top_ids"].shape[1]
        width = total - new_tokens
        shard_meta.append((shard_no, width, new_tokens, z["top_ids"].shape[2]))
        for i in range(n):
            p, a = int(z["prompt_lengths"][i]), int(z["answer_lengths"][i])
            flat.append(np.concatenate([z["tokens"][i, :p], z["tokens"][i, width:width + a]]))
        rows["shard"].append(np.full((n,), shard_no, np.int32))
        for k in ("prompt_lengths", "answer_lengths", "temperatures", "prompt_index"):
            rows[k].append(z[k])
        vocab_max = max(vocab_max, int(z["tokens"].max()))
    ids = np.concatenate(flat)
    ids = ids.astype(np.uint16 if vocab_max < 2**16 else np.int32)
    tmp = dest.with_name(f".{dest.stem}.tmp.npz")
    dest.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        tmp, format=np.int32(ANSWERS_FORMAT), token_ids=ids,
        shards=np.asarray(shard_meta, np.int32),  # [S, 4]: number, prompt width, new tokens, top-k
        **{k: np.concatenate(v) for k, v in rows.items()},
    )
    os.replace(tmp, dest)
    lengths = np.concatenate(rows["answer_lengths"])
    return {"shards": len(files), "rows": int(lengths.size), "answer_tokens": int(lengths.sum()),
            "bytes": dest.stat().st_size}


@functools.partial(jax.jit, static_argnums=(0, 5))
def _teacher_forced_top_k(module, params, prompts, prompt_lengths, answers, top_k: int):
    """Top-k log-probs ``[N, L, k]`` before each of ``answers [N, L]``, the way
    :func:`_answer` saw them: the right-padded ``prompts [N, P]`` prefilled, the cache cut
    back to ``prompt_lengths``, then the answers fed in one block. The LM head runs on
    the ``L`` answer positions only, not on the prompts' padding."""
    n, width = prompts.shape
    cache = module.init_cache(n, width + answers.shape[1])
    first = module.apply(params, prompts, cache, logits_at=prompt_lengths - 1)
    rest = module.apply(params, answers[:, :-1], first.cache.rollback(prompt_lengths))
    logits = jnp.concatenate([first.logits, rest.logits], axis=1)
    top_lp, top_i = jax.lax.top_k(jax.nn.log_softmax(logits), top_k)
    return top_i, top_lp


def unpack_answers(target, packed: str | os.PathLike, out_dir: str | os.PathLike, *, batch_size: int = 16,
                   log=print) -> int:
    """Rebuilds the shards of :func:`pack_answers`'s file under ``out_dir``, the target's
    top-k log-probs recomputed by teacher forcing (equal to the gathered ones up to float
    rounding). Resumable like :func:`gather`: shards that exist are kept. Returns shards written.

    ``target`` must be the model that wrote the answers: nothing in the file can check that,
    beyond its vocabulary size.
    """
    z = dict(np.load(packed))  # read once: an NpzFile decompresses an array on every access
    if int(z["format"]) != ANSWERS_FORMAT:
        raise ValueError(f"{packed}: packed answers format {int(z['format'])}, this code reads {ANSWERS_FORMAT}")
    ids = z["token_ids"].astype(np.int32)
    if ids.size and int(ids.max()) >= target.vocab_size:
        raise ValueError(f"{packed} holds token id {int(ids.max())}, beyond the target's vocabulary "
                         f"({target.vocab_size}): these answers are another model's")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    eos = target.module.config.eos_token_ids or (target.module.config.eos_token_id,)
    offsets = np.concatenate([[0], np.cumsum(z["prompt_lengths"] + z["answer_lengths"])])
    written = 0
    for shard_no, width, new_tokens, top_k in z["shards"].tolist():
        path = out / f"shard_{shard_no:05d}.npz"
        if path.exists():
            continue
        t0 = time.monotonic()
        idx = np.nonzero(z["shard"] == shard_no)[0]
        n = idx.size
        tokens = np.zeros((n, width + new_tokens), np.int32)
        tokens[:, width:] = eos[0]  # what the gather feeds after EOS
        lengths = z["prompt_lengths"][idx].astype(np.int32)
        for j, i in enumerate(idx):
            p, a = int(z["prompt_lengths"][i]), int(z["answer_lengths"][i])
            row = ids[offsets[i]:offsets[i + 1]]
            tokens[j, :p], tokens[j, width:width + a] = row[:p], row[p:]
        top_i = np.zeros((n, new_tokens, top_k), np.int32)
        top_lp = np.zeros((n, new_tokens, top_k), np.float16)
        for s in range(0, n, batch_size):
            chunk, lens = tokens[s:s + batch_size], lengths[s:s + batch_size]
            pad = batch_size - chunk.shape[0]  # the last chunk reuses the compiled program
            if pad:
                chunk = np.concatenate([chunk, np.zeros((pad, chunk.shape[1]), np.int32)])
                lens = np.concatenate([lens, np.ones((pad,), np.int32)])
            i_, lp_ = jax.device_get(_teacher_forced_top_k(
                target.module, target.params, jnp.asarray(chunk[:, :width]), jnp.asarray(lens),
                jnp.asarray(chunk[:, width:]), top_k))
            m = batch_size - pad
            top_i[s:s + m], top_lp[s:s + m] = i_[:m], lp_[:m].astype(np.float16)
        tmp = out / f".shard_{shard_no:05d}.tmp.npz"
        np.savez(tmp, tokens=tokens, prompt_lengths=z["prompt_lengths"][idx],
                 answer_lengths=z["answer_lengths"][idx], top_ids=top_i, top_logprobs=top_lp,
                 temperatures=z["temperatures"][idx], prompt_index=z["prompt_index"][idx])
        os.replace(tmp, path)
        written += 1
        log(f"[unpack] shard {shard_no}: {n} answers, {int(z['answer_lengths'][idx].sum())} tokens, "
            f"{time.monotonic() - t0:.1f} s")
    return written
