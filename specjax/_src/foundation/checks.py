"""Argument checks shared by the whole library (run on the host, before tracing).

Each returns the value as a plain Python number or raises ``ValueError`` naming
the argument, the value given and what is expected.
"""

from __future__ import annotations

import math
import numbers

import numpy as np


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


def as_integer(value) -> int | None:
    """``value`` as a Python int if it is an integer: a Python or numpy integer,
    or a 0-d integer array such as a JAX scalar; else ``None``. Not a bool, not
    a float such as ``4.0`` (a size given as a float is more often a slip)."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    dtype = getattr(value, "dtype", None)
    if dtype is not None and getattr(value, "shape", None) == () and np.issubdtype(dtype, np.integer):
        return int(value)
    return None


def check_positive_int(name: str, value) -> int:
    """An integer >= 1 (see :func:`as_integer`)."""
    number = as_integer(value)
    if number is None or number < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return number
