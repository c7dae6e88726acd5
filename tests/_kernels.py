"""Whether a test that needs specjax's CPU kernels skips or fails without them.

On a developer's machine without a C++ compiler the kernel tests skip. In CI
(``CI=true``, which CI services set) or with ``SPECJAX_REQUIRE_KERNELS=1`` they
fail instead, naming why the kernels could not be built: a packaging or build
regression (a header missing from the wheel, a compiler error) must not pass
as a run of skipped tests.
"""

from __future__ import annotations

import os

import pytest

from specjax._src.kernels import cpu_matmul


def kernels_required() -> bool:
    """``CI=true`` or ``SPECJAX_REQUIRE_KERNELS=1``: a kernel that cannot be built is a failure."""
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("SPECJAX_REQUIRE_KERNELS") == "1"


def require_kernels(reason: str = "the CPU matmul kernels cannot be built here") -> None:
    """Returns if the kernels are built and registered; else skips the calling
    test with ``reason``, or fails it where :func:`kernels_required`."""
    try:
        cpu_matmul.ensure_loaded()
        return
    except cpu_matmul.KernelUnavailableError as e:
        error = str(e)
    if kernels_required():
        pytest.fail(f"{reason}, and CI=true or SPECJAX_REQUIRE_KERNELS=1 requires them:\n{error}", pytrace=False)
    pytest.skip(f"{reason}: {error.splitlines()[0] if error else ''}")
