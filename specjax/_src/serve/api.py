"""The OpenAI-compatible HTTP API (FastAPI) in front of a :class:`Scheduler`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming by
server-sent events or not), ``GET /v1/models``, ``GET /health`` (200 once the
engine's programs are compiled, 503 before), ``GET /metrics`` (Prometheus
text). Error bodies follow OpenAI's: ``{"error": {"message", "type", "param",
"code"}}``; a request the server cannot serve as asked (a bad field, an
unknown model, a prompt or ``max_tokens`` beyond the slot capacity, ``n > 1``,
``logprobs``) gets 400 before it is queued, a full queue 429, a server that is
warming up or shutting down 503.

Extensions in the bodies: ``top_k``, ``repetition_penalty``, ``min_tokens``
and ``num_draft`` (the most drafts per cycle for this request; 0 turns
speculative decoding off) in a request; ``speculative`` (the request's
cycles, drafted and accepted tokens, tau and acceptance rate) in a response
and in a stream's last chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Annotated, Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Strict, StrictBool, StrictInt, StrictStr

from specjax._src.engine.slots import SlotSettings
from specjax._src.engine.text import check_stop_strings
from specjax._src.processors import GenerationControls
from specjax._src.serve import scheduler as sched

Number = Annotated[float, Strict()]  # an int or a float; not a string or a bool


# ---------------------------------------------------------------------------
# Request bodies
# ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: Optional[StrictBool] = False


class _Sampling(BaseModel):
    """The fields both endpoints share (unknown fields are ignored, as OpenAI's ``user`` is)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    top_k: Optional[StrictInt] = None
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    logit_bias: Optional[dict[str, Number]] = None
    min_tokens: Optional[StrictInt] = None
    num_draft: Optional[StrictInt] = None
    n: Optional[StrictInt] = None
    best_of: Optional[StrictInt] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    logprobs: Optional[StrictInt] = None
    echo: Optional[StrictBool] = False
    suffix: Optional[StrictStr] = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    text: Optional[StrictStr] = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: StrictStr
    content: Optional[Union[StrictStr, list[ContentPart]]] = None


class ChatRequest(_Sampling):
    messages: list[Message]
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[list[Any]] = None


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class ApiError(Exception):
    """An OpenAI-style error: ``status``, ``message``, ``type``, ``param``, ``code``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# Where an engine check names a field, the request field it came from.
_ENGINE_FIELDS = (("repetition_penalty", "repetition_penalty"), ("presence_penalty", "presence_penalty"),
                  ("frequency_penalty", "frequency_penalty"), ("logit_bias", "logit_bias"),
                  ("min_new_tokens", "min_tokens"), ("top_k", "top_k"), ("top_p", "top_p"),
                  ("temperature", "temperature"), ("num_draft", "num_draft"), ("seed", "seed"),
                  ("max_new_tokens", "max_tokens"))


# ---------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------


class ServerConfig:
    """What the routes need besides the scheduler.

    Args:
      model_name: the name ``/v1/models`` lists and requests must give.
      target: the target :class:`specjax.Model` (its tokenizer and chat template).
      max_stop: stop strings per request.
    """

    def __init__(self, model_name: str, target, *, max_stop: int = 4):
        self.model_name, self.target, self.max_stop = model_name, target, max_stop
        self.created = int(time.time())


def create_app(scheduler: sched.Scheduler, config: ServerConfig, *, drain_seconds: float = 30.0) -> FastAPI:
    """The FastAPI app; its lifespan starts ``scheduler`` (compiling in the
    background: ``/health`` is 503 until it is ready) and closes it on shutdown
    (waiting requests are refused, live ones get ``drain_seconds`` to finish)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not scheduler._thread.is_alive() and not scheduler.ready.is_set():
            scheduler.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, scheduler.close, drain_seconds)

    app = FastAPI(title="specjax", lifespan=lifespan)
    app.state.scheduler, app.state.config = scheduler, config

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None  # the request's field; the message gives the full path
        message = f"{'.'.join(loc)}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, param = "The body is not valid JSON.", None
        return JSONResponse(_bad(message, param, "invalid_value").body(), status_code=400)

    @app.get("/health")
    async def health():
        if scheduler.error is not None:
            return JSONResponse({"status": "failed", "error": str(scheduler.error)}, status_code=503)
        if not scheduler.ready.is_set():
            return JSONResponse({"status": "warming up"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": config.created,
                                            "owned_by": "specjax"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(scheduler.metrics()), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        _check_common(body, config)
        if body.logprobs:
            raise _bad("logprobs is not supported by this server; leave it unset.", "logprobs", "unsupported")
        if body.echo:
            raise _bad("echo is not supported by this server; leave it unset.", "echo", "unsupported")
        if body.suffix:
            raise _bad("suffix is not supported by this server; leave it unset.", "suffix", "unsupported")
        prompt = _completion_prompt(body.prompt, config.target)
        return await _serve(raw, scheduler, config, body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, raw: Request):
        _check_common(body, config)
        if body.logprobs or body.top_logprobs:
            raise _bad("logprobs is not supported by this server; leave it unset.", "logprobs", "unsupported")
        if body.tools:
            raise _bad("tools are not supported by this server.", "tools", "unsupported")
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        prompt = _chat_prompt(body.messages, config.target)
        return await _serve(raw, scheduler, config, body, prompt, chat=True)

    return app


# ---------------------------------------------------------------------------
# Checks: everything the engine would refuse is refused before queuing
# ---------------------------------------------------------------------------


def _check_common(body: _Sampling, config: ServerConfig) -> None:
    if body.model != config.model_name:
        raise _bad(f"The model `{body.model}` does not exist; this server serves `{config.model_name}` "
                   "(GET /v1/models).", "model", "model_not_found")
    if body.n not in (None, 1):
        raise _bad(f"n={body.n}: this server generates one choice per request; send n requests instead.",
                   "n", "unsupported")
    if body.best_of not in (None, 1):
        raise _bad("best_of is not supported by this server; leave it unset.", "best_of", "unsupported")
    if body.stream_options is not None and not body.stream:
        raise _bad("stream_options is only allowed with stream=true.", "stream_options")


def _completion_prompt(prompt, target) -> list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise _bad(f"prompt holds {len(prompt)} prompts; this server takes one per request.", "prompt",
                       "unsupported")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = target.tokenizer.encode(prompt).ids
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < target.vocab_size]
        if bad:
            raise _bad(f"prompt token {bad[0]} is not in the vocabulary (0 .. {target.vocab_size - 1}).", "prompt")
    if not ids:
        raise _bad("prompt is empty: give at least one token of text.", "prompt")
    return ids


def _chat_prompt(messages, target) -> list[int]:
    from specjax._src.chat import encode_chat

    if not messages:
        raise _bad("messages is empty: give at least one message.", "messages")
    if target.chat_template is None:
        raise _bad("The served model has no chat template: send plain prompts to /v1/completions, or start the "
                   "server with --chat-template FILE (a Jinja template).", "messages", "no_chat_template")
    plain = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise _bad(f"messages[{i}].content: only text parts are supported.", f"messages.{i}.content",
                           "unsupported")
            content = "".join(part.text or "" for part in content)
        plain.append({"role": m.role, "content": content or ""})
    try:
        return encode_chat(target, plain)
    except ValueError as e:
        raise _bad(str(e), "messages") from None
    except Exception as e:  # noqa: BLE001 -- a template's own error (jinja raise_exception, e.g. roles)
        raise _bad(f"The chat template refused the messages: {e}", "messages") from None


def _settings(body: _Sampling, prompt: list[int], scheduler: sched.Scheduler, config: ServerConfig):
    """``(SlotSettings, stop strings)`` for ``body``, checked as the engine will."""
    engine = scheduler.engine
    room = engine.capacity - len(prompt)
    if room < 1:
        raise _bad(f"The prompt is {len(prompt)} tokens; a slot holds {engine.capacity} (prompt and completion "
                   "together), so it leaves no room for a completion. Shorten the prompt, or start the server "
                   "with a larger --capacity.", "prompt" if isinstance(body, CompletionRequest) else "messages",
                   "context_length_exceeded")
    max_tokens = room if body.max_tokens is None else body.max_tokens
    if max_tokens < 1:
        raise _bad(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", "invalid_value")
    if max_tokens > room:
        raise _bad(f"max_tokens={max_tokens} with a prompt of {len(prompt)} tokens exceeds the slot capacity "
                   f"({engine.capacity} tokens, prompt and completion together): ask for at most {room}.",
                   "max_tokens", "context_length_exceeded")
    temperature = 1.0 if body.temperature is None else body.temperature
    if not 0.0 <= temperature <= 2.0:
        raise _bad(f"temperature must be in [0, 2], got {temperature}.", "temperature", "invalid_value")
    if body.seed is not None and not 0 <= body.seed < 2**32:
        raise _bad(f"seed must be in [0, 2**32), got {body.seed}.", "seed", "invalid_value")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    if len(stop) > config.max_stop:
        raise _bad(f"stop holds {len(stop)} strings; at most {config.max_stop}.", "stop", "invalid_value")
    try:
        stop = check_stop_strings(stop, config.target.tokenizer)
    except (TypeError, ValueError) as e:
        raise _bad(str(e), "stop", "invalid_value") from None
    bias = None
    if body.logit_bias:
        try:
            bias = {int(k): float(v) for k, v in body.logit_bias.items()}
        except ValueError:
            raise _bad("logit_bias keys must be token ids (integers as strings).", "logit_bias") from None
    controls = GenerationControls(
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=bias, min_new_tokens=body.min_tokens or 0)
    if not engine.cfg.controls:
        used = [name for name, value in (("repetition_penalty", body.repetition_penalty),
                                         ("presence_penalty", body.presence_penalty),
                                         ("frequency_penalty", body.frequency_penalty),
                                         ("logit_bias", body.logit_bias), ("min_tokens", body.min_tokens))
                if value not in (None, 0, 0.0, {}) and not (name == "repetition_penalty" and value == 1)]
        if used:
            raise _bad(f"{used[0]}: this server was started with --no-penalties (its engine has no logits "
                       "processors); leave the penalties, logit_bias and min_tokens unset.", used[0], "unsupported")
        controls = None
    settings = SlotSettings(
        temperature=float(temperature), top_p=1.0 if body.top_p is None else float(body.top_p), top_k=body.top_k,
        seed=body.seed, max_new_tokens=int(max_tokens), num_draft=body.num_draft, controls=controls)
    try:
        engine._check_settings(settings, len(prompt), 0)
    except (TypeError, ValueError) as e:
        message = str(e)
        param = next((api for name, api in _ENGINE_FIELDS if name in message), None)
        raise _bad(message, param, "invalid_value") from None
    return settings, stop


# ---------------------------------------------------------------------------
# Serving one request
# ---------------------------------------------------------------------------


def _emitter(loop: asyncio.AbstractEventLoop, events: asyncio.Queue):
    """``emit`` for the scheduler's thread: hands each event to the request's loop.

    Once the server's loop has closed (shutdown), nobody is left to read the
    events, so they are dropped instead of raising in the scheduler's thread.
    """

    def emit(event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:
            pass

    return emit


async def _serve(raw: Request, scheduler: sched.Scheduler, config: ServerConfig, body: _Sampling,
                 prompt: list[int], *, chat: bool):
    if scheduler.error is not None:
        raise ApiError(503, f"the server's engine failed: {scheduler.error}", type="server_error",
                       code="engine_error")
    if not scheduler.ready.is_set():
        raise ApiError(503, "the server is compiling its programs; retry when GET /health answers 200.",
                       type="server_error", code="warming_up")
    settings, stop = _settings(body, prompt, scheduler, config)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    request = sched.Request(prompt=prompt, settings=settings, stop=stop,
                            emit=_emitter(loop, events))
    try:
        scheduler.submit(request)
    except sched.QueueFull as e:
        raise ApiError(429, str(e), type="rate_limit_error", code="queue_full") from None
    except sched.Closed as e:
        raise ApiError(503, str(e), type="server_error", code="shutting_down") from None
    head = dict(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()),
                model=config.model_name)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse_events(scheduler, request, events, head, chat, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _collect(raw, scheduler, request, events, head, chat)


def _error_status(event: sched.Failed) -> ApiError:
    if event.code == "invalid_request":
        return _bad(event.message, None, "invalid_value")
    return ApiError(503 if event.code == "shutting_down" else 500, event.message, type="server_error",
                    code=event.code)


def _usage(done: sched.Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


async def _collect(raw: Request, scheduler, request, events: asyncio.Queue, head: dict, chat: bool):
    """A non-streaming response; a client that goes away cancels the request."""
    parts = []
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await raw.is_disconnected():
                    scheduler.cancel(request)
                    return JSONResponse({}, status_code=499)
                continue
            if isinstance(event, sched.Delta):
                parts.append(event.text)
            elif isinstance(event, sched.Failed):
                raise _error_status(event)
            else:
                break
    except asyncio.CancelledError:
        scheduler.cancel(request)
        raise
    text = "".join(parts)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": event.finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": event.finish_reason}
    return {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
            "usage": _usage(event), "speculative": event.stats}


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _sse_events(scheduler, request, events: asyncio.Queue, head: dict, chat: bool, include_usage: bool):
    """Server-sent events: one chunk per step's new text, then the finish reason,
    the usage (with ``include_usage``), ``[DONE]``. A client that goes away
    cancels the request (Starlette cancels this generator)."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}

    def chunk(text: Optional[str], finish: Optional[str] = None, first: bool = False) -> dict:
        if chat:
            delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**head, "object": kind, "choices": [choice], **extra}

    try:
        if chat:
            yield _sse(chunk(None, first=True))
        while True:
            event = await events.get()
            if isinstance(event, sched.Delta):
                yield _sse(chunk(event.text))
            elif isinstance(event, sched.Failed):
                yield _sse(_error_status(event).body())
                break
            else:
                yield _sse({**chunk(None, event.finish_reason), "speculative": event.stats})
                if include_usage:
                    yield _sse({**head, "object": kind, "choices": [], "usage": _usage(event)})
                break
        yield "data: [DONE]\n\n"
    finally:
        scheduler.cancel(request)  # a no-op where it finished; frees the slot where the client left


# ---------------------------------------------------------------------------
# Prometheus text
# ---------------------------------------------------------------------------

_METRICS = (
    ("specjax_requests_finished_total", "counter", "requests_finished", "Requests that completed."),
    ("specjax_requests_failed_total", "counter", "requests_failed", "Requests that failed after being queued."),
    ("specjax_requests_cancelled_total", "counter", "requests_cancelled",
     "Requests cancelled while generating (their client went away)."),
    ("specjax_requests_refused_total", "counter", "requests_refused", "Requests refused because the queue was full."),
    ("specjax_prompt_tokens_total", "counter", "prompt_tokens", "Prompt tokens prefilled."),
    ("specjax_generation_tokens_total", "counter", "completion_tokens", "Tokens generated by finished requests."),
    ("specjax_drafted_tokens_total", "counter", "drafted", "Draft tokens proposed (finished requests)."),
    ("specjax_accepted_tokens_total", "counter", "accepted", "Draft tokens accepted (finished requests)."),
    ("specjax_cycles_total", "counter", "cycles", "Draft-verify cycles (target forwards) of finished requests."),
    ("specjax_steps_total", "counter", "steps", "engine.step calls."),
    ("specjax_prefills_total", "counter", "prefills", "Prefill calls (requests admitted together share one)."),
    ("specjax_prefilled_requests_total", "counter", "prefilled_requests", "Requests prefilled."),
    ("specjax_step_seconds_total", "counter", "step_seconds", "Wall time in engine.step, reading its output included."),
    ("specjax_prefill_seconds_total", "counter", "insert_seconds", "Wall time in prefills (insert, waited for) and release."),
    ("specjax_busy_seconds_total", "counter", "busy_seconds", "The scheduler loop's wall time while serving."),
    ("specjax_queue_depth", "gauge", "queue_depth", "Requests waiting for a slot."),
    ("specjax_live_slots", "gauge", "live_slots", "Slots holding a request."),
    ("specjax_slots", "gauge", "num_slots", "Slots in the engine."),
    ("specjax_acceptance_rate", "gauge", "acceptance_rate", "Accepted / drafted tokens over finished requests."),
    ("specjax_tau", "gauge", "tau", "Generated tokens per target forward over finished requests."),
    ("specjax_host_share", "gauge", "host_share",
     "Share of the scheduler's busy wall time spent outside the engine's calls."),
)


def prometheus_text(m: dict) -> str:
    """The scheduler's metrics in Prometheus' text exposition format."""
    m = dict(m)
    m["acceptance_rate"] = m["accepted"] / m["drafted"] if m["drafted"] else 0.0
    m["tau"] = m["completion_tokens"] / m["cycles"] if m["cycles"] else 0.0
    lines = []
    for name, kind, key, help_text in _METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {float(m[key]):.6g}"]
    return "\n".join(lines) + "\n"
