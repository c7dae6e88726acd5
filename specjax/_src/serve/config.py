"""What the routes need besides the scheduler: the served model's name, its tokenizer's
texts and bytes per token, the API key, the body limit and the seeds of unseeded requests."""

from __future__ import annotations

import functools
import random
import re
import secrets
import time
from typing import Optional

from specjax._src.serve.schemas import MAX_STOP_STRINGS


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

    def __init__(
        self,
        model_name: str,
        target,
        *,
        max_stop: int = MAX_STOP_STRINGS,
        api_key: Optional[str] = None,
        max_body_bytes: int = 2 * 2**20,
        seed: Optional[int] = None,
    ):
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
        return (
            max(len(tokenizer.decode([i], skip_special_tokens=False).encode("utf-8", "replace")) for i in range(size))
            or 1
        )

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


_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "KIB": 2**10,
    "M": 10**6,
    "MB": 10**6,
    "MIB": 2**20,
    "G": 10**9,
    "GB": 10**9,
    "GIB": 2**30,
}


def parse_bytes(text: str) -> int:
    """A size such as ``"512MiB"``, ``"2GB"``, ``"1.5G"`` or ``"1000000"`` (bytes) as bytes; ``ValueError``
    naming the forms taken for anything else."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a size: give bytes, or a number with KB, MB, GB, KiB, MiB or GiB (e.g. 512MiB, 2GB)."
        )
    return int(float(match.group(1)) * _UNITS[unit])
