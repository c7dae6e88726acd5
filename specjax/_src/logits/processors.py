"""Logits processors: per-sequence generation controls as pure functions of logits.

A processor maps one sequence's raw next-token logits ``[V]`` and what it
knows of the sequence so far (:class:`TokenContext`) to new logits ``[V]``.
The built-ins read their numbers from :class:`Controls`, per-sequence arrays
that are traced (a new penalty compiles nothing):

* :func:`logit_bias`: adds a bias to chosen tokens (OpenAI's ``logit_bias``);
* :func:`repetition_penalty`: divides the positive logits (multiplies the
  negative ones) of tokens seen in the prompt or the output by ``r``
  ("CTRL: A Conditional Transformer Language Model for Controllable
  Generation", arXiv:1909.05858; transformers' and vLLM's semantics);
* :func:`presence_frequency_penalty`: subtracts ``presence`` from every token
  generated at least once and ``frequency`` times its count (OpenAI's);
* :func:`min_new_tokens`: the EOS and stop ids get ``-inf`` until
  ``min_new_tokens`` tokens were generated.

Speculative decoding applies the same processors to the target's and the
draft's logits at every position, before the temperature / top-k / top-p
warp, each with the tokens before that position (committed ones and the
cycle's own drafts: on a token tree, the drafts on the node's path from the
root). The processed target is then the distribution the user
asked for, and the lossless rule is exactly lossless with respect to it:
the rule only needs ``p`` and ``q`` to be the distributions the two models
are sampled from, whatever produced them.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

Array = jax.Array

# OpenAI's ranges: presence / frequency in [-2, 2], a bias in [-100, 100].
MAX_PENALTY = 2.0
# The repetition penalty divides (or multiplies) logits: far from 1, float32 logits overflow to
# inf and the distribution turns to NaN, so it is kept to a range where any logit stays finite.
REPETITION_PENALTY_RANGE = (1e-3, 1e3)
MAX_BIAS = 100.0


@struct.dataclass
class Controls:
    """Per-sequence numbers of the built-in processors (leading axis ``[B]``).

    Attributes:
      repetition_penalty: ``[B]`` float32, ``> 0``; 1 is off.
      presence_penalty: ``[B]`` float32 in [-2, 2]; 0 is off.
      frequency_penalty: ``[B]`` float32 in [-2, 2]; 0 is off.
      min_new_tokens: ``[B]`` int32 ``>= 0``.
      bias_ids: ``[B, NB]`` int32 token ids, ``-1`` for an unused entry.
      bias_values: ``[B, NB]`` float32.
    """

    repetition_penalty: Array
    presence_penalty: Array
    frequency_penalty: Array
    min_new_tokens: Array
    bias_ids: Array
    bias_values: Array


class TokenContext(NamedTuple):
    """What a processor reads about one sequence at one position."""

    counts: Array  # [V] float32: how often each token was generated before this position
    seen: Array  # [V] bool: the token occurs in the prompt or before this position
    num_generated: Array  # int32: tokens generated before this position
    eos_ids: Array  # [E] int32 EOS and stop ids (-1: none)
    controls: Controls  # this sequence's numbers (no batch axis)


# A processor: (logits [V] float32, TokenContext) -> logits [V] float32, pure and traceable.
LogitsProcessor = Callable[[Array, TokenContext], Array]


def logit_bias(logits: Array, ctx: TokenContext) -> Array:
    """Adds ``controls.bias_values`` to the logits of ``controls.bias_ids`` (``-1``: unused)."""
    ids, values = ctx.controls.bias_ids, ctx.controls.bias_values
    valid = ids >= 0
    return logits.at[jnp.where(valid, ids, 0)].add(jnp.where(valid, values, 0.0))


def repetition_penalty(logits: Array, ctx: TokenContext) -> Array:
    """Tokens seen in the prompt or the output: a positive logit divided by ``r``, a negative one times ``r``."""
    r = ctx.controls.repetition_penalty
    penalised = jnp.where(logits > 0, logits / r, logits * r)
    return jnp.where(ctx.seen, penalised, logits)


def presence_frequency_penalty(logits: Array, ctx: TokenContext) -> Array:
    """Subtracts ``presence`` once from each generated token and ``frequency`` per occurrence."""
    c = ctx.controls
    return logits - c.presence_penalty * (ctx.counts > 0) - c.frequency_penalty * ctx.counts


def min_new_tokens(logits: Array, ctx: TokenContext) -> Array:
    """EOS and stop ids to ``-inf`` while fewer than ``min_new_tokens`` tokens were generated."""
    early = ctx.num_generated < ctx.controls.min_new_tokens
    is_end = (jnp.arange(logits.shape[-1])[:, None] == ctx.eos_ids[None, :]).any(-1)
    return jnp.where(early & is_end, -jnp.inf, logits)


# The order transformers and vLLM use: bias, then penalties, then the EOS mask.
BUILTIN_PROCESSORS: tuple[LogitsProcessor, ...] = (
    logit_bias, repetition_penalty, presence_frequency_penalty, min_new_tokens,
)


# ---------------------------------------------------------------------------
# Applying them inside the loop
# ---------------------------------------------------------------------------


class History(NamedTuple):
    """Every sequence's tokens before the current cycle, as counts (``[B]``-batched)."""

    counts: Array  # [B, V] float32: generated tokens
    seen: Array  # [B, V] bool: prompt and generated tokens
    num_generated: Array  # [B] int32
    eos_ids: Array  # [B, E] int32
    # Scalar bool: some row's logits change in this cycle (:func:`changes_logits`); where it is
    # False, ``counts`` and ``seen`` are zeros and :func:`process` returns the logits as they are.
    # None: always processed.
    active: Any = None


def changes_logits(processors, controls: Controls, num_generated: Array, live: Array) -> Optional[Array]:
    """Scalar bool: the built-in processors change some live row's logits in
    a cycle that starts after ``num_generated [B]`` tokens (a control off its
    default; for ``min_new_tokens``, a row still short of it). None when ``processors``
    holds others than the built-ins, whose effect cannot be told: they always run.

    A batch of requests at their defaults (the common case) thus skips the
    vocabulary-sized counts and scatters of :func:`history` and :func:`process`."""
    if not set(processors) <= set(BUILTIN_PROCESSORS):
        return None
    return (rows_with_controls(controls, num_generated) & live).any()


def rows_with_controls(c: Controls, num_generated=0):
    """``[B]`` bool: the rows whose built-in controls change their logits after
    ``num_generated`` tokens (a control off its default; ``min_new_tokens`` while a
    row is short of it, so with 0: while it is set). JAX or NumPy arrays alike: the
    slots engine asks it on the host to choose a step's program."""
    return ((c.repetition_penalty != 1.0) | (c.presence_penalty != 0.0) | (c.frequency_penalty != 0.0)
            | (c.min_new_tokens > num_generated) | (c.bias_ids >= 0).any(-1))


def history(tokens: Array, prompt_lengths: Array, num_committed: Array, eos_ids: Array, vocab: int,
            active: Optional[Array] = None) -> History:
    """Counts of ``tokens[b, :num_committed[b]]`` (``[B, L]``), split at the prompt
    (computed only where ``active``, a scalar bool, holds; None: always)."""
    batch, length = tokens.shape

    def count(tokens):
        pos = jnp.arange(length)[None, :]
        rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, length))
        ids = jnp.clip(tokens, 0, vocab - 1)
        before = pos < num_committed[:, None]
        generated = before & (pos >= prompt_lengths[:, None])
        counts = jnp.zeros((batch, vocab), jnp.float32).at[rows, ids].add(generated.astype(jnp.float32))
        seen = jnp.zeros((batch, vocab), jnp.float32).at[rows, ids].add(before.astype(jnp.float32)) > 0
        return counts, seen

    if active is None:
        counts, seen = count(tokens)
    else:
        nothing = lambda _: (jnp.zeros((batch, vocab), jnp.float32), jnp.zeros((batch, vocab), bool))  # noqa: E731
        counts, seen = jax.lax.cond(active, count, nothing, tokens)
    eos = jnp.broadcast_to(eos_ids, (batch, eos_ids.shape[-1])) if eos_ids.ndim == 1 else eos_ids
    return History(counts, seen, num_committed - prompt_lengths, eos, active)


def process(processors, controls: Controls, hist: History, logits: Array, block: Array, offset: Array) -> Array:
    """Applies ``processors`` to a block of positions on a chain.

    Args:
      logits: ``[B, T, V]`` raw logits; row ``t`` predicts the token after
        ``t`` more tokens than ``hist`` holds.
      block: ``[B, T']`` the tokens that follow ``hist`` (this cycle's drafts);
        row ``t`` sees the first ``t + offset`` of them.
      offset: int, how many of ``block`` row ``t = 0`` already sees.

    Returns:
      ``[B, T, V]`` float32 processed logits.
    """
    upto = jnp.arange(logits.shape[1])[:, None] + offset  # [T, 1]: block tokens seen by row t
    follows = jnp.arange(block.shape[1])[None, :] < upto  # [T, T']
    return process_paths(processors, controls, hist, logits, block, follows[None])


def process_paths(processors, controls: Controls, hist: History, logits: Array, block: Array,
                  follows: Array) -> Array:
    """Applies ``processors`` to positions that each follow their own subset of
    ``block``: a chain's prefixes, or a token tree's root-to-node paths.

    Args:
      logits: ``[B, T, V]`` raw logits.
      block: ``[B, K]`` the tokens drafted after ``hist``.
      follows: ``[B or 1, T, K]`` bool, row ``t`` comes after ``block[:, k]``
        (the tokens its history holds beyond ``hist``).

    Returns:
      ``[B, T, V]`` float32 processed logits.
    """
    if hist.active is not None:
        return jax.lax.cond(hist.active, lambda x: process_paths(processors, controls, hist._replace(active=None),
                                                                 x, block, follows),
                            lambda x: x.astype(jnp.float32), logits)
    vocab = logits.shape[-1]
    onehot = jax.nn.one_hot(block, vocab, dtype=jnp.float32)  # [B, K, V]
    mask = follows.astype(jnp.float32)
    extra = jnp.einsum("btk,bkv->btv", jnp.broadcast_to(mask, (block.shape[0],) + mask.shape[1:]), onehot)
    counts = hist.counts[:, None, :] + extra
    seen = hist.seen[:, None, :] | (extra > 0)
    generated = hist.num_generated[:, None] + follows.sum(-1).astype(jnp.int32)  # [B, T]

    def one(lg, c, s, n, eos, ctl):
        ctx = TokenContext(counts=c, seen=s, num_generated=n, eos_ids=eos, controls=ctl)
        for fn in processors:
            lg = fn(lg, ctx)
        return lg

    per_position = jax.vmap(one, in_axes=(0, 0, 0, 0, None, None))
    return jax.vmap(per_position)(logits.astype(jnp.float32), counts, seen, generated, hist.eos_ids, controls)


# ---------------------------------------------------------------------------
# Host side: one request's controls, checked
# ---------------------------------------------------------------------------


@struct.dataclass
class GenerationControls:
    """One request's generation controls (host values, checked by ``check_controls``).

    Attributes:
      repetition_penalty: in ``[1e-3, 1e3]``; 1 (default) is off, above 1 discourages
        tokens already in the prompt or the output.
      presence_penalty: in [-2, 2], subtracted once from every generated token.
      frequency_penalty: in [-2, 2], subtracted per occurrence.
      logit_bias: ``{token_id: bias}``, bias in [-100, 100] added to the logits.
      min_new_tokens: EOS and stop ids are blocked until this many tokens were generated.
    """

    repetition_penalty: float = struct.field(pytree_node=False, default=1.0)
    presence_penalty: float = struct.field(pytree_node=False, default=0.0)
    frequency_penalty: float = struct.field(pytree_node=False, default=0.0)
    logit_bias: Optional[dict] = struct.field(pytree_node=False, default=None)
    min_new_tokens: int = struct.field(pytree_node=False, default=0)


def check_controls(controls: Optional[GenerationControls], vocab: int, where: str = "controls") -> GenerationControls:
    """Raises ``ValueError`` / ``TypeError`` naming the field; returns the controls (defaults for None)."""
    if controls is None:
        return GenerationControls()
    if not isinstance(controls, GenerationControls):
        raise TypeError(f"{where} must be specjax.GenerationControls(...), got {type(controls).__name__}.")
    r = _number(f"{where}.repetition_penalty", controls.repetition_penalty)
    low, high = REPETITION_PENALTY_RANGE
    if not r > 0:
        raise ValueError(f"{where}.repetition_penalty must be > 0 (1 is off, above 1 penalises repeats), got {r}.")
    if not low <= r <= high:
        raise ValueError(f"{where}.repetition_penalty must be in [{low:g}, {high:g}] (1 is off, above 1 penalises "
                         f"repeats; further from 1, float32 logits overflow), got {r}.")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(f"{where}.{name}", getattr(controls, name))
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ValueError(f"{where}.{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}.")
    n = controls.min_new_tokens
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"{where}.min_new_tokens must be an integer >= 0, got {n!r}.")
    bias = controls.logit_bias or {}
    if not isinstance(bias, dict):
        raise TypeError(f"{where}.logit_bias must be a dict {{token_id: bias}}, got {type(bias).__name__}.")
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < vocab:
            raise ValueError(f"{where}.logit_bias: token id {token!r} is not in the vocabulary [0, {vocab}).")
        v = _number(f"{where}.logit_bias[{token}]", value)
        if not -MAX_BIAS <= v <= MAX_BIAS:
            raise ValueError(f"{where}.logit_bias[{token}] must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {v}.")
    return controls


def _number(name: str, value) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r}.")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}.") from None
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}.")
    return out


def controls_rows(controls: list[GenerationControls], num_bias: int) -> dict[str, np.ndarray]:
    """Host arrays of :class:`Controls`' fields for checked controls, ``NB = num_bias``."""
    b = len(controls)
    ids = np.full((b, num_bias), -1, np.int32)
    values = np.zeros((b, num_bias), np.float32)
    for i, c in enumerate(controls):
        items = sorted((c.logit_bias or {}).items())
        if len(items) > num_bias:
            raise ValueError(f"logit_bias has {len(items)} entries; at most {num_bias} fit (raise max_bias).")
        for j, (token, value) in enumerate(items):
            ids[i, j], values[i, j] = int(token), float(value)
    return dict(
        repetition_penalty=np.array([c.repetition_penalty for c in controls], np.float32),
        presence_penalty=np.array([c.presence_penalty for c in controls], np.float32),
        frequency_penalty=np.array([c.frequency_penalty for c in controls], np.float32),
        min_new_tokens=np.array([c.min_new_tokens for c in controls], np.int32),
        bias_ids=ids,
        bias_values=values,
    )


def bias_bucket(controls: list[GenerationControls]) -> int:
    """Bias entries per row: 4, 8, 16, ... (one program per bucket)."""
    most = max((len(c.logit_bias or {}) for c in controls), default=0)
    n = 4
    while n < most:
        n *= 2
    return n


def is_default(c: GenerationControls) -> bool:
    return (c.repetition_penalty == 1.0 and c.presence_penalty == 0.0 and c.frequency_penalty == 0.0
            and not c.logit_bias and c.min_new_tokens == 0)


# ---------------------------------------------------------------------------
# The per-row settings the cycle reads
# ---------------------------------------------------------------------------


@struct.dataclass
class RowSettings:
    """Per-sequence settings of a loop, as traced arrays (``None``: the loop's static setting holds).

    Attributes:
      greedy: ``[B]`` bool, the rows decoded greedily (temperature 0), so
        greedy and sampled rows share one program.
      top_k: ``[B]`` int32, 0 for no top-k filter.
      draft_cap: ``[B]`` int32, the most drafts per cycle; 0 decodes the row
        one token per cycle (the bonus token alone).
      controls: :class:`Controls`, or None for no processing.
      rules: the acceptance rule with every numeric field ``[B]``-batched (one
        rule's numbers per sequence, of the loop's rule type), or None.
      logprobs: ``[B]`` int32, the alternatives each row's request asks for
        (-1: no log-probs, 0: the chosen token's only): the top-N over the
        vocabulary runs when a live row asks for more than 0.
      processors: the processors (static).
    """

    greedy: Any = None
    top_k: Any = None
    draft_cap: Any = None
    controls: Any = None
    rules: Any = None
    logprobs: Any = None
    processors: tuple = struct.field(pytree_node=False, default=BUILTIN_PROCESSORS)
