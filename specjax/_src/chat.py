"""Chat prompts: a model's own chat template rendered to token ids.

Templates are Jinja, as in ``tokenizer_config.json`` and GGUF metadata; they
are rendered in Jinja's immutable sandbox (as transformers does), since a
template comes with a checkpoint and is not trusted code.
"""

from __future__ import annotations

import functools
from typing import Sequence, Union

Message = dict  # {"role": "user" | "system" | "assistant", "content": str}


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template)


def render_chat(model, messages: Union[str, Sequence[Message]], *, add_generation_prompt: bool = True) -> str:
    """The text of ``messages`` in ``model``'s chat template.

    Args:
      model: a :class:`specjax.Model` with a ``chat_template``.
      messages: a list of ``{"role", "content"}`` dicts, or one user message as a str.
      add_generation_prompt: end with the assistant's turn header, so the
        model's continuation is its answer.

    Raises:
      ValueError: the model has no chat template, or a message is malformed.
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
    return _compile(model.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token="", eos_token=""
    )


def encode_chat(model, messages: Union[str, Sequence[Message]], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of :func:`render_chat`'s text (special tokens kept whole)."""
    if model.tokenizer is None:
        raise ValueError("This model has no tokenizer; chat prompts need one.")
    return model.tokenizer.encode(render_chat(model, messages, add_generation_prompt=add_generation_prompt)).ids
