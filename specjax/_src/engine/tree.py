"""One draft-verify cycle over a token tree (``decode(..., tree=static_tree(...))``).

The same five steps as the chain cycle (:mod:`specjax._src.engine.chain`), as
the same five functions, with a tree of draft tokens in place of a chain.
:func:`_tree_cycle` is the whole cycle (:data:`TREE`, a
:class:`specjax._src.engine.cycle.Cycle` of the chain's signature)::

    keys, uniforms = _tree_uniforms(...)  # the cycle's randomness, from one key per sequence
    drafted   = draft_nodes(...) # the tree: a static one level by level, a dynamic one expanded and reranked
    verified  = _verify(...)     # one target forward over all N nodes with tree attention
    accepted  = _accept(...)     # the walk down the tree: the accepted path and the emitted token
    committed = _commit(...)     # the path's tokens written, both caches keep the path and roll back
    ...       = _record(...)     # stats, a stateful rule's state and diagnostics from the path

What it shares with the chain cycle (the first draft step, the block
commit, the draft cache's invariant, the non-finite codes, the state after a
cycle) is in :mod:`specjax._src.engine.cycle`; the draft step is in
:mod:`specjax._src.engine.tree_drafting`. Step by step:

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
by :func:`~specjax._src.engine.tree_drafting.draft_dynamic` instead: ``depth`` draft forwards, each over the
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
    greedy_rows,
    live_diagnostics,
    live_settings,
    next_state,
    nonfinite_codes,
    per_row_rule,
    with_greedy_rows,
)
from specjax._src.engine.ops import cond_in_place, switch_in_place, warp, where_b
from specjax._src.engine.plain import draft_can_wait, plain_cycle
from specjax._src.models.lm import KVCache
from specjax._src.models.feature_head import is_feature_head
from specjax._src.models.pairing import ModelPair
from specjax._src.rules.base import AcceptanceRule, Path, Verdict, VerifyInputs
from specjax._src.engine.stats import record_cycle
from specjax._src.engine.tree_drafting import DraftedTree, draft_nodes, node_paths, processed_logits
from specjax._src.proposals.trees import (DynamicTree, TreeVerdict, verify_dynamic_tree,
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
    processed after the tokens on its path, :func:`~specjax._src.engine.tree_drafting.processed_logits`), and the draft
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
    drafted, draft_cache = draft_nodes(cfg, pair_params, rule, state, draft_keys, temperature, top_p, need_view, rows,
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
        policy_state = where_b(accepted.live, _learn_sizes(cfg, policy, state, drafted, verified, accepted, count, rows),
                               policy_state)
    new_state = next_state(state, committed, bad=accepted.bad, rule_state=rule_state,
                           policy_state=policy_state, stats=stats, draft_features=draft_features,
                           logprobs=logprobs)
    return new_state, diag


def _learn_sizes(cfg: LoopConfig, policy, state: DecodeState, drafted: DraftedTree, verified: _TreeVerified,
                 accepted: _TreeAccepted, count: Array, rows):
    """The policy's state after a sized cycle: the ``count`` best-ranked nodes were
    judged, and those on the accepted path were accepted. A row whose draft cap cut
    its walk short of the tree's depth tells nothing about the deeper ranks: it only decays.
    A cycle that verified no node but ran the draft's first step (its catch-up) judges the
    best-ranked node against the root's target distribution (:func:`_first_node_acceptance`),
    as a chain's plain cycle judges its first slot: else plain cycles teach nothing, every
    estimate drifts back to its prior, and the tree is drafted again where it does not pay."""
    learned = _learn_verified(policy, state, accepted, count, rows)
    first = jax.vmap(policy.update_tree_first)(state.policy_state, _first_node_acceptance(cfg, drafted, verified))
    return jax.tree_util.tree_map(lambda a, b: jnp.where(count == 0, a, b), first, learned)


def _first_node_acceptance(cfg: LoopConfig, drafted: DraftedTree, verified: _TreeVerified) -> Array:
    """``[B]`` how likely the best-ranked node (node 1, a child of the root) was to be
    accepted, judged by the root's target distribution ``p``: greedy, whether it is the
    target's pick; sampled, ``min(1, p(x) / q(x))`` for a child drawn from the draft's
    ``q``, and ``p(x)`` for a point-mass child (a top-k one)."""
    x = drafted.tokens[:, 1]
    if cfg.greedy:
        return (jnp.argmax(verified.target_logits[:, 0], axis=-1) == x).astype(jnp.float32)
    p = jnp.take_along_axis(verified.target_probs[:, 0], x[:, None], axis=-1)[:, 0]
    if drafted.probs is None:
        return p.astype(jnp.float32)
    q = jnp.take_along_axis(drafted.probs[:, 0], x[:, None], axis=-1)[:, 0]
    return jnp.clip(p / jnp.maximum(q, jnp.finfo(jnp.float32).tiny), 0.0, 1.0).astype(jnp.float32)


def _learn_verified(policy, state: DecodeState, accepted: _TreeAccepted, count: Array, rows):
    """:func:`_learn_sizes` for a cycle that verified ``count`` nodes."""
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
            drafted: DraftedTree, temperature, top_p, rows=None, hist=None, size=None) -> _TreeVerified:
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
            processed = processed_logits(rows, hist, raw, drafted.tokens, paths)
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


def _accept(cfg: LoopConfig, rule: AcceptanceRule, state: DecodeState, drafted: DraftedTree,
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


def _walk_all(cfg: LoopConfig, rule: AcceptanceRule, state: DecodeState, drafted: DraftedTree,
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


def _walk_shape(tree, drafted: DraftedTree) -> tuple:
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


def _commit(pair_params: ModelPair, state: DecodeState, drafted: DraftedTree, verified: _TreeVerified,
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


def _logprobs(state: DecodeState, drafted: DraftedTree, verified: _TreeVerified, accepted: _TreeAccepted,
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


def _record(cfg: LoopConfig, rule: AcceptanceRule, state: DecodeState, drafted: DraftedTree, verified: _TreeVerified,
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
