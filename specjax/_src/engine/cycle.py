"""The cycle interface, and what every draft-verify cycle is built from.

A cycle is a value (:class:`Cycle`) with one signature::

    cycle.run(cfg, pair_params, rule, policy, inputs, state) -> (state, diagnostics or None)

:data:`CHAIN` drafts a chain of up to ``K`` tokens
(:mod:`specjax._src.engine.chain`), :data:`TREE` a static or dynamic token
tree (:mod:`specjax._src.engine.tree`), :data:`TARGET_ONLY` no draft at all,
one target token per cycle (:mod:`specjax._src.engine.target_only`,
``generate``'s); :func:`cycle_for` picks the chain or the tree as a loop's
config asks. ``decode``'s and ``generate``'s loops and the slots engine's
``step`` all call a cycle through this signature and :func:`run_cycles`,
and a new drafter plugs in as another value. What a cycle reads of each sequence
besides the loop state is one :class:`CycleInputs`; a rule tells a cycle
what it can do through capabilities (``rule.lossless``, ``rule.hidden_layers``),
never through its class.

The chain cycle (:mod:`specjax._src.engine.chain`) and the tree cycle
(:mod:`specjax._src.engine.tree`) run the same five steps (draft, verify,
accept, commit, record) over the same loop state
(:class:`specjax._src.engine.config.DecodeState`) and keep the same cache
invariants (:mod:`specjax._src.engine.loop`). What those invariants fix,
whatever the drafts' shape, is here, and both cycles import it:

* draft: the cycle's first draft step, a draft model's ``T = 2`` forward
  (:func:`first_draft_logits`) or a feature head's ``T = K + 1`` one
  (:func:`first_head_logits`);
* accept: which model's non-finite logits stop a sequence (:func:`nonfinite_codes`);
* commit: the committed block written and cut at EOS and ``max_new_tokens``
  (:func:`commit_block`), its tokens' log-probabilities written beside it
  (:func:`commit_logprobs`, the slots engine's ``logprobs=``), the draft
  cache's length after it (:func:`draft_keep`), and what a commit hands on
  (:class:`Committed`);
* record: the ``diagnostics`` hook's values on live sequences
  (:func:`live_diagnostics`), and the state the cycle leaves (:func:`next_state`).

And the loop that runs cycles (:func:`run_cycles`): ``decode`` runs it until
every sequence is done, the slots engine's ``step`` for a number of cycles.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from specjax._src.logits import processors as processors_lib
from specjax._src.engine.config import DecodeState, LoopConfig, Logprobs
from specjax._src.engine.ops import gather, is_eos, narrowest_width, row_at, switch_in_place, where_b
from specjax._src.models.lm import KVCache, LMOutput, ReducedLogits
from specjax._src.engine.stats import DecodeStats

Array = jax.Array

# ---------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------


class CycleInputs(NamedTuple):
    """What a cycle reads of each sequence besides the loop state.

    Attributes:
      prompt_lengths: ``[B]`` int32.
      max_new: ``[B]`` int32, each sequence's ``max_new_tokens``.
      eos_ids: ``[E]`` int32 shared, or ``[B, E]`` per sequence (``-1``: none).
      keys: ``[B]`` typed PRNG keys, one per sequence (a cycle folds in ``state.step``).
      temperature: a scalar, or ``[B]`` with ``rows``.
      top_p: a scalar, or ``[B]`` with ``rows``.
      rows: per-sequence settings (:class:`specjax._src.logits.processors.RowSettings`:
        greedy rows, top-k, the draft cap, rule numbers, log-probs; the slots
        engine's), or None: the call's settings hold for every sequence.
    """

    prompt_lengths: Array
    max_new: Array
    eos_ids: Array
    keys: Array
    temperature: Any
    top_p: Any
    rows: Any = None


class Cycle(NamedTuple):
    """One draft-verify cycle as a value.

    Attributes:
      name: ``"chain"``, ``"tree"`` or ``"target_only"`` (a new drafter: its own).
      run: ``(cfg, pair_params, rule, policy, inputs, state) -> (state,
        diagnostics or None)``: ``cfg`` the loop's static
        :class:`~specjax._src.engine.config.LoopConfig`, ``pair_params`` the
        :class:`~specjax.ModelPair`, ``rule`` and ``policy`` the acceptance
        rule and drafting policy (pytrees), ``inputs`` a :class:`CycleInputs`,
        ``state`` the loop state (:class:`~specjax._src.engine.config.DecodeState`),
        which the cycle returns advanced by one draft, one verification and
        one commit per live sequence. Pure and traceable: it runs inside
        :func:`run_cycles`'s ``while_loop``.
    """

    name: str
    run: Callable

    def bind(self, cfg: LoopConfig, pair_params, rule, policy, inputs: CycleInputs
             ) -> Callable[[DecodeState], tuple[DecodeState, Any]]:
        """``state -> (state, diagnostics)``, the form :func:`run_cycles` calls."""
        return lambda state: self.run(cfg, pair_params, rule, policy, inputs, state)


# ---------------------------------------------------------------------------
# Per-row settings (the slots engine's)
# ---------------------------------------------------------------------------


def live_settings(rows, top_p, live: Array):
    """Per-row settings with finished rows' top-k and top-p filters off: such
    a row commits nothing, so its filters need not keep a batch of unfiltered
    live rows sorting the vocabulary (:func:`specjax._src.engine.ops.warp`)."""
    if rows.top_k is not None:
        rows = rows.replace(top_k=jnp.where(live, rows.top_k, 0))
    if top_p is not None and jnp.ndim(top_p) == 1:
        top_p = jnp.where(live, top_p, 1.0)
    return rows, top_p


def cycle_history(rows, state: DecodeState, prompt_lengths: Array, eos_ids: Array,
                  vocab: int) -> Optional[processors_lib.History]:
    """What the logits processors read of each sequence before the cycle
    (:func:`specjax._src.logits.processors.history`), or None without per-row controls.
    Counted only when some live row's controls change its logits."""
    if rows is None or rows.controls is None:
        return None
    active = processors_lib.changes_logits(rows.processors, rows.controls, state.num_committed - prompt_lengths,
                                           ~state.done)
    return processors_lib.history(state.tokens, prompt_lengths, state.num_committed, eos_ids, vocab, active=active)


def per_row_rule(rule, rows, method: str, greedy: bool, *args):
    """``rule.verify`` / ``rule.update`` per sequence: with ``rows.rules``, each
    sequence's own numbers (vmapped over the rule's leaves too)."""
    if rows is None or rows.rules is None:
        return jax.vmap(functools.partial(getattr(rule, method), greedy=greedy))(*args)
    return jax.vmap(lambda r, *a: getattr(r, method)(*a, greedy=greedy))(rows.rules, *args)


def greedy_rows(cfg: LoopConfig, rows) -> Optional[Array]:
    """``[B]`` the rows that decode greedily in a sampled program, or None
    where there are none to tell apart (a greedy program, or no per-row settings)."""
    return None if rows is None or cfg.greedy else rows.greedy


def with_greedy_rows(cfg: LoopConfig, rows, sampled, greedy_fn):
    """``sampled`` with the greedy rows' values taken from ``greedy_fn()``
    (computed only where a sampled program holds greedy rows)."""
    which = greedy_rows(cfg, rows)
    return sampled if which is None else where_b(which, greedy_fn(), sampled)


# ---------------------------------------------------------------------------
# draft: the first step
# ---------------------------------------------------------------------------


def first_draft_logits(module, params, vocab: int, state: DecodeState) -> tuple[Array, KVCache]:
    """The cycle's first draft step: a ``T = 2`` forward over the last two
    committed tokens (or ``[t0, pad]``), read at the last real one. Returns
    its raw logits ``[B, V]`` and the draft cache, now holding every committed token."""
    nc, tokens = state.num_committed, state.tokens
    first = gather(tokens, jnp.maximum(nc - 2, 0))
    second = jnp.where(nc >= 2, gather(tokens, jnp.maximum(nc - 1, 0)), 0)
    pair_tokens, row = jnp.stack([first, second], axis=1), jnp.minimum(nc - 1, 1)
    if getattr(module, "supports_logits_at", False):
        # Only one of the two rows is read: a one-row LM head (on CPU a 2-row
        # head ran ~10x slower than a one-row one, a quarter of a greedy cycle).
        out = module.apply(params, pair_tokens, state.draft_cache, logits_at=row)
        raw0 = out.logits[:, 0, :vocab]
    else:
        out = module.apply(params, pair_tokens, state.draft_cache)
        raw0 = row_at(out.logits[..., :vocab], row)
    return raw0, out.cache.rollback(nc)


def first_head_logits(cfg: LoopConfig, module, params, vocab: int, state: DecodeState):
    """A feature head's first draft step: one ``T = K + 1`` forward over the
    positions whose target features the last verification produced.

    The head cache holds positions ``0 .. m - 1``; ``state.draft_features[:, j]``
    is the target's ``f_{m+j}``, valid for ``j < count = num_committed - 1 - m``
    (the tokens the last cycle committed). Position ``m + j`` reads
    ``(f_{m+j}, x_{m+j+1})``; the output at ``j = count - 1`` drafts
    ``x_{num_committed}``, and the rows past it are dropped (a length reset).
    The drafts of the last cycle, written with the head's own features, are
    thus rewritten with the target's: EAGLE's feature correction.

    Returns ``(raw logits [B, V], predicted feature [B, H], cache, reduced)``,
    ``reduced`` a reduced-vocabulary head's own logits ``[B, V']``
    (:func:`usable_reduced`), else None.
    """
    cache, tokens = state.draft_cache, state.tokens
    start = cache.lengths
    count = jnp.clip(state.num_committed - 1 - start, 1, cfg.num_draft + 1)
    index = start[:, None] + 1 + jnp.arange(cfg.num_draft + 1)[None, :]
    block = jnp.take_along_axis(tokens, jnp.minimum(index, tokens.shape[1] - 1), axis=1)

    def at(width: int):
        def run(carry):
            out = module.apply(params, block[:, :width], carry[2], features=state.draft_features[:, :width],
                               logits_at=count - 1)
            reduced = usable_reduced(out, vocab)
            reduced = None if reduced is None else reduced._replace(logits=reduced.logits[:, 0])
            return out.logits[:, 0, :vocab], row_at(out.hidden[0], count - 1), out.cache, reduced
        return run

    # With drafts of varying length (auto()'s verification widths), the forward runs over the
    # narrowest of those widths that holds every live sequence's pending features, not all K + 1:
    # after a one-draft cycle, two rows, as a fixed K = 1 head reads (at four rows on a 2-core CPU
    # the K + 1 rows made a one-draft cycle 8.5% dearer than fixed K = 1's).
    rows = cfg.num_draft + 1
    widths = tuple(sorted({min(w, rows) for w in cfg.verify_widths or ()} | {rows}))
    if len(widths) == 1:
        logits, feature, cache, reduced = at(widths[-1])((None, None, cache, None))
    else:
        pick = narrowest_width(widths, jnp.max(jnp.where(state.done, 1, count)))
        blank = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype),
                                       jax.eval_shape(at(widths[-1]), (None, None, cache, None)))
        logits, feature, cache, reduced = switch_in_place(pick, [at(w) for w in widths],
                                                          (blank[0], blank[1], cache, blank[3]))
    return logits, feature, cache.rollback(start + count), reduced


def usable_reduced(out: LMOutput, vocab: int) -> Optional[ReducedLogits]:
    """A reduced-vocabulary head's own logits (``out.reduced``) with any
    column whose id is past the pair's usable ``vocab`` at ``-inf``, as the
    full logits' ``[..., :vocab]`` drops it; None for a full-vocabulary model.

    Ranking these ``V'`` columns gives the full logits' greedy picks at a
    fraction of the cost (the head's 7,168 columns against the target's
    49,152 for the shipped SmolLM2 head)."""
    if out.reduced is None:
        return None
    logits, ids = out.reduced
    return ReducedLogits(jnp.where(ids < vocab, logits.astype(jnp.float32), -jnp.inf), ids)


# ---------------------------------------------------------------------------
# accept: non-finite logits
# ---------------------------------------------------------------------------


def nonfinite_codes(state: DecodeState, draft_bad: Array, target_bad: Array) -> tuple[Array, Array]:
    """``(new_bad [B], bad [B])`` int32: this cycle's code for each live
    sequence whose outcome read non-finite logits (2 the draft's, else 1 the
    target's, else 0), and the first code each sequence met (sticky).

    ``draft_bad`` / ``target_bad [B]``: only the logits the outcome depended on
    (a chain's rows up to the accepted run, a tree's path)."""
    live_before = ~state.done
    new_bad = jnp.where(
        live_before & draft_bad, 2, jnp.where(live_before & target_bad, 1, 0)
    ).astype(jnp.int32)
    return new_bad, jnp.where(state.bad > 0, state.bad, new_bad)


# ---------------------------------------------------------------------------
# commit
# ---------------------------------------------------------------------------


class Committed(NamedTuple):
    """What a cycle's commit hands on (both caches already rolled back)."""

    tokens: Array  # [B, L] with this cycle's block written at the old num_committed
    num_committed: Array  # [B]
    num_new: Array  # [B] tokens this cycle committed
    done: Array  # [B]
    target_cache: KVCache  # rolled back: num_committed - 1 entries
    draft_cache: KVCache  # rolled back to draft_keep(...) entries


def commit_block(state: DecodeState, accepted_tokens: Array, n: Array, emitted: Array, live: Array,
                 prompt_lengths, max_new, eos_ids) -> tuple[Array, Array, Array]:
    """Writes ``accepted_tokens[:, :n] + emitted`` at ``num_committed``, cut after
    the first EOS and at each sequence's ``max_new_tokens`` (nothing for
    non-live rows).

    Args:
      accepted_tokens: ``[B, K]`` the drafts in output order (a chain's drafts,
        a tree's accepted path); only the first ``n[b]`` are committed.

    Returns:
      ``(tokens [B, L], num_new [B], done [B])``: ``done`` for EOS or the budget.
    """
    nc = state.num_committed
    k = accepted_tokens.shape[1]
    slots = jnp.arange(k + 1)[None, :]
    block = committed_block(accepted_tokens, n, emitted)
    eos_at = is_eos(eos_ids, block) & (slots <= n[:, None])
    first_eos = jnp.where(eos_at.any(1), jnp.argmax(eos_at, axis=1), k + 1)
    room = max_new - (nc - prompt_lengths)
    n_commit = jnp.minimum(jnp.minimum(n + 1, first_eos + 1), room)
    n_commit = jnp.where(live, n_commit, 0).astype(jnp.int32)
    hit_eos = live & (first_eos < n_commit)
    tokens = jax.vmap(lambda row, blk, off: jax.lax.dynamic_update_slice(row, blk, (off,)))(
        state.tokens, block, nc
    )
    return tokens, n_commit, hit_eos | (nc + n_commit - prompt_lengths >= max_new)


def committed_block(accepted_tokens: Array, n: Array, emitted: Array) -> Array:
    """``[B, K + 1]``: ``accepted_tokens[:, :n]``, then ``emitted`` at slot ``n`` (what
    :func:`commit_block` writes; the slots past ``n`` are never committed)."""
    batch, k = accepted_tokens.shape
    block = jnp.concatenate([accepted_tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    return jnp.where(jnp.arange(k + 1)[None, :] == n[:, None], emitted[:, None], block)


# A token the target's sampling distribution excludes (top-k, top-p, ``min_new_tokens``'s -inf)
# has log-probability -inf; it is reported as this floor instead, which JSON can carry.
LOGPROB_FLOOR = -9999.0


def commit_logprobs(buffers: Logprobs, num_committed: Array, target_logits: Array, block: Array,
                    want_top: Array) -> Logprobs:
    """Writes the log-probabilities of ``block [B, K + 1]`` at ``num_committed``
    (where :func:`commit_block` writes its tokens).

    Slot ``k``'s token is scored under ``log_softmax(target_logits[:, k])``
    (``[B, K + 1, V]``: the processed, warped logits that the target's
    position ``k`` samples from; for a greedy row its processed logits at
    temperature 1), floored at :data:`LOGPROB_FLOOR`. A lossless rule commits
    each token distributed as that distribution, so it is the one the token
    was sampled from; a relaxed rule's token is still scored under it.

    ``want_top``: scalar bool, some live row asks for alternatives: only then
    does the ``top_k`` over the vocabulary run (else ids -1, log-probs the floor).
    """
    logz = jax.nn.logsumexp(target_logits, axis=-1, keepdims=True)
    chosen = jnp.take_along_axis(target_logits, block[..., None], axis=-1)[..., 0] - logz[..., 0]
    n = buffers.top_ids.shape[-1]

    def top(logits):
        values, ids = jax.lax.top_k(logits - logz, n)
        return ids.astype(jnp.int32), values

    def none(logits):
        shape = logits.shape[:-1] + (n,)
        return jnp.full(shape, -1, jnp.int32), jnp.full(shape, LOGPROB_FLOOR, jnp.float32)

    top_ids, top_values = jax.lax.cond(want_top, top, none, target_logits)

    def write(buf, blk):  # buf [B, L, ...] <- blk [B, K + 1, ...] at each row's num_committed
        return jax.vmap(lambda row, b, at: jax.lax.dynamic_update_slice(row, b, (at,) + (0,) * (b.ndim - 1)))(
            buf, blk.astype(buf.dtype), num_committed)

    floor = lambda x: jnp.maximum(x, LOGPROB_FLOOR)  # noqa: E731
    return Logprobs(chosen=write(buffers.chosen, floor(chosen)), top_ids=write(buffers.top_ids, top_ids),
                     top_logprobs=write(buffers.top_logprobs, floor(top_values)))


def cycle_logprobs(state: DecodeState, target_logits: Array, block: Array, rows=None) -> Logprobs:
    """The log-prob buffers after a cycle that commits ``block [B, K + 1]``,
    each slot scored under its own row of ``target_logits [B, K + 1, V]``
    (:func:`commit_logprobs`). With per-row settings, the top-N alternatives
    run only when a live row asks for them, and nothing runs when no live row
    asks for log-probabilities at all (the rows that do not ask never read theirs)."""
    if rows is None or rows.logprobs is None:
        return commit_logprobs(state.logprobs, state.num_committed, target_logits, block, jnp.bool_(True))
    live = ~state.done
    want_top = (live & (rows.logprobs > 0)).any()
    return jax.lax.cond((live & (rows.logprobs >= 0)).any(),
                        lambda: commit_logprobs(state.logprobs, state.num_committed, target_logits, block, want_top),
                        lambda: state.logprobs)


def draft_keep(state: DecodeState, new_nc: Array) -> Array:
    """The draft cache's invariant after a commit: a draft model keeps every
    committed token but the last two (the next cycle's first forward reads
    them); a feature head keeps the positions whose features were the
    target's before this cycle (``num_committed - 1`` of them), and rewrites
    the rest from this cycle's target features (:func:`first_head_logits`)."""
    if state.draft_features is not None:
        return state.num_committed - 1
    return jnp.maximum(new_nc - 2, 0)


# ---------------------------------------------------------------------------
# record
# ---------------------------------------------------------------------------


def live_diagnostics(cfg: LoopConfig, live: Array, inputs, verdict, num_accepted: Array):
    """The ``diagnostics`` hook's per-sequence values over the cycle's chain
    block (``inputs``, ``verdict``, ``num_accepted``, each ``[B]``-batched),
    zero for sequences that did not commit; None without a hook."""
    if cfg.diagnostics is None:
        return None
    values = jax.vmap(cfg.diagnostics)(inputs, verdict, num_accepted)
    return jax.tree_util.tree_map(
        lambda x: jnp.where(live.reshape(live.shape + (1,) * (x.ndim - 1)), x, 0), values
    )


def next_state(state: DecodeState, committed: Committed, *, bad: Array, rule_state, policy_state,
               stats: DecodeStats, draft_features: Optional[Any], logprobs: Optional[Logprobs] = None
               ) -> DecodeState:
    """The loop state after one cycle: one more step, the commit, and what the
    record step and the verification left for the next cycle (``logprobs``:
    the buffers :func:`commit_logprobs` wrote, or None to keep ``state``'s)."""
    return DecodeState(
        step=state.step + 1,
        tokens=committed.tokens,
        num_committed=committed.num_committed,
        done=committed.done,
        bad=bad,
        target_cache=committed.target_cache,
        draft_cache=committed.draft_cache,
        rule_state=rule_state,
        policy_state=policy_state,
        stats=stats,
        draft_features=draft_features,
        logprobs=state.logprobs if logprobs is None else logprobs,
    )


# ---------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------


def run_cycles(
    cycle: Callable[[DecodeState], tuple[DecodeState, Any]],
    state: DecodeState,
    keep_going: Callable[[DecodeState, Array], Array],
    after_cycle: Optional[Callable[[DecodeState, DecodeState, Any], DecodeState]] = None,
) -> DecodeState:
    """Draft-verify cycles in one ``lax.while_loop``: the loop of ``decode``, of ``generate`` and
    of the slots engine's ``step`` alike.

    Args:
      cycle: ``state -> (state, diagnostics or None)``, a chain or tree cycle
        with its settings bound.
      state: the loop state before the first cycle.
      keep_going: ``(state, cycles_run) -> bool`` scalar, tested before each cycle.
      after_cycle: optional ``(before, after, diagnostics) -> after``: what a
        caller adds to each cycle (``decode``: the diagnostics summed into the
        stats, the streamed tokens, the state placed back on its mesh).

    Returns:
      The state after the last cycle.
    """

    def body(carry):
        i, before = carry
        after, diagnostics = cycle(before)
        if after_cycle is not None:
            after = after_cycle(before, after, diagnostics)
        return i + 1, after

    _, state = jax.lax.while_loop(lambda carry: keep_going(carry[1], carry[0]), body, (jnp.int32(0), state))
    return state
