"""What the server does with each field OpenAI's and vLLM's clients send.

Three tables, one place: :data:`REFUSED` fields get a 400 naming them
(unless their value asks for nothing, e.g. ``tool_choice: "none"``),
:data:`IGNORED` fields are accepted and have no effect, for the reason given;
every other field the request models declare is honoured. ``docs/server.md``
lists the same fields (a test checks that it does).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple


class Refusal(NamedTuple):
    """A field the server refuses unless ``harmless(value)``; ``why`` ends the error message."""

    harmless: Callable[[Any], bool]
    why: str


def _unset(value) -> bool:
    return value is None or value is False or value == [] or value == {}


def _is(*values) -> Callable[[Any], bool]:
    return lambda value: _unset(value) or value in values


_STRUCTURED = "structured output (JSON mode, a JSON schema, a grammar) is not implemented: the server samples free text"
_TOOLS = "tools and function calling are not implemented: send the tools' descriptions in the messages instead"

# field -> Refusal, for both routes (a field one route does not know is refused there too).
REFUSED: dict[str, Refusal] = {
    "response_format": Refusal(lambda v: _unset(v) or (isinstance(v, dict) and v.get("type") == "text"),
                               _STRUCTURED),
    "tools": Refusal(_unset, _TOOLS),
    "functions": Refusal(_unset, _TOOLS),
    "tool_choice": Refusal(_is("none"), _TOOLS),
    "function_call": Refusal(_is("none"), _TOOLS),
    "guided_json": Refusal(_unset, _STRUCTURED),
    "guided_regex": Refusal(_unset, _STRUCTURED),
    "guided_choice": Refusal(_unset, _STRUCTURED),
    "guided_grammar": Refusal(_unset, _STRUCTURED),
    "guided_decoding_backend": Refusal(_unset, _STRUCTURED),
    "structured_outputs": Refusal(_unset, _STRUCTURED),
    "best_of": Refusal(_is(1), "best_of is not implemented; send n for several choices"),
    "use_beam_search": Refusal(_unset, "beam search is not implemented"),
    "length_penalty": Refusal(_is(1, 1.0), "length_penalty only applies to beam search, which is not implemented"),
    "suffix": Refusal(_is(""), "suffix (fill in the middle) is not implemented"),
    "prompt_logprobs": Refusal(_unset, "prompt log-probabilities are not computed; logprobs gives the completion's"),
    "min_p": Refusal(_is(0, 0.0), "min_p is not implemented; use top_p or top_k"),
    "include_stop_str_in_output": Refusal(_unset, "the text always ends before its stop string"),
    "audio": Refusal(_unset, "the server generates text only"),
    "modalities": Refusal(lambda v: _unset(v) or v == ["text"], "the server generates text only"),
    "prediction": Refusal(_unset, "predicted outputs are not implemented"),
    "web_search_options": Refusal(_unset, "web search is not implemented"),
    "reasoning_effort": Refusal(_unset, "the served model has no reasoning effort setting"),
    "continue_final_message": Refusal(_unset, "continuing the final message is not implemented"),
    "chat_template": Refusal(_unset, "the chat template is the server's (specjax serve --chat-template)"),
    "chat_template_kwargs": Refusal(_unset, "the chat template takes no arguments here"),
    "logits_processors": Refusal(_unset, "a request cannot bring logits processors"),
    "truncate_prompt_tokens": Refusal(_unset, "prompts are never truncated: a prompt too long is refused"),
    "return_tokens_as_token_ids": Refusal(_unset, "logprobs name tokens by their text"),
    "priority": Refusal(_is(0), "requests are served first come, first served"),
}

# field -> why it has no effect.
IGNORED: dict[str, str] = {
    "user": "an end-user id for the caller's own abuse monitoring; the server keeps no per-user state",
    "metadata": "tags for stored completions; the server stores nothing",
    "store": "the server stores nothing",
    "service_tier": "the server has one tier",
    "parallel_tool_calls": "it qualifies tools, which are refused",
    "prompt_cache_key": "the prefix cache matches prompts by their tokens: it needs no key",
    "safety_identifier": "an end-user id for the caller's own abuse monitoring",
    "verbosity": "a hint for other models' reasoning; the served model takes none",
    "spaces_between_special_tokens": "special tokens are decoded as the tokenizer decodes them",
    "add_special_tokens": "prompts are encoded as the tokenizer's defaults (and the chat template) say",
    "request_id": "the X-Request-Id header names a request",
}


def refusal(name: str, value) -> str | None:
    """The error message for ``name: value``, or None where the server accepts it."""
    rule = REFUSED.get(name)
    if rule is None or rule.harmless(value):
        return None
    return f"{name} is not supported by this server: {rule.why}."
