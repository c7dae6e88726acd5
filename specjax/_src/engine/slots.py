"""Slots: a state of S requests, each in its own row of the draft-verify loop.

The functional core a server drives from a host loop, in the shape of
JetStream's engine API (``prefill`` / ``insert`` / ``generate`` over decode
slots): a :class:`SlotState` holds ``S`` slots, each with a fixed-capacity
region of both KV caches, its token buffer and its own settings as traced
arrays; two jitted pure functions move it on, and a host-side update frees a slot:

* :func:`insert` prefills one request into a free slot (the prompt padded to
  a width bucket: one program per bucket);
* :func:`step` runs up to ``num_cycles`` draft-verify cycles for every live
  slot in one ``lax.while_loop`` (the chain cycle of :mod:`specjax._src.engine.chain`,
  with per-row settings) and returns what each slot committed (one program);
* :meth:`Engine.release` frees a slot: it sets the slot's ``occupied`` and
  ``done`` flags from the host (no program of its own, no work added to a step);
* :meth:`Engine.fork` copies an inserted request into free slots, each with
  its own key (``n`` choices of one prompt, one prefill);
* :meth:`Engine.flush` returns the tokens committed since the last output
  without a cycle: an insert draws each request's first token from its
  prefill's logits at the prompt's last position, so it needs none.

For a serving loop, :meth:`Engine.validate` returns a request's bad settings
as data (:class:`FieldError`), and :meth:`Engine.plan` picks a step's program
from the settings the host already holds (:class:`StepPlan`), so that a step
need not read them back from the device. ``Engine(logprobs=N)`` also reports
each committed token's log-probability and its ``N`` most likely alternatives.
:meth:`Engine.begin_insert` takes a prompt's start from a prefix cache
(:mod:`specjax._src.engine.prefix_cache`).

This module holds the :class:`Engine` (its checks and entry points); the
state and the jitted programs are in :mod:`specjax._src.engine.slot_programs`,
a request's settings and their checks in :mod:`specjax._src.engine.slot_settings`.

Per-request data (traced, so mixed traffic shares one program): temperature
(0 = greedy), top_p, top_k, the PRNG key, ``max_new_tokens``, EOS and stop
ids, the ``num_draft`` cap (0 = one target token per cycle) and the logits
processors' numbers (:mod:`specjax._src.logits.processors`). Static structure (one
program per value): the pair, the rule's and drafting policy's types, ``K``,
the slot count and capacity, the lookup, whether processors are compiled in.

A slot's randomness: ``SlotSettings(seed=s)`` samples what
``decode(..., key=jax.random.key(s))`` samples for that request alone (the key
of sequence 0, ``fold_in(key(s), 0)``); ``SlotSettings(key=k)`` what
``decode(..., key=k[None])`` does (one key per sequence). The cycle counter
is per slot, so a request's draws do not depend on when it was inserted.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import numpy as np

from specjax._src.proposals.drafting import CostModel
from specjax._src.proposals import lookup as lookup_lib
from specjax._src.logits import processors as processors_lib
from specjax._src.foundation.checks import as_integer
from specjax._src.engine import costs as costs_lib
from specjax._src.engine.config import LoopConfig
from specjax._src.engine import slot_programs as programs
from specjax._src.engine import slot_settings as settings_lib
from specjax._src.engine.ops import PREFILL_BLOCK, SINGLE_PREFILL_BLOCK, prefill_block
from specjax._src.engine.prepare import (BUCKETS, bucket_of, check_decode_args, check_tree, tree_size_widths,
                                         prepare_prompts, verify_widths_for)
from specjax._src.engine.slot_programs import SlotsConfig, SlotState, StepOutput
from specjax._src.engine.slot_settings import FieldError, SlotSettings
from specjax._src.foundation.jit_keys import pytree_classes
from specjax._src.models.pairing import ModelPair
from specjax._src.rules.base import AcceptanceRule
from specjax._src.rules.combinators import OneOf

Array = jax.Array

# ---------------------------------------------------------------------------
# Host values: a step's plan, a chunked insert
# ---------------------------------------------------------------------------


class StepPlan(NamedTuple):
    """Which compiled step a step runs (:meth:`Engine.plan`).

    Attributes:
      program: ``"greedy"``, ``"sampled"`` or ``"general"`` (:meth:`Engine.step_program`).
      rows: the row bucket: the leading slots the step runs (:meth:`Engine.rows_to_run`).
    """

    program: str
    rows: int


class PrefillJob(NamedTuple):
    """A request whose prompt is being prefilled chunk by chunk (:meth:`Engine.begin_insert`).

    A host value holding the prompt's two caches so far (device arrays,
    apart from the :class:`SlotState`: steps never see them); pass it to
    :meth:`Engine.continue_insert` until :attr:`finished`.

    Attributes:
      slot: the slot the request goes into when its last chunk is in.
      length: the prompt's tokens.
      chunk: prompt positions per call.
      position: positions prefilled so far (``start`` + a multiple of ``chunk``).
      chunks: the calls the whole prefill takes.
      finished: the request is in its slot (the caches went into the state).
      start: the positions the job began with, copied from a prefix cache
        (``begin_insert(prefix=...)``; 0: none).
    """

    slot: int
    length: int
    chunk: int
    position: int
    chunks: int
    finished: bool
    prompt: Any  # [1, P] int32 host array, zeros past the prompt
    width: int  # the width a whole insert would prefill the prompt at
    settings: SlotSettings
    row: dict
    caches: Any  # (target cache, draft cache) of batch 1, or None once finished
    start: int = 0

    @property
    def chunks_left(self) -> int:
        """Calls of :meth:`Engine.continue_insert` still to make."""
        return 0 if self.finished else self.chunks - (self.position - self.start) // self.chunk



# ---------------------------------------------------------------------------
# The engine: static structure, params, and checked entry points
# ---------------------------------------------------------------------------


class Engine:
    """A pair of models and the static structure of a :class:`SlotState`.

    ``engine.init()`` gives a state of ``num_slots`` free slots; ``insert``,
    ``step`` and ``release`` check their arguments on the host (an error
    names the field at fault and leaves the state as it was); ``insert`` and
    ``step`` then call the jitted pure functions, ``release`` sets two flags
    from the host. The state is a value: each call returns a new one.

    Args:
      params: ``specjax.pair(target, draft)`` (a draft model or a feature head).
      num_slots: S, requests held at once.
      capacity: C, the most prompt + generated tokens per slot (each slot's
        caches hold ``C + num_draft`` positions).
      num_draft: K, the most drafts per cycle (a request may cap it lower).
      rule: the acceptance rule (default ``speculative_sampling()``). When
        every numeric field is a scalar, each slot holds its own numbers
        (``SlotSettings.rule``, default this rule's); otherwise they are shared.
        ``one_of(r1, r2, ...)``: each request picks one of the rules, with
        numbers of its own (:meth:`rule_for`; members holding arrays, such as
        PAD's, make the choice shared: every request gets the default).
      drafting: the drafting policy (default ``fixed()``).
      lookup: ``specjax.drafting.ngram_lookup(...)``: drafts copied from each
        slot's own context.
      tree: a :class:`specjax.trees.TokenTree` (``static_tree((4, 2, 1))``) or
        :class:`specjax.trees.DynamicTree` (``dynamic_tree(4, 4, 12)``): every
        slot drafts a token tree per cycle and the target verifies all its
        nodes in one forward, as ``decode(tree=...)`` does, with each slot's own
        temperature, top-p, top-k, rule numbers and log-probs. ``K`` is the
        tree's depth; a request's ``num_draft`` caps the depth its path may
        accept (0: one target token per cycle). Not with ``lookup``; the
        drafting policy is the tree's shape, or, with ``drafting=auto()`` and a
        dynamic tree, each step's cycles verify only its best-ranked nodes that
        pay (or run plain steps), as ``decode`` does.
      controls: compile the logits processors in (``SlotSettings.controls``);
        False saves their work when no request uses them. Default: True.
        On a tree each node's logits are processed after the tokens on its path.
      processors: the processors, in order (static; default the built-ins:
        bias, repetition, presence / frequency, ``min_new_tokens``). Each is a
        pure function ``(logits [V], TokenContext) -> logits [V]``.
      max_eos: EOS + stop ids per request (E).
      max_bias: ``logit_bias`` entries per request.
      prompt_bucket: the smallest prompt width bucket (widths ``b * 2**i``,
        capped at ``capacity``): one ``insert`` program per width. A prompt
        inserted alone that fits one prefill block (64 tokens) runs at its own
        width, rounded up to 16 (16, 32, 48 or 64), whatever the bucket, so
        that a short request's prefill runs no more positions than it needs
        (one block is one forward, its cost about linear in its positions).
      row_buckets: the leading slot counts a step may run, e.g. ``(1, 2, 4)``
        (``num_slots`` is always one): a step runs the smallest that holds
        every occupied slot, so an engine with few requests, packed into its
        lowest slots, pays for those rows only (one ``step`` program per
        bucket). None (default): every step runs all ``num_slots`` rows, one
        program. ``"powers"``: 1, 2, 4, ... below ``num_slots``.
      donate_state: ``insert`` and ``step`` write the new state into the
        buffers of the state passed in, which is then consumed (passing it
        again is an error): no copy of the caches per call, which a serving
        loop that keeps only the newest state wants. False (default): every
        state stays valid.
      specialized_steps: each step runs the program compiled for what its
        occupied slots use (:meth:`step_program`): ``"greedy"`` when every
        one decodes greedily without ``controls`` (what ``decode`` compiles
        for temperature 0: no sampling draws, sampled verdicts or processor
        checks); ``"sampled"`` when none uses ``controls``, top-k or top-p
        (no filters or processors: a request that sends only a temperature);
        else ``"general"``. Two more ``step`` programs per row bucket; each
        request decodes the same tokens in any of them. False (default):
        the general program serves every mix.
      logprobs: N, the most alternatives per token a request may ask for
        (``SlotSettings.logprobs``): steps then also report each committed
        token's log-probability and the N most likely tokens at its position
        (:class:`StepOutput`). 0 (default): no log-probabilities, and nothing
        of them compiled in.
    """

    def __init__(self, params: ModelPair, *, num_slots: int, capacity: int, num_draft: Optional[int] = None,
                 rule=None, drafting=None, lookup=None, tree=None, controls: Optional[bool] = None, max_eos: int = 8,
                 max_bias: int = 8, prompt_bucket: int = 16,
                 processors: Sequence = processors_lib.BUILTIN_PROCESSORS, row_buckets=None,
                 donate_state: bool = False, specialized_steps: bool = False, logprobs: int = 0):
        if lookup is not None and not isinstance(lookup, lookup_lib.NgramLookup):
            raise TypeError(f"lookup must be specjax.drafting.ngram_lookup(...), got {type(lookup).__name__}.")
        controls = True if controls is None else controls
        if tree is None:
            rule, drafting, num_draft = check_decode_args(params, rule, drafting, num_draft)
            cache_room = num_draft
        else:
            if lookup is not None:
                raise ValueError("Engine: lookup= drafts chains; it cannot be combined with tree=. Drop one of them.")
            rule, drafting, _ = check_decode_args(params, rule, drafting, None)
            # The tree's depth is its K; the target cache holds every node for a moment.
            num_draft, cache_room = check_tree(tree, params, rule, drafting, num_draft), tree.num_nodes
        for name, value in (("num_slots", num_slots), ("capacity", capacity), ("max_eos", max_eos),
                            ("max_bias", max_bias), ("prompt_bucket", prompt_bucket)):
            number = as_integer(value)
            if number is None or number < 1:
                raise ValueError(f"Engine: {name} must be a positive integer, got {value!r}.")
        num_logprobs = as_integer(logprobs)
        if num_logprobs is None or not 0 <= num_logprobs <= params.vocab_size:
            raise ValueError(f"Engine: logprobs must be an integer in 0 .. {params.vocab_size} (the vocabulary), "
                             f"got {logprobs!r}.")
        for name, model in (("target", params.target), ("draft", params.draft)):
            limit = getattr(getattr(model.module, "config", None), "max_position_embeddings", None)
            if limit is not None and capacity + cache_room > limit:
                room = f"the tree's {cache_room} nodes" if tree is not None else f"num_draft {num_draft}"
                raise ValueError(f"Engine: capacity {capacity} + {room} exceeds the {name} model's "
                                 f"{limit} positions (max_position_embeddings); lower capacity.")
        processors = tuple(processors)
        if not all(callable(p) for p in processors):
            raise TypeError("processors must be functions (logits [V], TokenContext) -> logits [V].")
        if capacity < 2:
            raise ValueError(f"Engine: capacity must hold a prompt token and a generated one (>= 2), got {capacity}.")
        # auto(): a verification as narrow as the drafts (one token when none), and costs measured at each
        # row bucket (a step of one live request runs one row, where drafting pays most).
        verify_widths = None
        if drafting.may_draft_none:  # auto(): a chain's length, or a dynamic tree's size (check_tree)
            verify_widths = (verify_widths_for(BUCKETS, drafting, num_draft) if tree is None
                             else tree_size_widths(tree))
            drafts = num_draft if tree is None else verify_widths[-1] - 1
            drafting = costs_lib.with_costs(drafting, lambda: costs_lib.cached_costs_by_batch(
                params, batches=settings_lib.check_row_buckets(row_buckets, int(num_slots)), num_draft=drafts,
                verify_widths=verify_widths, cache_length=capacity + cache_room, tree=tree))
        self.params, self.rule, self.drafting = params, rule, drafting
        self.donate_state = bool(donate_state)
        self._insert_fn, self._step_fn, self._fork_fn, self._flush_fn = (
            (programs.insert_donating, programs.step_donating, programs.fork_donating, programs.flush_donating)
            if self.donate_state else (programs.insert_jit, programs.step_jit, programs.fork_jit, programs.flush_jit))
        self._chunk_fn, self._finish_fn = ((programs.prefill_chunk_donating, programs.prefill_finish_donating) if self.donate_state
                                           else (programs.prefill_chunk_jit, programs.prefill_finish_jit))
        leaves = jax.tree_util.tree_leaves(rule)
        per_slot_rule = bool(leaves) and all(np.ndim(x) == 0 for x in leaves)
        self.vocab_size = params.vocab_size
        loop = LoopConfig(diagnostics=None, num_draft=num_draft, max_new_tokens=capacity - 1,
                       cache_length=capacity + cache_room, greedy=False, top_k=None, use_top_p=True, lookup=lookup,
                       tree=tree, classes=pytree_classes(rule, drafting), verify_widths=verify_widths)
        self.cfg = SlotsConfig(loop=loop, num_slots=int(num_slots), capacity=int(capacity),
                                 prompt_bucket=int(prompt_bucket), num_eos=int(max_eos), num_bias=int(max_bias),
                                 controls=bool(controls), processors=processors,
                                 per_slot_rule=per_slot_rule,
                                 row_buckets=settings_lib.check_row_buckets(row_buckets, int(num_slots)),
                                 logprobs=num_logprobs)
        # The programs by name (:meth:`step_program`). Custom processors may change any row's logits
        # whatever the controls say: they always run, in the general program.
        self._programs = {"general": self.cfg}
        if specialized_steps and set(processors) <= set(processors_lib.BUILTIN_PROCESSORS):
            plain = self.cfg._replace(controls=False, filters=False)
            self._programs.update(greedy=plain._replace(loop=loop._replace(greedy=True, use_top_p=False)),
                                  sampled=plain._replace(loop=loop._replace(use_top_p=False)))

    @property
    def num_slots(self) -> int:
        return self.cfg.num_slots

    @property
    def num_draft(self) -> int:
        """The most drafts a cycle accepts, ``K`` (with a tree, its depth)."""
        return self.cfg.loop.num_draft

    @property
    def tree(self):
        """The token tree every slot drafts, or None (chains)."""
        return self.cfg.loop.tree

    @property
    def capacity(self) -> int:
        return self.cfg.capacity

    def attention_widths(self) -> tuple[int, ...]:
        """The key widths the target's attention may read from a slot's cache,
        ascending: each step reads the narrowest that holds its longest row's
        positions (one width where it reads the whole buffer)."""
        module, length = self.params.target.module, self.cfg.loop.cache_length
        widths = getattr(module, "attention_widths", None)
        return tuple(widths(length)) if widths is not None else (int(length),)

    @property
    def logprobs(self) -> int:
        """The most alternatives per token a request may ask for (``Engine(logprobs=N)``'s N;
        0: no log-probabilities)."""
        return self.cfg.logprobs

    def init(self) -> SlotState:
        """A state of ``num_slots`` free slots."""
        return programs.init_jit(self.params, self.rule, self.drafting, cfg=self.cfg)

    def free_slots(self, state: SlotState) -> list[int]:
        """The slots no request holds (reads ``state.occupied`` from the device)."""
        return np.flatnonzero(~np.asarray(state.occupied)).tolist()

    def insert(self, state: SlotState, slot: int, prompt, settings: Optional[SlotSettings] = None) -> SlotState:
        """Prefills ``prompt`` (a list of token ids) into the free ``slot``.

        Raises ``ValueError`` / ``TypeError`` naming the field (an unknown or
        busy slot, a prompt longer than the capacity, a bad setting) before
        anything runs, leaving the state passed in as it was. On success the
        state passed in stays valid, unless the engine donates its state
        (``donate_state=True``): then it is consumed.
        """
        return self.insert_many(state, [slot], [prompt], [settings])

    def insert_many(self, state: SlotState, slots: Sequence[int], prompts, settings=None) -> SlotState:
        """:meth:`insert` for ``n`` requests at once (one program per ``n`` and width bucket)."""
        self._check_state(state)
        slots = [self._check_slot(s) for s in slots]
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} name a slot twice.")
        busy = [s for s in slots if bool(np.asarray(state.occupied)[s])]
        if busy:
            raise ValueError(f"slot(s) {busy} are busy (a request holds them): release them first "
                             f"(engine.release(state, slot)); free slots: {self.free_slots(state)}.")
        if settings is None:
            settings = [None] * len(slots)
        if len(settings) != len(slots) or len(prompts) != len(slots):
            raise ValueError(f"{len(slots)} slots, {len(prompts)} prompts and {len(settings)} settings: give one "
                             "of each per request.")
        settings = [SlotSettings() if s is None else s for s in settings]
        tokens, lengths = prepare_prompts(list(prompts), None, self.vocab_size)
        tokens = tokens[:, : int(lengths.max())]
        rows = [self._check_settings(s, int(n), i) for i, (s, n) in enumerate(zip(settings, lengths))]
        width = self._insert_width(len(slots), tokens.shape[1])
        padded = np.zeros((len(slots), width), np.int32)
        padded[:, : tokens.shape[1]] = tokens
        row = self._device_rows(rows)
        return self._insert_fn(self.params, self.rule, self.drafting, state, np.asarray(slots, np.int32), padded,
                               lengths, row, cfg=self.cfg)

    def begin_insert(self, state: SlotState, slot: int, prompt, settings: Optional[SlotSettings] = None, *,
                     chunk: int, prefix=None) -> PrefillJob:
        """Starts an insert whose prompt is prefilled ``chunk`` positions per call.

        A long prompt inserted whole holds up every running slot for its
        whole prefill; a serving loop instead calls :meth:`continue_insert`
        once between steps, each call prefilling ``chunk`` more positions,
        so that a running slot waits at most one chunk's prefill per step.
        The request decodes exactly what :meth:`insert` would give it: each
        chunk runs the prefill blocks (``SINGLE_PREFILL_BLOCK`` tokens)
        that a whole insert of the prompt alone runs at those positions, with
        the same shapes and cache entries, and the last one builds the same
        first-cycle state (both caches, a feature head's pending features,
        the token buffer the n-gram lookup reads).

        The prompt's caches live in the returned :class:`PrefillJob`, not in
        ``state``, until the last chunk: the slot stays free on the device, so
        no step drafts, verifies, commits or reports anything for it, nor runs
        its row (plan and row buckets leave it out). The caller keeps the slot
        for the request (a scheduler holds it out of its free slots);
        :meth:`continue_insert`'s last call refuses a slot that was taken
        meanwhile. ``state`` is only read (the slot must be free) and stays valid.

        ``chunk``: a positive multiple of ``SINGLE_PREFILL_BLOCK`` (64).
        One program per chunk width for the middle chunks and one for the last
        (plus one that makes the empty caches); a prompt of at most 48 tokens,
        which a whole insert prefills at its own narrower width, takes one
        call, that insert. Raises as :meth:`insert` does before anything runs.

        ``prefix``: ``(caches, tokens)``, both caches of one prompt already
        holding its first ``tokens`` positions (at most the prompt's length
        - 2), as :meth:`PrefixCache.restore` gives them; the chunks then start
        at ``tokens``, and the request decodes what it would from a cold start
        where those entries are the prefill's (consumed with
        ``donate_state=True``). ``tokens`` is a multiple of 64, or, for a
        prefix cached to a position inside a block, the prompt's length less a
        multiple of 64, so that the chunks' blocks end at the prompt's last
        token (:func:`specjax._src.engine.ops.prefill_chunk`).
        """
        self._check_state(state)
        slot = self._check_slot(slot)
        size = as_integer(chunk)
        if size is None or size < 1 or size % SINGLE_PREFILL_BLOCK:
            raise ValueError(f"chunk must be a positive multiple of {SINGLE_PREFILL_BLOCK} (the prefill block), "
                             f"got {chunk!r}.")
        if bool(np.asarray(state.occupied)[slot]):
            raise ValueError(f"slot {slot} is busy (a request holds it): release it first "
                             f"(engine.release(state, slot)); free slots: {self.free_slots(state)}.")
        settings = SlotSettings() if settings is None else settings
        tokens, lengths = prepare_prompts([prompt], None, self.vocab_size)
        length = int(lengths[0])
        row = self._device_rows([self._check_settings(settings, length, 0)])
        padded = np.zeros((1, self.capacity + size + 1), np.int32)
        padded[0, :length] = tokens[0, :length]
        start = 0
        if prefix is None:
            caches = self.empty_prefill_caches()
        else:
            caches, start = self._check_prefix(prefix, length)
        chunks = max(1, -(-(length - start) // size))  # through the last position: its logits give the first token
        return PrefillJob(slot=slot, length=length, chunk=size, position=start, chunks=chunks, finished=False,
                          prompt=padded, width=self._insert_width(1, length), settings=settings, row=row,
                          caches=caches, start=start)

    def empty_prefill_caches(self):
        """Both caches of one prompt before its first chunk (batch 1, ``capacity + K`` positions)."""
        return programs.prefill_start_jit(self.params, cfg=self.cfg)

    def _check_prefix(self, prefix, length: int):
        """``(caches, start)`` of ``begin_insert``'s ``prefix``, checked against a prompt of ``length``."""
        if not (isinstance(prefix, tuple) and len(prefix) == 2):
            raise TypeError("prefix must be (caches, tokens): both caches of one prompt holding its first "
                            "`tokens` positions (specjax.engine.PrefixCache.restore).")
        caches, tokens = prefix
        start, block = as_integer(tokens), SINGLE_PREFILL_BLOCK
        if start is None or start < 0 or start > length - 2 or (start % block and (length - start) % block):
            raise ValueError(f"prefix tokens must lie in 0 .. {length - 2} (positions below the prompt's length - 2 "
                             f"that both caches keep) and be a multiple of {block} or the prompt's length "
                             f"({length}) less a multiple of {block} (as PrefixCache.match counts), got {tokens!r}.")
        want = jax.eval_shape(self.empty_prefill_caches)
        same = jax.tree_util.tree_structure(caches) == jax.tree_util.tree_structure(want) and all(
            np.shape(a) == b.shape and a.dtype == b.dtype
            for a, b in zip(jax.tree_util.tree_leaves(caches), jax.tree_util.tree_leaves(want)))
        if not same:
            raise ValueError("prefix caches are not this engine's (their structure, shapes or dtypes differ from "
                             "engine.empty_prefill_caches()).")
        return caches, start

    def continue_insert(self, state: SlotState, job: PrefillJob) -> tuple[SlotState, PrefillJob]:
        """Prefills the next chunk of ``job`` (:meth:`begin_insert`); returns ``(state, job)``.

        Before the last chunk the state is returned as it was (not consumed)
        and the job holds the caches so far (the job passed in is consumed
        with ``donate_state=True``). The last call writes the request into
        its slot as :meth:`insert` does (consuming ``state`` with
        ``donate_state=True``) and returns a job with ``finished`` set; the
        next :meth:`step` generates for it. Raises ``ValueError`` if the job is
        finished or the slot was taken meanwhile, leaving both as they were.
        """
        self._check_state(state)
        if not isinstance(job, PrefillJob):
            raise TypeError(f"job must be a PrefillJob (engine.begin_insert(...)), got {type(job).__name__}.")
        if job.finished:
            raise ValueError(f"this prefill is finished: its request is in slot {job.slot}.")
        args = (job.prompt, np.int32(job.length), np.int32(job.width), np.int32(job.position))
        if job.chunks_left > 1:
            caches = self._chunk_fn(self.params, job.caches, *args, cfg=self.cfg, chunk=job.chunk)
            return state, job._replace(position=job.position + job.chunk, caches=caches)
        if bool(np.asarray(state.occupied)[job.slot]):
            raise ValueError(f"slot {job.slot} was taken while its prompt was prefilled: release it, or begin "
                             f"the insert again in a free slot ({self.free_slots(state)}).")
        if job.width < SINGLE_PREFILL_BLOCK:
            # A prompt shorter than a prefill block runs as one block of its own width, which the
            # chunk programs (whole 64-token blocks) do not run: its one call is the whole insert.
            state = self.insert(state, job.slot, job.prompt[0, : job.length].tolist(), job.settings)
        else:
            state = self._finish_fn(self.params, self.rule, self.drafting, state, job.caches, *args,
                                    np.asarray([job.slot], np.int32), job.row, cfg=self.cfg, chunk=job.chunk)
        return state, job._replace(position=job.start + job.chunks * job.chunk, finished=True, caches=None)

    def _device_rows(self, rows: list) -> dict:
        """The checked settings of ``n`` requests stacked as the insert programs read them."""
        skip = ("controls", "rule") + (() if self.cfg.logprobs else ("logprobs",))
        row = {name: np.stack([r[name] for r in rows]) for name in rows[0] if name not in skip}
        if self.cfg.controls:
            row["controls"] = processors_lib.controls_rows([r["controls"] for r in rows], self.cfg.num_bias)
        if self.cfg.per_slot_rule:
            row["rule"] = jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]),
                                                 *[r["rule"] for r in rows])
        return row

    def _insert_width(self, num_prompts: int, longest: int) -> int:
        """The padded width ``insert_many`` runs ``num_prompts`` prompts at."""
        if num_prompts == 1 and longest <= prefill_block(1):  # one block: its own width (see ops.prefill_block)
            return min(-(-longest // PREFILL_BLOCK) * PREFILL_BLOCK, self.capacity)
        return min(bucket_of(longest, self.cfg.prompt_bucket), self.capacity)

    def _single_prompt_widths(self) -> tuple[int, ...]:
        """The widths a short prompt inserted alone runs at that no bucket has: the ``insert``
        programs a server compiles beside the buckets'."""
        short = range(1, prefill_block(1) + 1)
        alone, grouped = ({self._insert_width(n, length) for length in short} for n in (1, 2))
        return tuple(sorted(alone - grouped))

    def step(self, state: SlotState, num_cycles: int = 1, *, until_first_finish: bool = False,
             plan: Optional[StepPlan] = None,
             costs: Optional[CostModel] = None) -> tuple[SlotState, StepOutput]:
        """Runs up to ``num_cycles`` draft-verify cycles for every live slot
        (fewer when every slot is done).

        ``until_first_finish``: also return after the first cycle in which a
        slot's request finishes, so that a waiting request can take the slot
        at once instead of it idling for the rest of the step. Both arguments
        are traced: any values share one program.

        ``plan``: the program and row bucket to run (:meth:`plan`, from the
        occupied slots' settings the caller holds), so that nothing is read
        from the device to choose them. The caller vouches for it: a plan
        whose rows leave out an occupied slot stalls it, and the greedy or
        sampled program decodes rows that need more (top-k, top-p, controls)
        without it. None: chosen from the state (:meth:`step_program`).

        ``costs``: with :func:`~specjax.drafting.auto`, the costs this step
        plans with instead of :attr:`costs` (same shapes, traced: no new
        program), e.g. ``LiveCosts.forced_costs(k)`` to time a length.
        """
        self._check_state(state)
        drafting = self.drafting if costs is None else costs_lib.set_costs(self.drafting, self._check_costs(costs))
        n = as_integer(num_cycles)
        if n is None or n < 1:
            raise ValueError(f"num_cycles must be a positive integer, got {num_cycles!r}.")
        if not isinstance(until_first_finish, (bool, np.bool_)):
            raise TypeError(f"until_first_finish must be True or False, got {until_first_finish!r}.")
        program, rows_run = self._step_program(state) if plan is None else self._check_plan(plan)
        return self._step_fn(self.params, self.rule, drafting, state, np.int32(n),
                             np.bool_(until_first_finish), cfg=self._programs[program], rows_run=rows_run)

    def flush(self, state: SlotState) -> tuple[SlotState, StepOutput]:
        """The tokens committed since the last output, without running a cycle.

        An insert draws each request's first token from the target's logits
        at the prompt's last position, which its prefill computes: that token
        comes out with the next :meth:`step`, or at once from ``flush``, so a
        server can stream it as soon as the prefill ends. Returns ``(state,
        StepOutput)`` as :meth:`step` does (one program; with
        ``donate_state=True`` the state passed in is consumed).
        """
        self._check_state(state)
        return self._flush_fn(state, cfg=self.cfg)

    @property
    def costs(self) -> Optional[CostModel]:
        """The costs :func:`~specjax.drafting.auto` plans with (measured at each
        row bucket when the engine was built), or None without ``auto``."""
        return costs_lib.auto_costs(self.drafting)

    def set_costs(self, costs: CostModel) -> None:
        """Plans later steps with ``costs`` (e.g. ``LiveCosts.costs()``): the
        same shapes as :attr:`costs`, so no step compiles again."""
        self.drafting = costs_lib.set_costs(self.drafting, self._check_costs(costs))

    def _check_costs(self, costs) -> CostModel:
        current = self.costs
        if current is None:
            raise ValueError("costs= applies to an Engine built with drafting=auto(); this one drafts with "
                             f"{self.drafting.spec.name}.")
        if not isinstance(costs, CostModel):
            raise TypeError(f"costs must be a CostModel (Engine.costs, LiveCosts.costs()), got {type(costs).__name__}.")
        shapes = lambda c: [np.shape(x) for x in jax.tree_util.tree_leaves(c)]  # noqa: E731
        if shapes(costs) != shapes(current):
            raise ValueError(f"costs cover shapes {shapes(costs)}, the engine's {shapes(current)} (one row per row "
                             f"bucket {self.row_buckets}, num_draft {self.num_draft}); derive them from Engine.costs.")
        return costs

    @property
    def row_buckets(self) -> tuple[int, ...]:
        """The slot counts a step may run (ascending; the last is ``num_slots``)."""
        return self.cfg.row_buckets

    def rows_to_run(self, state: SlotState) -> int:
        """The smallest row bucket holding every occupied slot (reads
        ``state.occupied``, waiting for the call that made it)."""
        return self._step_program(state)[1]

    @property
    def specialized_steps(self) -> bool:
        """Whether steps run the program for their slots' settings (``Engine(specialized_steps=True)``)."""
        return len(self._programs) > 1

    def step_program(self, state: SlotState) -> str:
        """The program :meth:`step` runs on ``state``: ``"greedy"``, ``"sampled"`` or
        ``"general"`` (see ``specialized_steps``; always ``"general"`` without it)."""
        return self._step_program(state)[0]

    def _step_program(self, state: SlotState) -> StepPlan:
        """The plan for the occupied slots, their settings read from the device."""
        buckets, specialized = self.cfg.row_buckets, self.specialized_steps
        if len(buckets) == 1 and not specialized:
            return StepPlan("general", buckets[0])
        settings = None
        if specialized:
            settings = (state.temperature, state.top_k, state.top_p, state.controls if self.cfg.controls else None)
        occupied, settings = jax.device_get((state.occupied, settings))
        slots = np.flatnonzero(occupied)
        if not specialized:
            return self._choose(slots)
        temperature, top_k, top_p, controls = settings
        with_controls = (np.zeros(slots.shape, bool) if controls is None
                         else processors_lib.rows_with_controls(controls)[slots])
        return self._choose(slots, temperature[slots], top_k[slots], top_p[slots], with_controls)

    def plan(self, settings_by_slot: Mapping[int, SlotSettings]) -> StepPlan:
        """The program and row bucket :meth:`step` would choose, from host values.

        ``settings_by_slot``: every occupied slot (finished ones too, until
        released) and its request's settings. Decides as :meth:`step_program`
        and :meth:`rows_to_run` do from the state, without reading the device:
        controls that change logits, ``"general"``; every slot greedy,
        ``"greedy"``; a sampled slot with top-k or top-p below 1,
        ``"general"``; else ``"sampled"`` (``"general"`` always without
        ``specialized_steps``); rows: the smallest row bucket holding the
        highest slot (no slots: the smallest bucket). Pass it to ``step(plan=...)``.
        """
        slots = sorted(self._check_slot(slot) for slot in settings_by_slot)
        settings = [settings_by_slot[slot] for slot in slots]
        for s in settings:
            if not isinstance(s, SlotSettings):
                raise TypeError(f"plan: settings must be specjax.engine.SlotSettings(...), got {type(s).__name__}.")
        if not self.specialized_steps:
            return self._choose(np.asarray(slots, np.int64))
        # As the state holds them (float32), so that a top_p that rounds to 1 plans as it steps.
        temperature = np.array([s.temperature for s in settings], np.float32)
        top_k = np.array([s.top_k or 0 for s in settings], np.int32)
        top_p = np.array([1.0 if s.top_p is None else s.top_p for s in settings], np.float32)
        with_controls = np.array([self.cfg.controls and s.controls is not None
                                  and not processors_lib.is_default(s.controls) for s in settings], bool)
        return self._choose(np.asarray(slots, np.int64), temperature, top_k, top_p, with_controls)

    def _choose(self, slots: np.ndarray, temperature=None, top_k=None, top_p=None, with_controls=None) -> StepPlan:
        """The plan for the occupied ``slots`` (ascending) and their settings
        (``[n]`` host arrays, None without ``specialized_steps``)."""
        used = int(slots[-1]) + 1 if slots.size else 1
        rows = next(b for b in self.cfg.row_buckets if b >= used)
        if temperature is None or with_controls.any():
            return StepPlan("general", rows)
        greedy = temperature == 0.0
        if greedy.all():
            return StepPlan("greedy", rows)
        filtered = ~greedy & ((top_k > 0) | (top_p < 1.0))
        return StepPlan("general" if filtered.any() else "sampled", rows)

    def _check_plan(self, plan) -> StepPlan:
        if not isinstance(plan, StepPlan):
            raise TypeError(f"plan must be a StepPlan (engine.plan(...)), got {type(plan).__name__}.")
        if plan.program not in self._programs or plan.rows not in self.cfg.row_buckets:
            raise ValueError(f"plan {plan} is not one of this engine's: programs {sorted(self._programs)}, "
                             f"row buckets {self.cfg.row_buckets}.")
        return plan

    def fork(self, state: SlotState, source: int, slots: Sequence[int], keys) -> SlotState:
        """Copies the request in slot ``source`` into the free ``slots``, each
        with its own PRNG key: ``n`` choices of one prompt from one prefill.

        Each copy holds what ``source`` holds (caches, tokens, settings, its
        cycle count) but its key, ``keys[i]`` for ``slots[i]`` (typed keys of
        the default kind, ``jax.random.key(...)``, one per slot), so it samples
        what an insert with ``SlotSettings(key=keys[i])`` would. One program per
        ``len(slots)``. Raises ``ValueError`` / ``TypeError`` before anything runs
        (an unoccupied source; an unknown, busy or repeated slot; not one key
        per slot); with ``donate_state=True`` the state passed in is consumed.
        """
        self._check_state(state)
        source = self._check_slot(source)
        slots = [self._check_slot(s) for s in slots]
        if not slots:
            raise ValueError("fork: give at least one slot to copy the request into.")
        if len(set(slots)) != len(slots):
            raise ValueError(f"fork: slots {slots} name a slot twice.")
        occupied = np.asarray(state.occupied)
        if not occupied[source]:
            raise ValueError(f"fork: source slot {source} holds no request; insert one into it first.")
        busy = [s for s in slots if occupied[s]]
        if busy:
            raise ValueError(f"fork: slot(s) {busy} are busy (a request holds them): release them first "
                             f"(engine.release(state, slot)); free slots: {self.free_slots(state)}.")
        keys = list(keys)
        if len(keys) != len(slots):
            raise ValueError(f"fork: {len(slots)} slots and {len(keys)} keys: give one key per slot.")
        data = np.stack([settings_lib.key_fields(SlotSettings(key=key))["keys"] for key in keys])
        stepped = int(np.asarray(state.loop.num_committed)[source]) - int(np.asarray(state.prompt_lengths)[source])
        if stepped > 1:
            raise ValueError(f"fork: slot {source}'s request has run steps since its insert ({stepped} tokens "
                             "committed); fork copies a request right after its insert, before any step.")
        return self._fork_fn(self.params, state, np.int32(source), np.asarray(slots, np.int32), data, cfg=self.cfg)

    def release(self, state: SlotState, slot: int) -> SlotState:
        """Frees ``slot`` (finished or not): it stops and takes the next :meth:`insert`.

        Marks the slot done and not occupied; its tokens and caches stay as
        they were until an insert overwrites them. Two ``[S]`` flag arrays go
        to the host and back (waiting for the step that made them); nothing
        is compiled. The state returned shares every other buffer with the
        one passed in, so with ``donate_state=True`` the next insert or step
        on it consumes both.
        """
        self._check_state(state)
        slot = self._check_slot(slot)
        loop = state.loop
        return state.replace(loop=loop.replace(done=programs.with_entry(loop.done, slot, True)),
                             occupied=programs.with_entry(state.occupied, slot, False))

    # -- checks -------------------------------------------------------------

    def _check_state(self, state) -> None:
        if not isinstance(state, SlotState):
            raise TypeError(f"state must be a SlotState (engine.init(), or what insert / step / release "
                            f"returned), got {type(state).__name__}.")
        leaves = (state.loop.tokens, state.loop.target_cache.lengths, state.occupied)
        if not all(isinstance(x, jax.Array) for x in leaves):
            raise TypeError("state holds host arrays (e.g. from jax.device_get): pass the SlotState that "
                            "engine.init / insert / step / release returned.")
        if any(x.is_deleted() for x in leaves):
            raise ValueError("this SlotState was consumed by an earlier insert or step (the Engine was built "
                             "with donate_state=True, which reuses its buffers): pass the state that call "
                             "returned.")

    def _check_slot(self, slot) -> int:
        number = as_integer(slot)
        if number is None or not 0 <= number < self.num_slots:
            raise ValueError(f"slot {slot!r} is not one of this engine's {self.num_slots} slots "
                             f"(0 .. {self.num_slots - 1}).")
        return number

    def validate(self, settings: SlotSettings, prompt_length: int) -> tuple[FieldError, ...]:
        """Every problem with a request's settings, as data: ``()`` when
        :meth:`insert` would take them with a prompt of ``prompt_length``
        tokens, else one :class:`FieldError` per problem, naming the
        :class:`SlotSettings` field (``"controls.presence_penalty"`` for a
        control), in the order :meth:`insert` checks them (it raises the first).
        Raises ``TypeError`` only when ``settings`` is not a :class:`SlotSettings`."""
        self._check_settings_type(settings)
        length = as_integer(prompt_length)
        if length is None or length < 1:
            raise ValueError(f"prompt_length must be a positive integer, got {prompt_length!r}.")
        problems, _ = settings_lib.settings_problems(self, settings, length, None)
        return tuple(FieldError(field, str(error)) for field, error in problems)

    def _check_settings(self, s: SlotSettings, prompt_length: int, index: int) -> dict:
        """The device row of one request's settings; raises the first problem :meth:`validate` finds."""
        self._check_settings_type(s)
        problems, row = settings_lib.settings_problems(self, s, prompt_length, index)
        if problems:
            raise problems[0][1]
        return row

    @staticmethod
    def _check_settings_type(s) -> None:
        if not isinstance(s, SlotSettings):
            raise TypeError(f"settings must be specjax.engine.SlotSettings(...), got {type(s).__name__}.")


    @property
    def served_rules(self) -> tuple:
        """The rules a request may choose (:meth:`rule_for`): the members of
        an engine rule built with :func:`specjax.rules.one_of`, else the engine's
        rule alone. The first is what a request that names none gets."""
        return tuple(self.rule.rules) if isinstance(self.rule, OneOf) else (self.rule,)

    def rule_for(self, rule) -> AcceptanceRule:
        """The value of ``SlotSettings.rule`` that has ``rule`` judge a request
        (:func:`specjax._src.engine.slot_settings.rule_for`, which says how)."""
        return settings_lib.rule_for(self, rule)
