"""Megatron-LM's learning-rate and weight-decay schedules, as Optax schedules.

The options are those of Megatron-LM's ``OptimizerParamScheduler`` (and of Accelerate's
``MegatronLMPlugin``: ``lr_warmup_iters``/``lr_warmup_fraction``, ``lr_decay_iters``,
``lr_decay_style``, ``min_lr``, ``start_weight_decay``, ``end_weight_decay``,
``weight_decay_incr_style``). A schedule maps the step count ``n`` (the number of
updates already applied, which is what Optax passes: 0 at the first update) to the
value Megatron uses after ``n`` scheduler steps.

Learning rate, with ``W`` warm-up and ``D`` decay steps (``D`` counts from step 0,
warm-up included)::

  if W > 0 and n <= W:  lr = init_lr + (peak - init_lr) * n / W
  elif style == "constant":  lr = peak
  elif n > D:  lr = min_lr
  elif style == "inverse_sqrt":
    lr = max(min_lr, peak * sqrt(max(W, 1)) / sqrt(max(n, 1)))
  else:
    r = (n - W) / (D - W)
    lr = min_lr + (peak - min_lr) * (1 - r)                      # "linear"
    lr = min_lr + (peak - min_lr) * 0.5 * (1 + cos(pi * r))     # "cosine"

Weight decay, over ``S`` steps::

  if n > S or style == "constant":  wd = end
  else:
    r = n / S
    wd = start + (end - start) * r                               # "linear"
    wd = start + (end - start) * 0.5 * (1 - cos(pi * r))        # "cosine"

References:
  Megatron-LM, ``megatron/core/optimizer_param_scheduler.py``
  (https://github.com/NVIDIA/Megatron-LM).
  Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts",
  ICLR 2017. https://arxiv.org/abs/1608.03983
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from mpscale import validation

LR_STYLES = ("constant", "linear", "cosine", "inverse_sqrt")
WEIGHT_DECAY_STYLES = ("constant", "linear", "cosine")


def lr_schedule(peak: float, *, warmup_steps: int = 0,
                warmup_fraction: Optional[float] = None,
                decay_steps: Optional[int] = None, style: str = "linear",
                min_lr: float = 0.0, init_lr: float = 0.0) -> optax.Schedule:
  """Megatron-LM's learning rate: linear warm-up, then a decay to ``min_lr``.

  The formulas are in the module docstring; they are Megatron's ``get_lr`` with
  ``num_steps`` = the Optax step count. Notably, as in Megatron, after ``decay_steps``
  every style but ``"constant"`` returns ``min_lr`` (``"inverse_sqrt"`` too), and
  ``"inverse_sqrt"`` is ``peak * sqrt(max(W, 1) / max(n, 1))``, floored at ``min_lr``.

  Args:
    peak: the learning rate at the end of warm-up (Megatron's ``lr``/``max_lr``);
      positive.
    warmup_steps: ``W``, linear warm-up steps from ``init_lr`` to ``peak``; >= 0.
    warmup_fraction: instead of ``warmup_steps``: ``W = warmup_fraction *
      decay_steps`` (not rounded, as in Megatron); in [0, 1).
    decay_steps: ``D``, the step at which the decay reaches ``min_lr``, counted from
      0 (warm-up included); ``> W``. Required except for ``style="constant"``
      without ``warmup_fraction``.
    style: ``"constant"``, ``"linear"`` (Megatron's default), ``"cosine"`` or
      ``"inverse_sqrt"``.
    min_lr: the floor after decay; in [0, peak].
    init_lr: the learning rate at step 0 of the warm-up (Megatron's
      ``lr_warmup_init``); in [0, peak].

  Returns:
    An Optax schedule ``count -> learning rate`` for `mpscale.came`, ``optax.adamw``
    and the like.

  Example:
    >>> import optax, mpscale
    >>> schedule = mpscale.lr_schedule(3e-4, warmup_fraction=0.01,
    ...                                decay_steps=100_000, style="cosine",
    ...                                min_lr=3e-5)
    >>> tx = optax.adamw(schedule, weight_decay=0.1)
  """
  peak = validation.positive_float("peak", peak)
  min_lr = validation.float_in("min_lr", min_lr, 0.0, peak)
  init_lr = validation.float_in("init_lr", init_lr, 0.0, peak)
  style = validation.one_of("style", style, LR_STYLES)
  warmup_steps = validation.integer("warmup_steps", warmup_steps, 0)
  if decay_steps is not None:
    decay_steps = validation.positive_int("decay_steps", decay_steps)
  elif style != "constant" or warmup_fraction is not None:
    raise validation.ArgumentError(
        ("decay_steps", "style", "warmup_fraction"),
        "{0} is required with {1}=" + validation.literal(repr(style))
        + (" and {2}" if warmup_fraction is not None else ""))
  warmup: float = warmup_steps
  if warmup_fraction is not None:
    if warmup_steps:
      raise validation.ArgumentError(("warmup_steps", "warmup_fraction"),
                                     "give {0} or {1}, not both")
    fraction = validation.float_in("warmup_fraction", warmup_fraction, 0.0, 1.0,
                                   high_open=True)
    warmup = fraction * decay_steps
  if decay_steps is not None and not warmup < decay_steps:
    raise validation.ArgumentError(
        ("warmup_steps", "decay_steps"),
        f"{{0}} ({warmup_steps}) must be < {{1}} ({decay_steps})")

  if style == "constant":
    decay = optax.constant_schedule(peak)
  elif style == "linear":
    decay = optax.linear_schedule(peak, min_lr, decay_steps - warmup)
  elif style == "cosine":
    decay = optax.cosine_decay_schedule(peak, decay_steps - warmup,
                                        alpha=min_lr / peak)
  else:
    root_warmup = math.sqrt(max(warmup, 1.0))

    def decay(since_warmup):
      n = jnp.asarray(since_warmup, jnp.float32) + warmup
      lr = peak * root_warmup * jax.lax.rsqrt(jnp.maximum(n, 1.0))
      return jnp.where(n > decay_steps, min_lr, jnp.maximum(lr, min_lr))

  if warmup == 0:
    return decay
  return optax.join_schedules(
      [optax.linear_schedule(init_lr, peak, warmup), decay], [warmup])


def weight_decay_schedule(start: float, end: float, steps: int,
                          style: str = "linear") -> optax.Schedule:
  """Megatron-LM's weight-decay schedule: from ``start`` to ``end`` over ``steps``.

  The formulas are in the module docstring (Megatron's ``get_wd``). Megatron only
  increases the weight decay; here ``end < start`` decreases it along the same curve.

  Args:
    start: the weight decay at step 0; in [0, 1].
    end: the weight decay from step ``steps`` on; in [0, 1]. Must equal ``start`` for
      ``style="constant"``.
    steps: the number of steps of the change (Megatron's ``wd_incr_steps``, usually the
      number of training steps); >= 1, or >= 0 for ``"constant"``.
    style: ``"constant"``, ``"linear"`` or ``"cosine"``.

  Returns:
    An Optax schedule ``count -> weight decay`` for `mpscale.came`'s or
    ``optax.adamw``'s ``weight_decay``.

  Example:
    >>> import mpscale
    >>> tx = mpscale.came(1e-4, weight_decay=mpscale.weight_decay_schedule(
    ...     0.01, 0.1, 10_000, style="cosine"))
  """
  start = validation.float_in("start", start, 0.0, 1.0)
  end = validation.float_in("end", end, 0.0, 1.0)
  style = validation.one_of("style", style, WEIGHT_DECAY_STYLES)
  steps = validation.integer("steps", steps, 0 if style == "constant" else 1)
  if style == "constant":
    if start != end:
      raise validation.ArgumentError(
          ("style", "start", "end"),
          f"{{0}}='constant' needs {{1}} == {{2}}; got {start} and {end}")
    return optax.constant_schedule(end)
  if style == "linear":
    return optax.linear_schedule(start, end, steps)
  rise = optax.cosine_decay_schedule(start - end, steps)
  return lambda count: end + rise(count)


SCHEDULE_STATES = ("InjectHyperparamsState", "InjectStatefulHyperparamsState",
                   "WrappedScheduleState", "CameLearningRateState", "ParamGroupsState")
"""The states whose ``count`` a schedule of theirs reads (``optax.inject_hyperparams``
and the state of each schedule it wraps, `mpscale.came`'s learning rate,
`mpscale.param_groups`' reported rates): what `count_samples` makes count
samples."""


def count_samples(inner: optax.GradientTransformation
                 ) -> optax.GradientTransformationExtraArgs:
  """``inner`` with its schedules counting samples, as Megatron-LM's scheduler does.

  Megatron-LM advances its ``OptimizerParamScheduler`` by each *applied* step's own
  global batch size (``step(increment=batch_size)``, only when the update
  succeeded), so during a batch-size ramp-up a skipped step moves neither the
  learning rate nor the weight decay, and later steps move them by their larger
  batches. Here the ``count`` of every state inside ``inner`` that evaluates a
  schedule (`SCHEDULE_STATES`: ``optax.inject_hyperparams``, `mpscale.came`'s
  learning rate, `mpscale.param_groups`) is that sum: each update evaluates its
  schedules at the samples of the steps applied before it, then adds the extra
  argument ``samples`` (the step's global batch size, which `mpscale.make_train_step`
  passes). Inside a skip or
  loss-scale wrapper a skipped step keeps the inner state, so it adds nothing.
  Other counts (Adam's bias correction, CAME's second-moment decay) still count
  updates.

  Give ``inner``'s schedules in samples: `lr_schedule` with ``warmup_steps`` and
  ``decay_steps`` set to the warm-up's and the decay's samples.

  Args:
    inner: the optimizer, built with ``optax.inject_hyperparams`` (or `mpscale.came`)
      around schedules of the samples consumed.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is ``inner``'s; its
    update needs the keyword ``samples`` (an int).

  Raises:
    TypeError: at trace time, when an update is called without ``samples``.

  References:
    Megatron-LM ``megatron/training/training.py`` (its ``train_step`` steps the
    scheduler by the global batch size when ``update_successful``) and
    ``megatron/core/optimizer_param_scheduler.py``.
  """
  inner = optax.with_extra_args_support(validation.transformation("inner", inner))

  def update_fn(updates, state, params=None, *, samples=None, **extra_args):
    if samples is None:
      raise TypeError("count_samples: update(..., samples=N) needs the step's global "
                      "batch size (mpscale.make_train_step passes it)")
    before = _schedule_counts(state)
    updates, new_state = inner.update(updates, state, params, **extra_args)
    step = jnp.asarray(samples, jnp.int32)
    return updates, _with_schedule_counts(new_state, [c + step for c in before])

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def _is_schedule_state(x: Any) -> bool:
  return type(x).__name__ in SCHEDULE_STATES and hasattr(x, "count")


def _map_counts(state: Any, fn: Any) -> Any:
  """``state`` with ``fn`` applied to the ``count`` of each schedule state in it,
  outermost first (their inner states too)."""
  def visit(x):
    if not _is_schedule_state(x):
      return x
    return type(x)(**{f: fn(v) if f == "count" else _map_counts(v, fn)
                      for f, v in x._asdict().items()})
  return jax.tree_util.tree_map(visit, state, is_leaf=_is_schedule_state)


def _schedule_counts(state: Any) -> list:
  counts: list = []
  _map_counts(state, lambda c: counts.append(c) or c)
  return counts


def _with_schedule_counts(state: Any, counts: list) -> Any:
  counts = iter(counts)
  return _map_counts(state, lambda _: next(counts))
