"""Device-side pieces the cycles and the loop are built from (the chain and
tree cycles, ``generate``'s target-only cycle, the prefills): the blocked
prefill, per-sequence gathers and selects, the logit warp, the per-sequence
keys, EOS tests, the output slice and the mesh pins. Each is a pure function
of arrays, traced inside the jitted loops of :mod:`specjax._src.engine.loop`
and the slots engine. They live apart from the cycles because every cycle,
and the state's construction (:mod:`specjax._src.engine.state`), uses them.
Those that other modules import have plain names; ``_``-prefixed ones are this
module's own.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from specjax._src.logits import sampling
from specjax._src.engine.config import LoopConfig
from specjax._src.models.lm import KVCache

Array = jax.Array


def gather(tokens: Array, index: Array) -> Array:
    """``tokens[b, index[b]]``."""
    return jnp.take_along_axis(tokens, index[:, None].astype(jnp.int32), axis=1)[:, 0]


def row_at(x: Array, index: Array) -> Array:
    """``x[b, index[b]]`` for ``x[B, T, ...]``."""
    idx = index.astype(jnp.int32).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


def switch_in_place(index: Array, branches: Sequence[Callable[[Any], Any]], carry):
    """``lax.switch(index, branches, carry)`` for branches that return a value
    of ``carry``'s structure, run as while loops of zero or one trip.

    Why not a conditional: XLA copies every buffer that a conditional's branch
    updates in place (the same operand reaches each branch), so a switch
    around a forward that writes the KV cache copied the whole cache on every
    cycle (a fifth of a target forward for SmolLM2-135M at batch 4 on a
    2-core CPU, per switch). A while loop's carried buffers are updated in place.
    ``index`` is a traced int32 scalar in ``0 .. len(branches) - 1``.
    """
    index = jnp.asarray(index, jnp.int32)
    for i, branch in enumerate(branches):
        _, carry = jax.lax.while_loop(lambda c, i=i: c[0] == i,
                                      lambda c, branch=branch: (jnp.int32(-1), branch(c[1])), (index, carry))
    return carry


def narrowest_width(widths: Sequence[int], need: Array) -> Array:
    """The index in ``widths`` (ascending) of the narrowest that holds ``need`` (a traced
    int32 scalar) positions, or of the widest where none does."""
    return jnp.minimum(jnp.searchsorted(jnp.asarray(widths), need), len(widths) - 1)


def cond_in_place(pred: Array, true_fn: Callable[[Any], Any], false_fn: Callable[[Any], Any], carry):
    """``lax.cond(pred, true_fn, false_fn, carry)`` without a copy of the
    buffers the branches write (:func:`switch_in_place`)."""
    return switch_in_place(jnp.where(pred, 0, 1), (true_fn, false_fn), carry)


def where_b(mask: Array, new, old):
    """Per-sequence select over two pytrees with leading batch axes."""

    def sel(n, o):
        m = mask.reshape(mask.shape + (1,) * (n.ndim - mask.ndim))
        return jnp.where(m, n, o)

    return jax.tree_util.tree_map(sel, new, old)


def batched_init(init_fn: Callable[[], Any], batch: int):
    return jax.tree_util.tree_map(
        lambda x: jnp.broadcast_to(jnp.asarray(x), (batch,) + jnp.shape(x)), init_fn()
    )


def per_sequence_keys(key: Array, batch: int) -> Array:
    if key.ndim == 0:
        return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch, dtype=jnp.uint32))
    return key


def warp(cfg: LoopConfig, raw: Array, temperature, top_p, rows=None) -> Array:
    """The sampling warp of raw logits ``[B, ..., V]``. With per-row settings
    (``rows``, a :class:`specjax._src.logits.processors.RowSettings`), ``temperature``
    and ``top_p`` are ``[B]`` arrays, a ``top_p`` of 1 keeps every token, and a
    greedy row gets its raw logits, as a greedy loop does."""
    if cfg.greedy:
        return raw.astype(jnp.float32)
    if rows is None:
        return sampling.warp_logits(raw, temperature, cfg.top_k, top_p if cfg.use_top_p else None)
    raw = raw.astype(jnp.float32)
    batch, vocab = raw.shape[0], raw.shape[-1]
    t, p = _per_row(temperature, raw), _per_row(top_p, raw)
    greedy = None if rows.greedy is None else _per_row(rows.greedy, raw)
    logits = raw / (t if greedy is None else jnp.where(greedy, 1.0, t))
    # Each filter sorts the whole vocabulary per row; a batch in which no
    # sampled row asks for it (all greedy, or top_k 0 / top_p 1) skips it.
    # Skipping is exact: a skipped filter would have kept every logit.
    sampled = jnp.ones((batch,), bool) if rows.greedy is None else ~jnp.broadcast_to(rows.greedy, (batch,))
    if rows.top_k is not None:
        k = jnp.broadcast_to(rows.top_k, (batch,))
        logits = _only_if((sampled & (k > 0) & (k < vocab)).any(),
                          lambda x: sampling.apply_top_k_rows(x, _per_row(k, x)), logits)
    elif cfg.top_k is not None:
        logits = sampling.apply_top_k(logits, cfg.top_k)
    if cfg.use_top_p:
        below = (sampled & (jnp.broadcast_to(top_p, (batch,)) < 1.0)).any()
        logits = _only_if(below, lambda x: jnp.where(p < 1.0, sampling.apply_top_p(x, p), x), logits)
    return logits if greedy is None else jnp.where(greedy, raw, logits)


def _only_if(pred: Array, fn: Callable[[Array], Array], x: Array) -> Array:
    """``fn(x)`` if the traced scalar ``pred`` holds, else ``x`` (which ``fn``
    must then leave as it is): the work of ``fn`` runs only when it changes something."""
    return jax.lax.cond(pred, fn, lambda y: y, x)


def _per_row(x, like: Array) -> Array:
    """A scalar as it is, a ``[B]`` array shaped to broadcast against ``like[B, ...]``."""
    x = jnp.asarray(x)
    return x if x.ndim == 0 else x.reshape(x.shape + (1,) * (like.ndim - x.ndim))


# Prompts are prefilled in blocks of this many tokens (the smallest prompt
# bucket), so that every prefill matmul has ``B * PREFILL_BLOCK`` rows whatever
# the padded width: one ``[B * P, H]`` product rounded differently for another
# ``P``, and in bfloat16 a sequence's output changed with its companions'
# prompt lengths.
PREFILL_BLOCK = 16
# A prompt prefilled alone has no companions whose prompt lengths could change
# its numbers, so it runs in wider blocks: each block is one pass over the
# weights, and at 16 rows that pass, not the arithmetic, is most of a block's
# time. On a 2-core CPU a 40-token chat prompt took 88-119 ms to prefill in
# blocks of 48 or 64 against 142 ms in blocks of 16 (SmolLM2-135M, float32);
# on an accelerator the 64 rows cost about what 16 do.
SINGLE_PREFILL_BLOCK = 64


def prefill_block(batch: int) -> int:
    """Tokens per prefill block for a batch of ``batch`` prompts."""
    return SINGLE_PREFILL_BLOCK if batch == 1 else PREFILL_BLOCK


class Prefilled(NamedTuple):
    """What :func:`prefill` and :func:`prefill_chunk` leave.

    Attributes:
      cache: the cache (``prefill``'s rolled back to ``keep``; a chunk's not yet).
      hidden: ``[B, P, ...]`` the asked ``hidden_layers``' outputs (through
        ``hidden_fn``) at every position, zeros where a block was skipped; None
        without ``hidden_layers``.
      logits: ``[B, V]`` float32, the raw logits at each sequence's
        ``logits_at`` position (zeros where that position lies in no block run
        here); None without ``logits_at``.
    """

    cache: KVCache
    hidden: Array | None = None
    logits: Array | None = None


def prefill(module, params, prompts: Array, keep: Array, cache_length: int, *, hidden_layers=(),
            features: Array | None = None, hidden_fn: Callable | None = None,
            logits_at: Array | None = None) -> Prefilled:
    """Runs ``prompts[B, P]`` into a fresh cache, then keeps ``keep[B]`` entries.

    Blocks of :func:`prefill_block` tokens run one at a time through one compiled
    forward (a shorter tail, where the width was shrunk to a position limit,
    through one more), and only as many as hold a kept position: the blocks
    of the bucket's padding past ``max(keep)`` are skipped, so the prefill's
    work follows the longest prompt, not its width bucket. Nothing past
    ``keep`` is read (the cache masks it, the callers read features below it),
    and every block that runs has the same shape, so skipping changes no
    sequence's numbers.

    With n ``hidden_layers``, :attr:`Prefilled.hidden` holds those blocks'
    outputs at every prompt position, concatenated, then ``hidden_fn`` of
    them, applied block by block: a feature head's input. Applying
    ``hidden_fn`` per block keeps its products the shape they have in
    :func:`prefill_chunk`, so that a prompt prefilled in chunks gets the
    same numbers. A feature head reads ``features [B, P, H]`` alongside the tokens.
    ``logits_at [B]``: a position below ``keep`` per sequence whose raw logits
    :attr:`Prefilled.logits` returns (the prompt's last: its first token's
    distribution), read from the block that holds it (one row of the LM
    head per block, not the block's).
    """
    batch, width = prompts.shape
    block_size = prefill_block(batch)
    cache = module.init_cache(batch, cache_length)
    run, skip = _block_forward(module, params, hidden_layers, hidden_fn, logits_at)
    layers = tuple(hidden_layers)

    def split(x, full):  # [B, full * PB, ...] -> [full, B, PB, ...]
        x = x[:, : full * block_size]
        return x.reshape((batch, full, block_size) + x.shape[2:]).swapaxes(0, 1)

    def block(xs, i):
        return tuple(None if x is None else x[i] for x in xs)

    full, tail = divmod(width, block_size)
    longest = jnp.max(keep)
    hidden, logits = [], _no_logits(run, cache, prompts[:, :block_size], features, logits_at)
    if full:
        xs = (split(prompts, full), None if features is None else split(features, full))
        _, h, _ = skip(cache, *block(xs, 0), jnp.int32(0))
        h_all = None if h is None else jnp.zeros((full,) + h.shape, h.dtype)

        def body(i, carry):
            c, h_all, got = carry
            c, h, lg = run(c, *block(xs, i), i * block_size)
            return c, (None if h_all is None else h_all.at[i].set(h)), _keep_logits(got, lg, logits_at,
                                                                                    i * block_size, block_size)

        needed = jnp.minimum((longest + block_size - 1) // block_size, full)
        cache, h_all, logits = jax.lax.fori_loop(0, needed, body, (cache, h_all, logits))
        if layers:
            hidden.append(h_all.swapaxes(0, 1).reshape(batch, full * block_size, -1))
    if tail:
        rest = full * block_size
        args = (cache, prompts[:, rest:], None if features is None else features[:, rest:], jnp.int32(rest))
        # Only where a kept position lies in the tail; skipping it leaves the cache's lengths short of
        # ``rest``, which the rollback below makes moot (every kept entry was written).
        cache, h, lg = jax.lax.cond(longest > rest, run, skip, *args)
        logits = _keep_logits(logits, lg, logits_at, rest, tail)
        if layers:
            hidden.append(h)
    cache = cache.rollback(keep)
    if layers:
        hidden = jnp.concatenate(hidden, axis=1) if len(hidden) > 1 else hidden[0]
    return Prefilled(cache, hidden if layers else None, logits)


def _no_logits(run, cache, block, features, logits_at) -> Array | None:
    """Zero logits of the shape one block's forward gives, or None without ``logits_at``."""
    if logits_at is None:
        return None
    shape = jax.eval_shape(run, cache, block, None if features is None else features[:, : block.shape[1]],
                           jnp.int32(0))[2]
    return jnp.zeros(shape.shape, shape.dtype)


def _keep_logits(got, new, logits_at, start, size: int):
    """``got [B, V]`` with the rows whose ``logits_at`` lies in ``[start, start + size)`` from ``new``."""
    if logits_at is None:
        return None
    inside = (logits_at >= start) & (logits_at < start + size)
    return jnp.where(inside[:, None], new, got)


def _block_forward(module, params, hidden_layers, hidden_fn, logits_at=None):
    """``(run, skip)``: one prefill block's forward ``(cache, tokens, features, start) -> (cache,
    hidden or None, logits [B, V] at ``logits_at - start`` or None)``, and what it returns without
    running (the cache as it was, zero hidden and logits)."""
    layers = tuple(hidden_layers)

    def run(c, block, feats, start):
        extra = {} if feats is None else {"features": feats}
        at = None if logits_at is None else jnp.clip(logits_at - start, 0, block.shape[1] - 1)
        if at is not None and getattr(module, "supports_logits_at", False):
            out = module.apply(params, block, c, hidden_layers=layers, logits_at=at, **extra)
            logits = out.logits[:, 0]
        else:
            out = module.apply(params, block, c, hidden_layers=layers, **extra)
            logits = None if at is None else row_at(out.logits, at)
        h = None
        if layers:
            h = jnp.concatenate(out.hidden, axis=-1)
            h = h if hidden_fn is None else hidden_fn(h)
        return out.cache, h, None if logits is None else logits.astype(jnp.float32)

    def skip(c, block, feats, start):
        if not layers and logits_at is None:
            return c, None, None
        _, h, lg = jax.eval_shape(run, c, block, feats, start)
        zeros = lambda x: None if x is None else jnp.zeros(x.shape, x.dtype)  # noqa: E731
        return c, zeros(h), zeros(lg)

    return run, skip


def prefill_chunk(module, params, cache: KVCache, chunk: Array, keep: Array, start: Array, width: Array, *,
                  tail: int, hidden_layers=(), features: Array | None = None,
                  hidden_fn: Callable | None = None, logits_at: Array | None = None) -> Prefilled:
    """The part of :func:`prefill` that lies in one chunk of a prompt: for
    one prompt padded to ``width`` (traced) and prefilled alone (blocks of
    :func:`prefill_block` ``(1)``), the blocks ``prefill`` runs whose
    positions lie in ``[start, start + N)``, run into ``cache`` (which holds
    the blocks before ``start``: a fresh cache for ``start = 0``).

    ``chunk [1, N]``: the padded prompt's tokens at those positions (N a
    multiple of the block); ``start`` a multiple of the block; ``keep``: the
    entries the whole prefill keeps; ``tail``: the width of ``prefill``'s
    tail block when ``width`` is not a multiple of the block (the engine's
    capacity modulo the block: only a width cut to the capacity is one),
    else unused. Each block runs the forward ``prefill`` runs for it, with
    the same tokens and cache entries before it, so chunk after chunk leaves
    the cache ``prefill`` leaves (before its rollback to ``keep``, which the
    caller does after the last chunk). Returns :class:`Prefilled` as
    ``prefill`` does for those positions (``hidden [1, N, ...]``; the logits
    at ``logits_at`` where this chunk holds it).

    A ``start`` off the block grid resumes a prefix cached to a position
    inside a block: the chunks' blocks then run from ``start`` on and the
    last one must end at the prompt's last token (``max(keep)`` minus
    ``start`` a multiple of the block, rounded up for a draft model's keep of
    one less), so that none writes past the prompt; their entries match
    ``prefill``'s within float rounding (other block boundaries), and no
    tail block runs.
    """
    batch, n = chunk.shape
    block_size = prefill_block(batch)
    blocks = n // block_size
    run, skip = _block_forward(module, params, hidden_layers, hidden_fn, logits_at)
    layers = tuple(hidden_layers)
    first = start // block_size
    full = width // block_size

    def split(x):  # [B, N, ...] -> [blocks, B, PB, ...]
        return x.reshape((batch, blocks, block_size) + x.shape[2:]).swapaxes(0, 1)

    xs = (split(chunk), None if features is None else split(features))

    def block(i):
        return tuple(None if x is None else x[i] for x in xs)

    _, h, _ = skip(cache, *block(0), jnp.int32(0))
    h_all = None if h is None else jnp.zeros((blocks,) + h.shape, h.dtype)
    logits = _no_logits(run, cache, chunk[:, :block_size], None if features is None else features, logits_at)

    def body(i, carry):
        c, h_all, got = carry
        at = start + i * block_size
        c, h, lg = run(c, *block(i), at)
        return c, (None if h_all is None else h_all.at[i].set(h)), _keep_logits(got, lg, logits_at, at, block_size)

    aligned = start % block_size == 0
    needed = jnp.minimum((jnp.max(keep) + block_size - 1) // block_size, full) - first
    count = jnp.clip(jnp.where(aligned, needed, (jnp.max(keep) - start + block_size - 1) // block_size), 0, blocks)
    cache, h_all, logits = jax.lax.fori_loop(0, count, body, (cache, h_all, logits))
    hidden = h_all.swapaxes(0, 1).reshape(batch, n, -1) if layers else None
    if tail:
        offset = (full - first) * block_size
        runs = aligned & (width % block_size != 0) & (jnp.max(keep) > full * block_size) & (offset >= 0) & (offset < n)
        at = jnp.clip(offset, 0, n - tail)
        args = (cache, jax.lax.dynamic_slice_in_dim(chunk, at, tail, axis=1),
                None if features is None else jax.lax.dynamic_slice_in_dim(features, at, tail, axis=1), start + at)
        cache, h, lg = jax.lax.cond(runs, run, skip, *args)
        if logits is not None:
            logits = jnp.where(runs, _keep_logits(logits, lg, logits_at, start + at, tail), logits)
        if layers:
            hidden = jnp.where(runs, jax.lax.dynamic_update_slice_in_dim(hidden, h.astype(hidden.dtype), at, axis=1),
                               hidden)
    return Prefilled(cache, hidden, logits)


def constrain(cfg: LoopConfig, state, batch: int, caches: Sequence[tuple[str, str]]):
    """Pins a loop state to the mesh layout (no-op without a mesh): caches get
    their own spec, every other batch-leading leaf is split over 'data'."""
    lay = cfg.layout
    if lay is None:
        return state
    pinned = {field: lay.constrain_cache(getattr(state, field), which) for field, which in caches}
    rest = lay.constrain_batch(state.replace(**{field: None for field, _ in caches}), batch)
    return rest.replace(**pinned)


def replicate_outputs(cfg: LoopConfig, tree):
    """On a mesh, outputs are replicated so every host can read them (they are small)."""
    return tree if cfg.layout is None else cfg.layout.replicated(tree)


def extract(cfg: LoopConfig, tokens: Array, prompt_lengths: Array, generated: Array, pad_id: Array) -> Array:
    """``[B, N]`` generated tokens, ``pad_id`` after each end."""
    n = cfg.max_new_tokens
    out = jax.vmap(lambda row, start: jax.lax.dynamic_slice(row, (start,), (n,)))(
        tokens, prompt_lengths
    )
    return jnp.where(jnp.arange(n)[None, :] < generated[:, None], out, pad_id)


def is_eos(eos_ids: Array, tokens: Array) -> Array:
    """``tokens`` (any shape) that are one of ``eos_ids[E]`` (-1 entries match nothing),
    or, for ``eos_ids[B, E]`` (one set per sequence), ``tokens[B, ...]`` in their row's set."""
    if eos_ids.ndim == 2:
        eos_ids = eos_ids.reshape((eos_ids.shape[0],) + (1,) * (tokens.ndim - 1) + (eos_ids.shape[1],))
    return (tokens[..., None] == eos_ids).any(-1)

