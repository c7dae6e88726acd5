"""What a ``jit`` static must add to tell apart pytree classes with equal fields.

JAX (0.10) compares the treedefs of two ``register_dataclass`` classes
(``flax.struct.dataclass`` registers that way) as equal when their fields are,
though their hashes differ. ``jax.jit`` finds programs by the treedef of their
arguments in a hash table that compares keys with ``==`` on a partial hash
match, so two rules with the same fields (``speculative_sampling()`` and
``block_verification()`` have none) occasionally share a compiled program: a
call silently runs the other rule. Measured: 300 field-less classes through one
jitted function, 48 ran another class's program. Passing the classes as part
of a static argument, which ``jit`` compares with the classes' own ``==``,
keeps the programs apart.
"""

from __future__ import annotations

from typing import Any

import jax


def pytree_classes(*trees: Any) -> tuple:
    """The classes of the pytree nodes of ``trees``, nested as the trees are (hashable)."""

    def walk(treedef) -> tuple:
        data = treedef.node_data()
        return (None if data is None else data[0], tuple(walk(c) for c in treedef.children()))

    return tuple(walk(jax.tree_util.tree_structure(t)) for t in trees)
