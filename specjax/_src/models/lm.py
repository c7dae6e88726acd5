"""The language-model protocol the decode loop runs on.

Any model that implements :class:`LanguageModel` plugs into ``specjax.decode``:
the Flax decoders in :mod:`specjax._src.models`, or a bigram table in a test.

A model is split into a *static* half (an object holding the config and the
pure functions, hashable, closed over by ``jax.jit``) and a *dynamic* half (the
params pytree, traced). :class:`Model` bundles the two with the tokenizer; it is
what ``specjax.load`` returns.

Cache contract (what makes speculative decoding cheap):

* ``init_cache(batch_size, max_length)`` preallocates every buffer once.
* ``apply(params, tokens[B, T], cache)`` writes the T new entries of sequence
  ``b`` at positions ``cache.lengths[b] ... cache.lengths[b] + T - 1`` and
  returns a cache whose ``lengths`` are ``cache.lengths + T``. Token ``t`` of
  sequence ``b`` sits at absolute position ``cache.lengths[b] + t``; it attends
  to the cached entries before ``cache.lengths[b]`` and to tokens ``<= t`` of
  the block.
* Entries at or beyond ``lengths[b]`` are never read, so rolling back rejected
  tokens is ``cache.replace(lengths=new_lengths)``: no buffer is copied, and the
  next append overwrites them. Ragged prompts use the same mechanism: prefill
  the right-padded batch, then reset ``lengths`` to the true prompt lengths.
* The caller guarantees ``lengths + T <= max_length``; ``specjax.decode``
  checks this before tracing, because XLA clamps out-of-range writes silently.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array
Params = Any


@struct.dataclass
class KVCache:
    """Preallocated per-layer key/value buffers with per-sequence lengths.

    Separate buffers per layer (a tuple, not one stacked ``[L, ...]`` array):
    see the models module for why this layout was chosen on CPU.

    Attributes:
      keys: per layer, ``[B, num_kv_heads, S, head_dim]`` (heads-major, so the
        attention dots read the buffers without transposing them).
      values: per layer, ``[B, num_kv_heads, S, head_dim]``.
      lengths: ``[B]`` int32, number of valid entries of each sequence.
    """

    keys: tuple[Array, ...]
    values: tuple[Array, ...]
    lengths: Array

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_length(self) -> int:
        if not self.keys:
            return _UNBOUNDED
        return self.keys[0].shape[2]

    def rollback(self, lengths: Array) -> "KVCache":
        """Forgets every entry at or beyond ``lengths`` (``[B]``); copies nothing."""
        return self.replace(lengths=jnp.asarray(lengths, jnp.int32))

    def keep_path(self, start: Array, path: Array, num: Array) -> "KVCache":
        """Keeps one root path of a token tree written at ``start``.

        After a tree forward wrote node ``j`` of sequence ``b`` at
        ``start[b] + j``, moves the entries of ``path[b, :num[b]]`` (node
        indices, root first) to ``start[b], start[b] + 1, ...`` and sets
        ``lengths = start + num``. Only the ``P`` path rows are gathered and
        written back (``path: [B, P]`` int32, entries past ``num`` ignored): no
        copy of the whole buffer. For a chain (``path[b, i] = i``) it is a
        rollback that moves nothing.
        """
        start = jnp.asarray(start, jnp.int32)
        rows = start[:, None] + jnp.asarray(path, jnp.int32)  # [B, P]

        def move(buf):
            block = jnp.take_along_axis(buf, rows[:, None, :, None], axis=2)  # [B, K, P, D]
            return jax.vmap(lambda b, blk, off: jax.lax.dynamic_update_slice(b, blk, (0, off, 0)))(
                buf, block, start
            )

        return self.replace(keys=tuple(move(k) for k in self.keys), values=tuple(move(v) for v in self.values),
                            lengths=start + jnp.asarray(num, jnp.int32))

    @classmethod
    def empty(cls, batch_size: int) -> "KVCache":
        """A cache with no buffers, for stateless models (a bigram table)."""
        return cls(keys=(), values=(), lengths=jnp.zeros((batch_size,), jnp.int32))


# A cache with no buffers can hold any length (a bigram model needs no history).
_UNBOUNDED = 2**31 - 1


class ReducedLogits(NamedTuple):
    """A reduced-vocabulary head's logits over its own vocabulary.

    Attributes:
      logits: ``[B, T, V']`` float32, column ``c`` scoring target token ``ids[c]``.
      ids: ``[V']`` int32 target ids, each once.
    """

    logits: Array
    ids: Array


class LMOutput(NamedTuple):
    """What one forward returns.

    Attributes:
      logits: ``[B, T, V]`` float32, for every input position.
      hidden: one ``[B, T, H]`` array per requested layer, in request order.
      cache: the cache after appending the T tokens (``None`` if none given).
      reduced: a reduced-vocabulary head's own ``V' < V`` columns, of which
        ``logits`` is the scatter (``-inf`` elsewhere); None for a model that
        scores the whole vocabulary. Greedy drafting ranks these: a pass over
        ``V'`` columns rather than ``V``.
    """

    logits: Array
    hidden: tuple[Array, ...]
    cache: KVCache | None
    reduced: ReducedLogits | None = None


@runtime_checkable
class LanguageModel(Protocol):
    """The static half of a model. Must be hashable (it is a jit static).

    Attributes:
      vocab_size: size of the logits' last axis.
      hidden_size: width of the hidden states ``apply`` can return.
      num_layers: number of blocks; ``hidden_layers`` index them like Python
        lists (``-1`` is the output of the last block, before the final norm).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> KVCache:
        ...

    def apply(
        self,
        params: Params,
        tokens: Array,
        cache: KVCache | None = None,
        *,
        hidden_layers: Sequence[int] = (),
    ) -> LMOutput:
        """Runs ``tokens[B, T]``; with ``cache=None`` a plain causal forward from position 0.

        Optional extension: a model whose class sets ``supports_logits_at = True``
        also accepts ``logits_at=[B]`` (one position per sequence) and returns
        logits ``[B, 1, V]`` for those positions only; the engine uses it where it
        needs one row of a multi-token forward.

        Optional extension: a model whose class sets ``supports_trees = True``
        also accepts ``tree_parents=[B, T]`` (or ``[T]``) int32, a flattened
        token tree in topological order (``parents[t] < t``; ``-1`` for a node
        whose parent is the last cached token). Node ``t`` is written at
        ``lengths + t``, sits at position ``lengths + depth(t)`` and attends to
        the cached prefix and to its own ancestors (and itself) only, so its
        logits equal a chain forward over its root path. The cache then holds
        every node; :meth:`KVCache.keep_path` keeps the accepted path. A model
        without it runs chains only.
        """
        ...


@struct.dataclass
class Model:
    """A loaded model: static module, params pytree, optional tokenizer.

    A pytree whose only leaves are the params, so it can be passed straight to
    jitted functions. ``chat_template`` is the checkpoint's Jinja chat template
    (``tokenizer_config.json`` or GGUF metadata), if it has one.
    """

    params: Params
    module: LanguageModel = struct.field(pytree_node=False)
    tokenizer: Any = struct.field(pytree_node=False, default=None)
    chat_template: Optional[str] = struct.field(pytree_node=False, default=None)

    @property
    def vocab_size(self) -> int:
        return self.module.vocab_size
