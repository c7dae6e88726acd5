"""The cycles as values, and the choice a loop's config makes between them.

Apart from :mod:`specjax._src.engine.cycle` (which every cycle imports) so that
the interface module sits below the cycles and this one above them.
"""

from __future__ import annotations

from specjax._src.engine.chain import CHAIN
from specjax._src.engine.config import LoopConfig
from specjax._src.engine.cycle import Cycle
from specjax._src.engine.target_only import TARGET_ONLY
from specjax._src.engine.tree import TREE

__all__ = ["CHAIN", "TREE", "TARGET_ONLY", "cycle_for"]


def cycle_for(cfg: LoopConfig) -> Cycle:
    """``TREE`` when the loop drafts a tree (``cfg.tree``), else ``CHAIN``
    (``TARGET_ONLY``, which drafts nothing, is ``generate``'s: never picked here)."""
    return CHAIN if cfg.tree is None else TREE
