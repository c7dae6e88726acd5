"""Token trees: static tree shapes, and verifying a drafted tree against the target.

A draft tree is flattened in breadth-first order: node 0 is the *root*, the
last committed token (already in the output), and every other node is a draft
token whose parent is an earlier node. A chain is the tree whose parents are
``i - 1``. The target scores every node in one forward with tree attention
(``Decoder.apply(tree_parents=...)``): row ``j`` of its logits is the
distribution of the token after node ``j``, which judges ``j``'s children.

Verification walks down from the root. At each node it tries the node's
children in order and moves to the first accepted one; when every child is
rejected (or the node is a leaf) it emits one more token and stops, as chain
verification emits its correction or bonus token.

* Greedy: a child is accepted iff its token is the target's argmax at the
  parent; the emitted token is that argmax. Output: exactly the target's
  greedy continuation, whatever the tree.
* Sampling: multi-draft speculative sampling. The children of a node are drawn
  from the draft's ``q`` at that node, *without replacement* (Gumbel top-k,
  :func:`sample_children`). Child ``x_i`` is accepted with probability
  ``min(1, p_i(x_i) / q_i(x_i))``; after a rejection the target side becomes
  the residual ``p_{i+1} = norm(max(0, p_i - q_i))`` and the draft side ``q``
  with ``x_i`` removed, renormalised (``q_{i+1}``); if all are rejected the
  emitted token is drawn from the last residual. This is the recursive
  rejection sampling of "Recursive Speculative Decoding: Accelerating LLM
  Inference via Sampling Without Replacement" (Jeon et al., arXiv:2402.14160);
  with one child it is standard speculative sampling, and the output follows
  the target distribution exactly (``tests/test_trees.py`` checks the joint
  law of the first tokens against exact enumeration).

Everything is per sequence with static shapes (``vmap`` over the batch): the
walk is a ``fori_loop`` over depths with the node's children unrolled.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src import sampling
from specjax._src.checks import check_positive_int

Array = jax.Array


class TokenTree(NamedTuple):
    """A static tree shape (hashable: a ``jit`` static).

    Attributes:
      parents: ``parents[j]`` for each of the ``N`` nodes, breadth-first;
        ``parents[0] = -1`` (the root, the last committed token).
    """

    parents: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> tuple[int, ...]:
        out = []
        for parent in self.parents:
            out.append(0 if parent < 0 else out[parent] + 1)
        return tuple(out)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Each node's children, in order."""
        kids: list[list[int]] = [[] for _ in self.parents]
        for j, parent in enumerate(self.parents):
            if parent >= 0:
                kids[parent].append(j)
        return tuple(tuple(k) for k in kids)

    @property
    def max_children(self) -> int:
        return max(len(k) for k in self.children)

    def children_table(self) -> np.ndarray:
        """``int32 [N, C]``: each node's children, padded with ``-1``."""
        table = np.full((self.num_nodes, max(self.max_children, 1)), -1, np.int32)
        for j, kids in enumerate(self.children):
            table[j, : len(kids)] = kids
        return table

    def draft_parents(self) -> tuple[int, ...]:
        """The draft nodes' parents for ``Decoder.apply(tree_parents=...)`` over
        nodes ``1 .. N-1`` fed after the root (``-1`` for the root's children)."""
        return tuple(p - 1 for p in self.parents[1:])


def static_tree(branching: Sequence[int]) -> TokenTree:
    """The tree in which every node at depth ``d`` has ``branching[d]`` children.

    ``static_tree((4, 2, 2, 1))`` drafts the root's 4 best (or sampled)
    children, 2 children of each, and so on: 4 + 8 + 16 + 16 = 44 draft nodes,
    depth 4 (Medusa / SpecInfer style). ``static_tree((1,) * K)`` is a chain.
    """
    if not branching:
        raise ValueError("static_tree: branching must give at least one depth, e.g. (4, 2, 1).")
    branching = tuple(check_positive_int(f"static_tree: branching[{d}]", b) for d, b in enumerate(branching))
    parents, level = [-1], [0]
    for b in branching:
        next_level = []
        for node in level:
            for _ in range(b):
                parents.append(node)
                next_level.append(len(parents) - 1)
        level = next_level
    return TokenTree(tuple(parents))


def levels(tree: TokenTree) -> list[tuple[int, int]]:
    """``[(first node, end)]`` of each breadth-first level, root level first."""
    depths = tree.depths
    out = []
    for d in range(tree.max_depth + 1):
        nodes = [j for j, x in enumerate(depths) if x == d]
        if nodes != list(range(nodes[0], nodes[-1] + 1)):
            raise ValueError("tree levels must be contiguous node ranges (breadth-first order)")
        out.append((nodes[0], nodes[-1] + 1))
    return out


def uniform_branching(tree: TokenTree) -> tuple[int, ...]:
    """Children per node at each depth; raises if a level is not uniform."""
    kids = tree.children
    out = []
    for lo, hi in levels(tree)[:-1]:
        counts = {len(kids[j]) for j in range(lo, hi)}
        if len(counts) != 1:
            raise ValueError("tree decoding drafts trees whose nodes at one depth have equally many children")
        out.append(counts.pop())
    return tuple(out)


def sample_children(key: Array, probs: Array, num: int) -> Array:
    """``[num]`` distinct tokens drawn from ``probs[V]`` without replacement, in
    draw order (Gumbel top-k: the top-``num`` of ``log p + Gumbel``). Tokens
    with ``p = 0`` come last, only when fewer than ``num`` have mass."""
    gumbel = jax.random.gumbel(key, probs.shape, jnp.float32)
    scores = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)) + gumbel, -jnp.inf)
    return sampling.top_indices(scores, num)


class TreeVerdict(NamedTuple):
    """The outcome of verifying one sequence's tree.

    Attributes:
      path: ``int32 [D + 1]`` node indices of the accepted path, root first
        (``path[0] = 0``); entries past ``num_accepted`` repeat the last node.
      num_accepted: int32, accepted draft tokens (the path's length minus 1).
      token: int32, the emitted token after the path (correction or bonus).
    """

    path: Array
    num_accepted: Array
    token: Array


def _residual(p: Array, q: Array) -> Array:
    r = jnp.maximum(p - q, 0.0)
    total = r.sum()
    return jnp.where(total > 1e-12, r / jnp.maximum(total, 1e-30), p)


def _without(q: Array, token: Array) -> Array:
    """``q`` with ``token`` removed, renormalised (all zeros if nothing is left:
    then no further child can have been drawn)."""
    kept = q.at[token].set(0.0)
    return kept / jnp.maximum(kept.sum(), 1e-30)


def verify_tree(
    tree: TokenTree,
    tokens: Array,
    target_logits: Array,
    target_probs: Array,
    draft_probs: Array,
    uniforms: Array,
    emit_uniform: Array,
    *,
    greedy: bool,
    node_accept: Array | None = None,
    node_correction: Array | None = None,
) -> TreeVerdict:
    """Verifies one sequence's drafted tree (see the module docstring).

    Args:
      tree: the static shape.
      tokens: ``int32 [N]`` node tokens (``tokens[0]``, the root, is not judged).
      target_logits: ``[N, V]`` warped target logits at each node (greedy: raw).
      target_probs: ``[N, V]`` ``softmax(target_logits)``: row ``j`` judges
        ``j``'s children and gives the bonus token after a leaf.
      draft_probs: ``[N, V]`` the draft distribution ``j``'s children were drawn
        from (without replacement, in child order).
      uniforms: ``[N]`` Uniform(0, 1): node ``j``'s acceptance coin.
      emit_uniform: scalar Uniform(0, 1) for the emitted token.
      greedy: static; True at temperature 0.
      node_accept: greedy only, optional ``bool [N]``: another rule's verdict
        on node ``j`` as a child of its parent (``tests`` the relaxed greedy
        rules on trees); default: ``tokens[j]`` is the target's argmax there.
      node_correction: with ``node_accept``, ``int32 [N]``: the token that rule
        emits when node ``j`` is the first child it rejects at its parent.

    Returns:
      :class:`TreeVerdict`.
    """
    table = jnp.asarray(tree.children_table())
    depth = tree.max_depth

    def step(_, carry):
        cur, n, p, q, done, path, fix = carry
        moved = jnp.bool_(False)
        next_node = cur
        for i in range(table.shape[1]):
            child = table[cur, i]
            live = ~done & ~moved & (child >= 0)
            x = tokens[jnp.maximum(child, 0)]
            if greedy and node_accept is not None:
                accept = live & node_accept[jnp.maximum(child, 0)]
                if i == 0:  # the first rejected child's correction is the one emitted
                    fix = jnp.where(live & ~accept, node_correction[jnp.maximum(child, 0)], fix)
            elif greedy:
                accept = live & (x == sampling.argmax(target_logits[cur]))
            else:
                # A child the draft could not have drawn (q = 0: top-k / top-p
                # left fewer tokens than the node has children) is no candidate.
                live = live & (q[x] > 0)
                accept = live & (uniforms[jnp.maximum(child, 0)] * q[x] <= p[x])
                rejected = live & ~accept
                p = jnp.where(rejected, _residual(p, q), p)
                q = jnp.where(rejected, _without(q, x), q)
            next_node = jnp.where(accept, child, next_node)
            moved = moved | accept
        n = n + moved.astype(jnp.int32)
        fix = jnp.where(moved, -1, fix)
        path = path.at[n].set(jnp.where(moved, next_node, path[n]))
        cur = next_node
        # A move restarts both sides at the new node's own distributions.
        p = jnp.where(moved, target_probs[cur], p)
        q = jnp.where(moved, draft_probs[cur], q)
        return cur, n, p, q, done | ~moved, path, fix

    # ``fix``: the correction of the first child rejected at the node the walk
    # stopped at (-1: it stopped at a leaf, or no rule-given corrections).
    init = (jnp.int32(0), jnp.int32(0), target_probs[0], draft_probs[0], jnp.bool_(False),
            jnp.zeros((depth + 1,), jnp.int32), jnp.int32(-1))
    cur, n, p, _, _, path, fix = jax.lax.fori_loop(0, depth, step, init)
    path = jnp.where(jnp.arange(depth + 1) <= n, path, cur)
    if greedy:
        token = sampling.argmax(target_logits[cur])
        if node_accept is not None:
            token = jnp.where(fix >= 0, fix, token)
    else:
        # p is the last residual after a rejection, or the node's own p after a leaf.
        token = sampling.sample_categorical(p, emit_uniform)
    return TreeVerdict(path=path, num_accepted=n, token=token)
