"""A run's arithmetic rate: the train step's FLOPs, read from its compiled program, and
the peak its MFU is taken against.

- `StepFlops` counts the FLOPs one device runs in one step, once per compiled program
  (one per batch shape: a batch-size ramp-up compiles one per size). It reads the
  program the loop runs: ``step.lower(state, batch).compile()`` is jit's own cache
  entry, the executable the call runs (nothing is compiled twice), and its HLO text
  is counted by `mpscale.trainer.planning.hlo.matmul_flops`, the count ``mpscale
  plan`` gives as ``flops_per_device``.
- `peak` reads ``train.hardware`` (a built-in profile's name or a profile file,
  `mpscale.trainer.planning.hardware.load_hardware`) and gives the peak FLOP/s of the
  step's compute dtype (`mpscale.trainer.planning.hardware.peak_for`, the plan's).

`mpscale.trainer.runs.metrics_log` turns them into the logged ``tflops_per_device``
(the interval's FLOPs a device over its seconds) and ``mfu`` (that over the peak).
What the count holds, and how it compares with MaxText's, torchtitan's and
Megatron-LM's: docs/trainer.md, "TFLOP/s and MFU".
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import numpy as np

from mpscale import validation
from mpscale.trainer.planning import hlo
from mpscale.trainer.planning.hardware import load_hardware, peak_for

KEY = "train.hardware"
"""The config key naming the hardware profile (``mpscale train --hardware``)."""


def compiled_flops(compiled: Any) -> float:
  """The FLOPs one device runs in a step of a compiled program (``jax.jit(f).lower(
  ...).compile()``): `mpscale.trainer.planning.hlo.matmul_flops` of its HLO text."""
  return hlo.matmul_flops(compiled.as_text())


class StepFlops:
  """The FLOPs a device of each step of a jitted ``step(state, batch)``, counted once
  per program it compiles to (per batch shapes and dtypes).

  Calling it before the step (``flops = count(state, batch)``; then
  ``step(state, batch)``) compiles the step as the call would, into jit's cache, so
  the call compiles nothing more; a later step of the same shapes costs a dictionary
  lookup. A step that is not jitted (no ``lower``: a plain function, a wrapper)
  has no program to read: its count is NaN, and the logged rate is empty."""

  def __init__(self, step: Callable[..., Any]):
    self.step = step
    self.counted: dict[Any, float] = {}
    self.last = math.nan  # the latest step's count

  def __call__(self, state: Any, batch: Any) -> float:
    key = _shapes(batch)
    if key not in self.counted:
      lower = getattr(self.step, "lower", None)
      self.counted[key] = (math.nan if lower is None
                           else compiled_flops(lower(state, batch).compile()))
    self.last = self.counted[key]
    return self.last


def _shapes(tree: Any) -> Any:
  """What picks a compiled program of the step, beside the state (whose shapes do not
  change): the batch's structure, shapes and dtypes."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x).__name__)))
                        for x in leaves)


class Peak(NamedTuple):
  """The peak a run's MFU is taken against."""
  hardware: str
  """The profile's name."""
  dtype: str
  """The step's compute dtype."""
  flops: float
  """FLOP/s a device: the profile's dense peak for ``dtype``
  (`mpscale.trainer.planning.hardware.peak_for`: float32 at TF32's where listed)."""


def peak(name: Optional[str], compute_dtype: Any) -> Optional[Peak]:
  """The peak of ``train.hardware`` (``name``: a built-in profile or a profile file)
  for ``compute_dtype``; ``None`` without one.

  Raises:
    ArgumentError: naming ``train.hardware``, for a name that is neither a built-in
      profile nor a file, a profile file's mistake, or a profile that lists no peak
      for the compute dtype (then naming ``precision.policy`` too).
  """
  if name is None:
    return None
  dtype = np.dtype(compute_dtype).name
  try:
    profile = load_hardware(name)
  except validation.ArgumentError as e:  # an unknown name: said as --hardware's
    raise e.renamed(lambda n: KEY if n == "--hardware" else n) from None
  except (ValueError, TypeError) as e:  # a profile file's mistake, naming the file
    cls = (validation.ArgumentTypeError if isinstance(e, TypeError)
           else validation.ArgumentError)
    raise validation.fail(KEY, f" ({name}): {e}", cls) from None
  try:
    return Peak(profile.name, dtype, peak_for(profile, dtype))
  except validation.ArgumentError:
    raise validation.ArgumentError(
        (KEY, "precision.policy"),
        "{0}: " + validation.literal(f"{profile.name} lists no peak for {dtype}, the "
                                     "compute dtype of ") + "{1}"
        + validation.literal(f"; it lists {', '.join(profile.peak_flops)}")) from None
