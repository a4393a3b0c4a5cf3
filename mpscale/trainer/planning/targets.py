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

TPUs: libtpu compiles for TPU topologies without a TPU (``pip install
"mpscale[plan-tpu]"``, which is ``jax[tpu]``; MaxText's ``train_compile`` does the
same). A TPU profile (``compile_target: tpu/v4``) then plans on
``get_topology_desc(platform="tpu", topology_name="v4:4x4x4",
chip_config_name="megacore")``: its chips in the slice shape `tpu_topology` gives,
one JAX device a chip, as on a v4 or v5p slice. One slice: a job larger than a
slice is not modelled.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
import math
from typing import Any, Optional, Sequence

INSTALL = 'pip install "mpscale[plan-gpu]"'
"""What installs the CUDA compiler (JAX's CUDA plugin) for plans on NVIDIA GPUs."""

INSTALL_TPU = 'pip install "mpscale[plan-tpu]"'
"""What installs the TPU compiler (libtpu) for plans on TPUs."""

TPU_CHIPS = {"v4": 3, "v5p": 3, "v5e": 2, "v6e": 2}
"""The TPU chips a ``tpu/<chip>`` compile target may name, and their slices' number
of torus dimensions."""

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
  """``"cuda"``, ``"tpu"`` or ``"cpu"``."""
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


class CompileTargetError(ValueError):
  """A ``compile_target`` no compiler here takes; ``reason`` says why, without the
  key (a hardware profile names the key and its file itself)."""

  def __init__(self, reason: str):
    self.reason = reason
    super().__init__(f"compile_target: {reason}")

  def __reduce__(self):
    return type(self), (self.reason,)


def spec_text(name: str) -> str:
  """The text of the target spec ``target_specs/<name>.txtpb``.

  Raises:
    CompileTargetError: for a spec that is not shipped.
  """
  if name not in names():
    raise CompileTargetError(f"no GPU target spec {name!r}; known: "
                             f"{', '.join('cuda/' + n for n in names())}")
  folder = importlib.resources.files(__package__).joinpath(_FOLDER)
  return folder.joinpath(name + ".txtpb").read_text()


def parse(compile_target: str) -> tuple[str, str]:
  """``"cuda/h100_sxm"`` as ``("cuda", "h100_sxm")``.

  Raises:
    CompileTargetError: for another platform or form, or a spec or chip not known.
  """
  platform, _, name = str(compile_target).partition("/")
  if platform not in ("cuda", "tpu") or not name:
    raise CompileTargetError(f"must be 'cuda/<spec>' or 'tpu/<chip>'; got "
                             f"{compile_target!r}")
  if platform == "cuda":
    spec_text(name)
  elif name not in TPU_CHIPS:
    raise CompileTargetError(f"no TPU chip {name!r}; known: "
                             f"{', '.join('tpu/' + n for n in TPU_CHIPS)}")
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


def tpu_topology(num_devices: int, chip: str) -> str:
  """The slice shape of ``num_devices`` chips of ``chip``: ``"v4:4x4x4"``.

  A 3D chip (v4, v5p) starts from one host's ``2x2x1`` and doubles its smallest
  dimension until the slice holds the chips (``2x2x2``, ``2x2x4``, ``2x4x4``,
  ``4x4x4``, ...); a 2D one (v5e, v6e) from ``2x2`` likewise (``2x4``, ``4x4``, ...).

  Raises:
    ValueError: naming ``mesh`` when ``num_devices`` is no such slice's chips (4
      times a power of two).
  """
  dims = [2, 2, 1] if TPU_CHIPS[chip] == 3 else [2, 2]
  while math.prod(dims) < num_devices:
    small = min(range(len(dims)), key=lambda i: (dims[i], -i))
    dims[small] *= 2
  if math.prod(dims) != num_devices:
    raise ValueError(f"mesh: {num_devices} devices are no {chip} slice; a slice "
                     "holds 4 times a power of two chips (4, 8, 16, ...)")
  return f"{chip}:" + "x".join(str(d) for d in sorted(dims, reverse=len(dims) == 3
                                                      and dims[2] == 1))


def tpu_installed() -> bool:
  """Whether libtpu (the compiler for TPUs) is installed."""
  return importlib.util.find_spec("libtpu") is not None


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
  if platform == "tpu":
    return _tpu(hardware, name, num_devices, mode)
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


def _tpu(hardware: Any, chip: str, num_devices: int, mode: str) -> Target:
  """`choose` for a TPU profile: libtpu's compile of a ``chip`` slice."""
  if not tpu_installed():
    return _instead(mode, f"{hardware.name}'s compiler (libtpu) is not installed",
                    f"install it with: {INSTALL_TPU}")
  shape = tpu_topology(num_devices, chip)
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    devices = topologies.get_topology_desc(
        platform="tpu", topology_name=shape, chip_config_name="megacore").devices
  except Exception as e:  # pylint: disable=broad-except  (libtpu's own errors)
    return _instead(mode, f"libtpu's compiler did not register ({type(e).__name__}: "
                    f"{str(e)[:200]})", "JAX must start with JAX_PLATFORMS=cpu "
                    "(mpscale plan sets it)")
  devices = list(devices)
  return Target(devices, "tpu", f"{num_devices} x {devices[0].device_kind} ({shape}, "
                "libtpu's compiler, no TPU needed)")
