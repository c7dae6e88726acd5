"""A request's answer: OpenAI's response bodies and server-sent events, built from the
scheduler's events.

A completions request may hold several prompts (OpenAI's batch form); each is its own
scheduler request, and its ``n`` choices are choices ``p * n .. p * n + n - 1`` of the
answer (OpenAI's order: prompt by prompt, the choices of each together). A choice's
events arrive tagged with its prompt's place.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import NamedTuple, Optional, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse

from specjax._src.engine.cycle import LOGPROB_FLOOR
from specjax._src.serve import events as events_lib
from specjax._src.serve.config import ServerConfig
from specjax._src.serve.errors import failure
from specjax._src.serve.metrics import add_into, cycle_tokens

NO_STATS = dict(cycles=0, drafted=0, accepted=0, tau=0.0, acceptance_rate=0.0, accepted_at=[], draft_lengths=[])


class Prompt(NamedTuple):
    """One prompt of a request.

    Attributes:
      ids: its tokens.
      echo: the text echoed before its choices' completions ("" without ``echo``).
      scores: with ``echo`` and ``logprobs``, its tokens' log-probabilities
        (:func:`specjax._src.serve.scoring.prompt_logprobs`: ``(logprobs, top)``), else None.
    """

    ids: list
    echo: str = ""
    scores: Optional[tuple] = None


def emitter(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, tag: int = 0):
    """``emit`` for the scheduler's thread: hands each event, as ``(tag, event)``, to the request's loop.

    Once the server's loop has closed (shutdown), nobody is left to read the
    events, so they are dropped instead of raising in the scheduler's thread.
    """

    def emit(event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, (tag, event))
        except RuntimeError:
            pass

    return emit


def finite(x: float) -> float:
    """A log-probability JSON can carry (a non-finite one, which checked settings should not
    produce, reports the floor rather than breaking the body)."""
    return x if math.isfinite(x) else LOGPROB_FLOOR


class Reply:
    """Builds a request's response bodies (OpenAI's shapes) from the scheduler's events.

    ``prompts``: the request's :class:`Prompt` s (chat: one); ``n``: choices per prompt;
    ``k``: the alternatives per token asked for (None: no log-probabilities).
    """

    def __init__(
        self,
        config: ServerConfig,
        chat: bool,
        n: int,
        k: Optional[int],
        prompts: Sequence[Prompt],
        rule: str,
        head: dict,
    ):
        self.config, self.chat, self.n, self.k, self.head = config, chat, n, k, head
        self.prompts = list(prompts)
        self.choices = len(self.prompts) * n
        self.rule = rule  # the acceptance rule's spec, for the ``speculative`` blocks
        self.kind = "chat.completion" if chat else "text_completion"
        # completions' text_offset: where each choice's next token starts
        self.offsets = [len(self.prompt_of(g).echo) for g in range(self.choices)]

    def prompt_of(self, index: int) -> Prompt:
        return self.prompts[index // self.n]

    def index(self, tag: int, event) -> int:
        """The choice an event of prompt ``tag`` belongs to."""
        return tag * self.n + (event.index if isinstance(event, (events_lib.Delta, events_lib.Done)) else 0)

    def logprobs(self, index: int, delta: events_lib.Delta) -> Optional[dict]:
        """The delta's tokens' log-probabilities in the route's shape, or None."""
        if self.k is None or delta.logprobs is None:
            return None
        text = self.config.token_text
        # Alternatives that top-k / top-p cut off (the floor) are left out: "up to k" of them.
        tops = [[(t, lp) for t, lp in row if lp > LOGPROB_FLOOR] for row in delta.top] if delta.top else None
        if self.chat:

            def entry(token, logprob):
                return {"token": text(token), "logprob": finite(logprob), "bytes": self.config.token_bytes(token)}

            content = []
            for i, (token, logprob) in enumerate(zip(delta.tokens, delta.logprobs)):
                top = [entry(t, lp) for t, lp in tops[i]] if tops else []
                content.append({**entry(token, logprob), "top_logprobs": top})
            return {"content": content, "refusal": None}
        return self._completion_logprobs(index, delta.tokens, delta.logprobs, tops)

    def _completion_logprobs(self, index: int, tokens, logprobs, tops) -> dict:
        text = self.config.token_text
        texts = [text(t) for t in tokens]
        offsets = []
        for token in texts:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(token)
        top = None
        if tops is not None:
            top = [None if row is None else {text(t): finite(lp) for t, lp in row} for row in tops]
        return {
            "tokens": texts,
            "token_logprobs": [None if x is None else finite(x) for x in logprobs],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def echo_logprobs(self, index: int) -> Optional[dict]:
        """The prompt's tokens' log-probabilities (``echo`` with ``logprobs``), their text offsets
        from the start of the echoed text; None where they were not asked for."""
        prompt = self.prompt_of(index)
        if prompt.scores is None:
            return None
        self.offsets[index] = 0
        logprobs, top = prompt.scores
        part = self._completion_logprobs(index, prompt.ids, logprobs, top if self.k else None)
        # The completion's tokens follow the echoed text (whose decoding may be shorter than its tokens' own
        # texts end to end: a tokenizer joins some pieces); offsets never go back.
        self.offsets[index] = max(len(prompt.echo), self.offsets[index])
        return part

    def no_logprobs(self) -> Optional[dict]:
        """An empty log-probabilities object (a choice with no tokens), or None where none were asked."""
        if self.k is None:
            return None
        if self.chat:
            return {"content": [], "refusal": None}
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [] if self.k else None, "text_offset": []}

    def merge_logprobs(self, parts: list) -> Optional[dict]:
        parts = [p for p in parts if p is not None]
        if not parts:
            return self.no_logprobs()
        merged = {key: ([] if value is not None else None) for key, value in parts[0].items() if key != "refusal"}
        for p in parts:
            for key in merged:
                if merged[key] is not None and p[key] is not None:
                    merged[key].extend(p[key])
        if "content" in merged:
            merged["refusal"] = None
        return merged

    def choice(self, index: int, text: str, logprobs, finish: Optional[str]) -> dict:
        if self.chat:
            return {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def chunk(
        self, index: int, text: Optional[str], logprobs=None, finish: Optional[str] = None, first: bool = False
    ) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return {**self.head, "object": self.kind + ".chunk" if self.chat else self.kind, "choices": [choice]}

    def usage(self, done: list) -> dict:
        """Tokens: each prompt once (its ``n`` choices share its prefill), every choice's completion,
        and the prompt tokens read from the prefix cache instead of prefilled (OpenAI's
        ``prompt_tokens_details.cached_tokens``)."""
        firsts = [done[p * self.n] for p in range(len(self.prompts))]
        prompt = sum(d.prompt_tokens for d in firsts)
        completion = sum(d.completion_tokens for d in done)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in firsts)},
        }

    def speculative(self, done: list) -> dict:
        """The rule used and the request's counters (summed over its choices)."""
        if len(done) == 1:
            return {"rule": self.rule, **done[0].stats}
        c, d, a = (sum(x.stats[key] for x in done) for key in ("cycles", "drafted", "accepted"))
        tokens = sum(cycle_tokens(x.completion_tokens) for x in done)
        at, lengths = [], []
        for x in done:
            add_into(at, x.stats["accepted_at"])
            add_into(lengths, x.stats["draft_lengths"])
        return dict(
            rule=self.rule,
            cycles=c,
            drafted=d,
            accepted=a,
            tau=tokens / c if c else 0.0,
            acceptance_rate=a / d if d else 0.0,
            accepted_at=at,
            draft_lengths=lengths,
        )

    def nothing_generated(self) -> dict:
        """Every choice's end where the request asked for no tokens (``max_tokens`` 0)."""
        return {
            g: events_lib.Done("length", len(self.prompt_of(g).ids), 0, dict(NO_STATS), g % self.n)
            for g in range(self.choices)
        }


async def _wait_for_disconnect(raw: Request) -> None:
    """Returns when the client has gone (the body is read; what ``receive`` gives next is the
    disconnect)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def cancel_all(scheduler, requests) -> None:
    for request in requests:
        scheduler.cancel(request)  # a no-op where it finished


async def first_event(raw: Request, scheduler, requests, events: asyncio.Queue):
    """The request's first event, before a stream's response starts: a request that fails while it
    waits for a slot (a shutdown) gets an error status (503), not a stream that carries the error.
    None where the client left meanwhile (the requests are cancelled)."""
    gone = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        get = asyncio.ensure_future(events.get())
        await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            cancel_all(scheduler, requests)
            return None
        tagged = get.result()
        if isinstance(tagged[1], events_lib.Failed):
            cancel_all(scheduler, requests)
            raise failure(tagged[1])
        return tagged
    except asyncio.CancelledError:
        cancel_all(scheduler, requests)
        raise
    finally:
        gone.cancel()


async def collect(raw: Request, scheduler, requests, events: asyncio.Queue, reply: Reply):
    """A non-streaming response; a client that goes away cancels the request at once."""
    count = reply.choices
    texts, logprobs = [[] for _ in range(count)], [[reply.echo_logprobs(g)] for g in range(count)]
    done = {} if requests else reply.nothing_generated()
    gone = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        while len(done) < count:
            get = asyncio.ensure_future(events.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                cancel_all(scheduler, requests)
                return JSONResponse({}, status_code=499)
            tag, event = get.result()
            index = reply.index(tag, event)
            if isinstance(event, events_lib.Delta):
                texts[index].append(event.text)
                logprobs[index].append(reply.logprobs(index, event))
            elif isinstance(event, events_lib.Failed):
                cancel_all(scheduler, requests)
                raise failure(event)
            else:
                done[index] = event
    except asyncio.CancelledError:
        cancel_all(scheduler, requests)
        raise
    finally:
        gone.cancel()
    finished = [done[g] for g in range(count)]
    choices = [
        reply.choice(
            g, reply.prompt_of(g).echo + "".join(texts[g]), reply.merge_logprobs(logprobs[g]), finished[g].finish_reason
        )
        for g in range(count)
    ]
    return {
        **reply.head,
        "object": reply.kind,
        "choices": choices,
        "usage": reply.usage(finished),
        "speculative": reply.speculative(finished),
    }


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def sse_events(scheduler, requests, events: asyncio.Queue, reply: Reply, include_usage: bool, first=None):
    """Server-sent events: chunks of each choice's new text, each choice's finish reason,
    the usage (with ``include_usage``), ``[DONE]``; a failure after the stream began (the
    drain's end at shutdown, non-finite logits) as an ``error`` event before ``[DONE]``.
    ``first``: the first ``(tag, event)``, already read (:func:`first_event`). A client that
    goes away cancels the request (Starlette cancels this generator)."""
    extra = {"usage": None} if include_usage else {}
    done = {} if requests else reply.nothing_generated()
    try:
        if reply.chat:
            for g in range(reply.choices):
                yield _sse({**reply.chunk(g, None, first=True), **extra})
        for g in range(reply.choices):
            echo, scores = reply.prompt_of(g).echo, reply.echo_logprobs(g)
            if echo or scores:
                yield _sse({**reply.chunk(g, echo, scores), **extra})
        if not requests:
            for g in range(reply.choices):
                yield _sse(
                    {**reply.chunk(g, None, finish="length"), **extra, "speculative": {"rule": reply.rule, **NO_STATS}}
                )
        pending = [first] if first is not None else []
        while len(done) < reply.choices:
            tag, event = pending.pop() if pending else await events.get()
            index = reply.index(tag, event)
            if isinstance(event, events_lib.Delta):
                logprobs = reply.logprobs(index, event)
                if event.text or logprobs:
                    yield _sse({**reply.chunk(index, event.text, logprobs), **extra})
            elif isinstance(event, events_lib.Failed):
                yield _sse(failure(event).body())
                break
            else:
                done[index] = event
                yield _sse(
                    {
                        **reply.chunk(index, None, finish=event.finish_reason),
                        **extra,
                        "speculative": {"rule": reply.rule, **event.stats},
                    }
                )
        if include_usage and len(done) == reply.choices:
            yield _sse(
                {
                    **reply.head,
                    "object": reply.chunk(0, None)["object"],
                    "choices": [],
                    "usage": reply.usage([done[g] for g in range(reply.choices)]),
                }
            )
        yield "data: [DONE]\n\n"
    finally:
        cancel_all(scheduler, requests)  # frees the slots where the client left
