"""Test configuration: every test sees 8 fake CPU devices.

The flag must be set before jax is imported anywhere, which is why it lives at the
top of conftest.py (pytest imports it before any test module).

``MPSCALE_TEST_PLATFORM=gpu`` (or ``tpu``) runs the suite on that backend instead, with
the devices it has: there the tests that build meshes of several devices need that
many, so on one accelerator run the single-device and numerical files, e.g.
``tests/test_loss_scale.py tests/test_came.py tests/test_producer_select.py``.
"""
import os

PLATFORM = os.environ.get("MPSCALE_TEST_PLATFORM", "cpu")
_FLAG = "--xla_force_host_platform_device_count=8"
if PLATFORM == "cpu":
  if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
else:
  os.environ["JAX_PLATFORMS"] = PLATFORM

import jax  # noqa: E402  (after the flag on purpose)

if PLATFORM == "cpu":
  assert jax.device_count() == 8, "tests expect 8 fake CPU devices"
