"""A prefix cache for the slots engine: prompts that begin alike are prefilled once.

Chat clients resend a conversation's whole history every turn, and many requests
share one long system prompt. The cache keeps the KV entries of prompts already
prefilled, and of finished requests' prompts and generated tokens (a conversation's
next turn resends the reply), in blocks of ``BLOCK`` (64) positions, and an insert
whose prompt begins with cached blocks copies them in and prefills only the rest
(:meth:`specjax.engine.Engine.begin_insert` with ``prefix=``).

**The index** (host side) is a chain of hashes, as in vLLM's automatic prefix
caching: block ``j`` of a prompt is keyed by the key of block ``j - 1`` and the
tokens ``[B j, B (j + 1)]`` (one past the block: a feature head's draft entry at
position ``i`` reads the token ``i + 1``), and block 0's parent is the engine's
identity: a digest of both models' modules (architecture and configuration), their
parameters' structure, shapes, dtypes and a checksum of their values (so another
checkpoint, weights format or quantization never matches), the KV buffers' shapes,
and a caller's ``namespace`` (a server names its chat template there). A block also
keeps its tokens, compared on every match, so a hash collision cannot reuse it.

**Partial blocks.** A conversation's history rarely ends on a block boundary,
and a prompt that diverges from a cached one mid-block still shares that
block's first positions. So the cache also keeps a prompt's (or a finished
request's) last, incomplete block, keyed by the tokens it holds, and a match
that runs out of whole blocks takes, among the cached children of the last
matched block, the one that agrees with the prompt longest: causal entries
before the first differing token are exact. The prefill then resumes inside
that block, at the prompt's length less a whole number of blocks, so that its
blocks end at the prompt's last token (``resume_position``; positions
between the resumption and the match are computed again). A partial match is
taken only where it leaves fewer blocks to prefill than the whole blocks do,
and a partial block that a longer sibling covers is dropped.

**What a block holds**: every KV buffer of both caches at its ``B`` positions:
the target's, and the draft model's or the feature head's (whose entries were
computed from the target's features at those positions, so nothing else of the
target is needed). The rest of a request's first state is rebuilt from the
prompt by the insert's last chunk, which is never cached: the feature head's
pending features come from that chunk's target forward, the n-gram lookup
reads the prompt from the token buffer, and the rule's and drafting policy's
states start fresh. A block is usable for a prompt of ``L`` tokens when all its
positions lie below ``L - 2`` (the draft cache keeps ``L - 2`` entries).

**Exactness**: a block's entries are what a prefill of the prompt computed at
those positions; copied in, they leave the job's caches as the chunks before
would have, so a prompt inserted alone decodes the same tokens from a cached
prefix as from a cold cache (bit for bit when the block came from an insert of
one prompt, which runs ``B``-wide blocks as the chunks do; within float
rounding when it came from a group prefill, which runs 16-wide blocks, from a
finished request's generated tokens, whose entries the verifications computed,
or when the prefill resumes inside a block).

**Memory**: blocks live on the device, under ``budget_bytes``; when a new block
would exceed it, the least recently used unpinned block with no cached
children goes first (a radix tree's leaf: evicting an inner block would strand
its descendants). Blocks of a match are pinned until :meth:`PrefixCache.release`,
and a block that would need a pinned one evicted is not stored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import weakref
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.engine.ops import SINGLE_PREFILL_BLOCK

BLOCK = SINGLE_PREFILL_BLOCK  # positions per block: a single prompt's prefill block, so chunks line up


class PrefixHit(NamedTuple):
    """The cached start of a prompt (:meth:`PrefixCache.match`).

    Attributes:
      tokens: prompt positions the prefill takes from the cached blocks and does not compute
        (0: none): a multiple of ``BLOCK`` (64), or after a partial block, the prompt's length
        less a multiple of it (``resume_position``).
      keys: the blocks' keys, first to last (pinned until :meth:`PrefixCache.release`).
    """

    tokens: int
    keys: tuple


@dataclasses.dataclass(eq=False)
class _Block:
    key: bytes
    parent: bytes
    tokens: np.ndarray  # [m + 1] int32: the block's first m positions' tokens and the one after (m = BLOCK: whole)
    arrays: Any  # per cache, (keys per layer, values per layer), each [H, BLOCK, D]
    nbytes: int
    used: int  # the LRU clock when last matched or stored
    pins: int = 0

    @property
    def positions(self) -> int:
        """Positions whose entries the block holds (``BLOCK`` for a whole block)."""
        return len(self.tokens) - 1


# ---------------------------------------------------------------------------
# Device copies (one program each; slot and position traced)
# ---------------------------------------------------------------------------


def _take_block(caches, row, start):
    """Positions ``[start, start + BLOCK)`` of row ``row`` of both caches: per cache,
    ``(keys, values)`` per layer, each ``[H, BLOCK, D]``."""

    def take(buf):
        return jax.lax.dynamic_slice_in_dim(buf[row], start, BLOCK, axis=1)

    return tuple((tuple(map(take, c.keys)), tuple(map(take, c.values))) for c in caches)


def _put_block(caches, block, start):
    """Both batch-1 caches with ``block`` written at positions ``[start, start + BLOCK)``."""

    def put(buf, part):
        return jax.lax.dynamic_update_slice_in_dim(buf, part[None].astype(buf.dtype), start, axis=2)

    return tuple(
        c.replace(keys=tuple(map(put, c.keys, ks)), values=tuple(map(put, c.values, vs)))
        for c, (ks, vs) in zip(caches, block)
    )


def _with_lengths(caches, length):
    return tuple(c.rollback(jnp.full(c.lengths.shape, length, jnp.int32)) for c in caches)


_take_jit = jax.jit(_take_block)
_put_jit = jax.jit(_put_block, donate_argnums=(0,))
_lengths_jit = jax.jit(_with_lengths, donate_argnums=(0,))


# ---------------------------------------------------------------------------
# Identity: everything besides the tokens that changes a block's entries
# ---------------------------------------------------------------------------


def _checksums(tree) -> list:
    """Per leaf: its sum and the sum of its squares, enough to tell checkpoints apart (read on the
    host once per engine)."""
    out = []
    for x in jax.tree_util.tree_leaves(tree):
        x = np.asarray(jax.device_get(x)).astype(np.float64, copy=False).ravel()
        out.append((round(float(x.sum()), 6), round(float(np.dot(x, x)), 6)))
    return out


def engine_identity(engine, namespace: str = "") -> bytes:
    """The digest a block of ``engine``'s caches is keyed under (see the module's docstring)."""
    digest = hashlib.sha256(b"specjax-prefix-cache-v1\0" + namespace.encode("utf-8", "replace") + b"\0")
    for model in (engine.params.target, engine.params.draft):
        leaves, treedef = jax.tree_util.tree_flatten(model.params)
        digest.update(repr(model.module).encode())
        digest.update(str(treedef).encode())
        digest.update(repr([(tuple(np.shape(x)), str(x.dtype)) for x in leaves]).encode())
        digest.update(repr(_checksums(model.params)).encode())
    digest.update(repr(engine.cfg.loop.cache_length).encode())
    return digest.digest()


def _block_key(parent: bytes, tokens: np.ndarray) -> bytes:
    return hashlib.sha256(parent + np.asarray(tokens, np.int32).tobytes()).digest()


def resume_position(cached: int, length: int) -> int:
    """Where the prefill of a prompt of ``length`` tokens resumes after a match of its first
    ``cached`` positions: ``cached`` itself on the block grid, else the prompt's length less the
    whole blocks that cover the rest (their last ends at the prompt's last token, none past it)."""
    cached, length = int(cached), int(length)
    if cached % BLOCK == 0:
        return cached
    return length - -(-(length - cached) // BLOCK) * BLOCK


def _agreeing_positions(block: "_Block", tokens: np.ndarray, limit: int) -> int:
    """How many of ``block``'s leading positions ``tokens`` (the prompt from the block's first
    position on) shares: a position counts when its token and the one after it agree; at most
    ``limit``."""
    stored = block.tokens[: len(tokens)]
    differs = np.flatnonzero(stored != tokens[: len(stored)])
    agree = int(differs[0]) if differs.size else len(stored)
    return max(0, min(agree - 1, len(block.tokens) - 1, limit))


def _fits(engine, index: int) -> bool:
    """Whether block ``index`` lies within ``engine``'s KV buffers: a partial block near the end of
    a capacity that is not a multiple of ``BLOCK`` may not (its copies are ``BLOCK`` wide)."""
    return (index + 1) * BLOCK <= engine.cfg.loop.cache_length


def usable_blocks(length: int) -> int:
    """How many leading blocks a prompt of ``length`` tokens may take from (or give to) the cache:
    those whose positions all lie below ``length - 2`` (kept by both caches, and the token after
    each in the prompt)."""
    return max(0, (int(length) - 2) // BLOCK)


def blocks_in_common(prompt: Sequence[int], other: Sequence[int]) -> int:
    """The leading blocks of ``prompt`` that ``other``'s would key alike (the same tokens through the
    token after each block), among those both may give to the cache (:func:`usable_blocks`)."""
    a, b = np.asarray(prompt), np.asarray(other)
    n = min(usable_blocks(len(a)), usable_blocks(len(b))) * BLOCK
    if not n:
        return 0
    differs = np.flatnonzero(a[: n + 1] != b[: n + 1])
    first = int(differs[0]) if differs.size else n + 1
    return max(first - 1, 0) // BLOCK


# ---------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------


class PrefixCache:
    """Blocks of prefilled prompts' KV entries, on the device, under a memory budget.

    One cache may serve several engines: each engine's blocks are keyed under its
    own identity (``engine_identity``), so none is reused by another.

    Args:
      budget_bytes: the most bytes the blocks may hold (device memory, beside the engine's state).
      namespace: mixed into every engine's identity; give what else changes a prompt's
        meaning for the caller's requests (a server gives its chat template).
    """

    def __init__(self, budget_bytes: int, *, namespace: str = ""):
        budget = int(budget_bytes)
        if budget < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes!r}.")
        self.budget_bytes, self.namespace = budget, str(namespace)
        self._blocks: dict[bytes, _Block] = {}
        self._children: dict[bytes, set] = {}  # a block's key (or an identity) -> its cached children's
        self._identities: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._clock = itertools.count(1)
        self.bytes = 0
        self.evictions = 0
        self.queried_tokens = 0  # prompt tokens of the matched prompts
        self.hit_tokens = 0  # of those, read from the cache
        self.stored_blocks = 0

    # -- reading ------------------------------------------------------------

    def identity(self, engine) -> bytes:
        found = self._identities.get(engine)
        if found is None:
            _check_layout(engine)
            found = self._identities[engine] = engine_identity(engine, self.namespace)
        return found

    def match(self, engine, prompt: Sequence[int]) -> PrefixHit:
        """The longest cached start of ``prompt`` for ``engine``: whole blocks, then the child of the
        last that agrees with the prompt longest where that leaves fewer blocks to prefill (see the
        module's docstring). Its blocks are pinned (not evicted) until :meth:`release`. Counts
        toward the hit rate."""
        tokens = np.asarray(prompt, np.int32)
        length = len(tokens)
        parent, keys = self.identity(engine), []
        for j in range(usable_blocks(length)):
            span = tokens[j * BLOCK : (j + 1) * BLOCK + 1]
            key = _block_key(parent, span)
            block = self._blocks.get(key)
            if block is None or block.parent != parent or not np.array_equal(block.tokens, span):
                break
            keys.append(key)
            parent = key
        cached = len(keys) * BLOCK
        partial = self._best_child(engine, parent, len(keys), tokens[cached:], limit=length - 2 - cached)
        resume = cached if partial is None else resume_position(cached + partial[1], length)
        if resume > cached:  # the partial block leaves fewer blocks to prefill
            keys.append(partial[0])
            cached = resume
        now = next(self._clock)
        for key in keys:
            block = self._blocks[key]
            block.pins += 1
            block.used = now
        self.queried_tokens += length
        self.hit_tokens += cached
        return PrefixHit(cached, tuple(keys))

    def _best_child(self, engine, parent: bytes, index: int, rest: np.ndarray, *, limit: int):
        """``(key, positions)`` of the child of ``parent`` (block ``index`` of a prompt) that agrees
        with ``rest`` (the prompt from the child's first position on) over the most positions, at
        most ``limit``; None: none agrees, or the block would not fit the KV buffers."""
        best, most = None, 0
        if _fits(engine, index):
            for key in self._children.get(parent, ()):
                agree = _agreeing_positions(self._blocks[key], rest, limit)
                if agree > most:
                    best, most = key, agree
        return None if best is None else (best, most)

    def release(self, hit: PrefixHit) -> None:
        """Unpins ``hit``'s blocks (each call once per :meth:`match`)."""
        for key in hit.keys:
            block = self._blocks.get(key)
            if block is not None and block.pins > 0:
                block.pins -= 1

    def restore(self, engine, hit: PrefixHit):
        """Both caches of one prompt (batch 1, as :meth:`specjax.engine.Engine.begin_insert` starts
        them) with ``hit``'s blocks copied in and their lengths at ``hit.tokens``."""
        caches = engine.empty_prefill_caches()
        for j, key in enumerate(hit.keys):
            caches = _put_jit(caches, self._blocks[key].arrays, np.int32(j * BLOCK))
        return _lengths_jit(caches, np.int32(hit.tokens))

    def begin_insert(self, engine, state, slot: int, prompt, settings=None, *, chunk: int):
        """``(job, hit)``: :meth:`specjax.engine.Engine.begin_insert` of ``prompt`` from its longest
        cached start (the rest prefilled chunk by chunk; a prompt with none starts cold). The hit's
        blocks stay pinned: :meth:`release` it once the job is finished or dropped."""
        hit = self.match(engine, prompt)
        try:
            prefix = (self.restore(engine, hit), hit.tokens) if hit.tokens else None
            job = engine.begin_insert(state, slot, prompt, settings, chunk=chunk, prefix=prefix)
        except BaseException:
            self.release(hit)
            raise
        return job, hit

    # -- writing ------------------------------------------------------------

    def store(self, engine, state, slot: int, prompt: Sequence[int], *, cached: Optional[int] = None) -> int:
        """Adds the blocks of ``prompt`` that are not cached yet, read from ``slot`` of ``state``.

        ``prompt``: the tokens the slot holds from its first position on. ``cached``: how many
        leading positions both of the slot's caches hold entries of; None: ``len(prompt) - 2``,
        what an insert leaves (store right after it, before a step: the entries are the
        prefill's). A finished request stores its prompt and generated tokens with the caches'
        lengths (``target_cache.lengths`` and ``draft_cache.lengths`` at the slot, the smaller):
        its entries past the prompt are the verifications', within float rounding of what a
        prefill of those tokens computes. The positions below ``cached`` (and below the last
        token: a block's key holds the token after it) are stored as whole blocks and, for the
        rest, one partial block, unless a cached sibling already holds those tokens or the block
        would not fit the KV buffers. Returns the blocks added; stops at the first that the
        budget cannot hold without evicting a pinned block. Dispatches device copies only (no
        wait for the device)."""
        tokens = np.asarray(prompt, np.int32)
        caches = (state.loop.target_cache, state.loop.draft_cache)
        parent, added, now = self.identity(engine), 0, next(self._clock)
        kept = len(tokens) - 2 if cached is None else min(int(cached), len(tokens) - 1)
        chain = []
        for j in range(-(-max(kept, 0) // BLOCK)):
            span = tokens[j * BLOCK : min(j * BLOCK + BLOCK, kept) + 1]
            if len(span) <= BLOCK and (not _fits(engine, j) or self._covers(parent, span, now)):
                break  # a partial block past the buffers' end, or one a sibling holds
            key = _block_key(parent, span)
            chain.append(key)
            block = self._blocks.get(key)
            if block is not None and np.array_equal(block.tokens, span):
                block.used = now
                parent = key
                continue
            if block is not None:  # a colliding key: never overwrite (nor use) it
                break
            arrays = _take_jit(caches, np.int32(slot), np.int32(j * BLOCK))
            nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(arrays))
            if not self._make_room(nbytes, keep=set(chain)):
                break
            self._add(_Block(key, parent, span.copy(), arrays, nbytes, now))
            added += 1
            parent = key
        return added

    def _covers(self, parent: bytes, span: np.ndarray, now: int) -> bool:
        """Whether a child of ``parent`` holds entries for all of ``span``'s positions (its tokens
        begin with ``span``); that child counts as used."""
        for key in self._children.get(parent, ()):
            block = self._blocks[key]
            if len(block.tokens) >= len(span) and np.array_equal(block.tokens[: len(span)], span):
                block.used = now
                return True
        return False

    def _add(self, block: _Block) -> None:
        """Stores ``block``, and drops the unpinned partial siblings whose tokens it extends."""
        for key in list(self._children.get(block.parent, ())):
            other = self._blocks[key]
            shorter = len(other.tokens) < len(block.tokens)
            if shorter and not other.pins and np.array_equal(block.tokens[: len(other.tokens)], other.tokens):
                self._drop(other)
        self._blocks[block.key] = block
        self._children.setdefault(block.parent, set()).add(block.key)
        self.bytes += block.nbytes
        self.stored_blocks += 1

    def _drop(self, block: _Block) -> None:
        del self._blocks[block.key]
        siblings = self._children.get(block.parent)
        if siblings is not None:
            siblings.discard(block.key)
            if not siblings:
                del self._children[block.parent]
        self._children.pop(block.key, None)
        self.bytes -= block.nbytes

    def _make_room(self, nbytes: int, keep: set) -> bool:
        """Evicts least recently used leaves (unpinned, not in ``keep``: the chain being stored)
        until ``nbytes`` more fit the budget; False (nothing evicted beyond need) where they cannot."""
        while self.bytes + nbytes > self.budget_bytes:
            leaves = [b for b in self._blocks.values()
                      if not b.pins and b.key not in self._children and b.key not in keep]
            if not leaves:
                return False
            self._drop(min(leaves, key=lambda b: b.used))
            self.evictions += 1
        return True

    def clear(self) -> None:
        """Drops every unpinned block (pinned ones stay until released)."""
        budget, self.budget_bytes = self.budget_bytes, 0
        try:
            self._make_room(0, keep=set())
        finally:
            self.budget_bytes = budget

    # -- reporting ----------------------------------------------------------

    def reset_stats(self) -> None:
        """Zeroes the counters (hit rate, evictions, stored blocks); the blocks stay."""
        self.evictions = self.queried_tokens = self.hit_tokens = self.stored_blocks = 0

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def stats(self) -> dict:
        """``blocks``, ``bytes``, ``budget_bytes``, ``evictions``, ``queried_tokens``, ``hit_tokens``,
        ``stored_blocks`` and ``hit_rate`` (hit over queried prompt tokens)."""
        return dict(
            blocks=self.num_blocks,
            bytes=self.bytes,
            budget_bytes=self.budget_bytes,
            evictions=self.evictions,
            queried_tokens=self.queried_tokens,
            hit_tokens=self.hit_tokens,
            stored_blocks=self.stored_blocks,
            hit_rate=self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0,
        )


def _check_layout(engine) -> None:
    """Every KV buffer ``[B, H, cache_length, D]``: the layout the block copies read and write."""
    length = engine.cfg.loop.cache_length
    for name, cache in zip(("target", "draft"), jax.eval_shape(engine.empty_prefill_caches)):
        for buf in (*cache.keys, *cache.values):
            if buf.ndim != 4 or buf.shape[2] != length:
                raise ValueError(
                    f"PrefixCache: the {name} model's KV buffers are {buf.shape}, not "
                    f"[batch, heads, {length}, head_dim]; this model cannot use the prefix cache "
                    "(serve it with the prefix cache off)."
                )
