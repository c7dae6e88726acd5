"""Per-sequence decode statistics, accumulated inside the loop.

Counts are int32 per sequence (leading axis ``B``; ``K`` draft slots), so the
totals and every derived rate are exact. The rates are the quantities of
"Fast Inference from Transformers via Speculative Decoding" (Leviathan,
Kalman and Matias, arXiv:2211.17192), named for what they measure.

One cycle drafts up to ``K`` tokens; the rule judges them left to right until
its first rejection, and the engine commits the accepted prefix plus one
correction (after a rejection) or bonus (after a fully accepted block) token,
cut at EOS and at ``max_new_tokens``. Slot ``k`` of the block lands at output
position ``k`` of the cycle.

**Only what lands in the output counts.** Slots at output positions at or past
the cycle's committed count ``c`` come after the sequence ended: the rule may
have accepted them, but they are neither accepted, nor judged, nor reached.
A rejection counts as judged only when its correction token was committed.

Counters (per sequence ``[B]`` unless noted):

* ``cycles``: draft-verify cycles the sequence took part in.
* ``drafted``: valid draft tokens proposed, committed or not: the drafting
  cost. ``drafted_at [B, K]``: cycles in which slot ``k`` was drafted.
* ``accepted``: drafts accepted *and committed*, ``min(n, c)`` per cycle for
  an accepted prefix of ``n`` drafts and ``c`` committed tokens.
* ``judged``: drafts the rule actually decided: the accepted ones plus the
  first rejection (when its correction was committed). Slots after the first
  rejection are drafted but never judged.
* ``reached_at [B, K]``: cycles in which slot ``k`` was judged, i.e. drafted
  with every earlier slot accepted (and its output position committed).
* ``accepted_at [B, K]``: cycles in which slot ``k`` was accepted (hence every
  earlier slot too).
* ``accepted_by_path [B, NUM_PATHS]``: accepted drafts by
  :class:`~specjax.rules.Path` (``EXACT`` / ``RELAXED`` / ``PARDON``; the
  ``REJECTED`` column stays 0).
* ``tokens``: tokens the cycles committed: ``DecodeOutput.lengths`` less the
  first token, which the prefill draws (from the target's logits at the
  prompt's last position) before any cycle.
* ``draft_forwards`` / ``target_forwards``: batch forwards run (scalars;
  ``generate`` counts its target forwards).
* ``verified``: tokens the verification forwards scored for the sequence
  (its cycles' block widths: ``K + 1``, or narrower where the batch's drafts
  stopped early; a tree's nodes).
* ``copied`` / ``copied_accepted``: with ``decode(lookup=...)``, the drafted
  (and the accepted) tokens that were copied from the context rather than
  drafted by the draft model or head; 0 without a lookup.
* ``extra``: a dict of per-sequence sums from the ``diagnostics`` hook of
  ``decode`` (e.g. theory diagnostics), empty by default.

Rates (totals over the batch):

* ``tau`` (mean acceptance length) = ``tokens / cycles``: tokens per cycle
  counting the correction or bonus token, so at most ``K + 1``.
* ``acceptance_rate`` = ``accepted / judged``: the per-token acceptance
  probability alpha of Leviathan et al. (its maximum-likelihood estimate when
  every judged slot is an independent Bernoulli(alpha) trial). Under that model
  a cycle of ``K`` drafts commits ``E[tau] = (1 - alpha^(K+1)) / (1 - alpha)``
  tokens: :func:`expected_tau`.
* ``accepted_per_drafted`` = ``accepted / drafted``: the share of the drafting
  work that was kept. It is *not* alpha: drafts after a rejection are counted
  as drafted but were never judged, so it falls with ``K`` at a fixed alpha.
* ``acceptance_at_position [K]`` = ``accepted_at / reached_at``: the
  conditional per-position rate ``alpha_k = P(accept slot k | slot k judged)``;
  constant (= alpha) under the i.i.d. model.
* ``prefix_acceptance [K]`` = ``accepted_at / drafted_at``: ``P(slots 0..k
  all accepted | slot k drafted)``, a cumulative quantity (``alpha^(k+1)``
  under the i.i.d. model); slot 0 gives the first-slot acceptance.
* ``efficiency`` = ``tokens / (cycles * (K + 1))``.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax._src.rules.base import NUM_PATHS, Path

Array = jax.Array


def _ratio(num, den) -> float:
    num, den = float(num), float(den)
    return num / den if den else float("nan")


def _rates(num, den) -> np.ndarray:
    """Elementwise ``num / den`` as float64, NaN where ``den == 0``."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    return np.divide(num, den, out=np.full_like(den, np.nan), where=den > 0)


def expected_tau(alpha, num_draft: int):
    """Expected tokens per cycle with ``K`` drafts and i.i.d. acceptance alpha.

    ``E[tau] = sum_{i=0..K} alpha^i = (1 - alpha^(K+1)) / (1 - alpha)``
    (``K + 1`` at ``alpha = 1``): Leviathan et al., "Fast Inference from
    Transformers via Speculative Decoding" (arXiv:2211.17192), eq. (1). Written
    as the finite sum so it has no singularity at ``alpha = 1``.

    Args:
      alpha: per-token acceptance probability (a float or an array of them),
        e.g. :attr:`DecodeStats.acceptance_rate`.
      num_draft: ``K``, draft tokens per cycle.

    Returns:
      ``E[tau]`` with the shape of ``alpha``.
    """
    total, power = 1.0, 1.0
    for _ in range(num_draft):
        power = power * alpha
        total = total + power
    return total


@struct.dataclass
class DecodeStats:
    """Counters of one ``decode`` (or ``generate``) call; see the module doc."""

    cycles: Array  # [B]
    drafted: Array  # [B]
    accepted: Array  # [B]
    judged: Array  # [B]
    tokens: Array  # [B]
    drafted_at: Array  # [B, K]
    reached_at: Array  # [B, K]
    accepted_at: Array  # [B, K]
    accepted_by_path: Array  # [B, NUM_PATHS]
    verified: Array  # [B] tokens (chain slots or tree nodes) the target's verification forwards scored
    draft_forwards: Array  # scalar
    copied: Array  # [B] drafts copied from the context (``decode(lookup=...)``), among ``drafted``
    copied_accepted: Array  # [B] of those, accepted (among ``accepted``)
    target_forwards: Array  # scalar
    extra: dict = struct.field(default_factory=dict)

    @classmethod
    def zeros(cls, batch_size: int, num_draft: int, extra: dict | None = None) -> "DecodeStats":
        """All counters 0: ``[batch_size]``, ``[batch_size, num_draft]`` per slot.

        ``num_draft=0`` gives empty per-slot counters (``generate``, which then
        fills ``cycles``, ``tokens`` and ``target_forwards`` with ``replace``).
        """
        z = jnp.zeros((batch_size,), jnp.int32)
        per_slot = jnp.zeros((batch_size, num_draft), jnp.int32)
        return cls(
            cycles=z,
            drafted=z,
            accepted=z,
            judged=z,
            tokens=z,
            drafted_at=per_slot,
            reached_at=per_slot,
            accepted_at=per_slot,
            accepted_by_path=jnp.zeros((batch_size, NUM_PATHS), jnp.int32),
            verified=z,
            draft_forwards=jnp.int32(0),
            copied=z,
            copied_accepted=z,
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
        """``[B]`` tokens / cycles."""
        return _rates(self.tokens, self.cycles)

    @property
    def acceptance_rate_per_sequence(self) -> np.ndarray:
        """``[B]`` accepted / judged: each sequence's alpha."""
        return _rates(self.accepted, self.judged)

    # ----- totals -----
    @property
    def tau(self) -> float:
        """Mean tokens committed per cycle (incl. correction / bonus), over the batch."""
        return _ratio(np.sum(self.tokens), np.sum(self.cycles))

    @property
    def acceptance_rate(self) -> float:
        """alpha = accepted / judged, the per-token acceptance probability.

        Plugs into ``(1 - alpha^(K+1)) / (1 - alpha)`` (:func:`expected_tau`):
        the denominator counts only slots the rule decided, not the drafts
        after a rejection (see :attr:`accepted_per_drafted` for those).
        """
        return _ratio(np.sum(self.accepted), np.sum(self.judged))

    @property
    def accepted_per_drafted(self) -> float:
        """accepted / drafted: the share of drafted tokens kept (not alpha)."""
        return _ratio(np.sum(self.accepted), np.sum(self.drafted))

    @property
    def acceptance_at_position(self) -> np.ndarray:
        """``[K]`` accepted_at / reached_at: ``P(accept slot k | slot k judged)``."""
        return _rates(np.sum(self.accepted_at, 0), np.sum(self.reached_at, 0))

    @property
    def prefix_acceptance(self) -> np.ndarray:
        """``[K]`` accepted_at / drafted_at: ``P(slots 0..k accepted | slot k drafted)``.

        Cumulative, so non-increasing when every cycle drafts all ``K`` slots;
        ``prefix_acceptance[0]`` is the first-slot acceptance.
        """
        return _rates(np.sum(self.accepted_at, 0), np.sum(self.drafted_at, 0))

    @property
    def accepted_by_path_total(self) -> dict[str, int]:
        counts = np.asarray(self.accepted_by_path).sum(0)
        return {p.name.lower(): int(counts[p]) for p in Path if p != Path.REJECTED}

    @property
    def mean_drafted_per_cycle(self) -> float:
        return _ratio(np.sum(self.drafted), np.sum(self.cycles))

    @property
    def verified_per_cycle(self) -> float:
        """Tokens each verification forward scored per sequence: ``K + 1`` for a
        chain (less where a drafting policy stopped early and the forward ran
        narrower, ``Buckets.verify``), the tree's node count for a tree (what
        tau is bought with)."""
        return _ratio(np.sum(self.verified), np.sum(self.cycles))

    @property
    def efficiency(self) -> float:
        """tokens / (cycles * (K + 1)): tau as a share of its maximum."""
        return _ratio(np.sum(self.tokens), np.sum(self.cycles) * (self.num_draft + 1))

    def summary(self) -> dict[str, float]:
        """Totals as a flat dict of Python floats.

        Per slot ``k``: ``alpha_at_{k}`` (:attr:`acceptance_at_position`) and
        ``prefix_acceptance_{k}`` (:attr:`prefix_acceptance`). These are rates;
        to pool several calls, :func:`specjax.concatenate_stats` the stats, not the summaries.
        """
        out = {
            "sequences": float(self.batch_size),
            "cycles": float(np.sum(self.cycles)),
            "tokens": float(np.sum(self.tokens)),
            "drafted": float(np.sum(self.drafted)),
            "judged": float(np.sum(self.judged)),
            "accepted": float(np.sum(self.accepted)),
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "accepted_per_drafted": self.accepted_per_drafted,
            "mean_drafted_per_cycle": self.mean_drafted_per_cycle,
            "verified_per_cycle": self.verified_per_cycle,
            "efficiency": self.efficiency,
            "draft_forwards": float(self.draft_forwards),
            "target_forwards": float(self.target_forwards),
            "copied": float(np.sum(self.copied)),
            "copied_accepted": float(np.sum(self.copied_accepted)),
        }
        for k, rate in enumerate(self.acceptance_at_position):
            out[f"alpha_at_{k}"] = float(rate)
        for k, rate in enumerate(self.prefix_acceptance):
            out[f"prefix_acceptance_{k}"] = float(rate)
        for name, count in self.accepted_by_path_total.items():
            out[f"accepted_{name}"] = float(count)
        for name, value in self.extra.items():
            out[f"extra_{name}"] = float(np.sum(value))
        return out

    def __str__(self) -> str:
        s = self.summary()
        pos = " ".join(f"{r:.2f}" for r in self.acceptance_at_position)
        paths = ", ".join(f"{k}={v}" for k, v in self.accepted_by_path_total.items())
        return (
            f"DecodeStats(B={self.batch_size}, K={self.num_draft}: {int(s['tokens'])} tokens in "
            f"{int(s['cycles'])} seq-cycles, tau={s['tau']:.3f}, "
            f"alpha={s['acceptance_rate']:.3f} ({int(s['accepted'])}/{int(s['judged'])} judged), "
            f"accepted/drafted={s['accepted_per_drafted']:.3f} ({int(s['drafted'])} drafted), "
            f"alpha by position [{pos}], by path {{{paths}}}, "
            + (f"copied={int(s['copied'])} ({int(s['copied_accepted'])} accepted), " if s["copied"] else "")
            + f"forwards draft={int(s['draft_forwards'])} target={int(s['target_forwards'])})"
        )

    __repr__ = __str__


def record_cycle(
    stats: DecodeStats,
    *,
    live: Array,
    valid: Array,
    num_accepted: Array,
    num_committed: Array,
    paths: Array,
    draft_forwards: Array,
    verified: Array | int | None = None,
    copied: Array | None = None,
) -> DecodeStats:
    """Adds one draft-verify cycle to ``stats``. Pure and jit-friendly.

    Args:
      stats: the running counters, ``[B]`` / ``[B, K]``.
      live: ``[B]`` bool, rows that ran this cycle (not done, finite logits).
      valid: ``[B, K]`` bool, slots the drafting policy filled (a prefix).
      num_accepted: ``[B]`` int32, the rule's accepted prefix ``n`` among the
        valid slots (``n < sum(valid)`` means slot ``n`` was rejected).
      num_committed: ``[B]`` int32, tokens committed this cycle, ``c <= n + 1``
        after the cut at EOS and ``max_new_tokens`` (0 on non-live rows).
      paths: ``[B, K]`` int32 :class:`~specjax.rules.Path` codes of the verdict.
      draft_forwards: scalar int32, draft batch forwards run this cycle.
      verified: tokens the verification forward scored per sequence (scalar or
        ``[B]``); default ``K + 1``, a chain's block.
      copied: ``[B, K]`` bool, slots whose draft was copied from the context
        (``decode(lookup=...)``); default none.

    Returns:
      ``stats`` plus this cycle. Counting: slot ``k`` is reached (judged) when it
      is valid and its output position was committed (``k < c``, which implies
      ``k <= n``); it is accepted when also ``k < n``. So ``accepted = min(n, c)``
      and ``judged = accepted + [n < sum(valid) and n < c]``: an accepted draft
      cut by EOS or the token budget is not counted, and neither is a rejection
      whose correction token was cut. ``drafted`` and ``drafted_at`` count every
      valid slot of a live row (the work done); ``cycles`` counts live rows;
      ``target_forwards`` grows by one (one verification forward per cycle).
    """
    live = jnp.asarray(live, bool)
    live_i = live.astype(jnp.int32)
    valid = jnp.asarray(valid, bool) & live[:, None]
    k_max = valid.shape[1]
    pos = jnp.arange(k_max)[None, :]
    n = jnp.asarray(num_accepted, jnp.int32)[:, None]
    c = jnp.where(live, jnp.asarray(num_committed, jnp.int32), 0)[:, None]
    # Slot k lands at output position k: it counts only if that position was
    # committed. A committed position k <= n is slot k's accepted draft (k < n)
    # or the correction that followed its rejection (k == n).
    reached = valid & (pos < c)
    accepted = reached & (pos < n)
    reached_i, accepted_i = reached.astype(jnp.int32), accepted.astype(jnp.int32)
    path_counts = (
        jax.nn.one_hot(jnp.asarray(paths, jnp.int32), NUM_PATHS, dtype=jnp.int32) * accepted_i[..., None]
    ).sum(1)
    copied = valid & (False if copied is None else jnp.asarray(copied, bool))
    s = stats
    return s.replace(
        copied=s.copied + copied.sum(1, dtype=jnp.int32),
        copied_accepted=s.copied_accepted + (copied & accepted).sum(1, dtype=jnp.int32),
        cycles=s.cycles + live_i,
        drafted=s.drafted + valid.sum(1, dtype=jnp.int32),
        accepted=s.accepted + accepted_i.sum(1),
        judged=s.judged + reached_i.sum(1),
        tokens=s.tokens + c[:, 0],
        drafted_at=s.drafted_at + valid.astype(jnp.int32),
        reached_at=s.reached_at + reached_i,
        accepted_at=s.accepted_at + accepted_i,
        accepted_by_path=s.accepted_by_path + path_counts,
        verified=s.verified + live_i * jnp.asarray(k_max + 1 if verified is None else verified, jnp.int32),
        draft_forwards=s.draft_forwards + jnp.asarray(draft_forwards, jnp.int32),
        target_forwards=s.target_forwards + 1,
    )


def concatenate(stats_list: Sequence[DecodeStats]) -> DecodeStats:
    """Several calls' stats as one batch: per-sequence counters joined along
    ``B``, forward counts summed. Pool stats this way (not by adding up
    ``summary()`` dicts, whose rates do not add). All must share ``K``."""
    stats_list = [to_numpy(s) for s in stats_list]
    if not stats_list:
        raise ValueError("concatenate needs at least one DecodeStats")
    ks = {s.num_draft for s in stats_list}
    if len(ks) > 1:
        raise ValueError(f"concatenate needs one num_draft, got {sorted(ks)}")
    keys = set(stats_list[0].extra)
    if any(set(s.extra) != keys for s in stats_list):
        raise ValueError("concatenate needs the same extra keys in every DecodeStats")
    per_seq = ("cycles", "drafted", "accepted", "judged", "tokens", "drafted_at", "reached_at", "accepted_at",
               "accepted_by_path", "verified", "copied", "copied_accepted")
    joined = {f: np.concatenate([getattr(s, f) for s in stats_list]) for f in per_seq}
    return stats_list[0].replace(
        **joined,
        draft_forwards=np.sum([s.draft_forwards for s in stats_list]),
        target_forwards=np.sum([s.target_forwards for s in stats_list]),
        extra={k: np.concatenate([s.extra[k] for s in stats_list]) for k in keys},  # [B, ...] sums
    )


def to_numpy(tree: Any) -> Any:
    return jax.tree_util.tree_map(np.asarray, tree)
