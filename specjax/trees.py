"""Token trees: draft a tree of tokens per cycle and verify it in one target forward.

    from specjax.trees import dynamic_tree, static_tree

    out = specjax.decode(pair, prompts, tree=static_tree((4, 2, 1)), temperature=1.0)
    out = specjax.decode(pair, prompts, tree=dynamic_tree(depth=5, top_k=8, num_nodes=48), temperature=0.0)

A tree is flattened breadth-first (:class:`TokenTree`: one parent index per
node, node 0 the last committed token). ``static_tree(branching)`` gives
every node at depth ``d`` ``branching[d]`` children: the draft's best tokens
when greedy, a draw without replacement when sampling. Verification accepts
the longest path the target agrees with (greedy) or runs exact multi-draft
speculative sampling (:func:`verify_tree`).

``dynamic_tree(depth, top_k, num_nodes)`` (:class:`DynamicTree`) grows a new
shape every cycle, EAGLE-2 style (arXiv:2406.16858): ``depth`` levels, each
expanding the ``top_k`` best-scored nodes into ``top_k`` children, then the
``num_nodes`` best candidates are verified (:func:`top_ranked`,
:func:`rerank`). Greedy, the children are the draft's top-k; sampling, they
are drawn without replacement and verified exactly like a static tree's,
because a child's score is its slot's (:func:`slot_scores`), never its drawn
token's own probability; with ``sampled=False`` they are the top-k, verified
as point-mass drafts (:func:`verify_dynamic_tree`). By default the lossless
rule gets drawn children and relaxed rules the top-k. Fixed shapes: one
compiled program per ``(depth, top_k, num_nodes, sampled)``.
:func:`parse_tree` reads both from text (``"3,1,1"``, ``"dynamic:3,3,8"``,
``"dynamic-topk:3,3,8"``, ``"dynamic-sampled:3,3,8"``), as ``specjax
generate/compare --tree`` do.
"""

from specjax._src.proposals.trees import (
    DynamicTree,
    TokenTree,
    TreeVerdict,
    children_table,
    dynamic_tree,
    levels,
    parse_tree,
    tree_spec,
    rerank,
    sample_children,
    slot_scores,
    static_tree,
    top_ranked,
    uniform_branching,
    verify_dynamic_tree,
    verify_tree,
)

__all__ = (
    "DynamicTree",
    "TokenTree",
    "TreeVerdict",
    "children_table",
    "dynamic_tree",
    "levels",
    "parse_tree",
    "tree_spec",
    "rerank",
    "sample_children",
    "slot_scores",
    "static_tree",
    "top_ranked",
    "uniform_branching",
    "verify_dynamic_tree",
    "verify_tree",
)
