"""JAX's persistent compilation cache for the ``specjax`` commands, and a count of the programs a job builds.

A job compiles each distinct program once per process: on a 2-core CPU the real
pair's main comparison spends minutes compiling, and a server compiles every
program it will run before it takes requests. With the persistent cache a
compiled program is written to disk, and the next process that builds the same
program (same computation, shapes, flags, jax version and device) loads it
instead of compiling it. Tracing and lowering still run; only XLA's compile is
skipped.

The commands turn the cache on by default, in ``$XDG_CACHE_HOME/specjax/jax``
(else ``~/.cache/specjax/jax``). ``--compilation-cache DIR`` picks another
directory, ``--no-compile-cache`` (or ``SPECJAX_COMPILATION_CACHE=none``)
turns it off; ``SPECJAX_COMPILATION_CACHE=DIR`` and JAX's own
``JAX_COMPILATION_CACHE_DIR`` pick the directory from the environment. Every
program is kept, however quick its compile and small its executable (JAX's
defaults keep only programs that took a second to compile). On a GPU JAX also
keeps XLA's per-fusion autotuning results there
(``jax_persistent_cache_enable_xla_caches``), so a second run does not
autotune again.

The cache is trusted code: do not point it at a directory others can write to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from pathlib import Path
from typing import Iterator, Optional

#: The environment variable that names the cache directory, or turns the cache off (``none``, ``off``, ``0``).
ENV = "SPECJAX_COMPILATION_CACHE"
_OFF = ("none", "off", "0", "false", "no")

# jax.monitoring events: one BUILT per program built (compiled, or loaded from the cache, its
# duration the wall time of either), one LOADED per program loaded from the persistent cache.
BUILT = "/jax/core/compile/backend_compile_duration"
LOADED = "/jax/compilation_cache/cache_hits"


def default_dir() -> Path:
    """``$XDG_CACHE_HOME/specjax/jax``, else ``~/.cache/specjax/jax``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specjax" / "jax"


def is_off(value: Optional[str]) -> bool:
    """Whether a flag's or environment variable's value turns the cache off."""
    return value is not None and value.strip().lower() in _OFF


def resolve(directory: Optional[str] = None, *, enabled: bool = True) -> Optional[str]:
    """The directory the cache goes in, or None where it is off.

    In order: ``enabled=False`` (``--no-compile-cache``) turns it off;
    ``directory`` (``--compilation-cache``) names it, or turns it off with
    ``"none"``; then ``$SPECJAX_COMPILATION_CACHE`` (the same values); then
    ``$JAX_COMPILATION_CACHE_DIR``; then :func:`default_dir`.
    """
    if not enabled:
        return None
    for value in (directory, os.environ.get(ENV)):
        if value:
            return None if is_off(value) else value
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(default_dir())


def enable(directory: Optional[str]) -> Optional[str]:
    """Points JAX's persistent compilation cache at ``directory`` (created if missing), keeping every
    program; None turns the cache off for this process. Call it before anything compiles: JAX decides
    once per process, at its first compile, whether it uses a cache (this resets that decision).

    Returns ``directory``.

    Raises:
      ValueError: ``directory`` cannot be created or is not a directory.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
        return None
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"compilation cache {directory}: {e.strerror or e}; give a writable directory, or turn the cache off "
            f"with --no-compile-cache (or {ENV}=none)."
        ) from None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # JAX's defaults keep only programs that took >= 1 s to compile; a decode job builds dozens of
    # smaller ones (the prefill buckets, the eager casts of loading) whose sum is what a restart pays.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # every size, no filesystem override
    compilation_cache.reset_cache()
    return str(directory)


@dataclasses.dataclass
class ProgramCount:
    """Programs a job built: ``built`` in all, ``loaded`` of them from the persistent cache, the
    rest compiled; ``seconds`` the wall time spent building them (compiling or loading);
    ``by_name`` that time per jitted function's name (``[programs, seconds]``)."""

    built: int = 0
    loaded: int = 0
    seconds: float = 0.0
    by_name: dict = dataclasses.field(default_factory=dict)

    @property
    def compiled(self) -> int:
        return self.built - self.loaded

    def slowest(self, count: int = 3) -> list[tuple[str, int, float]]:
        """``(name, programs, seconds)`` of the ``count`` functions whose programs took longest to build."""
        ranked = sorted(self.by_name.items(), key=lambda item: -item[1][1])[:count]
        return [(name, n, seconds) for name, (n, seconds) in ranked]

    def describe(self) -> str:
        slowest = ", ".join(
            f"{name} {seconds:.1f} s" + (f" ({n})" if n > 1 else "") for name, n, seconds in self.slowest()
        )
        return (
            f"{self.built} programs built in {self.seconds:.1f} s: {self.compiled} compiled, "
            f"{self.loaded} loaded from the compilation cache" + (f"; slowest: {slowest}" if slowest else "")
        )


_lock = threading.Lock()


@contextlib.contextmanager
def count_programs() -> Iterator[ProgramCount]:
    """Counts the programs built (by any thread) while the block runs: jit cache misses, each
    compiled or loaded from the persistent cache. A program already in this process's jit cache
    is not built again and not counted."""
    import jax

    count = ProgramCount()

    def on_duration(event, duration, **kwargs):
        if event == BUILT:
            name = str(kwargs.get("fun_name", "?"))
            with _lock:
                count.built += 1
                count.seconds += duration
                entry = count.by_name.setdefault(name, [0, 0.0])
                entry[0] += 1
                entry[1] += duration

    def on_event(event, **kwargs):
        del kwargs
        if event == LOADED:
            with _lock:
                count.loaded += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)
