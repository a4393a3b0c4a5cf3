"""What a training loop logs each step, read from the optimizer state (no host sync)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from mpscale import loss_scale as loss_scale_lib
from mpscale import opt_state as opt_state_lib
from mpscale import skip as skip_lib


class StepMetrics(NamedTuple):
  """The names and meanings of the metrics `step_metrics` reads, in the order of the
  dict it returns (`mpscale.make_train_step`'s metrics add ``loss`` and
  ``num_tokens``). Each is a device array of the latest step (the group fields,
  dicts of them by group name)."""
  loss_scale: Any
  """float32 loss scale of the step; 1 without a loss-scale wrapper."""
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
  `clip_by_global_norm` inside the wrapper when there is one, else the wrapper's."""
  group_sizes: Any
  """Number of elements in each group, by group name."""
  learning_rate: Any = None
  """float32 learning rate of the step, where the inner optimizer records one
  (``None``: left out of `step_metrics`'s dict)."""


def _learning_rate(opt_state: Any) -> Optional[jax.Array]:
  """The outermost learning rate in ``opt_state``: an ``optax.inject_hyperparams``
  hyperparameter or a state field named ``learning_rate`` (e.g. `mpscale.came`'s)."""
  found = optax.tree_utils.tree_get_all_with_path(
      opt_state, "learning_rate", lambda _, x: not isinstance(x, tuple))
  if not found:
    return None
  _, lr = min(found, key=lambda path_value: len(path_value[0]))
  return jnp.asarray(lr, jnp.float32)


def step_metrics(opt_state: Any) -> dict[str, Any]:
  """The metrics of the latest step, as device arrays, from anywhere in ``opt_state``.

  Args:
    opt_state: a state containing an mpscale loss-scale or skip wrapper (and possibly a
      `clip_by_global_norm` and an ``optax.inject_hyperparams`` optimizer); or a Flax
      NNX ``nnx.Optimizer`` or its ``opt_state`` (values come back as plain arrays).

  Returns:
    A dict of the fields of `StepMetrics` by name: ``loss_scale`` (1 without a
    loss-scale wrapper), ``overflow``, ``nan``, ``inf``, ``skipped`` (total),
    ``consecutive_skipped``, ``global_norm`` (unscaled, before clipping),
    ``group_norms`` and ``group_sizes`` (dicts by group name), and ``learning_rate``
    where the inner optimizer records one.

  Raises:
    ValueError: if ``opt_state`` holds no mpscale wrapper state.
  """
  opt_state = opt_state_lib.plain(opt_state)
  skip_states = opt_state_lib.find(opt_state, skip_lib.SkipNonfiniteState)
  if not skip_states:
    raise ValueError("opt_state holds no mpscale loss-scale or skip_nonfinite state")
  skip_state = skip_states[0]
  metrics = StepMetrics(
      loss_scale=loss_scale_lib.loss_scale_of(opt_state),
      overflow=skip_state.overflow,
      nan=skip_state.nan,
      inf=skip_state.inf,
      skipped=skip_state.skipped,
      consecutive_skipped=skip_state.consecutive_skipped,
      global_norm=skip_state.global_norm,
      group_norms=skip_state.group_norms,
      group_sizes=skip_state.group_sizes,
      learning_rate=_learning_rate(skip_state.inner_state),
  )._asdict()
  if metrics["learning_rate"] is None:
    del metrics["learning_rate"]
  return metrics
