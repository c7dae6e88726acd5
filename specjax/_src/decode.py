"""The engine: one jitted, batched draft-verify ``while_loop``.

``decode`` runs the whole generation on device — prefill, then cycles of
(draft up to K tokens, verify them in one target forward, accept per sequence,
commit, roll the caches back by length) — inside one ``jax.lax.while_loop``
with fixed-size buffers. There is no host round trip per cycle (unless
``on_tokens=`` asks for streaming: see :func:`_report`).

Shapes are bucketed (:class:`Buckets`): the batch, the prompt width and the
``max_new_tokens`` buffer are padded up to a few sizes so that mixed traffic
reuses a few compiled programs; each sequence's own ``max_new_tokens`` is a
traced value, dummy rows are finished from the start, and the output is cut
back on the host. The prefill runs in blocks of ``PREFILL_BLOCK`` tokens so
that no matmul's shape depends on the padded width.

Loop state (per sequence ``b``; ``P`` padded prompt length, ``N`` the
``max_new_tokens`` buffer, ``K`` ``num_draft``):

* ``tokens[B, P + N + K + 1]``: prompt and committed tokens, in place;
  ``num_committed[b]`` of them are valid. Each cycle writes its ``K + 1``
  candidate block at ``num_committed`` (only the committed prefix counts).
* the target cache holds every committed token but the last:
  ``lengths = num_committed - 1``. Verification feeds ``[last, d_1 .. d_K]``
  (``T = K + 1``); logits at slot ``k`` judge ``d_{k+1}``, slot ``K`` gives
  the bonus.
* the draft cache holds every committed token but the last two:
  ``lengths = max(num_committed - 2, 0)``. The first draft step of a cycle is a
  ``T = 2`` forward over those two tokens, which absorbs both the correction /
  bonus token the draft has not seen and its own last draft when all K were
  accepted, with no extra forward. A one-token prompt feeds ``[t_0, pad]`` and
  reads the logits at index 0.
* after accepting ``n`` drafts and committing ``c <= n + 1`` tokens, both
  caches roll back (a length reset, nothing copied) to restore the two
  invariants.
* ``done[b]`` (EOS, ``max_new_tokens`` or non-finite logits): finished
  sequences keep running masked, commit nothing and keep their lengths, so
  their caches never overflow; the loop ends when every sequence is done.

Randomness: sequence ``b`` draws from ``fold_in(key, b)`` (or from ``key[b]``
when one key per sequence is given), then ``fold_in(., cycle)``: its output
never depends on its batch companions and is fixed by the key.

Hooks for later rules and diagnostics:

* hidden states: a rule that declares ``rule.hidden_layers`` (PAD's
  ``(-8,)``; combinators declare their sub-rules' layers) gets
  ``inputs.features["hidden"] = {layer: [K, H]}``: the target's block output
  at each draft token's own position, from the verification forward.
* ``decode(..., diagnostics=fn)``: ``fn(inputs, verdict, num_accepted) -> dict``
  of per-sequence scalars, evaluated per cycle on live sequences and summed
  into ``stats.extra`` (e.g. theory diagnostics).

Sharding (``mesh=``, or params already on a mesh): the same program, with the
inputs placed over a ``('data', 'model')`` mesh and the caches / loop carry
pinned by ``with_sharding_constraint`` (``_Config.layout``); XLA's SPMD
partitioner inserts the collectives. See :mod:`specjax._src.sharding`.
"""

from __future__ import annotations

import functools
import itertools
import secrets
import threading
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import io_callback

from specjax._src import drafting as drafting_lib
from specjax._src import sampling
from specjax._src import sharding as sharding_lib
from specjax._src.lm import KVCache, Model
from specjax._src.rules.base import (
    AcceptanceRule,
    VerifyInputs,
    speculative_sampling,
)
from specjax._src.stats import DecodeStats, record_cycle

Array = jax.Array

# ---------------------------------------------------------------------------
# Public containers
# ---------------------------------------------------------------------------


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


@struct.dataclass
class DecodeOutput:
    """What ``decode`` and ``generate`` return.

    Attributes:
      tokens: ``[B, max_new_tokens]`` int32 generated tokens (the prompt
        excluded), ``pad_token_id`` after each sequence's end.
      lengths: ``[B]`` int32 tokens generated per sequence (an EOS included).
      stats: :class:`DecodeStats`.
      key: the PRNG key the run sampled with: the ``key=`` given, or the fresh
        one drawn for ``key=None``; passing it back (``key=out.key``)
        reproduces the run. None for greedy decoding without a key.
      seed: the integer seed drawn for ``key=None`` (``key=jax.random.key(seed)``
        reproduces the run; handy for logs), else None.
    """

    tokens: Array
    lengths: Array
    stats: DecodeStats
    key: Any = None
    seed: Optional[int] = struct.field(pytree_node=False, default=None)

    def to_lists(self) -> list[list[int]]:
        """The generated tokens as ragged Python lists."""
        toks, lens = np.asarray(self.tokens), np.asarray(self.lengths)
        return [toks[b, : lens[b]].tolist() for b in range(toks.shape[0])]


# ---------------------------------------------------------------------------
# Vocabulary and pairing
# ---------------------------------------------------------------------------


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


def _model_vocab(model: Model) -> int:
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
      ValueError: for a real vocabulary mismatch.
    """
    for name, m in (("target", target), ("draft", draft)):
        if not isinstance(m, Model):
            raise TypeError(
                f"pair(): {name} must be a specjax.Model (from specjax.load or "
                f"Model(params, module, tokenizer)), got {type(m).__name__}."
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
        else:
            raise ValueError(
                f"pair(): the target has vocab_size {tv} and the draft {dv}, and neither "
                "carries a tokenizer to tell padding rows from real tokens. If the extra rows "
                f"are padding, pass vocab_size=<real vocabulary size> (<= {min(tv, dv)})."
            )
    vocab_size = int(vocab_size)
    if not 1 <= vocab_size <= min(tv, dv):
        raise ValueError(
            f"pair(): vocabulary mismatch: {vocab_size} usable tokens, but the target's logits "
            f"cover {tv} and the draft's {dv}."
        )
    return ModelPair(target=target, draft=draft, vocab_size=vocab_size)


# ---------------------------------------------------------------------------
# Static (hashable) configuration
# ---------------------------------------------------------------------------


class _Config(NamedTuple):
    """The compile-time settings of one loop (a ``jit`` static). The rule and
    the drafting policy are not here: they are pytree arguments, whose static
    fields are part of the program's key and whose numbers are traced."""

    # ``decode(diagnostics=fn)``: hashed by identity, so pass one function
    # object (not a fresh lambda per call) to reuse the compiled loop.
    diagnostics: Optional[Callable]
    num_draft: int
    max_new_tokens: int
    cache_length: int
    greedy: bool
    top_k: Optional[int]
    use_top_p: bool
    layout: Optional[sharding_lib.DecodeLayout] = None  # set when running on a mesh
    # ``on_tokens=`` given: the loop reports each cycle's tokens to the host
    # (:func:`_report`). False compiles the program without any callback.
    stream: bool = False


# ---------------------------------------------------------------------------
# Input checks (all before tracing)
# ---------------------------------------------------------------------------


def _token_row(row, index: int) -> list[int]:
    """One prompt as a list of ints; refuses non-integer ids instead of truncating them.

    ``np.asarray([1.7, 2.2], np.int64)`` would silently give ``[1, 2]``.
    """
    arr = np.asarray(row)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        bad = next((x for x in arr.ravel().tolist() if type(x) is not int), arr.ravel()[0])
        raise TypeError(
            f"prompt {index} must hold integer token ids, got {bad!r} (dtype {arr.dtype}); "
            "tokenize the text first, and convert float ids with int() only if they are whole."
        )
    return arr.astype(np.int64).tolist()


def _prepare_prompts(prompt_ids, prompt_lengths, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns right-padded ``int32 [B, P]`` prompts and ``int32 [B]`` lengths."""
    if isinstance(prompt_ids, (list, tuple)):
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids is empty: pass at least one prompt.")
        if all(np.ndim(p) == 0 for p in prompt_ids):
            rows = [_token_row(prompt_ids, 0)]  # one prompt given as a flat list of ids
        else:
            rows = []
            for i, p in enumerate(prompt_ids):
                if np.ndim(p) != 1:
                    raise ValueError(
                        f"prompt {i} must be a flat sequence of token ids, got shape {np.shape(p)}."
                    )
                rows.append(_token_row(p, i))
        if prompt_lengths is not None:
            raise ValueError("prompt_lengths is only for a padded array; a list is already ragged.")
        lengths = np.array([len(r) for r in rows], np.int64)
        width = max(int(lengths.max()), 1)
        tokens = np.zeros((len(rows), width), np.int64)
        for i, r in enumerate(rows):
            if r:
                tokens[i, : len(r)] = np.asarray(r, np.int64)
    else:
        arr = np.asarray(prompt_ids)
        if arr.dtype == object:
            raise ValueError(
                "prompt_ids is a ragged array: pass a list of token lists, or a right-padded "
                "[batch, length] array together with prompt_lengths=."
            )
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2:
            raise ValueError(f"prompt_ids must be [batch, length], got shape {arr.shape}.")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"prompt_ids must hold integer token ids, got dtype {arr.dtype}.")
        if arr.shape[0] == 0:
            raise ValueError("prompt_ids is empty: pass at least one prompt.")
        tokens = arr.astype(np.int64)
        if prompt_lengths is None:
            lengths = np.full((arr.shape[0],), arr.shape[1], np.int64)
        else:
            lengths = np.asarray(prompt_lengths).astype(np.int64).reshape(-1)
            if lengths.shape[0] != arr.shape[0]:
                raise ValueError(
                    f"prompt_lengths has {lengths.shape[0]} entries for {arr.shape[0]} prompts."
                )
            if (lengths > arr.shape[1]).any():
                raise ValueError(
                    f"prompt_lengths exceed the padded width {arr.shape[1]}: {lengths.tolist()}."
                )
        col = np.arange(tokens.shape[1])[None, :]
        tokens = np.where(col < lengths[:, None], tokens, 0)
    empty = np.flatnonzero(lengths < 1)
    if empty.size:
        raise ValueError(
            f"empty prompt(s) at index {empty.tolist()}: every sequence needs at least one "
            "token (e.g. a BOS token)."
        )
    col = np.arange(tokens.shape[1])[None, :]
    real = col < lengths[:, None]
    out_of_vocab = real & ((tokens < 0) | (tokens >= vocab_size))
    if out_of_vocab.any():
        b, t = np.argwhere(out_of_vocab)[0]
        raise ValueError(
            f"token id {int(tokens[b, t])} (prompt {b}, position {t}) is outside the "
            f"vocabulary [0, {vocab_size})."
        )
    return tokens.astype(np.int32), lengths.astype(np.int32)


def _config_eos(module, vocab_size: int) -> tuple[int, ...]:
    """The end-of-sequence ids of a model's config (every one when it lists
    several, as Llama 3 does), or ``()``. Ids outside the usable vocabulary can
    never be emitted, so they are dropped rather than refused."""
    config = getattr(module, "config", None)
    ids = tuple(getattr(config, "eos_token_ids", None) or ())
    if not ids:
        one = getattr(config, "eos_token_id", None)
        ids = () if one is None else (one,)
    return tuple(int(i) for i in ids if 0 <= int(i) < vocab_size)


def _eos_ids(eos_token_id, vocab_size: int, module=None) -> tuple[int, ...]:
    """``None``: the target's config decides (:func:`_config_eos`); ``()``: no EOS."""
    if eos_token_id is None:
        return () if module is None else _config_eos(module, vocab_size)
    ids = (eos_token_id,) if np.ndim(eos_token_id) == 0 else tuple(np.asarray(eos_token_id).tolist())
    out = []
    for i in ids:
        if int(i) != i or not 0 <= int(i) < vocab_size:
            raise ValueError(f"eos_token_id {i!r} is outside the vocabulary [0, {vocab_size}).")
        out.append(int(i))
    return tuple(out)


def _resolve_key(key, batch: int, greedy: bool) -> tuple[Any, Any, Optional[int]]:
    """``(key for the loop, key to record on the output, seed to record)``.

    ``key=None`` when sampling draws a fresh 32-bit seed from the OS
    (``secrets``), so two such calls differ; the seed and its key are recorded
    so that passing either back reproduces the run. Greedy decoding uses no
    randomness: nothing is drawn or recorded.
    """
    if key is None:
        if greedy:
            return jax.random.key(0), None, None  # never read when greedy
        seed = secrets.randbits(32)
        fresh = jax.random.key(seed)
        return fresh, fresh, seed
    return _sequence_keys_input(key, batch), key, None


def _sequence_keys_input(key, batch: int):
    """A typed PRNG key (scalar: folded per sequence on device) or ``[B]`` keys."""
    if isinstance(key, (int, np.integer)):
        raise TypeError(f"key must be a JAX PRNG key such as jax.random.key({key}), not an int.")
    if not hasattr(key, "dtype"):
        raise TypeError(f"key must be a JAX PRNG key (jax.random.key(seed)), got {type(key).__name__}.")
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        typed = key
    elif key.dtype == jnp.uint32 and key.shape[-1:] == (2,):
        typed = jax.random.wrap_key_data(key)  # a legacy jax.random.PRNGKey
    else:
        raise TypeError(
            f"key must be a JAX PRNG key (jax.random.key(seed)), got an array of dtype "
            f"{key.dtype} and shape {key.shape}."
        )
    if typed.ndim == 0:
        return typed
    if typed.shape == (batch,):
        return typed
    raise ValueError(
        f"key must be one PRNG key or one per sequence (shape ({batch},)), got shape {typed.shape}."
    )


def _max_positions(module) -> Optional[int]:
    value = getattr(module, "max_position_embeddings", None)
    if value is None:
        value = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    return None if value is None else int(value)


def _check_length(
    modules: Sequence[tuple[str, Any]], needed: int, max_length: Optional[int], what: str
) -> int:
    """Cache length to allocate; raises if the models or ``max_length`` are too short."""
    for name, module in modules:
        limit = _max_positions(module)
        if limit is not None and needed > limit:
            raise ValueError(
                f"{what} needs {needed} positions but the {name} model supports "
                f"{limit} (max_position_embeddings): shorten the prompts or lower "
                "max_new_tokens (or num_draft)."
            )
    if max_length is None:
        return needed
    if int(max_length) < needed:
        raise ValueError(
            f"max_length={max_length} is too short: {what} needs a cache of {needed} "
            "positions; raise max_length, or shorten the prompts / lower max_new_tokens "
            "(or num_draft)."
        )
    return int(max_length)


# The smallest temperature ``decode`` / ``generate`` accept, other than 0 (greedy).
# ``logits / temperature`` runs in float32: a temperature below its normal range
# (1.2e-38) is flushed to zero and one just above it overflows ordinary logits
# to inf; either way every probability became NaN and every token 0. Below 1e-6
# sampling differs from greedy only between logits within about 2e-5 of the top, so
# such a temperature is refused with a pointer to temperature=0 rather than
# silently replaced by greedy decoding (whose rules take their greedy branch).
MIN_TEMPERATURE = 1e-6


def _check_common(temperature, top_k, top_p, max_new_tokens) -> None:
    sampling.check_sampling_args(temperature, top_k, top_p)
    if 0.0 < float(temperature) < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature={temperature!r} is too small to sample with: below {MIN_TEMPERATURE:g}, "
            "logits / temperature can overflow float32 (every token came out 0), and sampling "
            "equals greedy decoding up to near-ties anyway. Pass temperature=0 for greedy "
            f"decoding, or a temperature >= {MIN_TEMPERATURE:g}."
        )
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")


def _check_pad_id(pad_token_id) -> int:
    """``pad_token_id`` fills the int32 token buffer: any int32 (e.g. -1) is allowed."""
    ok = isinstance(pad_token_id, (int, np.integer)) and not isinstance(pad_token_id, bool)
    if not ok or not -(2**31) <= int(pad_token_id) < 2**31:
        raise ValueError(
            f"pad_token_id must be an integer in the int32 range [-2**31, 2**31 - 1] (it fills "
            f"the int32 tokens after each sequence's end), got {pad_token_id!r}."
        )
    return int(pad_token_id)


# ---------------------------------------------------------------------------
# Shape buckets: a handful of compiled programs for mixed traffic
# ---------------------------------------------------------------------------


class Buckets(NamedTuple):
    """The shapes ``decode`` and ``generate`` pad their inputs to (``buckets=``).

    A compiled loop is specialised to the batch size, the padded prompt width
    and the length of its token buffers; without buckets every new prompt width
    compiled a new program (about 16 s each on the embedded pair). Each is
    rounded up to a bucket instead, so mixed-length traffic compiles a few
    programs and then reuses them:

    * the prompt width (the longest prompt of the batch) pads to
      ``prompt * 2**i``: 16, 32, 64, 128, ...;
    * ``max_new_tokens`` pads to ``new_tokens * 2**i`` for the buffers only:
      generation still stops at the caller's ``max_new_tokens`` (a traced
      value) and the output is cut back to it;
    * with ``batch=True`` the batch pads to 1, 2, 4, 8, then multiples of 8, with
      one-token dummy sequences that are finished before the first cycle (they
      commit nothing and are cut from the output).

    Padding is inert: padded prompt columns lie beyond each sequence's length
    (masked, then overwritten before they are read), dummy rows never touch a
    real row, and each sequence keeps its own key (``fold_in(key, b)``). Near a
    model's ``max_position_embeddings`` (or ``max_length=``) the padding
    shrinks to fit; the request itself is never cut. The prompt is prefilled
    in blocks of ``PREFILL_BLOCK`` (16) tokens, so even in bfloat16 a
    sequence's tokens do not depend on the width bucket its batch falls in.

    Powers of two keep the count logarithmic (widths 3..90 with
    ``max_new_tokens <= 16``: four programs per batch bucket) for at most twice
    the prefill work and cache length. Measured on the embedded pair against
    the unbucketed engine in one run (CPU, float32, 24-token prompts, K=4,
    calls of 6-75 ms): 0-6% slower when ``max_new_tokens`` is a bucket (64);
    15-30% when it is not (40 -> 64: a 1.5x longer cache to attend over, and
    about 1 ms to cut the output on the host). A server with one fixed
    ``max_new_tokens`` should pass ``Buckets(new_tokens=max_new_tokens)``: the
    ladder then starts at its own length (40, 80, 160, ...), and that case ran
    within 10% of the unbucketed engine (the prompt still pads 24 -> 32).
    """

    prompt: int = 16
    new_tokens: int = 16
    batch: bool = True


# The default of ``decode`` and ``generate``; ``buckets=None`` compiles the exact shapes.
BUCKETS = Buckets()


def _bucket(n: int, smallest: int) -> int:
    """The smallest ``smallest * 2**i`` that is ``>= n``."""
    size = smallest
    while size < n:
        size *= 2
    return size


def _batch_bucket(n: int, multiple: int) -> int:
    """1, 2, 4, 8, then multiples of 8 (at most 7 dummy rows past 8). On a mesh
    the bucket must stay divisible by its ``'data'`` axis, else ``n`` is kept."""
    size = _bucket(n, 1) if n <= 8 else -(-n // 8) * 8
    return size if size % multiple == 0 else n


def _check_buckets(buckets) -> Optional[Buckets]:
    if buckets is None:
        return None
    if not isinstance(buckets, Buckets):
        raise TypeError(f"buckets must be a specjax Buckets(...) or None, got {type(buckets).__name__}.")
    for name in ("prompt", "new_tokens"):
        value = getattr(buckets, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"Buckets.{name} must be a positive integer, got {value!r}.")
    return buckets


def _position_limit(modules: Sequence[tuple[str, Any]], max_length: Optional[int]) -> Optional[int]:
    """The most cache positions a call may allocate (models' limits, ``max_length``)."""
    limits = [_max_positions(m) for _, m in modules] + [None if max_length is None else int(max_length)]
    limits = [x for x in limits if x is not None]
    return min(limits) if limits else None


def _padded_lengths(
    buckets: Optional[Buckets], width: int, new_tokens: int, extra: int, limit: Optional[int]
) -> tuple[int, int]:
    """``(P', N')``: prompt width and new-token buffer, rounded up to their buckets
    and shrunk (never below the request) until ``P' + N' + extra`` fits ``limit``.

    The caller has checked that ``width + new_tokens + extra <= limit``.
    """
    if buckets is None:
        return width, new_tokens
    wp, nw = _bucket(width, buckets.prompt), _bucket(new_tokens, buckets.new_tokens)
    if limit is not None:
        nw = max(new_tokens, min(nw, limit - wp - extra))
        wp = max(width, min(wp, limit - nw - extra))
    return wp, nw


class _Call(NamedTuple):
    """One ``decode`` / ``generate`` call after validation: host inputs padded to
    the buckets, the compile-time settings both loops share, and what the
    output must be cut back to."""

    prompts: np.ndarray  # [B', P'] int32
    lengths: np.ndarray  # [B'] int32 (1 for a dummy row)
    max_new: np.ndarray  # [B'] int32: max_new_tokens, 0 for a dummy row (done from the start)
    eos: Any  # [E] int32 EOS ids, -1 filled (traced: a new EOS set compiles nothing)
    pad_id: Any  # int32 scalar (traced)
    key: Any  # typed PRNG key: scalar, or [B']
    temperature: Any  # float32 scalar
    top_p: Any  # float32 scalar
    cfg: _Config  # rule, drafting, diagnostics and hidden layers left for decode to set
    models: dict  # the models, placed on the mesh if there is one
    batch: int  # B: rows to keep
    new_tokens: int  # N: columns to keep
    record: tuple  # (key, seed) recorded on the output


def _prepare_call(
    models: dict,
    vocab: int,
    prompt_ids,
    *,
    extra: int,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    eos_token_id,
    key,
    max_length,
    prompt_lengths,
    pad_token_id,
    mesh,
    buckets,
    what: str,
) -> _Call:
    """The argument preparation ``decode`` and ``generate`` share (all before tracing).

    ``models``: ``{"target": Model, "draft": Model}`` (draft optional);
    ``extra``: cache positions past ``P + N`` (``num_draft`` for decode).
    """
    _check_common(temperature, top_k, top_p, max_new_tokens)
    pad_id = _check_pad_id(pad_token_id)
    buckets = _check_buckets(buckets)
    greedy = float(temperature) == 0.0
    new_tokens = int(max_new_tokens)
    prompts, lengths = _prepare_prompts(prompt_ids, prompt_lengths, vocab)
    # A padded array wider than its longest prompt is bucketed by the real width.
    prompts = prompts[:, : int(lengths.max())]
    batch, width = prompts.shape
    eos = _eos_ids(eos_token_id, vocab, models["target"].module)
    key, recorded_key, seed = _resolve_key(key, batch, greedy)
    modules = [(name, m.module) for name, m in models.items()]
    cache_length = _check_length(modules, width + new_tokens + extra, max_length, what.format(width=width))
    width_pad, new_pad = _padded_lengths(
        buckets, width, new_tokens, extra, _position_limit(modules, max_length)
    )
    if max_length is None:
        cache_length = width_pad + new_pad + extra
    placed, layout = sharding_lib.prepare(models, batch, mesh)
    data = 1 if layout is None else int(layout.mesh.shape[sharding_lib.DATA])
    batch_pad = batch if buckets is None or not buckets.batch else _batch_bucket(batch, data)

    padded_prompts = np.zeros((batch_pad, width_pad), np.int32)
    padded_prompts[:batch, :width] = prompts
    padded_lengths = np.ones((batch_pad,), np.int32)
    padded_lengths[:batch] = lengths
    max_new = np.zeros((batch_pad,), np.int32)
    max_new[:batch] = new_tokens
    key = _pad_keys(key, batch_pad)
    cfg = _Config(
        diagnostics=None,
        num_draft=extra,
        max_new_tokens=new_pad,
        cache_length=cache_length,
        greedy=greedy,
        top_k=None if (greedy or top_k is None) else int(top_k),
        use_top_p=(not greedy) and top_p is not None and float(top_p) < 1.0,
    )
    temp = np.float32(1.0 if greedy else temperature)
    top_p_value = np.float32(1.0 if top_p is None else top_p)
    eos_ids, pad = _eos_array(eos), np.int32(pad_id)
    if layout is not None:
        padded_prompts, padded_lengths, max_new, pad, key, temp, top_p_value = layout.put_inputs(
            padded_prompts, padded_lengths, max_new, pad, key, temp, top_p_value
        )
        eos_ids = _replicated(layout, eos_ids)
        cfg = cfg._replace(layout=layout)
    return _Call(
        padded_prompts, padded_lengths, max_new, eos_ids, pad, key, temp, top_p_value, cfg=cfg, models=placed,
        batch=batch, new_tokens=new_tokens, record=(recorded_key, seed),
    )


def _eos_array(eos: tuple[int, ...]) -> np.ndarray:
    """EOS ids as an ``int32 [E]`` operand, ``E`` in 4, 8, 16, ... and ``-1``
    (no token) filling the rest: the ids are traced, only ``E`` shapes the program."""
    out = np.full((_bucket(max(len(eos), 1), 4),), -1, np.int32)
    out[: len(eos)] = eos
    return out


def _replicated(layout, x) -> Array:
    """A host array replicated over the mesh, built per shard (works on every host of a job)."""
    rep = layout.named(jax.sharding.PartitionSpec())
    return jax.make_array_from_callback(np.shape(x), rep, lambda idx, h=np.asarray(x): h[idx])


def _pad_keys(key, batch_pad: int):
    """``[B]`` keys padded to ``[B']`` on the host (dummy rows reuse key 0; their
    draws are never read). Host-side so that no device program is compiled per B."""
    if key.ndim == 0 or key.shape[0] == batch_pad:
        return key
    data = np.asarray(jax.random.key_data(key))
    data = np.concatenate([data, np.repeat(data[:1], batch_pad - data.shape[0], axis=0)])
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))


def _finish(call: _Call, out: "DecodeOutput", bad, which: dict[int, str]) -> "DecodeOutput":
    """Cuts the dummy rows and the buffer columns, records the key, raises on
    non-finite logits.

    The cut runs on the host (slicing on device would compile one small
    program per output shape, defeating the buckets), and only when a bucket
    padded something: about 1 ms per call on CPU.
    """
    if out.tokens.shape != (call.batch, call.new_tokens):
        out, bad = jax.device_get((out, bad))
        out = jax.tree_util.tree_map(lambda x: x[: call.batch] if np.ndim(x) >= 1 else x, out)
        out = out.replace(tokens=out.tokens[:, : call.new_tokens])
        bad = bad[: call.batch]
        layout = call.cfg.layout
        if layout is None:
            out = jax.device_put(out)
        else:  # replicated on the mesh
            out = jax.tree_util.tree_map(functools.partial(_replicated, layout), out)
    out = out.replace(key=call.record[0], seed=call.record[1])
    _raise_if_bad(bad, out, which)
    return out


# ---------------------------------------------------------------------------
# Device-side helpers
# ---------------------------------------------------------------------------


def _gather(tokens: Array, index: Array) -> Array:
    """``tokens[b, index[b]]``."""
    return jnp.take_along_axis(tokens, index[:, None].astype(jnp.int32), axis=1)[:, 0]


def _row(x: Array, index: Array) -> Array:
    """``x[b, index[b]]`` for ``x[B, T, ...]``."""
    idx = index.astype(jnp.int32).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


def _where_b(mask: Array, new, old):
    """Per-sequence select over two pytrees with leading batch axes."""

    def sel(n, o):
        m = mask.reshape(mask.shape + (1,) * (n.ndim - mask.ndim))
        return jnp.where(m, n, o)

    return jax.tree_util.tree_map(sel, new, old)


def _batched_init(init_fn: Callable[[], Any], batch: int):
    return jax.tree_util.tree_map(
        lambda x: jnp.broadcast_to(jnp.asarray(x), (batch,) + jnp.shape(x)), init_fn()
    )


def _per_sequence_keys(key: Array, batch: int) -> Array:
    if key.ndim == 0:
        return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch, dtype=jnp.uint32))
    return key


def _warp(cfg: _Config, raw: Array, temperature, top_p) -> Array:
    if cfg.greedy:
        return raw.astype(jnp.float32)
    return sampling.warp_logits(raw, temperature, cfg.top_k, top_p if cfg.use_top_p else None)


# Prompts are prefilled in blocks of this many tokens (the smallest prompt
# bucket), so that every prefill matmul has ``B * PREFILL_BLOCK`` rows whatever
# the padded width: one ``[B * P, H]`` product rounded differently for another
# ``P``, and in bfloat16 a sequence's output changed with its companions'
# prompt lengths.
PREFILL_BLOCK = 16


def _prefill(module, params, prompts: Array, keep: Array, cache_length: int) -> KVCache:
    """Runs ``prompts[B, P]`` into a fresh cache, then keeps ``keep[B]`` entries.

    Full blocks of ``PREFILL_BLOCK`` tokens go through one ``scan`` (one
    forward compiled); a shorter tail (``buckets=None`` or a width shrunk to a
    position limit) through one more forward.
    """
    batch, width = prompts.shape
    cache = module.init_cache(batch, cache_length)
    full, tail = divmod(width, PREFILL_BLOCK)
    if full:
        blocks = prompts[:, : full * PREFILL_BLOCK].reshape(batch, full, PREFILL_BLOCK).transpose(1, 0, 2)
        cache, _ = jax.lax.scan(lambda c, block: (module.apply(params, block, c).cache, None), cache, blocks)
    if tail:
        cache = module.apply(params, prompts[:, full * PREFILL_BLOCK :], cache).cache
    return cache.rollback(keep)


def _constrain(cfg: _Config, state, batch: int, caches: Sequence[tuple[str, str]]):
    """Pins a loop state to the mesh layout (no-op without a mesh): caches get
    their own spec, every other batch-leading leaf is split over 'data'."""
    lay = cfg.layout
    if lay is None:
        return state
    pinned = {field: lay.constrain_cache(getattr(state, field), which) for field, which in caches}
    rest = lay.constrain_batch(state.replace(**{field: None for field, _ in caches}), batch)
    return rest.replace(**pinned)


def _replicate_outputs(cfg: _Config, tree):
    """On a mesh, outputs are replicated so every host can read them (they are small)."""
    return tree if cfg.layout is None else cfg.layout.replicated(tree)


def _extract(cfg: _Config, tokens: Array, prompt_lengths: Array, generated: Array, pad_id: Array) -> Array:
    """``[B, N]`` generated tokens, ``pad_id`` after each end."""
    n = cfg.max_new_tokens
    out = jax.vmap(lambda row, start: jax.lax.dynamic_slice(row, (start,), (n,)))(
        tokens, prompt_lengths
    )
    return jnp.where(jnp.arange(n)[None, :] < generated[:, None], out, pad_id)


def _is_eos(eos_ids: Array, tokens: Array) -> Array:
    """``tokens`` (any shape) that are one of ``eos_ids[E]`` (-1 entries match nothing)."""
    return (tokens[..., None] == eos_ids).any(-1)


# ---------------------------------------------------------------------------
# Streaming (``on_tokens=``)
# ---------------------------------------------------------------------------

# The callbacks of the streaming calls in flight, by the id each call passes
# to its loop as a traced operand: the compiled program holds one fixed host
# function (:func:`_dispatch`), so a new ``on_tokens`` (e.g. a bound method
# of a fresh object per request) compiles nothing, and calls running in
# parallel threads each reach their own callback.
_STREAMS: dict[int, "_Stream"] = {}
_STREAM_IDS = itertools.count(1)
_STREAMS_LOCK = threading.Lock()


class _Stream:
    """One call's ``on_tokens`` and the caller's batch (rows past it are bucket padding)."""

    def __init__(self, fn: Callable, batch: int):
        self.fn, self.batch, self.error = fn, batch, None


def _check_on_tokens(on_tokens, call: "_Call") -> None:
    if on_tokens is None:
        return
    if not callable(on_tokens):
        raise TypeError(f"on_tokens must be callable (tokens, counts) -> None, got {type(on_tokens).__name__}.")
    if call.cfg.layout is not None:
        raise ValueError(
            "on_tokens (streaming) is not supported on a mesh (mesh=, or params placed on one): "
            "its per-cycle host callback is an ordered effect, which JAX runs on one device only. "
            "Decode without on_tokens there, or on one device."
        )


def _dispatch(stream_id, tokens, counts) -> None:
    """Host side of the per-cycle callback: forwards the caller's rows to its ``on_tokens``.

    A cycle that commits nothing for the caller's rows is not reported. An
    exception of ``on_tokens`` is kept and re-raised by ``decode`` /
    ``generate`` once the loop is over (raised here, JAX would replace it by a
    runtime error); that call's later cycles are then not reported.
    """
    stream = _STREAMS.get(int(stream_id))
    if stream is None or stream.error is not None:
        return
    counts = np.asarray(counts, np.int32)[: stream.batch]
    if not counts.any():
        return
    try:
        stream.fn(np.asarray(tokens, np.int32)[: stream.batch], counts)
    except Exception as e:  # noqa: BLE001 - re-raised by the caller
        stream.error = e


def _report(cfg: _Config, stream_id, tokens: Array, before: Array, after: Array, width: int, pad_id) -> None:
    """Inside the loop body: reports ``tokens[b, before[b]:after[b]]`` (the
    tokens committed by this cycle, at most ``width``) to the host.

    ``io_callback(ordered=True)``: ordered so that the chunks arrive in cycle
    order, and an ``io_callback`` (not ``jax.debug.callback``) because this
    is an effect the caller relies on, which must neither be dropped nor
    reordered; it runs inside ``while_loop`` with the effect token in the
    carry. It costs one device-to-host round trip per cycle; the program
    compiled without ``on_tokens`` (``cfg.stream`` False) has no callback.
    """
    if not cfg.stream:
        return
    counts = (after - before).astype(jnp.int32)
    chunk = jax.vmap(lambda row, off: jax.lax.dynamic_slice(row, (off,), (width,)))(tokens, before)
    chunk = jnp.where(jnp.arange(width)[None, :] < counts[:, None], chunk, pad_id)
    io_callback(_dispatch, None, stream_id, chunk, counts, ordered=True)


def _run_streaming(on_tokens, batch: int, run: Callable):
    """``run(stream_id)`` with ``on_tokens`` registered; waits for the loop (and
    so for every callback) before returning, then re-raises a callback error."""
    if on_tokens is None:
        return run(None)
    stream = _Stream(on_tokens, batch)
    with _STREAMS_LOCK:
        stream_id = next(_STREAM_IDS) % (2**31 - 1)
        _STREAMS[stream_id] = stream
    try:
        result = jax.block_until_ready(run(np.int32(stream_id)))
        jax.effects_barrier()
    finally:
        with _STREAMS_LOCK:
            _STREAMS.pop(stream_id, None)
    if stream.error is not None:
        raise stream.error
    return result


# ---------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------


@struct.dataclass
class _DecodeState:
    step: Array  # scalar int32: cycles run
    tokens: Array  # [B, L]
    num_committed: Array  # [B]
    done: Array  # [B] bool
    bad: Array  # [B] int32: 0 ok, 1 target logits non-finite, 2 draft logits non-finite
    target_cache: KVCache
    draft_cache: KVCache
    rule_state: Any
    policy_state: Any
    stats: DecodeStats


class _Drafts(NamedTuple):
    tokens: Array  # [B, K]
    logits: Array  # [B, K, V] warped (raw when greedy)
    probs: Array  # [B, K, V] softmax(logits)
    valid: Array  # [B, K]
    entropies: Array  # [B, K]
    token_probs: Array  # [B, K]
    bad: Array  # [B, K] the draft logits of that slot were non-finite
    forwards: Array  # scalar int32


def _draft_phase(
    cfg, pair_params: ModelPair, policy: drafting_lib.DraftingPolicy, state: _DecodeState, draft_uniforms,
    temperature, top_p,
):
    module, params = pair_params.draft.module, pair_params.draft.params
    vocab, k_max = pair_params.vocab_size, cfg.num_draft
    nc, tokens = state.num_committed, state.tokens
    batch = nc.shape[0]

    # First step: a T=2 forward over the last two committed tokens (or [t0, pad]).
    first = _gather(tokens, jnp.maximum(nc - 2, 0))
    second = jnp.where(nc >= 2, _gather(tokens, jnp.maximum(nc - 1, 0)), 0)
    pair_tokens, row = jnp.stack([first, second], axis=1), jnp.minimum(nc - 1, 1)
    if getattr(module, "supports_logits_at", False):
        # Only one of the two rows is read: a one-row LM head (on CPU a 2-row
        # head ran ~10x slower than a one-row one, a quarter of a greedy cycle).
        out = module.apply(params, pair_tokens, state.draft_cache, logits_at=row)
        raw0 = out.logits[:, 0, :vocab]
    else:
        out = module.apply(params, pair_tokens, state.draft_cache)
        raw0 = _row(out.logits[..., :vocab], row)
    cache = out.cache.rollback(nc)

    budget = jax.vmap(lambda s: policy.budget(s, k_max), axis_size=batch)(state.policy_state)
    budget = jnp.clip(jnp.asarray(budget, jnp.int32), 1, k_max)

    def process(j, raw, active, bufs: _Drafts) -> tuple[Array, _Drafts]:
        logits = _warp(cfg, raw, temperature, top_p)
        probs = jax.nn.softmax(logits, axis=-1)
        if cfg.greedy:
            tok = sampling.argmax(raw)
        else:
            u = jax.lax.dynamic_index_in_dim(draft_uniforms, j, axis=1, keepdims=False)
            tok = sampling.sample_categorical(probs, u)
        tok_p = jnp.take_along_axis(probs, tok[:, None], axis=-1)[:, 0]
        ent = sampling.entropy(probs)
        step = drafting_lib.DraftStep(
            position=jnp.full((batch,), j, jnp.int32), token=tok, probs=probs, token_prob=tok_p, entropy=ent
        )
        go = jax.vmap(policy.proceed)(state.policy_state, step)
        bufs = _Drafts(
            tokens=bufs.tokens.at[:, j].set(tok),
            logits=bufs.logits.at[:, j].set(logits),
            probs=bufs.probs.at[:, j].set(probs),
            valid=bufs.valid.at[:, j].set(active),
            entropies=bufs.entropies.at[:, j].set(ent),
            token_probs=bufs.token_probs.at[:, j].set(tok_p),
            bad=bufs.bad.at[:, j].set(active & sampling.nonfinite_rows(raw)),
            forwards=bufs.forwards,
        )
        next_active = active & (j + 1 < budget) & jnp.asarray(go, bool)
        return next_active, bufs

    bufs = _Drafts(
        tokens=jnp.zeros((batch, k_max), jnp.int32),
        logits=jnp.zeros((batch, k_max, vocab), jnp.float32),
        probs=jnp.zeros((batch, k_max, vocab), jnp.float32),
        valid=jnp.zeros((batch, k_max), bool),
        entropies=jnp.zeros((batch, k_max), jnp.float32),
        token_probs=jnp.zeros((batch, k_max), jnp.float32),
        bad=jnp.zeros((batch, k_max), bool),
        forwards=jnp.int32(1),
    )
    active, bufs = process(0, raw0, ~state.done, bufs)

    def cond(carry):
        j, active, _, _ = carry
        return (j < k_max) & active.any()

    def body(carry):
        j, active, cache, bufs = carry
        prev = jax.lax.dynamic_index_in_dim(bufs.tokens, j - 1, axis=1, keepdims=True)
        out = module.apply(params, prev, cache)
        active, bufs = process(j, out.logits[:, 0, :vocab], active, bufs)
        new_cache = out.cache if cfg.layout is None else cfg.layout.constrain_cache(out.cache, "draft")
        return j + 1, active, new_cache, bufs._replace(forwards=bufs.forwards + 1)

    _, _, cache, bufs = jax.lax.while_loop(cond, body, (jnp.int32(1), active, cache, bufs))
    return bufs, cache


def _decode_cycle(
    cfg: _Config, pair_params: ModelPair, rule: AcceptanceRule, policy: drafting_lib.DraftingPolicy,
    prompt_lengths, max_new, eos_ids, seq_keys, temperature, top_p, state,
):
    """One draft-verify cycle. Returns ``(state, diagnostics or None)``.

    ``max_new[B]``: each sequence's ``max_new_tokens`` (traced, so it does not
    shape the program; ``cfg.max_new_tokens`` is only the buffer's bucket).
    """
    k_max, vocab = cfg.num_draft, pair_params.vocab_size
    nc, done = state.num_committed, state.done
    batch = nc.shape[0]

    # All of a cycle's randomness in one draw per sequence: the K acceptance
    # uniforms, one uniform per draft sample and one for the emitted token
    # (inverse-CDF sampling; a Gumbel-max draw would need V of them).
    if cfg.greedy:
        draft_uniforms = emit_uniform = None
        uniforms = jnp.zeros((batch, k_max), jnp.float32)  # rules ignore them when greedy
    else:
        u = jax.vmap(lambda k: sampling.uniform_open(jax.random.fold_in(k, state.step), (2 * k_max + 1,)))(
            seq_keys
        )
        uniforms, draft_uniforms, emit_uniform = u[:, :k_max], u[:, k_max : 2 * k_max], u[:, 2 * k_max]

    # ---- draft ----
    drafts, draft_cache = _draft_phase(cfg, pair_params, policy, state, draft_uniforms, temperature, top_p)
    draft_probs = drafts.probs

    # ---- verify: one target forward over [last, d_1 .. d_K] ----
    last = _gather(state.tokens, nc - 1)
    block_in = jnp.concatenate([last[:, None], drafts.tokens], axis=1)
    out = pair_params.target.module.apply(
        pair_params.target.params, block_in, state.target_cache, hidden_layers=rule.hidden_layers
    )
    raw = out.logits[..., :vocab]
    target_logits = _warp(cfg, raw, temperature, top_p)
    target_probs = jax.nn.softmax(target_logits, axis=-1)
    features = {}
    if rule.hidden_layers:
        features["hidden"] = {layer: h[:, 1:] for layer, h in zip(rule.hidden_layers, out.hidden)}
    inputs = VerifyInputs(
        draft_tokens=drafts.tokens,
        draft_logits=drafts.logits,
        draft_probs=draft_probs,
        target_logits=target_logits,
        target_probs=target_probs,
        uniforms=uniforms,
        valid=drafts.valid,
        features=features,
    )
    verdict = jax.vmap(functools.partial(rule.verify, greedy=cfg.greedy))(inputs, state.rule_state)

    # ---- accept: leading run of accepted valid slots ----
    accept = jnp.asarray(verdict.accept, bool) & drafts.valid
    n = jnp.cumprod(accept.astype(jnp.int32), axis=1).sum(1)
    v = drafts.valid.sum(1).astype(jnp.int32)
    correction = _row(verdict.correction, jnp.minimum(n, k_max - 1))
    if cfg.greedy:
        corr_tok = sampling.argmax(correction)
        bonus_tok = sampling.argmax(_row(target_logits, n))
    else:
        # One uniform serves both: only one of the two tokens is used.
        corr_tok = sampling.sample_categorical(correction, emit_uniform)
        bonus_tok = sampling.sample_categorical(_row(target_probs, n), emit_uniform)
    emitted = jnp.where(n < v, corr_tok, bonus_tok)

    # ---- non-finite logits: stop the sequence, emit nothing ----
    # Only rows the outcome depends on count: target rows 0..n (decisions up
    # to slot n and the emitted token's distribution), draft rows 0..n.
    slots = jnp.arange(k_max + 1)[None, :]
    target_bad = (sampling.nonfinite_rows(raw) & (slots <= n[:, None])).any(1)
    draft_bad = (drafts.bad & (slots[:, :k_max] <= n[:, None])).any(1)
    live_before = ~done
    new_bad = jnp.where(
        live_before & draft_bad, 2, jnp.where(live_before & target_bad, 1, 0)
    ).astype(jnp.int32)
    bad = jnp.where(state.bad > 0, state.bad, new_bad)
    live = live_before & (new_bad == 0)

    # ---- commit: drafts[:n] + emitted, cut at EOS and max_new_tokens ----
    block = jnp.concatenate([drafts.tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    block = jnp.where(slots == n[:, None], emitted[:, None], block)
    is_eos = _is_eos(eos_ids, block) & (slots <= n[:, None])
    first_eos = jnp.where(is_eos.any(1), jnp.argmax(is_eos, axis=1), k_max + 1)
    room = max_new - (nc - prompt_lengths)
    n_commit = jnp.minimum(jnp.minimum(n + 1, first_eos + 1), room)
    n_commit = jnp.where(live, n_commit, 0).astype(jnp.int32)
    hit_eos = live & (first_eos < n_commit)
    new_nc = nc + n_commit
    tokens = jax.vmap(lambda row, blk, off: jax.lax.dynamic_update_slice(row, blk, (off,)))(
        state.tokens, block, nc
    )
    new_done = done | (new_bad > 0) | hit_eos | (new_nc - prompt_lengths >= max_new)

    # ---- roll the caches back to their invariants ----
    target_cache = out.cache.rollback(new_nc - 1)
    draft_cache = draft_cache.rollback(jnp.maximum(new_nc - 2, 0))

    # ---- running states ----
    rule_state = jax.vmap(functools.partial(rule.update, greedy=cfg.greedy))(
        state.rule_state, inputs, verdict, n
    )
    rule_state = _where_b(live, rule_state, state.rule_state)
    outcome = drafting_lib.DraftOutcome(
        num_drafted=v,
        num_accepted=n,
        valid=drafts.valid,
        entropies=drafts.entropies,
        token_probs=drafts.token_probs,
    )
    policy_state = jax.vmap(policy.update)(state.policy_state, outcome)
    policy_state = _where_b(live, policy_state, state.policy_state)

    # ---- stats ----
    stats = record_cycle(state.stats, live=live, valid=drafts.valid, num_accepted=n, num_committed=n_commit,
                         paths=verdict.path, draft_forwards=drafts.forwards)
    diag = None
    if cfg.diagnostics is not None:
        values = jax.vmap(cfg.diagnostics)(inputs, verdict, n)
        diag = jax.tree_util.tree_map(
            lambda x: jnp.where(live.reshape(live.shape + (1,) * (x.ndim - 1)), x, 0), values
        )

    new_state = _DecodeState(
        step=state.step + 1,
        tokens=tokens,
        num_committed=new_nc,
        done=new_done,
        bad=bad,
        target_cache=target_cache,
        draft_cache=draft_cache,
        rule_state=rule_state,
        policy_state=policy_state,
        stats=stats,
    )
    return new_state, diag


def _decode_impl(
    pair_params: ModelPair, rule: AcceptanceRule, policy: drafting_lib.DraftingPolicy, prompts, prompt_lengths,
    max_new, eos_ids, pad_id, key, temperature, top_p, stream_id=None, *, cfg: _Config,
):
    batch, width = prompts.shape
    k_max, n_max = cfg.num_draft, cfg.max_new_tokens
    seq_keys = _per_sequence_keys(key, batch)

    target_cache = _prefill(
        pair_params.target.module, pair_params.target.params, prompts, prompt_lengths - 1, cfg.cache_length
    )
    draft_cache = _prefill(
        pair_params.draft.module,
        pair_params.draft.params,
        prompts,
        jnp.maximum(prompt_lengths - 2, 0),
        cfg.cache_length,
    )
    tokens = jnp.zeros((batch, width + n_max + k_max + 1), jnp.int32).at[:, :width].set(prompts)
    state = _DecodeState(
        step=jnp.int32(0),
        tokens=tokens,
        num_committed=prompt_lengths,
        done=max_new <= 0,  # the buckets' dummy rows
        bad=jnp.zeros((batch,), jnp.int32),
        target_cache=target_cache,
        draft_cache=draft_cache,
        rule_state=_batched_init(rule.init, batch),
        policy_state=_batched_init(lambda: policy.init(k_max), batch),
        stats=DecodeStats.zeros(batch, k_max),
    )
    caches = (("target_cache", "target"), ("draft_cache", "draft"))
    state = _constrain(cfg, state, batch, caches)
    cycle = functools.partial(
        _decode_cycle, cfg, pair_params, rule, policy, prompt_lengths, max_new, eos_ids, seq_keys, temperature,
        top_p,
    )
    if cfg.diagnostics is not None:
        shapes = jax.eval_shape(lambda s: cycle(s)[1], state)
        extra = jax.tree_util.tree_map(lambda sd: jnp.zeros(sd.shape, sd.dtype), shapes)
        state = state.replace(stats=state.stats.replace(extra=extra))

    def cond(s: _DecodeState):
        return (~s.done.all()) & (s.step < n_max)

    def body(s: _DecodeState):
        new, diag = cycle(s)
        if diag is not None:
            extra = jax.tree_util.tree_map(jnp.add, new.stats.extra, diag)
            new = new.replace(stats=new.stats.replace(extra=extra))
        _report(cfg, stream_id, new.tokens, s.num_committed, new.num_committed, k_max + 1, pad_id)
        return _constrain(cfg, new, batch, caches)

    state = jax.lax.while_loop(cond, body, state)
    generated = state.num_committed - prompt_lengths
    out = DecodeOutput(
        tokens=_extract(cfg, state.tokens, prompt_lengths, generated, pad_id),
        lengths=generated,
        stats=state.stats,
    )
    return _replicate_outputs(cfg, (out, state.bad))


_decode_jit = jax.jit(_decode_impl, static_argnames=("cfg",))


def _raise_if_bad(bad, out, which: dict[int, str]) -> None:
    bad = np.asarray(bad)
    rows = np.flatnonzero(bad)
    if rows.size == 0:
        return
    parts = [f"sequence {int(b)} ({which[int(bad[b])]} model)" for b in rows]
    err = FloatingPointError(
        "non-finite logits (NaN or inf) in " + ", ".join(parts) + "; those sequences were "
        "stopped before the bad step and nothing was emitted from it. Check the params "
        "(e.g. a bfloat16 overflow) and the inputs."
    )
    err.output = out
    raise err


def decode(
    params: ModelPair,
    prompt_ids,
    *,
    rule: Optional[AcceptanceRule] = None,
    drafting: Optional[drafting_lib.DraftingPolicy] = None,
    num_draft: int = 4,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    eos_token_id=None,
    key=None,
    max_length: Optional[int] = None,
    prompt_lengths=None,
    pad_token_id: int = 0,
    diagnostics: Optional[Callable] = None,
    mesh=None,
    buckets: Optional[Buckets] = BUCKETS,
    on_tokens: Optional[Callable] = None,
) -> DecodeOutput:
    """Speculative decoding: draft with ``params.draft``, verify with ``params.target``.

    Args:
      params: ``specjax.pair(target, draft)``.
      prompt_ids: a ragged list of token lists, or a right-padded ``[B, P]``
        int array (with ``prompt_lengths`` unless every row is full).
      rule: acceptance rule (default ``speculative_sampling()``, lossless).
      drafting: drafting policy (default ``specjax.drafting.fixed()``, i.e.
        always ``num_draft`` tokens).
      num_draft: K, the most tokens drafted per cycle (buffer shapes).
      max_new_tokens: N, tokens generated per sequence at most.
      temperature: 0 for greedy; applied with ``top_k`` / ``top_p`` identically
        to both models. A positive temperature below ``MIN_TEMPERATURE``
        (1e-6) is refused: ``logits / temperature`` would overflow.
      eos_token_id: an id or a list of ids that end a sequence (kept in the
        output). Default (None): the target's config (``eos_token_ids``, from
        the checkpoint's ``eos_token_id``), if it has one; ``()`` disables EOS
        (every sequence runs to ``max_new_tokens``).
      key: ``jax.random.key(seed)`` (sequence ``b`` uses ``fold_in(key, b)``),
        or one key per sequence (shape ``[B]``). Default (None): a fresh
        random seed per call, recorded as ``out.seed`` / ``out.key`` (pass
        ``key=out.key`` to reproduce the run). Greedy decoding needs no key.
      max_length: cache length to allocate (default: just enough for the
        bucketed shapes, ``P' + N' + K``).
      prompt_lengths: ``[B]`` true lengths of a padded ``prompt_ids`` array.
      pad_token_id: fills ``tokens`` after each sequence's end (any int32).
      diagnostics: optional hook ``(inputs, verdict, num_accepted) -> dict`` of
        per-sequence scalars, summed per sequence into ``stats.extra``.
      mesh: a ``('data', 'model')`` :class:`jax.sharding.Mesh`
        (``specjax.sharding.make_mesh``): sequences are split over ``'data'``,
        heads / MLP / vocabulary over ``'model'``; params not yet on the mesh
        are placed by ``specjax.sharding.shard_params``'s rules, params already
        on it (sharded or replicated) are used as they are. Default: the mesh
        the params are on, if any (``specjax.sharding.shard_params``), else one
        device. Outputs come back replicated. See ``docs/sharding.md``.
      buckets: the shapes the inputs are padded to (:class:`Buckets`; default
        ``BUCKETS``: batch 1, 2, 4, 8, then multiples of 8; prompt width and
        ``max_new_tokens`` buffer 16, 32, 64, ...), so that calls whose shapes
        fall in the same buckets share one compiled program. Padding never
        changes a sequence's output, and the output is cut back to ``[B, N]``.
        ``None``: compile for the exact shapes.
      on_tokens: streaming. A host function ``on_tokens(tokens, counts)``
        called after every draft-verify cycle that committed tokens, in cycle
        order, while the loop runs: ``tokens`` is an ``int32 [B, K + 1]``
        numpy array and ``counts`` an ``int32 [B]`` one; row ``b``'s first
        ``counts[b]`` entries are the tokens that cycle committed to sequence
        ``b`` (already cut at EOS and ``max_new_tokens``; 0 for a finished
        sequence), the rest is ``pad_token_id``. Concatenated per sequence, the
        chunks are exactly ``out.tokens[b, :out.lengths[b]]``. ``B`` is the
        caller's batch (bucket padding rows are never reported). It is called
        from a JAX runtime thread through an ordered ``io_callback``: one
        device-to-host round trip per cycle, so the loop waits for it (keep it
        quick). ``decode`` returns once every chunk was delivered, with the
        same :class:`DecodeOutput` as without it; an exception raised by
        ``on_tokens`` stops the reports and is re-raised then. Default (None):
        no callback is compiled in, the program is the one without streaming.
        Any two callbacks share one compiled program. Not supported on a mesh
        (ValueError).

    Compilation and warm-up: the first call for each combination of
    (batch bucket, prompt-width bucket, ``max_new_tokens`` bucket) and of the
    static settings (the rule's and the drafting policy's types and static
    fields, ``num_draft``, greedy or not, ``top_k``, whether ``top_p`` is set,
    ``max_length``, the mesh, the ``diagnostics`` function, whether
    ``on_tokens`` is given) compiles; later calls reuse it. Traced, so free
    to change between calls: the rule's numeric hyper-parameters (MARS's
    ``theta``, EARS's ``beta``, PAD's ``sigma`` and head params, ...), the
    policy's thresholds, temperature, ``top_p``'s value, the EOS ids (up to 4
    share one program), ``pad_token_id``, the key and the prompts' contents.
    A serving loop can compile ahead by calling ``decode`` once per bucket it
    will meet, e.g. with ``[[0] * width] * batch`` for ``width`` in 16, 32,
    64, ... and its batch sizes, before taking traffic (``docs/serving.md``).

    Returns:
      :class:`DecodeOutput`.

    Raises:
      ValueError / TypeError: for bad arguments (before anything is traced),
        including a mesh that does not divide the batch, or the heads / kv heads
        / MLP width of a model it must shard.
      FloatingPointError: if a model produced NaN / inf logits (the sequence
        is named; ``err.output`` holds what was generated).
    """
    if not isinstance(params, ModelPair):
        raise TypeError(
            "decode(): params must be specjax.pair(target, draft); for target-only decoding "
            f"use specjax.generate. Got {type(params).__name__}."
        )
    rule = speculative_sampling() if rule is None else rule
    if not isinstance(rule, AcceptanceRule):
        raise TypeError(f"rule must be an AcceptanceRule (e.g. specjax.rules.mars(0.9)), got {type(rule).__name__}.")
    drafting = drafting_lib.fixed() if drafting is None else drafting
    if not isinstance(drafting, drafting_lib.DraftingPolicy):
        raise TypeError(
            f"drafting must be a DraftingPolicy (e.g. specjax.drafting.heuristic()), got {type(drafting).__name__}."
        )
    if isinstance(num_draft, bool) or int(num_draft) != num_draft or num_draft < 1:
        raise ValueError(f"num_draft (K) must be an integer >= 1, got {num_draft!r}.")
    num_draft = int(num_draft)
    fixed_k = drafting_lib.max_fixed_k(drafting)
    if fixed_k is not None and fixed_k > num_draft:
        raise ValueError(
            f"drafting fixed(k={fixed_k}) exceeds num_draft={num_draft}; pass num_draft={fixed_k}."
        )
    call = _prepare_call(
        {"target": params.target, "draft": params.draft},
        params.vocab_size,
        prompt_ids,
        extra=num_draft,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=eos_token_id,
        key=key,
        max_length=max_length,
        prompt_lengths=prompt_lengths,
        pad_token_id=pad_token_id,
        mesh=mesh,
        buckets=buckets,
        what=f"decoding (longest prompt {{width}} + max_new_tokens {max_new_tokens} + num_draft {num_draft})",
    )
    if diagnostics is not None and not callable(diagnostics):
        raise TypeError(f"diagnostics must be a function (inputs, verdict, num_accepted) -> dict, got "
                        f"{type(diagnostics).__name__}.")
    cfg = call.cfg._replace(diagnostics=diagnostics)
    if cfg.layout is not None:  # the rule's and policy's traced numbers, replicated on the mesh
        rule, drafting = jax.tree_util.tree_map(
            lambda x: _replicated(cfg.layout, np.asarray(jnp.asarray(x))), (rule, drafting)
        )
    _check_on_tokens(on_tokens, call)
    cfg = cfg._replace(stream=on_tokens is not None)
    params = params.replace(target=call.models["target"], draft=call.models["draft"])
    args = (params, rule, drafting, call.prompts, call.lengths, call.max_new, call.eos, call.pad_id, call.key,
            call.temperature, call.top_p)
    out, bad = _run_streaming(
        on_tokens, call.batch,
        lambda sid: _decode_jit(*args, cfg=cfg) if sid is None else _decode_jit(*args, sid, cfg=cfg),
    )
    return _finish(call, out, bad, {1: "target", 2: "draft"})


# ---------------------------------------------------------------------------
# generate: the target-only baseline
# ---------------------------------------------------------------------------


@struct.dataclass
class _GenState:
    step: Array
    tokens: Array
    num_committed: Array
    done: Array
    bad: Array
    cache: KVCache


def _generate_impl(
    model: Model, vocab: int, prompts, prompt_lengths, max_new, eos_ids, pad_id, key, temperature, top_p,
    stream_id=None, *, cfg: _Config,
):
    batch, width = prompts.shape
    n_max = cfg.max_new_tokens
    seq_keys = _per_sequence_keys(key, batch)
    cache = _prefill(model.module, model.params, prompts, prompt_lengths - 1, cfg.cache_length)
    state = _GenState(
        step=jnp.int32(0),
        tokens=jnp.zeros((batch, width + n_max + 1), jnp.int32).at[:, :width].set(prompts),
        num_committed=prompt_lengths,
        done=max_new <= 0,  # the buckets' dummy rows
        bad=jnp.zeros((batch,), jnp.int32),
        cache=cache,
    )
    state = _constrain(cfg, state, batch, (("cache", "target"),))

    def cond(s: _GenState):
        return (~s.done.all()) & (s.step < n_max)

    def body(s: _GenState):
        nc = s.num_committed
        last = _gather(s.tokens, nc - 1)
        out = model.module.apply(model.params, last[:, None], s.cache)
        raw = out.logits[:, 0, :vocab]
        if cfg.greedy:
            tok = sampling.argmax(raw)
        else:
            probs = jax.nn.softmax(_warp(cfg, raw, temperature, top_p), axis=-1)
            u = jax.vmap(lambda k: sampling.uniform_open(jax.random.fold_in(k, s.step), ()))(seq_keys)
            tok = sampling.sample_categorical(probs, u)
        bad_now = ~s.done & sampling.nonfinite_rows(raw)
        live = ~s.done & ~bad_now
        tokens = jax.vmap(lambda row, t, off: jax.lax.dynamic_update_slice(row, t[None], (off,)))(
            s.tokens, tok, nc
        )
        new_nc = nc + live.astype(jnp.int32)
        hit_eos = live & _is_eos(eos_ids, tok)
        done = s.done | bad_now | hit_eos | (new_nc - prompt_lengths >= max_new)
        new = _GenState(
            step=s.step + 1,
            tokens=tokens,
            num_committed=new_nc,
            done=done,
            bad=jnp.where(bad_now, 1, s.bad),
            cache=out.cache.rollback(new_nc - 1),
        )
        _report(cfg, stream_id, tokens, nc, new_nc, 1, pad_id)
        return _constrain(cfg, new, batch, (("cache", "target"),))

    state = jax.lax.while_loop(cond, body, state)
    generated = state.num_committed - prompt_lengths
    stats = DecodeStats.zeros(batch, 0).replace(
        cycles=generated, tokens=generated, target_forwards=state.step
    )
    out = DecodeOutput(
        tokens=_extract(cfg, state.tokens, prompt_lengths, generated, pad_id), lengths=generated, stats=stats
    )
    return _replicate_outputs(cfg, (out, state.bad))


_generate_jit = jax.jit(_generate_impl, static_argnames=("vocab", "cfg"))


def generate(
    model,
    prompt_ids,
    *,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    eos_token_id=None,
    key=None,
    max_length: Optional[int] = None,
    prompt_lengths=None,
    pad_token_id: int = 0,
    mesh=None,
    buckets: Optional[Buckets] = BUCKETS,
    on_tokens: Optional[Callable] = None,
) -> DecodeOutput:
    """Target-only autoregressive sampling: the baseline ``decode`` is compared to.

    Same sampling semantics (warps, greedy at temperature 0, EOS from the
    model's config unless given, ``key=None`` drawing a recorded fresh seed,
    padding, per-sequence keys, shape ``buckets``) and output type as
    :func:`decode`; ``stats`` count one cycle per token. ``model`` is a
    :class:`~specjax.Model`, or a :class:`ModelPair` (its target is used,
    with the pair's vocabulary). One jitted ``while_loop``, one ``T = 1``
    forward per token. ``mesh``: as for :func:`decode`.

    ``on_tokens``: streaming, as for :func:`decode`, called after every token
    step with ``tokens`` ``int32 [B, 1]`` and ``counts`` ``int32 [B]`` (1 for
    a sequence that produced a token in that step, else 0).
    """
    if isinstance(model, ModelPair):
        vocab, model = model.vocab_size, model.target
    elif isinstance(model, Model):
        vocab = _model_vocab(model)
    else:
        raise TypeError(f"generate(): model must be a specjax.Model, got {type(model).__name__}.")
    call = _prepare_call(
        {"target": model},
        vocab,
        prompt_ids,
        extra=0,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=eos_token_id,
        key=key,
        max_length=max_length,
        prompt_lengths=prompt_lengths,
        pad_token_id=pad_token_id,
        mesh=mesh,
        buckets=buckets,
        what=f"generation (longest prompt {{width}} + max_new_tokens {max_new_tokens})",
    )
    _check_on_tokens(on_tokens, call)
    cfg = call.cfg._replace(stream=on_tokens is not None)
    args = (call.models["target"], vocab, call.prompts, call.lengths, call.max_new, call.eos, call.pad_id,
            call.key, call.temperature, call.top_p)
    out, bad = _run_streaming(
        on_tokens, call.batch,
        lambda sid: _generate_jit(*args, cfg=cfg) if sid is None else _generate_jit(*args, sid, cfg=cfg),
    )
    return _finish(call, out, bad, {1: "target"})
