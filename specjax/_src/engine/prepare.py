"""A call's boundary: the arguments ``decode`` and ``generate`` take, checked
and padded before anything is traced, and the :class:`DecodeOutput` they return.

Read in the order of a call:

1. :func:`prepare_call`, the one argument preparation both entry points
   share: the sampling arguments, the prompts (:func:`prepare_prompts`), the
   EOS ids (:func:`resolve_eos_ids`), the key (:func:`_resolve_key`) and the cache
   length (:func:`_check_length`) are validated, then the shapes are rounded up
   to their :class:`Buckets` and the inputs padded and, on a mesh, placed. It
   returns a :class:`PreparedCall`: the host inputs, the compile-time :class:`LoopConfig`
   and what the output must be cut back to.
2. the jitted loop runs (:mod:`specjax._src.engine.loop`).
3. :func:`finish_call` cuts the bucket padding off the output, records the key
   and raises on non-finite logits (:func:`_raise_if_bad`).

Everything here runs on the host, so an error names the argument at fault
before any compilation. The shape buckets are here, not with the loop,
because bucketing is part of preparing a call: the loop only ever sees the
padded shapes.
"""

from __future__ import annotations

import functools
import secrets
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax._src.proposals import drafting as drafting_lib
from specjax._src.models import multihost
from specjax._src.logits import sampling
from specjax._src.models import sharding as sharding_lib
from specjax._src.proposals import trees as trees_lib
from specjax._src.foundation.checks import as_integer, check_positive_int
from specjax._src.engine.config import LoopConfig
from specjax._src.models.pairing import ModelPair
from specjax._src.rules.base import AcceptanceRule, RuleSpec, speculative_sampling
from specjax._src.engine.stats import DecodeStats

Array = jax.Array

# ---------------------------------------------------------------------------
# What a call returns
# ---------------------------------------------------------------------------


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


def prepare_prompts(prompt_ids, prompt_lengths, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
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
        if prompt_ids is None:
            raise TypeError("prompt_ids is None: pass a list of token lists or a [batch, length] array.")
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
            lengths = np.asarray(prompt_lengths)
            if not np.issubdtype(lengths.dtype, np.integer):  # 2.7 would be cut to 2 silently
                raise TypeError(f"prompt_lengths must hold integers, got dtype {lengths.dtype}.")
            lengths = lengths.astype(np.int64).reshape(-1)
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


def resolve_eos_ids(eos_token_id, vocab_size: int, module=None) -> tuple[int, ...]:
    """``None``: the target's config decides (:func:`_config_eos`); ``()``: no EOS."""
    if eos_token_id is None:
        return () if module is None else _config_eos(module, vocab_size)
    ids = np.asarray(eos_token_id, dtype=object)
    if ids.ndim > 1:
        raise ValueError(f"eos_token_id must be an id or a flat list of ids, got {eos_token_id!r}.")
    out = []
    for i in ids.reshape(-1).tolist():
        token = as_integer(i)  # not a bool: True meaning token 1 is never what was meant
        if token is None:
            raise TypeError(f"eos_token_id must hold integer token ids, got {i!r}.")
        if not 0 <= token < vocab_size:
            raise ValueError(f"eos_token_id {i!r} is outside the vocabulary [0, {vocab_size}).")
        out.append(token)
    return tuple(out)


def _resolve_key(key, batch: int, greedy: bool) -> tuple[Any, Any, Optional[int]]:
    """``(key for the loop, key to record on the output, seed to record)``.

    ``key=None`` when sampling draws a fresh 32-bit seed from the OS
    (``secrets``), so two such calls differ; the seed and its key are recorded
    so that passing either back reproduces the run. Greedy decoding uses no
    randomness: nothing is drawn or recorded. On a multi-host job every
    process takes process 0's seed: the key is one replicated value, and
    shards of one sequence that sampled differently would diverge (and the
    loop's exit with them).
    """
    if key is None:
        if greedy:
            return jax.random.key(0), None, None  # never read when greedy
        seed = multihost.one_seed(secrets.randbits(32))
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
                "max_new_tokens (or num_draft, or the tree's size)."
            )
    if max_length is None:
        return needed
    if int(max_length) < needed:
        raise ValueError(
            f"max_length={max_length} is too short: {what} needs a cache of {needed} "
            "positions; raise max_length, or shorten the prompts / lower max_new_tokens "
            "(or num_draft, or the tree's size)."
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
    check_min_temperature(temperature)
    check_positive_int("max_new_tokens", max_new_tokens)


def check_min_temperature(temperature) -> None:
    """A valid ``temperature`` (see ``check_sampling_args``) that is 0 or large enough to sample with."""
    if 0.0 < float(temperature) < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature={temperature!r} is too small to sample with: below {MIN_TEMPERATURE:g}, "
            "logits / temperature can overflow float32 (every token came out 0), and sampling "
            "equals greedy decoding up to near-ties anyway. Pass temperature=0 for greedy "
            f"decoding, or a temperature >= {MIN_TEMPERATURE:g}."
        )


def _check_pad_id(pad_token_id) -> int:
    """``pad_token_id`` fills the int32 token buffer: any int32 (e.g. -1) is allowed."""
    number = as_integer(pad_token_id)
    if number is None or not -(2**31) <= number < 2**31:
        raise ValueError(
            f"pad_token_id must be an integer in the int32 range [-2**31, 2**31 - 1] (it fills "
            f"the int32 tokens after each sequence's end), got {pad_token_id!r}."
        )
    return number


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
      commit nothing and are cut from the output);
    * ``decode``'s verification block, ``[last, d_1 .. d_K]``, runs at the
      smallest of ``verify * 2**i`` (and ``K + 1``) that holds the most drafts
      any live sequence of the batch proposed this cycle, when the drafting
      policy can stop before ``K`` (``confidence``, ``adasd_entropy``,
      ``heuristic``; ``fixed(k)`` runs at ``k + 1``). One program holds a
      target forward per width and picks one per cycle (``lax.switch``).
      ``verify=None``: always ``K + 1``.

    Padding is inert: padded prompt columns lie beyond each sequence's length
    (masked, then overwritten before they are read), dummy rows never touch a
    real row, and each sequence keeps its own key (``fold_in(key, b)``). Near a
    model's ``max_position_embeddings`` (or ``max_length=``) the padding
    shrinks to fit; the request itself is never cut. The prompts are
    prefilled in blocks of ``PREFILL_BLOCK`` (16) tokens (one prompt alone:
    64), so even in bfloat16 a sequence's tokens do not depend on the width
    bucket its batch falls in.

    Powers of two keep the count logarithmic (widths 3..90 with
    ``max_new_tokens <= 16``: four programs per batch bucket) for at most twice
    the cache length; the prefill skips the width's padding blocks, so its
    work follows the batch's longest prompt (rounded up to a block).
    Measured on the embedded pair against the unbucketed engine in one run
    (CPU, float32, 24-token prompts, K=4, calls of 6-75 ms; before the prefill
    skipped padding): 0-6% slower when ``max_new_tokens`` is a bucket (64);
    15-30% when it is not (40 -> 64: a 1.5x longer cache to attend over, and
    about 1 ms to cut the output on the host). A server with one fixed
    ``max_new_tokens`` should pass ``Buckets(new_tokens=max_new_tokens)``: the
    ladder then starts at its own length (40, 80, 160, ...), and that case ran
    within 10% of the unbucketed engine (the prompt still pads 24 -> 32).
    """

    prompt: int = 16
    new_tokens: int = 16
    batch: bool = True
    verify: Optional[int] = 2


# The default of ``decode`` and ``generate``; ``buckets=None`` compiles the exact shapes.
BUCKETS = Buckets()


def bucket_of(n: int, smallest: int) -> int:
    """The smallest ``smallest * 2**i`` that is ``>= n``."""
    size = smallest
    while size < n:
        size *= 2
    return size


def _batch_bucket(n: int, multiple: int) -> int:
    """1, 2, 4, 8, then multiples of 8 (at most 7 dummy rows past 8). On a mesh
    the bucket must stay divisible by its ``'data'`` axis, else ``n`` is kept."""
    size = bucket_of(n, 1) if n <= 8 else -(-n // 8) * 8
    return size if size % multiple == 0 else n


def _check_buckets(buckets) -> Optional[Buckets]:
    if buckets is None:
        return None
    if not isinstance(buckets, Buckets):
        raise TypeError(f"buckets must be a specjax Buckets(...) or None, got {type(buckets).__name__}.")
    for name in ("prompt", "new_tokens"):
        check_positive_int(f"Buckets.{name}", getattr(buckets, name))
    if buckets.verify is not None:
        check_positive_int("Buckets.verify", buckets.verify)
    return buckets


# auto()'s verification widths are every count up to this many tokens (verify_widths_for).
AUTO_EXACT_WIDTHS = 8


def verify_widths_for(buckets: Optional[Buckets], drafting, num_draft: int) -> Optional[tuple[int, ...]]:
    """The widths a chain's verification forward may run at (``None``: only
    ``K + 1``). The forward's cost grows with its width wherever it is not
    free: on a CPU a 4-token forward of SmolLM2-135M costs 1.2-2x a 1-token
    one, and on an accelerator the batch's rows add up. So a cycle whose
    drafting stopped early verifies only what was drafted.

    ``auto()`` verifies each draft length ``k`` at exactly ``k + 1`` tokens
    up to :data:`AUTO_EXACT_WIDTHS` (then at doubling widths): it chooses
    ``k`` by what verifying ``k + 1`` tokens costs, and a power-of-two bucket
    would make a 2-draft cycle verify 4 tokens, paying for one it did not
    draft (a tenth of a forward on the GGUF's 4-bit target on a 2-core CPU,
    where each token of a verification adds 0.07-0.10 of one). A width is
    one more branch of the compiled cycle, so four widths instead of three at
    the default cap of 3."""
    if buckets is None or buckets.verify is None:
        return None
    cap = _draft_cap(drafting, num_draft)
    if type(drafting) is drafting_lib.Fixed:  # every cycle drafts the same count: one static width
        return None if cap == num_draft else (cap + 1,)
    # A block holds the last token and at least one draft, unless the policy may draft none.
    widths, w = ([1] if drafting.may_draft_none else []), max(2, buckets.verify)
    if type(drafting) is drafting_lib.Auto and w <= AUTO_EXACT_WIDTHS:
        widths += list(range(w, min(cap + 1, AUTO_EXACT_WIDTHS + 1)))
        w = 2 * AUTO_EXACT_WIDTHS
    while w < cap + 1:
        widths.append(w)
        w *= 2
    widths.append(cap + 1)
    return None if widths == [num_draft + 1] else tuple(widths)


def tree_size_widths(tree) -> tuple[int, ...]:
    """The widths a dynamic tree's verification runs at when :func:`specjax.drafting.auto`
    chooses its size: ``n + 1`` for ``n`` = 0 (a plain step), 1, 2, 4, ... and the tree's
    ``num_nodes`` (its best-ranked ``n`` draft nodes and the root). Powers of two keep the
    compiled branches few (five for ``num_nodes=12``) where every width is one more forward
    in the cycle's program."""
    counts, n = [0], 1
    while n < tree.num_kept:
        counts.append(n)
        n *= 2
    counts.append(tree.num_kept)
    return tuple(c + 1 for c in counts)


def _names_rule(spec, name: str) -> bool:
    """Whether the rule spec ``spec`` is, or holds, a rule called ``name``."""
    if isinstance(spec, RuleSpec):  # a NamedTuple: before the plain tuples
        return spec.name == name or any(_names_rule(v, name) for _, v in spec.params)
    return isinstance(spec, (tuple, list)) and any(_names_rule(v, name) for v in spec)


def _draft_cap(drafting, num_draft: int) -> int:
    """The most drafts ``drafting`` can propose in a cycle, as far as its type
    says: ``fixed(k)``'s ``k``, the smallest cap inside ``combine(...)`` (its
    budget is the smallest), else ``num_draft``. Exact types only: a subclass
    may override ``budget``."""
    if type(drafting) is drafting_lib.Fixed:
        return num_draft if drafting.k is None else min(drafting.k, num_draft)
    if type(drafting) is drafting_lib.Combine:
        return min(_draft_cap(p, num_draft) for p in drafting.policies)
    return num_draft


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
    wp, nw = bucket_of(width, buckets.prompt), bucket_of(new_tokens, buckets.new_tokens)
    if limit is not None:
        nw = max(new_tokens, min(nw, limit - wp - extra))
        wp = max(width, min(wp, limit - nw - extra))
    return wp, nw


# ---------------------------------------------------------------------------
# One call, validated and padded: what decode and generate share
# ---------------------------------------------------------------------------


class PreparedCall(NamedTuple):
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
    cfg: LoopConfig  # rule, drafting, diagnostics and hidden layers left for decode to set
    models: dict  # the models, placed on the mesh if there is one
    batch: int  # B: rows to keep
    new_tokens: int  # N: columns to keep
    record: tuple  # (key, seed) recorded on the output


def prepare_call(
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
) -> PreparedCall:
    """The argument preparation ``decode`` and ``generate`` share (all before tracing).

    ``models``: ``{"target": Model, "draft": Model}`` (draft optional);
    ``extra``: cache positions past ``P + N`` (``num_draft`` for decode).
    """
    _check_common(temperature, top_k, top_p, max_new_tokens)
    pad_id = _check_pad_id(pad_token_id)
    buckets = _check_buckets(buckets)
    greedy = float(temperature) == 0.0
    new_tokens = int(max_new_tokens)
    prompts, lengths = prepare_prompts(prompt_ids, prompt_lengths, vocab)
    # A padded array wider than its longest prompt is bucketed by the real width.
    prompts = prompts[:, : int(lengths.max())]
    batch, width = prompts.shape
    eos = resolve_eos_ids(eos_token_id, vocab, models["target"].module)
    if jax.process_count() > 1:
        _check_same_inputs(what, prompts, lengths, new_tokens, extra, temperature, top_k, top_p, eos, pad_id, key)
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
    cfg = LoopConfig(
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
        eos_ids = replicated(layout, eos_ids)
        cfg = cfg._replace(layout=layout)
    return PreparedCall(
        padded_prompts, padded_lengths, max_new, eos_ids, pad, key, temp, top_p_value, cfg=cfg, models=placed,
        batch=batch, new_tokens=new_tokens, record=(recorded_key, seed),
    )


def _check_same_inputs(what: str, prompts, lengths, *settings) -> None:
    """Every process of a multi-host job must pass the same global batch and
    settings (each builds its shards of the same global arrays from them)."""
    *settings, key = settings
    parts = [prompts, lengths, *(None if x is None else np.asarray(x) for x in settings), _key_digest(key)]
    multihost.check_same_on_every_process(what.split(" (")[0], parts)


def _key_digest(key):
    """A host copy of ``key``'s data to compare across processes (its type where it has none)."""
    if key is None or not hasattr(key, "dtype") or not getattr(key, "is_fully_addressable", True):
        return repr(type(key))
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.asarray(key)


def _eos_array(eos: tuple[int, ...]) -> np.ndarray:
    """EOS ids as an ``int32 [E]`` operand, ``E`` in 4, 8, 16, ... and ``-1``
    (no token) filling the rest: the ids are traced, only ``E`` shapes the program."""
    out = np.full((bucket_of(max(len(eos), 1), 4),), -1, np.int32)
    out[: len(eos)] = eos
    return out


def replicated(layout, x) -> Array:
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


# ---------------------------------------------------------------------------
# decode's own arguments
# ---------------------------------------------------------------------------


def check_decode_args(params, rule, drafting, num_draft) -> tuple[AcceptanceRule, Any, int]:
    """``decode``'s own arguments (the ones ``generate`` lacks): the pair, the
    rule and the drafting policy (defaults filled in) and ``num_draft``."""
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
    num_draft = 4 if num_draft is None else check_positive_int("num_draft (K)", num_draft)
    fixed_k = drafting_lib.max_fixed_k(drafting)
    if fixed_k is not None and fixed_k > num_draft:
        raise ValueError(
            f"drafting fixed(k={fixed_k}) exceeds num_draft={num_draft}; pass num_draft={fixed_k}."
        )
    return rule, drafting, num_draft


def check_tree(tree, params, rule, drafting, num_draft):
    """``decode(tree=...)``'s preconditions; returns the tree's depth (its ``K``)."""
    dynamic = isinstance(tree, trees_lib.DynamicTree)
    if not isinstance(tree, trees_lib.TokenTree) and not dynamic:
        raise TypeError(f"tree must be a TokenTree (e.g. specjax.trees.static_tree((4, 2, 1))) or a DynamicTree "
                        f"(specjax.trees.dynamic_tree(depth, top_k, num_nodes)), got {type(tree).__name__}.")
    if dynamic:
        # A hand-built DynamicTree gets dynamic_tree's checks (positive ints, num_nodes <= candidates).
        trees_lib.dynamic_tree(tree.depth, tree.top_k, tree.num_kept, sampled=tree.sampled)
        if tree.top_k > params.vocab_size:
            raise ValueError(f"dynamic_tree: top_k={tree.top_k} exceeds the vocabulary ({params.vocab_size} tokens).")
    else:
        _check_tree_parents(tree)
        if tree.num_nodes < 2:
            raise ValueError("tree has no draft nodes: give it at least one level, e.g. static_tree((2,)).")
    for name, model in (("target", params.target), ("draft", params.draft)):
        if not getattr(model.module, "supports_trees", False):
            raise ValueError(f"tree decoding needs tree attention, which the {name} model "
                             f"({type(model.module).__name__}) does not implement (supports_trees); "
                             "decode it with chains (no tree=).")
    if type(drafting) is drafting_lib.Auto:
        if not dynamic:
            raise ValueError("drafting.auto() chooses how many of a dynamic tree's nodes to verify each cycle; a "
                             "static tree's shape is fixed. Use specjax.trees.dynamic_tree(depth, top_k, num_nodes), "
                             "or leave drafting unset.")
    elif not isinstance(drafting, drafting_lib.Fixed) or drafting.k is not None:
        raise ValueError("with tree=, the tree's shape decides what is drafted: leave drafting unset, or give "
                         "drafting.auto() with a dynamic tree to choose its size each cycle.")
    if _names_rule(rule.spec, "fly"):
        # FLy's window reads the slots after a mismatch as one chain; a tree's block is its nodes in
        # breadth-first order, so the window would read nodes that are not descendants.
        raise ValueError("fly() judges a chain of drafts (its window reads the following slots); decode it "
                         "with chains (no tree=).")
    if num_draft is not None and num_draft != tree.max_depth:
        raise ValueError(f"num_draft={num_draft} but the tree's depth is {tree.max_depth}: leave num_draft "
                         "unset with tree= (the depth is the most tokens a cycle accepts).")
    if not dynamic:
        widest = max(trees_lib.uniform_branching(tree))  # raises for shapes the drafter cannot grow
        if widest > params.vocab_size:  # a node's children are distinct tokens
            raise ValueError(f"tree: a node has {widest} children, more than the vocabulary's "
                             f"{params.vocab_size} tokens; give every node at most {params.vocab_size}.")
    return tree.max_depth


def _check_tree_parents(tree) -> None:
    """A hand-built ``TokenTree``: breadth-first parents, the root first."""
    parents = tree.parents
    if not isinstance(parents, tuple) or not all(isinstance(p, int) and not isinstance(p, bool) for p in parents):
        raise TypeError(f"TokenTree.parents must be a tuple of ints (a jit static), got {parents!r}.")
    bad = [j for j, p in enumerate(parents) if not (p == -1 if j == 0 else 0 <= p < j)]
    if not parents or bad:
        raise ValueError(
            f"TokenTree.parents {parents} must start with -1 (the root) and give every later node j a "
            f"parent in 0..j-1 (breadth-first order); node(s) {bad} do not. Build trees with "
            "specjax.trees.static_tree(branching)."
        )


def check_diagnostics(diagnostics) -> None:
    if diagnostics is not None and not callable(diagnostics):
        raise TypeError(f"diagnostics must be a function (inputs, verdict, num_accepted) -> dict, got "
                        f"{type(diagnostics).__name__}.")


# ---------------------------------------------------------------------------
# After the loop
# ---------------------------------------------------------------------------


def finish_call(call: PreparedCall, out: DecodeOutput, bad, which: dict[int, str]) -> DecodeOutput:
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
            out = jax.tree_util.tree_map(functools.partial(replicated, layout), out)
    out = out.replace(key=call.record[0], seed=call.record[1])
    _raise_if_bad(bad, out, which)
    return out


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
