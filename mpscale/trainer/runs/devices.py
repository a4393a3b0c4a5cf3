"""Devices before JAX starts: simulated CPU devices (the distributed runtime is in
`mpscale.trainer.runs.distributed`)."""

from __future__ import annotations

import os
import re
import sys
from typing import Optional


_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _backends_are_initialized() -> bool:
  """Whether JAX has started its backends (then XLA_FLAGS no longer apply). JAX has
  no public API for this; where its private one moved, assume they have not: the
  flag is then set, and a mesh that needs more devices than exist fails by name."""
  try:
    from jax._src import xla_bridge  # noqa: PLC0415
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):  # pragma: no cover - a JAX that moved it
    return False


def set_host_device_count(n: Optional[int]) -> None:
  """Make the CPU backend simulate ``n`` devices (before JAX initializes a backend).

  Raises:
    ValueError: if ``n`` < 1, or JAX is already running with fewer than ``n`` devices.
  """
  if n is None:
    return
  if n < 1:
    raise ValueError(f"--devices must be >= 1; got {n}")
  if "jax" in sys.modules and _backends_are_initialized():
    import jax
    if jax.device_count() < n:
      raise ValueError(f"--devices {n}: JAX is already running with "
                       f"{jax.device_count()} devices; set XLA_FLAGS={_DEVICE_FLAG}="
                       f"{n} before starting Python")
    return
  flags = re.sub(rf"{_DEVICE_FLAG}=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()
  os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={n}".strip()


def host_devices_at_least(n: int) -> None:
  """Make the CPU backend simulate at least ``n`` devices, where nothing else said
  how many: ``mpscale plan`` without ``--devices`` compiles for its config's mesh.
  Leaves a larger ``XLA_FLAGS`` count as it is, and does nothing once JAX runs (a
  mesh that needs more devices than it has then fails by name, naming
  ``--devices``)."""
  if "jax" in sys.modules and _backends_are_initialized():
    return
  given = re.search(rf"{_DEVICE_FLAG}=(\d+)", os.environ.get("XLA_FLAGS", ""))
  if given is None or int(given.group(1)) < n:
    set_host_device_count(n)


def start_on_cpu() -> None:
  """Make JAX start on the CPU platform (before it initializes a backend), unless
  ``JAX_PLATFORMS`` says otherwise: ``mpscale plan`` only compiles, and on the CPU
  platform JAX's CUDA plugin registers its compile-only GPU topologies without a
  GPU (`mpscale.trainer.planning.targets`). Does nothing once backends run."""
  if os.environ.get("JAX_PLATFORMS"):
    return
  if "jax" in sys.modules:
    if _backends_are_initialized():
      return
    import jax  # noqa: PLC0415
    jax.config.update("jax_platforms", "cpu")
  os.environ["JAX_PLATFORMS"] = "cpu"
