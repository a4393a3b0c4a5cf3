"""What a training loop logs each step, read from the optimizer state (no host sync)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mpscale import finite
from mpscale import loss_scale as loss_scale_lib


def _learning_rate(opt_state: Any):
  """The learning rate recorded by ``optax.inject_hyperparams`` or by a state with a
  ``learning_rate`` field (e.g. `mpscale.came`), outermost first."""
  def has_lr(x):
    hp = getattr(x, "hyperparams", None)
    if isinstance(hp, dict) and "learning_rate" in hp:
      return True
    return isinstance(x, tuple) and "learning_rate" in getattr(x, "_fields", ())

  for x in jax.tree_util.tree_leaves(opt_state, is_leaf=has_lr):
    if has_lr(x):
      hp = getattr(x, "hyperparams", None)
      if isinstance(hp, dict) and "learning_rate" in hp:
        return jnp.asarray(hp["learning_rate"], jnp.float32)
      return jnp.asarray(x.learning_rate, jnp.float32)
  return None


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
  opt_state = finite.plain_state(opt_state)
  guards = finite.find_states(opt_state, finite.SkipNonfiniteState)
  if not guards:
    raise ValueError("opt_state holds no mpscale loss-scale or skip_nonfinite state")
  guard = guards[0]
  metrics = {
      "loss_scale": loss_scale_lib.loss_scale_of(opt_state),
      "overflow": guard.overflow,
      "nan": guard.nan,
      "inf": guard.inf,
      "skipped": guard.skipped,
      "consecutive_skipped": guard.consecutive_skipped,
      "global_norm": guard.global_norm,
      "group_norms": guard.group_norms,
      "group_sizes": guard.group_sizes,
  }
  lr = _learning_rate(guard.inner_state)
  if lr is not None:
    metrics["learning_rate"] = lr
  return metrics
