"""What every piece of the decode loop shares: its static config and its state.

:class:`_Config` is the loop's compile-time settings (a ``jit`` static),
built by the argument preparation (:mod:`specjax._src.engine.prepare`);
:class:`_DecodeState` is the carry of the draft-verify ``while_loop``, built
by :func:`specjax._src.engine.chain._initial_state` and advanced by either
cycle (:mod:`specjax._src.engine.chain`, :mod:`specjax._src.engine.tree`).
They live apart from all of those so that each imports them from here, below
itself, instead of from a sibling.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
from flax import struct

from specjax._src import sharding as sharding_lib
from specjax._src.lm import KVCache
from specjax._src.stats import DecodeStats

Array = jax.Array


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
    # (:func:`specjax._src.engine.streaming._report`). False compiles the program
    # without any callback.
    stream: bool = False
    # ``decode(tree=...)``: a static TokenTree; ``num_draft`` is then its depth.
    tree: Optional[Any] = None
    # ``decode(lookup=...)``: a static NgramLookup (drafts copied from the context).
    lookup: Optional[Any] = None
    # The widths a chain's verification block may run at
    # (:func:`specjax._src.engine.prepare._verify_widths`), ascending, the last
    # ``num_draft + 1``; ``None``: always the full block.
    verify_widths: Optional[tuple[int, ...]] = None
    # The rule's and drafting policy's pytree classes (:func:`specjax._src.jit_keys.pytree_classes`):
    # without them jit may run one rule's program for another rule with the same fields.
    classes: tuple = ()


@struct.dataclass
class _DecodeState:
    """The carry of ``decode``'s ``while_loop``, per sequence ``b`` (the
    invariants of its caches are in :mod:`specjax._src.engine.loop`)."""

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
    # A feature head's pending inputs: the target's features of the last
    # verified block, [B, K + 1, H] (None for a draft model; see cycle.first_head_logits).
    draft_features: Any = None
    # The committed tokens' log-probabilities beside ``tokens`` (:class:`_Logprobs`; the slots
    # engine's ``logprobs=``), or None: then no cycle computes them.
    logprobs: Any = None


@struct.dataclass
class _Logprobs:
    """Log-probabilities aligned with ``_DecodeState.tokens [B, L]``: entry ``[b, i]`` is
    that of the token at position ``i`` under the target's sampling distribution there
    (:func:`specjax._src.engine.cycle.block_logprobs`); prompt positions hold zeros."""

    chosen: Array  # [B, L] float32: the token's own
    top_ids: Array  # [B, L, N] int32: the N most likely tokens, most likely first
    top_logprobs: Array  # [B, L, N] float32: theirs
