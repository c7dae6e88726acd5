"""Shared test configuration.

Tests run on the CPU. Multi-device tests start their own process with
``--xla_force_host_platform_device_count`` (the flag must be set before JAX
initialises, so it cannot be set here for one test only).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
