"""A host loop that serves a stream of requests on the slots engine.

Requests wait in a bounded queue; one thread (the loop) owns the
:class:`specjax.engine.SlotState` and, between ``engine.step`` calls, admits
waiting requests into free slots (prefill), releases finished or cancelled
ones, and hands each request's new text to its consumer. The device work is
the engine's jitted programs; the loop only does bookkeeping between them,
and measures its own share of the wall time.

The shape is JetStream's orchestrator (a prefill side that inserts requests
into decode slots, a generate side that steps them, and a detokenizer that
streams the results) folded into one thread: on a CPU or a single device
the steps are serialized anyway, and one owner of the state needs no locks
around it.

A request's output does not depend on the others: each slot samples with its
own key (``SlotSettings.seed``) and counts its own cycles (see
``docs/engine.md``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import numpy as np

from specjax._src.engine.slots import Engine, SlotSettings
from specjax._src.engine.text import TextStream


# ---------------------------------------------------------------------------
# What a consumer receives (on the loop's thread: hand it over, don't block)
# ---------------------------------------------------------------------------


class Delta(NamedTuple):
    """New text of a request (final: never part of a stop string)."""

    text: str


class Done(NamedTuple):
    """The request ended.

    Attributes:
      finish_reason: ``"stop"`` (EOS, a stop id or a stop string) or
        ``"length"`` (``max_new_tokens``).
      prompt_tokens, completion_tokens: token counts (the completion's up to
        the step that found a stop string).
      stats: the request's speculative-decoding counters: ``cycles``,
        ``drafted``, ``accepted``, ``tau`` (tokens per target forward) and
        ``acceptance_rate`` (accepted / drafted).
    """

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict


class Failed(NamedTuple):
    """The request could not be served (it was refused, cancelled or its logits went non-finite)."""

    message: str
    code: str


class QueueFull(RuntimeError):
    """The waiting queue holds ``max_queue`` requests: refuse, retry later."""


class Closed(RuntimeError):
    """The scheduler is shutting down and takes no more requests."""


_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Request:
    """One request: its prompt ids, settings, stop strings and consumer.

    ``emit`` is called on the loop's thread with :class:`Delta` events, then
    one :class:`Done` or :class:`Failed`; it must not block (e.g.
    ``loop.call_soon_threadsafe(queue.put_nowait, event)``).
    """

    prompt: Sequence[int]
    settings: SlotSettings
    emit: Callable[[object], None]
    stop: Sequence[str] = ()
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    cancelled: bool = False
    arrived: float = dataclasses.field(default_factory=time.perf_counter)


@dataclasses.dataclass
class _Live:
    request: Request
    stream: TextStream


@dataclasses.dataclass
class Counters:
    """What the loop has done since it started (read with :meth:`Scheduler.metrics`)."""

    requests_finished: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    requests_refused: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    prefills: int = 0  # insert calls that succeeded (a group of requests counts once)
    prefilled_requests: int = 0
    step_seconds: float = 0.0  # engine.step and reading its output back
    insert_seconds: float = 0.0  # engine.insert (prefill, waited for) and release
    busy_seconds: float = 0.0  # the loop's wall time while a request was waiting or live


class Scheduler:
    """Serves requests on ``engine`` from its own thread.

    Args:
      engine: a :class:`specjax.engine.Engine`.
      tokenizer: the target's tokenizer (detokenizes each request's stream).
      max_queue: requests that may wait for a slot; one more is refused with
        :class:`QueueFull` (memory stays bounded whatever the load).
      num_cycles: the most draft-verify cycles per ``engine.step``. A step
        delivers its tokens at its end and returns as soon as a request
        finishes (``until_first_finish``), so that a finished request's last
        tokens go out and its slot takes the next request at once; while a
        slot is free and no request waits, steps run one cycle, so that a
        request arriving then waits at most one cycle for its slot. Fewer
        cycles stream sooner; more cycles spread the loop's fixed cost per
        step (dispatch, reading the output back, detokenizing) over more
        tokens. At 4 that cost measured 0.1 to 2% of the loop's busy
        time (``host_share``; the embedded and smollm2-eagle pairs on a
        shared 2-core CPU, ``benchmarks/serve_load.py`` smoke runs of
        2026-11-26): the loop's cost is small beside a step's either way, so
        lower it where steps are slow and a stream's latency matters.
      warmup_widths: prompt widths to compile ``insert`` for before
        :attr:`ready` (None: every width bucket up to the capacity).
      prefill_groups: how many requests one prefill may take (None: 1, 2,
        4, ... up to the slot count). Requests admitted together are
        prefilled in the fewest such groups (7 as 4 + 2 + 1), the shorter
        prompts together, since a group's prefill runs as many positions as
        its longest prompt. One ``insert`` program per group size and
        width, all compiled before :attr:`ready`. A group shares one pass
        over the weights, most of a short prefill's cost on an accelerator.
        On a 2-core CPU, where a prompt alone runs no wider than it needs
        (a multiple of 16 positions) and its cost is mostly arithmetic, 8
        chat prompts took as long one by one as in one group (677 against
        674 ms on the real pair, ``benchmarks/serve_programs.py``).
      eos_ids: the ids that end a request (the target's EOS), to tell
        ``"stop"`` from ``"length"``.
    """

    def __init__(self, engine: Engine, tokenizer, *, max_queue: int = 64, num_cycles: int = 4,
                 warmup_widths: Optional[Sequence[int]] = None, eos_ids: Sequence[int] = (),
                 prefill_groups: Optional[Sequence[int]] = None):
        if int(max_queue) < 0 or int(num_cycles) < 1:
            raise ValueError(f"max_queue must be >= 0 and num_cycles >= 1, got {max_queue}, {num_cycles}.")
        if prefill_groups is None:
            prefill_groups = [2**i for i in range(engine.num_slots.bit_length()) if 2**i <= engine.num_slots]
        groups = sorted({int(n) for n in prefill_groups})
        if not groups or groups[0] != 1 or groups[-1] > engine.num_slots:
            raise ValueError(f"prefill_groups must include 1 and stay within the {engine.num_slots} slots, got "
                             f"{list(prefill_groups)}.")
        self.prefill_groups = tuple(groups)
        self.engine, self.tokenizer = engine, tokenizer
        self.max_queue, self.num_cycles = int(max_queue), int(num_cycles)
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.warmup_widths = warmup_widths
        self.counters = Counters()
        self.ready = threading.Event()
        self._waiting: collections.deque[Request] = collections.deque()
        self._live: dict[int, _Live] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._stop = False
        self._paused = 0
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="specjax-scheduler", daemon=True)

    # -- the consumer's side (any thread) -----------------------------------

    def start(self) -> "Scheduler":
        """Starts the loop: it compiles the engine's programs, sets :attr:`ready`, then serves."""
        self._thread.start()
        return self

    def submit(self, request: Request) -> None:
        """Queues ``request``; raises :class:`QueueFull` or :class:`Closed` instead of waiting."""
        with self._cond:
            if self._closing:
                raise Closed("the server is shutting down and takes no new requests.")
            if len(self._waiting) >= self.max_queue:
                self.counters.requests_refused += 1
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting for "
                                f"{self.engine.num_slots} slots); retry later.")
            self._waiting.append(request)
            self._cond.notify()

    def cancel(self, request: Request) -> None:
        """Ends ``request`` (e.g. its client went away): its slot is freed before the next step."""
        with self._cond:
            request.cancelled = True
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

    def close(self, drain_seconds: float = 30.0) -> None:
        """Refuses new and waiting requests, lets live ones finish for up to
        ``drain_seconds``, cancels the rest, and stops the loop."""
        with self._cond:
            self._closing = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._cond.notify()
        for request in waiting:
            _emit(request, Failed("the server shut down before this request was admitted; retry.", "shutting_down"))
        deadline = time.monotonic() + drain_seconds
        while self._thread.is_alive() and self._live and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def error(self) -> Optional[BaseException]:
        """The exception that stopped the loop, if one did."""
        return self._error

    def metrics(self) -> dict:
        """A snapshot: the counters, ``queue_depth``, ``live_slots``, ``num_slots``,
        ``host_share`` (the loop's time outside the engine's calls over its busy time)."""
        with self._cond:
            c = dataclasses.asdict(self.counters)
            c.update(queue_depth=len(self._waiting), live_slots=len(self._live), num_slots=self.engine.num_slots,
                     ready=self.ready.is_set())
        busy = c["busy_seconds"]
        c["host_share"] = (busy - c["step_seconds"] - c["insert_seconds"]) / busy if busy > 0 else 0.0
        return c

    # -- the loop (its own thread) ------------------------------------------

    def _run(self) -> None:
        try:
            state = self._warm_up()
            self.ready.set()
            self._serve(state)
        except BaseException as e:  # noqa: BLE001 -- reported to every request, then to the server
            self._error = e
            with self._cond:
                self._closing = True
                doomed = list(self._waiting) + [live.request for live in self._live.values()]
                self._waiting.clear()
                self._live.clear()
            for request in doomed:
                _emit(request, Failed(f"the server's engine failed: {type(e).__name__}: {e}", "engine_error"))

    def _warm_up(self):
        """Compiles init, insert (per prompt width) and step (per row bucket, and for an engine
        with ``specialized_steps`` each of its three programs) before any request (release compiles
        nothing)."""
        engine = self.engine
        state = engine.init()
        widths = self.warmup_widths
        if widths is None:
            widths, w = [], engine.cfg.prompt_bucket
            while w < engine.capacity:
                widths.append(w)
                w *= 2
            widths.append(engine.capacity)
        greedy = SlotSettings(temperature=0.0, max_new_tokens=1, seed=0)
        # One request per step program: greedy, sampled without filters, and (top-p) the general one.
        programs = [greedy, SlotSettings(temperature=1.0, max_new_tokens=1, seed=0),
                    SlotSettings(temperature=1.0, top_p=0.5, max_new_tokens=1, seed=0)]

        def serve_one(state, slot: int, prompt, settings=greedy, group: int = 1):
            slots = range(slot, slot + group)
            state = engine.insert_many(state, slots, [prompt] * group, [settings] * group)
            state, out = engine.step(state, self.num_cycles)
            jax.block_until_ready(out)
            for s in slots:
                state = engine.release(state, s)
            return state

        for width in sorted(set(int(w) for w in widths)):  # insert's programs, and step's first row bucket
            for group in self.prefill_groups:
                state = serve_one(state, 0, [0] * max(1, min(width, engine.capacity - 1)), group=group)
        for width in engine._single_prompt_widths():  # a short prompt alone runs at its own width
            state = serve_one(state, 0, [0] * width)
        for rows in engine.row_buckets:  # the step that runs the first `rows` slots, in each program
            for settings in (programs if engine.specialized_steps else [greedy]):
                if rows > 1 or settings is not greedy:  # (greedy at one row: compiled above)
                    state = serve_one(state, rows - 1, [0], settings)
        jax.block_until_ready(state)
        return state

    def _serve(self, state) -> None:
        engine, free = self.engine, list(range(self.engine.num_slots))
        while True:
            with self._cond:
                while not self._stop and not self._live and (not self._waiting or self._paused):
                    self._cond.wait()
                if self._stop:
                    doomed = [live.request for live in self._live.values()]
                    self._live.clear()
                    break
            began = time.perf_counter()
            state = self._release_cancelled(state, free)  # first, so that a waiting request takes the slot now
            with self._cond:
                admitted = []
                free.sort()  # the lowest free slots first: a step runs only up to the highest occupied one
                while free and self._waiting and not self._paused:
                    request = self._waiting.popleft()
                    if not request.cancelled:
                        admitted.append((free.pop(0), request))
            state = self._admit(state, admitted, free)
            if self._live:
                state = self._step(state, free)
            self.counters.busy_seconds += time.perf_counter() - began
        for request in doomed:
            _emit(request, Failed("the server shut down while this request was being generated.", "shutting_down"))

    def _admit(self, state, admitted, free):
        """Prefills ``admitted`` (``(slot, request)`` pairs) in groups of ``prefill_groups`` sizes."""
        admitted = sorted(admitted, key=lambda item: len(item[1].prompt))
        while admitted:
            size = max(n for n in self.prefill_groups if n <= len(admitted))
            group, admitted = admitted[:size], admitted[size:]
            state = self._insert(state, group, free)
        return state

    def _insert(self, state, group, free):
        t0 = time.perf_counter()
        try:
            slots, requests = zip(*group)
            state = self.engine.insert_many(state, slots, [list(r.prompt) for r in requests],
                                            [r.settings for r in requests])
            # Waits for the prefill, so that insert_seconds holds its time rather than the next step
            # (the step would wait for it anyway: the device runs one program after the other).
            jax.block_until_ready(state.occupied)
        except (ValueError, TypeError) as e:  # checked by the server before queuing; here as a last guard
            self.counters.insert_seconds += time.perf_counter() - t0
            if len(group) > 1:  # find the request at fault: the others are served
                for item in group:
                    state = self._insert(state, [item], free)
                return state
            free.append(slots[0])
            self.counters.requests_failed += 1
            _emit(requests[0], Failed(str(e), "invalid_request"))
            return state
        self.counters.insert_seconds += time.perf_counter() - t0
        self.counters.prefills += 1
        self.counters.prefilled_requests += len(group)
        for slot, request in group:
            with self._cond:
                self._live[slot] = _Live(request, TextStream(self.tokenizer, stop=request.stop))
            self.counters.prompt_tokens += len(request.prompt)
        return state

    def _release(self, state, slot, free):
        t0 = time.perf_counter()
        state = self.engine.release(state, slot)
        self.counters.insert_seconds += time.perf_counter() - t0
        with self._cond:
            del self._live[slot]
        free.append(slot)
        return state

    def _release_cancelled(self, state, free):
        for slot in [s for s, live in self._live.items() if live.request.cancelled]:
            request = self._live[slot].request
            state = self._release(state, slot, free)
            self.counters.requests_cancelled += 1
            _emit(request, Failed("cancelled", "cancelled"))
        return state

    def _step(self, state, free):
        t0 = time.perf_counter()
        with self._cond:
            waiting = bool(self._waiting) and not self._paused
        # A free slot and nobody waiting: one cycle, so that a request that arrives meanwhile takes
        # the slot after at most one cycle. Otherwise the full step, cut short when a request ends:
        # its last tokens go out at once and its slot is free for the next one.
        cycles = 1 if free and not waiting else self.num_cycles
        state, out = self.engine.step(state, cycles, until_first_finish=True)
        stats = state.loop.stats
        out, cycles, drafted, accepted = jax.device_get((out, stats.cycles, stats.drafted, stats.accepted))
        self.counters.step_seconds += time.perf_counter() - t0
        self.counters.steps += 1
        for slot in list(self._live):
            live = self._live[slot]
            request, stream = live.request, live.stream
            new = out.tokens[slot, : out.counts[slot]]
            text = stream.push(new)
            if text:
                _emit(request, Delta(text))
            if not (out.done[slot] or stream.stopped):
                continue
            state = self._release(state, slot, free)
            if out.bad[slot]:
                self.counters.requests_failed += 1
                _emit(request, Failed("the model's logits became non-finite (NaN or inf); the request stopped.",
                                    "non_finite_logits"))
                continue
            tail = stream.finish()
            if tail:
                _emit(request, Delta(tail))
            n = len(stream.tokens)
            length = (not stream.stopped and n >= request.settings.max_new_tokens
                      and (n == 0 or stream.tokens[-1] not in self._end_ids(request)))
            c, d, a = int(cycles[slot]), int(drafted[slot]), int(accepted[slot])
            self.counters.requests_finished += 1
            self.counters.completion_tokens += n
            self.counters.cycles += c
            self.counters.drafted += d
            self.counters.accepted += a
            _emit(request, Done("length" if length else "stop", len(request.prompt), n, dict(
                cycles=c, drafted=d, accepted=a, tau=n / c if c else 0.0, acceptance_rate=a / d if d else 0.0)))
        return state

    def _end_ids(self, request: Request) -> frozenset:
        eos = request.settings.eos_token_id
        ends = self.eos_ids if eos is None else frozenset(np.atleast_1d(eos).tolist())
        return ends | frozenset(request.settings.stop_token_ids)


def _emit(request: Request, event) -> None:
    """Hands ``event`` to the request's consumer; a consumer that is gone (its
    event loop closed) must not stop the loop serving the others."""
    try:
        request.emit(event)
    except Exception:  # noqa: BLE001
        request.cancelled = True
