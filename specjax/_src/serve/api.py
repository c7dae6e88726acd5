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

This layer parses, validates and streams; it reads the prompt's tokens in a
worker thread, never on the event loop, and asks the engine
(:meth:`specjax.engine.Engine.validate`) which settings it would refuse.
The scheduler owns the slots.

Extensions in the bodies: ``top_k``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens`` (vLLM's) and
``num_draft`` (the most drafts per cycle for this request; 0 turns
speculative decoding off) and ``speculative`` (``{"rule": "mars:theta=0.8",
"num_draft": 3}``: the request's acceptance rule, one of those the server
serves, and its draft cap) in a request; ``speculative`` (the rule used and
the request's cycles, drafted and accepted tokens, tau, acceptance rate,
drafts accepted per position and the draft lengths chosen per cycle) in a response and in a stream's last chunk; ``speculative`` (the served rules)
in the model card.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import math
import random
import re
import secrets
import time
import uuid
from typing import Annotated, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Strict, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specjax._src.engine.cycle import LOGPROB_FLOOR
from specjax._src.engine.slots import SlotSettings
from specjax._src.engine.text import check_stop_strings
from specjax._src.logits.processors import GenerationControls
from specjax._src.rules.base import RuleSpec
from specjax._src.rules.combinators import OneOf
from specjax._src.rules.parse import parse_spec, rule_from_spec
from specjax._src.serve import fields as fields_lib
from specjax._src.serve import scheduler as sched
from specjax._src.proposals.trees import tree_spec

Number = Annotated[float, Strict()]  # an int or a float; not a string or a bool

MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 16
MAX_RULE_CHARS = 256  # an engine built for the server holds these beside the model's EOS ids
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")  # ASCII digits only (str.isdigit takes other scripts')  # per stop string: the stream holds back this much text while it may be one
CHAT_ROLES = ("system", "developer", "user", "assistant")


# ---------------------------------------------------------------------------
# Request bodies
# ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: Optional[StrictBool] = False


class Speculative(BaseModel):
    """A request's ``speculative`` block (specjax's extension)."""

    model_config = ConfigDict(extra="forbid")

    rule: Optional[StrictStr] = None
    num_draft: Optional[StrictInt] = None


class _Sampling(BaseModel):
    """The fields both endpoints honour (others: :mod:`specjax._src.serve.fields`)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    top_k: Optional[StrictInt] = None
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: Optional[StrictBool] = False
    skip_special_tokens: Optional[StrictBool] = True
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    logit_bias: Optional[dict[str, Number]] = None
    min_tokens: Optional[StrictInt] = None
    num_draft: Optional[StrictInt] = None
    speculative: Optional[Speculative] = None
    n: Optional[StrictInt] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    logprobs: Optional[StrictInt] = None
    echo: Optional[StrictBool] = False


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
    add_generation_prompt: Optional[StrictBool] = True


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class ApiError(Exception):
    """An OpenAI-style error: ``status``, ``message``, ``type``, ``param``, ``code``, and the
    seconds to wait before a retry (``Retry-After``), where one helps."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, retry_after: Optional[int] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _bad(message: str, param: Optional[str] = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _unsupported(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported")


# ---------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------


class ServerConfig:
    """What the routes need besides the scheduler.

    Args:
      model_name: the name ``/v1/models`` lists and requests must give.
      target: the target :class:`specjax.Model` (its tokenizer and chat template).
      max_stop: stop strings per request.
      api_key: requests to ``/v1/...`` must send ``Authorization: Bearer <api_key>``
        (None: no key).
      max_body_bytes: the largest request body; a larger one gets 413.
      seed: where a request gives no ``seed``, draw its seed from a stream this
        seeds (a server started with the same seed and sent the same requests
        in the same order samples the same text); None: fresh randomness.
    """

    def __init__(self, model_name: str, target, *, max_stop: int = 4, api_key: Optional[str] = None,
                 max_body_bytes: int = 2 * 2**20, seed: Optional[int] = None):
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}.")
        self.model_name, self.target, self.max_stop = model_name, target, max_stop
        self.api_key, self.max_body_bytes = api_key or None, int(max_body_bytes)
        self.created = int(time.time())
        self._seeds = random.Random(seed) if seed is not None else None

    def request_seed(self) -> int:
        """A seed for a request that gave none."""
        return self._seeds.getrandbits(32) if self._seeds is not None else secrets.randbits(32)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token decodes to: a text of ``b`` bytes has at least
        ``b / max_token_bytes`` tokens, so a prompt too long is refused before it is tokenized."""
        tokenizer = self.target.tokenizer
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        return max(len(tokenizer.decode([i], skip_special_tokens=False).encode("utf-8", "replace"))
                   for i in range(size)) or 1

    @functools.lru_cache(maxsize=65536)  # noqa: B019 -- one config per server, kept for its life
    def token_text(self, token: int) -> str:
        """A token's own text, as logprobs name it."""
        return self.target.tokenizer.decode([token], skip_special_tokens=False)

    @functools.lru_cache(maxsize=65536)  # noqa: B019
    def token_bytes(self, token: int) -> list[int]:
        """A token's own bytes (chat logprobs' ``bytes``): a byte-level BPE token's raw bytes, which
        may be part of one UTF-8 character, or a ``<0xNN>`` byte-fallback token's byte; else the
        UTF-8 of its text."""
        piece = self.target.tokenizer.id_to_token(token)
        if piece is not None:
            fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
            if fallback:
                return [int(fallback.group(1), 16)]
            if _is_byte_level(self.target.tokenizer) and all(c in _BYTE_OF for c in piece):
                return [_BYTE_OF[c] for c in piece]
        return list(self.token_text(token).encode("utf-8"))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: each byte's printable stand-in character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


_BYTE_OF = {c: b for b, c in _bytes_to_unicode().items()}


def _is_byte_level(tokenizer) -> bool:
    return type(getattr(tokenizer, "decoder", None)).__name__ == "ByteLevel"


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
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", request_id.encode())]}
            await send(message)

        if self.api_key is not None and scope["path"].startswith("/v1"):
            sent = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(sent.encode(), f"Bearer {self.api_key}".encode()):
                error = ApiError(401, "Incorrect or missing API key: send the header `Authorization: Bearer <key>` "
                                 "with the key the server was started with (--api-key).",
                                 type="authentication_error", code="invalid_api_key")
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
            await _server_error().response()(scope, receive, send_with_id)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"The request body exceeds {self.max_body_bytes} bytes (the server's "
                        "--max-body-bytes); send a shorter prompt.", code="request_too_large")


async def _api_error(request, e: ApiError):
    return e.response()


async def _http_error(request, e: StarletteHTTPException):
    if e.status_code == 404:
        message, code = f"No route {request.method} {request.url.path}; see GET /v1/models, POST /v1/completions " \
                        "and POST /v1/chat/completions.", "not_found"
    elif e.status_code == 405:
        message, code = f"{request.method} is not allowed on {request.url.path}.", "method_not_allowed"
    else:
        message, code = str(e.detail), None
    return JSONResponse(ApiError(e.status_code, message, code=code).body(), status_code=e.status_code,
                        headers=getattr(e, "headers", None))


def _server_error() -> ApiError:
    return ApiError(500, "The server failed while answering this request; see its log for the request id.",
                    type="server_error", code="internal_error")


async def _internal_error(request, e: Exception):
    return _server_error().response()


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
    return {"id": config.model_name, "object": "model", "created": config.created, "owned_by": "specjax",
            "speculative": {"rules": [str(r) for r in engine.served_rules], "default_rule": _default_rule(engine),
                            "num_draft": engine.num_draft, "tree": None if engine.tree is None else tree_spec(engine.tree)}}


async def list_models(raw: Request):
    return {"object": "list", "data": [_model_card(raw.app.state.config, raw.app.state.scheduler.engine)]}


async def retrieve_model(raw: Request, model_id: str):
    config: ServerConfig = raw.app.state.config
    if model_id != config.model_name:
        raise ApiError(404, f"The model `{model_id}` does not exist; this server serves `{config.model_name}`.",
                       param="model", code="model_not_found")
    return _model_card(config, raw.app.state.scheduler.engine)


async def metrics(raw: Request):
    return PlainTextResponse(prometheus_text(raw.app.state.scheduler.metrics()),
                             media_type="text/plain; version=0.0.4")


async def completions(raw: Request):
    began = time.perf_counter()
    scheduler, config = raw.app.state.scheduler, raw.app.state.config
    body = await _parse(raw, CompletionRequest)
    _check_common(body, scheduler, config)
    k = _completion_logprobs(body, scheduler.engine)
    if body.echo and k is not None:
        raise _unsupported("echo with logprobs asks for the prompt's log-probabilities, which this server does "
                           "not compute; send echo or logprobs, not both.", "echo")
    prompt = await asyncio.to_thread(_completion_prompt, body.prompt, config, scheduler.engine.capacity)
    echo = (body.prompt if isinstance(body.prompt, str) else
            config.target.tokenizer.decode(prompt, skip_special_tokens=body.skip_special_tokens is not False)) \
        if body.echo else ""
    return await _serve(raw, body, prompt, k, began, chat=False, echo=echo)


async def chat_completions(raw: Request):
    began = time.perf_counter()
    scheduler, config = raw.app.state.scheduler, raw.app.state.config
    body = await _parse(raw, ChatRequest)
    _check_common(body, scheduler, config)
    if body.max_completion_tokens is not None:
        body.max_tokens = body.max_completion_tokens
    k = _chat_logprobs(body, scheduler.engine)
    messages = _chat_messages(body.messages)
    prompt = await asyncio.to_thread(_chat_prompt, messages, config, scheduler.engine.capacity,
                                     bool(body.add_generation_prompt))
    return await _serve(raw, body, prompt, k, began, chat=True)


# ---------------------------------------------------------------------------
# Parsing and checks: everything the engine would refuse is refused before queuing
# ---------------------------------------------------------------------------


async def _parse(raw: Request, model: type[BaseModel]):
    """The body as ``model``, or a 400 that says what is wrong with it."""
    data = await raw.body()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(f"The body is not valid UTF-8 (byte {e.start}); send JSON encoded as UTF-8.", None,
                   "invalid_json") from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise _bad("The body's JSON nests too deeply to read.", None, "invalid_json") from None
    except ValueError as e:
        if "int_max_str_digits" in str(e) or "integer string conversion" in str(e):
            raise _bad("The body holds an integer of more than 4300 digits; no field takes one.") from None
        raise _bad(f"The body is not valid JSON: {e}.", None, "invalid_json") from None
    if not isinstance(obj, dict):
        raise _bad(f"The body must be a JSON object, got {type(obj).__name__}.", None, "invalid_json")
    if _SURROGATE_ESCAPE.search(text):  # (valid UTF-8 holds no surrogate: only a \u escape can)
        _check_strings(obj)
    for name, value in obj.items():
        message = fields_lib.refusal(name, value)
        if message is not None:
            raise _unsupported(message, name)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(x) for x in first.get("loc", ())]
        param = (".".join(loc[:2]) if loc[:1] == ["speculative"] else loc[0]) if loc else None
        message = f"{'.'.join(loc)}: {first.get('msg', 'invalid value')}" if loc else first.get("msg", "invalid")
        if param in _UNION_FIELDS:  # pydantic names one arm of the union; say what the field takes
            message = _UNION_FIELDS[param]
        raise _bad(message, param) from None


_UNION_FIELDS = {
    "prompt": "prompt must be a string, a list of token ids (integers), or a list holding one of those.",
    "stop": "stop must be a string or a list of strings.",
    "messages": "messages must be a list of {role, content} objects, content a string or a list of text parts.",
}


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_strings(obj) -> None:
    """A 400 naming the first string that is not Unicode text (a lone surrogate such as
    ``"\\ud800"``, which JSON can carry and UTF-8 cannot)."""
    stack = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
            keys = [k for k in value if not _is_text(k)]
            if keys:
                raise _bad(f"A key in {path or 'the body'} is not valid Unicode (a lone surrogate).", path or None)
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", v) for i, v in enumerate(value))
        elif isinstance(value, str) and not _is_text(value):
            raise _bad(f"{path} holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                       "Unicode text; send the character's full escape pair, or the character itself.",
                       path.split(".")[0])


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _check_common(body: _Sampling, scheduler: sched.Scheduler, config: ServerConfig) -> None:
    if body.model != config.model_name:
        raise _bad(f"The model `{body.model}` does not exist; this server serves `{config.model_name}` "
                   "(GET /v1/models).", "model", "model_not_found")
    slots = scheduler.engine.num_slots
    if body.n is not None and not 1 <= body.n <= slots:
        raise _bad(f"n={body.n}: n is the number of choices, at least 1 and at most the server's {slots} slots "
                   "(each choice takes one).", "n")
    if body.stream_options is not None and not body.stream:
        raise _bad("stream_options is only allowed with stream=true.", "stream_options")
    if body.stop_token_ids and len(set(body.stop_token_ids)) > MAX_STOP_TOKEN_IDS:
        raise _bad(f"stop_token_ids holds {len(set(body.stop_token_ids))} ids; at most {MAX_STOP_TOKEN_IDS}.",
                   "stop_token_ids")
    if body.stop_token_ids and any(not 0 <= t < config.target.vocab_size for t in body.stop_token_ids):
        raise _bad(f"stop_token_ids must be token ids in 0 .. {config.target.vocab_size - 1}.", "stop_token_ids")


def _max_logprobs(engine) -> int:
    return engine.logprobs


def _completion_logprobs(body: CompletionRequest, engine) -> Optional[int]:
    if body.logprobs is None:
        return None
    most = _max_logprobs(engine)
    if most == 0:
        raise _unsupported("logprobs: this server was started with --max-logprobs 0.", "logprobs")
    if not 0 <= body.logprobs <= most:
        raise _bad(f"logprobs must be in 0 .. {most} (the alternatives per token), got {body.logprobs}.",
                   "logprobs")
    return body.logprobs


def _chat_logprobs(body: ChatRequest, engine) -> Optional[int]:
    if body.top_logprobs is not None and not body.logprobs:
        raise _bad("top_logprobs needs logprobs=true.", "top_logprobs")
    if not body.logprobs:
        return None
    most = _max_logprobs(engine)
    if most == 0:
        raise _unsupported("logprobs: this server was started with --max-logprobs 0.", "logprobs")
    k = body.top_logprobs or 0
    if not 0 <= k <= most:
        raise _bad(f"top_logprobs must be in 0 .. {most}, got {k}.", "top_logprobs")
    return k


def _too_long(what: str, param: str, capacity: int) -> ApiError:
    return _bad(f"The {what} is longer than a slot holds ({capacity} tokens, prompt and completion together). "
                "Shorten it, or start the server with a larger --capacity.", param, "context_length_exceeded")


def _completion_prompt(prompt, config: ServerConfig, capacity: int) -> list[int]:
    """The prompt's ids (in a worker thread: tokenizing a long text takes a while)."""
    target = config.target
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise _unsupported(f"prompt holds {len(prompt)} prompts; this server takes one per request (send n "
                               "for several choices of one prompt).", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if len(prompt.encode("utf-8")) > capacity * config.max_token_bytes:
            raise _too_long("prompt", "prompt", capacity)
        ids = target.tokenizer.encode(prompt).ids
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < target.vocab_size]
        if bad:
            raise _bad(f"prompt token {bad[0]} is not in the vocabulary (0 .. {target.vocab_size - 1}).", "prompt")
    if not ids:
        raise _bad("prompt is empty: give at least one token of text.", "prompt")
    return ids


def _chat_messages(messages: list[Message]) -> list[dict]:
    if not messages:
        raise _bad("messages is empty: give at least one message.", "messages")
    plain = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            hint = (" (tool results need tools, which this server does not implement)"
                    if m.role in ("tool", "function") else "")
            raise _bad(f"messages[{i}].role is {m.role!r}; a role is one of {', '.join(CHAT_ROLES)}{hint}.",
                       f"messages.{i}.role")
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise _unsupported(f"messages[{i}].content: only text parts are supported.", f"messages.{i}.content")
            content = "".join(part.text or "" for part in content)
        plain.append({"role": m.role, "content": content or ""})
    return plain


def _chat_prompt(messages: list[dict], config: ServerConfig, capacity: int, add_generation_prompt: bool) -> list[int]:
    """The rendered chat's ids (in a worker thread)."""
    from specjax._src.models.chat import encode_chat

    target = config.target
    if target.chat_template is None:
        raise _bad("The served model has no chat template: send plain prompts to /v1/completions, or start the "
                   "server with --chat-template FILE (a Jinja template).", "messages", "no_chat_template")
    if (len(messages) > capacity  # a template renders each message as one token at least
            or sum(len(m["content"].encode("utf-8")) for m in messages) > capacity * config.max_token_bytes):
        raise _too_long("conversation", "messages", capacity)
    try:
        return encode_chat(target, messages, add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise _bad(str(e), "messages") from None
    except Exception as e:  # noqa: BLE001 -- a template's own error (jinja raise_exception, e.g. roles)
        raise _bad(f"The chat template refused the messages: {e}", "messages") from None


# A SlotSettings field the engine refuses -> the request field it came from.
_REQUEST_FIELDS = {"max_new_tokens": "max_tokens", "controls.min_new_tokens": "min_tokens",
                   "controls.logit_bias": "logit_bias", "controls.presence_penalty": "presence_penalty",
                   "controls.frequency_penalty": "frequency_penalty",
                   "controls.repetition_penalty": "repetition_penalty", "eos_token_id": "stop_token_ids",
                   "rule": "speculative.rule"}


def _default_rule(engine) -> str:
    """The rule a request that names none gets."""
    rule = engine.rule
    return str(rule.chosen if isinstance(rule, OneOf) else rule)


def _request_rule(text: str, engine):
    """``speculative.rule``'s rule: a 400 naming the served rules for a spec that does not parse or
    names no served rule (:meth:`specjax.engine.Engine.rule_for`). A request never names a file
    (PAD's ``head``) for the server to read: a spec naming PAD must be a served rule's own."""
    served = [str(r) for r in engine.served_rules]
    where = f"this server serves {', '.join(served)} (GET /v1/models)"
    if len(text) > MAX_RULE_CHARS:  # (a spec is a few dozen characters; the messages below quote it)
        raise _bad(f"speculative.rule is longer than {MAX_RULE_CHARS} characters; {where}.", "speculative.rule")
    try:
        spec = parse_spec(text)
    except RecursionError:
        raise _bad(f"speculative.rule nests too deeply; {where}.", "speculative.rule") from None
    except ValueError as e:
        raise _bad(f"speculative.rule: {e}; {where}.", "speculative.rule") from None
    names, stack = set(), [spec]
    while stack:
        node = stack.pop()
        names.add(node.name)
        stack.extend(sub for _, value in node.params if isinstance(value, tuple)
                     for sub in value if isinstance(sub, RuleSpec))
    if "pad" in names:
        rule = next((r for r in engine.served_rules if str(r.spec) == str(spec)), None)
        if rule is None:
            raise _bad(f"speculative.rule: a request cannot give PAD a pivot head or numbers of its own; {where}.",
                       "speculative.rule")
    else:
        try:
            rule = rule_from_spec(spec)
        except RecursionError:
            raise _bad(f"speculative.rule nests too deeply; {where}.", "speculative.rule") from None
        except (TypeError, ValueError) as e:
            raise _bad(f"speculative.rule: {e}; {where}.", "speculative.rule") from None
    try:
        engine.rule_for(rule)
    except (TypeError, ValueError) as e:
        raise _bad(str(e), "speculative.rule") from None
    return rule


def _settings(body: _Sampling, prompt: list[int], k: Optional[int], scheduler: sched.Scheduler,
              config: ServerConfig):
    """``(SlotSettings, stop strings)`` for ``body``: the request's fields checked here, its
    settings by the engine (:meth:`specjax.engine.Engine.validate`)."""
    engine = scheduler.engine
    room = engine.capacity - len(prompt)
    if room < 1:
        raise _bad(f"The prompt is {len(prompt)} tokens; a slot holds {engine.capacity} (prompt and completion "
                   "together), so it leaves no room for a completion. Shorten the prompt, or start the server "
                   "with a larger --capacity.", "prompt" if isinstance(body, CompletionRequest) else "messages",
                   "context_length_exceeded")
    max_field = ("max_completion_tokens" if isinstance(body, ChatRequest) and body.max_completion_tokens is not None
                 else "max_tokens")
    max_tokens = room if body.max_tokens is None else body.max_tokens
    if max_tokens < 1:
        raise _bad(f"{max_field} must be at least 1, got {max_tokens}.", max_field)
    if max_tokens > room:
        raise _bad(f"{max_field}={max_tokens} with a prompt of {len(prompt)} tokens exceeds the slot capacity "
                   f"({engine.capacity} tokens, prompt and completion together): ask for at most {room}.",
                   max_field, "context_length_exceeded")
    if body.min_tokens is not None and body.min_tokens > max_tokens:
        raise _bad(f"min_tokens={body.min_tokens} exceeds {max_field}={max_tokens}: EOS, stop ids and stop strings "
                   "are held back until min_tokens, so the completion would end at the limit first.", "min_tokens")
    temperature = 1.0 if body.temperature is None else body.temperature
    if not 0.0 <= temperature <= 2.0:
        raise _bad(f"temperature must be in [0, 2], got {temperature}.", "temperature")
    if body.seed is not None and not 0 <= body.seed < 2**32:
        raise _bad(f"seed must be in [0, 2**32), got {body.seed}.", "seed")
    top_k = None if body.top_k in (None, 0, -1) else body.top_k  # vLLM's "off" is -1 (0 as well)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    if len(stop) > config.max_stop:
        raise _bad(f"stop holds {len(stop)} strings; at most {config.max_stop}.", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise _bad(f"a stop string is longer than {MAX_STOP_CHARS} characters.", "stop")
    try:
        stop = check_stop_strings(stop, config.target.tokenizer)
    except (TypeError, ValueError) as e:
        raise _bad(str(e), "stop") from None
    bias = None
    if body.logit_bias:
        bad_keys = [key for key in body.logit_bias if not _TOKEN_ID.fullmatch(key)]
        if bad_keys:
            raise _bad(f"logit_bias key {bad_keys[0][:40]!r} is not a token id: keys are token ids written as "
                       "decimal integers without sign, spaces or leading zeros (\"5\", \"1024\").", "logit_bias")
        bias = {int(key): float(value) for key, value in body.logit_bias.items()}
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
            raise _unsupported(f"{used[0]}: this server was started with --no-penalties (its engine has no logits "
                               "processors); leave the penalties, logit_bias and min_tokens unset.", used[0])
        controls = None
    num_draft, num_draft_param, rule = body.num_draft, "num_draft", None
    speculative = body.speculative
    if speculative is not None and speculative.num_draft is not None:
        if num_draft is not None and num_draft != speculative.num_draft:
            raise _bad(f"num_draft={num_draft} and speculative.num_draft={speculative.num_draft} disagree; give "
                       "one of them.", "speculative.num_draft")
        num_draft, num_draft_param = speculative.num_draft, "speculative.num_draft"
    if speculative is not None and speculative.rule is not None:
        rule = _request_rule(speculative.rule, engine)
    settings = SlotSettings(
        temperature=float(temperature), top_p=1.0 if body.top_p is None else float(body.top_p), top_k=top_k,
        seed=config.request_seed() if body.seed is None else body.seed, max_new_tokens=int(max_tokens),
        num_draft=num_draft, controls=controls, stop_token_ids=tuple(body.stop_token_ids or ()),
        eos_token_id=() if body.ignore_eos else None, logprobs=k, rule=rule)
    errors = engine.validate(settings, len(prompt))
    if errors:
        field, message = errors[0]
        param = num_draft_param if field == "num_draft" else _REQUEST_FIELDS.get(field, field)
        if field == "max_new_tokens":
            param = max_field
        for engine_name, request_name in (*_REQUEST_FIELDS.items(), ("min_new_tokens", "min_tokens"),
                                          ("max_new_tokens", max_field)):
            message = message.replace(engine_name, request_name)  # the request's own names in the message
        raise _bad(message, param)
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


def _refusal(e: Exception) -> ApiError:
    if isinstance(e, sched.QueueFull):
        return ApiError(429, str(e), type="rate_limit_error", code="queue_full", retry_after=1)
    return ApiError(503, str(e), type="server_error", code="shutting_down", retry_after=5)


async def _serve(raw: Request, body: _Sampling, prompt: list[int], k: Optional[int], began: float, *, chat: bool,
                 echo: str = ""):
    scheduler: sched.Scheduler = raw.app.state.scheduler
    config: ServerConfig = raw.app.state.config
    if scheduler.error is not None:
        raise ApiError(503, f"the server's engine failed: {scheduler.error}", type="server_error",
                       code="engine_error")
    if scheduler.closing:
        raise _refusal(sched.Closed("the server is shutting down and takes no new requests."))
    if not scheduler.ready.is_set():
        raise ApiError(503, "the server is compiling its programs; retry when GET /health answers 200.",
                       type="server_error", code="warming_up", retry_after=5)
    settings, stop = _settings(body, prompt, k, scheduler, config)
    events: asyncio.Queue = asyncio.Queue()
    request = sched.Request(prompt=prompt, settings=settings, stop=stop, n=body.n or 1,
                            skip_special_tokens=body.skip_special_tokens is not False,
                            emit=_emitter(asyncio.get_running_loop(), events), arrived=began)
    try:
        scheduler.submit(request)
    except (sched.QueueFull, sched.Closed) as e:
        raise _refusal(e) from None
    rule = _default_rule(scheduler.engine) if settings.rule is None else str(settings.rule)
    reply = _Reply(config, chat, request.n, k, echo, rule,
                   head=dict(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()),
                             model=config.model_name))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse_events(scheduler, request, events, reply, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _collect(raw, scheduler, request, events, reply)


def _finite(x: float) -> float:
    """A log-probability JSON can carry (a non-finite one, which checked settings should not
    produce, reports the floor rather than breaking the body)."""
    return x if math.isfinite(x) else LOGPROB_FLOOR


def _failure(event: sched.Failed) -> ApiError:
    if event.code == "invalid_request":
        return _bad(event.message)
    if event.code == "shutting_down":
        return ApiError(503, event.message, type="server_error", code=event.code, retry_after=5)
    return ApiError(500, event.message, type="server_error", code=event.code)


class _Reply:
    """Builds a request's response bodies (OpenAI's shapes) from the scheduler's events."""

    def __init__(self, config: ServerConfig, chat: bool, n: int, k: Optional[int], echo: str, rule: str, head: dict):
        self.config, self.chat, self.n, self.k, self.echo, self.head = config, chat, n, k, echo, head
        self.rule = rule  # the acceptance rule's spec, for the ``speculative`` blocks
        self.kind = ("chat.completion" if chat else "text_completion")
        self.offsets = [len(echo)] * n  # completions' text_offset: where each choice's next token starts

    def logprobs(self, delta: sched.Delta) -> Optional[dict]:
        """The delta's tokens' log-probabilities in the route's shape, or None."""
        if self.k is None or delta.logprobs is None:
            return None
        text = self.config.token_text
        # Alternatives that top-k / top-p cut off (the floor) are left out: "up to k" of them.
        tops = [[(t, lp) for t, lp in row if lp > LOGPROB_FLOOR] for row in delta.top] if delta.top else None
        if self.chat:
            def entry(token, logprob):
                return {"token": text(token), "logprob": _finite(logprob), "bytes": self.config.token_bytes(token)}

            content = []
            for i, (token, logprob) in enumerate(zip(delta.tokens, delta.logprobs)):
                top = [entry(t, lp) for t, lp in tops[i]] if tops else []
                content.append({**entry(token, logprob), "top_logprobs": top})
            return {"content": content, "refusal": None}
        tokens = [text(t) for t in delta.tokens]
        offsets = []
        for token in tokens:
            offsets.append(self.offsets[delta.index])
            self.offsets[delta.index] += len(token)
        top = [{text(t): _finite(lp) for t, lp in row} for row in tops] if tops is not None else None
        return {"tokens": tokens, "token_logprobs": [_finite(x) for x in delta.logprobs], "top_logprobs": top,
                "text_offset": offsets}

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
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def chunk(self, index: int, text: Optional[str], logprobs=None, finish: Optional[str] = None,
              first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return {**self.head, "object": self.kind + ".chunk" if self.chat else self.kind, "choices": [choice]}

    def usage(self, done: list) -> dict:
        prompt = done[0].prompt_tokens
        completion = sum(d.completion_tokens for d in done)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def speculative(self, done: list) -> dict:
        """The rule used and the request's counters (summed over its choices)."""
        if len(done) == 1:
            return {"rule": self.rule, **done[0].stats}
        c, d, a = (sum(x.stats[key] for x in done) for key in ("cycles", "drafted", "accepted"))
        tokens = sum(x.completion_tokens for x in done)
        at, lengths = [], []
        for x in done:
            sched.add_into(at, x.stats["accepted_at"])
            sched.add_into(lengths, x.stats["draft_lengths"])
        return dict(rule=self.rule, cycles=c, drafted=d, accepted=a, tau=tokens / c if c else 0.0,
                    acceptance_rate=a / d if d else 0.0, accepted_at=at, draft_lengths=lengths)


async def _wait_for_disconnect(raw: Request) -> None:
    """Returns when the client has gone (the body is read; what ``receive`` gives next is the
    disconnect)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(raw: Request, scheduler, request, events: asyncio.Queue, reply: _Reply):
    """A non-streaming response; a client that goes away cancels the request at once."""
    texts, logprobs, done = [[] for _ in range(reply.n)], [[] for _ in range(reply.n)], {}
    gone = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        while len(done) < reply.n:
            get = asyncio.ensure_future(events.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                scheduler.cancel(request)
                return JSONResponse({}, status_code=499)
            event = get.result()
            if isinstance(event, sched.Delta):
                texts[event.index].append(event.text)
                logprobs[event.index].append(reply.logprobs(event))
            elif isinstance(event, sched.Failed):
                raise _failure(event)
            else:
                done[event.index] = event
    except asyncio.CancelledError:
        scheduler.cancel(request)
        raise
    finally:
        gone.cancel()
    finished = [done[i] for i in range(reply.n)]
    choices = [reply.choice(i, reply.echo + "".join(texts[i]), reply.merge_logprobs(logprobs[i]),
                            finished[i].finish_reason) for i in range(reply.n)]
    return {**reply.head, "object": reply.kind, "choices": choices, "usage": reply.usage(finished),
            "speculative": reply.speculative(finished)}


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _sse_events(scheduler, request, events: asyncio.Queue, reply: _Reply, include_usage: bool):
    """Server-sent events: chunks of each choice's new text, each choice's finish reason,
    the usage (with ``include_usage``), ``[DONE]``; a failure (shutdown, non-finite logits)
    as an ``error`` event before ``[DONE]``. A client that goes away cancels the request
    (Starlette cancels this generator)."""
    extra = {"usage": None} if include_usage else {}
    done = {}
    try:
        if reply.chat:
            for i in range(reply.n):
                yield _sse({**reply.chunk(i, None, first=True), **extra})
        if reply.echo:
            for i in range(reply.n):
                yield _sse({**reply.chunk(i, reply.echo), **extra})
        while len(done) < reply.n:
            event = await events.get()
            if isinstance(event, sched.Delta):
                logprobs = reply.logprobs(event)
                if event.text or logprobs:
                    yield _sse({**reply.chunk(event.index, event.text, logprobs), **extra})
            elif isinstance(event, sched.Failed):
                yield _sse(_failure(event).body())
                break
            else:
                done[event.index] = event
                yield _sse({**reply.chunk(event.index, None, finish=event.finish_reason), **extra,
                            "speculative": {"rule": reply.rule, **event.stats}})
        if include_usage and len(done) == reply.n:
            yield _sse({**reply.head, "object": reply.chunk(0, None)["object"], "choices": [],
                        "usage": reply.usage([done[i] for i in range(reply.n)])})
        yield "data: [DONE]\n\n"
    finally:
        scheduler.cancel(request)  # a no-op where it finished; frees the slots where the client left


# ---------------------------------------------------------------------------
# Prometheus text
# ---------------------------------------------------------------------------

_METRICS = (
    ("specjax_requests_finished_total", "counter", "requests_finished", "Requests that completed."),
    ("specjax_requests_failed_total", "counter", "requests_failed", "Requests that failed after being queued."),
    ("specjax_requests_cancelled_total", "counter", "requests_cancelled",
     "Requests cancelled while generating (their client went away)."),
    ("specjax_requests_refused_total", "counter", "requests_refused", "Requests refused because the server was full."),
    ("specjax_prompt_tokens_total", "counter", "prompt_tokens", "Prompt tokens prefilled."),
    ("specjax_generation_tokens_total", "counter", "completion_tokens", "Tokens generated by finished choices."),
    ("specjax_drafted_tokens_total", "counter", "drafted", "Draft tokens proposed (finished choices)."),
    ("specjax_accepted_tokens_total", "counter", "accepted", "Draft tokens accepted (finished choices)."),
    ("specjax_cycles_total", "counter", "cycles", "Draft-verify cycles (target forwards) of finished choices."),
    ("specjax_steps_total", "counter", "steps", "engine.step calls."),
    ("specjax_prefills_total", "counter", "prefills", "Prefill calls (requests admitted together share one)."),
    ("specjax_prefilled_requests_total", "counter", "prefilled_requests", "Requests prefilled."),
    ("specjax_prefill_chunks_total", "counter", "prefill_chunks",
     "Chunks of long prompts prefilled between steps (--prefill-chunk)."),
    ("specjax_step_seconds_total", "counter", "step_seconds", "Wall time in engine.step, reading its output included."),
    ("specjax_prefill_seconds_total", "counter", "insert_seconds",
     "Wall time in prefills (insert, waited for), forks and releases."),
    ("specjax_busy_seconds_total", "counter", "busy_seconds", "The scheduler loop's wall time while serving."),
    ("specjax_queue_depth", "gauge", "queue_depth", "Requests waiting for a slot."),
    ("specjax_live_slots", "gauge", "live_slots", "Slots holding a request."),
    ("specjax_slots", "gauge", "num_slots", "Slots in the engine."),
    ("specjax_acceptance_rate", "gauge", "acceptance_rate", "Accepted / drafted tokens over finished choices."),
    ("specjax_tau", "gauge", "tau", "Generated tokens per target forward over finished choices."),
    ("specjax_host_share", "gauge", "host_share",
     "Share of the scheduler's busy wall time spent outside the engine's calls."),
)

_HISTOGRAMS = (
    ("time_to_first_token_seconds", "Seconds from a request's arrival to its first token (per choice)."),
    ("inter_token_latency_seconds",
     "Seconds between a choice's tokens (a step's gap shared among the tokens it delivered)."),
    ("e2e_request_latency_seconds", "Seconds from a request's arrival to its end."),
    ("request_tau", "Tokens per target forward of each finished choice (1: no draft accepted)."),
)

# Per-position counters: (name, key in the metrics, label, help)
_VECTORS = (
    ("specjax_accepted_at_position_total", "accepted_at", "position",
     "Drafts accepted at each draft position (1-based), finished choices."),
    ("specjax_draft_length_cycles_total", "draft_lengths", "length",
     "Cycles that drafted this many tokens (0: a plain target step), finished choices."),
)


def prometheus_text(m: dict) -> str:
    """The scheduler's metrics in Prometheus' text exposition format."""
    m = dict(m)
    m["acceptance_rate"] = m["accepted"] / m["drafted"] if m["drafted"] else 0.0
    m["tau"] = m["completion_tokens"] / m["cycles"] if m["cycles"] else 0.0
    lines = []
    for name, kind, key, help_text in _METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {_number(m[key])}"]
    for name, key, label, help_text in _VECTORS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
        first = 1 if key == "accepted_at" else 0
        lines += [f'{name}{{{label}="{i + first}"}} {int(v)}' for i, v in enumerate(m.get(key, ()))]
    for key, help_text in _HISTOGRAMS:
        h, name = m["latency"][key], f"specjax_{key}"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip((*h.bounds, "+Inf"), h.counts):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        lines += [f"{name}_sum {_number(h.total)}", f"{name}_count {h.count}"]
    return "\n".join(lines) + "\n"


def _number(value) -> str:
    """A sample value, exactly: counters grow past a million, where 6 significant digits round."""
    return str(int(value)) if isinstance(value, int) else repr(float(value))
