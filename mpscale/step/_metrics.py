"""What a training loop logs each step, read from the optimizer state (no host sync)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax

from mpscale.scaling import _loss_scale as loss_scale_lib
from mpscale import _tree
from mpscale.optim import _param_groups as param_groups_lib
from mpscale.scaling import _skip as skip_lib
from mpscale.scaling import _spikes as spikes_lib


class StepMetrics(NamedTuple):
  """The names and meanings of the metrics `step_metrics` reads, in the order of the
  dict it returns (`mpscale.make_train_step`'s metrics add ``loss`` and
  ``num_tokens``). Each is a device array of the latest step (the group fields,
  dicts of them by group name)."""
  loss_scale: Any
  """float32 loss scale the step's gradients carried (its loss was multiplied by);
  1 without a loss-scale wrapper. The same value `mpscale.make_train_step`'s
  metrics and the trainer's logs report."""
  next_loss_scale: Any
  """float32 loss scale the next step uses (`mpscale.loss_scale_of` of the state:
  after an overflow, already backed off)."""
  overflow: Any
  """bool: the step's gradients held a NaN or an Inf, and its update was skipped."""
  nan: Any
  """bool: the step's gradients held a NaN."""
  inf: Any
  """bool: the step's gradients held an Inf (or a norm past float32's range)."""
  skipped: Any
  """int32 total number of skipped steps."""
  consecutive_skipped: Any
  """int32 number of skipped steps since the last applied one."""
  global_norm: Any
  """float32 global norm of the step's unscaled gradients, before clipping."""
  group_norms: Any
  """float32 norm of each group of the gradients, by group name: the groups of a
  `global_norm_clip` inside the wrapper when there is one, else the wrapper's."""
  group_sizes: Any
  """Number of elements in each group, by group name."""
  learning_rate: Any = None
  """float32 learning rate of the step, where the inner optimizer records one
  (``None``: left out of `step_metrics`'s dict)."""
  group_learning_rates: Any = None
  """float32 learning rate of each parameter group of the step, by group name, with
  `mpscale.param_groups` (``None``: left out of `step_metrics`'s dict)."""
  spike: Any = None
  """bool: the step was skipped as a loss or gradient-norm spike, with
  `mpscale.skip_spikes` (``None``: left out of `step_metrics`'s dict). An overflowed
  step is never a spike."""
  spikes: Any = None
  """int32 total number of spike steps, with `mpscale.skip_spikes` (``None``: left
  out); ``skipped`` counts them too."""


def step_metrics(opt_state: Any) -> dict[str, Any]:
  """The metrics of the latest step, as device arrays, from anywhere in ``opt_state``.

  Args:
    opt_state: a state containing an mpscale loss-scale or skip wrapper (and possibly a
      `global_norm_clip` and an ``optax.inject_hyperparams`` optimizer); or a Flax
      NNX ``nnx.Optimizer`` or its ``opt_state`` (values come back as plain arrays).

  Returns:
    A dict of the fields of `StepMetrics` by name: ``loss_scale`` (the step's; 1
    without a loss-scale wrapper), ``next_loss_scale``, ``overflow``, ``nan``,
    ``inf``, ``skipped`` (total),
    ``consecutive_skipped``, ``global_norm`` (unscaled, before clipping),
    ``group_norms`` and ``group_sizes`` (dicts by group name), ``learning_rate``
    where the inner optimizer records one, ``group_learning_rates`` (by group
    name) with `mpscale.param_groups`, and ``spike`` and ``spikes`` with
    `mpscale.skip_spikes`.

  Raises:
    ValueError: if ``opt_state`` holds no mpscale wrapper state.
  """
  opt_state = _tree.plain(opt_state)
  skip_states = _tree.find(opt_state, skip_lib.SkipNonfiniteState)
  if not skip_states:
    raise ValueError("opt_state holds no mpscale loss-scale or skip_nonfinite state")
  skip_state = skip_states[0]
  metrics = StepMetrics(
      loss_scale=_step_scale(opt_state),
      next_loss_scale=loss_scale_lib.loss_scale_of(opt_state),
      overflow=skip_state.overflow,
      nan=skip_state.nan,
      inf=skip_state.inf,
      skipped=skip_state.skipped,
      consecutive_skipped=skip_state.consecutive_skipped,
      global_norm=skip_state.global_norm,
      group_norms=skip_state.group_norms,
      group_sizes=skip_state.group_sizes,
      learning_rate=_tree.learning_rate(skip_state.inner_state),
      group_learning_rates=_group_learning_rates(skip_state.inner_state),
      **_spikes(skip_state),
  )._asdict()
  for optional in ("learning_rate", "group_learning_rates", "spike", "spikes"):
    if metrics[optional] is None:
      del metrics[optional]
  return metrics


def _step_scale(opt_state: Any) -> jax.Array:
  """The scale the latest step used: the outermost loss-scale state's (1 without)."""
  states = _tree.find(opt_state, loss_scale_lib.LossScaleState)
  if not states or states[0].step_scale is None:
    return loss_scale_lib.loss_scale_of(opt_state)
  return states[0].step_scale


def _group_learning_rates(inner_state: Any) -> Optional[dict[str, Any]]:
  """The outermost `mpscale.param_groups` state's learning rate per group, if any."""
  states = _tree.find(inner_state, param_groups_lib.ParamGroupsState)
  return dict(states[0].group_learning_rates) if states else None


def _spikes(skip_state: skip_lib.SkipNonfiniteState) -> dict[str, Any]:
  """``spike`` and ``spikes`` of the outermost `mpscale.skip_spikes` inside the
  wrapper, if any."""
  states = _tree.find(skip_state.inner_state, spikes_lib.SkipSpikesState)
  if not states:
    return {}
  # An overflowed step kept the inner state, whose flag is then the step before's.
  return {"spike": states[0].spike & ~skip_state.overflow,
          "spikes": states[0].spikes}
