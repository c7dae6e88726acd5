"""What the scheduler's consumers receive, and the requests they submit.

A consumer's ``emit`` gets :class:`Delta` events as text becomes final, then
one :class:`Done` per choice, or one :class:`Failed`; :class:`QueueFull` and
:class:`Closed` are what submitting raises when the scheduler cannot take a
request (:mod:`specjax._src.serve.scheduler`). :class:`LiveChoice` is the
scheduler's record of a choice being generated, which makes its :class:`Delta` events.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

from specjax._src.engine.slots import SlotSettings
from specjax._src.engine.text import TextStream

__all__ = ["Delta", "Done", "Failed", "QueueFull", "Closed", "Request", "LiveChoice"]


class Delta(NamedTuple):
    """New text of one of a request's choices (final: never part of a stop string).

    Attributes:
      text: the text that became final.
      index: the choice (``0 .. n - 1``).
      tokens: the ids this step committed for the choice that count in its
        completion (those after a stop string are left out).
      logprobs: with ``SlotSettings.logprobs`` set, each of ``tokens``'
        log-probability (:class:`specjax.engine.StepOutput`'s), else None.
      top: with ``SlotSettings.logprobs = k > 0``, per token its ``k`` most
        likely ``(id, logprob)`` pairs, else None.
    """

    text: str
    index: int = 0
    tokens: tuple = ()
    logprobs: Optional[tuple] = None
    top: Optional[tuple] = None


class Done(NamedTuple):
    """One of the request's choices ended (``index``; a request of ``n`` choices gets ``n``).

    Attributes:
      finish_reason: ``"stop"`` (EOS, a stop id or a stop string) or
        ``"length"`` (``max_new_tokens``).
      prompt_tokens, completion_tokens: token counts (the completion's up to
        the step that found a stop string).
      stats: the request's speculative-decoding counters: ``cycles``,
        ``drafted``, ``accepted``, ``tau`` (tokens per target forward),
        ``acceptance_rate`` (accepted / drafted), ``accepted_at`` (``[K]``
        drafts accepted at each position) and ``draft_lengths`` (``[K + 1]``
        cycles that drafted ``k = 0 .. K`` tokens: what the drafting policy chose).
      cached_tokens: the prompt's tokens read from the prefix cache, not prefilled.
    """

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict
    index: int = 0
    cached_tokens: int = 0


class Failed(NamedTuple):
    """The request could not be served (it was refused, cancelled or its logits went non-finite)."""

    message: str
    code: str


class QueueFull(RuntimeError):
    """More requests wait than the free slots and ``max_queue`` hold: refuse, retry later."""


class Closed(RuntimeError):
    """The scheduler is shutting down and takes no more requests."""


_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Request:
    """One request: its prompt ids, settings, stop strings and consumer.

    ``emit`` is called on the loop's thread with :class:`Delta` events, then
    one :class:`Done` per choice, or one :class:`Failed`; it must not block
    (e.g. ``loop.call_soon_threadsafe(queue.put_nowait, event)``).

    ``n`` choices share one prefill: the prompt is inserted once and copied
    into ``n - 1`` more slots (:meth:`specjax.engine.Engine.fork`); choice
    ``i`` samples with ``fold_in(key(seed), i)``, the key ``decode`` gives
    sequence ``i`` of a batch of ``n`` copies of the prompt, so choice 0 is
    what the request with ``n = 1`` samples. The request waits until ``n``
    slots are free at once.
    """

    prompt: Sequence[int]
    settings: SlotSettings
    emit: Callable[[object], None]
    stop: Sequence[str] = ()
    n: int = 1
    skip_special_tokens: bool = True
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    cancelled: bool = False
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    remaining: int = 0  # choices not yet done (set at admission)
    cached: int = 0  # prompt tokens read from the prefix cache (set at admission)


@dataclasses.dataclass
class LiveChoice:
    """A slot's choice: its stream, and where the request asked for them, its tokens'
    log-probabilities (``logprobs``, ``top``: aligned with ``stream.tokens``) until their text
    is final (``reported`` of them are out)."""

    request: Request
    index: int  # the choice this slot generates
    stream: TextStream
    last: Optional[float] = None  # when its last tokens went out (None: none yet)
    logprobs: Optional[list] = None
    top: Optional[list] = None
    reported: int = 0
    seen_cycles: int = 0  # the slot's cycle and drafted-slot counters at the last step (for LiveCosts)
    seen_drafted_at: Any = 0

    def keep_logprobs(self, out, slot: int) -> None:
        """Keeps this step's tokens' log-probabilities (their text may still be held back)."""
        count, k = int(out.counts[slot]), self.request.settings.logprobs
        self.logprobs.extend(float(x) for x in out.logprobs[slot, :count])
        if k:
            ids, lps = out.top_ids[slot, :count, :k], out.top_logprobs[slot, :count, :k]
            self.top.extend(tuple((int(i), float(x)) for i, x in zip(row_ids, row_lps))
                            for row_ids, row_lps in zip(ids, lps))

    def delta(self, text: str, finished: bool) -> Optional[Delta]:
        """The event for ``text``: with log-probabilities, those of the tokens whose text is now
        final (a token inside a held-back stop-string candidate waits; one past the stop never
        goes out), so that the tokens reported are the completion's, however steps fell."""
        if self.logprobs is None:
            return Delta(text, self.index) if text else None
        stream = self.stream
        final = stream.covered_tokens() if finished else stream.final_tokens()
        final = max(final, self.reported)
        if not text and final == self.reported:
            return None
        span = slice(self.reported, final)
        self.reported = final
        return Delta(text, self.index, tuple(stream.tokens[span]), tuple(self.logprobs[span]),
                     tuple(self.top[span]) if self.top is not None else None)
