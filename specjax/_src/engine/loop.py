"""The engine: one jitted, batched draft-verify ``while_loop``.

``decode`` (and ``generate``, its target-only baseline, through the same
loop) runs the whole generation on device — prefill, then cycles of
(draft up to K tokens, verify them in one target forward, accept per sequence,
commit, roll the caches back by length) — inside one ``jax.lax.while_loop``
with fixed-size buffers. There is no host round trip per cycle (unless
``on_tokens=`` asks for streaming: see :mod:`specjax._src.engine.streaming`).

Shapes are bucketed (:class:`Buckets`): the batch, the prompt width and the
``max_new_tokens`` buffer are padded up to a few sizes so that mixed traffic
reuses a few compiled programs; each sequence's own ``max_new_tokens`` is a
traced value, dummy rows are finished from the start, and the output is cut
back on the host. The prefill runs in blocks of ``prefill_block(B)`` tokens so
that no matmul's shape depends on the padded width.

The prefill draws each sequence's first token from the target's logits at
its prompt's last position (:func:`~specjax._src.engine.state.init_state`
given the cycles' inputs): the first cycle drafts the second token.

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
* a feature head (:mod:`specjax.heads`, EAGLE-style) keeps a different
  invariant: its position ``i`` reads the target's feature ``f_i`` and token
  ``x_{i+1}``, and it holds only positions built from the target's own
  features, ``0 .. m - 1``. ``state.draft_features [B, K + 1, H]`` carries the
  target features of the last verified block (``f_m ..``); the next cycle's
  first draft step is one ``T = K + 1`` forward over them, read at the last
  committed token (``m = num_committed_before - 1``). Its own-feature draft
  positions are thus rewritten with the target's features, as EAGLE does.
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
pinned by ``with_sharding_constraint`` (``LoopConfig.layout``); XLA's SPMD
partitioner inserts the collectives. See :mod:`specjax._src.models.sharding`.

The code, by concern (this module holds only the two entry points and the
jitted loop both run, :func:`_run_loop`):

* :mod:`specjax._src.models.pairing`: :class:`ModelPair`, :func:`pair`, vocabulary checks;
* :mod:`specjax._src.engine.config`: the loop's static config (``LoopConfig``)
  and its state (``DecodeState``), which every other piece reads;
* :mod:`specjax._src.engine.prepare`: argument checks, :class:`Buckets`, the shared
  argument preparation (``prepare_call``), :class:`DecodeOutput` and the
  cut back after the loop (``finish_call``);
* :mod:`specjax._src.engine.state`: the prefills and the state before the first
  cycle (``init_state``);
* :mod:`specjax._src.engine.chain`: one chain cycle as five pure functions
  (draft, verify, accept, commit, record);
* :mod:`specjax._src.engine.tree`: one cycle over a token tree, the same five steps;
* :mod:`specjax._src.engine.plain`: the plain step ``auto()`` may choose inside
  either cycle, and the draft's catch-up after skipped cycles;
* :mod:`specjax._src.engine.target_only`: ``generate``'s cycle, one target token
  per cycle and no draft;
* :mod:`specjax._src.engine.cycle`: the cycle interface (``Cycle``,
  ``run_cycles``) and what the cycles are built from (the first draft step,
  the block commit, the state after a cycle);
* :mod:`specjax._src.engine.ops`: device helpers the cycles share (prefill,
  gathers, warp, EOS test, output slice, mesh pins);
* :mod:`specjax._src.engine.streaming`: the ``on_tokens`` callback plumbing.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.proposals import drafting as drafting_lib
from specjax._src.proposals import lookup as lookup_lib
from specjax._src.logits import processors as processors_lib
from specjax._src.engine import costs as costs_lib
from specjax._src.engine.config import DecodeState, LoopConfig
from specjax._src.engine.cycle import Cycle, CycleInputs, run_cycles
from specjax._src.engine.cycles import TARGET_ONLY, cycle_for
from specjax._src.engine.ops import constrain, extract, per_sequence_keys, replicate_outputs
from specjax._src.engine.prepare import (
    BUCKETS,
    MIN_TEMPERATURE,
    Buckets,
    DecodeOutput,
    check_decode_args,
    check_diagnostics,
    check_tree,
    finish_call,
    prepare_call,
    replicated,
    tree_size_widths,
    verify_widths_for,
)
from specjax._src.engine.state import init_state
from specjax._src.engine.streaming import check_on_tokens, report_tokens, run_streaming
from specjax._src.foundation.jit_keys import pytree_classes
from specjax._src.models.lm import Model
from specjax._src.models.pairing import ModelPair, model_vocab, pair
from specjax._src.rules.base import AcceptanceRule

# The public names (``specjax/__init__.py`` imports them from here).
__all__ = [
    "BUCKETS",
    "MIN_TEMPERATURE",
    "Buckets",
    "DecodeOutput",
    "ModelPair",
    "decode",
    "generate",
    "pair",
]

Array = jax.Array

# ---------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------


def _run_loop(
    cycle: Cycle, pair_params: ModelPair, rule, policy, prompts, prompt_lengths, max_new, eos_ids, pad_id, key,
    temperature, top_p, stream_id, *, cfg: LoopConfig, rows,
):
    """Prefill (:func:`init_state`), then ``cycle`` in one ``while_loop``
    (:func:`run_cycles`) until every sequence is done; returns ``(output,
    bad)``. The body of ``decode`` and of ``generate`` (:data:`TARGET_ONLY`,
    with a pair whose draft is None). ``rows``: the logits processors'
    per-sequence settings, or None."""
    batch = prompts.shape[0]
    k_max, n_max = cfg.num_draft, cfg.max_new_tokens
    seq_keys = per_sequence_keys(key, batch)
    inputs = CycleInputs(prompt_lengths, max_new, eos_ids, seq_keys, temperature, top_p, rows)
    state = init_state(cfg, pair_params, rule, policy, prompts, prompt_lengths, max_new, inputs)
    report_tokens(cfg, stream_id, state.tokens, prompt_lengths, state.num_committed, k_max + 1, pad_id)
    caches = tuple((field, which) for field, which in (("target_cache", "target"), ("draft_cache", "draft"))
                   if getattr(state, field) is not None)
    state = constrain(cfg, state, batch, caches)
    bound = cycle.bind(cfg, pair_params, rule, policy, inputs)
    if cfg.diagnostics is not None:
        shapes = jax.eval_shape(lambda s: bound(s)[1], state)
        extra = jax.tree_util.tree_map(lambda sd: jnp.zeros(sd.shape, sd.dtype), shapes)
        state = state.replace(stats=state.stats.replace(extra=extra))

    def until_done(s: DecodeState, _):
        return (~s.done.all()) & (s.step < n_max)

    def after_cycle(s: DecodeState, new: DecodeState, diag):
        if diag is not None:
            extra = jax.tree_util.tree_map(jnp.add, new.stats.extra, diag)
            new = new.replace(stats=new.stats.replace(extra=extra))
        report_tokens(cfg, stream_id, new.tokens, s.num_committed, new.num_committed, k_max + 1, pad_id)
        return constrain(cfg, new, batch, caches)

    state = run_cycles(bound, state, until_done, after_cycle)
    generated = state.num_committed - prompt_lengths
    out = DecodeOutput(
        tokens=extract(cfg, state.tokens, prompt_lengths, generated, pad_id),
        lengths=generated,
        stats=state.stats,
    )
    return replicate_outputs(cfg, (out, state.bad))


def _decode_impl(
    pair_params: ModelPair, rule: AcceptanceRule, policy: drafting_lib.DraftingPolicy, prompts, prompt_lengths,
    max_new, eos_ids, pad_id, key, temperature, top_p, stream_id=None, *, cfg: LoopConfig, rows=None,
):
    """The jitted body of ``decode``: :func:`_run_loop` with :func:`cycle_for`'s cycle."""
    return _run_loop(cycle_for(cfg), pair_params, rule, policy, prompts, prompt_lengths, max_new, eos_ids, pad_id,
                     key, temperature, top_p, stream_id, cfg=cfg, rows=rows)


_decode_jit = jax.jit(_decode_impl, static_argnames=("cfg",))


def _controls_rows(controls, vocab: int, batch: int, batch_pad: int, layout) -> Optional[processors_lib.RowSettings]:
    """``controls=`` (one :class:`GenerationControls` or one per prompt) as
    per-sequence arrays for the loop; None when every request has the defaults
    (the program is then the one without processors). On a mesh (``layout``)
    the arrays are replicated, as the rule's numbers are: they are a few
    numbers per sequence, and every host of a job builds the same ones."""
    if controls is None:
        return None
    many = isinstance(controls, (list, tuple))
    items = list(controls) if many else [controls] * batch
    if many and len(items) != batch:
        raise ValueError(f"controls has {len(items)} entries for {batch} prompts; give one per prompt or one for all.")
    items = [processors_lib.check_controls(c, vocab, f"controls[{i}]" if many else "controls")
             for i, c in enumerate(items)]
    if all(processors_lib.is_default(c) for c in items):
        return None
    items += [processors_lib.GenerationControls()] * (batch_pad - batch)
    arrays = processors_lib.controls_rows(items, processors_lib.bias_bucket(items))
    if layout is not None:
        arrays = {name: replicated(layout, x) for name, x in arrays.items()}
    return processors_lib.RowSettings(controls=processors_lib.Controls(**arrays))


def decode(
    params: ModelPair,
    prompt_ids,
    *,
    rule: Optional[AcceptanceRule] = None,
    drafting: Optional[drafting_lib.DraftingPolicy] = None,
    num_draft: Optional[int] = None,
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
    tree=None,
    lookup: Optional[lookup_lib.NgramLookup] = None,
    controls=None,
) -> DecodeOutput:
    """Speculative decoding: draft with ``params.draft``, verify with ``params.target``.

    Args:
      params: ``specjax.pair(target, draft)``.
      prompt_ids: a ragged list of token lists, or a right-padded ``[B, P]``
        int array (with ``prompt_lengths`` unless every row is full).
      rule: acceptance rule (default ``speculative_sampling()``, lossless).
      drafting: drafting policy (default ``specjax.drafting.fixed()``, i.e.
        always ``num_draft`` tokens). With :func:`specjax.drafting.auto`, a
        call whose first cycle would draft nothing
        (:func:`specjax.drafting.drafts_before_evidence`) runs :func:`generate`
        instead: the same law, no draft work, ``generate``'s ``stats`` and
        ``on_tokens`` widths.
      num_draft: K, the most tokens drafted per cycle (buffer shapes); default 4,
        or the tree's depth with ``tree=``.
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
        With a drafting policy that can stop early, a cycle's verification
        forward runs only as wide as the batch's longest draft, rounded up to
        2, 4, 8, ... or ``K + 1`` (``Buckets.verify``; ``stats.verified``
        counts the tokens verified). ``None``: compile for the exact shapes,
        and verify all ``K + 1`` tokens every cycle.
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
      tree: a :class:`specjax.trees.TokenTree` (``static_tree((4, 2, 1))``)
        or a :class:`specjax.trees.DynamicTree` (``dynamic_tree(depth, top_k,
        num_nodes)``, EAGLE-2: each cycle expands the ``top_k`` best-scored
        nodes per level and verifies the ``num_nodes`` best): draft a token
        tree per cycle instead of a chain and verify it in one target forward
        with tree attention (both models must support trees, as the built-in
        decoders and feature heads do). The lossless rule: greedy (output
        identical to the target's greedy output) or exact sampling (children
        drawn without replacement, recursive rejection sampling; a
        ``sampled=False`` dynamic tree's top-k children as point masses);
        every other rule, greedy or sampling (see :mod:`specjax.trees`). The drafting
        policy is the tree's shape, and ``num_draft`` is its depth; with
        ``drafting=auto()`` and a dynamic tree, each cycle verifies only the
        best-ranked nodes that pay on this machine (1, 2, 4, ... or all), or
        runs a plain target step (docs/trees.md).
      lookup: ``specjax.drafting.ngram_lookup()`` to copy drafts from the
        context: where a sequence's last ``min_match``..``max_match`` tokens
        occurred earlier in it, the tokens that followed them there fill the
        cycle's first draft slots (as point masses, so every rule stays what
        it is: the lossless one stays exact), and the draft model or head
        drafts the rest, reading the copied tokens. Counted in
        ``stats.copied`` / ``stats.copied_accepted``. Chains only (ValueError
        with ``tree=``).
      controls: :class:`specjax.GenerationControls` (repetition / presence /
        frequency penalties, ``logit_bias``, ``min_new_tokens``) for every
        prompt, or a list with one per prompt. The processed logits are what
        both models sample from and what the rule judges, so the lossless
        rule is exactly lossless with respect to the processed target
        (:mod:`specjax._src.logits.processors`). On a tree, each node's logits are
        processed after the tokens on its path from the root. Stop strings
        are matched on the text by the reader of the tokens
        (:class:`specjax.engine.TextStream`).

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
    if lookup is not None and not isinstance(lookup, lookup_lib.NgramLookup):
        raise TypeError(f"lookup must be specjax.drafting.ngram_lookup(...), got {type(lookup).__name__}.")
    if lookup is not None and tree is not None:
        raise ValueError("lookup= drafts chains; it cannot be combined with tree=. Drop one of them.")
    if tree is not None:
        rule, drafting, _ = check_decode_args(params, rule, drafting, None)
        depth = check_tree(tree, params, rule, drafting, num_draft)
        num_draft, cache_room = depth, tree.num_nodes  # the target cache holds every node for a moment
    else:
        rule, drafting, num_draft = check_decode_args(params, rule, drafting, num_draft)
        cache_room = num_draft
    call = prepare_call(
        {"target": params.target, "draft": params.draft},
        params.vocab_size,
        prompt_ids,
        extra=cache_room,
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
        what=(f"decoding (longest prompt {{width}} + max_new_tokens {max_new_tokens} + "
              + (f"the tree's {cache_room} nodes)" if tree is not None else f"num_draft {num_draft})")),
    )
    check_diagnostics(diagnostics)
    sized = tree is not None and type(drafting) is drafting_lib.Auto  # auto() chooses the tree's size
    widths = tree_size_widths(tree) if sized else (None if tree is not None else
                                                    verify_widths_for(buckets, drafting, num_draft))
    cfg = call.cfg._replace(diagnostics=diagnostics, num_draft=num_draft, tree=tree, lookup=lookup,
                            verify_widths=widths, classes=pytree_classes(rule, drafting))
    timing = costs_lib.timing_asked(drafting) if (tree is None or sized) and cfg.layout is None else False
    if tree is None or sized:  # auto() without costs: measured once per shape on this machine
        measured_pair = params.replace(target=call.models["target"], draft=call.models["draft"])
        drafting = costs_lib.with_costs(drafting, lambda: costs_lib.cached_costs(
            measured_pair, batch=call.prompts.shape[0], num_draft=widths[-1] - 1 if sized else num_draft,
            verify_widths=cfg.verify_widths, cache_length=cfg.cache_length, tree=tree if sized else None))
        cfg = cfg._replace(classes=pytree_classes(rule, drafting))  # the filled-in costs are a node too
    if cfg.layout is not None:  # the rule's and policy's traced numbers, replicated on the mesh
        rule, drafting = jax.tree_util.tree_map(
            lambda x: replicated(cfg.layout, np.asarray(jnp.asarray(x))), (rule, drafting)
        )
    check_on_tokens(on_tokens, call)
    rows = _controls_rows(controls, params.vocab_size, call.batch, call.prompts.shape[0], cfg.layout)
    cfg = cfg._replace(stream=on_tokens is not None)
    params = params.replace(target=call.models["target"], draft=call.models["draft"])
    if timing or (timing is None and costs_lib.parts_undecided(drafting, num_draft, call.prompts.shape[0],
                                                               tree=tree, sizes=widths)):
        # the cycle's cost by draft length (a sized tree's: by node count), timed in this very program
        # (compiled once anyway)
        shape = (costs_lib.shape_key(params), cfg, call.prompts.shape, rows is None)
        baseline = None
        if diagnostics is None:  # decode falls back to generate's program: time it too
            baseline = _timed_generation(params, prompt_ids, max_new_tokens, controls, temperature=temperature,
                                         top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, key=key,
                                         max_length=max_length, prompt_lengths=prompt_lengths,
                                         pad_token_id=pad_token_id, mesh=mesh, buckets=buckets)
        drafting = costs_lib.set_costs(drafting, costs_lib.cached_calibration(
            shape, costs_lib.auto_costs(drafting), _timed_loop(params, rule, drafting, call, cfg, rows), baseline,
            lengths=None if tree is None else tuple(w - 1 for w in widths)))
    opens_plain = (not drafting_lib.drafts_before_evidence(drafting, num_draft) if tree is None
                   else sized and not drafting_lib.drafts_before_evidence(drafting, num_draft, sizes=widths,
                                                                         top_k=tree.top_k))
    if diagnostics is None and opens_plain:
        # auto() would open with plain steps: run them in generate's program, not in the drafting one,
        # whose plain steps still carry the draft (its prefill, and a catch-up every K cycles) and
        # cost 0.85-0.93 of a generate step on a 2-core CPU at batch 4 and 8.
        return generate(params, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, eos_token_id=eos_token_id, key=key, max_length=max_length,
                        prompt_lengths=prompt_lengths, pad_token_id=pad_token_id, mesh=mesh, buckets=buckets,
                        on_tokens=on_tokens, controls=controls)
    args = (params, rule, drafting, call.prompts, call.lengths, call.max_new, call.eos, call.pad_id, call.key,
            call.temperature, call.top_p)
    out, bad = run_streaming(
        on_tokens, call.batch,
        lambda sid: (_decode_jit(*args, cfg=cfg, rows=rows) if sid is None
                     else _decode_jit(*args, sid, cfg=cfg, rows=rows)),
    )
    return finish_call(call, out, bad, {1: "target", 2: "draft"})


def _timed_loop(params, rule, drafting, call, cfg: LoopConfig, rows):
    """``run(costs, max_new_tokens) -> (seconds, cycles)``: ``decode``'s own
    program on the call's prompts with ``auto(costs)``, no EOS, each sequence
    stopping at ``max_new_tokens`` (:func:`specjax._src.engine.costs.calibrate_costs`)."""
    no_eos = jnp.full_like(call.eos, -1)

    def run(costs, max_new_tokens: int):
        max_new = jnp.where(call.max_new > 0, min(max_new_tokens, cfg.max_new_tokens), 0).astype(call.max_new.dtype)
        args = (params, rule, costs_lib.set_costs(drafting, costs), call.prompts, call.lengths, max_new, no_eos,
                call.pad_id, call.key, call.temperature, call.top_p)
        start = time.perf_counter()
        out, _ = run_streaming(
            (lambda tokens, counts: None) if cfg.stream else None, call.batch,
            lambda sid: (_decode_jit(*args, cfg=cfg, rows=rows) if sid is None
                         else _decode_jit(*args, sid, cfg=cfg, rows=rows)))
        jax.block_until_ready(out.tokens)
        return time.perf_counter() - start, int(out.stats.target_forwards)

    return run


# ---------------------------------------------------------------------------
# generate: the target-only baseline
# ---------------------------------------------------------------------------


def _generate_impl(
    model: Model, vocab: int, prompts, prompt_lengths, max_new, eos_ids, pad_id, key, temperature, top_p,
    stream_id=None, *, cfg: LoopConfig, rows=None,
):
    """The jitted body of ``generate``: :func:`_run_loop` with :data:`TARGET_ONLY`
    over a pair without a draft."""
    target_only = ModelPair(target=model, draft=None, vocab_size=vocab)
    return _run_loop(TARGET_ONLY, target_only, None, None, prompts, prompt_lengths, max_new, eos_ids, pad_id, key,
                     temperature, top_p, stream_id, cfg=cfg, rows=rows)


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
    controls=None,
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

    ``controls``: logits processors, as for :func:`decode`.
    """
    call, vocab, cfg, rows = _generation_call(model, prompt_ids, max_new_tokens=max_new_tokens,
                                              temperature=temperature, top_k=top_k, top_p=top_p,
                                              eos_token_id=eos_token_id, key=key, max_length=max_length,
                                              prompt_lengths=prompt_lengths, pad_token_id=pad_token_id, mesh=mesh,
                                              buckets=buckets, controls=controls)
    check_on_tokens(on_tokens, call)
    cfg = cfg._replace(stream=on_tokens is not None)
    args = (call.models["target"], vocab, call.prompts, call.lengths, call.max_new, call.eos, call.pad_id,
            call.key, call.temperature, call.top_p)
    out, bad = run_streaming(
        on_tokens, call.batch,
        lambda sid: (_generate_jit(*args, cfg=cfg, rows=rows) if sid is None
                     else _generate_jit(*args, sid, cfg=cfg, rows=rows)),
    )
    return finish_call(call, out, bad, {1: "target"})


def _generation_call(model, prompt_ids, *, max_new_tokens, controls, **kw):
    """``generate``'s checked call: ``(call, vocab, cfg, rows)``."""
    if isinstance(model, ModelPair):
        vocab, model = model.vocab_size, model.target
    elif isinstance(model, Model):
        if getattr(model.module, "reads_target_features", False):
            raise ValueError("generate(): this is a draft head, which drafts from its target's hidden states and "
                             "cannot decode alone; decode with its target: specjax.decode(specjax.pair(target, "
                             "head), prompts).")
        vocab = model_vocab(model)
    else:
        raise TypeError(f"generate(): model must be a specjax.Model, got {type(model).__name__}.")
    call = prepare_call({"target": model}, vocab, prompt_ids, extra=0, max_new_tokens=max_new_tokens,
                        what=f"generation (longest prompt {{width}} + max_new_tokens {max_new_tokens})", **kw)
    rows = _controls_rows(controls, vocab, call.batch, call.prompts.shape[0], call.cfg.layout)
    return call, vocab, call.cfg, rows


def _timed_generation(params, prompt_ids, max_new_tokens: int, controls, **kw):
    """``run(max_new_tokens) -> (seconds, steps)``: the program ``generate`` runs for this call (the
    one ``decode`` falls back to), no EOS, each sequence stopping at ``max_new_tokens``
    (:func:`specjax._src.engine.costs.calibrate_costs`'s ``baseline``)."""
    call, vocab, cfg, rows = _generation_call(params, prompt_ids, max_new_tokens=max_new_tokens, controls=controls,
                                              **kw)
    no_eos = jnp.full_like(call.eos, -1)

    def run(n: int):
        max_new = jnp.where(call.max_new > 0, min(n, cfg.max_new_tokens), 0).astype(call.max_new.dtype)
        args = (call.models["target"], vocab, call.prompts, call.lengths, max_new, no_eos, call.pad_id, call.key,
                call.temperature, call.top_p)
        start = time.perf_counter()
        out, _ = _generate_jit(*args, cfg=cfg, rows=rows)
        jax.block_until_ready(out.tokens)
        return time.perf_counter() - start, int(out.stats.target_forwards)

    return run
