"""A bigram table language model implementing the LM protocol, for tests.

``logits[b, t] = table[tokens[b, t]]``: the next-token distribution depends on
the current token only, so exact distributions are easy to enumerate. The model
is stateless (``KVCache.empty``) but keeps the protocol's length bookkeeping.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.lm import KVCache, LMOutput, Model


@dataclasses.dataclass(frozen=True)
class Bigram:
    """Static half: the vocabulary size (and an optional position limit)."""

    vocab_size: int
    max_position_embeddings: Optional[int] = None

    @property
    def hidden_size(self) -> int:
        return self.vocab_size

    @property
    def num_layers(self) -> int:
        return 1

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> KVCache:
        del max_length, dtype
        return KVCache.empty(batch_size)

    def apply(self, params, tokens, cache: Optional[KVCache] = None, *, hidden_layers: Sequence[int] = ()):
        table = params["table"]
        logits = jnp.take(table, tokens, axis=0).astype(jnp.float32)
        hidden = tuple(logits for _ in hidden_layers)
        new_cache = None
        if cache is not None:
            new_cache = cache.replace(lengths=cache.lengths + tokens.shape[1])
        return LMOutput(logits=logits, hidden=hidden, cache=new_cache)


def bigram_model(table, max_position_embeddings: Optional[int] = None, tokenizer=None) -> Model:
    table = jnp.asarray(table, jnp.float32)
    module = Bigram(int(table.shape[1]), max_position_embeddings)
    return Model(params={"table": table}, module=module, tokenizer=tokenizer)


def random_table(seed: int, vocab: int, scale: float = 1.5) -> np.ndarray:
    """Random logits ``[V, V]``."""
    return np.random.default_rng(seed).normal(scale=scale, size=(vocab, vocab)).astype(np.float32)
