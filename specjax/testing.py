"""Tiny models for tests and examples: no checkpoint, no download, compiled in seconds on a CPU.

Two kinds:

* a **bigram table** (:func:`bigram_model`): ``logits[b, t] = table[tokens[b, t]]``,
  so the next-token distribution depends on the current token only and exact
  output distributions are easy to enumerate (the lossless rule's statistical
  tests use it);
* a **random Llama** pair (:func:`llama_config`, :func:`peaked_target_and_draft`):
  the real :class:`specjax.Decoder` (KV cache, GQA, hidden states), 2 layers of
  width 32, with a draft that agrees with the target part of the time.

::

    import jax, specjax
    from specjax import testing

    pair = specjax.pair(testing.bigram_model(testing.random_table(0, 8)),
                        testing.bigram_model(testing.random_table(1, 8)))
    out = specjax.decode(pair, [[1, 2, 3]], max_new_tokens=16, key=jax.random.key(0))

    target, draft = testing.peaked_target_and_draft(testing.llama_config())
    out = specjax.decode(specjax.pair(target, draft), [[1, 2, 3]], temperature=0.0)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.models.lm import KVCache, LMOutput, Model
from specjax._src.models.config import ModelConfig
from specjax._src.models.decoder import Decoder

__all__ = ["Bigram", "bigram_model", "random_table", "llama_config", "peaked_target_and_draft"]


# ----------------------------------------------------------------------------
# a bigram table


@dataclasses.dataclass(frozen=True)
class Bigram:
    """The static half of a bigram LM (the LM protocol's module): the vocabulary
    size and an optional position limit. Params are ``{"table": [V, V]}``.

    Stateless (``KVCache.empty``), but it keeps the protocol's length
    bookkeeping, so ``decode`` treats it like any cached model.
    """

    vocab_size: int
    max_position_embeddings: Optional[int] = None

    # A bigram's next-token logits depend on the current token alone, so a
    # token tree needs no attention mask: any tree shape is exact.
    supports_trees = True

    @property
    def hidden_size(self) -> int:
        return self.vocab_size

    @property
    def num_layers(self) -> int:
        return 1

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> KVCache:
        del max_length, dtype  # a bigram needs no history
        return KVCache.empty(batch_size)

    def apply(self, params, tokens, cache: Optional[KVCache] = None, *, hidden_layers: Sequence[int] = (),
              tree_parents=None, tree_offset: int = 0):
        """``tokens [B, T]`` -> ``LMOutput(logits [B, T, V] float32, hidden, cache)``.

        Every requested hidden layer is the logits row itself (``[B, T, V]``): a
        hidden state that rules and drafters can read without a real network.
        ``tree_parents`` / ``tree_offset`` are accepted and need nothing.
        """
        del tree_parents, tree_offset
        logits = jnp.take(params["table"], tokens, axis=0).astype(jnp.float32)
        hidden = tuple(logits for _ in hidden_layers)
        new_cache = None
        if cache is not None:
            new_cache = cache.replace(lengths=cache.lengths + tokens.shape[1])
        return LMOutput(logits=logits, hidden=hidden, cache=new_cache)


def bigram_model(table, max_position_embeddings: Optional[int] = None, tokenizer=None) -> Model:
    """A :class:`specjax.Model` whose next-token logits are ``table[current token]``.

    ``table``: logits ``[V, V]`` (array-like, stored as float32), row = current
    token. ``max_position_embeddings`` makes ``decode`` check lengths as for a
    real model; ``tokenizer`` is attached as the model's tokenizer.
    """
    table = jnp.asarray(table, jnp.float32)
    module = Bigram(int(table.shape[1]), max_position_embeddings)
    return Model(params={"table": table}, module=module, tokenizer=tokenizer)


def random_table(seed: int, vocab: int, scale: float = 1.5) -> np.ndarray:
    """Random logits ``[vocab, vocab]`` float32, normal with std ``scale`` (fixed by ``seed``)."""
    return np.random.default_rng(seed).normal(scale=scale, size=(vocab, vocab)).astype(np.float32)


# ----------------------------------------------------------------------------
# a random Llama target and its draft


def llama_config(**overrides) -> ModelConfig:
    """A small Llama: vocabulary 96, width 32, 2 layers, GQA 4/2 heads of 8,
    MLP 64, 128 positions; ``overrides`` replace any field."""
    base = dict(model_type="llama", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128)
    return ModelConfig(**{**base, **overrides})


def peaked_target_and_draft(config: ModelConfig) -> tuple[Model, Model]:
    """``(target, draft)`` from a randomly initialised :class:`specjax.Decoder` (key 0).

    Random init gives near-uniform logits, so the target's LM head is scaled
    x30 (peaked distributions, no greedy near-ties). The draft is the target's
    layer 0 (``num_layers=1``) with that head plus 0.3 std of noise, so it agrees
    with the target part of the time (about 1 in 5 first drafts greedy, on random
    prompts): rules see both accepts and rejects. Both share ``config``'s vocabulary.
    """
    params = Decoder(config).init(jax.random.key(0))
    params["lm_head"] = params["lm_head"] * 30.0
    draft_params = {k: v for k, v in params.items() if k != "layer_1"}
    head = draft_params["lm_head"]
    draft_params["lm_head"] = head + 0.3 * jnp.std(head) * jax.random.normal(jax.random.key(5), head.shape)
    return Model(params, Decoder(config)), Model(draft_params, Decoder(config.replace(num_layers=1)))
