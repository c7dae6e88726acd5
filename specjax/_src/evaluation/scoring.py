"""Scores of a comparison's outputs: intervals, percentiles, the target's likelihood, agreement."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.models.loading import logits as model_logits


def mean_target_nll(
    target,
    prompts: Sequence[Sequence[int]],
    tokens: np.ndarray,
    lengths: np.ndarray,
    width: Optional[int] = None,
    chunk: int = 8,
) -> float:
    """Mean negative log-likelihood per generated token under the target (T=1).

    Rows are scored ``chunk`` at a time, padded to ``width`` (default: the
    longest row), so every call with the same ``width`` reuses one program.
    """
    rows = [list(p) + row[:n].tolist() for p, row, n in zip(prompts, tokens, lengths)]
    width = max(width or 0, max(len(r) for r in rows))
    total, count = 0.0, 0
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        padded = np.zeros((min(chunk, len(rows)), width), np.int32)
        for i, r in enumerate(part):
            padded[i, : len(r)] = r
        logp = np.asarray(jax.nn.log_softmax(model_logits(target, jnp.asarray(padded)), -1))
        # Token t is scored by the logits at t - 1; only generated positions count.
        token_logp = np.take_along_axis(logp[:, :-1], padded[:, 1:, None], -1)[..., 0]
        starts = np.array([len(p) for p in prompts[start : start + chunk]])[:, None]
        ends = starts + np.asarray(lengths[start : start + chunk])[:, None]
        positions = np.arange(1, width)[None, :]
        generated = (positions >= starts) & (positions < ends)
        total -= float(token_logp[: len(part)][generated].sum())
        count += int(generated.sum())
    return total / max(count, 1)


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% for ``z`` 1.96):
    unlike the normal approximation it stays inside [0, 1] and is honest for
    small samples and proportions near 0 or 1 (E. B. Wilson, "Probable
    Inference, the Law of Succession, and Statistical Inference", JASA 1927)."""
    if trials <= 0:
        return math.nan, math.nan
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def percentiles(values: Sequence[float]) -> tuple[float, float, float]:
    """10th, 50th and 90th percentile of the finite values (NaN where there are none)."""
    finite = np.asarray([v for v in values if math.isfinite(v)], float)
    if not finite.size:
        return math.nan, math.nan, math.nan
    p10, p50, p90 = np.percentile(finite, (10, 50, 90))
    return float(p10), float(p50), float(p90)


def token_agreement(tokens, lengths, ref_tokens, ref_lengths) -> float:
    """Fraction of positions equal to the reference output, over the reference's length."""
    same = total = 0
    for row, n, ref, m in zip(tokens, lengths, ref_tokens, ref_lengths):
        k = int(m)
        total += k
        same += int((row[: min(int(n), k)] == ref[: min(int(n), k)]).sum())
    return same / max(total, 1)
