"""Argument checks shared by the whole library (run on the host, before tracing).

Each returns the value as a plain Python number or raises ``ValueError`` naming
the argument, the value given and what is expected.
"""

from __future__ import annotations

import math
import numbers


def check_real(name: str, value) -> float:
    """A finite real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def check_nonnegative(name: str, value) -> float:
    value = check_real(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def check_positive(name: str, value) -> float:
    value = check_real(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return value


def check_interval(name: str, value, lo: float, hi: float, *, open_lo: bool = False) -> float:
    value = check_real(name, value)
    if value > hi or value < lo or (open_lo and value == lo):
        bracket = "(" if open_lo else "["
        raise ValueError(f"{name} must be in {bracket}{lo}, {hi}], got {value!r}")
    return value


def check_positive_int(name: str, value) -> int:
    """An integer >= 1: a Python or numpy integer (not a bool, not a float such
    as ``4.0``: a size given as a float is more often a slip than intended)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)
