"""The OpenAI-compatible HTTP API (FastAPI) in front of a :class:`Scheduler`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming by
server-sent events or not), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health`` (200 once the engine's programs are compiled, 503 before),
``GET /metrics`` (Prometheus text). Every error body, a 404 or a body that is
not JSON included, is OpenAI's ``{"error": {"message", "type", "param",
"code"}}``; a request the server cannot serve as asked gets 400 before it is
queued (:mod:`specjax._src.serve.fields` says which fields are refused and
which ignored), a body over the size limit 413, a wrong API key 401, a full
server 429, a server that is warming up or shutting down 503 (429 and 503
with ``Retry-After``). Every response carries ``X-Request-Id`` (the
request's own, where it sent one).

This module holds the app, its middleware and the routes; the request bodies
are in :mod:`~specjax._src.serve.schemas`, their checks in
:mod:`~specjax._src.serve.validation`, the answers in
:mod:`~specjax._src.serve.replies`, a prompt's own log-probabilities in
:mod:`~specjax._src.serve.scoring` and ``/metrics`` in
:mod:`~specjax._src.serve.metrics`. It reads the prompts' tokens in a worker
thread, never on the event loop, and asks the engine
(:meth:`specjax.engine.Engine.validate`) which settings it would refuse. A
completions request's list of prompts is queued all or none, one scheduler
request per prompt. A stream's status waits for its first event, so a
request refused while it waited (a shutdown) gets 503, not a stream. The
scheduler owns the slots.

Extensions in the bodies: ``top_k``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens`` (vLLM's) and
``num_draft`` (the most drafts per cycle for this request; 0 turns
speculative decoding off) and ``speculative`` (``{"rule": "mars:theta=0.8",
"num_draft": 3}``: the request's acceptance rule, one of those the server
serves, and its draft cap) in a request; ``speculative`` (the rule used and
the request's cycles, drafted and accepted tokens, tau, acceptance rate,
drafts accepted per position and the draft lengths chosen per cycle) in a
response and in a stream's last chunk; ``speculative`` (the served rules) in
the model card.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specjax._src.serve import replies
from specjax._src.serve import scheduler as sched
from specjax._src.serve import scoring
from specjax._src.serve import validation as checks
from specjax._src.serve.config import ServerConfig
from specjax._src.serve.errors import ApiError, refusal, server_error
from specjax._src.serve.metrics import prometheus_text
from specjax._src.serve.schemas import MAX_STOP_TOKEN_IDS, ChatRequest, CompletionRequest, Sampling
from specjax._src.proposals.trees import tree_spec

__all__ = ["ServerConfig", "create_app", "prometheus_text", "MAX_STOP_TOKEN_IDS", "ApiError"]


# ---------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------


def create_app(scheduler: sched.Scheduler, config: ServerConfig, *, drain_seconds: float = 30.0) -> FastAPI:
    """The FastAPI app; its lifespan starts ``scheduler`` (compiling in the background:
    ``/health`` is 503 until it is ready) and closes it on shutdown (waiting requests are
    refused, live ones get ``drain_seconds`` to finish; :class:`specjax._src.serve.server.
    DrainingServer` starts that drain as soon as the shutdown begins)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not scheduler._thread.is_alive() and not scheduler.ready.is_set():
            scheduler.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, scheduler.close, drain_seconds)

    # No /docs, /redoc or /openapi.json (undocumented routes outside the API key), and no 307
    # redirect for a trailing slash (its Location would come from the client's Host header).
    app = FastAPI(title="specjax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.router.redirect_slashes = False
    app.state.scheduler, app.state.config = scheduler, config
    app.add_middleware(_Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    return app


# ---------------------------------------------------------------------------
# Before the routes: request id, API key, body size
# ---------------------------------------------------------------------------

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces: safe to echo in a header


class _Guard:
    """ASGI middleware: gives every response an ``X-Request-Id``, checks the API key of
    ``/v1`` requests, and refuses a body over ``max_body_bytes`` with 413 (by its
    ``Content-Length`` at once, or while it is read)."""

    def __init__(self, app, *, api_key: Optional[str], max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())]}
            await send(message)

        if self.api_key is not None and scope["path"].startswith("/v1"):
            sent = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(sent.encode(), f"Bearer {self.api_key}".encode()):
                error = ApiError(
                    401,
                    "Incorrect or missing API key: send the header `Authorization: Bearer <key>` "
                    "with the key the server was started with (--api-key).",
                    type="authentication_error",
                    code="invalid_api_key",
                )
                return await error.response()(scope, receive, send_with_id)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large().response()(scope, receive, send_with_id)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large()
            return message

        started = False

        async def send_tracked(message):
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send_with_id(message)

        try:
            await self.app(scope, counted_receive, send_tracked)
        except Exception:  # noqa: BLE001 -- answered here so that the 500 carries the request id too
            logging.getLogger("specjax.serve").exception("request %s failed", request_id)
            if started:
                raise
            await server_error().response()(scope, receive, send_with_id)

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"The request body exceeds {self.max_body_bytes} bytes (the server's "
            "--max-body-bytes); send a shorter prompt.",
            code="request_too_large",
        )


async def _api_error(request, e: ApiError):
    return e.response()


async def _http_error(request, e: StarletteHTTPException):
    if e.status_code == 404:
        message, code = (
            f"No route {request.method} {request.url.path}; see GET /v1/models, POST /v1/completions "
            "and POST /v1/chat/completions.",
            "not_found",
        )
    elif e.status_code == 405:
        message, code = f"{request.method} is not allowed on {request.url.path}.", "method_not_allowed"
    else:
        message, code = str(e.detail), None
    return JSONResponse(
        ApiError(e.status_code, message, code=code).body(),
        status_code=e.status_code,
        headers=getattr(e, "headers", None),
    )


async def _internal_error(request, e: Exception):
    return server_error().response()


# ---------------------------------------------------------------------------
# The routes
# ---------------------------------------------------------------------------


async def health(raw: Request):
    scheduler: sched.Scheduler = raw.app.state.scheduler
    if scheduler.error is not None:
        return JSONResponse({"status": "failed", "error": str(scheduler.error)}, status_code=503)
    if scheduler.closing:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    if not scheduler.ready.is_set():
        return JSONResponse({"status": "warming up"}, status_code=503, headers={"Retry-After": "5"})
    return {"status": "ok"}


def _model_card(config: ServerConfig, engine) -> dict:
    """OpenAI's model object, and ``speculative``: the rules a request may name (the first is the
    default), the most drafts per cycle, and the token tree each cycle drafts (None: chains)."""
    return {
        "id": config.model_name,
        "object": "model",
        "created": config.created,
        "owned_by": "specjax",
        "speculative": {
            "rules": [str(r) for r in engine.served_rules],
            "default_rule": checks.default_rule(engine),
            "num_draft": engine.num_draft,
            "tree": None if engine.tree is None else tree_spec(engine.tree),
        },
    }


async def list_models(raw: Request):
    return {"object": "list", "data": [_model_card(raw.app.state.config, raw.app.state.scheduler.engine)]}


async def retrieve_model(raw: Request, model_id: str):
    config: ServerConfig = raw.app.state.config
    if model_id != config.model_name:
        raise ApiError(
            404,
            f"The model `{model_id}` does not exist; this server serves `{config.model_name}`.",
            param="model",
            code="model_not_found",
        )
    return _model_card(config, raw.app.state.scheduler.engine)


async def metrics(raw: Request):
    return PlainTextResponse(prometheus_text(raw.app.state.scheduler.metrics()), media_type="text/plain; version=0.0.4")


async def completions(raw: Request):
    began = time.perf_counter()
    scheduler, config = raw.app.state.scheduler, raw.app.state.config
    body = await checks.parse_body(raw, CompletionRequest)
    checks.check_common(body, scheduler, config)
    k = checks.completion_logprobs(body, scheduler.engine)
    capacity = scheduler.engine.capacity
    texts = checks.completion_prompts(body.prompt)
    many = len(texts) > 1
    prompts = []
    for i, text in enumerate(texts):
        ids = await asyncio.to_thread(checks.completion_prompt, text, config, capacity, i if many else None)
        echo, scores = "", None
        if body.echo:
            echo = (
                text
                if isinstance(text, str)
                else config.target.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens is not False)
            )
            if k is not None:  # the prompt's own log-probabilities (lm-evaluation-harness' loglikelihood)
                scores = await asyncio.to_thread(scoring.prompt_logprobs, config.target, ids, k)
        prompts.append(replies.Prompt(ids, echo, scores))
    return await _serve(raw, body, prompts, k, began, chat=False)


async def chat_completions(raw: Request):
    began = time.perf_counter()
    scheduler, config = raw.app.state.scheduler, raw.app.state.config
    body = await checks.parse_body(raw, ChatRequest)
    checks.check_common(body, scheduler, config)
    if body.max_completion_tokens is not None:
        body.max_tokens = body.max_completion_tokens
    k = checks.chat_logprobs(body, scheduler.engine)
    messages = checks.chat_messages(body.messages)
    ids = await asyncio.to_thread(
        checks.chat_prompt, messages, config, scheduler.engine.capacity, bool(body.add_generation_prompt)
    )
    return await _serve(raw, body, [replies.Prompt(ids)], k, began, chat=True)


# ---------------------------------------------------------------------------
# Serving one request
# ---------------------------------------------------------------------------


async def _serve(raw: Request, body: Sampling, prompts: list, k: Optional[int], began: float, *, chat: bool):
    """Queues one scheduler request per prompt (all or none) and answers from their events."""
    scheduler: sched.Scheduler = raw.app.state.scheduler
    config: ServerConfig = raw.app.state.config
    if scheduler.error is not None:
        raise ApiError(503, f"the server's engine failed: {scheduler.error}", type="server_error", code="engine_error")
    if scheduler.closing:
        raise refusal(sched.Closed("the server is shutting down and takes no new requests."))
    if not scheduler.ready.is_set():
        raise ApiError(
            503,
            "the server is compiling its programs; retry when GET /health answers 200.",
            type="server_error",
            code="warming_up",
            retry_after=5,
        )
    checked = [checks.request_settings(body, p.ids, k, scheduler, config) for p in prompts]
    settings = checked[0][0]
    events: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    requests = []
    if body.max_tokens != 0 or chat:  # max_tokens 0 (completions): the prompts' scores alone, no slot
        requests = [
            sched.Request(
                prompt=p.ids,
                settings=s,
                stop=stop,
                n=body.n or 1,
                skip_special_tokens=body.skip_special_tokens is not False,
                emit=replies.emitter(loop, events, tag),
                arrived=began,
            )
            for tag, (p, (s, stop)) in enumerate(zip(prompts, checked))
        ]
        try:
            scheduler.submit_many(requests)
        except (sched.QueueFull, sched.Closed) as e:
            raise refusal(e) from None
    rule = checks.default_rule(scheduler.engine) if settings.rule is None else str(settings.rule)
    reply = replies.Reply(
        config,
        chat,
        body.n or 1,
        k,
        prompts,
        rule,
        head=dict(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()), model=config.model_name
        ),
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        first = None
        if requests:  # the status waits for the first event: a request refused while it waited gets 503
            first = await replies.first_event(raw, scheduler, requests, events)
            if first is None:
                return JSONResponse({}, status_code=499)
        return StreamingResponse(
            replies.sse_events(scheduler, requests, events, reply, include_usage, first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    return await replies.collect(raw, scheduler, requests, events, reply)
