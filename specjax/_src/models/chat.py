"""Chat prompts: a model's own chat template rendered to token ids.

Templates are Jinja, as in ``tokenizer_config.json`` and GGUF metadata; they
are rendered in Jinja's immutable sandbox (as transformers does), since a
template comes with a checkpoint and is not trusted code.

One template is built in: Gemma's (:data:`GEMMA_CHAT_TEMPLATE`), for Gemma GGUF
files that carry none (the GGUF reader adds it, marked, and logs that it did).
"""

from __future__ import annotations

import functools
from typing import Sequence, Union

Message = dict  # {"role": "user" | "system" | "assistant", "content": str}

# The chat template of google/gemma-3-*-it (their tokenizer_config.json; the same
# text ggml-org's gemma-3-*-it GGUF files carry as tokenizer.chat_template). Gemma
# has no system turn: a system message is put at the start of the first user turn,
# followed by a blank line; the assistant's turns are "model" turns; every message
# is trimmed.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
# What a model's ``chat_template`` starts with when specjax supplied it (a Jinja
# comment: it renders as nothing, and stays with the template when it is saved).
BUILTIN_MARK = "{#- specjax built-in template: "


def builtin_gemma_template(source: str) -> str:
    """:data:`GEMMA_CHAT_TEMPLATE` marked as supplied by specjax for ``source`` (a file name)."""
    note = source.replace("#}", "# }")  # a file name cannot end the comment early
    return (f"{BUILTIN_MARK}Gemma's (google/gemma-3-*-it tokenizer_config.json); {note} carries no "
            "chat template -#}" + GEMMA_CHAT_TEMPLATE)


def _raise_exception(message):
    """The ``raise_exception`` templates call (transformers defines it too)."""
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def render_chat(model, messages: Union[str, Sequence[Message]], *, add_generation_prompt: bool = True) -> str:
    """The text of ``messages`` in ``model``'s chat template.

    Args:
      model: a :class:`specjax.Model` with a ``chat_template``.
      messages: a list of ``{"role", "content"}`` dicts, or one user message as a str.
      add_generation_prompt: end with the assistant's turn header, so the
        model's continuation is its answer.

    Raises:
      ValueError: the model has no chat template, a message is malformed, or
        the template refuses the messages (Gemma's: roles that do not alternate).
    """
    if model.chat_template is None:
        raise ValueError(
            "This model has no chat template (none in tokenizer_config.json or GGUF metadata); "
            "pass plain prompts instead of chat messages."
        )
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"A chat message is a dict with str 'role' and 'content'; got {m!r}.")
    # BOS stays out of the text: encoding adds it where the tokenizer's
    # post-processor says so, and rendering it too would give it twice. EOS is
    # text the template places between turns (Mistral-Instruct closes every
    # assistant turn with it), so it must be the real token.
    from jinja2.exceptions import TemplateError

    try:
        return _compile(model.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token="",
            eos_token=_eos_text(model),
        )
    except TemplateError as e:  # the template's own refusal (raise_exception), or a broken template
        raise ValueError(f"The chat template refused these messages: {e}") from e


def _eos_text(model) -> str:
    """The text of the model's (first) EOS token; "" without a tokenizer or an EOS id."""
    config = getattr(model.module, "config", None)
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None or model.tokenizer is None:
        return ""
    return model.tokenizer.id_to_token(int(eos)) or ""


def encode_chat(model, messages: Union[str, Sequence[Message]], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of :func:`render_chat`'s text (special tokens kept whole)."""
    if model.tokenizer is None:
        raise ValueError("This model has no tokenizer; chat prompts need one.")
    return model.tokenizer.encode(render_chat(model, messages, add_generation_prompt=add_generation_prompt)).ids
