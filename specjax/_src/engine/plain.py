"""A cycle that drafts nothing, and the draft's catching up after it.

:func:`drafting.auto <specjax._src.proposals.drafting.auto>` may choose a plain
target step inside a drafting program, for a chain (:mod:`specjax._src.engine.chain`)
or a dynamic tree (:mod:`specjax._src.engine.tree`). Such a cycle skips the
draft's forwards: a draft model's cache falls behind and catches up in one
first step of up to ``K + 2`` tokens (:func:`first_draft_step`); a feature
head's pending target features accumulate (:func:`pending_after_skip`) and its
first step reads them all. A sequence may fall at most ``K`` tokens behind
(:func:`draft_can_wait`), so a long plain run still runs the draft every ``K`` cycles.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from specjax._src.engine.config import DecodeState, LoopConfig
from specjax._src.engine.cycle import (
    Committed,
    CycleInputs,
    commit_block,
    committed_block,
    cycle_history,
    cycle_logprobs,
    greedy_rows,
    live_settings,
    next_state,
    nonfinite_codes,
)
from specjax._src.engine.ops import cond_in_place, gather, row_at, warp, where_b
from specjax._src.engine.stats import record_cycle
from specjax._src.logits import processors as processors_lib
from specjax._src.logits import sampling
from specjax._src.models.feature_head import is_feature_head
from specjax._src.models.lm import KVCache
from specjax._src.models.pairing import ModelPair

Array = jax.Array


def plain_cycle(cfg: LoopConfig, pair_params: ModelPair, inputs: CycleInputs, state: DecodeState,
                emit_uniform, update_policy: Callable[[Array], object]) -> DecodeState:
    """A cycle that drafts nothing: one target forward over each sequence's
    last token, its token emitted as a drafting cycle would emit its bonus
    token after no drafts (:func:`commit_target_token`), the draft skipped
    (its cache waits; a head's features are kept pending), the rule's state
    unchanged (nothing judged). ``update_policy(live [B])`` gives the policy's
    state after the cycle (each cycle kind tells its policy what a plain step
    showed). Returns the state after the cycle."""
    k_max = cfg.num_draft
    head = pair_params.draft.module
    head_layers = head.feature_layers if is_feature_head(head) else ()
    last = gather(state.tokens, state.num_committed - 1)
    out = pair_params.target.module.apply(pair_params.target.params, last[:, None], state.target_cache,
                                          hidden_layers=head_layers)
    after, live = commit_target_token(cfg, pair_params.vocab_size, inputs, state, out.logits[:, 0], emit_uniform)
    features = None
    if head_layers:
        hidden = jnp.concatenate(out.hidden[len(out.hidden) - len(head_layers):], axis=-1)
        own = head.target_features(pair_params.draft.params, hidden)  # [B, 1, H]
        features = pending_after_skip(state, jnp.pad(own, [(0, 0), (0, k_max), (0, 0)]))
    return after.replace(target_cache=out.cache.rollback(after.num_committed - 1),
                         policy_state=where_b(live, update_policy(live), state.policy_state),
                         draft_features=features)


def commit_target_token(cfg: LoopConfig, vocab: int, inputs: CycleInputs, state: DecodeState, raw: Array,
                        emit_uniform) -> tuple[DecodeState, Array]:
    """Commits one token per live sequence drawn from the target's ``raw [B, V']``
    logits at its last committed token, as a drafting cycle emits its bonus
    token after no drafts: the logits processors, greedy rows, temperature,
    top-k and top-p, ``emit_uniform [B]``, the non-finite check, EOS and
    ``max_new_tokens``, the log-probabilities, counted as a cycle of no drafts.

    The caches, the rule's and the policy's states are left as they were (the
    caller sets them: :func:`plain_cycle` after its forward, the prefill's
    first token, :func:`specjax._src.engine.state.draw_first_token`). Returns
    ``(state, live [B])``: the state one step on, and the rows that committed.
    """
    prompt_lengths, max_new, eos_ids, _, temperature, top_p, rows = inputs
    batch, k_max = state.num_committed.shape[0], cfg.num_draft
    if rows is not None:
        rows, top_p = live_settings(rows, top_p, ~state.done)
    hist = cycle_history(rows, state, prompt_lengths, eos_ids, vocab)
    raw = raw[:, None, :vocab]  # [B, 1, V]
    no_drafts = jnp.zeros((batch, k_max), jnp.int32)
    processed = raw if hist is None else processors_lib.process(rows.processors, rows.controls, hist, raw,
                                                                no_drafts, 0)
    target_logits = warp(cfg, processed, temperature, top_p, rows)
    if cfg.greedy:
        emitted = sampling.argmax(target_logits[:, 0])
    else:
        emitted = sampling.sample_categorical(jax.nn.softmax(target_logits[:, 0], axis=-1), emit_uniform)
        if greedy_rows(cfg, rows) is not None:
            emitted = jnp.where(rows.greedy, sampling.argmax(target_logits[:, 0]), emitted)
    new_bad, bad = nonfinite_codes(state, jnp.zeros((batch,), bool), sampling.nonfinite_rows(raw)[:, 0])
    live = ~state.done & (new_bad == 0)
    none = jnp.zeros((batch,), jnp.int32)
    tokens, n_commit, finished = commit_block(state, no_drafts, none, emitted, live, prompt_lengths, max_new, eos_ids)
    new_nc = state.num_committed + n_commit
    committed = Committed(tokens=tokens, num_committed=new_nc, num_new=n_commit,
                          done=state.done | (new_bad > 0) | finished, target_cache=state.target_cache,
                          draft_cache=state.draft_cache)
    logprobs = None
    if state.logprobs is not None:
        padded = jnp.pad(target_logits, [(0, 0), (0, k_max), (0, 0)])
        logprobs = cycle_logprobs(state, padded, committed_block(no_drafts, none, emitted), rows)
    unused = jnp.zeros((batch, k_max), bool)
    stats = record_cycle(state.stats, live=live, valid=unused, num_accepted=none, num_committed=n_commit,
                         paths=no_drafts, draft_forwards=jnp.int32(0), copied=unused, verified=jnp.int32(1))
    after = next_state(state, committed, bad=bad, rule_state=state.rule_state, policy_state=state.policy_state,
                       stats=stats, draft_features=state.draft_features, logprobs=logprobs)
    return after, live


def draft_lag(state: DecodeState) -> Array:
    """``[B]`` committed tokens a draft model's cache is behind its invariant
    (``num_committed - 2`` entries): 0 unless cycles skipped its forwards."""
    return jnp.maximum(state.num_committed - 2, 0) - state.draft_cache.lengths


def draft_can_wait(cfg: LoopConfig, pair_params: ModelPair, state: DecodeState) -> Array:
    """Scalar bool: every live sequence can skip this cycle's draft forwards
    and still be caught up by one first draft step later. A draft model
    catches up ``K`` tokens (:func:`first_draft_step`); a feature head reads
    at most ``K + 1`` pending target features (:func:`pending_after_skip`)."""
    live = ~state.done
    if is_feature_head(pair_params.draft.module):
        after = state.num_committed - state.draft_cache.lengths  # pending features after one more token
        return jnp.all(~live | (after <= cfg.num_draft + 1))
    return jnp.all(~live | (draft_lag(state) + 1 <= cfg.num_draft))


def first_draft_step(cfg: LoopConfig, module, params, vocab: int, state: DecodeState) -> tuple[Array, KVCache]:
    """A draft model's first draft step where earlier cycles may have skipped
    it: a ``K + 2``-token forward from its cache's end when some live sequence
    lags (:func:`catch_up_logits`), else the usual two-token one. Returns
    the raw logits ``[B, V]`` at the last committed token and the draft cache
    holding every committed token."""
    batch = state.num_committed.shape[0]

    def catch_up(width):
        return lambda carry: catch_up_logits(module, params, vocab, state.replace(draft_cache=carry[1]), width)

    return cond_in_place(jnp.any(~state.done & (draft_lag(state) > 0)), catch_up(cfg.num_draft + 2), catch_up(2),
                         (jnp.zeros((batch, vocab), jnp.float32), state.draft_cache))


def catch_up_logits(module, params, vocab: int, state: DecodeState, width: int) -> tuple[Array, KVCache]:
    """The first draft step of a draft model whose cache holds ``L <=
    num_committed - 2`` entries: one forward over the ``width`` tokens from
    position ``L``, read at the last committed token. With ``width = 2`` and
    no lag it is :func:`specjax._src.engine.cycle.first_draft_logits`."""
    nc, tokens, start = state.num_committed, state.tokens, state.draft_cache.lengths
    index = jnp.minimum(start[:, None] + jnp.arange(width)[None, :], tokens.shape[1] - 1)
    block, row = jnp.take_along_axis(tokens, index, axis=1), jnp.clip(nc - 1 - start, 0, width - 1)
    if getattr(module, "supports_logits_at", False):
        raw0 = module.apply(params, block, state.draft_cache, logits_at=row)
        return raw0.logits[:, 0, :vocab], raw0.cache.rollback(nc)
    out = module.apply(params, block, state.draft_cache)
    return row_at(out.logits[..., :vocab], row), out.cache.rollback(nc)


def pending_after_skip(state: DecodeState, verified_features: Array) -> Array:
    """A feature head's pending target features after a cycle that skipped
    its forwards: the ones still pending (``f_m .. f_{nc-2}``), then the
    verification's (``f_{nc-1}``, its only row). ``[B, K + 1, H]``."""
    count = state.num_committed - 1 - state.draft_cache.lengths
    slots = jnp.arange(verified_features.shape[1])
    shifted = jnp.take_along_axis(verified_features, jnp.maximum(slots[None, :] - count[:, None], 0)[..., None],
                                  axis=1)
    return jnp.where((slots[None, :] < count[:, None])[..., None], state.draft_features, shifted)
