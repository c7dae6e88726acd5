"""One draft-verify cycle over a token tree (``decode(..., tree=static_tree(...))``).

The same five steps as the chain cycle (:mod:`specjax._src.engine.chain`), as
the same five functions, with a tree of draft tokens in place of a chain.
:func:`_tree_cycle` is the whole cycle (:data:`TREE`, a
:class:`specjax._src.engine.cycle.Cycle` of the chain's signature)::

    keys, uniforms = _tree_uniforms(...)  # the cycle's randomness, from one key per sequence
    drafted   = _draft(...)      # the tree: a static one level by level, a dynamic one expanded and reranked
    verified  = _verify(...)     # one target forward over all N nodes with tree attention
    accepted  = _accept(...)     # the walk down the tree: the accepted path and the emitted token
    committed = _commit(...)     # the path's tokens written, both caches keep the path and roll back
    ...       = _record(...)     # stats, a stateful rule's state and diagnostics from the path

What it shares with the chain cycle (the first draft step, the block
commit, the draft cache's invariant, the non-finite codes, the state after a
cycle) is in :mod:`specjax._src.engine.cycle`. Step by step:

* draft: the draft's ``T = 2`` first step gives its distribution at the root
  (the last committed token, node 0); each breadth-first level's children are
  its ``branching[d]`` best tokens (greedy) or a draw without replacement
  (Gumbel top-k) from the warped draft distribution, and each level but the
  last is fed to the draft in one forward with tree attention
  (``tree_offset``), which gives the next level's distributions;
* verify: one target forward over all ``N`` nodes with tree attention: row
  ``j`` of its logits judges node ``j``'s children;
* accept: :func:`specjax._src.proposals.trees.verify_tree` walks down the tree (greedy:
  the child equal to the target's argmax; sampling: recursive rejection
  sampling without replacement, exact);
* commit: the accepted path's tokens and the emitted token, cut at EOS and
  ``max_new_tokens``; both caches keep the accepted path
  (:meth:`KVCache.keep_path`: the path's rows move into place) and roll back
  to the chain loop's invariants;
* record: stats with ``K`` = the tree's depth (each cycle judges one path).

A dynamic tree (:class:`specjax._src.proposals.trees.DynamicTree`, EAGLE-2) is drafted
by :func:`draft_dynamic` instead: ``depth`` draft forwards, each over the
``top_k`` best-scored frontier nodes with traced per-sequence tree parents,
then a rerank keeps the ``num_kept`` best candidates. Greedy, the children
are the draft's top-k and the scores EAGLE-2's cumulative draft
log-probabilities. Sampling, the children are drawn without replacement as a
static tree's are, and ranked by slot scores that never read a drawn token's
own probability (:func:`specjax._src.proposals.trees.slot_scores`), so the recursive
rejection sampling stays exact; with ``sampled=False`` (by default for
relaxed rules) they are the top-k, point-mass drafts. The target verifies
that traced tree (:func:`specjax._src.proposals.trees.verify_dynamic_tree`).

Node ``j`` of the tree sits in cache slot ``start + j`` with ``start =
num_committed - 1``, the root's own slot, in both caches (a dynamic tree's
draft cache holds its *fed* tree instead: the root, then each level's
frontier; the accepted path's nodes but the last are frontier nodes, so the
commit moves them from their fed slots). A feature head
(:mod:`specjax.heads`) holds node ``j`` one slot earlier (its position ``i``
reads token ``x_{i+1}``): its first step ends at the root, node ``j`` reads
its parent's predicted feature, and after the commit it keeps only what it
built from the target's features; the accepted path's target features are
its next cycle's first inputs, as in the chain cycle.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.logits import processors as processors_lib
from specjax._src.logits import sampling
from specjax._src.engine.config import DecodeState, LoopConfig
from specjax._src.engine.cycle import (
    Committed,
    Cycle,
    CycleInputs,
    commit_block,
    committed_block,
    cycle_history,
    cycle_logprobs,
    draft_keep,
    first_draft_logits,
    first_head_logits,
    greedy_rows,
    live_diagnostics,
    live_settings,
    next_state,
    nonfinite_codes,
    per_row_rule,
    usable_reduced,
    with_greedy_rows,
)
from specjax._src.engine.ops import cond_in_place, gather, switch_in_place, warp, where_b
from specjax._src.engine.plain import draft_can_wait, first_draft_step, plain_cycle
from specjax._src.models.lm import KVCache, ReducedLogits
from specjax._src.models.feature_head import is_feature_head
from specjax._src.models.pairing import ModelPair
from specjax._src.rules.base import AcceptanceRule, Path, Verdict, VerifyInputs
from specjax._src.engine.stats import record_cycle
from specjax._src.proposals.trees import (DynamicTree, TokenTree, TreeVerdict, children_table, levels, rerank,
                                sample_children, slot_scores, top_ranked, uniform_branching, verify_dynamic_tree,
                                verify_tree)

Array = jax.Array


def _tree_cycle(
    cfg: LoopConfig, pair_params: ModelPair, rule: AcceptanceRule, policy, inputs: CycleInputs, state: DecodeState,
):
    """One tree cycle (a static :class:`TokenTree` or a :class:`DynamicTree`)
    with any rule, as the chain cycle's five steps (:data:`TREE`'s ``run``).
    Returns ``(state, diagnostics or None)``.

    The tree's shape is the drafting policy, except with :func:`drafting.auto
    <specjax._src.proposals.drafting.auto>` on a dynamic tree (:func:`_sized_cycle`):
    each cycle then verifies only the ``n`` best-ranked of its nodes, ``n`` chosen
    from ``cfg.verify_widths`` (``0``: a plain target step, the draft skipped).
    ``inputs.rows`` (the slots engine's): per-row temperature, top-p and
    top-k, greedy rows among sampled ones, rule numbers, log-probabilities,
    the logits processors (each node's logits, the draft's and the target's,
    processed after the tokens on its path, :func:`_processed`), and the draft
    cap, which limits the accepted path's depth
    (:func:`specjax._src.proposals.trees.verify_tree`'s ``limit``)."""
    if chooses_size(cfg, policy):
        return _sized_cycle(cfg, pair_params, rule, policy, inputs, state)
    return _drafting_cycle(cfg, pair_params, rule, policy, inputs, state, None)


def chooses_size(cfg: LoopConfig, policy) -> bool:
    """Whether each cycle chooses how many of its tree's nodes to verify: a
    policy that may draft none (:func:`drafting.auto
    <specjax._src.proposals.drafting.auto>`) on a dynamic tree."""
    return isinstance(cfg.tree, DynamicTree) and bool(getattr(policy, "may_draft_none", False))


def size_counts(cfg: LoopConfig) -> tuple[int, ...]:
    """The draft-node counts a sized cycle chooses from (``0``: a plain step), ascending."""
    return tuple(w - 1 for w in cfg.verify_widths)


def _sized_cycle(cfg: LoopConfig, pair_params: ModelPair, rule: AcceptanceRule, policy, inputs: CycleInputs,
                 state: DecodeState):
    """A dynamic tree's cycle whose size the policy chooses from past cycles alone
    (:meth:`~specjax._src.proposals.drafting.Auto.plan_tree`): a plain target step
    (:func:`specjax._src.engine.plain.plain_cycle`) where it chooses no nodes and the
    draft can wait, else the tree verified at the chosen count's width. Where it chooses
    none but the draft cannot wait, the cycle runs the draft's first step (its catch-up)
    and verifies the root alone: a target step that keeps the draft in step."""
    counts = size_counts(cfg)
    batch = state.num_committed.shape[0]
    drafting = ~state.done
    if inputs.rows is not None and inputs.rows.draft_cap is not None:
        drafting = drafting & (inputs.rows.draft_cap > 0)  # a row capped at no drafts gains nothing from nodes
    choice = policy.plan_tree(state.policy_state, drafting, counts, cfg.tree.max_depth, cfg.tree.top_k)
    if cfg.diagnostics is not None:  # the hook reads every cycle's decided path: always a drafting cycle
        return _drafting_cycle(cfg, pair_params, rule, policy, inputs, state, choice)
    nodes = cfg.tree.num_kept

    def plain(s):
        _, _, emit_uniform = _tree_uniforms(cfg, inputs.keys, s.step, batch)
        nothing = (jnp.zeros((batch,), jnp.int32), jnp.zeros((batch, nodes), bool))
        return plain_cycle(cfg, pair_params, inputs, s, emit_uniform,
                           lambda live: jax.vmap(policy.update_tree)(s.policy_state, *nothing))

    go_plain = (choice == 0) & draft_can_wait(cfg, pair_params, state)
    return cond_in_place(go_plain, plain,
                         lambda s: _drafting_cycle(cfg, pair_params, rule, policy, inputs, s, choice)[0], state), None


def _drafting_cycle(cfg: LoopConfig, pair_params: ModelPair, rule: AcceptanceRule, policy, inputs: CycleInputs,
                    state: DecodeState, size):
    """The draft, verify, accept, commit and record of :func:`_tree_cycle`. ``size``:
    None (every node verified), or a traced index into :func:`size_counts`, the
    number of best-ranked nodes verified (the policy learns from their outcome)."""
    prompt_lengths, max_new, eos_ids, seq_keys, temperature, top_p, rows = inputs
    if rows is not None:
        rows, top_p = live_settings(rows, top_p, ~state.done)
    hist = cycle_history(rows, state, prompt_lengths, eos_ids, pair_params.vocab_size)
    batch = state.num_committed.shape[0]
    need_view = _needs_chain_view(cfg, state)
    draft_keys, uniforms, emit_uniform = _tree_uniforms(cfg, seq_keys, state.step, batch)
    count = None if size is None else jnp.asarray(size_counts(cfg), jnp.int32)[size]
    drafted, draft_cache = _draft(cfg, pair_params, rule, state, draft_keys, temperature, top_p, need_view, rows,
                                  hist, count)
    verified = _verify(cfg, pair_params, rule, state, drafted, temperature, top_p, rows, hist, size)
    accepted = _accept(cfg, rule, state, drafted, verified, uniforms, emit_uniform, rows)
    committed, draft_features = _commit(pair_params, state, drafted, verified, accepted, draft_cache, prompt_lengths,
                                        max_new, eos_ids)
    logprobs = None if state.logprobs is None else _logprobs(state, drafted, verified, accepted, rows)
    rule_state, stats, diag = _record(cfg, rule, state, drafted, verified, accepted, committed, uniforms, need_view,
                                      rows, count)
    policy_state = state.policy_state
    if count is not None:
        policy_state = where_b(accepted.live, _learn_sizes(policy, state, accepted, count, rows), policy_state)
    new_state = next_state(state, committed, bad=accepted.bad, rule_state=rule_state,
                           policy_state=policy_state, stats=stats, draft_features=draft_features,
                           logprobs=logprobs)
    return new_state, diag


def _learn_sizes(policy, state: DecodeState, accepted: _TreeAccepted, count: Array, rows):
    """The policy's state after a sized cycle: the ``count`` best-ranked nodes were
    judged, and those on the accepted path were accepted. A row whose draft cap cut
    its walk short of the tree's depth tells nothing about the deeper ranks: it only decays."""
    path, n = accepted.verdict.path, accepted.num_accepted
    nodes = state.policy_state.accepted.shape[-1]
    on = jnp.arange(path.shape[1] - 1)[None, :] < n[:, None]  # [B, D] path slots accepted
    on_path = ((path[:, 1:, None] == jnp.arange(1, nodes + 1)) & on[..., None]).any(1)  # [B, M]
    judged = jnp.broadcast_to(count, n.shape)
    limit = _draft_limit(rows)
    if limit is not None:
        judged = jnp.where(limit >= path.shape[1] - 1, judged, 0)
    return jax.vmap(policy.update_tree)(state.policy_state, judged, on_path)


def _draft_limit(rows):
    """``[B]`` each row's draft cap (the deepest node its walk may accept), or None."""
    return None if rows is None else rows.draft_cap


def _needs_chain_view(cfg: LoopConfig, state: DecodeState) -> bool:
    """Whether anything reads the decided path as a chain block
    (:func:`_path_as_chain`): a stateful rule's ``update`` (e.g. AdaSD's
    running means) or a ``diagnostics`` hook."""
    return _stateful(state) or cfg.diagnostics is not None


def _stateful(state: DecodeState) -> bool:
    return bool(jax.tree_util.tree_leaves(state.rule_state))


def _verified_nodes(tree) -> int:
    """``N``: the nodes one verification scores, the root included."""
    return tree.verified_nodes if isinstance(tree, DynamicTree) else tree.num_nodes


def _tree_uniforms(cfg: LoopConfig, seq_keys, step, batch: int):
    """All of a cycle's randomness, from ``fold_in(seq_key, step)``:
    ``(draft_keys [B], uniforms [B, N], emit_uniform [B])``: the keys the
    children are drawn with (each level folds in its own index), one
    acceptance uniform per node and one for the emitted token. Greedy draws
    nothing (``draft_keys`` is None). ``step``: a scalar, or ``[B]``."""
    n_nodes = _verified_nodes(cfg.tree)
    if cfg.greedy:
        return None, jnp.zeros((batch, n_nodes), jnp.float32), jnp.zeros((batch,), jnp.float32)
    steps = jnp.broadcast_to(step, (batch,))  # the slots engine counts cycles per row
    cycle_keys = jax.vmap(jax.random.fold_in)(seq_keys, steps)
    draft_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(cycle_keys)
    u = jax.vmap(lambda k: sampling.uniform_open(jax.random.fold_in(k, 2), (n_nodes + 1,)))(cycle_keys)
    return draft_keys, u[:, :n_nodes], u[:, n_nodes]


def node_paths(parents: Array, nodes: Array, depth: int) -> Array:
    """``[B, M, N]`` bool: the drafted tokens each of ``nodes [B or 1, M]``
    follows, the non-root nodes on its path from the root, itself included.
    ``parents``: ``[B or 1, N]`` (the root's ``-1``); ``depth``: the deepest level."""
    n, batch = parents.shape[-1], max(parents.shape[0], nodes.shape[0])
    parents = jnp.broadcast_to(parents, (batch, n))
    node = jnp.broadcast_to(nodes, (batch, nodes.shape[-1]))
    paths = jnp.zeros(node.shape + (n,), bool)
    for _ in range(depth):
        on = node > 0
        paths = paths | (on[..., None] & (node[..., None] == jnp.arange(n)))
        node = jnp.where(on, jnp.take_along_axis(parents, jnp.maximum(node, 0), axis=1), 0)
    return paths


def _processed(rows, hist, raw: Array, tokens: Array, follows: Array) -> Array:
    """``raw [B, M, V]`` through the rows' logits processors, each of the ``M``
    nodes after the committed tokens (``hist``) and the drafted ``tokens [B, N]``
    on its path (``follows [B or 1, M, N]``, :func:`node_paths`): the
    processing a chain gives the same tokens in a row. As is without controls.

    The draft's and the target's logits at a node are processed alike, so every
    rule judges the distributions the user asked for, as on a chain
    (:mod:`specjax._src.logits.processors`)."""
    if hist is None:
        return raw
    return processors_lib.process_paths(rows.processors, rows.controls, hist, raw, tokens, follows)


# ---------------------------------------------------------------------------
# 1. draft
# ---------------------------------------------------------------------------


class _DraftedTree(NamedTuple):
    """A cycle's tree, static or dynamic, as the later steps read it."""

    tokens: Array  # [B, N] node tokens (node 0: the root, the last committed token)
    # The tree's parents: numpy [N] for a static tree (its attention mask is built on the host),
    # traced [B, N] for a dynamic one.
    parents: Any
    table: Array  # [B, N, C] each node's children, -1 padded
    # [B, N, V] the draft distribution each node's children were drawn from (None: a dynamic
    # tree's top-k children, point masses).
    probs: Any
    # [B, N - 1, V] the draft's warped logits at each non-root node's parent (None where neither
    # a relaxed rule nor the chain view reads them).
    parent_logits: Any
    fed: Any  # [B, N] a dynamic tree's node slots in the draft's fed tree (-1: never fed); None for a static tree
    bad: Array  # [B] the draft's logits were non-finite somewhere
    forwards: Array  # scalar int32

    @property
    def node_parents(self):
        """The non-root nodes' parents: numpy ``[N - 1]`` or traced ``[B, N - 1]``."""
        return self.parents[1:] if isinstance(self.parents, np.ndarray) else self.parents[:, 1:]

    @property
    def child_draft_logits(self) -> Array:
        """``[B, N, V]``: :attr:`parent_logits` by node (row 0, the root's, is unused)."""
        return jnp.concatenate([self.parent_logits[:, :1], self.parent_logits], axis=1)


def _draft(cfg: LoopConfig, pair_params: ModelPair, rule: AcceptanceRule, state: DecodeState, draft_keys,
           temperature, top_p, need_view: bool, rows=None, hist=None, count=None) -> tuple[_DraftedTree, KVCache]:
    """Drafts the cycle's tree: a static tree level by level
    (:func:`_draft_tree`), a dynamic one by EAGLE-2's expansion and rerank
    (:func:`draft_dynamic`). Returns the tree and the draft cache after it,
    whose accepted path :func:`_commit` keeps. Greedy rows among sampled
    ones (``rows.greedy``) take the draft's best tokens as a greedy loop does.

    ``count`` (a sized cycle's, traced): the dynamic tree's nodes come best-ranked
    first, and only the first ``count`` are in the tree the walk reads (the
    others' parents are ``-1``); a draft model whose earlier cycles were plain
    steps catches up in its first step."""
    tree = cfg.tree
    batch = state.num_committed.shape[0]
    lossless = rule.lossless
    need_logits = not lossless or need_view
    if isinstance(tree, DynamicTree):
        # Drawn children keep the lossless walk exact and accept more; relaxed
        # rules judge by the target's ranks and accept more of the draft's best.
        sampled = lossless if tree.sampled is None else bool(tree.sampled)
        drafts, cache = draft_dynamic(cfg, tree, pair_params, state, need_logits=need_logits, draft_keys=draft_keys,
                                       temperature=temperature, top_p=top_p, sampled=sampled, rows=rows, hist=hist,
                                       count=count)
        parent_logits = warp(cfg, drafts.parent_logits, temperature, top_p, rows) if need_logits else None
        parents = drafts.parents
        if count is not None:  # the best-ranked count nodes: a subtree, its nodes' ancestors all rank above them
            parents = jnp.where(jnp.arange(parents.shape[1])[None, :] > count, -1, parents)
        table = jax.vmap(lambda p: children_table(p, tree.top_k))(parents)
        return _DraftedTree(tokens=drafts.tokens, parents=parents, table=table, probs=drafts.probs,
                            parent_logits=parent_logits, fed=drafts.fed, bad=drafts.bad,
                            forwards=drafts.forwards), cache
    drafts, cache = _draft_tree(cfg, tree, pair_params, state, draft_keys, temperature, top_p, rows, hist)
    parents = np.asarray(tree.parents, np.int32)  # static: the mask is built on the host
    static_table = tree.children_table()
    table = jnp.broadcast_to(jnp.asarray(static_table), (batch,) + static_table.shape)
    return _DraftedTree(tokens=drafts.tokens, parents=parents, table=table, probs=drafts.probs,
                        parent_logits=drafts.logits[:, parents[1:]] if need_logits else None, fed=None,
                        bad=drafts.bad, forwards=drafts.forwards), cache


class _StaticDrafts(NamedTuple):
    """What :func:`_draft_tree` drafts for a static tree."""

    tokens: Array  # [B, N] node tokens (node 0: the root, the last committed token)
    logits: Array  # [B, N, V] the warped draft logits at each node (raw when greedy)
    probs: Array  # [B, N, V] the draft distribution each node's children were drawn from
    bad: Array  # [B] the draft's logits were non-finite somewhere
    forwards: Array  # scalar int32


def _ranked(raw: Array, reduced: ReducedLogits | None, k: int) -> tuple[Array, Array | None]:
    """What greedy picks rank: a reduced head's own ``V'`` columns with their
    target ``ids`` when it has at least ``k``, else the raw logits ``[..., V]``
    (``ids`` None)."""
    if reduced is None or reduced.logits.shape[-1] < k:
        return raw, None
    return reduced.logits, reduced.ids


def top_tokens(raw: Array, reduced: ReducedLogits | None, k: int) -> Array:
    """``[..., k]`` the draft's ``k`` best tokens by its raw logits ``[..., V]``
    (:func:`specjax._src.logits.sampling.top_indices`), ranked over a reduced head's
    own ``V'`` columns when it has them (``reduced``, the same logits before
    their scatter; a tie may rank its tokens in another order)."""
    x, ids = _ranked(raw, reduced, k)
    columns = sampling.top_indices(x, k)
    return columns if ids is None else ids[columns]


def best_children(raw: Array, reduced: ReducedLogits | None, k: int) -> tuple[Array, Array]:
    """``(children [..., k], slot scores [..., k])``: the draft's top-k and their
    ``T = 1`` log-probabilities (EAGLE-2's greedy expansion,
    :func:`specjax._src.proposals.trees.slot_scores`), over a reduced head's own columns
    when it has them (as :func:`top_tokens`)."""
    x, ids = _ranked(raw, reduced, k)
    columns = sampling.top_indices(x, k)
    scores = slot_scores(jax.nn.log_softmax(x, axis=-1), columns)
    return (columns if ids is None else ids[columns]), scores


def _as_level(reduced: ReducedLogits | None) -> ReducedLogits | None:
    """The root's reduced logits ``[B, V']`` as a one-node level ``[B, 1, V']``."""
    return None if reduced is None else reduced._replace(logits=reduced.logits[:, None])


def _children(cfg: LoopConfig, raw: Array, keys: Array, num: int, temperature, top_p, rows=None, reduced=None):
    """``(children [B, M, num], logits [B, M, V], probs [B, M, V])`` for ``M``
    nodes' raw draft logits ``[B, M, V]`` (``reduced``: a reduced head's own,
    which greedy picks rank)."""
    logits = warp(cfg, raw, temperature, top_p, rows)
    probs = jax.nn.softmax(logits, axis=-1)
    if cfg.greedy:
        return top_tokens(raw, reduced, num), logits, probs
    m = raw.shape[1]
    pick = jax.vmap(jax.vmap(sample_children, in_axes=(0, 0, None)), in_axes=(0, 0, None))
    node_keys = jax.vmap(lambda k: jax.random.split(k, m))(keys)
    kids = with_greedy_rows(cfg, rows, pick(node_keys, probs, num), lambda: top_tokens(raw, reduced, num))
    return kids, logits, probs


def _draft_tree(cfg: LoopConfig, tree: TokenTree, pair_params: ModelPair, state: DecodeState, draft_keys,
                temperature, top_p, rows=None, hist=None) -> tuple[_StaticDrafts, KVCache]:
    module, params = pair_params.draft.module, pair_params.draft.params
    vocab = pair_params.vocab_size
    batch = state.num_committed.shape[0]
    branching = uniform_branching(tree)
    spans = levels(tree)
    head = is_feature_head(module)
    reduced = None
    if head:  # the root's own prediction; node j then reads its parent's f_hat
        raw0, root_feature, cache, reduced = first_head_logits(cfg, module, params, vocab, state)
        node_features = jnp.zeros((batch, tree.num_nodes, root_feature.shape[-1]), jnp.float32)
        node_features = node_features.at[:, 0].set(root_feature)
    else:
        raw0, cache = first_draft_logits(module, params, vocab, state)
    root = gather(state.tokens, state.num_committed - 1)
    tokens = jnp.zeros((batch, tree.num_nodes), jnp.int32).at[:, 0].set(root)
    probs = jnp.zeros((batch, tree.num_nodes, vocab), jnp.float32)
    logits = jnp.zeros((batch, tree.num_nodes, vocab), jnp.float32)
    bad = sampling.nonfinite_rows(raw0 if reduced is None else reduced.logits)
    raw, reduced = raw0[:, None], _as_level(reduced)  # [B, 1, V]: the root level
    parents = np.asarray(tree.parents, np.int32)  # static: the mask is built on the host
    paths = node_paths(jnp.asarray(parents)[None], jnp.arange(tree.num_nodes)[None], len(spans) - 1)
    forwards = 1
    for d, (lo, hi) in enumerate(spans[:-1]):
        keys = jax.vmap(lambda k: jax.random.fold_in(k, d))(draft_keys) if draft_keys is not None else None
        if hist is not None:  # the processed logits rank the children: the head's own columns would not
            raw, reduced = _processed(rows, hist, raw, tokens, paths[:, lo:hi]), None
        kids, level_logits, level_probs = _children(cfg, raw, keys, branching[d], temperature, top_p, rows,
                                                    reduced)
        probs = probs.at[:, lo:hi].set(level_probs)
        logits = logits.at[:, lo:hi].set(level_logits)
        nlo, nhi = spans[d + 1]
        tokens = tokens.at[:, nlo:nhi].set(kids.reshape(batch, nhi - nlo))
        if d + 1 < len(spans) - 1:  # the deepest level's children are never drafted
            if head:
                out = module.apply(params, tokens[:, nlo:nhi], cache, tree_parents=parents, tree_offset=nlo,
                                   features=node_features[:, parents[nlo:nhi]])
                node_features = node_features.at[:, nlo:nhi].set(out.hidden[0])
            else:
                out = module.apply(params, tokens[:, nlo:nhi], cache, tree_parents=parents, tree_offset=nlo)
            cache, raw = out.cache, out.logits[..., :vocab]
            reduced = usable_reduced(out, vocab)
            bad = bad | sampling.nonfinite_rows(raw if reduced is None else reduced.logits).any(1)
            forwards += 1
    return _StaticDrafts(tokens, logits, probs, bad, jnp.int32(forwards)), cache


class _DynamicDrafts(NamedTuple):
    """What :func:`draft_dynamic` drafts for a dynamic tree."""

    tokens: Array  # [B, M + 1] the verified tree's tokens (node 0: the root)
    parents: Array  # [B, M + 1] int32 the verified tree (traced, per sequence)
    fed: Array  # [B, M + 1] int32 each node's slot in the draft's fed tree (root 0; -1: never fed)
    parent_logits: Array | None  # [B, M, V] the draft's raw logits at each non-root node's parent (relaxed rules)
    probs: Array | None  # [B, M + 1, V] sampled children: the warped draft distribution they were drawn from
    bad: Array  # [B]
    forwards: Array  # scalar int32


def draft_dynamic(cfg: LoopConfig, tree: DynamicTree, pair_params: ModelPair, state: DecodeState,
                   need_logits: bool, draft_keys=None, temperature=1.0, top_p=1.0,
                   sampled: bool = False, rows=None, hist=None, count=None) -> tuple[_DynamicDrafts, KVCache]:
    """EAGLE-2's expansion and rerank (:func:`specjax._src.proposals.trees.dynamic_tree`).

    The draft sees a *fed tree*: node 0 the root, then each level's frontier
    (``top_k`` nodes, levels ``1 .. depth - 1``) at fed slots ``1 + (d - 1) *
    top_k ...``, one forward per level with traced per-sequence parents and
    tree attention; a feature head's fed node reads its parent's ``f_hat``.
    Candidates are numbered in drafting order: the root's ``top_k`` children,
    then each level's ``top_k ** 2`` (frontier slot ``i``'s children at ``i *
    top_k ...``, in draw order). Scores add :func:`slot_scores` of the
    ``T = 1`` draft log-probabilities of the raw logits. ``sampled`` (when
    not greedy): the children are drawn without replacement from the warped
    draft distribution with ``draft_keys [B]`` (level ``d``'s folded with ``d``);
    greedy rows among them (``rows.greedy``) take the top-k, as a greedy loop does.
    With logits processors (``hist``), each fed node's logits are processed
    after the tokens on its fed path before anything ranks or draws from them.
    ``count`` (traced; a cycle that verifies only its ``count`` best-ranked
    nodes): the kept candidates come in rank order
    (:func:`specjax._src.proposals.trees.rerank`'s ``by_rank``), levels deeper
    than ``count`` are not drafted (the best ``count`` nodes lie above them),
    and a draft model's first step catches up on skipped cycles.
    """
    module, params = pair_params.draft.module, pair_params.draft.params
    vocab, k, depth = pair_params.vocab_size, tree.top_k, tree.depth
    batch = state.num_committed.shape[0]
    head = is_feature_head(module)
    reduced0 = None
    if head:
        raw0, root_feature, cache, reduced0 = first_head_logits(cfg, module, params, vocab, state)
        fed_features = jnp.zeros((batch, tree.num_fed + 1, root_feature.shape[-1]), jnp.float32)
        fed_features = fed_features.at[:, 0].set(root_feature)
    elif count is not None:
        raw0, cache = first_draft_step(cfg, module, params, vocab, state)
    else:
        raw0, cache = first_draft_logits(module, params, vocab, state)
    raw0 = raw0.astype(jnp.float32)
    root = gather(state.tokens, state.num_committed - 1)
    bad = sampling.nonfinite_rows(raw0 if reduced0 is None else reduced0.logits)
    sampled = sampled and not cfg.greedy
    fed_tokens = jnp.zeros((batch, tree.num_fed + 1), jnp.int32).at[:, 0].set(root)
    if hist is not None:  # the root's children follow the committed tokens alone
        raw0 = _processed(rows, hist, raw0[:, None], fed_tokens, jnp.zeros((1, 1, tree.num_fed + 1), bool))[:, 0]
        reduced0 = None

    fed_probs = []  # sampled: [B, M, V] per draft forward, the warped distributions children are drawn from

    def children(raw, d, reduced):  # [B, M, V] -> ([B, M, k] tokens in draw order, [B, M, k] slot scores)
        def best():
            return best_children(raw, reduced, k)

        if not sampled:
            return best()
        level_keys = jax.vmap(lambda key: jax.random.split(jax.random.fold_in(key, d), raw.shape[1]))(draft_keys)
        probs = jax.nn.softmax(warp(cfg, raw, temperature, top_p, rows), axis=-1)
        kids = jax.vmap(jax.vmap(sample_children, in_axes=(0, 0, None)), in_axes=(0, 0, None))(level_keys, probs, k)
        fed_probs.append(probs)
        return with_greedy_rows(cfg, rows, (kids, slot_scores(jax.nn.log_softmax(raw, axis=-1), kids, probs)), best)

    kids, scores = children(raw0[:, None], 0, _as_level(reduced0))  # level 1, all of it the first frontier
    kids, scores = kids[:, 0], scores[:, 0]
    cand_tokens, cand_scores = [kids], [scores]
    cand_parents = [jnp.full((batch, k), -1, jnp.int32)]
    cand_fed = [jnp.broadcast_to(jnp.arange(1, k + 1, dtype=jnp.int32), (batch, k))]
    front_cand = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k))
    front_tokens, front_scores = kids, scores
    fed_parents = jnp.full((batch, tree.num_fed + 1), -1, jnp.int32).at[:, 1 : k + 1].set(0)
    raws = [raw0[:, None]]
    base = k
    for d in range(1, depth):
        lo = 1 + (d - 1) * k  # this level's frontier: fed slots lo .. lo + k - 1

        def level(carry, lo=lo, front_tokens=front_tokens, tree_parents=fed_parents[:, : lo + k],
                  front_fed=fed_parents[:, lo : lo + k]):
            """The level's draft forward: ``(cache, fed features, raw logits [B, k, V], reduced)``."""
            cache, fed_features, _, _ = carry
            if head:
                feats = jnp.take_along_axis(fed_features, front_fed[..., None], axis=1)
                out = module.apply(params, front_tokens, cache, tree_parents=tree_parents, tree_offset=lo,
                                   features=feats)
                fed_features = fed_features.at[:, lo : lo + k].set(out.hidden[0])
            else:
                out = module.apply(params, front_tokens, cache, tree_parents=tree_parents, tree_offset=lo)
            return out.cache, fed_features, out.logits[..., :vocab].astype(jnp.float32), usable_reduced(out, vocab)

        carry = (cache, fed_features if head else None, None, None)
        if count is None:
            cache, fed_features, raw, reduced = level(carry)
        else:
            # The best-ranked count nodes are a subtree, at most count levels deep: a level
            # below it is not drafted, and its candidates score -inf (never among the count).
            shapes = jax.eval_shape(level, carry)
            blank = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), (shapes[2], shapes[3]))
            cache, fed_features, raw, reduced = cond_in_place(d < count, level, lambda c: c, carry[:2] + blank)
        bad = bad | sampling.nonfinite_rows(raw if reduced is None else reduced.logits).any(1)
        if hist is not None:
            fed_tokens = fed_tokens.at[:, lo : lo + k].set(front_tokens)
            front_slots = jnp.broadcast_to(jnp.arange(lo, lo + k), (batch, k))
            raw = _processed(rows, hist, raw, fed_tokens, node_paths(fed_parents, front_slots, d))
            reduced = None
        raws.append(raw)
        level_kids, kid_scores = children(raw, d, reduced)  # [B, k, k]
        level_scores = front_scores[:, :, None] + kid_scores
        if count is not None:
            level_scores = jnp.where(d < count, level_scores, -jnp.inf)
        level_tokens, level_scores = level_kids.reshape(batch, k * k), level_scores.reshape(batch, k * k)
        cand_tokens.append(level_tokens)
        cand_scores.append(level_scores)
        cand_parents.append(jnp.repeat(front_cand, k, axis=1))
        level_fed = jnp.full((batch, k * k), -1, jnp.int32)
        if d < depth - 1:  # the next frontier: this level's top_k
            pick = top_ranked(level_scores, k)  # [B, k]
            nlo = lo + k
            level_fed = jax.vmap(lambda f, i: f.at[i].set(jnp.arange(nlo, nlo + k, dtype=jnp.int32)))(level_fed, pick)
            fed_parents = fed_parents.at[:, nlo : nlo + k].set(lo + pick // k)
            front_cand = base + pick
            front_tokens = jnp.take_along_axis(level_tokens, pick, axis=1)
            front_scores = jnp.take_along_axis(level_scores, pick, axis=1)
        cand_fed.append(level_fed)
        base += k * k

    cand = lambda xs: jnp.concatenate(xs, axis=1)  # noqa: E731
    kept, parents = jax.vmap(lambda s, p: rerank(s, p, tree.num_kept, by_rank=count is not None))(cand(cand_scores),
                                                                                        cand(cand_parents))
    take = lambda x: jnp.take_along_axis(x, kept, axis=1)  # noqa: E731
    tokens = jnp.concatenate([root[:, None], take(cand(cand_tokens))], axis=1)
    fed = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), take(cand(cand_fed))], axis=1)
    parent_logits = probs = None
    if need_logits:  # every parent was fed (or is the root): its logits exist
        parent_fed = jnp.take_along_axis(fed, parents[:, 1:], axis=1)
        parent_logits = jnp.take_along_axis(cand(raws), parent_fed[:, :, None], axis=1)
    if sampled:  # a node with children was fed; a never-fed leaf's row (the root's) is not read
        probs = jnp.take_along_axis(cand(fed_probs), jnp.maximum(fed, 0)[:, :, None], axis=1)
    # A sized cycle drafts min(count, depth) levels, and always its first step (count 0: the catch-up).
    forwards = jnp.int32(depth) if count is None else jnp.clip(count, 1, depth).astype(jnp.int32)
    return _DynamicDrafts(tokens, parents, fed, parent_logits, probs, bad, forwards), cache


# ---------------------------------------------------------------------------
# 2. verify
# ---------------------------------------------------------------------------


class _TreeVerified(NamedTuple):
    raw: Array  # [B, N, V] target logits before the warp (checked for non-finite values)
    target_logits: Array  # [B, N, V] warped (raw when greedy): row j judges node j's children
    target_probs: Array  # [B, N, V] softmax(target_logits)
    hidden: dict  # {layer: [B, N, H]} the rule's hidden_layers, at each node's own position
    head_hidden: Any  # [B, N, n H] a feature head's layers, concatenated (None for a draft model)
    cache: KVCache  # the target cache after the forward (the commit keeps the accepted path)


def _verify(cfg: LoopConfig, pair_params: ModelPair, rule: AcceptanceRule, state: DecodeState,
            drafted: _DraftedTree, temperature, top_p, rows=None, hist=None, size=None) -> _TreeVerified:
    """One target forward over all ``N`` nodes with tree attention: row ``j``
    of its logits judges node ``j``'s children (processed after node ``j``'s path).
    ``size`` (a sized cycle's index into ``cfg.verify_widths``): the forward runs
    over the first ``width`` nodes only (the root alone at index 0), and the rows
    past them come back zero (no walk reaches those nodes: their parents are ``-1``)."""
    head = pair_params.draft.module
    head_layers = head.feature_layers if is_feature_head(head) else ()
    layers = tuple(rule.hidden_layers) + head_layers
    target, vocab, full = pair_params.target, pair_params.vocab_size, drafted.tokens.shape[1]

    def scored(width, cache):
        """The forward over the first ``width`` nodes and their distributions, padded to all ``N``:
        ``(raw, target_logits, target_probs, hidden, cache)`` (the softmaxes over the vocabulary
        are a tree cycle's largest work past the forwards: only the verified rows pay them)."""
        parents = drafted.parents if isinstance(drafted.parents, np.ndarray) else drafted.parents[:, :width]
        out = target.module.apply(target.params, drafted.tokens[:, :width], cache, tree_parents=parents,
                                  hidden_layers=layers)
        raw = out.logits[..., :vocab]
        processed = raw
        if hist is not None:
            every = drafted.parents[None] if isinstance(drafted.parents, np.ndarray) else drafted.parents
            paths = node_paths(jnp.asarray(every), jnp.arange(width)[None], cfg.num_draft)
            processed = _processed(rows, hist, raw, drafted.tokens, paths)
        target_logits = warp(cfg, processed, temperature, top_p, rows)
        rows_out = (raw, target_logits, jax.nn.softmax(target_logits, axis=-1), tuple(out.hidden))
        if width < full:
            pad = lambda x: jnp.pad(x, [(0, 0), (0, full - width)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
            rows_out = jax.tree_util.tree_map(pad, rows_out)
        return rows_out + (out.cache,)

    if size is None:
        raw, target_logits, target_probs, hidden, cache = scored(full, state.target_cache)
    else:
        shapes = jax.eval_shape(lambda c: scored(full, c), state.target_cache)
        blank = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[:4])
        raw, target_logits, target_probs, hidden, cache = switch_in_place(
            size, [lambda o, w=w: scored(w, o[4]) for w in cfg.verify_widths], blank + (state.target_cache,))
    head_hidden = None
    if head_layers:
        head_hidden = jnp.concatenate(hidden[len(hidden) - len(head_layers):], axis=-1)
    return _TreeVerified(raw=raw, target_logits=target_logits, target_probs=target_probs,
                         hidden=dict(zip(rule.hidden_layers, hidden)), head_hidden=head_hidden, cache=cache)


# ---------------------------------------------------------------------------
# 3. accept
# ---------------------------------------------------------------------------


class _TreeAccepted(NamedTuple):
    verdict: TreeVerdict  # [B]-batched: the accepted path, its length and the emitted token
    num_accepted: Array  # [B] n: the accepted path's draft tokens
    # [B, N] each node's Path code as a relaxed rule judged it (None for the lossless rule).
    node_codes: Any
    live: Array  # [B] live before the cycle, with finite logits: the sequences that commit
    new_bad: Array  # [B] int32: this cycle's non-finite logits (1 target, 2 draft), else 0
    bad: Array  # [B] int32: the first non-finite logits each sequence met (sticky)


def _accept(cfg: LoopConfig, rule: AcceptanceRule, state: DecodeState, drafted: _DraftedTree,
            verified: _TreeVerified, uniforms, emit_uniform, rows=None) -> _TreeAccepted:
    """The walk down each sequence's tree (:func:`_walk`) keeps the accepted
    path and emits one more token. A lossless rule (``rule.lossless``) is the
    walk's own test; greedy, a relaxed rule judges every node at once as a
    child of its parent (:func:`_rule_on_nodes`); sampling, the walk asks it
    about each child in turn (:func:`_judge_child`). Greedy rows among sampled
    ones walk greedily, as a greedy loop does; ``rows.draft_cap`` limits a
    row's path. A sequence whose path read non-finite logits stops and emits nothing."""
    verdict, node_codes = _walk_all(cfg, rule, state, drafted, verified, uniforms, emit_uniform, rows, cfg.greedy)
    if greedy_rows(cfg, rows) is not None:
        greedy = _walk_all(cfg, rule, state, drafted, verified, uniforms, emit_uniform, rows, True)
        verdict, node_codes = with_greedy_rows(cfg, rows, (verdict, node_codes), lambda: greedy)
    n = verdict.num_accepted
    # Only the nodes the walk visited (the root and the n accepted ones) were
    # read, as a chain reads only its rows up to n: a NaN row at a sibling the
    # path never entered changes nothing that is committed.
    on_path = jnp.arange(verdict.path.shape[1])[None, :] <= n[:, None]
    target_bad = (jnp.take_along_axis(sampling.nonfinite_rows(verified.raw), verdict.path, axis=1) & on_path).any(1)
    new_bad, bad = nonfinite_codes(state, drafted.bad, target_bad)
    return _TreeAccepted(verdict=verdict, num_accepted=n, node_codes=node_codes, live=~state.done & (new_bad == 0),
                         new_bad=new_bad, bad=bad)


def _walk_all(cfg: LoopConfig, rule: AcceptanceRule, state: DecodeState, drafted: _DraftedTree,
              verified: _TreeVerified, uniforms, emit_uniform, rows, greedy: bool):
    """Every sequence's walk, greedy or sampling (static ``greedy``):
    ``(TreeVerdict [B]-batched without path codes, node codes [B, N] or None)``."""
    walk = functools.partial(_walk, cfg.tree)
    shape = _walk_shape(cfg.tree, drafted)
    limit = _draft_limit(rows)
    limits = jnp.full(drafted.tokens.shape[:1], cfg.tree.max_depth, jnp.int32) if limit is None else limit
    inputs = (drafted.tokens, verified.target_logits, verified.target_probs, uniforms, emit_uniform, limits)
    node_codes = None
    if not rule.lossless and greedy:
        node_accept, node_fix, node_codes = _rule_on_nodes(
            rule, drafted.tokens, drafted.node_parents, drafted.parent_logits, verified.target_logits,
            verified.target_probs, verified.hidden, state.rule_state, rows)
        verdict = jax.vmap(lambda s, a, fix, *xs: walk(s, *xs, greedy=True, node_accept=a, node_correction=fix))(
            shape, node_accept, node_fix, *inputs)
    elif not rule.lossless:
        judge_data = (verified.target_logits, drafted.child_draft_logits, verified.hidden, state.rule_state)
        if rows is not None and rows.rules is not None:  # each row judges with its own numbers
            verdict = jax.vmap(lambda r, s, data, *xs: walk(s, *xs, greedy=False,
                                                            judge=functools.partial(_judge_child, r),
                                                            judge_data=data))(rows.rules, shape, judge_data, *inputs)
        else:
            verdict = jax.vmap(lambda s, data, *xs: walk(s, *xs, greedy=False,
                                                         judge=functools.partial(_judge_child, rule),
                                                         judge_data=data))(shape, judge_data, *inputs)
        node_codes = verdict.path_codes
    else:
        verdict = jax.vmap(lambda s, *xs: walk(s, *xs, greedy=greedy))(shape, *inputs)
    return verdict._replace(path_codes=None), node_codes


def _walk_shape(tree, drafted: _DraftedTree) -> tuple:
    """What :func:`_walk` reads of a sequence's tree besides the models' rows
    (``[B]``-batched): a static tree's ``(draft_probs,)``, a dynamic tree's
    ``(parents, draft_probs or None)``."""
    if isinstance(tree, DynamicTree):
        return drafted.parents, drafted.probs
    return (drafted.probs,)


def _walk(tree, shape: tuple, tokens, target_logits, target_probs, uniforms, emit_uniform, limit,
          **kwargs) -> TreeVerdict:
    """One sequence's walk down its tree: :func:`specjax._src.proposals.trees.verify_tree`
    for a static tree, :func:`specjax._src.proposals.trees.verify_dynamic_tree` for a
    dynamic one (``shape``: :func:`_walk_shape`'s, one sequence's; ``limit``:
    the deepest node it may accept)."""
    if isinstance(tree, DynamicTree):
        parents, draft_probs = shape
        return verify_dynamic_tree(parents, tokens, target_logits, target_probs, uniforms, emit_uniform,
                                   depth=tree.max_depth, width=tree.top_k, draft_probs=draft_probs, limit=limit,
                                   **kwargs)
    (draft_probs,) = shape
    return verify_tree(tree, tokens, target_logits, target_probs, draft_probs, uniforms, emit_uniform, limit=limit,
                       **kwargs)


def _rule_on_nodes(rule: AcceptanceRule, tokens: Array, parents, parent_logits: Array, target_logits,
                   target_probs, hidden: dict, rule_state, rows=None) -> tuple[Array, Array, Array]:
    """A greedy rule's verdict on every node as a child of its parent:
    ``(accept [B, N], correction token [B, N], path code [B, N])`` (node 0: none).

    ``parents``: the non-root nodes' parents, ``[N - 1]`` (numpy, a static
    tree) or ``[B, N - 1]`` (traced, a dynamic tree); ``parent_logits [B, N -
    1, V]``: the draft's logits each node was drafted from (at its parent).
    The rule sees the ``N - 1`` non-root nodes as the slots of one block, slot
    ``i`` (node ``i + 1``) judged by its parent's distributions. That is exact
    for rules that decide a slot from its own distributions alone (every
    stateless built-in rule); each node's hidden states are at its own position.
    """
    batch, n = tokens.shape
    if isinstance(parents, np.ndarray):
        at_parents = lambda x: x[:, parents]  # noqa: E731
    else:
        at_parents = lambda x: jnp.take_along_axis(x, parents[:, :, None], axis=1)  # noqa: E731
    judge = lambda x: jnp.concatenate([at_parents(x), x[:, :1]], axis=1)  # noqa: E731 (+ an unused bonus row)
    features = {"hidden": {layer: h[:, 1:] for layer, h in hidden.items()}} if hidden else {}
    inputs = VerifyInputs(
        draft_tokens=tokens[:, 1:], draft_logits=parent_logits, draft_probs=jax.nn.softmax(parent_logits, axis=-1),
        target_logits=judge(target_logits), target_probs=judge(target_probs),
        uniforms=jnp.zeros((batch, n - 1), jnp.float32),
        valid=jnp.ones((batch, n - 1), bool), features=features,
    )
    verdict = per_row_rule(rule, rows, "verify", True, inputs, rule_state)
    pad = lambda x, v: jnp.concatenate([jnp.full((batch, 1), v, x.dtype), x], axis=1)  # noqa: E731
    return (pad(jnp.asarray(verdict.accept, bool), False), pad(sampling.argmax(verdict.correction), 0),
            pad(jnp.asarray(verdict.path, jnp.int32), Path.REJECTED))


def _judge_child(rule: AcceptanceRule, data, child, node, token, p, q, uniform):
    """A relaxed rule's verdict on one tree child when sampling (the walk's
    ``judge``, :func:`specjax._src.proposals.trees._walk`): the child as a one-slot
    block whose ``target_probs`` / ``draft_probs`` are what its earlier
    siblings left, and whose logits are the models' at the node (see
    :class:`~specjax.rules.VerifyInputs`). ``data``: the sequence's
    ``(target_logits [N, V], child_draft_logits [N, V], hidden, rule_state)``."""
    target_logits, child_draft_logits, hidden, rule_state = data
    features = {"hidden": {layer: h[child][None] for layer, h in hidden.items()}} if hidden else {}
    inputs = VerifyInputs(
        draft_tokens=token[None], draft_logits=child_draft_logits[child][None], draft_probs=q[None],
        target_logits=jnp.stack([target_logits[node]] * 2), target_probs=jnp.stack([p, p]),
        uniforms=uniform[None], valid=jnp.ones((1,), bool), features=features,
    )
    verdict = rule.verify(inputs, rule_state, greedy=False)
    return jnp.asarray(verdict.accept[0], bool), verdict.correction[0], jnp.asarray(verdict.path[0], jnp.int32)


# ---------------------------------------------------------------------------
# 4. commit
# ---------------------------------------------------------------------------


def _commit(pair_params: ModelPair, state: DecodeState, drafted: _DraftedTree, verified: _TreeVerified,
            accepted: _TreeAccepted, draft_cache: KVCache, prompt_lengths, max_new, eos_ids) -> tuple[Committed, Any]:
    """Commits the accepted path's tokens and the emitted token
    (:func:`specjax._src.engine.cycle.commit_block`); both caches keep the
    accepted path (:meth:`KVCache.keep_path`: its rows move into place) and
    roll back to the chain loop's invariants. Returns the commit and a
    feature head's next inputs, the target's features on the accepted path
    ``[B, D + 1, H]`` (None for a draft model)."""
    nc = state.num_committed
    start = nc - 1
    path, n = accepted.verdict.path, accepted.num_accepted
    path_tokens = jnp.take_along_axis(drafted.tokens, path[:, 1:], axis=1)  # [B, D], root excluded
    tokens, n_commit, finished = commit_block(state, path_tokens, n, accepted.verdict.token, accepted.live,
                                              prompt_lengths, max_new, eos_ids)
    new_nc = nc + n_commit
    # The target cache keeps the root and the first n_commit - 1 path nodes
    # (everything committed but the last token); the draft one path node less.
    target_cache = verified.cache.keep_path(start, path, n_commit)
    draft_features = None
    if verified.head_hidden is not None:  # a feature head rewrites its tree from the target's features on the path
        path_hidden = jnp.take_along_axis(verified.head_hidden, path[:, :, None], axis=1)
        draft_features = pair_params.draft.module.target_features(pair_params.draft.params, path_hidden)
    elif drafted.fed is not None:
        # The draft holds the fed tree at start + fed slot. The kept path nodes
        # (all but the last committed two tokens' nodes) each have an accepted
        # child, so they were frontier nodes, all fed; entries past the kept
        # count are ignored (a never-fed leaf reads slot 0, the root).
        fed_path = jnp.maximum(jnp.take_along_axis(drafted.fed, path, axis=1), 0)
        draft_cache = draft_cache.keep_path(start, fed_path, jnp.maximum(n_commit - 1, 0))
    else:
        draft_cache = draft_cache.keep_path(start, path, jnp.maximum(n_commit - 1, 0))
    committed = Committed(
        tokens=tokens,
        num_committed=new_nc,
        num_new=n_commit,
        done=state.done | (accepted.new_bad > 0) | finished,
        target_cache=target_cache.rollback(new_nc - 1),
        draft_cache=draft_cache.rollback(draft_keep(state, new_nc)),
    )
    return committed, draft_features


def _logprobs(state: DecodeState, drafted: _DraftedTree, verified: _TreeVerified, accepted: _TreeAccepted,
              rows=None):
    """The committed path's log-probabilities: slot ``k`` scored under the
    target's distribution at path node ``k``, which judged node ``k + 1``
    and, at the end of the path, gave the emitted token
    (:func:`specjax._src.engine.cycle.cycle_logprobs`)."""
    path, n = accepted.verdict.path, accepted.num_accepted
    path_tokens = jnp.take_along_axis(drafted.tokens, path[:, 1:], axis=1)
    block = committed_block(path_tokens, n, accepted.verdict.token)
    return cycle_logprobs(state, jnp.take_along_axis(verified.target_logits, path[:, :, None], axis=1), block, rows)


# ---------------------------------------------------------------------------
# 5. record
# ---------------------------------------------------------------------------


def _record(cfg: LoopConfig, rule: AcceptanceRule, state: DecodeState, drafted: _DraftedTree, verified: _TreeVerified,
            accepted: _TreeAccepted, committed: Committed, uniforms, need_view: bool, rows=None, count=None):
    """What the cycle leaves for later, for live sequences only: the stats
    with ``K`` = the tree's depth (each cycle judges one path), and, from the
    decided path as a chain block (:func:`_path_as_chain`), a stateful rule's
    running state and the ``diagnostics`` hook's values. Returns
    ``(rule_state, stats, diagnostics or None)``."""
    tree = cfg.tree
    depth = tree.max_depth
    verdict, n, live = accepted.verdict, accepted.num_accepted, accepted.live
    batch = n.shape[0]
    # Slot n was judged only if the walk stopped at a node with children; a
    # dynamic tree's path can end at a leaf above full depth, and the token
    # emitted there is a bonus, not a correction.
    stop = jnp.take_along_axis(verdict.path, n[:, None], axis=1)[:, 0]
    stop_has_child = jax.vmap(lambda t, j: t[j, 0] >= 0)(drafted.table, stop)
    limit = _draft_limit(rows)
    if limit is not None:  # a path cut at the row's draft cap ends at a leaf for that row
        stop_has_child = stop_has_child & (n < limit)
    judged = jnp.where(jnp.arange(depth)[None, :] == n[:, None], stop_has_child[:, None], True)
    if accepted.node_codes is not None:  # each accepted node's own path code (exact / relaxed / pardon)
        paths = jnp.take_along_axis(accepted.node_codes, verdict.path[:, 1:], axis=1)
    else:
        paths = jnp.full((batch, depth), Path.EXACT, jnp.int32)
    paths = jnp.where(jnp.arange(depth)[None, :] < n[:, None], paths, Path.REJECTED).astype(jnp.int32)
    rule_state, diag = state.rule_state, None
    if need_view:
        view = jax.vmap(_path_as_chain)(drafted.table, verdict.path, n, paths, drafted.tokens,
                                        drafted.child_draft_logits, verified.target_logits, uniforms, verified.hidden)
        if _stateful(state):  # e.g. AdaSD's running means: the rule updates from the decided path, as from a chain
            args = (rule_state,) + tuple(view) + (n,)
            rule_state = with_greedy_rows(cfg, rows, per_row_rule(rule, rows, "update", cfg.greedy, *args),
                                          lambda: per_row_rule(rule, rows, "update", True, *args))
            rule_state = where_b(live, rule_state, state.rule_state)
        diag = live_diagnostics(cfg, live, *view, n)
    stats = record_cycle(state.stats, live=live, valid=judged, num_accepted=n, num_committed=committed.num_new,
                         paths=paths, draft_forwards=drafted.forwards,
                         verified=_verified_nodes(tree) if count is None else count + 1)
    return rule_state, stats, diag


def _path_as_chain(table, path, n, codes, tokens, child_draft_logits, target_logits, uniforms,
                   hidden) -> tuple[VerifyInputs, Verdict]:
    """One sequence's decided path as a chain block, for a stateful rule's
    ``update`` and a ``diagnostics`` hook: slot ``s < n`` the accepted path node ``s + 1``, slot ``n`` the
    first child rejected at the node the walk stopped at (invalid when that
    node is a leaf), later slots invalid. The rows are the models' own
    distributions at each slot's parent (``softmax`` of the logits). The
    verdict accepts the first ``n`` slots with their path ``codes [D]``; its
    correction rows are the target's distributions (a tree's corrections are
    per child, not per slot)."""
    depth = path.shape[0] - 1
    slot = jnp.arange(depth)
    stop_child = table[path[n], 0]
    node = jnp.where(slot < n, path[1:], jnp.where(slot == n, jnp.maximum(stop_child, 0), 0))
    valid = (slot < n) | ((slot == n) & (stop_child >= 0))
    draft_logits, logits = child_draft_logits[node], target_logits[path]
    features = {"hidden": {layer: h[node] for layer, h in hidden.items()}} if hidden else {}
    inputs = VerifyInputs(
        draft_tokens=tokens[node], draft_logits=draft_logits, draft_probs=jax.nn.softmax(draft_logits, axis=-1),
        target_logits=logits, target_probs=jax.nn.softmax(logits, axis=-1), uniforms=uniforms[node],
        valid=valid, features=features,
    )
    return inputs, Verdict(accept=slot < n, path=codes, correction=inputs.target_probs[:depth])


TREE = Cycle("tree", _tree_cycle)
"""The tree cycle: a static or dynamic token tree, one verification of all its nodes."""
