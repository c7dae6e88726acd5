"""A host loop that serves a stream of requests on the slots engine.

Requests wait in a bounded queue; one thread (the loop) owns the
:class:`specjax.engine.SlotState` and, between ``engine.step`` calls, admits
waiting requests into free slots (prefill), releases finished or cancelled
ones, and hands each request's new text to its consumer. The device work is
the engine's jitted programs; the loop only does bookkeeping between them,
and measures its own share of the wall time.

The shape is JetStream's orchestrator (prefill, generate and detokenize)
folded into one thread: on a CPU or a single device the steps are serialized
anyway, and one owner of the state needs no locks around it.

A request's output does not depend on the others: each slot samples with its
own key (``SlotSettings.seed``) and counts its own cycles (see
``docs/engine.md``).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import secrets
import threading
import time
from typing import Any, Optional, Sequence

import jax
import numpy as np

from specjax._src.engine.live_costs import LiveCosts, promised_tokens, step_draft_length, widths_read
from specjax._src.engine.ops import SINGLE_PREFILL_BLOCK
from specjax._src.engine.prefix_cache import BLOCK, PrefixCache, blocks_in_common, usable_blocks
from specjax._src.engine.slots import Engine, PrefillJob, SlotSettings
from specjax._src.engine.text import TextStream
from specjax._src.foundation.memory import release_free_heap
from specjax._src.serve.events import Closed, Delta, Done, Failed, LiveChoice, QueueFull, Request
from specjax._src.serve.metrics import Counters, add_into, cycle_tokens, draft_lengths, latency_histograms
from specjax._src.serve.step_length import StepLength
from specjax._src.serve.warm_branches import run_every_branch

# The events and the request are the scheduler's vocabulary: importable from here too.
__all__ = ["Scheduler", "Request", "Delta", "Done", "Failed", "QueueFull", "Closed"]


@dataclasses.dataclass
class _Pending:
    """A request whose prompt is prefilled chunk by chunk (:meth:`specjax.engine.Engine.begin_insert`):
    it holds ``slots`` (its first, and the copies' of a request of ``n`` choices) until its last chunk."""

    request: Request
    job: PrefillJob
    slots: tuple
    keys: Optional[list] = None  # a request of n choices: the copies' keys
    hit: Any = None  # the prefix cache's blocks it started from (pinned until its last chunk)
    passed: int = 0  # chunks of other prompts run since it began (its priority grows with them)


class _Stopped(Exception):
    """The scheduler was closed while it compiled its programs."""


class Scheduler:
    """Serves requests on ``engine`` from its own thread.

    The scheduler alone knows which slots hold which request: it admits
    waiting requests into its free slots, releases them, and picks each
    step's program and rows from the live requests' settings
    (:meth:`specjax.engine.Engine.plan`), without reading the device's state.

    Args:
      engine: a :class:`specjax.engine.Engine`.
      tokenizer: the target's tokenizer (detokenizes each request's stream).
      max_queue: requests that may wait beyond the free slots; one more is
        refused with :class:`QueueFull` (memory stays bounded whatever the
        load). A request that a free slot will take is not waiting: with 0,
        a request is served when a slot is free and refused otherwise.
      num_cycles: the most draft-verify cycles per ``engine.step``. A step
        delivers its tokens at its end and returns as soon as a request
        finishes (``until_first_finish``), so that a finished request's last
        tokens go out and its slot takes the next request at once; while a
        slot is free and no request waits, steps run as many cycles as fit in
        ``admission_wait`` (``serve.step_length.StepLength``).
      admission_wait: seconds a request arriving while a slot is free may wait
        for it at most (about): the cycles a step then runs. 0: one cycle.
      warmup_widths: prompt widths to compile ``insert`` for before
        :attr:`ready` (None: every width bucket up to the capacity).
      prefill_groups: how many requests one prefill may take (None: 1, 2,
        4, ... up to the slot count). Requests admitted together are
        prefilled in the fewest such groups (7 as 4 + 2 + 1), the shorter
        prompts together, since a group's prefill runs as many positions as
        its longest prompt. One ``insert`` program per group size and
        width, all compiled before :attr:`ready` (docs/server.md: what a group saves).
      eos_ids: the ids that end a request (the target's EOS), to tell
        ``"stop"`` from ``"length"``.
      prefill_chunk: a prompt longer than this many tokens (a positive
        multiple of 64) is prefilled this many positions at a time
        (:meth:`specjax.engine.Engine.begin_insert`), one chunk between two
        steps, so that the running requests keep streaming while it is
        prefilled: a stream's gap between tokens grows by one chunk's
        prefill at most. The request decodes what a whole insert gives it;
        its slots are held for it meanwhile. 0: every prompt is prefilled whole.
      prefix_cache: a :class:`specjax._src.engine.prefix_cache.PrefixCache`: every prefilled
        prompt's blocks are kept in it, and at its release every finished request's prompt and
        generated tokens (up to the positions both caches hold); a prompt that begins with
        cached blocks is copied from them and prefilled from there on, chunk by chunk
        (``prefill_chunk`` positions a call, 64 where that is 0), the chunked prefill with the
        fewest chunks left first. None: every prompt is prefilled from its first token.
    """

    def __init__(self, engine: Engine, tokenizer, *, max_queue: int = 64, num_cycles: int = 4,
                 warmup_widths: Optional[Sequence[int]] = None, eos_ids: Sequence[int] = (),
                 prefill_groups: Optional[Sequence[int]] = None, prefill_chunk: int = 128,
                 prefix_cache: Optional[PrefixCache] = None, live_costs: bool = True,
                 admission_wait: float = 0.1):
        if int(max_queue) < 0 or int(num_cycles) < 1:
            raise ValueError(f"max_queue must be >= 0 and num_cycles >= 1, got {max_queue}, {num_cycles}.")
        if int(prefill_chunk) < 0 or int(prefill_chunk) % SINGLE_PREFILL_BLOCK:
            raise ValueError(f"prefill_chunk must be 0 (off) or a positive multiple of {SINGLE_PREFILL_BLOCK}, got "
                             f"{prefill_chunk}.")
        self.prefill_chunk = int(prefill_chunk)
        if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
            raise TypeError(f"prefix_cache must be a PrefixCache or None, got {type(prefix_cache).__name__}.")
        self.prefix_cache = prefix_cache
        # auto() on a chain: costs refreshed from the steps' own times (LiveCosts); a tree's from its parts alone.
        timed = live_costs and engine.costs is not None and engine.tree is None
        self.live_costs = LiveCosts(engine.costs) if timed else None
        self._timed_steps = 0
        self._attention_widths = engine.attention_widths()
        self._target_lengths: Optional[np.ndarray] = None  # each slot's cached positions after the last step
        self._unflushed = False  # a request went live whose first token is not yet streamed
        if prefill_groups is None:
            prefill_groups = [2**i for i in range(engine.num_slots.bit_length()) if 2**i <= engine.num_slots]
        groups = sorted({int(n) for n in prefill_groups})
        if not groups or groups[0] != 1 or groups[-1] > engine.num_slots:
            raise ValueError(f"prefill_groups must include 1 and stay within the {engine.num_slots} slots, got "
                             f"{list(prefill_groups)}.")
        self.prefill_groups = tuple(groups)
        self.engine, self.tokenizer = engine, tokenizer
        self.max_queue, self.num_cycles = int(max_queue), int(num_cycles)
        self.step_length = StepLength(self.num_cycles, admission_wait)
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.warmup_widths = warmup_widths
        self.counters = Counters()
        self.latency = latency_histograms()
        self.ready = threading.Event()
        self._waiting: collections.deque[Request] = collections.deque()
        self._live: dict[int, LiveChoice] = {}
        self._pending: dict[int, _Pending] = {}  # by first slot, oldest first
        self._free = list(range(engine.num_slots))  # slots no request holds or is about to take
        self._cond = threading.Condition()
        self._closing = False
        self._stop = False
        self._paused = 0
        self._closer: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="specjax-scheduler", daemon=True)

    # -- the consumer's side (any thread) -----------------------------------

    def start(self) -> "Scheduler":
        """Starts the loop: it compiles the engine's programs, sets :attr:`ready`, then serves."""
        self._thread.start()
        return self

    def submit(self, request: Request) -> None:
        """Queues ``request``; raises :class:`QueueFull` or :class:`Closed` instead of waiting."""
        self.submit_many([request])

    def submit_many(self, requests: Sequence[Request]) -> None:
        """Queues ``requests`` (the prompts of one HTTP request) all or none: raises
        :class:`QueueFull` or :class:`Closed`, queuing none of them, where they do not all fit."""
        for request in requests:
            if not 1 <= request.n <= self.engine.num_slots:
                raise ValueError(f"n={request.n}: a request takes 1 .. {self.engine.num_slots} slots (one per "
                                 "choice).")
        with self._cond:
            if self._closing:
                raise Closed("the server is shutting down and takes no new requests.")
            demand = sum(r.n for r in self._waiting) + sum(r.n for r in requests)
            if demand > self.max_queue + len(self._free):
                self.counters.requests_refused += len(requests)
                raise QueueFull(f"the server is full: {len(self._live)} of {self.engine.num_slots} slots busy and "
                                f"{len(self._waiting)} requests waiting (at most {self.max_queue} beyond the free "
                                f"slots){'' if len(requests) == 1 else f'; this request holds {len(requests)} prompts'}"
                                "; retry later.")
            self._waiting.extend(requests)
            self._cond.notify()

    def cancel(self, request: Request) -> None:
        """Ends ``request`` (e.g. its client went away): a waiting one leaves the queue at once
        (its place goes to the next), a live one's slots are freed before the next step."""
        with self._cond:
            if request.cancelled:
                return
            request.cancelled = True
            if request in self._waiting:
                self._waiting.remove(request)
                self.counters.requests_cancelled += 1
            self._cond.notify()

    def paused(self):
        """A context manager that holds admission: live requests go on, waiting ones stay queued."""
        scheduler = self

        class _Paused:
            def __enter__(self):
                with scheduler._cond:
                    scheduler._paused += 1

            def __exit__(self, *exc):
                with scheduler._cond:
                    scheduler._paused -= 1
                    scheduler._cond.notify()

        return _Paused()

    def begin_close(self, drain_seconds: float = 30.0) -> None:
        """Starts :meth:`close` in the background (once) and returns: new and waiting requests
        are refused from now on. A server calls it as its shutdown begins, so that the drain
        runs while the HTTP connections are still open to carry the last events."""
        with self._cond:
            if self._closer is None:
                self._closing = True
                self._closer = threading.Thread(target=self._close, args=(drain_seconds,),
                                                name="specjax-scheduler-close", daemon=True)
                self._closer.start()

    def close(self, drain_seconds: float = 30.0) -> None:
        """Refuses new and waiting requests, lets live ones finish for up to
        ``drain_seconds``, ends the rest with a ``shutting_down`` failure, and
        stops the loop. Waits for all that (a second call waits for the first)."""
        self.begin_close(drain_seconds)
        self._closer.join()

    def _close(self, drain_seconds: float) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._cond.notify()
        for request in waiting:
            _emit(request, Failed("the server is shutting down and did not admit this request; retry.",
                                  "shutting_down"))
        deadline = time.monotonic() + drain_seconds
        while self._thread.is_alive() and (self._live or self._pending) and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    @property
    def closing(self) -> bool:
        """Whether :meth:`close` has begun (new requests are refused)."""
        return self._closing

    @property
    def error(self) -> Optional[BaseException]:
        """The exception that stopped the loop, if one did."""
        return self._error

    def metrics(self) -> dict:
        """A snapshot: the counters, ``queue_depth``, ``live_slots``, ``num_slots``,
        ``host_share`` (the loop's time outside the engine's calls over its busy time) and
        ``latency`` (the :class:`~specjax._src.serve.metrics.Histogram` s, copied)."""
        with self._cond:
            c = dataclasses.asdict(self.counters)
            c.update(queue_depth=len(self._waiting), live_slots=len(self._live), num_slots=self.engine.num_slots,
                     ready=self.ready.is_set(), latency=copy.deepcopy(self.latency),
                     prefix_cache=None if self.prefix_cache is None else self.prefix_cache.stats(),
                     cycle_costs=None if self.live_costs is None else self.live_costs.report())
        busy = c["busy_seconds"]
        c["host_share"] = (busy - c["step_seconds"] - c["insert_seconds"]) / busy if busy > 0 else 0.0
        return c

    # -- the loop (its own thread) ------------------------------------------

    def _run(self) -> None:
        try:
            state = self._warm_up()
            release_free_heap()  # the warm-up's freed pages (about 2 GB on the real pair's 4-bit server)
            self.ready.set()
            self._serve(state)
        except _Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 -- reported to every request, then to the server
            self._error = e
            with self._cond:
                self._closing = True
                doomed = list(self._waiting) + self._held_requests()
                self._waiting.clear()
                self._live.clear()
                self._pending.clear()
            for request in doomed:
                _emit(request, Failed(f"the server's engine failed: {type(e).__name__}: {e}", "engine_error"))

    def _warm_up(self):
        """Compiles init, insert (per prompt width), the chunked prefill's programs, fork (per copy count), flush
        and step (per row bucket, and for an engine with ``specialized_steps`` each of its three programs)
        before any request, and runs each step's cycle once (release compiles nothing). Stops early
        when the scheduler is closed."""
        engine = self.engine
        state = engine.init()
        widths = self.warmup_widths
        if widths is None:
            widths, w = [], engine.cfg.prompt_bucket
            while w < engine.capacity:
                widths.append(w)
                w *= 2
            widths.append(engine.capacity)
        # Two tokens: the insert draws the first, a cycle the second (XLA's CPU runtime prepares a
        # loop body's kernels at its first run, which would otherwise fall on a request).
        greedy = SlotSettings(temperature=0.0, max_new_tokens=2, seed=0)
        # One request per step program: greedy, sampled without filters, and (top-p) the general one.
        programs = [greedy, SlotSettings(temperature=1.0, max_new_tokens=2, seed=0),
                    SlotSettings(temperature=1.0, top_p=0.5, max_new_tokens=2, seed=0)]

        def serve_one(state, slot: int, prompt, settings=greedy, group: int = 1, copies: int = 0):
            self._check_stop()
            slots = range(slot, slot + group)
            state = engine.insert_many(state, slots, [prompt] * group, [settings] * group)
            if copies:
                keys = [jax.random.key(i) for i in range(copies)]
                state = engine.fork(state, slot, range(slot + 1, slot + 1 + copies), keys)
                slots = range(slot, slot + 1 + copies)
            state, _ = engine.flush(state)
            plan = engine.plan({s: settings for s in slots})
            state, out = engine.step(state, self.num_cycles, plan=plan)
            jax.block_until_ready(out)
            for s in slots:
                state = engine.release(state, s)
            return state

        for width in sorted(set(int(w) for w in widths)):  # insert's programs, and step's first row bucket
            for group in self.prefill_groups:
                state = serve_one(state, 0, [0] * max(1, min(width, engine.capacity - 2)), group=group)
        for width in engine._single_prompt_widths():  # a short prompt alone runs at its own width
            state = serve_one(state, 0, [0] * width)
        chunk = self.prefill_chunk
        for length in self._chunked_warmup_lengths():  # a long prompt's chunks: the middle ones' program, the last's
            self._check_stop()
            job = engine.begin_insert(state, 0, [0] * length, greedy, chunk=chunk)
            while not job.finished:
                state, job = engine.continue_insert(state, job)
            state, out = engine.step(state, self.num_cycles, plan=engine.plan({0: greedy}))
            jax.block_until_ready(out)
            state = engine.release(state, 0)
        cache = self.prefix_cache
        if cache is not None and usable_blocks(engine.capacity - 2):  # its copies, and a prefill from a hit
            self._check_stop()
            prompt = [0] * min(engine.capacity - 2, BLOCK + 3)
            state = engine.insert(state, 0, prompt, greedy)
            cache.store(engine, state, 0, prompt)
            state = engine.release(state, 0)
            job, hit = cache.begin_insert(engine, state, 0, prompt, greedy, chunk=self.prefill_chunk or BLOCK)
            while not job.finished:
                state, job = engine.continue_insert(state, job)
            cache.release(hit)
            state, out = engine.step(state, self.num_cycles, plan=engine.plan({0: greedy}))
            jax.block_until_ready(out)
            state = engine.release(state, 0)
            cache.clear()
            cache.reset_stats()
        for copies in range(1, engine.num_slots):  # a request of n choices: one fork program per n - 1
            state = serve_one(state, 0, [0], copies=copies)
        for rows in engine.row_buckets:  # the step that runs the first `rows` slots, in each program
            for settings in (programs if engine.specialized_steps else [greedy]):
                if rows > 1 or settings is not greedy:  # (greedy at one row: compiled above)
                    state = serve_one(state, rows - 1, [0], settings)
        jax.block_until_ready(state)
        if self.live_costs is not None:
            state = self._time_lengths(state)
            state = run_every_branch(engine, self.live_costs, state, programs, self._note_untimed, self._check_stop)
        return state

    def _note_untimed(self, rows, ran, drafted, program, longest) -> None:
        self._time_step(rows, 1, ran, drafted, 0.0, timed=False, program=program, longest=longest)

    def _check_stop(self) -> None:
        if self._stop:
            raise _Stopped()

    def _chunked_warmup_lengths(self) -> list[int]:
        """The prompt lengths the warm-up prefills chunk by chunk: three chunks' worth, and with
        several key widths (``Engine.attention_widths``) one prompt whose last chunk ends in each
        width (one position past the width before) and the longest, whose middle chunks reach
        the last width.

        A chunk's attention reads the narrowest key width holding the positions up to its end (a
        branch of its program), and XLA's CPU runtime prepares a branch the first time it runs it:
        on the real pair, a prompt's chunked prefill took 0.23-0.28 s longer the first time its
        last chunk read a new width (200 tokens 0.66 s, then 0.44; 390 tokens 1.03 s, then 0.75;
        530 tokens 1.29 s, then 1.01), which a server paid at the first request of each length,
        a conversation at the turns that crossed a width."""
        chunk, longest = self.prefill_chunk, self.engine.capacity - 2
        if not chunk or longest <= chunk:
            return []
        widths = self._attention_widths
        lengths = {min(longest, 2 * chunk + 1)}
        if len(widths) > 1:
            lengths |= {w + 1 for w in widths[:-1] if chunk < w + 1 <= longest} | {longest}
        return sorted(lengths)

    def _time_lengths(self, state, rounds: int = 3):
        """Times each row bucket's step forced to each draft length, before any request, into
        :attr:`live_costs` as serving's own steps would (two steps per length, the second timed;
        ``rounds`` turns over the lengths), and hands the engine the costs.

        Without it a server's first requests plan with the parts' costs until every length of
        their row bucket has been timed by exploration: on a 2-core CPU the parts put three
        drafts at eight rows at 1.75 plain cycles where the loop's cost more (fixed K=3 ran 0.83 of
        fixed K=1 there), so auto drafted three tokens in a third of its first cycles at eight
        clients. One request, alone in the bucket's last slot, runs each step: a step computes
        every row of its bucket whatever the others hold. It is re-inserted before it outgrows
        the narrowest key width, so every sample reads one width."""
        engine, live = self.engine, self.live_costs
        lengths = range(live.num_lengths)
        per_step = self.num_cycles * (engine.num_draft + 1)
        first_width = self._attention_widths[0]
        if min(first_width, engine.capacity) < 2 * per_step + 2:
            return state  # too small a cache to time a few steps in: exploration times them while serving
        settings = SlotSettings(temperature=0.0, max_new_tokens=engine.capacity - 2, seed=0, eos_token_id=())

        def counters(state, slot, out=None):  # the slot's cycles, drafted-slot counts, cached positions, done
            stats = state.loop.stats
            cycles, drafted_at, length, done = jax.device_get(
                (stats.cycles[slot], stats.drafted_at[slot], state.loop.target_cache.lengths[slot],
                 None if out is None else out.done[slot]))
            return int(cycles), np.asarray(drafted_at), int(length), bool(done)

        for rows in engine.row_buckets:
            slot = rows - 1
            plan = engine.plan({slot: settings})
            state = engine.insert(state, slot, [0], settings)
            for _ in range(rounds):
                for k in lengths:
                    for timed in (False, True):
                        self._check_stop()
                        before = counters(state, slot)
                        if before[2] + per_step + engine.num_draft + 1 > first_width:
                            state = engine.insert(engine.release(state, slot), slot, [0], settings)
                            before = counters(state, slot)
                        t0 = time.perf_counter()
                        state, out = engine.step(state, self.num_cycles, plan=plan, costs=live.forced_costs(k))
                        after = counters(state, slot, out)
                        seconds = time.perf_counter() - t0
                        self._time_step(plan.rows, self.num_cycles, np.array([after[0] - before[0]]),
                                        (after[1] - before[1])[None], seconds, timed=timed and not after[3],
                                        program=plan.program, longest=(before[2], after[2]))
            state = engine.release(state, slot)
        engine.set_costs(live.costs())
        # Compiled here, not at the first exploration.
        promised_tokens(engine.drafting, state.loop.policy_state, np.arange(engine.num_slots) == 0)
        jax.block_until_ready(state)
        return state

    def _serve(self, state) -> None:
        while True:
            with self._cond:
                while (not self._stop and not self._live and not self._pending
                       and (not self._waiting or self._paused)):
                    self._cond.wait()
                if self._stop:
                    doomed = self._held_requests()
                    self._live.clear()
                    self._pending.clear()
                    break
            began = time.perf_counter()
            state = self._release_cancelled(state)  # first, so that a waiting request takes the slot now
            with self._cond:
                admitted = []
                self._free.sort()  # the lowest free slots first: a step runs only up to the highest occupied one
                while self._waiting and not self._paused and len(self._free) >= self._waiting[0].n:
                    request = self._waiting.popleft()
                    if not request.cancelled:
                        slots = [self._free.pop(0) for _ in range(request.n)]
                        admitted.append((slots, request))
            state = self._admit(state, admitted)
            state = self._prefill_chunk(state)
            if self._unflushed:
                state = self._flush(state)
            if self._live:
                state = self._step(state)
            self.counters.busy_seconds += time.perf_counter() - began
        for request in doomed:
            _emit(request, Failed("the server shut down while this request was being generated; retry.",
                                  "shutting_down"))

    def _held_requests(self) -> list:
        """The requests that hold slots, live or pending, each once."""
        held = [l.request for l in self._live.values()] + [p.request for p in self._pending.values()]
        return list({id(r): r for r in held}.values())

    def _admit(self, state, admitted):
        """Prefills ``admitted`` (``(slots, request)`` pairs): requests of one choice in groups of
        ``prefill_groups`` sizes, a request of ``n`` alone, then copied into its other slots. A
        prompt longer than ``prefill_chunk``, or one that begins with blocks of the prefix cache,
        begins a chunked prefill instead (:meth:`_prefill_chunk`), or waits (:meth:`_waits_for_a_prefill`)."""
        if self.prefix_cache is not None:
            cold, deferred = [], []
            for slots, request in admitted:
                if self._waits_for_a_prefill(request):
                    deferred.append((slots, request))
                    continue
                hit = self.prefix_cache.match(self.engine, request.prompt)
                if hit.tokens:
                    self._begin(state, slots, request, hit)
                    continue
                self.prefix_cache.release(hit)
                if self.prefill_chunk and len(request.prompt) > self.prefill_chunk:
                    self._begin(state, slots, request)  # now, so that the requests after it wait for its blocks
                else:
                    cold.append((slots, request))
            admitted = cold
            with self._cond:  # back to the queue's head, in order; their slots freed
                self._free.extend(s for slots, _ in deferred for s in slots)
                self._waiting.extendleft(request for _, request in reversed(deferred))
        if self.prefill_chunk:
            long = [a for a in admitted if len(a[1].prompt) > self.prefill_chunk]
            admitted = [a for a in admitted if len(a[1].prompt) <= self.prefill_chunk]
            for slots, request in long:
                self._begin(state, slots, request)
        single = sorted([a for a in admitted if a[1].n == 1], key=lambda item: len(item[1].prompt))
        while single:
            size = max(n for n in self.prefill_groups if n <= len(single))
            group, single = single[:size], single[size:]
            state = self._insert(state, [(slots[0], request) for slots, request in group])
        for slots, request in admitted:
            if request.n > 1:
                state = self._insert(state, [(slots[0], request)], copies=slots[1:])
        return state

    def _waits_for_a_prefill(self, request) -> bool:
        """Whether a chunked prefill under way computes uncached blocks of ``request``'s prompt, at least
        half its positions left: the request waits for them (stored at its end) rather than computing
        them beside it; clients sending one system prompt at once prefill it once."""
        def worth(p):
            gain = blocks_in_common(request.prompt, p.request.prompt) * BLOCK - (p.hit.tokens if p.hit else 0)
            return gain > 0 and 2 * gain >= p.job.chunks_left * p.job.chunk
        return any(worth(p) for p in self._pending.values())

    def _begin(self, state, slots, request, hit=None) -> None:
        """Starts the chunked prefill of ``request`` into ``slots`` (its chunks run between steps),
        from the prefix cache's blocks of ``hit`` where given."""
        t0 = time.perf_counter()
        settings, keys = request.settings, None
        if request.n > 1:
            keys = _choice_keys(settings, request.n)
            settings = settings._replace(seed=None, key=keys[0])
        try:
            prefix = None
            if hit is not None:
                prefix = (self.prefix_cache.restore(self.engine, hit), hit.tokens)
                request.cached = hit.tokens
            job = self.engine.begin_insert(state, slots[0], list(request.prompt), settings,
                                           chunk=self.prefill_chunk or BLOCK, prefix=prefix)
        except (ValueError, TypeError) as e:  # checked by the server before queuing; here as a last guard
            self.counters.insert_seconds += time.perf_counter() - t0
            self._unpin(hit)
            self._refuse(request, slots, e)
            return
        self.counters.insert_seconds += time.perf_counter() - t0
        self._pending[slots[0]] = _Pending(request, job, tuple(slots), keys, hit)

    def _unpin(self, hit) -> None:
        if hit is not None:
            self.prefix_cache.release(hit)

    def _store(self, state, slot: int, request: Request) -> None:
        """Keeps the blocks of ``request``'s prompt, just prefilled into ``slot``, in the prefix cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.store(self.engine, state, slot, request.prompt)

    def _store_finished(self, state, slot: int, request: Request, generated, lengths) -> None:
        """Keeps the blocks of a finished request's prompt and generated tokens (``slot`` of
        ``state``, before its release) in the prefix cache, up to the positions both caches hold
        (``lengths``: the target's and the draft's, per slot): a conversation's next turn finds its history."""
        tokens = list(request.prompt) + [int(t) for t in generated]
        self.prefix_cache.store(self.engine, state, slot, tokens, cached=min(int(c[slot]) for c in lengths))

    def _prefill_chunk(self, state):
        """Prefills the next chunk of the chunked prefill with the fewest chunks left, less the
        chunks of others run while it waited (the oldest of a tie): a prompt that the prefix cache
        mostly covers gets its first token without waiting for a long cold one, and a long one
        passed over ``c`` times ranks as one ``c`` chunks shorter, so none waits forever. At its
        last chunk the request goes live (its copies forked), its first tokens drawn from the
        prefill and streamed before the next step (:meth:`_flush`). A cancelled one's slots are freed instead."""
        if not self._pending:
            return state
        cancelled = [s for s, p in self._pending.items() if p.request.cancelled]  # their slots go first
        first = cancelled[0] if cancelled else min(
            self._pending, key=lambda s: self._pending[s].job.chunks_left - self._pending[s].passed)
        for slot, other in self._pending.items():
            if slot != first:
                other.passed += 1
        pending = self._pending[first]
        request = pending.request
        if request.cancelled:
            del self._pending[first]
            self._unpin(pending.hit)
            with self._cond:
                self._free.extend(pending.slots)
            self.counters.requests_cancelled += 1
            _emit(request, Failed("cancelled", "cancelled"))
            return state
        t0 = time.perf_counter()
        try:
            state, job = self.engine.continue_insert(state, pending.job)
            if job.finished and pending.keys is not None:
                state = self.engine.fork(state, first, pending.slots[1:], pending.keys[1:])
            jax.block_until_ready(state.occupied if job.finished else job.caches)
        except (ValueError, TypeError) as e:
            self.counters.insert_seconds += time.perf_counter() - t0
            del self._pending[first]
            self._unpin(pending.hit)
            self._refuse(request, pending.slots, e)
            return state
        self.counters.insert_seconds += time.perf_counter() - t0
        self.counters.prefill_chunks += 1
        pending.job = job
        if job.finished:
            del self._pending[first]
            self._store(state, first, request)
            self._unpin(pending.hit)
            self.counters.prefills += 1
            self.counters.prefilled_requests += 1
            self._start(first, request, pending.slots[1:])
        return state

    def _refuse(self, request, slots, error) -> None:
        with self._cond:
            self._free.extend(slots)
        self.counters.requests_failed += 1
        _emit(request, Failed(str(error), "invalid_request"))

    def _start(self, slot, request, copies=()) -> None:
        """``request`` is in ``slot`` (and its copies): each choice's stream goes live."""
        request.remaining = request.n
        self._unflushed = True
        with self._cond:
            for index, s in enumerate((slot, *copies) if request.n > 1 else (slot,)):
                controls = request.settings.controls
                stream = TextStream(self.tokenizer, stop=request.stop, skip_special_tokens=request.skip_special_tokens,
                                    min_tokens=controls.min_new_tokens if controls is not None else 0)
                k = request.settings.logprobs
                self._live[s] = LiveChoice(request, index, stream, logprobs=None if k is None else [],
                                      top=[] if k else None)
        self.counters.prompt_tokens += len(request.prompt)

    def _insert(self, state, group, copies=()):
        t0 = time.perf_counter()
        slots, requests = zip(*group)
        try:
            settings = [r.settings for r in requests]
            if copies:  # choice i samples with fold_in(key(seed), i), as decode's sequence i does
                keys = _choice_keys(requests[0].settings, 1 + len(copies))
                settings = [settings[0]._replace(seed=None, key=keys[0])]
            state = self.engine.insert_many(state, slots, [list(r.prompt) for r in requests], settings)
            if copies:
                state = self.engine.fork(state, slots[0], copies, keys[1:])
            # Waits for the prefill, so that insert_seconds holds its time rather than the next step
            # (the step would wait for it anyway: the device runs one program after the other).
            jax.block_until_ready(state.occupied)
        except (ValueError, TypeError) as e:  # checked by the server before queuing; here as a last guard
            self.counters.insert_seconds += time.perf_counter() - t0
            if len(group) > 1:  # find the request at fault: the others are served
                for item in group:
                    state = self._insert(state, [item])
                return state
            self._refuse(requests[0], (slots[0], *copies), e)
            return state
        self.counters.insert_seconds += time.perf_counter() - t0
        self.counters.prefills += 1
        self.counters.prefilled_requests += len(group)
        for slot, request in group:
            self._store(state, slot, request)
            self._start(slot, request, copies)
        return state

    def _release(self, state, slot):
        t0 = time.perf_counter()
        state = self.engine.release(state, slot)
        self.counters.insert_seconds += time.perf_counter() - t0
        with self._cond:
            del self._live[slot]
            self._free.append(slot)
        return state

    def _release_cancelled(self, state):
        cancelled = {}
        for slot in [s for s, live in self._live.items() if live.request.cancelled]:
            request = self._live[slot].request
            state = self._release(state, slot)
            cancelled[id(request)] = request
        for request in cancelled.values():
            if request.remaining >= 0:  # (a failed request's other choices: its failure was reported)
                self.counters.requests_cancelled += 1
                _emit(request, Failed("cancelled", "cancelled"))
        return state

    def _since_last_step(self, cycles, drafted_at) -> tuple[np.ndarray, np.ndarray]:
        """Each live slot's cycles ``[L]`` and drafted-slot counts ``[L, K]`` since the last step
        (from its counters after this step, which become the ones seen)."""
        slots = list(self._live)
        ran = np.array([int(cycles[s]) - self._live[s].seen_cycles for s in slots], np.int64)
        lengths = np.array([np.asarray(drafted_at[s]) - self._live[s].seen_drafted_at for s in slots])
        for s in slots:
            self._live[s].seen_cycles, self._live[s].seen_drafted_at = int(cycles[s]), np.asarray(drafted_at[s])
        return ran, lengths

    def _time_step(self, rows: int, asked: int, ran: np.ndarray, lengths: np.ndarray, seconds: float,
                   timed: bool = True, program: str = "", longest: Optional[tuple[int, int]] = None) -> None:
        """Gives :attr:`live_costs` the length the step's cycles drafted (``ran``, ``lengths``:
        :meth:`_since_last_step`), the key widths they read (``longest``: the longest of the
        step's rows before and after it, in cached positions) and, for a ``timed`` step, its
        seconds per cycle, and every 8 timed steps hands the engine the refreshed costs. A
        step cut short by a finish is not timed: its fixed host work, over fewer cycles,
        would make its length look dear (docs/drafting.md)."""
        k = step_draft_length(ran, lengths, asked) if ran.size else None
        timed = timed and k is not None and int(ran.max()) == asked
        widths = () if longest is None or k is None else widths_read(self._attention_widths, *longest, k)
        self.live_costs.observe(rows, k, seconds / int(ran.max()) if timed else None, program, widths,
                                cycles=int(ran.max()) if ran.size else 0)
        if not timed:
            return
        self._timed_steps += 1
        if self._timed_steps % 8 == 0:
            self.engine.set_costs(self.live_costs.costs())

    def _width_now(self, rows: int) -> int:
        """The index of the key width a plain cycle of the first ``rows`` slots reads now (-1 before
        any step)."""
        if self._target_lengths is None:
            return -1
        longest = int(np.max(self._target_lengths[:rows]))
        return widths_read(self._attention_widths, longest, longest, 0)[0]

    def _promise(self, state, rows: int) -> Optional[np.ndarray]:
        """:func:`promised_tokens` of the live slots among the first ``rows`` (read only when
        :attr:`live_costs` is about to explore)."""
        live = np.zeros(self.engine.num_slots, bool)
        live[[s for s in self._live if s < rows]] = True
        return promised_tokens(self.engine.drafting, state.loop.policy_state, live)

    def _plan(self):
        return self.engine.plan({slot: live.request.settings for slot, live in self._live.items()})

    def _step(self, state):
        with self._cond:
            waiting = bool(self._waiting) and not self._paused
            free = bool(self._free)
        # Every step is cut short when a request ends: its last tokens go out at once and its slot
        # is free for the next one.
        plan = self._plan()
        fresh = any(live.last is None for live in self._live.values())
        asked = self.step_length.cycles(plan.rows, free, waiting, fresh)
        # A new request's one-cycle first step is neither forced nor timed (see _time_step).
        forced = None
        if self.live_costs is not None and not fresh:
            forced = self.live_costs.explore(plan.rows, plan.program, self._width_now(plan.rows),
                                             promise=lambda: self._promise(state, plan.rows))
        costs = None if forced is None else self.live_costs.forced_costs(forced)
        # Timed from here: the step and reading its output back, what every step pays alike (the
        # plan and a forced step's costs, prepared above, are not part of a cycle's cost).
        t0 = time.perf_counter()
        state, out = self.engine.step(state, asked, until_first_finish=True, plan=plan, costs=costs)
        out, counts, cache_lengths, target_lengths = jax.device_get(
            (out, self._counts(state), self._cache_lengths(state), state.loop.target_cache.lengths))
        cycles, drafted_at = counts[0], counts[4]
        now = time.perf_counter()
        self.counters.step_seconds += now - t0
        self.counters.steps += 1
        ran, lengths = self._since_last_step(cycles, drafted_at)
        self.step_length.observe(plan.rows, asked, ran, now - t0)
        if self.live_costs is not None:
            after = int(np.max(target_lengths[: plan.rows]))
            before = after if self._target_lengths is None else int(np.max(self._target_lengths[: plan.rows]))
            self._time_step(plan.rows, asked, ran, lengths, now - t0, timed=not fresh, program=plan.program,
                            longest=(min(before, after), after))
        self._target_lengths = target_lengths
        return self._deliver(state, out, counts, cache_lengths, now)

    def _flush(self, state):
        """Streams the first tokens of the requests inserted since the last step at once: an insert
        draws them from the prefill (:meth:`Engine.flush`), so they need not wait for a step."""
        self._unflushed = False
        state, out = self.engine.flush(state)
        out, *counts, cache_lengths = jax.device_get((out, *self._counts(state), self._cache_lengths(state)))
        return self._deliver(state, out, counts, cache_lengths, time.perf_counter())

    @staticmethod
    def _counts(state) -> tuple:
        stats = state.loop.stats
        return stats.cycles, stats.drafted, stats.accepted, stats.accepted_at, stats.drafted_at

    def _cache_lengths(self, state):
        """Both caches' lengths with a prefix cache (a finished request's entries are stored up to them)."""
        loop = state.loop
        return None if self.prefix_cache is None else (loop.target_cache.lengths, loop.draft_cache.lengths)

    def _deliver(self, state, out, counts, cache_lengths, now: float):
        """Streams each live slot's new tokens of ``out`` (a step's or a flush's, on the host) to its
        client and ends the choices that finished. ``counts``: the slots' ``cycles``, ``drafted``,
        ``accepted``, ``accepted_at`` and ``drafted_at`` statistics; ``cache_lengths``: both caches'
        lengths with a prefix cache, else None."""
        cycles, drafted, accepted, accepted_at, drafted_at = counts
        for slot in list(self._live):
            live = self._live[slot]
            request, stream, index = live.request, live.stream, live.index
            if request.cancelled:
                continue  # released before the next step; its client is gone
            new = out.tokens[slot, : out.counts[slot]]
            before = len(stream.tokens)
            text = stream.push(new)
            if live.logprobs is not None:
                live.keep_logprobs(out, slot)
            counted = stream.covered_tokens() if stream.stopped else len(stream.tokens)  # past a stop: not output
            if counted > before:
                self._observe_tokens(live, counted - before, now)
            finishing = bool(out.done[slot]) or stream.stopped
            if finishing and out.bad[slot]:
                state = self._release(state, slot)
                self._fail(request, Failed("the model's logits became non-finite (NaN or inf); the "
                                           "request stopped.", "non_finite_logits"))
                continue
            if finishing:
                text += stream.finish()
            delta = live.delta(text, finishing)
            if delta is not None:
                _emit(request, delta)
            if not finishing:
                continue
            if cache_lengths is not None:
                self._store_finished(state, slot, request, stream.tokens, cache_lengths)
            state = self._release(state, slot)
            n = stream.covered_tokens()
            length = (not stream.stopped and n >= request.settings.max_new_tokens
                      and (n == 0 or stream.tokens[n - 1] not in self._end_ids(request)))
            c, d, a = int(cycles[slot]), int(drafted[slot]), int(accepted[slot])
            at, lengths = [int(x) for x in accepted_at[slot]], draft_lengths(c, drafted_at[slot])
            self.counters.completion_tokens += n
            self.counters.cycle_tokens += cycle_tokens(n)
            self.counters.cycles += c
            self.counters.drafted += d
            self.counters.accepted += a
            add_into(self.counters.accepted_at, at)
            add_into(self.counters.draft_lengths, lengths)
            if c:
                self.latency["request_tau"].observe(cycle_tokens(n) / c)
            request.remaining -= 1
            if request.remaining == 0:
                self.counters.requests_finished += 1
                self.latency["e2e_request_latency_seconds"].observe(now - request.arrived)
            _emit(request, Done("length" if length else "stop", len(request.prompt), n, dict(
                cycles=c, drafted=d, accepted=a, tau=cycle_tokens(n) / c if c else 0.0, acceptance_rate=a / d if d else 0.0,
                accepted_at=at, draft_lengths=lengths), index, request.cached))
        return state

    def _fail(self, request: Request, event: Failed) -> None:
        """Ends every choice of ``request`` with ``event`` (its other slots freed before the next step)."""
        self.counters.requests_failed += 1
        request.cancelled = True  # the other choices' slots: released by _release_cancelled, not counted
        request.remaining = -1
        _emit(request, event)

    def _observe_tokens(self, live: LiveChoice, count: int, now: float) -> None:
        """The time to a choice's first tokens, or the gap since its last ones shared among the
        ``count`` tokens that arrived together (one observation each)."""
        with self._cond:
            if live.last is None:
                self.latency["time_to_first_token_seconds"].observe(now - live.request.arrived)
            else:
                self.latency["inter_token_latency_seconds"].observe((now - live.last) / count, count)
            live.last = now

    def _end_ids(self, request: Request) -> frozenset:
        if request.settings.eos_token_id == ():
            ends = frozenset()
        elif request.settings.eos_token_id is None:
            ends = self.eos_ids
        else:
            ends = frozenset(np.atleast_1d(request.settings.eos_token_id).tolist())
        return ends | frozenset(request.settings.stop_token_ids)


def _choice_keys(settings: SlotSettings, n: int) -> list:
    """The keys of a request's ``n`` choices: choice i samples with fold_in(key(seed), i), as
    decode's sequence i does."""
    base = settings.key if settings.key is not None else jax.random.key(
        secrets.randbits(32) if settings.seed is None else settings.seed)
    return [jax.random.fold_in(base, i) for i in range(n)]


def _emit(request: Request, event) -> None:
    """Hands ``event`` to the request's consumer; a consumer that is gone (its
    event loop closed) must not stop the loop serving the others."""
    try:
        request.emit(event)
    except Exception:  # noqa: BLE001
        request.cancelled = True
