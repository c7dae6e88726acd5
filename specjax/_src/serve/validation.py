"""Reading a request: its body parsed and checked, its prompts tokenized, its settings built.

Everything the engine would refuse is refused here, before the request is queued
(:meth:`specjax.engine.Engine.validate` returns the engine's refusals as data), so a
request that was accepted is not refused later.
"""

from __future__ import annotations

import json
import re
from typing import Optional

from fastapi import Request
from pydantic import BaseModel, ValidationError

from specjax._src.engine.slots import SlotSettings
from specjax._src.engine.text import check_stop_strings
from specjax._src.logits.processors import GenerationControls
from specjax._src.rules.base import RuleSpec
from specjax._src.rules.combinators import OneOf
from specjax._src.rules.parse import parse_spec, rule_from_spec
from specjax._src.serve import fields as fields_lib
from specjax._src.serve import scheduler as sched
from specjax._src.serve.config import ServerConfig
from specjax._src.serve.errors import bad, too_long, unsupported
from specjax._src.serve.schemas import (
    CHAT_ROLES,
    MAX_RULE_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    ChatRequest,
    CompletionRequest,
    Message,
    Sampling,
)

_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")  # ASCII digits only (str.isdigit takes other scripts')


async def parse_body(raw: Request, model: type[BaseModel]):
    """The body as ``model``, or a 400 that says what is wrong with it."""
    data = await raw.body()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(
            f"The body is not valid UTF-8 (byte {e.start}); send JSON encoded as UTF-8.", None, "invalid_json"
        ) from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise bad("The body's JSON nests too deeply to read.", None, "invalid_json") from None
    except ValueError as e:
        if "int_max_str_digits" in str(e) or "integer string conversion" in str(e):
            raise bad("The body holds an integer of more than 4300 digits; no field takes one.") from None
        raise bad(f"The body is not valid JSON: {e}.", None, "invalid_json") from None
    if not isinstance(obj, dict):
        raise bad(f"The body must be a JSON object, got {type(obj).__name__}.", None, "invalid_json")
    if _SURROGATE_ESCAPE.search(text):  # (valid UTF-8 holds no surrogate: only a \u escape can)
        check_strings(obj)
    for name, value in obj.items():
        message = fields_lib.refusal(name, value)
        if message is not None:
            raise unsupported(message, name)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(x) for x in first.get("loc", ())]
        param = (".".join(loc[:2]) if loc[:1] == ["speculative"] else loc[0]) if loc else None
        message = f"{'.'.join(loc)}: {first.get('msg', 'invalid value')}" if loc else first.get("msg", "invalid")
        if param in _UNION_FIELDS:  # pydantic names one arm of the union; say what the field takes
            message = _UNION_FIELDS[param]
        raise bad(message, param) from None


_UNION_FIELDS = {
    "prompt": "prompt must be a string, a list of token ids (integers), or a list holding one of those.",
    "stop": "stop must be a string or a list of strings.",
    "messages": "messages must be a list of {role, content} objects, content a string or a list of text parts.",
}


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def check_strings(obj) -> None:
    """A 400 naming the first string that is not Unicode text (a lone surrogate such as
    ``"\\ud800"``, which JSON can carry and UTF-8 cannot)."""
    stack = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
            keys = [k for k in value if not _is_text(k)]
            if keys:
                raise bad(f"A key in {path or 'the body'} is not valid Unicode (a lone surrogate).", path or None)
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", v) for i, v in enumerate(value))
        elif isinstance(value, str) and not _is_text(value):
            raise bad(
                f"{path} holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                "Unicode text; send the character's full escape pair, or the character itself.",
                path.split(".")[0],
            )


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def check_common(body: Sampling, scheduler: sched.Scheduler, config: ServerConfig) -> None:
    if body.model != config.model_name:
        raise bad(
            f"The model `{body.model}` does not exist; this server serves `{config.model_name}` (GET /v1/models).",
            "model",
            "model_not_found",
        )
    slots = scheduler.engine.num_slots
    if body.n is not None and not 1 <= body.n <= slots:
        raise bad(
            f"n={body.n}: n is the number of choices, at least 1 and at most the server's {slots} slots "
            "(each choice takes one).",
            "n",
        )
    if body.stream_options is not None and not body.stream:
        raise bad("stream_options is only allowed with stream=true.", "stream_options")
    if body.stop_token_ids and len(set(body.stop_token_ids)) > MAX_STOP_TOKEN_IDS:
        raise bad(
            f"stop_token_ids holds {len(set(body.stop_token_ids))} ids; at most {MAX_STOP_TOKEN_IDS}.", "stop_token_ids"
        )
    if body.stop_token_ids and any(not 0 <= t < config.target.vocab_size for t in body.stop_token_ids):
        raise bad(f"stop_token_ids must be token ids in 0 .. {config.target.vocab_size - 1}.", "stop_token_ids")


def _max_logprobs(engine) -> int:
    return engine.logprobs


def completion_logprobs(body: CompletionRequest, engine) -> Optional[int]:
    if body.logprobs is None:
        return None
    most = _max_logprobs(engine)
    if most == 0:
        raise unsupported("logprobs: this server was started with --max-logprobs 0.", "logprobs")
    if not 0 <= body.logprobs <= most:
        raise bad(f"logprobs must be in 0 .. {most} (the alternatives per token), got {body.logprobs}.", "logprobs")
    return body.logprobs


def chat_logprobs(body: ChatRequest, engine) -> Optional[int]:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad("top_logprobs needs logprobs=true.", "top_logprobs")
    if not body.logprobs:
        return None
    most = _max_logprobs(engine)
    if most == 0:
        raise unsupported("logprobs: this server was started with --max-logprobs 0.", "logprobs")
    k = body.top_logprobs or 0
    if not 0 <= k <= most:
        raise bad(f"top_logprobs must be in 0 .. {most}, got {k}.", "top_logprobs")
    return k


def completion_prompts(prompt) -> list:
    """The prompts of a completions body: a string or a list of ids is one prompt; a list of
    strings or of id lists is one prompt each (OpenAI's batch form)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return list(prompt)
    return [prompt]


def completion_prompt(prompt, config: ServerConfig, capacity: int, index: Optional[int] = None) -> list[int]:
    """One prompt's ids (in a worker thread: tokenizing a long text takes a while); ``index``:
    its place in a list of prompts, named in the errors."""
    target = config.target
    where = "prompt" if index is None else f"prompt[{index}]"
    if isinstance(prompt, str):
        if len(prompt.encode("utf-8")) > capacity * config.max_token_bytes:
            raise too_long(where, "prompt", capacity)
        ids = target.tokenizer.encode(prompt).ids
    else:
        ids = list(prompt)
        outside = [t for t in ids if not 0 <= t < target.vocab_size]
        if outside:
            raise bad(f"{where} token {outside[0]} is not in the vocabulary (0 .. {target.vocab_size - 1}).", "prompt")
    if not ids:
        raise bad(f"{where} is empty: give at least one token of text.", "prompt")
    return ids


def chat_messages(messages: list[Message]) -> list[dict]:
    if not messages:
        raise bad("messages is empty: give at least one message.", "messages")
    plain = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            hint = (
                " (tool results need tools, which this server does not implement)"
                if m.role in ("tool", "function")
                else ""
            )
            raise bad(
                f"messages[{i}].role is {m.role!r}; a role is one of {', '.join(CHAT_ROLES)}{hint}.",
                f"messages.{i}.role",
            )
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise unsupported(f"messages[{i}].content: only text parts are supported.", f"messages.{i}.content")
            content = "".join(part.text or "" for part in content)
        plain.append({"role": m.role, "content": content or ""})
    return plain


def chat_prompt(messages: list[dict], config: ServerConfig, capacity: int, add_generation_prompt: bool) -> list[int]:
    """The rendered chat's ids (in a worker thread)."""
    from specjax._src.models.chat import encode_chat

    target = config.target
    if target.chat_template is None:
        raise bad(
            "The served model has no chat template: send plain prompts to /v1/completions, or start the "
            "server with --chat-template FILE (a Jinja template).",
            "messages",
            "no_chat_template",
        )
    if (
        len(messages) > capacity  # a template renders each message as one token at least
        or sum(len(m["content"].encode("utf-8")) for m in messages) > capacity * config.max_token_bytes
    ):
        raise too_long("conversation", "messages", capacity)
    try:
        return encode_chat(target, messages, add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise bad(str(e), "messages") from None
    except Exception as e:  # noqa: BLE001 -- a template's own error (jinja raise_exception, e.g. roles)
        raise bad(f"The chat template refused the messages: {e}", "messages") from None


# A SlotSettings field the engine refuses -> the request field it came from.
_REQUEST_FIELDS = {
    "max_new_tokens": "max_tokens",
    "controls.min_new_tokens": "min_tokens",
    "controls.logit_bias": "logit_bias",
    "controls.presence_penalty": "presence_penalty",
    "controls.frequency_penalty": "frequency_penalty",
    "controls.repetition_penalty": "repetition_penalty",
    "eos_token_id": "stop_token_ids",
    "rule": "speculative.rule",
}


def default_rule(engine) -> str:
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
        raise bad(f"speculative.rule is longer than {MAX_RULE_CHARS} characters; {where}.", "speculative.rule")
    try:
        spec = parse_spec(text)
    except RecursionError:
        raise bad(f"speculative.rule nests too deeply; {where}.", "speculative.rule") from None
    except ValueError as e:
        raise bad(f"speculative.rule: {e}; {where}.", "speculative.rule") from None
    names, stack = set(), [spec]
    while stack:
        node = stack.pop()
        names.add(node.name)
        stack.extend(
            sub for _, value in node.params if isinstance(value, tuple) for sub in value if isinstance(sub, RuleSpec)
        )
    if "pad" in names:
        rule = next((r for r in engine.served_rules if str(r.spec) == str(spec)), None)
        if rule is None:
            raise bad(
                f"speculative.rule: a request cannot give PAD a pivot head or numbers of its own; {where}.",
                "speculative.rule",
            )
    else:
        try:
            rule = rule_from_spec(spec)
        except RecursionError:
            raise bad(f"speculative.rule nests too deeply; {where}.", "speculative.rule") from None
        except (TypeError, ValueError) as e:
            raise bad(f"speculative.rule: {e}; {where}.", "speculative.rule") from None
    try:
        engine.rule_for(rule)
    except (TypeError, ValueError) as e:
        raise bad(str(e), "speculative.rule") from None
    return rule


def request_settings(
    body: Sampling, prompt: list[int], k: Optional[int], scheduler: sched.Scheduler, config: ServerConfig
):
    """``(SlotSettings, stop strings)`` for ``body``: the request's fields checked here, its
    settings by the engine (:meth:`specjax.engine.Engine.validate`). A completions body with
    ``max_tokens`` 0 gets settings of one token (checked as any other; the caller queues nothing)."""
    engine = scheduler.engine
    room = engine.capacity - len(prompt)
    # A completion of no tokens (lm-evaluation-harness' loglikelihood requests: echo with logprobs) takes
    # no slot: its prompt may fill the capacity, and it is answered without the engine.
    scores_only = isinstance(body, CompletionRequest) and body.max_tokens == 0
    if room < (0 if scores_only else 1):
        raise bad(
            f"The prompt is {len(prompt)} tokens; a slot holds {engine.capacity} (prompt and completion "
            "together), so it leaves no room for a completion. Shorten the prompt, or start the server "
            "with a larger --capacity.",
            "prompt" if isinstance(body, CompletionRequest) else "messages",
            "context_length_exceeded",
        )
    max_field = (
        "max_completion_tokens"
        if isinstance(body, ChatRequest) and body.max_completion_tokens is not None
        else "max_tokens"
    )
    max_tokens = room if body.max_tokens is None else body.max_tokens
    if max_tokens < (0 if isinstance(body, CompletionRequest) else 1):
        raise bad(
            f"{max_field} must be at least {0 if isinstance(body, CompletionRequest) else 1}, got {max_tokens}.",
            max_field,
        )
    if max_tokens > room:
        raise bad(
            f"{max_field}={max_tokens} with a prompt of {len(prompt)} tokens exceeds the slot capacity "
            f"({engine.capacity} tokens, prompt and completion together): ask for at most {room}.",
            max_field,
            "context_length_exceeded",
        )
    if body.min_tokens is not None and body.min_tokens > max_tokens:
        raise bad(
            f"min_tokens={body.min_tokens} exceeds {max_field}={max_tokens}: EOS, stop ids and stop strings "
            "are held back until min_tokens, so the completion would end at the limit first.",
            "min_tokens",
        )
    temperature = 1.0 if body.temperature is None else body.temperature
    if not 0.0 <= temperature <= 2.0:
        raise bad(f"temperature must be in [0, 2], got {temperature}.", "temperature")
    if body.seed is not None and not 0 <= body.seed < 2**32:
        raise bad(f"seed must be in [0, 2**32), got {body.seed}.", "seed")
    top_k = None if body.top_k in (None, 0, -1) else body.top_k  # vLLM's "off" is -1 (0 as well)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    if len(stop) > config.max_stop:
        raise bad(f"stop holds {len(stop)} strings; at most {config.max_stop}.", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad(f"a stop string is longer than {MAX_STOP_CHARS} characters.", "stop")
    try:
        stop = check_stop_strings(stop, config.target.tokenizer)
    except (TypeError, ValueError) as e:
        raise bad(str(e), "stop") from None
    bias = None
    if body.logit_bias:
        bad_keys = [key for key in body.logit_bias if not _TOKEN_ID.fullmatch(key)]
        if bad_keys:
            raise bad(
                f"logit_bias key {bad_keys[0][:40]!r} is not a token id: keys are token ids written as "
                'decimal integers without sign, spaces or leading zeros ("5", "1024").',
                "logit_bias",
            )
        bias = {int(key): float(value) for key, value in body.logit_bias.items()}
    controls = GenerationControls(
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=bias,
        min_new_tokens=body.min_tokens or 0,
    )
    if not engine.cfg.controls:
        used = [
            name
            for name, value in (
                ("repetition_penalty", body.repetition_penalty),
                ("presence_penalty", body.presence_penalty),
                ("frequency_penalty", body.frequency_penalty),
                ("logit_bias", body.logit_bias),
                ("min_tokens", body.min_tokens),
            )
            if value not in (None, 0, 0.0, {}) and not (name == "repetition_penalty" and value == 1)
        ]
        if used:
            raise unsupported(
                f"{used[0]}: this server was started with --no-penalties (its engine has no logits "
                "processors); leave the penalties, logit_bias and min_tokens unset.",
                used[0],
            )
        controls = None
    num_draft, num_draft_param, rule = body.num_draft, "num_draft", None
    speculative = body.speculative
    if speculative is not None and speculative.num_draft is not None:
        if num_draft is not None and num_draft != speculative.num_draft:
            raise bad(
                f"num_draft={num_draft} and speculative.num_draft={speculative.num_draft} disagree; give one of them.",
                "speculative.num_draft",
            )
        num_draft, num_draft_param = speculative.num_draft, "speculative.num_draft"
    if speculative is not None and speculative.rule is not None:
        rule = _request_rule(speculative.rule, engine)
    settings = SlotSettings(
        temperature=float(temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=top_k,
        seed=config.request_seed() if body.seed is None else body.seed,
        max_new_tokens=max(1, int(max_tokens)),
        num_draft=num_draft,
        controls=controls,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        eos_token_id=() if body.ignore_eos else None,
        logprobs=k,
        rule=rule,
    )
    errors = engine.validate(settings, 1 if scores_only else len(prompt))
    if errors:
        field, message = errors[0]
        param = num_draft_param if field == "num_draft" else _REQUEST_FIELDS.get(field, field)
        if field == "max_new_tokens":
            param = max_field
        for engine_name, request_name in (
            *_REQUEST_FIELDS.items(),
            ("min_new_tokens", "min_tokens"),
            ("max_new_tokens", max_field),
        ):
            message = message.replace(engine_name, request_name)  # the request's own names in the message
        raise bad(message, param)
    return settings, stop
