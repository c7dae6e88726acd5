"""The loop state before the first cycle: the prefills and the state built from them.

:func:`init_state` prefills a batch of prompts into both caches, each to its
invariant (:mod:`specjax._src.engine.loop`), and returns the
:class:`~specjax._src.engine.config.DecodeState` that ``decode``'s loop, the
slots engine's ``insert`` and any driver of :func:`~specjax._src.engine.cycle.run_cycles`
start from. A pair without a draft (``draft=None``, ``generate``'s) prefills
the target alone. The slots engine prefills a long prompt one chunk at a time
instead: :func:`empty_prefill_caches`, then :func:`prefill_pair_chunk` per
chunk, then :func:`state_after_chunks`, which leave the state :func:`init_state`
builds for that prompt.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from specjax._src.proposals import drafting as drafting_lib
from specjax._src.engine.config import DecodeState, LoopConfig, policy_slots
from specjax._src.engine.ops import batched_init, prefill, prefill_chunk, row_at
from specjax._src.models.lm import KVCache
from specjax._src.models.feature_head import is_feature_head
from specjax._src.models.pairing import ModelPair
from specjax._src.rules.base import AcceptanceRule
from specjax._src.engine.stats import DecodeStats

__all__ = ["init_state", "empty_prefill_caches", "prefill_pair_chunk", "state_after_chunks"]

Array = jax.Array

# ---------------------------------------------------------------------------
# The whole prompt at once
# ---------------------------------------------------------------------------


def init_state(
    cfg: LoopConfig, pair_params: ModelPair, rule: Optional[AcceptanceRule],
    policy: Optional[drafting_lib.DraftingPolicy], prompts: Array, prompt_lengths: Array, max_new: Array,
) -> DecodeState:
    """The loop state before the first cycle: both prefills, each cache to its invariant.

    Args:
      cfg: the loop's :class:`~specjax._src.engine.config.LoopConfig`
        (``num_draft`` K, ``max_new_tokens`` N the buffer's width,
        ``cache_length`` C).
      pair_params: a :class:`~specjax.ModelPair`; its ``draft`` may be None
        (target-only decoding, ``generate``'s: no draft cache).
      rule, policy: the acceptance rule and drafting policy whose ``init``
        gives each sequence's state; None for none (target-only decoding).
      prompts: ``[B, P]`` int32, right-padded.
      prompt_lengths: ``[B]`` int32, each prompt's tokens (at least 1).
      max_new: ``[B]`` int32, each sequence's ``max_new_tokens`` (0: a
        padding row, done from the start).

    Returns:
      A :class:`~specjax._src.engine.config.DecodeState`: ``tokens [B, P + N +
      K + 1]`` with the prompts first, ``num_committed = prompt_lengths``, the
      target cache holding every prompt token but the last, the draft cache
      every one but the last two (a feature head's: see
      :mod:`specjax._src.engine.loop`), zero stats.
    """
    target, draft = pair_params.target, pair_params.draft
    draft_features, draft_cache = None, None
    if draft is not None and is_feature_head(draft.module):
        target_cache, features = prefill(
            target.module, target.params, prompts, prompt_lengths - 1, cfg.cache_length,
            hidden_layers=draft.module.feature_layers, hidden_fn=_features_fn(draft),
        )
        draft_cache, draft_features = _prefill_head(cfg, draft, prompts, prompt_lengths, features)
    else:
        target_cache = prefill(target.module, target.params, prompts, prompt_lengths - 1, cfg.cache_length)
        if draft is not None:
            draft_cache = prefill(
                draft.module, draft.params, prompts, jnp.maximum(prompt_lengths - 2, 0), cfg.cache_length
            )
    return _state_after_prefill(cfg, rule, policy, prompts, prompt_lengths, max_new, target_cache, draft_cache,
                                draft_features)


def _features_fn(head):
    """The target's hidden states to a feature head's input, as a prefill applies it to each block."""
    return functools.partial(head.module.target_features, head.params)


def _state_after_prefill(cfg: LoopConfig, rule: AcceptanceRule, policy: drafting_lib.DraftingPolicy, prompts,
                         prompt_lengths, max_new, target_cache: KVCache, draft_cache: Optional[KVCache],
                         draft_features) -> DecodeState:
    """The state before the first cycle, from the prefilled caches (and a feature head's pending features)."""
    batch, width = prompts.shape
    k_max, n_max = cfg.num_draft, cfg.max_new_tokens
    tokens = jnp.zeros((batch, width + n_max + k_max + 1), jnp.int32).at[:, :width].set(prompts)
    return DecodeState(
        step=jnp.int32(0),
        tokens=tokens,
        num_committed=prompt_lengths,
        done=max_new <= 0,  # the buckets' dummy rows
        bad=jnp.zeros((batch,), jnp.int32),
        target_cache=target_cache,
        draft_cache=draft_cache,
        rule_state=None if rule is None else batched_init(rule.init, batch),
        policy_state=None if policy is None else batched_init(lambda: policy.init(policy_slots(cfg)), batch),
        stats=DecodeStats.zeros(batch, k_max),
        draft_features=draft_features,
    )


def _prefill_head(cfg: LoopConfig, head, prompts, prompt_lengths, features) -> tuple[KVCache, Array]:
    """A feature head's prefill: head position ``i`` reads the target's
    feature ``f_i`` and the token ``x_{i+1}``. Keeps positions ``0 .. n - 3``
    and leaves ``f_{n-2}`` pending (a one-token prompt has no feature yet: its
    first draft reads zeros, a poor guess that costs speed, never correctness).
    Returns ``(cache, pending [B, K + 1, H])``."""
    batch = prompts.shape[0]
    shifted = jnp.concatenate([prompts[:, 1:], jnp.zeros((batch, 1), prompts.dtype)], axis=1)
    keep = jnp.maximum(prompt_lengths - 2, 0)
    cache = prefill(head.module, head.params, shifted, keep, cfg.cache_length, features=features)
    return cache, _pending_features(cfg, prompt_lengths, row_at(features, keep))


def _pending_features(cfg: LoopConfig, prompt_lengths, last) -> Array:
    """``[B, K + 1, H]``: ``last [B, H]`` (the target's ``f_{n-2}``) first, zeros for a one-token prompt."""
    last = jnp.where((prompt_lengths >= 2)[:, None], last, 0.0)
    batch, hidden = last.shape
    return jnp.zeros((batch, cfg.num_draft + 1, hidden), last.dtype).at[:, 0].set(last)


# ---------------------------------------------------------------------------
# The same prefill, one chunk at a time (the slots engine's chunked insert)
# ---------------------------------------------------------------------------


def empty_prefill_caches(cfg: LoopConfig, pair_params: ModelPair) -> tuple[KVCache, KVCache]:
    """The target's and the draft's caches of one prompt before its first chunk."""
    return tuple(m.module.init_cache(1, cfg.cache_length) for m in (pair_params.target, pair_params.draft))


def prefill_pair_chunk(cfg: LoopConfig, pair_params: ModelPair, caches, prompt, length, width, start, chunk: int,
                       tail: int):
    """The prompt positions ``[start, start + chunk)`` of :func:`init_state`'s prefills of one prompt.

    ``prompt [1, P]``: the prompt padded with zeros (``P >= start + chunk + 1``:
    a feature head reads the token after each position); ``length``: its
    tokens; ``width``: the width :func:`init_state` would be called with
    (traced); ``tail``: that call's tail block's width where ``width`` is cut
    to the capacity (see :func:`specjax._src.engine.ops.prefill_chunk`).
    ``caches``: both caches after the chunks before ``start``. Returns the
    caches after this chunk, not yet rolled back, and a feature head's
    features at these positions (None for a draft model).
    """
    target, draft = pair_params.target, pair_params.draft
    target_cache, draft_cache = caches
    tokens = jax.lax.dynamic_slice_in_dim(prompt, start, chunk, axis=1)
    keep_target, keep_draft = length - 1, jnp.maximum(length - 2, 0)
    common = dict(tail=tail)
    if is_feature_head(draft.module):
        target_cache, features = prefill_chunk(
            target.module, target.params, target_cache, tokens, keep_target, start, width,
            hidden_layers=draft.module.feature_layers, hidden_fn=_features_fn(draft), **common)
        # _prefill_head's shifted prompt (its zero at the width's last position: the padding's).
        shifted = jax.lax.dynamic_slice_in_dim(prompt, start + 1, chunk, axis=1)
        draft_cache, _ = prefill_chunk(draft.module, draft.params, draft_cache, shifted, keep_draft, start, width,
                                       features=features, **common)
        return (target_cache, draft_cache), features
    target_cache, _ = prefill_chunk(target.module, target.params, target_cache, tokens, keep_target, start, width,
                                    **common)
    draft_cache, _ = prefill_chunk(draft.module, draft.params, draft_cache, tokens, keep_draft, start, width,
                                   **common)
    return (target_cache, draft_cache), None


def state_after_chunks(cfg: LoopConfig, pair_params: ModelPair, rule: AcceptanceRule,
                       policy: drafting_lib.DraftingPolicy, caches, features, prompt, length, start, max_new):
    """The state :func:`init_state` builds for one prompt, from its caches after the last chunk
    (``features``: that chunk's, for a feature head; ``start``: where it began). ``prompt [1, W]``."""
    target_cache, draft_cache = caches
    lengths = jnp.reshape(length, (1,))
    keep_draft = jnp.maximum(lengths - 2, 0)
    target_cache, draft_cache = target_cache.rollback(lengths - 1), draft_cache.rollback(keep_draft)
    pending = None
    if features is not None:
        pending = _pending_features(cfg, lengths, row_at(features, jnp.clip(keep_draft - start, 0, features.shape[1] - 1)))
    return _state_after_prefill(cfg, rule, policy, prompt, lengths, max_new, target_cache, draft_cache, pending)
