"""The compiler a plan reads: the target hardware's own, or the CPU's in its place.

A hardware profile names its compile target (``compile_target: cuda/h100_sxm``). XLA
compiles for NVIDIA GPUs on a machine without one when JAX's CUDA plugin is installed
(``pip install "mpscale[plan-gpu]"``, which is ``jax[cuda12]``): the plugin registers
a compile-only topology (`jax.experimental.topologies.get_topology_desc`) of the
devices XLA's target spec describes (``target_specs/<name>.txtpb``, from openxla/xla's
``xla/backends/gpu/target_config/specs``), and ``lower().compile()`` then gives the
program those GPUs run: bf16 collectives kept bf16, GPU fusions, Triton and cuBLAS
GEMMs. Without the plugin the plan falls back to the CPU compile (8 fake host devices,
or ``--devices``) and says so, with the install line.

For the plugin to register, JAX must start on the CPU platform
(``JAX_PLATFORMS=cpu``): the plugin then skips its driver check. ``mpscale plan``
sets that before JAX starts; a program that already started JAX on another platform
gets the CPU compile and a note saying why.

TPUs: libtpu compiles for TPU topologies without a TPU on Cloud TPU images; it is not
tried here, so a TPU profile plans on the CPU compile.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
import math
from typing import Any, Optional, Sequence

INSTALL = 'pip install "mpscale[plan-gpu]"'
"""What installs the CUDA compiler (JAX's CUDA plugin) for plans on NVIDIA GPUs."""

MODES = ("auto", "target", "cpu")
"""``auto``: the target's compiler when installed, else the CPU's (with a note);
``target``: the target's compiler or an error with the install line; ``cpu``: the
CPU's."""

_FOLDER = "target_specs"


@dataclasses.dataclass(frozen=True)
class Target:
  """What a plan compiled for."""
  devices: Optional[Sequence[Any]]
  """The devices to build the mesh of, or ``None`` for JAX's own (the CPU's)."""
  compiler: str
  """``"cuda"`` or ``"cpu"``."""
  description: str
  """The devices and compiler in words, e.g. ``8 x NVIDIA H100 80GB HBM3 (XLA's CUDA
  compiler, no GPU needed)``."""
  note: str = ""
  """Why the CPU's compiler stood in for the target's, and how to install it."""


def names() -> list[str]:
  """The GPU target specs shipped (``cuda/<name>`` for each)."""
  folder = importlib.resources.files(__package__).joinpath(_FOLDER)
  return sorted(p.name[:-len(".txtpb")] for p in folder.iterdir()
                if p.name.endswith(".txtpb"))


def spec_text(name: str) -> str:
  """The text of the target spec ``target_specs/<name>.txtpb``.

  Raises:
    ValueError: naming ``compile_target`` for a spec that is not shipped.
  """
  if name not in names():
    raise ValueError(f"compile_target: no GPU target spec {name!r}; known: "
                     f"{', '.join('cuda/' + n for n in names())}")
  folder = importlib.resources.files(__package__).joinpath(_FOLDER)
  return folder.joinpath(name + ".txtpb").read_text()


def parse(compile_target: str) -> tuple[str, str]:
  """``"cuda/h100_sxm"`` as ``("cuda", "h100_sxm")``.

  Raises:
    ValueError: naming ``compile_target`` for another platform or form.
  """
  platform, _, name = str(compile_target).partition("/")
  if platform not in ("cuda", "tpu") or not name:
    raise ValueError(f"compile_target must be 'cuda/<spec>' or 'tpu/<chip>'; got "
                     f"{compile_target!r}")
  if platform == "cuda":
    spec_text(name)
  return platform, name


def topology(num_devices: int, devices_per_node: int) -> str:
  """The compile-only topology ``"<nodes>x1x<devices a node>"`` of ``num_devices``:
  one node of them when they fit in one, else whole nodes.

  Raises:
    ValueError: naming ``mesh`` when ``num_devices`` spans nodes but does not fill
      them (a topology is whole nodes).
  """
  if num_devices <= devices_per_node:
    return f"1x1x{num_devices}"
  if num_devices % devices_per_node:
    raise ValueError(
        f"mesh: {num_devices} devices span {math.ceil(num_devices / devices_per_node)} "
        f"nodes of {devices_per_node} but do not fill them; a compile topology is "
        "whole nodes")
  return f"{num_devices // devices_per_node}x1x{devices_per_node}"


def cuda_installed() -> bool:
  """Whether JAX's CUDA plugin (the compiler for NVIDIA GPUs) is installed."""
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:
    return False


def _cpu(reason: str) -> Target:
  return Target(None, "cpu", "fake CPU devices (XLA's CPU compiler)", reason)


def _instead(mode: str, why: str, remedy: str) -> Target:
  """The CPU's compile in place of the target's, saying ``why`` and the ``remedy``;
  with ``mode="target"``, the error saying so."""
  if mode == "target":
    raise ValueError(f"compiler: {why}; {remedy}")
  return _cpu(f"{why}; planned on the CPU compile instead; {remedy}")


def choose(hardware: Any, num_devices: int, mode: str = "auto") -> Target:
  """The devices a plan compiles for, on ``hardware`` (a `Hardware`, or ``None``).

  Args:
    hardware: the profile, whose ``compile_target`` names its compiler.
    num_devices: the mesh's devices.
    mode: one of `MODES`.

  Raises:
    ValueError: an unknown ``mode``; with ``mode="target"``, a profile without a
      compile target or whose compiler is not installed (the message gives the
      install line); a device count the topology cannot hold.
  """
  if mode not in MODES:
    raise ValueError(f"compiler must be one of {', '.join(MODES)}; got {mode!r}")
  if mode == "cpu":
    return _cpu("")
  target = getattr(hardware, "compile_target", None)
  if target is None:
    if mode == "target":
      raise ValueError("compiler: target needs --hardware with a compile_target")
    return _cpu("")
  platform, name = parse(target)
  if platform != "cuda":
    return _instead(mode, f"{hardware.name}'s compiler ({target}) is not tried here",
                    "plan with --compiler cpu")
  if not cuda_installed():
    return _instead(mode, f"{hardware.name}'s compiler (XLA's CUDA compiler) is not "
                    "installed", f"install it with: {INSTALL}")
  shape = topology(num_devices, int(hardware.devices_per_node))
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    devices = topologies.get_topology_desc(
        name, "cuda", target_config=spec_text(name), topology=shape).devices
  except Exception as e:  # pylint: disable=broad-except  (the plugin's own errors)
    return _instead(mode, f"XLA's CUDA compiler did not register ({type(e).__name__}: "
                    f"{str(e)[:200]})", "JAX must start with JAX_PLATFORMS=cpu "
                    "(mpscale plan sets it)")
  devices = list(devices)[:num_devices]
  return Target(devices, "cuda", f"{num_devices} x {devices[0].device_kind} "
                "(XLA's CUDA compiler, no GPU needed)")
