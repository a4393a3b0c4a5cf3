"""What a training loop logs each step, read from the optimizer state (no host sync)."""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from mpscale import loss_scale as loss_scale_lib
from mpscale import opt_state as opt_state_lib
from mpscale import skip as skip_lib


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
    A dict with ``loss_scale`` (1 without a loss-scale wrapper), ``overflow``, ``nan``,
    ``inf``, ``skipped`` (total), ``consecutive_skipped``, ``global_norm`` (unscaled,
    before clipping), ``group_norms`` and ``group_sizes`` (dicts by group name, with the groups
    of a `clip_by_global_norm` inside the wrapper when there is one, else the
    wrapper's own), and ``learning_rate`` where the
    inner optimizer records one.

  Raises:
    ValueError: if ``opt_state`` holds no mpscale wrapper state.
  """
  opt_state = opt_state_lib.plain(opt_state)
  skip_states = opt_state_lib.find(opt_state, skip_lib.SkipNonfiniteState)
  if not skip_states:
    raise ValueError("opt_state holds no mpscale loss-scale or skip_nonfinite state")
  skip_state = skip_states[0]
  metrics = {
      "loss_scale": loss_scale_lib.loss_scale_of(opt_state),
      "overflow": skip_state.overflow,
      "nan": skip_state.nan,
      "inf": skip_state.inf,
      "skipped": skip_state.skipped,
      "consecutive_skipped": skip_state.consecutive_skipped,
      "global_norm": skip_state.global_norm,
      "group_norms": skip_state.group_norms,
      "group_sizes": skip_state.group_sizes,
  }
  lr = _learning_rate(skip_state.inner_state)
  if lr is not None:
    metrics["learning_rate"] = lr
  return metrics
