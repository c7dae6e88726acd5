"""The two cycles as values, and the choice a loop's config makes between them.

Apart from :mod:`specjax._src.engine.cycle` (which both cycles import) so that
the interface module sits below the cycles and this one above them.
"""

from __future__ import annotations

from specjax._src.engine.chain import CHAIN
from specjax._src.engine.config import _Config
from specjax._src.engine.cycle import Cycle
from specjax._src.engine.tree import TREE

__all__ = ["CHAIN", "TREE", "cycle_for"]


def cycle_for(cfg: _Config) -> Cycle:
    """``TREE`` when the loop drafts a tree (``cfg.tree``), else ``CHAIN``."""
    return CHAIN if cfg.tree is None else TREE
