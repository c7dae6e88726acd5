"""One draft-verify cycle over a token tree (``decode(..., tree=static_tree(...))``).

The same five steps as the chain cycle (:mod:`specjax._src.cycle`), with a
tree of draft tokens in place of a chain:

* draft: the draft's ``T = 2`` first step gives its distribution at the root
  (the last committed token, node 0); each breadth-first level's children are
  its ``branching[d]`` best tokens (greedy) or a draw without replacement
  (Gumbel top-k) from the warped draft distribution, and each level but the
  last is fed to the draft in one forward with tree attention
  (``tree_offset``), which gives the next level's distributions;
* verify: one target forward over all ``N`` nodes with tree attention: row
  ``j`` of its logits judges node ``j``'s children;
* accept: :func:`specjax._src.trees.verify_tree` walks down the tree (greedy:
  the child equal to the target's argmax; sampling: recursive rejection
  sampling without replacement, exact);
* commit: the accepted path's tokens and the emitted token, cut at EOS and
  ``max_new_tokens``; both caches keep the accepted path
  (:meth:`KVCache.keep_path`: the path's rows move into place) and roll back
  to the chain loop's invariants;
* record: stats with ``K`` = the tree's depth (each cycle judges one path).

Node ``j`` of the tree sits in cache slot ``start + j`` with ``start =
num_committed - 1``, the root's own slot, in both caches. A feature head
(:mod:`specjax.heads`) holds node ``j`` one slot earlier (its position ``i``
reads token ``x_{i+1}``): its first step ends at the root, node ``j`` reads
its parent's predicted feature, and after the commit it keeps only what it
built from the target's features; the accepted path's target features are
its next cycle's first inputs, as in the chain cycle.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src import sampling
from specjax._src.calls import _Config
from specjax._src.cycle import _commit_block, _DecodeState, _draft_keep, _first_draft_logits, _first_head_logits
from specjax._src.lm import KVCache
from specjax._src.loop_ops import _gather, _warp
from specjax._src.models.feature_head import is_feature_head
from specjax._src.pairing import ModelPair
from specjax._src.rules.base import AcceptanceRule, Path, SpeculativeSampling, VerifyInputs
from specjax._src.stats import record_cycle
from specjax._src.trees import TokenTree, levels, sample_children, uniform_branching, verify_tree

Array = jax.Array


class _TreeDrafts(NamedTuple):
    tokens: Array  # [B, N] node tokens (node 0: the root, the last committed token)
    logits: Array  # [B, N, V] the warped draft logits at each node (raw when greedy)
    probs: Array  # [B, N, V] the draft distribution each node's children were drawn from
    bad: Array  # [B] the draft's logits were non-finite somewhere
    forwards: Array  # scalar int32


def _children(cfg: _Config, raw: Array, keys: Array, num: int, temperature, top_p):
    """``(children [B, M, num], logits [B, M, V], probs [B, M, V])`` for ``M``
    nodes' raw draft logits ``[B, M, V]``."""
    logits = _warp(cfg, raw, temperature, top_p)
    probs = jax.nn.softmax(logits, axis=-1)
    if cfg.greedy:
        return sampling.top_indices(raw, num), logits, probs
    m = raw.shape[1]
    pick = jax.vmap(jax.vmap(sample_children, in_axes=(0, 0, None)), in_axes=(0, 0, None))
    node_keys = jax.vmap(lambda k: jax.random.split(k, m))(keys)
    return pick(node_keys, probs, num), logits, probs


def _draft_tree(cfg: _Config, tree: TokenTree, pair_params: ModelPair, state: _DecodeState, draft_keys,
                temperature, top_p) -> tuple[_TreeDrafts, KVCache]:
    module, params = pair_params.draft.module, pair_params.draft.params
    vocab = pair_params.vocab_size
    batch = state.num_committed.shape[0]
    branching = uniform_branching(tree)
    spans = levels(tree)
    head = is_feature_head(module)
    if head:  # the root's own prediction; node j then reads its parent's f_hat
        raw0, root_feature, cache = _first_head_logits(cfg, module, params, vocab, state)
        node_features = jnp.zeros((batch, tree.num_nodes, root_feature.shape[-1]), jnp.float32)
        node_features = node_features.at[:, 0].set(root_feature)
    else:
        raw0, cache = _first_draft_logits(module, params, vocab, state)
    root = _gather(state.tokens, state.num_committed - 1)
    tokens = jnp.zeros((batch, tree.num_nodes), jnp.int32).at[:, 0].set(root)
    probs = jnp.zeros((batch, tree.num_nodes, vocab), jnp.float32)
    logits = jnp.zeros((batch, tree.num_nodes, vocab), jnp.float32)
    bad = sampling.nonfinite_rows(raw0)
    raw = raw0[:, None]  # [B, 1, V]: the root level
    parents = np.asarray(tree.parents, np.int32)  # static: the mask is built on the host
    forwards = 1
    for d, (lo, hi) in enumerate(spans[:-1]):
        keys = jax.vmap(lambda k: jax.random.fold_in(k, d))(draft_keys) if draft_keys is not None else None
        kids, level_logits, level_probs = _children(cfg, raw, keys, branching[d], temperature, top_p)
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
            bad = bad | sampling.nonfinite_rows(raw).any(1)
            forwards += 1
    return _TreeDrafts(tokens, logits, probs, bad, jnp.int32(forwards)), cache


def _rule_on_nodes(tree: TokenTree, rule: AcceptanceRule, drafts: _TreeDrafts, target_logits, target_probs,
                   hidden: dict, rule_state) -> tuple[Array, Array, Array]:
    """A greedy rule's verdict on every node as a child of its parent:
    ``(accept [B, N], correction token [B, N], path code [B, N])`` (node 0: none).

    The rule sees the ``N - 1`` non-root nodes as the slots of one block, slot
    ``i`` (node ``i + 1``) judged by its parent's distributions. That is exact
    for rules that decide a slot from its own distributions alone (every
    stateless built-in rule); each node's hidden states are at its own position.
    """
    parents = jnp.asarray(tree.parents[1:], jnp.int32)
    batch = drafts.tokens.shape[0]
    judge = lambda x: jnp.concatenate([x[:, parents], x[:, :1]], axis=1)  # noqa: E731 (+ an unused bonus row)
    features = {"hidden": {layer: h[:, 1:] for layer, h in hidden.items()}} if hidden else {}
    inputs = VerifyInputs(
        draft_tokens=drafts.tokens[:, 1:], draft_logits=drafts.logits[:, parents],
        draft_probs=drafts.probs[:, parents], target_logits=judge(target_logits), target_probs=judge(target_probs),
        uniforms=jnp.zeros((batch, tree.num_nodes - 1), jnp.float32),
        valid=jnp.ones((batch, tree.num_nodes - 1), bool), features=features,
    )
    verdict = jax.vmap(lambda i, s: rule.verify(i, s, greedy=True))(inputs, rule_state)
    pad = lambda x, v: jnp.concatenate([jnp.full((batch, 1), v, x.dtype), x], axis=1)  # noqa: E731
    return (pad(jnp.asarray(verdict.accept, bool), False), pad(sampling.argmax(verdict.correction), 0),
            pad(jnp.asarray(verdict.path, jnp.int32), Path.REJECTED))


def _tree_cycle(
    cfg: _Config, pair_params: ModelPair, rule: AcceptanceRule, prompt_lengths, max_new, eos_ids, seq_keys,
    temperature, top_p, state: _DecodeState,
):
    """One tree cycle: the lossless rule (greedy or sampling), or a stateless
    relaxed rule when greedy. Returns ``(state, None)``."""
    tree: TokenTree = cfg.tree
    depth, n_nodes = tree.max_depth, tree.num_nodes
    nc, done = state.num_committed, state.done
    batch = nc.shape[0]
    start = nc - 1
    if cfg.greedy:
        draft_keys = None
        uniforms = jnp.zeros((batch, n_nodes), jnp.float32)
        emit_uniform = jnp.zeros((batch,), jnp.float32)
    else:
        cycle_keys = jax.vmap(lambda k: jax.random.fold_in(k, state.step))(seq_keys)
        draft_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(cycle_keys)
        u = jax.vmap(lambda k: sampling.uniform_open(jax.random.fold_in(k, 2), (n_nodes + 1,)))(cycle_keys)
        uniforms, emit_uniform = u[:, :n_nodes], u[:, n_nodes]

    # ---- draft, verify ----
    drafts, draft_cache = _draft_tree(cfg, tree, pair_params, state, draft_keys, temperature, top_p)
    head = pair_params.draft.module
    head_layers = (head.feature_layer,) if is_feature_head(head) else ()
    out = pair_params.target.module.apply(pair_params.target.params, drafts.tokens, state.target_cache,
                                          tree_parents=np.asarray(tree.parents, np.int32),
                                          hidden_layers=tuple(rule.hidden_layers) + head_layers)
    raw = out.logits[..., : pair_params.vocab_size]
    target_logits = _warp(cfg, raw, temperature, top_p)
    target_probs = jax.nn.softmax(target_logits, axis=-1)

    # ---- accept ----
    relaxed = not isinstance(rule, SpeculativeSampling)
    if relaxed:
        hidden = dict(zip(rule.hidden_layers, out.hidden))
        node_accept, node_fix, node_code = _rule_on_nodes(tree, rule, drafts, target_logits, target_probs, hidden,
                                                          state.rule_state)
        verdict = jax.vmap(lambda *a: verify_tree(tree, *a[:-2], greedy=True, node_accept=a[-2],
                                                  node_correction=a[-1]))(
            drafts.tokens, target_logits, target_probs, drafts.probs, uniforms, emit_uniform, node_accept, node_fix
        )
    else:
        verdict = jax.vmap(lambda *a: verify_tree(tree, *a, greedy=cfg.greedy))(
            drafts.tokens, target_logits, target_probs, drafts.probs, uniforms, emit_uniform
        )
    n = verdict.num_accepted
    target_bad = sampling.nonfinite_rows(raw).any(1)
    new_bad = jnp.where(~done & drafts.bad, 2, jnp.where(~done & target_bad, 1, 0)).astype(jnp.int32)
    live = ~done & (new_bad == 0)

    # ---- commit ----
    path_tokens = jnp.take_along_axis(drafts.tokens, verdict.path[:, 1:], axis=1)  # [B, D], root excluded
    tokens, n_commit, finished = _commit_block(state, path_tokens, n, verdict.token, live, prompt_lengths, max_new,
                                               eos_ids)
    new_nc = nc + n_commit
    # The target cache keeps the root and the first n_commit - 1 path nodes
    # (everything committed but the last token); the draft one path node less.
    target_cache = out.cache.keep_path(start, verdict.path, n_commit)
    draft_features = None
    if head_layers:  # a feature head rewrites its tree from the target's features on the accepted path
        draft_features = jnp.take_along_axis(out.hidden[-1], verdict.path[:, :, None], axis=1)  # [B, D + 1, H]
    else:
        draft_cache = draft_cache.keep_path(start, verdict.path, jnp.maximum(n_commit - 1, 0))

    # ---- record ----
    judged = jnp.ones((batch, depth), bool)
    if relaxed:  # each accepted node's own path code (exact / relaxed / pardon)
        paths = jnp.take_along_axis(node_code, verdict.path[:, 1:], axis=1)
    else:
        paths = jnp.full((batch, depth), Path.EXACT, jnp.int32)
    paths = jnp.where(jnp.arange(depth)[None, :] < n[:, None], paths, Path.REJECTED).astype(jnp.int32)
    stats = record_cycle(state.stats, live=live, valid=judged, num_accepted=n, num_committed=n_commit,
                         paths=paths, draft_forwards=drafts.forwards)
    new_state = state.replace(
        step=state.step + 1,
        tokens=tokens,
        num_committed=new_nc,
        done=done | (new_bad > 0) | finished,
        bad=jnp.where(state.bad > 0, state.bad, new_bad),
        target_cache=target_cache.rollback(new_nc - 1),
        draft_cache=draft_cache.rollback(_draft_keep(cfg, state, new_nc)),
        stats=stats,
        draft_features=draft_features,
    )
    return new_state, None
