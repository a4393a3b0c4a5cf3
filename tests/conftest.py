"""Test configuration: every test sees 8 fake CPU devices.

The flag must be set before jax is imported anywhere, which is why it lives at the
top of conftest.py (pytest imports it before any test module).
"""
import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the flag on purpose)

assert jax.device_count() == 8, "tests expect 8 fake CPU devices"
