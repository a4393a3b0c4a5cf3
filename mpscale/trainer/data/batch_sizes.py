"""Training counted in samples: the global batch size of each step, with Megatron's
batch-size ramp-up, and the samples consumed before it.

Megatron-LM counts a run in samples (``train_samples``, ``lr_warmup_samples``,
``lr_decay_samples``, ``consumed_samples``) and may start with a smaller global batch
that grows as training goes (``rampup_batch_size = [start, increment, samples]``).
`BatchSizes` is that rule. Before each step, with ``consumed`` samples already
trained on::

  if ramp-up and consumed <= ramp_samples:
    size = start + floor(consumed / (ramp_samples / num_increments)) * increment
  else:
    size = batch_size                    # num_increments = (batch_size - start) / increment
  step trains on samples [consumed, consumed + size); consumed += size

Each distinct size is a phase of steps; `consumed_at(step)` is exact integer arithmetic
over the phases, on the host, and `consumed_fn` is the same function of a traced step
count (for the learning-rate schedule, which Megatron computes from the samples
consumed). With no ramp-up every step trains on ``batch_size`` samples.

References:
  Megatron-Core, ``megatron/core/num_microbatches_calculator.py``
  (``RampupBatchsizeNumMicroBatchesCalculator.update``) and Megatron-LM's
  ``training.py`` (``update_num_microbatches(consumed_samples)`` before each step).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpscale import validation


@dataclasses.dataclass(frozen=True)
class Phase:
  """A run of steps with one global batch size."""
  first_step: int
  """Its first step."""
  consumed: int
  """Samples consumed before ``first_step``."""
  size: int
  """Its global batch size."""


@dataclasses.dataclass(frozen=True)
class BatchSizes:
  """The global batch size of every step, with an optional ramp-up.

  Attributes:
    batch_size: the global batch size (after the ramp-up).
    rampup: ``(start, increment, ramp_samples)`` as Megatron's ``rampup_batch_size``,
      or ``None`` for a constant batch.
  """
  batch_size: int
  rampup: Optional[tuple[int, int, int]] = None

  def __post_init__(self):
    validation.positive_int("batch_size", self.batch_size)
    if self.rampup is None:
      return
    if not isinstance(self.rampup, (tuple, list)) or len(self.rampup) != 3:
      raise validation.fail("rampup", " must be (start, increment, ramp_samples); "
                            f"got {self.rampup!r}", validation.ArgumentTypeError)
    start, increment, samples = self.rampup
    validation.positive_int("rampup[0]", start)
    validation.positive_int("rampup[1]", increment)
    # Megatron takes 0 too, then divides by it at the first step.
    validation.positive_int("rampup[2]", samples)
    if start > self.batch_size or (self.batch_size - start) % increment:
      raise validation.ArgumentError(
          ("rampup", "batch_size"),
          f"{{0}} must climb from its start {start} to {{1}} {self.batch_size} in "
          f"whole increments of {increment}")
    object.__setattr__(self, "rampup", (int(start), int(increment), int(samples)))

  @property
  def ramped(self) -> bool:
    """Whether the size changes (a ramp-up from below ``batch_size``)."""
    return self.rampup is not None and self.rampup[0] < self.batch_size

  def size_for(self, consumed: int) -> int:
    """The global batch size of a step that starts after ``consumed`` samples."""
    if not self.ramped or consumed > self.rampup[2]:
      return self.batch_size
    start, increment, samples = self.rampup
    increments = (self.batch_size - start) // increment
    return start + int(consumed / (samples / increments)) * increment

  @functools.cached_property
  def _phases(self) -> tuple[Phase, ...]:
    phases, step, consumed = [], 0, 0
    size = self.size_for(0)
    while True:
      phases.append(Phase(step, consumed, size))
      if size == self.batch_size:
        return tuple(phases)
      # The steps until a step's start sees a new size: estimated from where the
      # size formula next changes, then checked by the formula itself.
      start, increment, samples = self.rampup
      per_increment = samples / ((self.batch_size - start) // increment)
      change = min(((size - start) // increment + 1) * per_increment, samples + 1)
      steps = max(1, math.ceil((change - consumed) / size) - 1)
      while self.size_for(consumed + steps * size) == size:
        steps += 1
      step, consumed = step + steps, consumed + steps * size
      size = self.size_for(consumed)

  def phases(self) -> tuple[Phase, ...]:
    """The phases of constant size, in order; the last one lasts forever."""
    return self._phases

  def _phase(self, step: int) -> Phase:
    phases = self.phases()
    return next(p for p in reversed(phases) if p.first_step <= step)

  def size_at(self, step: int) -> int:
    """The global batch size of ``step``."""
    validation.integer("step", step, 0)
    return self._phase(step).size

  def consumed_at(self, step: int) -> int:
    """The samples consumed before ``step`` (``consumed_samples``)."""
    validation.integer("step", step, 0)
    phase = self._phase(step)
    return phase.consumed + (step - phase.first_step) * phase.size

  def steps_for(self, samples: int) -> int:
    """The number of steps that consume at least ``samples`` samples (Megatron's
    ``train_samples``: the run ends at the first step whose end reaches it)."""
    validation.integer("samples", samples, 1)
    for phase, following in zip(self.phases(), self.phases()[1:] + (None,)):
      end = None if following is None else following.consumed
      if end is None or samples <= end:
        return phase.first_step + math.ceil((samples - phase.consumed) / phase.size)
    raise AssertionError("unreachable: the last phase lasts forever")

  def consumed_fn(self) -> Callable[[jax.Array], jax.Array]:
    """``consumed_at`` of a (traced) step count, as int32 (a schedule's input)."""
    phases = self.phases()
    first = np.array([p.first_step for p in phases], np.int32)
    consumed = np.array([p.consumed for p in phases], np.int32)
    sizes = np.array([p.size for p in phases], np.int32)

    def fn(count):
      count = jnp.asarray(count, jnp.int32)
      i = jnp.searchsorted(jnp.asarray(first), count, side="right") - 1
      return jnp.asarray(consumed)[i] + (count - jnp.asarray(first)[i]) * jnp.asarray(
          sizes)[i]
    return fn

  def sizes(self) -> tuple[int, ...]:
    """Every global batch size a run may see, in order: each one compiles the step
    once."""
    return tuple(p.size for p in self.phases())
