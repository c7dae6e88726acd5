"""One draft-verify cycle of ``decode``, as five small pure functions.

:func:`_decode_cycle` is the whole cycle (:data:`CHAIN`, a
:class:`specjax._src.engine.cycle.Cycle`); each step is one function of
arrays, traced inside the ``while_loop`` of :mod:`specjax._src.engine.loop`::

    uniforms  = _cycle_uniforms(...)  # the cycle's randomness, one draw per sequence
    drafts    = draft_chain(...)      # up to K draft tokens, one draft forward each (some copied
                                      # from the context with decode(lookup=...))
    # _judge: the rest, at the narrowest verification width that holds the drafts
    verified  = _verify(...)          # one target forward over [last, d_1 .. d_K]
    accepted  = _accept(...)          # the rule's verdict, the accepted run, the emitted token
    committed = _commit(...)          # tokens written, EOS / max_new_tokens, caches rolled back
    logprobs  = _logprobs(...)        # with state.logprobs (the slots engine's): the tokens' log-probs
    ...       = _record(...)          # rule and policy states, stats, diagnostics

The loop state (:class:`specjax._src.engine.config.DecodeState`, built by
:func:`specjax._src.engine.state.init_state`) and its cache invariants are described in
:mod:`specjax._src.engine.loop`'s docstring, the reader's map of the loop.
What the cycle shares with the tree cycle (the first draft step, the commit
of a block, the state after a cycle) is in :mod:`specjax._src.engine.cycle`;
the device helpers it shares with ``generate`` are in :mod:`specjax._src.engine.ops`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from specjax._src.proposals import drafting as drafting_lib
from specjax._src.logits import processors as processors_lib
from specjax._src.logits import sampling
from specjax._src.engine.config import DecodeState, LoopConfig
from specjax._src.engine.cycle import (
    Committed,
    Cycle,
    CycleInputs,
    commit_block,
    committed_block,
    cycle_history,
    cycle_logprobs,
    draft_keep,
    first_draft_logits,
    first_head_logits,
    greedy_rows,
    live_diagnostics,
    live_settings,
    next_state,
    nonfinite_codes,
    per_row_rule,
    with_greedy_rows,
)
from specjax._src.engine.ops import cond_in_place, gather, narrowest_width, row_at, switch_in_place, warp, where_b
from specjax._src.engine.plain import draft_can_wait, first_draft_step, pending_after_skip, plain_cycle
from specjax._src.models.lm import KVCache, LMOutput
from specjax._src.proposals.lookup import lookup_drafts
from specjax._src.models.feature_head import is_feature_head
from specjax._src.models.pairing import ModelPair
from specjax._src.rules.base import AcceptanceRule, Verdict, VerifyInputs
from specjax._src.engine.stats import record_cycle

Array = jax.Array
_POINT_MASS_FLOOR = -1e9  # a copied draft's logits off its token

# ---------------------------------------------------------------------------
# The cycle
# ---------------------------------------------------------------------------


def _decode_cycle(
    cfg: LoopConfig, pair_params: ModelPair, rule: AcceptanceRule, policy: drafting_lib.DraftingPolicy,
    inputs: CycleInputs, state: DecodeState,
):
    """One draft-verify cycle over a chain (:data:`CHAIN`'s ``run``). Returns
    ``(state, diagnostics or None)``.

    ``inputs.max_new[B]``: each sequence's ``max_new_tokens`` (traced, so it
    does not shape the program; ``cfg.max_new_tokens`` is only the buffer's bucket).

    ``inputs.rows``: per-sequence settings (:class:`specjax._src.logits.processors.RowSettings`,
    the slots engine's): then ``temperature`` and ``top_p`` are ``[B]``,
    ``eos_ids`` may be ``[B, E]`` and ``state.step`` ``[B]``; greedy rows, top-k,
    the draft cap and the logits processors are per sequence. ``None``: the
    settings are the call's, one for every sequence.
    """
    if policy.may_draft_none and cfg.diagnostics is None:
        # A batch that drafts nothing runs a plain target step: one token verified, none of a
        # drafting cycle's work over K slots (so that choosing no drafts costs what generate does).
        new_state = cond_in_place(_plain(cfg, pair_params, policy, state, inputs.rows),
                                  lambda s: _plain_cycle(cfg, pair_params, policy, inputs, s),
                                  lambda s: _drafting_cycle(cfg, pair_params, rule, policy, inputs, s)[0], state)
        return new_state, None
    return _drafting_cycle(cfg, pair_params, rule, policy, inputs, state)


def _drafting_cycle(
    cfg: LoopConfig, pair_params: ModelPair, rule: AcceptanceRule, policy: drafting_lib.DraftingPolicy,
    inputs: CycleInputs, state: DecodeState,
):
    """:func:`_decode_cycle`'s draft, then :func:`_judge` over the drafted slots.

    With several ``cfg.verify_widths`` (a policy whose drafts vary in length),
    the judging runs at the narrowest width that holds every live sequence's
    drafts, as if ``K`` were that width less one: the verification, the rule's
    verdicts, the residuals and the non-finite checks then read only the rows a
    cycle drafted. Each of those passes reads ``[B, width, V]`` logits, so a
    cycle that drafts one token under a cap of three costs what a fixed ``K = 1``
    cycle does, not a fixed ``K = 3`` cycle's vocabulary-wide work."""
    prompt_lengths, max_new, eos_ids, seq_keys, temperature, top_p, rows = inputs
    batch = state.num_committed.shape[0]
    if rows is not None:
        rows, top_p = live_settings(rows, top_p, ~state.done)
    inputs = inputs._replace(top_p=top_p, rows=rows)
    hist = cycle_history(rows, state, prompt_lengths, eos_ids, pair_params.vocab_size)
    uniforms, draft_uniforms, emit_uniform = _cycle_uniforms(cfg, seq_keys, state.step, batch)
    drafts, draft_cache = draft_chain(cfg, pair_params, policy, state, draft_uniforms, temperature, top_p, rows, hist)
    judge = functools.partial(_judge, pair_params, rule, policy, inputs, hist, drafts, uniforms, emit_uniform)
    # The draft's cache rides in the carry, so that no branch copies it (switch_in_place).
    state = state.replace(draft_cache=draft_cache)
    widths = cfg.verify_widths
    if widths is None or len(widths) == 1 or cfg.diagnostics is not None:
        return judge(cfg, state)
    branches = [lambda s, w=w: judge(_narrowed(cfg, w), s)[0] for w in widths]
    return switch_in_place(_width_index(widths, drafts.valid, ~state.done), branches, state), None


def _width_index(widths: tuple[int, ...], valid: Array, live: Array) -> Array:
    """The index in ``widths`` of the narrowest that holds every live sequence's last token and
    valid drafts (the widest where none does)."""
    return narrowest_width(widths, 1 + jnp.max(jnp.where(live, valid.sum(1), 0)))


def _narrowed(cfg: LoopConfig, width: int) -> LoopConfig:
    """``cfg`` for a cycle judged at ``width`` tokens: ``K = width - 1`` (a
    one-token block keeps one slot, verified at width 1 and never valid)."""
    return cfg._replace(num_draft=max(width - 1, 1), verify_widths=None if width > 1 else (1,))


def _judge(
    pair_params: ModelPair, rule: AcceptanceRule, policy: drafting_lib.DraftingPolicy, inputs: CycleInputs, hist,
    drafts: _Drafts, uniforms, emit_uniform, cfg: LoopConfig, state: DecodeState,
):
    """Verify, accept, commit and record the first ``cfg.num_draft`` of
    ``drafts``' slots (every valid one lies among them); ``state.draft_cache``
    is the draft's cache after drafting. Returns ``(state, diagnostics or
    None)`` with the state's per-slot arrays at the drafts' full ``K``."""
    prompt_lengths, max_new, eos_ids, _, temperature, top_p, rows = inputs
    k_full, k = drafts.tokens.shape[1], cfg.num_draft
    judged = _first_slots(drafts, k)
    if uniforms is not None:
        uniforms = uniforms[:, :k]
    verified = _verify(cfg, pair_params, rule, state, judged, uniforms, temperature, top_p, rows, hist)
    accepted = _accept(cfg, rule, state, judged, verified, emit_uniform, rows)
    committed = _commit(
        cfg, state, judged, accepted, verified.cache, state.draft_cache, prompt_lengths, max_new, eos_ids
    )
    logprobs = None if state.logprobs is None else _logprobs(state, judged, verified, accepted, rows)
    rule_state, policy_state, stats, diag = _record(cfg, rule, policy, state, drafts, judged, verified, accepted,
                                                    committed, rows)
    if verified.features is not None:  # a feature head's pending features keep K + 1 rows
        verified = verified._replace(features=_widen(verified.features, k_full + 1))
    new_state = next_state(state, committed, bad=accepted.bad, rule_state=rule_state, policy_state=policy_state,
                           stats=stats, draft_features=_next_features(state, judged, verified), logprobs=logprobs)
    return new_state, diag


def _first_slots(drafts: _Drafts, k: int) -> _Drafts:
    """``drafts`` cut to their first ``k`` slots."""
    if k == drafts.tokens.shape[1]:
        return drafts
    cut = lambda x: x[:, :k]  # noqa: E731
    return drafts._replace(tokens=cut(drafts.tokens), logits=cut(drafts.logits), probs=cut(drafts.probs),
                           valid=cut(drafts.valid), entropies=cut(drafts.entropies),
                           token_probs=cut(drafts.token_probs), bad=cut(drafts.bad), copied=cut(drafts.copied))


def _widen(x: Array, width: int) -> Array:
    """``x [B, T, ...]`` padded with zeros to ``[B, width, ...]``."""
    return jnp.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _budgets(cfg: LoopConfig, policy: drafting_lib.DraftingPolicy, state: DecodeState, rows) -> Array:
    """``[B]`` int32: the policy's plan for the batch, within ``0 .. K`` and each row's draft cap."""
    budget = jnp.clip(jnp.asarray(policy.plan(state.policy_state, ~state.done, cfg.num_draft), jnp.int32), 0,
                      cfg.num_draft)
    if rows is not None and rows.draft_cap is not None:
        budget = jnp.minimum(budget, rows.draft_cap)
    return budget


def _plain(cfg: LoopConfig, pair_params: ModelPair, policy, state: DecodeState, rows) -> Array:
    """Scalar bool: no live sequence drafts this cycle, and the draft can wait
    (:func:`specjax._src.engine.plain.draft_can_wait`)."""
    drafting_rows = ~state.done & (_budgets(cfg, policy, state, rows) > 0)
    return ~drafting_rows.any() & draft_can_wait(cfg, pair_params, state)


def _plain_cycle(cfg: LoopConfig, pair_params: ModelPair, policy: drafting_lib.DraftingPolicy, inputs: CycleInputs,
                 state: DecodeState) -> DecodeState:
    """A chain's plain step (:func:`specjax._src.engine.plain.plain_cycle`), with the uniform a
    drafting cycle emits its bonus token with; the policy learns that nothing was drafted."""
    batch, k_max = state.num_committed.shape[0], cfg.num_draft
    _, _, emit_uniform = _cycle_uniforms(cfg, inputs.keys, state.step, batch)
    none, unused = jnp.zeros((batch,), jnp.int32), jnp.zeros((batch, k_max), bool)
    outcome = drafting_lib.DraftOutcome(num_drafted=none, num_accepted=none, valid=unused,
                                        entropies=jnp.zeros((batch, k_max), jnp.float32),
                                        token_probs=jnp.zeros((batch, k_max), jnp.float32),
                                        first_acceptance=jnp.full((batch,), -1.0, jnp.float32),
                                        copy_acceptance=jnp.full((batch,), -1.0, jnp.float32))
    return plain_cycle(cfg, pair_params, inputs, state, emit_uniform,
                       lambda live: jax.vmap(policy.update)(state.policy_state, outcome))


def _next_features(state: DecodeState, drafts: _Drafts, verified: _Verified):
    """A feature head's pending features for the next cycle: the verification's,
    or, where this cycle skipped the head, those appended to the pending ones."""
    if verified.features is None:
        return None
    return jax.lax.cond(drafts.forwards > 0, lambda: verified.features,
                        lambda: pending_after_skip(state, verified.features))


def _cycle_uniforms(cfg: LoopConfig, seq_keys, step, batch: int):
    """All of a cycle's randomness in one draw per sequence (from
    ``fold_in(seq_key, step)``): ``(uniforms [B, K], draft_uniforms [B, K],
    emit_uniform [B])``, the K acceptance uniforms, one uniform per draft sample
    and one for the emitted token (inverse-CDF sampling; a Gumbel-max draw
    would need V of them). Greedy draws nothing. ``step``: a scalar, or one
    count per sequence (the slots engine's, where sequences start apart)."""
    k_max = cfg.num_draft
    if cfg.greedy:
        return jnp.zeros((batch, k_max), jnp.float32), None, None  # rules ignore them when greedy
    steps = jnp.broadcast_to(step, (batch,))
    u = jax.vmap(lambda k, s: sampling.uniform_open(jax.random.fold_in(k, s), (2 * k_max + 1,)))(seq_keys, steps)
    return u[:, :k_max], u[:, k_max : 2 * k_max], u[:, 2 * k_max]


# ---------------------------------------------------------------------------
# 1. draft
# ---------------------------------------------------------------------------


class _Drafts(NamedTuple):
    tokens: Array  # [B, K]
    logits: Array  # [B, K, V] warped (raw when greedy)
    probs: Array  # [B, K, V] softmax(logits)
    valid: Array  # [B, K]
    entropies: Array  # [B, K]
    token_probs: Array  # [B, K]
    bad: Array  # [B, K] the draft logits of that slot were non-finite
    forwards: Array  # scalar int32
    copied: Array  # [B, K] the slot's token was copied from the context (a point mass)
    # With a lookup only (None otherwise: without copies slot 0 is the drafter's own):
    own_token0: Optional[Array] = None  # [B] the drafter's own token at slot 0, before any copy took the slot
    own_probs0: Optional[Array] = None  # [B, V] the drafter's own distribution at slot 0
    copy_token0: Optional[Array] = None  # [B] the lookup's proposal for slot 0, taken or not
    copy_valid0: Optional[Array] = None  # [B] bool: the lookup proposed one


def draft_chain(
    cfg: LoopConfig, pair_params: ModelPair, policy: drafting_lib.DraftingPolicy, state: DecodeState, draft_uniforms,
    temperature, top_p, rows=None, hist=None,
) -> tuple[_Drafts, KVCache]:
    """Draft up to K tokens per sequence: the policy's ``budget``, cut short
    where its ``proceed`` says stop, one draft forward per token (the first is
    :func:`specjax._src.engine.cycle.first_draft_logits`). With ``cfg.lookup``, a slot that the context
    lookup fills (:func:`specjax._src.proposals.lookup.lookup_drafts`) takes the copied
    token instead, and the draft reads it for the next slot; with a feature
    head, once every active sequence's remaining slots are copies, the
    forwards stop (no slot reads them, and the head's cache is rewritten
    from the target's features next cycle). Returns the drafts and the draft
    cache after them (rolled back by :func:`_commit`). ``rows.draft_cap``
    lowers each sequence's budget (0: no drafts, the cycle emits the target's
    token alone)."""
    # The policy plans the batch at once (auto weighs the verification's shared width); 0: no drafts.
    k_max = cfg.num_draft
    budget = _budgets(cfg, policy, state, rows)
    active0 = ~state.done & (budget > 0)
    def run(state):
        return _draft_tokens(cfg, pair_params, policy, state, draft_uniforms, temperature, top_p, rows, hist,
                             budget, active0)

    if not policy.may_draft_none:
        return run(state)
    # Nothing to draft anywhere: skip the draft's forwards while its cache can still catch up later.
    batch, vocab = state.num_committed.shape[0], pair_params.vocab_size
    skip = ~active0.any() & draft_can_wait(cfg, pair_params, state)
    nothing = (_no_drafts(batch, k_max, vocab, cfg.lookup is not None)._replace(forwards=jnp.int32(0)), state.draft_cache)
    return cond_in_place(skip, lambda carry: carry, lambda carry: run(state.replace(draft_cache=carry[1])),
                         nothing)


def _draft_tokens(
    cfg: LoopConfig, pair_params: ModelPair, policy: drafting_lib.DraftingPolicy, state: DecodeState, draft_uniforms,
    temperature, top_p, rows, hist, budget, active0,
) -> tuple[_Drafts, KVCache]:
    """:func:`draft_chain`'s drafting: the first draft step, then one forward per further token."""
    module, params = pair_params.draft.module, pair_params.draft.params
    vocab, k_max = pair_params.vocab_size, cfg.num_draft
    batch = state.num_committed.shape[0]
    if is_feature_head(module):
        raw0, feature, cache, _ = first_head_logits(cfg, module, params, vocab, state)
    elif policy.may_draft_none:  # earlier cycles may have skipped the draft: catch up in one forward
        raw0, cache = first_draft_step(cfg, module, params, vocab, state)
        feature = jnp.zeros((batch, 0))
    else:
        (raw0, cache), feature = first_draft_logits(module, params, vocab, state), jnp.zeros((batch, 0))
    copied, bufs = None, _no_drafts(batch, k_max, vocab, cfg.lookup is not None)
    if cfg.lookup is not None:
        copy_tokens, copy_valid = lookup_drafts(state.tokens, state.num_committed, k_max, cfg.lookup)
        copies = jax.vmap(policy.copies, axis_size=batch)(state.policy_state)  # [B]: the policy may decline
        copied = (copy_tokens, copy_valid & jnp.asarray(copies, bool)[:, None])
        # Slot 0's proposal, taken or not: the verification tells how likely it was to be accepted.
        bufs = bufs._replace(copy_token0=copy_tokens[:, 0], copy_valid0=copy_valid[:, 0] & active0)
    slot = functools.partial(
        _draft_slot, cfg, policy, state.policy_state, budget, draft_uniforms, temperature, top_p, copied,
        rows=rows, hist=hist,
    )
    active, bufs = slot(0, raw0, active0, bufs)
    # copied_rest[b, j]: slots j.. are all copies, so no head forward from slot j on is read. (A head's
    # cache is rewritten from the target's features next cycle; a draft model keeps the entries these
    # forwards write, so it runs them all.)
    copied_rest = None
    if copied is not None and is_feature_head(module):
        copied_rest = jnp.flip(jnp.cumprod(jnp.flip(copied[1], 1), 1), 1).astype(bool)

    def cond(carry):
        j, active, *_ = carry
        if copied_rest is None:
            return (j < k_max) & active.any()
        rest = jax.lax.dynamic_index_in_dim(copied_rest, jnp.minimum(j, k_max - 1), axis=1, keepdims=False)
        return (j < k_max) & (active & ~rest).any()

    def body(carry):
        j, active, cache, feature, bufs = carry
        prev = jax.lax.dynamic_index_in_dim(bufs.tokens, j - 1, axis=1, keepdims=True)
        if is_feature_head(module):  # EAGLE: the head's own predicted feature stands in for the target's
            out = module.apply(params, prev, cache, features=feature[:, None])
            feature = out.hidden[0][:, 0]
        else:
            out = module.apply(params, prev, cache)
        active, bufs = slot(j, out.logits[:, 0, :vocab], active, bufs)
        new_cache = out.cache if cfg.layout is None else cfg.layout.constrain_cache(out.cache, "draft")
        return j + 1, active, new_cache, feature, bufs._replace(forwards=bufs.forwards + 1)

    j, active, cache, _, bufs = jax.lax.while_loop(cond, body, (jnp.int32(1), active, cache, feature, bufs))
    if copied_rest is not None:  # every active sequence copies the rest: fill those slots without forwards
        no_logits = jnp.zeros((batch, vocab), jnp.float32)

        def copy_slot(carry):
            j, active, bufs = carry
            return (j + 1,) + slot(j, no_logits, active, bufs)

        _, _, bufs = jax.lax.while_loop(lambda c: (c[0] < k_max) & c[1].any(), copy_slot, (j, active, bufs))
    return bufs, cache


def _draft_slot(
    cfg: LoopConfig, policy: drafting_lib.DraftingPolicy, policy_state, budget, draft_uniforms, temperature, top_p,
    copied, j, raw: Array, active: Array, bufs: _Drafts, *, rows=None, hist=None,
) -> tuple[Array, _Drafts]:
    """Draft slot ``j`` from the draft's raw logits ``[B, V]``: process (with
    ``rows.controls``), warp, sample (argmax when greedy), write the slot into
    ``bufs`` and ask the policy whether to go on. ``copied``: ``None``, or the
    lookup's ``(tokens [B, K], valid [B, K])``, whose valid slots replace the
    draft's sample by a point mass on the copied token. Returns ``(active for
    slot j + 1, bufs)``."""
    batch = raw.shape[0]
    unprocessed = raw
    if hist is not None:  # the draft sees the target's processing: same tokens before the slot
        raw = processors_lib.process(rows.processors, rows.controls, hist, raw[:, None], bufs.tokens, j)[:, 0]
    logits = warp(cfg, raw, temperature, top_p, rows)
    probs = jax.nn.softmax(logits, axis=-1)
    if cfg.greedy:
        tok = sampling.argmax(raw)
    else:
        u = jax.lax.dynamic_index_in_dim(draft_uniforms, j, axis=1, keepdims=False)
        tok = sampling.sample_categorical(probs, u)
        if rows is not None and rows.greedy is not None:
            tok = jnp.where(rows.greedy, sampling.argmax(raw), tok)
    own = {"own_token0": tok, "own_probs0": probs} if copied is not None and isinstance(j, int) and j == 0 else {}
    is_copy = jnp.zeros((batch,), bool)
    if copied is not None:
        copy_tok, copy_ok = (jax.lax.dynamic_index_in_dim(x, j, axis=1, keepdims=False) for x in copied)
        is_copy = copy_ok
        point = jax.nn.one_hot(copy_tok, probs.shape[-1], dtype=probs.dtype)
        tok = jnp.where(is_copy, copy_tok, tok)
        probs = jnp.where(is_copy[:, None], point, probs)
        # Finite, so that rules computing log q or KL terms stay finite; exp() of it is exactly 0.
        logits = jnp.where(is_copy[:, None], jnp.where(point > 0, 0.0, _POINT_MASS_FLOOR), logits)
    tok_p = jnp.take_along_axis(probs, tok[:, None], axis=-1)[:, 0]
    ent = sampling.entropy(probs)
    step = drafting_lib.DraftStep(
        position=jnp.full((batch,), j, jnp.int32), token=tok, probs=probs, token_prob=tok_p, entropy=ent
    )
    go = jax.vmap(policy.proceed)(policy_state, step)
    bufs = _Drafts(
        tokens=bufs.tokens.at[:, j].set(tok),
        logits=bufs.logits.at[:, j].set(logits),
        probs=bufs.probs.at[:, j].set(probs),
        valid=bufs.valid.at[:, j].set(active),
        entropies=bufs.entropies.at[:, j].set(ent),
        token_probs=bufs.token_probs.at[:, j].set(tok_p),
        bad=bufs.bad.at[:, j].set(active & sampling.nonfinite_rows(unprocessed)),
        forwards=bufs.forwards,
        copied=bufs.copied.at[:, j].set(active & is_copy),
        own_token0=own.get("own_token0", bufs.own_token0),
        own_probs0=own.get("own_probs0", bufs.own_probs0),
        copy_token0=bufs.copy_token0,
        copy_valid0=bufs.copy_valid0,
    )
    next_active = active & (j + 1 < budget) & jnp.asarray(go, bool)
    return next_active, bufs


def _no_drafts(batch: int, k_max: int, vocab: int, lookup: bool = False) -> _Drafts:
    """Empty draft buffers (no slot valid); one draft forward counted, the first. ``lookup``: with
    the slot-0 fields a context lookup needs."""
    slot0 = {}
    if lookup:
        slot0 = dict(own_token0=jnp.zeros((batch,), jnp.int32), own_probs0=jnp.zeros((batch, vocab), jnp.float32),
                     copy_token0=jnp.zeros((batch,), jnp.int32), copy_valid0=jnp.zeros((batch,), bool))
    return _Drafts(
        tokens=jnp.zeros((batch, k_max), jnp.int32),
        logits=jnp.zeros((batch, k_max, vocab), jnp.float32),
        probs=jnp.zeros((batch, k_max, vocab), jnp.float32),
        valid=jnp.zeros((batch, k_max), bool),
        entropies=jnp.zeros((batch, k_max), jnp.float32),
        token_probs=jnp.zeros((batch, k_max), jnp.float32),
        bad=jnp.zeros((batch, k_max), bool),
        forwards=jnp.int32(1),
        copied=jnp.zeros((batch, k_max), bool),
        **slot0,
    )


# ---------------------------------------------------------------------------
# 2. verify
# ---------------------------------------------------------------------------


class _Verified(NamedTuple):
    inputs: VerifyInputs  # [B]-batched: what the rule judges
    raw: Array  # [B, K + 1, V] target logits before the warp (checked for non-finite values)
    cache: KVCache  # the target cache after the forward (rolled back by _commit)
    features: Any  # [B, K + 1, H] the feature head's next inputs (None for a draft model)
    width: Array  # scalar int32: tokens per sequence the forward scored (cfg.verify_widths)


def _verify(
    cfg: LoopConfig, pair_params: ModelPair, rule: AcceptanceRule, state: DecodeState, drafts: _Drafts, uniforms,
    temperature, top_p, rows=None, hist=None,
) -> _Verified:
    """One target forward over ``[last, d_1 .. d_K]`` (``T = K + 1``): logits at
    slot ``k`` judge ``d_{k+1}``, slot ``K`` gives the bonus. A rule that
    declares ``hidden_layers`` gets the target's hidden states at each draft
    token's own position as ``features["hidden"]``."""
    last = gather(state.tokens, state.num_committed - 1)
    block_in = jnp.concatenate([last[:, None], drafts.tokens], axis=1)
    head = pair_params.draft.module
    head_layers = head.feature_layers if is_feature_head(head) else ()
    forward = functools.partial(
        pair_params.target.module.apply, pair_params.target.params,
        hidden_layers=tuple(rule.hidden_layers) + head_layers,
    )
    out, width = _verify_forward(cfg, forward, block_in, state.target_cache, drafts.valid, ~state.done)
    raw = out.logits[..., : pair_params.vocab_size]
    processed = raw
    if hist is not None:  # row k follows k drafts: the processing the draft saw at slot k
        processed = processors_lib.process(rows.processors, rows.controls, hist, raw, drafts.tokens, 0)
    target_logits = warp(cfg, processed, temperature, top_p, rows)
    target_probs = jax.nn.softmax(target_logits, axis=-1)
    features = {}
    if rule.hidden_layers:
        features["hidden"] = {layer: h[:, 1:] for layer, h in zip(rule.hidden_layers, out.hidden)}
    inputs = VerifyInputs(
        draft_tokens=drafts.tokens,
        draft_logits=drafts.logits,
        draft_probs=drafts.probs,
        target_logits=target_logits,
        target_probs=target_probs,
        uniforms=uniforms,
        valid=drafts.valid,
        features=features,
    )
    head_features = None
    if head_layers:
        hidden = jnp.concatenate(out.hidden[len(out.hidden) - len(head_layers):], axis=-1)
        head_features = head.target_features(pair_params.draft.params, hidden)
    return _Verified(inputs=inputs, raw=raw, cache=out.cache, features=head_features, width=width)


def _verify_forward(cfg: LoopConfig, forward, block_in: Array, cache: KVCache, valid: Array, live: Array):
    """``forward(tokens, cache)`` over the block's first ``width`` tokens:
    the smallest of ``cfg.verify_widths`` that holds every live sequence's
    last token and valid drafts (all ``K + 1`` when it is ``None``).

    The rows past ``width`` come back as zero logits and hidden states. No
    sequence reads them: its accepted run, correction and bonus token lie
    within its ``1 + valid`` slots, and the rules' verdicts on invalid slots
    are discarded. The cache entries they would have written lie past every
    sequence's rollback point. Returns ``(LMOutput with [B, K + 1, ...] rows,
    width as a scalar int32)``.
    """
    full = block_in.shape[1]
    widths = cfg.verify_widths or (full,)

    def at(width: int):
        def run(block_in, cache):
            out = forward(block_in[:, :width], cache)
            if width == full:
                return out
            return LMOutput(logits=_widen(out.logits, full), hidden=tuple(_widen(h, full) for h in out.hidden),
                            cache=out.cache)
        return run

    if len(widths) == 1:
        return at(widths[0])(block_in, cache), jnp.int32(widths[0])
    index = _width_index(widths, valid, live)
    shapes = jax.eval_shape(at(full), block_in, cache)
    blank = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), shapes._replace(cache=None))
    out = switch_in_place(index, [lambda out, w=w: at(w)(block_in, out.cache) for w in widths],
                          blank._replace(cache=cache))
    return out, jnp.asarray(widths, jnp.int32)[index]


# ---------------------------------------------------------------------------
# 3. accept
# ---------------------------------------------------------------------------


class _Accepted(NamedTuple):
    verdict: Verdict  # [B]-batched: the rule's decision per slot
    num_accepted: Array  # [B] n: the leading run of accepted valid slots
    num_drafted: Array  # [B] v: valid draft slots
    emitted: Array  # [B] the token after the accepted run: correction (n < v) or bonus
    live: Array  # [B] live before the cycle, with finite logits: the sequences that commit
    new_bad: Array  # [B] int32: this cycle's non-finite logits (1 target, 2 draft), else 0
    bad: Array  # [B] int32: the first non-finite logits each sequence met (sticky)


def _accept(
    cfg: LoopConfig, rule: AcceptanceRule, state: DecodeState, drafts: _Drafts, verified: _Verified, emit_uniform,
    rows=None,
) -> _Accepted:
    """The rule judges each slot; the leading run of accepted valid slots is
    kept and one more token is emitted: the rule's correction at the first
    rejection, or the target's bonus token after the last valid draft. A
    sequence whose outcome read non-finite logits stops and emits nothing.
    Greedy rows among sampled ones (``rows.greedy``) take the rule's greedy
    verdict and the argmax tokens, as a greedy loop would."""
    k_max, inputs = cfg.num_draft, verified.inputs
    greedy = greedy_rows(cfg, rows)
    verdict = with_greedy_rows(cfg, rows, per_row_rule(rule, rows, "verify", cfg.greedy, inputs, state.rule_state),
                               lambda: per_row_rule(rule, rows, "verify", True, inputs, state.rule_state))
    accept = jnp.asarray(verdict.accept, bool) & drafts.valid
    n = jnp.cumprod(accept.astype(jnp.int32), axis=1).sum(1)
    v = drafts.valid.sum(1).astype(jnp.int32)
    correction = row_at(verdict.correction, jnp.minimum(n, k_max - 1))
    if cfg.greedy:
        corr_tok = sampling.argmax(correction)
        bonus_tok = sampling.argmax(row_at(inputs.target_logits, n))
    else:
        # One uniform serves both: only one of the two tokens is used.
        corr_tok = sampling.sample_categorical(correction, emit_uniform)
        bonus_tok = sampling.sample_categorical(row_at(inputs.target_probs, n), emit_uniform)
        if greedy is not None:
            corr_tok = jnp.where(greedy, sampling.argmax(correction), corr_tok)
            bonus_tok = jnp.where(greedy, sampling.argmax(row_at(inputs.target_logits, n)), bonus_tok)
    emitted = jnp.where(n < v, corr_tok, bonus_tok)

    # Non-finite logits: only rows the outcome depends on count: target rows
    # 0..n (decisions up to slot n and the emitted token's distribution), draft rows 0..n.
    slots = jnp.arange(k_max + 1)[None, :]
    target_bad = (sampling.nonfinite_rows(verified.raw) & (slots <= n[:, None])).any(1)
    draft_bad = (drafts.bad & (slots[:, :k_max] <= n[:, None])).any(1)
    new_bad, bad = nonfinite_codes(state, draft_bad, target_bad)
    return _Accepted(
        verdict=verdict,
        num_accepted=n,
        num_drafted=v,
        emitted=emitted,
        live=~state.done & (new_bad == 0),
        new_bad=new_bad,
        bad=bad,
    )


# ---------------------------------------------------------------------------
# 4. commit
# ---------------------------------------------------------------------------


def _commit(
    cfg: LoopConfig, state: DecodeState, drafts: _Drafts, accepted: _Accepted, target_cache: KVCache,
    draft_cache: KVCache, prompt_lengths, max_new, eos_ids,
) -> Committed:
    """Commits ``drafts[:n] + emitted`` (:func:`specjax._src.engine.cycle.commit_block`)
    and rolls both caches back to their invariants (a length reset, nothing copied)."""
    tokens, n_commit, finished = commit_block(
        state, drafts.tokens, accepted.num_accepted, accepted.emitted, accepted.live, prompt_lengths, max_new,
        eos_ids,
    )
    new_nc = state.num_committed + n_commit
    return Committed(
        tokens=tokens,
        num_committed=new_nc,
        num_new=n_commit,
        done=state.done | (accepted.new_bad > 0) | finished,
        target_cache=target_cache.rollback(new_nc - 1),
        # A cycle that skipped the draft's forwards (forwards == 0) leaves its cache as it was.
        draft_cache=draft_cache.rollback(jnp.where(drafts.forwards > 0, draft_keep(state, new_nc),
                                                   state.draft_cache.lengths)),
    )


def _logprobs(state: DecodeState, drafts: _Drafts, verified: _Verified, accepted: _Accepted, rows=None):
    """The committed block's log-probabilities under the target's sampling
    distribution at each slot (:func:`specjax._src.engine.cycle.cycle_logprobs`)."""
    block = committed_block(drafts.tokens, accepted.num_accepted, accepted.emitted)
    return cycle_logprobs(state, verified.inputs.target_logits, block, rows)


# ---------------------------------------------------------------------------
# 5. record
# ---------------------------------------------------------------------------


def _record(
    cfg: LoopConfig, rule: AcceptanceRule, policy: drafting_lib.DraftingPolicy, state: DecodeState, drafts: _Drafts,
    judged: _Drafts, verified: _Verified, accepted: _Accepted, committed: Committed, rows=None,
):
    """What the cycle leaves for later, for live sequences only: the rule's
    and the drafting policy's running states, the stats
    (:func:`specjax._src.engine.stats.record_cycle`) and the ``diagnostics`` hook's
    values. ``drafts``: all ``K`` slots; ``judged``: those the verification
    read (:func:`_judge`). Returns ``(rule_state, policy_state, stats, diagnostics or None)``."""
    live, n = accepted.live, accepted.num_accepted
    args = (state.rule_state, verified.inputs, accepted.verdict, n)
    rule_state = with_greedy_rows(cfg, rows, per_row_rule(rule, rows, "update", cfg.greedy, *args),
                                  lambda: per_row_rule(rule, rows, "update", True, *args))
    rule_state = where_b(live, rule_state, state.rule_state)
    outcome = drafting_lib.DraftOutcome(
        num_drafted=accepted.num_drafted,
        num_accepted=n,
        valid=drafts.valid,
        entropies=drafts.entropies,
        token_probs=drafts.token_probs,
        first_acceptance=_first_acceptance(cfg, judged, verified),
        copy_acceptance=_copy_acceptance(cfg, judged, verified),
    )
    policy_state = jax.vmap(policy.update)(state.policy_state, outcome)
    policy_state = where_b(live, policy_state, state.policy_state)
    stats = record_cycle(state.stats, live=live, valid=drafts.valid, num_accepted=n,
                         num_committed=committed.num_new,
                         paths=_widen(jnp.asarray(accepted.verdict.path), drafts.tokens.shape[1]),
                         draft_forwards=drafts.forwards, copied=drafts.copied, verified=verified.width)
    diag = live_diagnostics(cfg, live, verified.inputs, accepted.verdict, n)
    return rule_state, policy_state, stats, diag


def _first_acceptance(cfg: LoopConfig, drafts: _Drafts, verified: _Verified) -> Array:
    """``[B]``: how likely the lossless rule was to accept the draft's first
    token, drafted or not (:class:`specjax.drafting.DraftOutcome`): the
    overlap ``sum(min(p, q))`` of the first slot's distributions, or, greedy,
    whether the draft's pick is the target's; -1 where the draft did not run."""
    if cfg.greedy:
        target_pick = sampling.argmax(verified.inputs.target_logits[:, 0])
        own = drafts.tokens[:, 0] if drafts.own_token0 is None else drafts.own_token0
        overlap = (target_pick == own).astype(jnp.float32)
    else:
        own = drafts.probs[:, 0] if drafts.own_probs0 is None else drafts.own_probs0
        overlap = jnp.minimum(verified.inputs.target_probs[:, 0], own).sum(-1)
    return jnp.where(drafts.forwards > 0, overlap, -1.0)  # -1: the draft did not run, nothing learnt


def _copy_acceptance(cfg: LoopConfig, drafts: _Drafts, verified: _Verified) -> Array:
    """``[B]``: how likely the lossless rule was to accept the lookup's proposal for slot 0, taken
    or not (a point mass: the target's probability of it; greedy: whether it is the target's
    pick); -1 where the lookup proposed nothing. None without a lookup."""
    if drafts.copy_valid0 is None:
        return None
    if cfg.greedy:
        p = (sampling.argmax(verified.inputs.target_logits[:, 0]) == drafts.copy_token0).astype(jnp.float32)
    else:
        p = jnp.take_along_axis(verified.inputs.target_probs[:, 0], drafts.copy_token0[:, None], axis=-1)[:, 0]
    return jnp.where(drafts.copy_valid0, p, -1.0)


CHAIN = Cycle("chain", _decode_cycle)
"""The chain cycle: up to ``K`` drafts, one verification of ``K + 1`` positions."""
