"""Stop strings, matched on the detokenized text by the reader of the tokens (host side).

A stop string can span tokens and a token can hold text on both sides of it,
so it is matched on the text, not on token ids: :class:`TextStream` decodes a
request's tokens as they arrive, holds back a tail that may be the start of a
stop string, and ends the text just before the first stop it finds. The
device keeps generating until the host releases the slot (or stops reading
``decode``'s output); what it generated past the stop is dropped.
"""

from __future__ import annotations

from typing import Optional, Sequence


def check_stop_strings(stop: Sequence[str], tokenizer=None) -> tuple[str, ...]:
    """The stop strings as a tuple; ``ValueError`` for an empty one or one
    the tokenizer encodes to no tokens (it could never be generated)."""
    if isinstance(stop, str):
        stop = (stop,)
    out = []
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise TypeError(f"stop[{i}] must be a string, got {type(s).__name__}.")
        if not s:
            raise ValueError(f"stop[{i}] is empty: an empty stop string would end every request at once.")
        if tokenizer is not None and not _ids(tokenizer, s):
            raise ValueError(f"stop[{i}] = {s!r} encodes to no tokens with this tokenizer, so no output can "
                             "contain it; give a string the tokenizer can produce.")
        out.append(s)
    return tuple(out)


def cut_at_stop(text: str, stop: Sequence[str], after: int = 0) -> tuple[str, bool]:
    """``(text before the earliest stop string, whether one occurred)``; only an occurrence that
    ends past character ``after`` counts."""
    hits = [i for i in (text.find(s, max(0, after - len(s) + 1)) for s in stop) if i >= 0]
    if not hits:
        return text, False
    return text[: min(hits)], True


class TextStream:
    """One request's text, built from its token chunks, cut before the first stop string.

    ::

        stream = TextStream(target.tokenizer, stop=["\\n\\n"])
        for chunk in chunks:                 # e.g. out.tokens[s, :out.counts[s]] of each step
            print(stream.push(chunk), end="")
            if stream.stopped:
                break                        # and engine.release(state, s)
        print(stream.finish())

    Args:
      tokenizer: a ``tokenizers.Tokenizer`` (``Model.tokenizer``), or any
        object with ``decode(ids) -> str``.
      stop: stop strings (each non-empty and encodable).
      skip_special_tokens: passed to ``tokenizer.decode``.
      min_tokens: no stop string ends the text within the first ``min_tokens``
        tokens' text (vLLM's ``min_tokens``, which holds back every stop check).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = check_stop_strings(stop, tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.min_tokens = int(min_tokens)
        self._after: Optional[int] = 0 if self.min_tokens == 0 else None  # where a stop may end, once known
        self.tokens: list[int] = []
        self.stopped = False
        self._sent = 0
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def text(self) -> str:
        """The text so far, cut before a stop string if one occurred."""
        return self._cut(self._decode())[0]

    def push(self, tokens) -> str:
        """Adds tokens; returns the text that is now final (never part of a stop string)."""
        if self.stopped:
            return ""
        self.tokens.extend(int(t) for t in tokens)
        text, self.stopped = self._cut(self._decode())
        end = len(text) if self.stopped else max(len(text) - self._hold, self._sent)
        while end > self._sent and text[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence: wait for more
            end -= 1
        new, self._sent = text[self._sent:end], max(end, self._sent)
        return new

    def finish(self) -> str:
        """The rest of the text (the request ended)."""
        text = self.text
        new, self._sent = text[self._sent:], len(text)
        return new

    def _cut(self, text: str) -> tuple[str, bool]:
        if self._after is None:
            if len(self.tokens) < self.min_tokens:
                return text, False
            self._after = len(self._decode(self.tokens[: self.min_tokens]))
        return cut_at_stop(text, self.stop, self._after)

    def covered_tokens(self) -> int:
        """How many of the tokens the text needs: all of them, or after a stop
        string the fewest whose decoding reaches the cut (the tokens past it do
        not count as output)."""
        if not self.stopped:
            return len(self.tokens)
        end, lo, hi = len(self.text), 0, len(self.tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode(self.tokens[:mid])) >= end:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def final_tokens(self) -> int:
        """How many of the tokens lie wholly within the text returned so far (the
        others may still turn out to be part of a stop string)."""
        lo, hi = 0, len(self.tokens)
        while lo < hi:  # the largest m whose decoding fits the text sent
            mid = (lo + hi + 1) // 2
            if len(self._decode(self.tokens[:mid])) <= self._sent:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _decode(self, tokens=None) -> str:
        tokens = self.tokens if tokens is None else tokens
        try:
            return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)
        except TypeError:
            return self.tokenizer.decode(tokens)


def _ids(tokenizer, text: str) -> Optional[list]:
    enc = tokenizer.encode(text, add_special_tokens=False) if _takes_special(tokenizer) else tokenizer.encode(text)
    return list(getattr(enc, "ids", enc))


def _takes_special(tokenizer) -> bool:
    try:
        tokenizer.encode("a", add_special_tokens=False)
        return True
    except TypeError:
        return False
