"""Which platforms a program being traced will be lowered for, and branches chosen by them.

``jax.lax.platform_dependent`` traces every branch it is given. A decode step
holds hundreds of products and attentions, each with a CPU form and a GPU or
TPU one, and on a CPU server tracing the forms it never runs took a fifth of
``specjax serve``'s start-up (the XLA formulation of every quantized product).
A program is lowered for the default backend unless it is exported for
others, so the library's branches go through :func:`platform_dependent` here,
which traces only the branches of :func:`lowering_platforms`: the default
backend's on a CPU or a TPU, every branch on a GPU (whose lowering name, cuda
or rocm, the backend does not give), and inside :func:`exporting_for` the
platforms named there.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, Optional

import jax

_EXPORTING: contextvars.ContextVar[Optional[tuple[str, ...]]] = contextvars.ContextVar(
    "specjax_exporting_for", default=None
)
# Default backends whose name is also their lowering platform's.
_NARROWED = ("cpu", "tpu")
_KNOWN = ("cpu", "cuda", "rocm", "tpu")


@contextlib.contextmanager
def exporting_for(*platforms: str) -> Iterator[None]:
    """Traces specjax's programs for ``platforms`` (e.g. ``"cuda", "tpu"``) inside the block,
    for ``jax.export.export(..., platforms=...)`` on a machine of another kind.

    Outside such a block a program holds only the default backend's branches (on a CPU
    or a TPU), so exporting it for a GPU from a CPU would carry CPU kernels. JAX's
    traced and compiled programs are cleared on entry and on exit, so that no trace
    made for other platforms is reused."""
    unknown = [p for p in platforms if p not in _KNOWN]
    if not platforms or unknown:
        raise ValueError(f"exporting_for takes platform names among {_KNOWN}, got {platforms}.")
    token = _EXPORTING.set(tuple(platforms))
    jax.clear_caches()
    try:
        yield
    finally:
        _EXPORTING.reset(token)
        jax.clear_caches()


def lowering_platforms() -> Optional[tuple[str, ...]]:
    """The platforms a program traced now will be lowered for; None: any."""
    asked = _EXPORTING.get()
    if asked is not None:
        return asked
    backend = jax.default_backend()
    return (backend,) if backend in _NARROWED else None


def platform_dependent(*args, default: Callable, **branches: Callable):
    """``jax.lax.platform_dependent(*args, default=default, **branches)`` with only the
    branches :func:`lowering_platforms` needs: one platform's branch is called directly."""
    platforms = lowering_platforms()
    if platforms is None:
        return jax.lax.platform_dependent(*args, default=default, **branches)
    chosen = {p: branches.get(p, default) for p in platforms}
    if len({id(f) for f in chosen.values()}) == 1:
        return chosen[platforms[0]](*args)
    needed = {p: branches[p] for p in platforms if p in branches}
    if len(needed) < len(platforms):
        needed["default"] = default
    return jax.lax.platform_dependent(*args, **needed)
