"""The BPE tokenizer shared by the shipped target/draft pair.

A byte-level BPE (``tokenizers`` library) trained on the training split of the
corpus (:mod:`training.data`), with every digit its own pre-token so that
``37`` is always ``3``, ``7``: arithmetic then never depends on which digit
groups happened to merge. Special tokens (fixed ids, first in the vocab):

* ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2.

The post-processor prepends ``<bos>`` by default (``encode(text)``, and
``transformers``' ``add_special_tokens=True``), the way the models were
trained: every training row starts with ``<bos>``. Pass
``add_special_tokens=False`` to get the bare pieces.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
DEFAULT_VOCAB_SIZE = 2048


def _empty_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE
) -> Tokenizer:
    """Trains the byte-level BPE on ``texts`` (deterministic for given texts)."""
    tok = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_as_iter(texts), trainer=trainer)
    for name, want in zip(SPECIAL_TOKENS, (PAD_ID, BOS_ID, EOS_ID)):
        got = tok.token_to_id(name)
        if got != want:
            raise AssertionError(f"special token {name} got id {got}, expected {want}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, BOS_ID)],
    )
    return tok


def _as_iter(texts: Iterable[str]) -> Iterator[str]:
    yield from texts


def load_tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_file(str(path))


def encode_batch(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Bare token ids (no ``<bos>``) of each text."""
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def decode(tok: Tokenizer, ids) -> str:
    return tok.decode([int(i) for i in ids], skip_special_tokens=True)
