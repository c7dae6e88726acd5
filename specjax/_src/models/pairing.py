"""Pairing a target with a draft: :class:`ModelPair`, :func:`pair` and the vocabulary checks.

A speculative pair must share one vocabulary. Models of one family often pad
their embedding tables to different sizes, so the usable vocabulary is read
from the tokenizers when they are attached (:func:`_tokenizer_size`) and the
logits beyond it are dropped by the engine. Nothing here traces or runs a
model: it is plain validation before ``decode``.

Its own module (not part of :mod:`specjax._src.engine.loop`) because
:mod:`specjax._src.models.sharding` needs :class:`ModelPair` to place a pair's params,
and the engine needs sharding: with the pair here, both import it and neither
imports the other.
"""

from __future__ import annotations

from typing import Optional

from flax import struct

from specjax._src.models.lm import Model
from specjax._src.models import feature_head, feature_head_build

@struct.dataclass
class ModelPair:
    """A target and a draft model as one pytree (the leaves are both params).

    Attributes:
      target, draft: the two :class:`~specjax.Model`\\ s.
      vocab_size: the usable vocabulary (static). Logits beyond it (embedding
        padding rows) are dropped before any sampling or verification.
    """

    target: Model
    draft: Model
    vocab_size: int = struct.field(pytree_node=False)



def _tokenizer_size(tok) -> Optional[int]:
    """Tokens a tokenizer can produce (added tokens included), or None if unknown.

    Handles ``transformers`` tokenizers (``len``), ``tokenizers.Tokenizer``
    (``get_vocab_size``) and objects with a ``vocab_size``.
    """
    try:
        return int(len(tok))
    except TypeError:
        pass
    get_size = getattr(tok, "get_vocab_size", None)
    if callable(get_size):
        try:
            return int(get_size(with_added_tokens=True))
        except TypeError:
            return int(get_size())
    size = getattr(tok, "vocab_size", None)
    return None if size is None else int(size)


def _same_tokenizer(a, b) -> bool:
    if a is b:
        return True
    if hasattr(a, "get_vocab") and hasattr(b, "get_vocab"):
        return a.get_vocab() == b.get_vocab()
    return _tokenizer_size(a) == _tokenizer_size(b)


def model_vocab(model: Model) -> int:
    size = model.vocab_size
    tok = model.tokenizer
    if tok is not None:
        tsize = _tokenizer_size(tok)
        if tsize is not None and tsize != size:
            if tsize > size:
                raise ValueError(
                    f"The tokenizer has {tsize} tokens but the model's logits cover only {size}."
                )
            size = tsize
    return size


def pair(target: Model, draft: Model, *, vocab_size: Optional[int] = None) -> ModelPair:
    """Pairs a target and a draft model into one pytree for :func:`decode`.

    Vocabularies: models of one family often pad their embedding tables to
    different sizes. The usable vocabulary is the tokenizer's size when a
    tokenizer is attached (both tokenizers, if both are, must have the same
    vocabulary), else the common ``vocab_size``; ``vocab_size=`` overrides it
    (needed when the tables differ and neither model carries a tokenizer).
    Logits beyond it are ignored.

    Raises:
      TypeError: if either argument is not a :class:`~specjax.Model`.
      ValueError: for a real vocabulary mismatch, or a feature head given as
        the target (the two swapped).
    """
    for name, m in (("target", target), ("draft", draft)):
        if not isinstance(m, Model):
            raise TypeError(
                f"pair(): {name} must be a specjax.Model (from specjax.load or "
                f"Model(params, module, tokenizer)), got {type(m).__name__}."
            )
    if feature_head.is_feature_head(target.module):
        which = "the two are swapped" if not feature_head.is_feature_head(draft.module) else "so is the draft"
        raise ValueError(
            "pair(): the target is a feature head (a draft that reads a target's hidden states), and "
            f"{which}; pass the target model first: specjax.pair(target, head)."
        )
    tv, dv = target.vocab_size, draft.vocab_size
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is not None and dt is not None and not _same_tokenizer(tt, dt):
        raise ValueError(
            "pair(): the target's and the draft's tokenizers have different vocabularies "
            f"({_tokenizer_size(tt)} vs {_tokenizer_size(dt)} tokens); speculative decoding "
            "needs one shared vocabulary."
        )
    if vocab_size is None:
        tok = tt if tt is not None else dt
        tok_size = None if tok is None else _tokenizer_size(tok)
        if tok_size is not None:
            vocab_size = tok_size
        elif tv == dv:
            vocab_size = tv
        elif feature_head.is_feature_head(draft.module):
            raise ValueError(
                f"pair(): the feature head scores a {dv}-token vocabulary and the target {tv}; a head drafts "
                "for the target it was trained on: pair it with that target."
            )
        else:
            raise ValueError(
                f"pair(): the target has vocab_size {tv} and the draft {dv}, and neither "
                "carries a tokenizer to tell padding rows from real tokens. If the extra rows "
                f"are padding, pass vocab_size=<real vocabulary size> (<= {min(tv, dv)})."
            )
    vocab_size = int(vocab_size)
    if feature_head.is_feature_head(draft.module):
        draft = _attach_target_features(target, draft)
    if not 1 <= vocab_size <= min(tv, dv):
        raise ValueError(
            f"pair(): vocabulary mismatch: {vocab_size} usable tokens, but the target's logits "
            f"cover {tv} and the draft's {dv}."
        )
    return ModelPair(target=target, draft=draft, vocab_size=vocab_size)


def _attach_target_features(target: Model, head: Model) -> Model:
    """A feature head reads the target's hidden states and borrows its embedding table."""
    module = head.module
    layers = getattr(target.module, "num_layers", None)
    missing = [x for x in module.feature_layers if layers is None or not -layers <= x < layers]
    if not hasattr(target.module, "config") or missing:
        raise ValueError(
            f"pair(): the feature head reads target block(s) {missing or list(module.feature_layers)}, which "
            f"this target ({type(target.module).__name__}, {layers} blocks) does not have; pair a head with "
            "the target it was trained on."
        )
    resolved = [x % layers for x in module.feature_layers]
    if len(set(resolved)) != len(resolved):
        raise ValueError(
            f"pair(): the feature head's blocks {list(module.feature_layers)} name one block of this "
            f"{layers}-block target twice ({resolved}); a head mixes distinct blocks."
        )
    if target.module.hidden_size != module.hidden_size:
        raise ValueError(
            f"pair(): the feature head reads {module.hidden_size}-wide features but the target's hidden "
            f"size is {target.module.hidden_size}; pair a head with the target it was trained on."
        )
    return feature_head_build.attach_embedding(head, target)
