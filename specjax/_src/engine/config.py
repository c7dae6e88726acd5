"""What every piece of the decode loop shares: its static config and its state.

:class:`LoopConfig` is the loop's compile-time settings (a ``jit`` static),
built by the argument preparation (:mod:`specjax._src.engine.prepare`) or by
hand; :class:`DecodeState` is the carry of the draft-verify ``while_loop``,
built by :func:`specjax._src.engine.state.init_state` and advanced by a cycle
(:mod:`specjax._src.engine.chain`, :mod:`specjax._src.engine.tree`,
:mod:`specjax._src.engine.target_only`); :class:`Logprobs` the committed
tokens' log-probabilities beside its tokens. They live apart from all of
those so that each imports them from here, below itself, instead of from a
sibling. All three are public: ``specjax.engine`` exports them.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
from flax import struct

from specjax._src.models import sharding as sharding_lib
from specjax._src.models.lm import KVCache
from specjax._src.engine.stats import DecodeStats

Array = jax.Array


class LoopConfig(NamedTuple):
    """The compile-time settings of one loop (a ``jit`` static: hashable, and
    a new value compiles a new program). The rule and the drafting policy are
    not here: they are pytree arguments, whose static fields are part of the
    program's key and whose numbers are traced.

    ``B`` below is the batch, ``K`` ``num_draft``, ``N`` ``max_new_tokens``.
    """

    # ``decode(diagnostics=fn)``: hashed by identity, so pass one function
    # object (not a fresh lambda per call) to reuse the compiled loop.
    diagnostics: Optional[Callable]
    num_draft: int  # K: the most drafts per cycle (a tree's depth; 0 for target-only decoding)
    max_new_tokens: int  # N: the token buffer's room for new tokens (each sequence's own budget is traced)
    cache_length: int  # C: positions each KV cache holds
    greedy: bool  # temperature 0: argmax, no randomness drawn
    top_k: Optional[int]  # the call's top-k filter, or None
    use_top_p: bool  # whether the top-p filter runs (its value is traced)
    layout: Optional[sharding_lib.DecodeLayout] = None  # set when running on a mesh
    # ``on_tokens=`` given: the loop reports each cycle's tokens to the host
    # (:func:`specjax._src.engine.streaming.report_tokens`). False compiles the program
    # without any callback.
    stream: bool = False
    # ``decode(tree=...)``: a static TokenTree; ``num_draft`` is then its depth.
    tree: Optional[Any] = None
    # ``decode(lookup=...)``: a static NgramLookup (drafts copied from the context).
    lookup: Optional[Any] = None
    # The widths a chain's verification block may run at
    # (:func:`specjax._src.engine.prepare.verify_widths_for`), ascending, the last
    # ``num_draft + 1``; ``None``: always the full block. With auto() on a dynamic tree,
    # the widths its verification chooses from (:func:`specjax._src.engine.prepare.tree_size_widths`).
    verify_widths: Optional[tuple[int, ...]] = None
    # The rule's and drafting policy's pytree classes (:func:`specjax._src.foundation.jit_keys.pytree_classes`):
    # without them jit may run one rule's program for another rule with the same fields.
    classes: tuple = ()


def policy_slots(cfg: LoopConfig) -> int:
    """How many slots a drafting policy's state keeps evidence for: a dynamic tree's
    verified nodes (by rank), else the chain's ``K`` draft slots."""
    num_kept = getattr(cfg.tree, "num_kept", None)
    return cfg.num_draft if num_kept is None else num_kept


@struct.dataclass
class DecodeState:
    """The carry of the draft-verify ``while_loop``, per sequence ``b`` (the
    invariants of its caches are in :mod:`specjax._src.engine.loop`).
    ``L = P + N + K + 1``: the padded prompt width, the new tokens' buffer
    and one cycle's block."""

    step: Array  # scalar int32: cycles run (the slots engine: [B], each slot's own)
    tokens: Array  # [B, L] int32: prompt and committed tokens, in place
    num_committed: Array  # [B] int32: valid entries of ``tokens``
    done: Array  # [B] bool: EOS, max_new_tokens or non-finite logits
    bad: Array  # [B] int32: 0 ok, 1 target logits non-finite, 2 draft logits non-finite
    target_cache: KVCache  # lengths num_committed - 1
    draft_cache: Optional[KVCache]  # lengths max(num_committed - 2, 0); None without a draft
    rule_state: Any  # the rule's per-sequence state ([B]-leading pytree), or None
    policy_state: Any  # the drafting policy's, or None
    stats: DecodeStats  # [B] counters (``[B, K]`` per slot)
    # A feature head's pending inputs: the target's features of the last
    # verified block, [B, K + 1, H] (None for a draft model; see cycle.first_head_logits).
    draft_features: Any = None
    # The committed tokens' log-probabilities beside ``tokens`` (:class:`Logprobs`; the slots
    # engine's ``logprobs=``), or None: then no cycle computes them.
    logprobs: Any = None


@struct.dataclass
class Logprobs:
    """Log-probabilities aligned with ``DecodeState.tokens [B, L]``: entry ``[b, i]`` is
    that of the token at position ``i`` under the target's sampling distribution there
    (:func:`specjax._src.engine.cycle.commit_logprobs`); prompt positions hold zeros.
    ``A``: the alternatives kept per position (the slots engine's ``logprobs=``)."""

    chosen: Array  # [B, L] float32: the token's own
    top_ids: Array  # [B, L, A] int32: the A most likely tokens, most likely first
    top_logprobs: Array  # [B, L, A] float32: theirs
