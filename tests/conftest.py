"""Shared test configuration.

Tests run on the CPU. Multi-device tests start their own process with
``--xla_force_host_platform_device_count`` (the flag must be set before JAX
initialises, so it cannot be set here for one test only).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402  (after the platform is set)


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
