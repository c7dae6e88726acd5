"""The request bodies both routes read (pydantic models, strict types) and the server's limits.

Fields beyond OpenAI's: ``top_k``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens`` (vLLM's),
``num_draft`` and ``speculative`` (specjax's). Fields the server refuses or
ignores are listed in :mod:`specjax._src.serve.fields`.
"""

from __future__ import annotations

from typing import Annotated, Optional, Union

from pydantic import BaseModel, ConfigDict, Strict, StrictBool, StrictInt, StrictStr

Number = Annotated[float, Strict()]  # an int or a float; not a string or a bool

MAX_STOP_CHARS = 256  # per stop string: the stream holds back this much text while it may be one
# Stop strings per request. vLLM sets no limit; lm-evaluation-harness' tasks send up to a few
# dozen. Each is matched on every new piece of text, so a bound keeps a step's host work bounded.
MAX_STOP_STRINGS = 1024
MAX_STOP_TOKEN_IDS = 16
MAX_RULE_CHARS = 256  # an engine built for the server holds these beside the model's EOS ids
CHAT_ROLES = ("system", "developer", "user", "assistant")


class StreamOptions(BaseModel):
    include_usage: Optional[StrictBool] = False


class Speculative(BaseModel):
    """A request's ``speculative`` block (specjax's extension)."""

    model_config = ConfigDict(extra="forbid")

    rule: Optional[StrictStr] = None
    num_draft: Optional[StrictInt] = None


class Sampling(BaseModel):
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


class CompletionRequest(Sampling):
    """A completions body: ``prompt`` is a string, token ids, or a list of either (one choice per
    prompt and ``n``)."""

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


class ChatRequest(Sampling):
    messages: list[Message]
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    add_generation_prompt: Optional[StrictBool] = True
