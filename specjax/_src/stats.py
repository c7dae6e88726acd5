"""Per-sequence decode statistics, accumulated inside the loop.

Counts are int32 per sequence (leading axis ``B``), so the totals and every
derived rate are exact. Vocabulary (papers/README.md):

* ``cycles``: draft-verify cycles the sequence took part in.
* ``drafted`` / ``accepted``: valid draft tokens proposed / accepted by the rule.
* ``tokens``: tokens committed (= ``DecodeOutput.lengths``).
* ``tau`` (mean acceptance length) = ``tokens / cycles``, counting the
  correction or bonus token, so at most ``K + 1``. Only the cycle that hits EOS
  or ``max_new_tokens`` can commit fewer than ``accepted + 1`` tokens.
* ``acceptance_rate`` = ``accepted / drafted``.
* per position ``k``: ``drafted_at[k]`` (slot k was drafted) and
  ``accepted_at[k]`` (slot k was accepted, hence every earlier slot too).
* per path: accepted tokens by :class:`~specjax.rules.Path`
  (``EXACT`` / ``RELAXED`` / ``PARDON``; the ``REJECTED`` column stays 0).
* ``draft_forwards`` / ``target_forwards``: batch forwards run (scalars;
  ``generate`` counts its target forwards).
* ``extra``: a dict of per-sequence sums from the ``diagnostics`` hook of
  ``decode`` (e.g. theory diagnostics), empty by default.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax._src.rules.base import NUM_PATHS, Path

Array = jax.Array


def _ratio(num, den) -> float:
    num, den = float(num), float(den)
    return num / den if den else float("nan")


@struct.dataclass
class DecodeStats:
    """Counters of one ``decode`` (or ``generate``) call; see the module doc."""

    cycles: Array  # [B]
    drafted: Array  # [B]
    accepted: Array  # [B]
    tokens: Array  # [B]
    drafted_at: Array  # [B, K]
    accepted_at: Array  # [B, K]
    accepted_by_path: Array  # [B, NUM_PATHS]
    draft_forwards: Array  # scalar
    target_forwards: Array  # scalar
    extra: dict = struct.field(default_factory=dict)

    @classmethod
    def zeros(cls, batch_size: int, num_draft: int, extra: dict | None = None) -> "DecodeStats":
        z = jnp.zeros((batch_size,), jnp.int32)
        return cls(
            cycles=z,
            drafted=z,
            accepted=z,
            tokens=z,
            drafted_at=jnp.zeros((batch_size, num_draft), jnp.int32),
            accepted_at=jnp.zeros((batch_size, num_draft), jnp.int32),
            accepted_by_path=jnp.zeros((batch_size, NUM_PATHS), jnp.int32),
            draft_forwards=jnp.int32(0),
            target_forwards=jnp.int32(0),
            extra=extra or {},
        )

    # ----- per sequence (numpy) -----
    @property
    def batch_size(self) -> int:
        return int(np.shape(self.cycles)[0])

    @property
    def num_draft(self) -> int:
        return int(np.shape(self.drafted_at)[1])

    @property
    def tau_per_sequence(self) -> np.ndarray:
        c = np.asarray(self.cycles, np.float64)
        return np.divide(np.asarray(self.tokens, np.float64), c, out=np.full_like(c, np.nan), where=c > 0)

    @property
    def acceptance_rate_per_sequence(self) -> np.ndarray:
        d = np.asarray(self.drafted, np.float64)
        return np.divide(np.asarray(self.accepted, np.float64), d, out=np.full_like(d, np.nan), where=d > 0)

    # ----- totals -----
    @property
    def tau(self) -> float:
        """Mean tokens committed per cycle (incl. correction / bonus), over the batch."""
        return _ratio(np.sum(self.tokens), np.sum(self.cycles))

    @property
    def acceptance_rate(self) -> float:
        return _ratio(np.sum(self.accepted), np.sum(self.drafted))

    @property
    def acceptance_by_position(self) -> np.ndarray:
        """``[K]``: accepted / drafted at each slot (conditional on being drafted)."""
        d = np.asarray(self.drafted_at, np.float64).sum(0)
        a = np.asarray(self.accepted_at, np.float64).sum(0)
        return np.divide(a, d, out=np.full_like(d, np.nan), where=d > 0)

    @property
    def accepted_by_path_total(self) -> dict[str, int]:
        counts = np.asarray(self.accepted_by_path).sum(0)
        return {p.name.lower(): int(counts[p]) for p in Path if p != Path.REJECTED}

    @property
    def mean_drafted_per_cycle(self) -> float:
        return _ratio(np.sum(self.drafted), np.sum(self.cycles))

    @property
    def efficiency(self) -> float:
        """tokens / (cycles * (K + 1)), the "system efficiency" of the papers page."""
        return _ratio(np.sum(self.tokens), np.sum(self.cycles) * (self.num_draft + 1))

    def summary(self) -> dict[str, float]:
        """Totals as a flat dict of Python floats."""
        out = {
            "sequences": float(self.batch_size),
            "cycles": float(np.sum(self.cycles)),
            "tokens": float(np.sum(self.tokens)),
            "drafted": float(np.sum(self.drafted)),
            "accepted": float(np.sum(self.accepted)),
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "mean_drafted_per_cycle": self.mean_drafted_per_cycle,
            "efficiency": self.efficiency,
            "draft_forwards": float(self.draft_forwards),
            "target_forwards": float(self.target_forwards),
        }
        for k, rate in enumerate(self.acceptance_by_position):
            out[f"acceptance_at_{k}"] = float(rate)
        for name, count in self.accepted_by_path_total.items():
            out[f"accepted_{name}"] = float(count)
        for name, value in self.extra.items():
            out[f"extra_{name}"] = float(np.sum(value))
        return out

    def __str__(self) -> str:
        s = self.summary()
        pos = " ".join(f"{r:.2f}" for r in self.acceptance_by_position)
        paths = ", ".join(f"{k}={v}" for k, v in self.accepted_by_path_total.items())
        return (
            f"DecodeStats(B={self.batch_size}, K={self.num_draft}: {int(s['tokens'])} tokens in "
            f"{int(s['cycles'])} seq-cycles, tau={s['tau']:.3f}, "
            f"acceptance={s['acceptance_rate']:.3f} ({int(s['accepted'])}/{int(s['drafted'])}), "
            f"by position [{pos}], by path {{{paths}}}, "
            f"forwards draft={int(s['draft_forwards'])} target={int(s['target_forwards'])})"
        )

    __repr__ = __str__


def to_numpy(tree: Any) -> Any:
    return jax.tree_util.tree_map(np.asarray, tree)
