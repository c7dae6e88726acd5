"""Shared test configuration.

Tests run on the CPU. Multi-device tests start their own process with
``--xla_force_host_platform_device_count`` (the flag must be set before JAX
initialises, so it cannot be set here for one test only).
"""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Most of the suite's time is XLA's backend compiling hundreds of small
# programs that then run for milliseconds: without its expensive passes two of
# the heaviest test files ran 21% faster (2026-11-25, 2-core CPU). The programs
# compute the same values; set the variable to 0 to test what users run.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# With the same switch, XLA's CPU backend emits fused loops with its classic
# emitter instead of its MLIR fusion emitters, which took about twice the CPU
# time to compile the tiny pair's decode programs (2026-11-26, 2-core CPU; the
# 8-device sharding worker's report was identical either way). An
# ``xla_cpu_use_fusion_emitters`` already in XLA_FLAGS is kept.
FAST_COMPILE_XLA_FLAG = "--xla_cpu_use_fusion_emitters=false"
if (os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"
        and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_XLA_FLAG}".strip()

import pytest  # noqa: E402  (after the platform is set)

_IS_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ


def pytest_configure(config):
    """One compilation cache per run, shared by the xdist workers.

    Test modules compile the same programs (one tiny pair's decode loop in many
    files) and ``_free_compiled_programs`` drops them between modules, so a
    disk cache lets a worker load what another module or worker compiled. The
    directory is made before the workers start (they inherit the variable) and
    removed when the run ends, so no stale entry outlives it; a developer's own
    ``JAX_COMPILATION_CACHE_DIR`` is used as it is and kept.
    """
    if _IS_XDIST_WORKER or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    cache_dir = tempfile.mkdtemp(prefix="specjax-test-jit-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    # The default (1 s) would skip most of the suite's programs.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    config._specjax_cache_dir = cache_dir


def pytest_unconfigure(config):
    cache_dir = getattr(config, "_specjax_cache_dir", None)
    if cache_dir is not None:
        shutil.rmtree(cache_dir, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops JAX's compiled programs after each test module.

    An xdist worker compiles hundreds of programs and grew past 6 GB here; in
    three of five full runs on 2026-11-24 a worker died of a segfault inside
    XLA's CPU compiler (each time in a different, unchanged test), and the run
    then hung. That matches a known XLA CPU failure: a process that keeps
    compiling new programs crashes in the JIT's code memory manager
    (jax-ml/jax#27201, patrick-kidger/equinox#972), and freeing the compiled
    programs is the workaround reported there. Within a module compiled
    programs stay cached, so "a second call compiles nothing" still holds there.
    """
    yield
    import jax

    jax.clear_caches()


@pytest.fixture(scope="module")
def llama_pair():
    """A random Llama target and its 1-layer draft (``specjax.testing.peaked_target_and_draft``)."""
    import specjax
    from specjax.testing import llama_config, peaked_target_and_draft

    return specjax.pair(*peaked_target_and_draft(llama_config()))


@pytest.fixture(scope="module")
def bigram_pair():
    """Bigram target and draft over 8 tokens (``test_decode.VOCAB``), tables of seeds 0 and 1."""
    import specjax
    from specjax.testing import bigram_model, random_table

    return specjax.pair(bigram_model(random_table(0, 8)), bigram_model(random_table(1, 8)))


@pytest.fixture
def cpu_kernels():
    """The CPU matmul kernels, built: else the test skips, or fails under
    ``CI=true`` or ``SPECJAX_REQUIRE_KERNELS=1`` (``tests/_kernels.py``). Use as
    ``pytest.mark.usefixtures("cpu_kernels")``."""
    from _kernels import require_kernels  # not at the top: it imports JAX, which must follow pytest_configure

    require_kernels()
