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
    # BOS stays out of the text: encoding adds it where the tokenizer's
    # post-processor says so, and rendering it too would give it twice. EOS is
    # text the template places between turns (Mistral-Instruct closes every
    # assistant turn with it), so it must be the real token.
    return _compile(model.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token="",
        eos_token=_eos_text(model),
    )


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
