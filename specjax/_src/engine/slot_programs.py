"""The slots engine's state and its jitted pure functions (:class:`specjax.engine.Engine` checks
their arguments on the host and calls them).

One program per static structure (:class:`SlotsConfig`) and shape: ``init_jit``; ``insert_jit``
(a batch of prompts prefilled whole into their slots, each request's first token drawn from its
prefill); ``prefill_start_jit``, ``prefill_chunk_jit`` and ``prefill_finish_jit`` (one prompt
prefilled chunk by chunk, its caches kept apart from the state until the last chunk); ``fork_jit``;
``step_jit`` (up to ``num_cycles`` cycles of the leading ``rows_run`` slots); ``flush_jit`` (what
a step would report before its cycles: the first tokens of requests inserted since the last one).
The ``*_donating`` variants write the new state into the old one's buffers.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax._src.engine.config import DecodeState, LoopConfig, Logprobs
from specjax._src.engine.cycle import LOGPROB_FLOOR, CycleInputs, run_cycles
from specjax._src.engine.cycles import cycle_for
from specjax._src.engine.ops import SINGLE_PREFILL_BLOCK
from specjax._src.engine.state import (draw_first_token, empty_prefill_caches, init_state, prefill_pair_chunk,
                                       prefill_state, state_after_chunks)
from specjax._src.logits import processors as processors_lib
from specjax._src.models.pairing import ModelPair

Array = jax.Array

# ---------------------------------------------------------------------------
# The state and the step's output
# ---------------------------------------------------------------------------


@struct.dataclass
class SlotState:
    """``S`` slots (every leaf's leading axis is ``S`` but the loop's two scalar counters).

    Attributes:
      loop: the draft-verify loop's state (``tokens [S, C + K + 1]``, caches of
        ``C + K`` positions, ``num_committed``, ``done``, stats, ...), with a
        per-slot cycle counter ``step [S]``.
      occupied: ``[S]`` bool, a request holds the slot (finished ones too,
        until released).
      prompt_lengths, max_new, draft_cap, top_k: ``[S]`` int32.
      temperature, top_p: ``[S]`` float32.
      eos: ``[S, E]`` int32 EOS and stop ids, ``-1`` for none.
      keys: ``[S, ...]`` uint32 key data.
      controls: :class:`specjax._src.logits.processors.Controls` ``[S]``, or None.
      rules: the engine's rule with each numeric field ``[S]`` (one set of
        numbers per slot), or None where the numbers are shared.
      logprobs: ``[S]`` int32 ``SlotSettings.logprobs`` (-1 for None) with
        ``Engine(logprobs=N)``, N > 0; else None.
      reported: ``[S]`` int32, each slot's committed tokens already given out
        (by a step's or a flush's :class:`StepOutput`): the next output starts there.
    """

    loop: DecodeState
    occupied: Array
    prompt_lengths: Array
    max_new: Array
    draft_cap: Array
    top_k: Array
    temperature: Array
    top_p: Array
    eos: Array
    keys: Array
    controls: Any = None
    rules: Any = None
    logprobs: Any = None
    reported: Any = None


@struct.dataclass
class StepOutput:
    """What one :meth:`Engine.step` committed (or :meth:`Engine.flush` found committed).

    Attributes:
      tokens: ``[S, W]`` int32: row ``s``'s first ``counts[s]`` entries are the
        tokens slot ``s`` committed since the last output (this step's, and a
        request's first token, drawn at its insert), in order; ``-1`` after them.
        ``W`` is the token buffer's width, ``capacity + K + 1``.
      counts: ``[S]`` int32.
      done: ``[S]`` bool: the slot's request is finished (EOS, a stop id,
        ``max_new_tokens``, or non-finite logits), or the slot is free.
      lengths: ``[S]`` int32 tokens generated so far per slot.
      bad: ``[S]`` int32: 0, or 1 / 2 when the target's / draft's logits went
        non-finite (the request stopped before that cycle).
      logprobs: ``[S, W]`` float32, aligned with ``tokens``: each token's
        log-probability under the target's sampling distribution at its
        position (after the logits processors, temperature, top-k and top-p;
        a greedy row's: the processed logits at temperature 1), floored at
        -9999.0 (a token those filters excluded); 0 after ``counts``. Only
        with ``Engine(logprobs=N)``, N > 0; else None.
      top_ids: ``[S, W, N]`` int32: the N most likely tokens at each position
        under that distribution, most likely first (-1 after ``counts``, or
        where no live slot asked for alternatives); None without ``logprobs``.
      top_logprobs: ``[S, W, N]`` float32: their log-probabilities (floored).
    """

    tokens: Array
    counts: Array
    done: Array
    lengths: Array
    bad: Array
    logprobs: Any = None
    top_ids: Any = None
    top_logprobs: Any = None


class SlotsConfig(NamedTuple):
    """The slots engine's static structure (a ``jit`` static)."""

    loop: LoopConfig
    num_slots: int
    capacity: int
    prompt_bucket: int
    num_eos: int
    num_bias: int
    controls: bool
    processors: tuple
    per_slot_rule: bool
    row_buckets: tuple = ()  # the leading rows a step may run, ascending, ending at num_slots
    filters: bool = True  # per-row top-k compiled in (top-p: ``loop.use_top_p``)
    logprobs: int = 0  # N: alternatives per token reported (0: no log-probs, nothing compiled in)


# ---------------------------------------------------------------------------
# The jitted pure functions
# ---------------------------------------------------------------------------


def _set_rows(full, part, slots: Array):
    """``full`` with rows ``slots[n]`` replaced by ``part``'s ``n`` rows (scalar leaves kept)."""
    return jax.tree_util.tree_map(lambda f, p: f if jnp.ndim(f) == 0 else f.at[slots].set(p), full, part)


def _init_impl(params: ModelPair, rule, policy, *, cfg: SlotsConfig) -> SlotState:
    s = cfg.num_slots
    loop_cfg = cfg.loop._replace(max_new_tokens=cfg.capacity - 1)
    ones = jnp.ones((s,), jnp.int32)
    loop = init_state(loop_cfg, params, rule, policy, jnp.zeros((s, 1), jnp.int32), ones, jnp.zeros((s,), jnp.int32))
    key_data = jax.random.key_data(jax.random.key(0))
    controls = None
    if cfg.controls:
        rows = processors_lib.controls_rows([processors_lib.GenerationControls()] * s, cfg.num_bias)
        controls = processors_lib.Controls(**{k: jnp.asarray(v) for k, v in rows.items()})
    return SlotState(
        loop=loop.replace(step=jnp.zeros((s,), jnp.int32), logprobs=_no_logprobs(loop.tokens.shape, cfg)),
        occupied=jnp.zeros((s,), bool),
        prompt_lengths=ones,
        max_new=jnp.zeros((s,), jnp.int32),
        draft_cap=jnp.zeros((s,), jnp.int32),
        top_k=jnp.zeros((s,), jnp.int32),
        temperature=jnp.ones((s,), jnp.float32),
        top_p=jnp.ones((s,), jnp.float32),
        eos=jnp.full((s, cfg.num_eos), -1, jnp.int32),
        keys=jnp.broadcast_to(key_data, (s,) + key_data.shape),
        controls=controls,
        rules=(
            jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (s,) + jnp.shape(x)), rule)
            if cfg.per_slot_rule
            else None
        ),
        logprobs=jnp.full((s,), -1, jnp.int32) if cfg.logprobs else None,
        reported=ones,
    )


def _no_logprobs(shape: tuple, cfg: SlotsConfig) -> Optional[Logprobs]:
    """Log-prob buffers beside a token buffer of ``shape`` ``[B, L]`` (None without ``cfg.logprobs``)."""
    if not cfg.logprobs:
        return None
    top = shape + (cfg.logprobs,)
    return Logprobs(
        chosen=jnp.zeros(shape, jnp.float32),
        top_ids=jnp.full(top, -1, jnp.int32),
        top_logprobs=jnp.full(top, LOGPROB_FLOOR, jnp.float32),
    )


def _insert_impl(
    params: ModelPair, rule, policy, state: SlotState, slots, prompts, lengths, row: dict, *, cfg: SlotsConfig
) -> SlotState:
    loop_cfg = cfg.loop._replace(max_new_tokens=cfg.capacity - prompts.shape[1])
    fresh, logits = prefill_state(loop_cfg, params, rule, policy, prompts, lengths, row["max_new"])
    return _write_requests(params, state, slots, fresh, logits, lengths, row, cfg)


def _prefill_start_impl(params: ModelPair, *, cfg: SlotsConfig):
    """Both caches of one prompt before its first chunk (:meth:`Engine.begin_insert`)."""
    return empty_prefill_caches(cfg.loop, params)


def _prefill_chunk_impl(params: ModelPair, caches, prompt, length, width, start, *, cfg: SlotsConfig, chunk: int):
    """One chunk that is not the prompt's last: the caches after it (:meth:`Engine.continue_insert`)."""
    caches, _, _ = prefill_pair_chunk(
        cfg.loop, params, caches, prompt, length, width, start, chunk, cfg.capacity % SINGLE_PREFILL_BLOCK
    )
    return caches


def _prefill_finish_impl(
    params: ModelPair,
    rule,
    policy,
    state: SlotState,
    caches,
    prompt,
    length,
    width,
    start,
    slots,
    row: dict,
    *,
    cfg: SlotsConfig,
    chunk: int,
) -> SlotState:
    """The prompt's last chunk, then the request written into its slot as :func:`_insert_impl` writes it."""
    caches, features, logits = prefill_pair_chunk(
        cfg.loop, params, caches, prompt, length, width, start, chunk, cfg.capacity % SINGLE_PREFILL_BLOCK
    )
    loop_cfg = cfg.loop._replace(max_new_tokens=0)
    fresh = state_after_chunks(
        loop_cfg, params, rule, policy, caches, features, prompt[:, : cfg.capacity], length, start, row["max_new"]
    )
    return _write_requests(params, state, slots, fresh, logits, jnp.reshape(length, (1,)), row, cfg)


def _write_requests(params: ModelPair, state: SlotState, slots, fresh, logits, lengths, row: dict,
                    cfg: SlotsConfig) -> SlotState:
    """``state`` with the requests of ``fresh`` (their prefilled loop rows, before their first
    token) and ``row`` (their settings) in ``slots``, each first token drawn from ``logits [n, V']``."""
    state = _write_settings(state, slots, lengths, row, cfg)
    settings = jax.tree_util.tree_map(lambda x: x[slots], state.replace(loop=None))
    fresh = fresh.replace(step=jnp.zeros_like(lengths), logprobs=_no_logprobs(fresh.tokens.shape, cfg))
    fresh = draw_first_token(cfg.loop, params, _cycle_inputs(settings, cfg), fresh, logits)
    return state.replace(loop=_set_rows(state.loop, fresh, slots), reported=state.reported.at[slots].set(lengths))


def _write_settings(state: SlotState, slots, lengths, row: dict, cfg: SlotsConfig) -> SlotState:
    """``state`` with the settings ``row`` of requests whose prompts hold ``lengths`` tokens in ``slots``."""
    controls, rules = state.controls, state.rules
    if cfg.per_slot_rule:
        rules = _set_rows(rules, row["rule"], slots)
    if cfg.controls:
        controls = _set_rows(controls, processors_lib.Controls(**row["controls"]), slots)
    put = lambda name: getattr(state, name).at[slots].set(row[name])  # noqa: E731
    # A seed's key is decode's key of sequence 0, derived here so that no host-side op compiles per insert.
    seeded = jax.vmap(lambda seed: jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 0)))(row["seed"])
    keys = jnp.where(row["use_key"][:, None], row["keys"], seeded)
    return state.replace(
        occupied=state.occupied.at[slots].set(True),
        prompt_lengths=state.prompt_lengths.at[slots].set(lengths),
        max_new=put("max_new"),
        draft_cap=put("draft_cap"),
        top_k=put("top_k"),
        temperature=put("temperature"),
        top_p=put("top_p"),
        eos=put("eos"),
        keys=state.keys.at[slots].set(keys),
        controls=controls,
        rules=rules,
        logprobs=put("logprobs") if cfg.logprobs else None,
    )


def _fork_impl(params: ModelPair, state: SlotState, source, slots, keys, *, cfg: SlotsConfig) -> SlotState:
    """Rows ``slots [n]`` become copies of row ``source`` (its caches, tokens,
    settings and counters), each with its own key data ``keys [n, ...]`` and
    its own first token: drawn again with that key from the target's logits
    at the prompt's last position (one forward of that token over the
    source's cache), as an insert with that key draws it. The source must
    have run no step since its insert."""
    n = slots.shape[0]
    copies = jax.tree_util.tree_map(
        lambda x: x if jnp.ndim(x) == 0 else jnp.broadcast_to(x[source], (n,) + x.shape[1:]), state
    ).replace(keys=keys)
    lengths = copies.prompt_lengths
    loop = copies.loop.replace(num_committed=lengths, done=copies.max_new <= 0, bad=jnp.zeros_like(lengths),
                               step=jnp.zeros_like(lengths))
    logits = jnp.broadcast_to(_last_prompt_logits(params, state, source), (n, params.vocab_size))
    loop = draw_first_token(cfg.loop, params, _cycle_inputs(copies, cfg), loop, logits)
    return _set_rows(state, copies.replace(loop=loop, reported=lengths), slots)


def _last_prompt_logits(params: ModelPair, state: SlotState, source) -> Array:
    """``[V']`` the target's raw logits at the last prompt position of slot ``source``: one
    forward of that token over the slot's target cache (which holds the prompt)."""
    length = state.prompt_lengths[source]
    cache = jax.tree_util.tree_map(lambda x: x[source][None], state.loop.target_cache).rollback(length[None] - 1)
    token = state.loop.tokens[source, length - 1]
    target = params.target
    return target.module.apply(target.params, token.reshape(1, 1), cache).logits[0, 0, : params.vocab_size]


def _cycle_inputs(state: SlotState, cfg: SlotsConfig) -> CycleInputs:
    """What a cycle reads of each of ``state``'s rows besides the loop state."""
    keys = jax.random.wrap_key_data(state.keys)
    return CycleInputs(state.prompt_lengths, state.max_new, state.eos, keys, state.temperature, state.top_p,
                       _rows(state, cfg))


def _rows(state: SlotState, cfg: SlotsConfig) -> processors_lib.RowSettings:
    return processors_lib.RowSettings(
        greedy=state.temperature == 0.0,
        top_k=state.top_k if cfg.filters else None,
        draft_cap=state.draft_cap,
        controls=state.controls if cfg.controls else None,
        rules=state.rules,
        processors=cfg.processors,
        logprobs=state.logprobs if cfg.logprobs else None,
    )


def _leading_rows(tree, n: int):
    """Every ``[S, ...]`` leaf of ``tree`` cut to its first ``n`` rows (scalar leaves kept)."""
    return jax.tree_util.tree_map(lambda x: x if jnp.ndim(x) == 0 else x[:n], tree)


def _with_leading_rows(full, part):
    """``full`` with its first rows replaced by ``part``'s (scalar leaves: ``part``'s)."""
    return jax.tree_util.tree_map(
        lambda f, p: p if jnp.ndim(f) == 0 else jax.lax.dynamic_update_slice_in_dim(f, p, 0, axis=0), full, part
    )


def _without_caches(loop: DecodeState) -> DecodeState:
    return loop.replace(target_cache=None, draft_cache=None)


def _leading_state_rows(state: SlotState, n: int, cfg: SlotsConfig) -> SlotState:
    """``state``'s first ``n`` rows, a chain's KV buffers whole (only their lengths cut).

    Cutting the buffers copies them: at one live slot of 8, the real pair's
    4-bit step spent about 6 ms copying its 24 MB of cache rows out and back,
    a quarter of a cycle. A chain's forwards write and read the first ``n``
    rows of wider buffers in place (``write_cache``, ``cache_attention``). A
    tree's cycle moves its accepted path within each row's buffer
    (``KVCache.keep_path``), so trees step cut buffers.
    """
    if cfg.loop.tree is not None:
        return _leading_rows(state, n)
    loop = state.loop
    part = _leading_rows(state.replace(loop=_without_caches(loop)), n)
    cut = lambda c: None if c is None else c.replace(lengths=c.lengths[:n])  # noqa: E731
    return part.replace(loop=part.loop.replace(target_cache=cut(loop.target_cache), draft_cache=cut(loop.draft_cache)))


def _with_leading_loop_rows(full: DecodeState, part: DecodeState, cfg: SlotsConfig) -> DecodeState:
    """``full`` with its first rows replaced by ``part``'s (:func:`_leading_state_rows`' inverse)."""
    if cfg.loop.tree is not None:
        return _with_leading_rows(full, part)
    merged = _with_leading_rows(_without_caches(full), _without_caches(part))

    def widen(whole, cut):  # the buffers are already whole: only the lengths go back
        if whole is None:
            return None
        return cut.replace(lengths=jax.lax.dynamic_update_slice_in_dim(whole.lengths, cut.lengths, 0, axis=0))

    return merged.replace(target_cache=widen(full.target_cache, part.target_cache),
                          draft_cache=widen(full.draft_cache, part.draft_cache))


def _step_impl(
    params: ModelPair,
    rule,
    policy,
    state: SlotState,
    num_cycles,
    until_first_finish,
    *,
    cfg: SlotsConfig,
    rows_run: int,
) -> tuple[SlotState, StepOutput]:
    """Cycles for the first ``rows_run`` slots (static: the engine passes a row
    bucket holding every occupied slot; the rows past it are free, so nothing
    of theirs changes), then the step's output for all ``S``."""
    part = state if rows_run == cfg.num_slots else _leading_state_rows(state, rows_run, cfg)
    loop = _run_rows(params, rule, policy, part, num_cycles, until_first_finish, cfg)
    if rows_run != cfg.num_slots:
        loop = _with_leading_loop_rows(state.loop, loop, cfg)
    return _output(state, loop, cfg)


def _flush_impl(state: SlotState, *, cfg: SlotsConfig) -> tuple[SlotState, StepOutput]:
    """The tokens committed since the last output, no cycle run (:meth:`Engine.flush`)."""
    return _output(state, state.loop, cfg)


def _output(state: SlotState, loop: DecodeState, cfg: SlotsConfig) -> tuple[SlotState, StepOutput]:
    """``state`` with ``loop``, and the :class:`StepOutput` of what its rows committed since ``state.reported``."""
    start = state.reported
    counts = loop.num_committed - start
    width = loop.tokens.shape[1]
    cols = jnp.arange(width)[None, :]
    index = jnp.minimum(start[:, None] + cols, width - 1)

    def new(x, fill):  # [S, W, ...]: this step's entries first, ``fill`` after them
        at = index.reshape(index.shape + (1,) * (x.ndim - 2))
        got = jnp.take_along_axis(x, jnp.broadcast_to(at, x.shape), axis=1)
        return jnp.where((cols < counts[:, None]).reshape(at.shape), got, fill)

    out = StepOutput(
        tokens=new(loop.tokens, -1),
        counts=counts,
        done=loop.done,
        lengths=loop.num_committed - state.prompt_lengths,
        bad=loop.bad,
    )
    if cfg.logprobs:
        out = out.replace(
            logprobs=new(loop.logprobs.chosen, 0.0),
            top_ids=new(loop.logprobs.top_ids, -1),
            top_logprobs=new(loop.logprobs.top_logprobs, 0.0),
        )
    return state.replace(loop=loop, reported=loop.num_committed), out


def _run_rows(
    params: ModelPair, rule, policy, state: SlotState, num_cycles, until_first_finish, cfg: SlotsConfig
) -> DecodeState:
    """Up to ``num_cycles`` cycles of ``state``'s rows; returns the loop state after them."""
    cycle = cycle_for(cfg.loop).bind(cfg.loop, params, rule, policy, _cycle_inputs(state, cfg))
    done_before = state.loop.done

    def keep_going(loop: DecodeState, cycles_run):
        finished = (loop.done & ~done_before).any()
        return (cycles_run < num_cycles) & ~loop.done.all() & ~(until_first_finish & finished)

    return run_cycles(cycle, state.loop, keep_going)


init_jit = jax.jit(_init_impl, static_argnames=("cfg",))
prefill_start_jit = jax.jit(_prefill_start_impl, static_argnames=("cfg",))
prefill_chunk_jit = jax.jit(_prefill_chunk_impl, static_argnames=("cfg", "chunk"))
prefill_finish_jit = jax.jit(_prefill_finish_impl, static_argnames=("cfg", "chunk"))
prefill_chunk_donating = jax.jit(_prefill_chunk_impl, static_argnames=("cfg", "chunk"), donate_argnames=("caches",))
# (The last chunk's caches go into the state's rows: no output of its shape could reuse them.)
prefill_finish_donating = jax.jit(_prefill_finish_impl, static_argnames=("cfg", "chunk"), donate_argnames=("state",))
insert_jit = jax.jit(_insert_impl, static_argnames=("cfg",))
fork_jit = jax.jit(_fork_impl, static_argnames=("cfg",))
step_jit = jax.jit(_step_impl, static_argnames=("cfg", "rows_run"))
flush_jit = jax.jit(_flush_impl, static_argnames=("cfg",))
# The same programs writing the new state into the old one's buffers: without
# donation every call copies the whole state, both KV caches of every slot
# included, to write a few rows of it.
insert_donating = jax.jit(_insert_impl, static_argnames=("cfg",), donate_argnames=("state",))
step_donating = jax.jit(_step_impl, static_argnames=("cfg", "rows_run"), donate_argnames=("state",))
fork_donating = jax.jit(_fork_impl, static_argnames=("cfg",), donate_argnames=("state",))
flush_donating = jax.jit(_flush_impl, static_argnames=("cfg",), donate_argnames=("state",))


def with_entry(flags: Array, index: int, value) -> Array:
    """A copy of ``flags`` ``[S]`` with entry ``index`` set to ``value``, written from the host.

    A device transfer, not a program: it compiles nothing. The copy is placed
    as ``flags`` was (its sharding, and committed or not: both are part of a
    jitted program's cache key), so the insert and step programs that read it
    are not compiled again.
    """
    host = np.array(flags)
    host[index] = value
    return jax.device_put(host, flags.sharding) if flags.committed else jax.device_put(host)
