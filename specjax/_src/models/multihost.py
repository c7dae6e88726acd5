"""What every process of a multi-host job must agree on before a program runs.

A multi-host (multi-controller) JAX job runs the same Python program on every
host; each builds the same global arrays and enters the same compiled program.
Two things must then be the same on every process, or the job computes mixed
rows or hangs in a collective that never completes:

* the inputs (:func:`check_same_on_every_process`): each process compares a
  digest of its arguments with every other's, and all raise the same error
  naming the processes that differ;
* anything drawn at random on the host (:func:`one_seed`): process 0's draw,
  broadcast.

With one process both are free: nothing is sent, nothing is compared.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable

import jax
import numpy as np


def _digest_words(parts: Iterable[Any]) -> np.ndarray:
    """SHA-256 of ``parts`` (arrays by dtype, shape and bytes; others by ``repr``) as ``uint32 [8]``."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, np.ndarray):
            arr = np.ascontiguousarray(part)
            h.update(f"{arr.dtype.str}{arr.shape}".encode())
            h.update(arr.view(np.uint8).reshape(-1).tobytes())
        else:
            h.update(repr(part).encode())
        h.update(b"\0")
    return np.frombuffer(h.digest(), np.uint32).copy()


def check_same_on_every_process(what: str, parts: Iterable[Any]) -> None:
    """Raises ``ValueError`` on every process unless all processes passed equal ``parts``.

    One all-gather of 32 bytes per call, on multi-process jobs only.
    ``what`` names the call in the message.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    mine = _digest_words(parts)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, 8], the same on every process
    differ = [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]
    if differ:
        raise ValueError(
            f"{what}: the processes of this multi-host job passed different inputs (process(es) "
            f"{', '.join(map(str, differ))} differ from process 0 in the prompts, their lengths or the "
            "settings). Every process must pass the same global batch and settings: gather per-host "
            "prompts first (jax.experimental.multihost_utils.process_allgather), in the same order "
            "everywhere (docs/sharding.md, Multi-host)."
        )


def one_seed(seed: int) -> int:
    """Process 0's ``seed`` on every process (``seed`` itself with one process)."""
    if jax.process_count() == 1:
        return int(seed)
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.uint32(seed)))
