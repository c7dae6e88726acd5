"""The loop state before the first cycle: the prefills and the state built from them.

:func:`init_state` prefills a batch of prompts into both caches, each to its
invariant (:mod:`specjax._src.engine.loop`), and returns the
:class:`~specjax._src.engine.config.DecodeState` that ``decode``'s loop, the
slots engine's ``insert`` and any driver of :func:`~specjax._src.engine.cycle.run_cycles`
start from. Given the cycles' inputs it also commits each sequence's first
token, drawn from the target's logits at the prompt's last position, which
the prefill computes anyway (:func:`prefill_state`, then
:func:`draw_first_token`): no cycle is spent on it. A pair without a draft
(``draft=None``, ``generate``'s) prefills the target alone. The slots engine
prefills a long prompt one chunk at a time instead: :func:`empty_prefill_caches`,
then :func:`prefill_pair_chunk` per chunk, then :func:`state_after_chunks`,
which leave the state :func:`prefill_state` builds for that prompt.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from specjax._src.proposals import drafting as drafting_lib
from specjax._src.engine.config import DecodeState, LoopConfig, policy_slots
from specjax._src.engine.cycle import CycleInputs, draft_keep
from specjax._src.engine.ops import batched_init, prefill, prefill_chunk, row_at
from specjax._src.engine.plain import commit_target_token
from specjax._src.logits import sampling
from specjax._src.models.lm import KVCache
from specjax._src.models.feature_head import is_feature_head
from specjax._src.models.pairing import ModelPair
from specjax._src.rules.base import AcceptanceRule
from specjax._src.engine.stats import DecodeStats

__all__ = ["init_state", "prefill_state", "draw_first_token", "empty_prefill_caches", "prefill_pair_chunk",
           "state_after_chunks"]

Array = jax.Array

# ---------------------------------------------------------------------------
# The whole prompt at once
# ---------------------------------------------------------------------------


def init_state(
    cfg: LoopConfig, pair_params: ModelPair, rule: Optional[AcceptanceRule],
    policy: Optional[drafting_lib.DraftingPolicy], prompts: Array, prompt_lengths: Array, max_new: Array,
    inputs: Optional[CycleInputs] = None,
) -> DecodeState:
    """The loop state before the first cycle: both prefills, each cache to its invariant.

    With ``inputs``, each sequence's first token is drawn from the target's
    logits at its prompt's last position, which the prefill computes anyway
    (:func:`~specjax._src.engine.state.draw_first_token`): no cycle is spent on it. Without, the prefill
    keeps every prompt token but the last, and the first cycle computes it.

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
      inputs: the :class:`~specjax._src.engine.cycle.CycleInputs` the cycles
        will read (keys, sampling settings, EOS), or None.

    Returns:
      A :class:`~specjax._src.engine.config.DecodeState`: ``tokens [B, P + N +
      K + 1]`` with the prompts first (and the first tokens after them, with
      ``inputs``), the target cache holding every committed token but the
      last, the draft cache every one but the last two (a feature head's: see
      :mod:`specjax._src.engine.loop`), zero stats.
    """
    if inputs is None:
        return _prefilled(cfg, pair_params, rule, policy, prompts, prompt_lengths, max_new, first_token=False)[0]
    state, logits = _prefilled(cfg, pair_params, rule, policy, prompts, prompt_lengths, max_new, first_token=True)
    return draw_first_token(cfg, pair_params, inputs, state, logits)


def prefill_state(cfg: LoopConfig, pair_params: ModelPair, rule: Optional[AcceptanceRule],
                  policy: Optional[drafting_lib.DraftingPolicy], prompts: Array, prompt_lengths: Array,
                  max_new: Array) -> tuple[DecodeState, Array]:
    """:func:`init_state`'s prefills before the first token is drawn: ``(state,
    logits [B, V'])``, the target's raw logits at each prompt's last position
    and the state :func:`~specjax._src.engine.state.draw_first_token` reads (``num_committed = prompt_lengths``,
    the caches holding one entry more than their invariants ask)."""
    return _prefilled(cfg, pair_params, rule, policy, prompts, prompt_lengths, max_new, first_token=True)


def _prefilled(cfg: LoopConfig, pair_params: ModelPair, rule, policy, prompts, prompt_lengths, max_new, *,
               first_token: bool) -> tuple[DecodeState, Optional[Array]]:
    """Both prefills: the target keeps the prompt but its last ``1 - first_token`` tokens, the draft
    one fewer (a feature head: see :func:`_prefill_head`); the last position's logits with ``first_token``."""
    target, draft = pair_params.target, pair_params.draft
    keep_target = prompt_lengths - 1 + int(first_token)
    logits_at = prompt_lengths - 1 if first_token else None
    draft_features, draft_cache = None, None
    if draft is not None and is_feature_head(draft.module):
        done = prefill(target.module, target.params, prompts, keep_target, cfg.cache_length, logits_at=logits_at,
                       hidden_layers=draft.module.feature_layers, hidden_fn=_features_fn(draft))
        draft_cache, draft_features = _prefill_head(cfg, draft, prompts, keep_target, done.hidden)
    else:
        done = prefill(target.module, target.params, prompts, keep_target, cfg.cache_length, logits_at=logits_at)
        if draft is not None:
            draft_cache = prefill(draft.module, draft.params, prompts, jnp.maximum(keep_target - 1, 0),
                                  cfg.cache_length).cache
    state = _state_after_prefill(cfg, rule, policy, prompts, prompt_lengths, max_new, done.cache, draft_cache,
                                 draft_features)
    return state, done.logits


def draw_first_token(cfg: LoopConfig, pair_params: ModelPair, inputs: CycleInputs, state: DecodeState,
                     logits: Array) -> DecodeState:
    """Commits each sequence's first token, drawn from the target's raw
    ``logits [B, V']`` at its prompt's last position (:func:`prefill_state`'s),
    as a plain cycle would draw it (:func:`specjax._src.engine.plain.commit_target_token`:
    processors, sampling settings, EOS, log-probabilities), with the uniform
    of ``fold_in(key, 0)``: the first cycle is then step 1. Leaves both
    caches at their invariants, and the rule's and policy's states and the
    statistics as they were (nothing was drafted; the statistics count
    cycles, and the token is in ``DecodeOutput.lengths`` but not in
    ``DecodeStats.tokens``)."""
    seq_keys = inputs.keys
    uniform = None
    if not cfg.greedy:
        uniform = jax.vmap(lambda k: sampling.uniform_open(jax.random.fold_in(k, 0), ()))(seq_keys)
    before = state
    state, _ = commit_target_token(cfg, pair_params.vocab_size, inputs, state, logits, uniform)
    nc = state.num_committed
    draft_cache = None if state.draft_cache is None else state.draft_cache.rollback(draft_keep(before, nc))
    # The statistics count cycles; this token is the prefill's.
    return state.replace(target_cache=state.target_cache.rollback(nc - 1), draft_cache=draft_cache,
                         stats=before.stats)


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


def _prefill_head(cfg: LoopConfig, head, prompts, kept, features) -> tuple[KVCache, Array]:
    """A feature head's prefill, for a target cache holding ``kept [B]`` positions:
    head position ``i`` reads the target's feature ``f_i`` and the token
    ``x_{i+1}``. Keeps positions ``0 .. kept - 2`` and leaves ``f_{kept-1}``
    pending (where the target kept nothing, a one-token prompt before its
    first token, the first draft reads zeros: a poor guess that costs speed,
    never correctness). Returns ``(cache, pending [B, K + 1, H])``."""
    batch = prompts.shape[0]
    shifted = jnp.concatenate([prompts[:, 1:], jnp.zeros((batch, 1), prompts.dtype)], axis=1)
    keep = jnp.maximum(kept - 1, 0)
    cache = prefill(head.module, head.params, shifted, keep, cfg.cache_length, features=features).cache
    return cache, _pending_features(cfg, kept >= 1, row_at(features, keep))


def _pending_features(cfg: LoopConfig, valid, last) -> Array:
    """``[B, K + 1, H]``: ``last [B, H]`` (the target's feature at the head's first pending
    position) first, zeros where not ``valid``."""
    last = jnp.where(valid[:, None], last, 0.0)
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
    """The prompt positions ``[start, start + chunk)`` of :func:`prefill_state`'s prefills of one prompt.

    ``prompt [1, P]``: the prompt padded with zeros (``P >= start + chunk + 1``:
    a feature head reads the token after each position); ``length``: its
    tokens; ``width``: the width :func:`prefill_state` would be called with
    (traced); ``tail``: that call's tail block's width where ``width`` is cut
    to the capacity (see :func:`specjax._src.engine.ops.prefill_chunk`).
    ``caches``: both caches after the chunks before ``start``. Returns
    ``(caches, features, logits)``: the caches after this chunk, not yet
    rolled back, a feature head's features at these positions (None for a
    draft model), and the target's logits at the prompt's last position
    (``[1, V']``, zeros unless this chunk holds it).
    """
    target, draft = pair_params.target, pair_params.draft
    target_cache, draft_cache = caches
    tokens = jax.lax.dynamic_slice_in_dim(prompt, start, chunk, axis=1)
    lengths = jnp.reshape(length, (1,))
    keep_target, keep_draft = lengths, jnp.maximum(lengths - 1, 0)
    common = dict(tail=tail)
    if is_feature_head(draft.module):
        done = prefill_chunk(target.module, target.params, target_cache, tokens, keep_target, start, width,
                             hidden_layers=draft.module.feature_layers, hidden_fn=_features_fn(draft),
                             logits_at=lengths - 1, **common)
        # _prefill_head's shifted prompt (its zero at the width's last position: the padding's).
        shifted = jax.lax.dynamic_slice_in_dim(prompt, start + 1, chunk, axis=1)
        draft_cache = prefill_chunk(draft.module, draft.params, draft_cache, shifted, keep_draft, start, width,
                                    features=done.hidden, **common).cache
        return (done.cache, draft_cache), done.hidden, done.logits
    done = prefill_chunk(target.module, target.params, target_cache, tokens, keep_target, start, width,
                         logits_at=lengths - 1, **common)
    draft_cache = prefill_chunk(draft.module, draft.params, draft_cache, tokens, keep_draft, start, width,
                                **common).cache
    return (done.cache, draft_cache), None, done.logits


def state_after_chunks(cfg: LoopConfig, pair_params: ModelPair, rule: AcceptanceRule,
                       policy: drafting_lib.DraftingPolicy, caches, features, prompt, length, start, max_new):
    """The state :func:`prefill_state` builds for one prompt, from its caches after the last chunk
    (``features``: that chunk's, for a feature head; ``start``: where it began). ``prompt [1, W]``."""
    target_cache, draft_cache = caches
    lengths = jnp.reshape(length, (1,))
    keep_draft = jnp.maximum(lengths - 1, 0)
    target_cache, draft_cache = target_cache.rollback(lengths), draft_cache.rollback(keep_draft)
    pending = None
    if features is not None:
        at = jnp.clip(keep_draft - start, 0, features.shape[1] - 1)
        pending = _pending_features(cfg, lengths >= 1, row_at(features, at))
    return _state_after_prefill(cfg, rule, policy, prompt, lengths, max_new, target_cache, draft_cache, pending)
