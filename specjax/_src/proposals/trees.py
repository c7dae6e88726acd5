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

Dynamic trees (:func:`dynamic_tree`, EAGLE-2, arXiv:2406.16858) are grown
each cycle from the draft's confidence: a frontier of the ``top_k`` nodes
with the best cumulative draft score is expanded level by level, and the
``num_nodes`` best of all drafted candidates are verified
(:func:`top_ranked`, :func:`rerank`). Their shape is traced, one per
sequence, with fixed sizes. Greedy, a node's children are the draft's top-k.
Sampling, they are drawn without replacement and verified by the recursive
rejection sampling above, as a static tree's are; that stays exact only
because the tree's shape never looks at a drawn token's own probability.
EAGLE-2 scores a child by ``log q(x)`` of the token it drew; whether a
sampled child is then kept would depend on its own value (a low-probability
draw is dropped), and the kept children would no longer be draws from
``q``. Here the ``i``-th child slot of a node scores the node's score plus
the ``i``-th largest ``log q`` at the node (:func:`slot_scores`): equal to
EAGLE-2's score when greedy, and a function of the tree above the slot
when sampling. Whether slot ``i`` is kept or expanded then depends only on
drafts drawn before it (its ancestors, its earlier siblings and what grew
from them) and on draws independent of it, so the children the walk tries
at a node are the first draws of a without-replacement sequence whose
length was fixed before they were drawn: the recursive rejection sampling
stays exact. With ``sampled=False`` a dynamic tree keeps EAGLE-2's top-k
children when sampling and verifies them as point-mass drafts
(:func:`verify_dynamic_tree` without ``draft_probs``): child ``c_i`` is
accepted with probability ``p_i(c_i)``, and after a rejection ``p_{i+1}``
is ``p_i`` without ``c_i``, renormalised; exact too, but the lossless walk
accepts less. Relaxed rules accept more of the draft's best tokens than of
its draws (they judge a child by the target's ranks and margins), so by
default (``sampled=None``) the lossless rule gets drawn children and every
other rule the top-k.

Relaxed rules (MARS, EARS, the criteria, AdaSD, PAD, custom rules) run on
both kinds of tree. Greedy, each node is judged once as a child of its
parent. Sampling, the walk asks the rule about each child in turn as a
one-slot block (:class:`specjax.rules.VerifyInputs`): its ``target_probs`` /
``draft_probs`` are what the earlier siblings left (the rule's correction
after the previous rejection, ``q`` without the earlier children, or the
child's point mass), its logits the models' own at the node, so the rule's
lossless half runs the recursive rejection above and its relaxed half reads
the target's confidence at the position. What this guarantees: a rule at its
lossless limit is the exact lossless tree; with one child per node it is the
rule on a chain; and every accepted child passed the rule's own test (a
criterion's accepted tokens and corrections stay in its set; the token after
a leaf follows ``p``, as a chain's bonus token does). A stateful rule
(AdaSD) updates from the decided path as from a chain block.

Everything is per sequence with static shapes (``vmap`` over the batch): the
walk is a ``fori_loop`` over depths with the node's children unrolled.

Sizes are bounded where a tree is made, before any node exists: at most
``MAX_TREE_NODES`` nodes (a dynamic tree: drafted candidates) and depth
``MAX_TREE_DEPTH``. Each depth is one more draft forward in the compiled
program, so compiling takes longer the deeper the tree: past
:data:`WARN_TREE_DEPTH` a ``RuntimeWarning`` says so.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.logits import sampling
from specjax._src.foundation.checks import check_positive_int

Array = jax.Array

#: The most nodes a tree may have (a dynamic tree: candidates drafted per
#: cycle). Every node carries a ``[V]`` distribution per sequence, and a
#: dynamic tree ranks its candidates pairwise (``O(C^2)``), so a larger tree
#: fills memory; none verifies faster than a smaller one on real models.
MAX_TREE_NODES = 4096
#: The deepest tree: one draft forward per level is unrolled into the program.
MAX_TREE_DEPTH = 64
#: Deeper trees compile long enough to look like a hang: a warning says so.
WARN_TREE_DEPTH = 16
_warned_depths: set = set()  # a shape is warned about once per process (decode checks it again)


def _check_tree_depth(what: str, depth: int) -> None:
    """Refuses a tree deeper than ``MAX_TREE_DEPTH``; warns (once per
    shape) past :data:`WARN_TREE_DEPTH`."""
    if depth > MAX_TREE_DEPTH:
        raise ValueError(f"{what} has depth {depth}, more than {MAX_TREE_DEPTH}: every level is one more draft "
                         "forward in the compiled program, which would compile for many minutes. Draft long "
                         "chains with decode(num_draft=K) instead (a loop, not unrolled).")
    if depth > WARN_TREE_DEPTH and (what, depth) not in _warned_depths:
        _warned_depths.add((what, depth))
        warnings.warn(f"{what} has depth {depth}: every level is one more draft forward in the compiled "
                      "program, so the first decode with it compiles for a long time (the longer the deeper).",
                      RuntimeWarning, stacklevel=3)


def _check_tree_nodes(what: str, nodes: int, noun: str = "nodes") -> None:
    """Refuses a tree of more than ``MAX_TREE_NODES`` nodes (``nodes`` is
    counted, never built)."""
    if nodes > MAX_TREE_NODES:
        raise ValueError(f"{what} has {nodes:,} {noun}, more than the {MAX_TREE_NODES:,} a tree may have "
                         "(each holds a vocabulary-sized distribution per sequence); choose a smaller tree, "
                         "e.g. static_tree((4, 2, 2, 1)) or dynamic_tree(6, 10, 60).")


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
    At most ``MAX_TREE_NODES`` nodes and depth ``MAX_TREE_DEPTH``.
    """
    if not branching:
        raise ValueError("static_tree: branching must give at least one depth, e.g. (4, 2, 1).")
    branching = tuple(check_positive_int(f"static_tree: branching[{d}]", b) for d, b in enumerate(branching))
    what = f"static_tree({branching if len(branching) <= 8 else f'({branching[0]}, ..., {branching[-1]})'})"
    _check_tree_depth(what, len(branching))
    _check_tree_nodes(what, 1 + sum(math.prod(branching[: d + 1]) for d in range(len(branching))))
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
      path_codes: ``int32 [N]`` each node's :class:`~specjax.rules.Path` code
        where a ``judge`` accepted it (``REJECTED`` elsewhere); ``None``
        without a judge.
    """

    path: Array
    num_accepted: Array
    token: Array
    path_codes: Array | None = None


# A relaxed rule's verdict on one child at ``T > 0``, for the walk:
# ``judge(data, child, node, token, p, q, uniform) -> (accept, correction [V],
# path code)``; ``data`` is the sequence's own pytree (``judge_data``), ``p``
# and ``q`` what the child's earlier siblings left (``q`` a point mass on
# ``token`` for a dynamic tree's top-k children, ``sampled=False``).


def _residual(p: Array, q: Array) -> Array:
    r = jnp.maximum(p - q, 0.0)
    total = r.sum()
    return jnp.where(total > 1e-12, r / jnp.maximum(total, 1e-30), p)


def _without(q: Array, token: Array) -> Array:
    """``q`` with ``token`` removed, renormalised (all zeros if nothing is left:
    then no further child can have been drawn)."""
    kept = q.at[token].set(0.0)
    return kept / jnp.maximum(kept.sum(), 1e-30)


def _without_or_same(p: Array, token: Array) -> Array:
    """``p`` with ``token`` removed, renormalised; ``p`` itself if nothing is
    left (``p(token) = 1`` was then accepted: unreachable but for rounding)."""
    kept = p.at[token].set(0.0)
    total = kept.sum()
    return jnp.where(total > 0, kept / jnp.maximum(total, 1e-30), p)


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
    judge=None,
    judge_data=None,
    limit=None,
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
      judge: sampling only, optional: a relaxed rule's verdict on each child
        in turn (see :func:`_walk`), in place of the lossless test; ``judge_data``
        its per-sequence inputs.
      limit: optional int32 scalar (traced): the walk accepts at most this
        many nodes, the node it reaches at that depth counting as a leaf (its
        target row gives the emitted token: exact, as at any leaf). The slots
        engine's per-request draft cap; None: the tree's depth.

    Returns:
      :class:`TreeVerdict`.
    """
    return _walk(jnp.asarray(tree.children_table()), tree.max_depth, tokens, target_logits, target_probs,
                 draft_probs, uniforms, emit_uniform, greedy=greedy, node_accept=node_accept,
                 node_correction=node_correction, judge=judge, judge_data=judge_data, limit=limit)


def verify_dynamic_tree(
    parents: Array,
    tokens: Array,
    target_logits: Array,
    target_probs: Array,
    uniforms: Array,
    emit_uniform: Array,
    *,
    depth: int,
    width: int,
    greedy: bool,
    draft_probs: Array | None = None,
    node_accept: Array | None = None,
    node_correction: Array | None = None,
    judge=None,
    judge_data=None,
    limit=None,
) -> TreeVerdict:
    """Verifies one sequence's dynamic tree (:func:`dynamic_tree`).

    Greedy: as :func:`verify_tree` (output: the target's greedy continuation).
    Sampling with ``draft_probs``: each node's children were drawn from its
    row without replacement, in child order, and the walk is
    :func:`verify_tree`'s recursive rejection sampling (exact when the tree's
    shape did not look at the drawn tokens: :func:`slot_scores`).
    Sampling without ``draft_probs``: the children were *chosen* (the draft's
    top-k, ``sampled=False``) and are point-mass drafts. At a node with target distribution ``p``, its kept
    children ``c_1, c_2, ...`` are tried in order (draft score): ``c_i`` is
    accepted with probability ``p_i(c_i)``, with ``p_1 = p`` and, after
    rejecting ``c_i``, ``p_{i+1} = p_i`` with ``c_i`` set to 0, renormalised;
    if all are rejected the emitted token is drawn from the last ``p_i``. Each
    try is standard speculative sampling with the point-mass draft ``q =
    delta(c_i)``: accept with ``min(1, p_i(c_i) / 1)``, residual
    ``norm(max(0, p_i - delta(c_i)))`` = ``p_i`` without ``c_i``. So each try
    outputs a draw from ``p_i``, by induction the node's token follows ``p``,
    and the output law is the target's (``tests/test_dynamic_trees.py``
    checks the first tokens' joint law against exact enumeration).

    Args:
      parents: ``int32 [N]`` the verified tree (traced; node 0 the root,
        ``parents[j] < j``).
      tokens, target_logits, target_probs, uniforms, emit_uniform, node_accept, node_correction, judge, judge_data:
        as for :func:`verify_tree` (a judge sees each child as a point-mass draft
        without ``draft_probs``, and what the earlier siblings left of ``q``
        with them).
      limit: as for :func:`verify_tree`.
      depth: static, the tree's largest possible depth.
      width: static, the most children a node has (``top_k``).
      greedy: static; True at temperature 0.
      draft_probs: sampling, optional ``[N, V]``: the distribution node
        ``j``'s children were drawn from (rows of nodes without children are
        not read); ``None``: the children are point masses.
    """
    return _walk(children_table(parents, width), depth, tokens, target_logits, target_probs,
                 None if greedy else draft_probs, uniforms, emit_uniform, greedy=greedy, node_accept=node_accept,
                 node_correction=node_correction, judge=judge, judge_data=judge_data, limit=limit)


def _walk(table, depth, tokens, target_logits, target_probs, draft_probs, uniforms, emit_uniform, *, greedy,
          node_accept, node_correction, judge=None, judge_data=None, limit=None) -> TreeVerdict:
    """The walk down a tree given its children ``table [N, C]`` (static or
    traced). ``draft_probs=None``: the children are point masses (a
    ``sampled=False`` dynamic tree's), else drawn from ``draft_probs``
    without replacement.

    With a ``judge`` (a relaxed rule when sampling), child ``i`` of a node is
    accepted iff the judge accepts it given ``(p_i, q_i)``, and a rejection
    makes the judge's correction the next sibling's ``p_{i+1}`` (``q`` loses
    the child, as in the lossless walk); after the last rejection the emitted
    token is drawn from that correction. A judge that is the lossless test
    (accept iff ``U q_i(x) <= p_i(x)``, correction the residual) is exactly the
    lossless walk; with one child per node it is the rule on a chain.
    """
    point_mass = draft_probs is None
    if point_mass:
        draft_probs = jnp.zeros((1, 1), jnp.float32)  # unused: q stays a placeholder
    vocab = target_probs.shape[-1]

    def step(level, carry):
        cur, n, p, q, done, path, fix, codes = carry
        if limit is not None:  # the node at depth ``limit`` is a leaf for this walk
            done = done | (level >= limit)
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
            elif judge is not None:
                c = jnp.maximum(child, 0)
                if not point_mass:  # as below: a child the draft could not have drawn is no candidate
                    live = live & (q[x] > 0)
                q_child = jax.nn.one_hot(x, vocab, dtype=jnp.float32) if point_mass else q
                ok, correction, code = judge(judge_data, c, cur, x, p, q_child, uniforms[c])
                accept = live & ok
                rejected = live & ~accept
                p = jnp.where(rejected, correction, p)
                if not point_mass:
                    q = jnp.where(rejected, _without(q, x), q)
                codes = codes.at[c].set(jnp.where(accept, code, codes[c]))
            elif point_mass:  # speculative sampling with q = delta(x): accept w.p. p(x)
                accept = live & (uniforms[jnp.maximum(child, 0)] <= p[x])
                p = jnp.where(live & ~accept, _without_or_same(p, x), p)
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
        if not point_mass:
            q = jnp.where(moved, draft_probs[cur], q)
        return cur, n, p, q, done | ~moved, path, fix, codes

    # ``fix``: the correction of the first child rejected at the node the walk
    # stopped at (-1: it stopped at a leaf, or no rule-given corrections).
    init = (jnp.int32(0), jnp.int32(0), target_probs[0], draft_probs[0], jnp.bool_(False),
            jnp.zeros((depth + 1,), jnp.int32), jnp.int32(-1), jnp.zeros((tokens.shape[0],), jnp.int32))
    cur, n, p, _, _, path, fix, codes = jax.lax.fori_loop(0, depth, step, init)
    path = jnp.where(jnp.arange(depth + 1) <= n, path, cur)
    if greedy:
        token = sampling.argmax(target_logits[cur])
        if node_accept is not None:
            token = jnp.where(fix >= 0, fix, token)
    else:
        # p is the last residual after a rejection, or the node's own p after a leaf.
        token = sampling.sample_categorical(p, emit_uniform)
    return TreeVerdict(path=path, num_accepted=n, token=token, path_codes=codes if judge is not None else None)


# ---------------------------------------------------------------------------
# Dynamic (EAGLE-2) trees
# ---------------------------------------------------------------------------


class DynamicTree(NamedTuple):
    """A dynamic tree's settings (hashable: a ``jit`` static); see :func:`dynamic_tree`.

    Attributes:
      depth: draft levels, the most tokens a cycle accepts (its ``K``).
      top_k: the frontier's width and each frontier node's children.
      num_kept: draft nodes kept for verification (``dynamic_tree``'s
        ``num_nodes``); the verified tree is the root plus these.
      sampled: when sampling, children are drawn without replacement (True)
        or are the draft's top-k, verified as point masses (False); ``None``:
        drawn for the lossless rule, the top-k for any other rule.
    """

    depth: int
    top_k: int
    num_kept: int
    sampled: bool | None = None

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def num_candidates(self) -> int:
        """Nodes drafted per cycle: the root's ``top_k`` children and ``top_k ** 2`` per deeper level."""
        return self.top_k + (self.depth - 1) * self.top_k**2

    @property
    def num_fed(self) -> int:
        """Frontier nodes fed to the draft per cycle (every level but the deepest)."""
        return (self.depth - 1) * self.top_k

    @property
    def verified_nodes(self) -> int:
        """The number of nodes in the target's tree forward (the root and ``num_kept`` drafts)."""
        return self.num_kept + 1

    @property
    def num_nodes(self) -> int:
        """The most tree nodes one cycle holds in a cache, root included: the
        verified tree (``num_kept + 1``) in the target's, the root and the
        ``num_fed`` frontier nodes in the draft's. As
        :attr:`TokenTree.num_nodes`, the room ``decode`` reserves in its caches."""
        return max(self.num_kept, self.num_fed) + 1


def dynamic_tree(depth: int, top_k: int, num_nodes: int, *, sampled: bool | None = None) -> DynamicTree:
    """An EAGLE-2 dynamic draft tree ("EAGLE-2: Faster Inference of Language
    Models with Dynamic Draft Trees", Li et al., arXiv:2406.16858).

    Each cycle grows the tree from the draft's confidence, with fixed shapes:

    * expansion: the root's ``top_k`` children form level 1; at each level
      the frontier is the ``top_k`` nodes of that level with the highest
      score, fed to the draft in one forward with tree attention; each
      proposes ``top_k`` children (``top_k ** 2`` candidates), and the next
      frontier is the ``top_k`` best of those. ``depth`` draft forwards per
      cycle, ``top_k + (depth - 1) * top_k ** 2`` candidates.
    * rerank: the ``num_nodes`` candidates with the highest score (ties: the
      earlier drafted) are verified, in drafting order. A node scores at most
      its parent, so they form a subtree.

    A node's ``i``-th child scores the node's score plus the ``i``-th largest
    log-probability of the draft's ``T = 1`` softmax at the node (its raw
    logits, whatever the decoding temperature; :func:`slot_scores`). Greedy,
    the children are the draft's top-k and this is EAGLE-2's cumulative
    ``sum log q`` along the root path. Sampling, with ``sampled=True`` the
    children are drawn without replacement from the warped draft
    distribution and verified by recursive rejection sampling, exact because
    the scores never read a drawn token's own probability (see the module
    docstring); with ``sampled=False`` they are the top-k, verified as
    point-mass drafts, which the lossless walk accepts less often whenever
    the target spreads its mass (``benchmarks/node_acceptance.py``), while a
    relaxed rule such as MARS accepts more of them. ``sampled=None`` (the
    default): drawn children for the lossless rule, the top-k for any other
    rule.

    Verification is one target forward over the root and those nodes (greedy:
    the longest path of target argmaxes; sampling: exact, see
    :func:`verify_dynamic_tree`). ``num_nodes`` may be at most the number of
    candidates, the candidates at most ``MAX_TREE_NODES`` and ``depth``
    at most ``MAX_TREE_DEPTH``.
    """
    depth = check_positive_int("dynamic_tree: depth", depth)
    top_k = check_positive_int("dynamic_tree: top_k", top_k)
    num_nodes = check_positive_int("dynamic_tree: num_nodes", num_nodes)
    if sampled is not None and not isinstance(sampled, (bool, np.bool_)):
        raise TypeError(f"dynamic_tree: sampled must be True, False or None (the rule decides), got {sampled!r}.")
    tree = DynamicTree(depth, top_k, num_nodes, None if sampled is None else bool(sampled))
    what = f"dynamic_tree({depth}, {top_k}, {num_nodes})"
    _check_tree_depth(what, depth)
    _check_tree_nodes(what, tree.num_candidates, "candidates (top_k + (depth - 1) * top_k ** 2)")
    if num_nodes > tree.num_candidates:
        raise ValueError(f"dynamic_tree: num_nodes={num_nodes} exceeds the {tree.num_candidates} candidates a "
                         f"depth-{depth}, top_k={top_k} expansion drafts (top_k + (depth - 1) * top_k ** 2).")
    return tree


def slot_scores(log_q: Array, children: Array, draw_probs: Array | None = None) -> Array:
    """``[..., k]`` the score each of a node's ``k`` child slots adds to its
    node's, from the draft's ``T = 1`` log-probabilities ``log_q [..., V]``.

    ``draw_probs=None``: the ``children [..., k]`` are the draft's top-k, and
    slot ``i`` scores ``log_q`` at its child (EAGLE-2's score). Else they were
    drawn without replacement from ``draw_probs [..., V]`` and slot ``i``
    scores the ``i``-th largest ``log_q``, or ``-inf`` when ``draw_probs``
    has mass on fewer than ``i + 1`` tokens (top-k / top-p leave such slots a
    zero-mass filler the walk skips; ranked last, it takes no kept or
    frontier place).

    When sampling, a slot's score must not depend on the token it drew: the
    rerank and the frontier compare scores, and a child kept because its
    own draw was likely would no longer be a draw from ``q`` (the recursive
    rejection sampling would then not be exact). Both rules above read ``q``
    alone.
    """
    k = children.shape[-1]
    if draw_probs is None:
        return jnp.take_along_axis(log_q, children, axis=-1)
    scores = jnp.take_along_axis(log_q, sampling.top_indices(log_q, k), axis=-1)
    has_mass = jnp.arange(k) < (draw_probs > 0).sum(-1, keepdims=True)
    return jnp.where(has_mass, scores, -jnp.inf)


def top_ranked(scores: Array, k: int) -> Array:
    """``int32 [..., k]``: the indices of the ``k`` best ``scores[..., C]`` by
    ``(score, -index)`` (ties: the lower index), best first; NaN counts as ``-inf``.

    Counts each entry's rank (``O(C^2)`` compares, no sort): a strict total
    order, so the ranks are a permutation and exactly ``k`` entries are picked.
    """
    s = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
    c = s.shape[-1]
    idx = jnp.arange(c)
    other, own = s[..., None, :], s[..., :, None]  # [..., C, C]: entry j against entry i (row i)
    before = (other > own) | ((other == own) & (idx[None, :] < idx[:, None]))
    rank = before.sum(-1).astype(jnp.int32)  # [..., C]: how many entries rank before each one
    out = jnp.zeros(s.shape[:-1] + (k,), jnp.int32)
    fill = lambda o, r: o.at[r].set(idx.astype(jnp.int32), mode="drop")  # noqa: E731 (ranks >= k dropped)
    for _ in range(s.ndim - 1):
        fill = jax.vmap(fill)
    return fill(out, rank)


def rerank(scores: Array, cand_parents: Array, num_kept: int, *, by_rank: bool = False) -> tuple[Array, Array]:
    """EAGLE-2's rerank of one sequence's drafted candidates.

    Args:
      scores: ``[C]`` cumulative draft log-probabilities, in drafting order.
      cand_parents: ``int32 [C]`` each candidate's parent candidate (``-1``:
        the root); a parent is drafted before its children.
      num_kept: static, ``M <= C``.
      by_rank: keep the candidates best first instead of in drafting order, so
        that the first ``n`` nodes are the ``n`` best for every ``n`` (a cycle
        that verifies only some of them, :func:`specjax.drafting.auto`).

    Returns:
      ``(kept, parents)``: ``kept int32 [M]``, the candidates of the ``M`` best
      ``(score, -index)``, in drafting order (or best first); ``parents int32
      [M + 1]``, the verified tree (node 0 the root, node ``m + 1`` candidate
      ``kept[m]``). When a candidate scores at most its parent
      (log-probabilities), the kept set is a subtree in topological order
      either way: a parent ranks before its children (on a tie, the lower index
      is the parent's), and siblings keep their drafting order.
    """
    c = scores.shape[-1]
    best = top_ranked(scores, num_kept)
    chosen = jnp.zeros((c,), bool).at[best].set(True)
    position = jnp.cumsum(chosen.astype(jnp.int32)) - 1  # rank of each kept candidate in drafting order
    if by_rank:
        position = jnp.zeros((c,), jnp.int32).at[best].set(jnp.arange(num_kept, dtype=jnp.int32))
    kept = jnp.zeros((num_kept,), jnp.int32).at[jnp.where(chosen, position, num_kept)].set(
        jnp.arange(c, dtype=jnp.int32), mode="drop")
    node_of = jnp.where(chosen, position + 1, 0)  # candidate -> verified node (0: not kept)
    up = cand_parents[kept]
    parents = jnp.concatenate([jnp.full((1,), -1, jnp.int32),
                               jnp.where(up < 0, 0, node_of[jnp.maximum(up, 0)]).astype(jnp.int32)])
    return kept, parents


def children_table(parents: Array, width: int) -> Array:
    """``int32 [N, width]``: each node's children in node order, padded with
    ``-1``, from traced ``parents [N]`` (``parents[0] = -1``; at most ``width``
    children per node)."""
    n = parents.shape[-1]
    j = jnp.arange(n)
    same = (parents[None, :] == parents[:, None]) & (j[None, :] < j[:, None])
    rank = same.sum(-1)  # each node's place among its siblings
    row = jnp.where(parents >= 0, parents, n)  # the root: dropped
    return jnp.full((n, width), -1, jnp.int32).at[row, rank].set(j.astype(jnp.int32), mode="drop")


def parse_tree(spec: str) -> TokenTree | DynamicTree:
    """A tree from its text form, as the command line takes it.

    ``"3,1,1"`` is ``static_tree((3, 1, 1))``; ``"dynamic:3,3,8"`` is
    ``dynamic_tree(depth=3, top_k=3, num_nodes=8)``, ``"dynamic-topk:3,3,8"``
    and ``"dynamic-sampled:3,3,8"`` the same with ``sampled=False`` / ``True``.
    """
    text = str(spec).strip()
    kinds = {"dynamic:": None, "dynamic-topk:": False, "dynamic-sampled:": True}
    prefix = next((p for p in kinds if text.startswith(p)), "")
    body = text[len(prefix):]
    try:
        numbers = tuple(int(x) for x in body.split(","))
    except ValueError:
        numbers = ()
    if not numbers or (prefix and len(numbers) != 3):
        raise ValueError(f"tree {spec!r}: expected branching per depth such as \"3,1,1\" (a static tree) or "
                         "\"dynamic:DEPTH,TOP_K,NUM_NODES\" such as \"dynamic:3,3,8\" (an EAGLE-2 dynamic tree; "
                         "\"dynamic-topk:...\" / \"dynamic-sampled:...\" fix how its children are chosen when "
                         "sampling).")
    if prefix:
        return dynamic_tree(*numbers, sampled=kinds[prefix])
    return static_tree(numbers)



def tree_spec(tree: TokenTree | DynamicTree) -> str:
    """The text form :func:`parse_tree` reads back (``"3,1,1"``, ``"dynamic:3,3,8"``)."""
    if isinstance(tree, DynamicTree):
        prefix = {None: "dynamic", False: "dynamic-topk", True: "dynamic-sampled"}[tree.sampled]
        return f"{prefix}:{tree.depth},{tree.top_k},{tree.num_kept}"
    return ",".join(str(b) for b in uniform_branching(tree))
