"""Streaming (``on_tokens=``): each cycle's committed tokens, reported to the host while the loop runs.

Three pieces, one per side of the device boundary:

* host, before the loop: :func:`run_streaming` registers the call's
  ``on_tokens`` under a fresh integer id (the registry ``_STREAMS``), runs the
  loop with that id as a traced operand, waits for every callback, then
  unregisters it and re-raises an error ``on_tokens`` raised;
* device, inside the loop body: :func:`report_tokens` slices the tokens this cycle
  committed and sends them out through an ordered ``io_callback``;
* host, per cycle: :func:`_dispatch`, the one host function every compiled
  program holds, looks the id up and calls that call's ``on_tokens``.

A call without ``on_tokens`` compiles no callback at all (``LoopConfig.stream``).
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from specjax._src.engine.config import LoopConfig
from specjax._src.engine.prepare import PreparedCall

Array = jax.Array

# The callbacks of the streaming calls in flight, by the id each call passes
# to its loop as a traced operand: the compiled program holds one fixed host
# function (:func:`_dispatch`), so a new ``on_tokens`` (e.g. a bound method
# of a fresh object per request) compiles nothing, and calls running in
# parallel threads each reach their own callback.
_STREAMS: dict[int, "_Stream"] = {}
_STREAM_IDS = itertools.count(1)
_STREAMS_LOCK = threading.Lock()


class _Stream:
    """One call's ``on_tokens`` and the caller's batch (rows past it are bucket padding)."""

    def __init__(self, fn: Callable, batch: int):
        self.fn, self.batch, self.error = fn, batch, None


def check_on_tokens(on_tokens, call: "PreparedCall") -> None:
    if on_tokens is None:
        return
    if not callable(on_tokens):
        raise TypeError(f"on_tokens must be callable (tokens, counts) -> None, got {type(on_tokens).__name__}.")
    if call.cfg.layout is not None:
        raise ValueError(
            "on_tokens (streaming) is not supported on a mesh (mesh=, or params placed on one): "
            "its per-cycle host callback is an ordered effect, which JAX runs on one device only. "
            "Decode without on_tokens there, or on one device."
        )


def _dispatch(stream_id, tokens, counts) -> None:
    """Host side of the per-cycle callback: forwards the caller's rows to its ``on_tokens``.

    A cycle that commits nothing for the caller's rows is not reported. An
    exception of ``on_tokens`` is kept and re-raised by ``decode`` /
    ``generate`` once the loop is over (raised here, JAX would replace it by a
    runtime error); that call's later cycles are then not reported.
    """
    stream = _STREAMS.get(int(stream_id))
    if stream is None or stream.error is not None:
        return
    counts = np.asarray(counts, np.int32)[: stream.batch]
    if not counts.any():
        return
    try:
        stream.fn(np.asarray(tokens, np.int32)[: stream.batch], counts)
    except Exception as e:  # noqa: BLE001 - re-raised by the caller
        stream.error = e


def report_tokens(cfg: LoopConfig, stream_id, tokens: Array, before: Array, after: Array, width: int, pad_id) -> None:
    """Inside the loop body: reports ``tokens[b, before[b]:after[b]]`` (the
    tokens committed by this cycle, at most ``width``) to the host.

    ``io_callback(ordered=True)``: ordered so that the chunks arrive in cycle
    order, and an ``io_callback`` (not ``jax.debug.callback``) because this
    is an effect the caller relies on, which must neither be dropped nor
    reordered; it runs inside ``while_loop`` with the effect token in the
    carry. It costs one device-to-host round trip per cycle; the program
    compiled without ``on_tokens`` (``cfg.stream`` False) has no callback.
    """
    if not cfg.stream:
        return
    counts = (after - before).astype(jnp.int32)
    chunk = jax.vmap(lambda row, off: jax.lax.dynamic_slice(row, (off,), (width,)))(tokens, before)
    chunk = jnp.where(jnp.arange(width)[None, :] < counts[:, None], chunk, pad_id)
    io_callback(_dispatch, None, stream_id, chunk, counts, ordered=True)


def run_streaming(on_tokens, batch: int, run: Callable):
    """``run(stream_id)`` with ``on_tokens`` registered; waits for the loop (and
    so for every callback) before returning, then re-raises a callback error."""
    if on_tokens is None:
        return run(None)
    stream = _Stream(on_tokens, batch)
    with _STREAMS_LOCK:
        stream_id = next(_STREAM_IDS) % (2**31 - 1)
        _STREAMS[stream_id] = stream
    try:
        result = jax.block_until_ready(run(np.int32(stream_id)))
        jax.effects_barrier()
    finally:
        with _STREAMS_LOCK:
            _STREAMS.pop(stream_id, None)
    if stream.error is not None:
        raise stream.error
    return result

