"""The draft step of a token-tree cycle (:mod:`specjax._src.engine.tree`).

:func:`draft_nodes` drafts a cycle's tree: a static tree level by level
(each breadth-first level's children are its ``branching[d]`` best tokens, or
a draw without replacement from the warped draft distribution, and each level
but the last is fed to the draft in one forward with tree attention), a
dynamic one by EAGLE-2's expansion and rerank (:func:`draft_dynamic`;
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees",
arXiv:2406.16858). It returns a :class:`DraftedTree`, which the cycle's
verification, walk and commit read.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.logits import processors as processors_lib
from specjax._src.logits import sampling
from specjax._src.engine.config import DecodeState, LoopConfig
from specjax._src.engine.cycle import (
    first_draft_logits,
    first_head_logits,
    usable_reduced,
    with_greedy_rows,
)
from specjax._src.engine.ops import cond_in_place, gather, warp
from specjax._src.engine.plain import first_draft_step
from specjax._src.models.lm import KVCache, ReducedLogits
from specjax._src.models.feature_head import is_feature_head
from specjax._src.models.pairing import ModelPair
from specjax._src.rules.base import AcceptanceRule
from specjax._src.proposals.trees import (DynamicTree, TokenTree, children_table, levels, rerank,
                                sample_children, slot_scores, top_ranked, uniform_branching)


Array = jax.Array


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


def processed_logits(rows, hist, raw: Array, tokens: Array, follows: Array) -> Array:
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


class DraftedTree(NamedTuple):
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


def draft_nodes(cfg: LoopConfig, pair_params: ModelPair, rule: AcceptanceRule, state: DecodeState, draft_keys,
           temperature, top_p, need_view: bool, rows=None, hist=None, count=None) -> tuple[DraftedTree, KVCache]:
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
        return DraftedTree(tokens=drafts.tokens, parents=parents, table=table, probs=drafts.probs,
                            parent_logits=parent_logits, fed=drafts.fed, bad=drafts.bad,
                            forwards=drafts.forwards), cache
    drafts, cache = _draft_tree(cfg, tree, pair_params, state, draft_keys, temperature, top_p, rows, hist)
    parents = np.asarray(tree.parents, np.int32)  # static: the mask is built on the host
    static_table = tree.children_table()
    table = jnp.broadcast_to(jnp.asarray(static_table), (batch,) + static_table.shape)
    return DraftedTree(tokens=drafts.tokens, parents=parents, table=table, probs=drafts.probs,
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
            raw, reduced = processed_logits(rows, hist, raw, tokens, paths[:, lo:hi]), None
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
        raw0 = processed_logits(rows, hist, raw0[:, None], fed_tokens, jnp.zeros((1, 1, tree.num_fed + 1), bool))[:, 0]
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
            raw = processed_logits(rows, hist, raw, fed_tokens, node_paths(fed_parents, front_slots, d))
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
