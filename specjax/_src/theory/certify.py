"""Live acceptance-certificate diagnostics for ``decode`` (the library half).

``specjax.theory.certificate(rule, p)`` (``_src/theory/certificates.py``) says how far, in
``KL(p || q)``, a drafter may be from the target before a greedy draft can be
rejected. This module measures it on real runs: a :class:`CertificateDiagnostics`
hook records, at every verified position of a greedy ``decode``, the drafter's
``KL(p || q)``, each criterion's certificate ``C(p)``, whether the position was
certified (``KL < C``) and whether the rule accepted the draft, so a report
gives the certified fraction and certificate quantiles (median, 5th percentile:
the paper's figures)::

    from specjax import theory
    from specjax.rules import additive

    diag = theory.certificate_diagnostics(additive(0.3), trees=(2, 4, 8))
    out = specjax.decode(pair, prompts, rule=additive(0.3), temperature=0.0, diagnostics=diag)
    report = diag.summarize(out.stats)          # CertificateReport
    report["additive:t=0.3"]["certificate_p5"], report["tree:m=4"]["certified_fraction"]

    # or, with the temperature checked up front:
    out, report = theory.certified_decode(pair, prompts, rule=additive(0.3), trees=(2, 4, 8))

Design. The engine's ``diagnostics`` hook sums per-sequence values over the
cycles of the jitted loop, so quantiles are kept as *histograms*: fine
log-spaced bins over ``[lo, log(m_max + 1)]`` (``lo = 1e-6`` nats, ``m_max``
the largest tree width, 1 without trees) plus an underflow bin (``C < lo``,
counted as 0) and an overflow bin (``C = +inf``: nothing can be rejected). Per
sequence that is a fixed ``[num_bins + 2]`` int32 vector per criterion,
independent of the generation length; each cycle scatters its ``K`` positions
into it. A quantile is read back by locating the two order statistics numpy's
(linear) quantile interpolates between and taking their bins' geometric
midpoints, so it is exact up to the stated resolution::

    |estimate - numpy.quantile(values)| <= resolution * max(x_lo, x_hi) + lo

with ``resolution = sqrt(bin ratio) - 1`` (0.36% with the default 2048 bins and
trees up to m = 8). Sums (certified, accepted, violations, sums of KL and of
finite certificates) are exact.

Which positions. A *verified position* is a draft slot ``j`` the target judged
on the committed trajectory: ``j`` valid and ``j <= n`` (the accepted drafts and
the first rejected one). Those are the statistics' positions. Soundness
(certified but rejected) is checked on *every* valid slot, including those after
the first rejection (their ``p`` and ``q`` are conditioned on the same draft
prefix, so the certificate applies there too).

Criteria. The first criterion is the decoding rule itself, and its acceptance
is the rule's real verdict. Extra criteria (``also=``: other level-set rules;
``trees=``: the greedy-tree event "the target's top token stays within the
drafter's top m", ``theory.tree_certificate``) are evaluated on the same
positions against ``theory.accepted_set`` / the tree event. ``rule_mismatches``
counts valid slots where the rule's verdict differs from ``theory.accepted_set``
(0 for the built-in level-set rules except top-m ties at the cut-off).

Greedy only. Certificates guarantee acceptance of a drafter that proposes its
argmax, i.e. greedy decoding (``temperature=0``). At ``temperature > 0`` the
engine samples the drafts, and speculative sampling's test is itself random, so
no rule has a certificate there: :func:`certified_decode` and
``certificate_diagnostics(..., temperature=T)`` raise ``ValueError``, and
``summarize`` raises if the recorded run drew random numbers.

Compilation. The hook is a frozen dataclass of hashable fields, so equal hooks
(built twice) key the engine's compile cache identically: a second ``decode``
with the same shapes compiles nothing.

App code apart. The ``specjax certify`` job (prompt files, one greedy run per
rule over ``CERTIFY_RULES``, the paper's figures, the table, the CDF plot and
the written outputs) is ``specjax/cli/certify.py``; this module has no argparse
and prints nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.theory import certificates as theory
from specjax._src.engine.loop import decode
from specjax._src.rules.base import RuleSpec, speculative_sampling

Array = jax.Array

DEFAULT_BINS = 2048
DEFAULT_LO = 1e-6
KL_HI = 64.0  # nats; finite KL above it lands in the last regular bin


# ----------------------------------------------------------------------------
# Criteria and bins


class Criterion(NamedTuple):
    """One certified event: a level-set rule (``spec``) or a greedy tree (``tree_m``)."""

    label: str
    spec: Optional[RuleSpec] = None
    tree_m: Optional[int] = None


def criterion_label(rule: Any) -> str:
    """``"greedy"`` for the strict rule, else the spec string (``"additive:t=0.3"``)."""
    spec = theory.normalize_spec(theory.check_certifiable(rule))
    return "greedy" if spec.name == "speculative_sampling" else str(spec)


def log_edges(lo: float, hi: float, num_bins: int) -> np.ndarray:
    """``num_bins + 1`` log-spaced edges from ``lo`` to ``hi``."""
    return np.exp(np.linspace(math.log(lo), math.log(hi), num_bins + 1))


def _bin_index(values: Array, lo: float, hi: float, num_bins: int) -> Array:
    """0: ``v < lo`` (incl. 0); 1..num_bins: log bins (finite ``v >= hi`` clipped
    into the last); ``num_bins + 1``: ``+inf``. NaN goes to the overflow bin too."""
    step = (math.log(hi) - math.log(lo)) / num_bins
    safe = jnp.where(jnp.isfinite(values) & (values >= lo), values, lo)
    regular = jnp.clip(jnp.floor((jnp.log(safe) - math.log(lo)) / step), 0, num_bins - 1).astype(jnp.int32) + 1
    idx = jnp.where(values < lo, 0, regular)
    return jnp.where(jnp.isfinite(values) | (values < lo), idx, num_bins + 1)


def _histogram(values: Array, mask: Array, lo: float, hi: float, num_bins: int) -> Array:
    idx = _bin_index(values, lo, hi, num_bins)
    return jnp.zeros((num_bins + 2,), jnp.int32).at[idx].add(mask.astype(jnp.int32))


def _representatives(lo: float, hi: float, num_bins: int) -> np.ndarray:
    """Value reported for each bin: 0, geometric midpoints, +inf."""
    e = log_edges(lo, hi, num_bins)
    return np.concatenate([[0.0], np.sqrt(e[:-1] * e[1:]), [np.inf]])


def resolution(lo: float, hi: float, num_bins: int) -> float:
    """Relative error bound of a bin's geometric midpoint: ``sqrt(ratio) - 1``."""
    return math.exp((math.log(hi) - math.log(lo)) / num_bins / 2) - 1


def histogram_quantile(hist: np.ndarray, q: float, lo: float, hi: float) -> float:
    """numpy's linear quantile ``q`` of the values histogrammed in ``hist``, to the
    resolution stated in the module docstring. NaN when the histogram is empty."""
    hist = np.asarray(hist, np.int64)
    num_bins = hist.shape[-1] - 2
    n = int(hist.sum())
    if n == 0:
        return float("nan")
    rep = _representatives(lo, hi, num_bins)
    cum = np.cumsum(hist)
    r = q * (n - 1)
    i0, i1 = int(math.floor(r)), int(math.ceil(r))
    v0 = rep[np.searchsorted(cum, i0, side="right")]
    v1 = rep[np.searchsorted(cum, i1, side="right")]
    frac = r - i0
    if frac == 0 or v0 == v1:
        return float(v0)
    return float(v0 + frac * (v1 - v0))


def histogram_cdf(hist: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """``(x, F(x))`` at the regular bins' upper edges (for plotting); ``x`` starts at ``lo``."""
    hist = np.asarray(hist, np.float64)
    num_bins = hist.shape[-1] - 2
    n = max(hist.sum(), 1.0)
    e = log_edges(lo, hi, num_bins)
    cum = np.cumsum(hist)[:-1] / n  # through the underflow bin, then each regular bin
    return e, cum


# ----------------------------------------------------------------------------
# The hook


def _rank(p: Array, tokens: Array) -> Array:
    """Rank of ``tokens[k]`` in the stable descending order of ``p[k]`` (ties: lower id first)."""
    pt = jnp.take_along_axis(p, tokens[:, None], -1)
    ids = jnp.arange(p.shape[-1])
    before = (p > pt) | ((p == pt) & (ids < tokens[:, None]))
    return before.sum(-1)


def _check_greedy(temperature: Optional[float], rule_label: str) -> None:
    if temperature is None or float(temperature) == 0.0:
        return
    why = (
        "speculative sampling's test is itself random at T > 0"
        if rule_label == "greedy"
        else "the engine samples drafts at T > 0, and the certificate guarantees acceptance "
        "only of a drafter that proposes its argmax"
    )
    raise ValueError(
        f"certificates apply to greedy decoding (temperature=0); rule {rule_label!r} has no "
        f"certificate at temperature={temperature}: {why}. Decode with temperature=0.0."
    )


@dataclasses.dataclass(frozen=True)
class CertificateDiagnostics:
    """A ``decode(..., diagnostics=)`` hook recording certificate statistics.

    Build with :func:`certificate_diagnostics`. Calling it is the engine's hook
    ``(inputs, verdict, num_accepted) -> dict`` of per-sequence values (summed over
    cycles into ``stats.extra``); :meth:`summarize` turns ``stats`` into a
    :class:`CertificateReport`. Keys of ``stats.extra`` (per sequence):
    ``positions``, ``sampled``, ``soundness_checked``, ``rule_mismatches``,
    ``kl_sum``, ``kl/hist`` and per criterion label ``L``: ``L/hist``,
    ``L/certified``, ``L/accepted``, ``L/violations``, ``L/cert_sum``.
    """

    criteria: tuple[Criterion, ...]
    num_bins: int = DEFAULT_BINS
    lo: float = DEFAULT_LO

    @property
    def hi(self) -> float:
        """Upper end of the certificate bins: the universal bound ``log(m_max + 1)``."""
        m = max([c.tree_m for c in self.criteria if c.tree_m is not None], default=1)
        return theory.universal_bound(m)

    @property
    def rule(self) -> Criterion:
        return self.criteria[0]

    @property
    def resolution(self) -> float:
        return resolution(self.lo, self.hi, self.num_bins)

    def __call__(self, inputs, verdict, num_accepted) -> dict[str, Array]:
        k = inputs.draft_tokens.shape[0]
        p = inputs.target_probs[:k]
        q = inputs.draft_probs
        tokens = inputs.draft_tokens
        valid = jnp.asarray(inputs.valid, bool)
        on_path = valid & (jnp.arange(k) <= num_accepted)
        kl = theory.kl_divergence(p, q)
        i32 = lambda m: m.sum(dtype=jnp.int32)  # noqa: E731
        out = {
            "positions": i32(on_path),
            # Greedy decoding draws nothing (the engine passes zero uniforms).
            "sampled": (jnp.asarray(inputs.uniforms) != 0).any().astype(jnp.int32),
            "soundness_checked": i32(valid),
            "kl_sum": jnp.where(on_path & jnp.isfinite(kl), kl, 0.0).sum(),
            "kl/hist": _histogram(kl, on_path, self.lo, KL_HI, self.num_bins),
        }
        for i, c in enumerate(self.criteria):
            if c.tree_m is not None:
                cert = theory.tree_certificate(p, c.tree_m)
                top = jnp.argmax(p, -1)
                q_top = jnp.take_along_axis(q, top[:, None], -1)
                others = (q >= q_top) & (jnp.arange(q.shape[-1]) != top[:, None])
                holds = others.sum(-1) < c.tree_m  # the target's top token is in q's top m
            else:
                k_acc = theory.num_accepted(c.spec, p)
                cert = theory.level_set_certificate(p, k_acc)
                member = _rank(p, tokens) < k_acc  # = theory.accepted_set(c.spec, p)[token], no sort
                if i == 0:
                    holds = jnp.asarray(verdict.accept, bool)
                    out["rule_mismatches"] = i32(valid & (holds != member))
                else:
                    holds = member
            certified = kl < cert
            out[f"{c.label}/hist"] = _histogram(cert, on_path, self.lo, self.hi, self.num_bins)
            out[f"{c.label}/certified"] = i32(on_path & certified)
            out[f"{c.label}/accepted"] = i32(on_path & holds)
            out[f"{c.label}/violations"] = i32(valid & certified & ~holds)
            out[f"{c.label}/cert_sum"] = jnp.where(on_path & jnp.isfinite(cert), cert, 0.0).sum()
        return out

    def summarize(self, stats, quantiles: Sequence[float] = (0.05, 0.5)) -> "CertificateReport":
        """Totals over the batch. Raises ``ValueError`` if the run was not greedy."""
        extra = {k: np.asarray(v) for k, v in stats.extra.items()}
        missing = [f"{c.label}/hist" for c in self.criteria if f"{c.label}/hist" not in extra]
        if missing or "positions" not in extra:
            raise ValueError(
                "stats.extra does not hold this hook's records (missing "
                f"{missing or ['positions']}); pass diagnostics=<this object> to decode."
            )
        if int(extra["sampled"].sum()):
            _check_greedy(1.0, self.rule.label)
        total = {k: v.sum(0) for k, v in extra.items()}
        positions = int(total["positions"])
        crit: dict[str, dict[str, Any]] = {}
        hists: dict[str, np.ndarray] = {}
        for c in self.criteria:
            hist = total[f"{c.label}/hist"].astype(np.int64)
            hists[c.label] = hist
            row: dict[str, Any] = {
                "criterion": c.label,
                "kind": "tree" if c.tree_m is not None else "rule",
                "decode_rule": c is self.rule,
                "positions": positions,
                "certified_fraction": _frac(total[f"{c.label}/certified"], positions),
                "accepted_fraction": _frac(total[f"{c.label}/accepted"], positions),
                "infinite_fraction": _frac(hist[-1], positions),
                "violations": int(total[f"{c.label}/violations"]),
                "mean_finite_certificate": _frac(total[f"{c.label}/cert_sum"], positions - int(hist[-1])),
            }
            for qq in quantiles:
                row[_qname(qq)] = histogram_quantile(hist, qq, self.lo, self.hi)
            crit[c.label] = row
        kl_hist = total["kl/hist"].astype(np.int64)
        kl = {"mean_finite": _frac(total["kl_sum"], positions - int(kl_hist[-1]))}
        for qq in quantiles:
            kl[_qname(qq).replace("certificate", "kl")] = histogram_quantile(kl_hist, qq, self.lo, KL_HI)
        return CertificateReport(
            criteria=crit,
            kl=kl,
            histograms=hists,
            kl_histogram=kl_hist,
            positions=positions,
            soundness_checked=int(total["soundness_checked"]),
            rule_mismatches=int(total["rule_mismatches"]) if "rule_mismatches" in total else 0,
            lo=self.lo,
            hi=self.hi,
            kl_hi=KL_HI,
            resolution=self.resolution,
        )


def _frac(num, den) -> float:
    den = float(den)
    return float(num) / den if den else float("nan")


def _qname(q: float) -> str:
    return {0.5: "certificate_median"}.get(q, f"certificate_p{100 * q:g}")


@dataclasses.dataclass
class CertificateReport:
    """What :meth:`CertificateDiagnostics.summarize` returns.

    ``report[label]`` is a dict per criterion: ``positions``, ``certified_fraction``,
    ``accepted_fraction``, ``infinite_fraction`` (nothing rejectable),
    ``violations`` (certified yet rejected: must be 0), ``certificate_median``,
    ``certificate_p5``, ``mean_finite_certificate``. ``kl`` holds the drafter's
    ``KL(p||q)`` quantiles. Quantiles are exact to ``resolution`` (relative) plus
    ``lo`` (absolute); ``histograms`` / ``kl_histogram`` are the raw counts.
    """

    criteria: dict[str, dict[str, Any]]
    kl: dict[str, float]
    histograms: dict[str, np.ndarray]
    kl_histogram: np.ndarray
    positions: int
    soundness_checked: int
    rule_mismatches: int
    lo: float
    hi: float
    kl_hi: float
    resolution: float

    def __getitem__(self, label: str) -> dict[str, Any]:
        return self.criteria[label]

    def quantile(self, label: str, q: float) -> float:
        if label == "kl":
            return histogram_quantile(self.kl_histogram, q, self.lo, self.kl_hi)
        return histogram_quantile(self.histograms[label], q, self.lo, self.hi)

    def to_dict(self) -> dict[str, Any]:
        return {
            "criteria": self.criteria,
            "kl": self.kl,
            "positions": self.positions,
            "soundness_checked": self.soundness_checked,
            "rule_mismatches": self.rule_mismatches,
            "bins": {"lo": self.lo, "hi": self.hi, "kl_hi": self.kl_hi,
                     "num_bins": int(self.kl_histogram.shape[0] - 2), "resolution": self.resolution},
        }


def certificate_diagnostics(
    rule: Any = None,
    *,
    trees: Iterable[int] = (),
    also: Iterable[Any] = (),
    num_bins: int = DEFAULT_BINS,
    lo: float = DEFAULT_LO,
    temperature: Optional[float] = None,
) -> CertificateDiagnostics:
    """The ``decode(..., diagnostics=)`` hook for certificate statistics.

    Args:
      rule: the rule ``decode`` runs with (an ``AcceptanceRule`` or ``RuleSpec``;
        default strict greedy). Must be certifiable (``theory.check_certifiable``):
        other rules raise ``ValueError`` saying why.
      trees: greedy-tree widths ``m`` whose certificate (``theory.tree_certificate``)
        and event (target's top token within the drafter's top m) are recorded too.
      also: more level-set rules evaluated on the same positions (against
        ``theory.accepted_set``, since decode runs only ``rule``).
      num_bins, lo: histogram resolution (module docstring).
      temperature: if given and ``> 0``, raises: certificates are for greedy decoding.
    """
    rule = speculative_sampling() if rule is None else rule
    label = criterion_label(rule)
    _check_greedy(temperature, label)
    crits = [Criterion(label, spec=theory.normalize_spec(theory.check_certifiable(rule)))]
    for r in also:
        crits.append(Criterion(criterion_label(r), spec=theory.normalize_spec(theory.check_certifiable(r))))
    for m in trees:
        if isinstance(m, bool) or int(m) != m or m < 1:
            raise ValueError(f"tree widths must be integers >= 1, got {m!r}")
        crits.append(Criterion(f"tree:m={int(m)}", tree_m=int(m)))
    labels = [c.label for c in crits]
    if len(set(labels)) != len(labels):
        raise ValueError(f"criteria repeat: {labels}")
    if int(num_bins) < 8 or not 0 < float(lo) < 1e-2:
        raise ValueError(f"need num_bins >= 8 and 0 < lo < 1e-2, got {num_bins}, {lo}")
    return CertificateDiagnostics(criteria=tuple(crits), num_bins=int(num_bins), lo=float(lo))


def certified_decode(params, prompt_ids, *, rule=None, trees: Iterable[int] = (), also: Iterable[Any] = (),
                     temperature: float = 0.0, num_bins: int = DEFAULT_BINS, **decode_kwargs):
    """``decode`` at temperature 0 with a :func:`certificate_diagnostics` hook.

    Returns ``(DecodeOutput, CertificateReport)``. Raises ``ValueError`` for a
    non-certifiable rule or ``temperature > 0`` before anything runs.
    """
    rule = speculative_sampling() if rule is None else rule
    diag = certificate_diagnostics(rule, trees=trees, also=also, num_bins=num_bins, temperature=temperature)
    out = decode(params, prompt_ids, rule=rule, temperature=0.0, diagnostics=diag, **decode_kwargs)
    return out, diag.summarize(out.stats)
