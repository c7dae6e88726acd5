"""Token trees: draft a tree of tokens per cycle and verify it in one target forward.

    from specjax.trees import static_tree

    out = specjax.decode(pair, prompts, tree=static_tree((4, 2, 1)), temperature=1.0)

A tree is flattened breadth-first (:class:`TokenTree`: one parent index per
node, node 0 the last committed token). ``static_tree(branching)`` gives
every node at depth ``d`` ``branching[d]`` children: the draft's best tokens
when greedy, a draw without replacement when sampling. Verification accepts
the longest path the target agrees with (greedy) or runs exact multi-draft
speculative sampling (:func:`verify_tree`).
"""

from specjax._src.trees import (
    TokenTree,
    TreeVerdict,
    levels,
    sample_children,
    static_tree,
    uniform_branching,
    verify_tree,
)

__all__ = (
    "TokenTree",
    "TreeVerdict",
    "levels",
    "sample_children",
    "static_tree",
    "uniform_branching",
    "verify_tree",
)
