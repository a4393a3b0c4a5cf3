"""Loss scaling as Optax wrappers: dynamic, fixed, and none.

The scale lives in the optimizer state. Inside the train step the loss is multiplied by
`loss_scale_of(opt_state)` before differentiation; the wrapper's ``update`` receives the
gradients of ``scale * loss``, unscales them in float32, checks them in one pass (see
`mpscale.scaling`), runs or skips the inner transformation, and adjusts the scale.

Dynamic loss scaling, per step::

  g = grads / scale                              # float32
  if all_finite(g):
    apply inner(g); growth_count += 1
    if consecutive_hysteresis: hysteresis_left = hysteresis
    if growth_count >= growth_interval:
      scale = min(scale * growth_factor, max_scale)
      growth_count = 0; hysteresis_left = hysteresis
  else:
    skip (params and inner state unchanged); growth_count = 0
    hysteresis_left -= 1
    if hysteresis_left <= 0:
      scale = max(scale * backoff_factor, min_scale)
      if refill_after_backoff: hysteresis_left = hysteresis

With ``hysteresis=1`` this is exactly PyTorch's ``GradScaler`` (bounded by min/max).
The hysteresis modes, on three overflows in a row from 1024 with ``hysteresis=2``::

  Megatron-LM (default)     refill on growth only                 1024, 512, 256
  DeepSpeed                 ``consecutive_hysteresis``: refill on  1024, 512, 256
                            every finite step too
  TensorFlow / Ascend NPU   ``refill_after_backoff``: the bad-step 1024, 512, 512
                            count restarts after each cut

TensorFlow's ``ExponentialUpdateLossScaleManager(init_loss_scale,
incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio, decr_ratio)`` (the NPU seed's)
is ``dynamic_loss_scale(init_scale=init_loss_scale,
growth_interval=incr_every_n_steps, hysteresis=decr_every_n_nan_or_inf,
growth_factor=incr_ratio, backoff_factor=decr_ratio, refill_after_backoff=True,
min_scale=1)``, up to its ceiling: TF keeps the scale when growing it would overflow
float32, mpscale stops at ``max_scale``.

The code reads the same way (``_loss_scaling``'s ``update_fn``; fixed and no scaling
are the same function with ``dynamic=False``)::

  scaled = norms.measure(raw)                    # sums of squares of scale * g
  leaf_squares = scaled.vector * inv_scale ** 2  # those of g, handed down the chain
  updates, skip_state = skip.apply_or_skip(inner, unscaled, ...)  # all_finite, skip
  if dynamic:
    scale, growth_count, hysteresis_left = next_scale(state, skip_state.overflow)
    # next_scale: grown_count = count + 1; grow = grown_count >= growth_interval;
    # ok_* when finite, bad_* (backed off once bad_hyst <= 0, then refilled with
    # refill_after_backoff) on an overflow

The check reads the scaled gradients' float32 sums of squares times ``1 / scale**2``:
a gradient whose *scaled* squared norm leaves float32's range counts as an overflow
(the scale then backs off, as for an Inf).

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018.
  https://arxiv.org/abs/1710.03740
  Megatron-LM ``DynamicGradScaler`` (hysteresis); DeepSpeed ``DynamicLossScaler``
  (consecutive hysteresis).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from mpscale.scaling import _norms as norms_lib
from mpscale import _tree
from mpscale.scaling import _skip as skip_lib
from mpscale import _deprecated
from mpscale import validation


class LossScaleState(NamedTuple):
  """State of the loss-scale wrappers (dynamic, fixed and none share it)."""
  loss_scale: jax.Array
  """float32 scale to multiply the loss by at the next step."""
  growth_count: jax.Array
  """int32 consecutive finite steps since the last growth or overflow (dynamic only)."""
  hysteresis_left: jax.Array
  """int32 overflows still tolerated before the next back-off (dynamic only)."""
  skip_state: skip_lib.SkipNonfiniteState
  """The finite-check-and-skip state (`mpscale.skip_nonfinite`'s), which holds the
  inner state and the step's statistics."""
  step_scale: Any = None
  """float32 scale the latest step's gradients carried: what `mpscale.step_metrics`
  reports as ``loss_scale`` (``loss_scale`` above is the next step's, its
  ``next_loss_scale``); the initial scale before any step."""


def _loss_scaling(inner, *, init_scale: float, skip_nonfinite: bool, dynamic: bool,
             growth_factor: float = 2.0, backoff_factor: float = 0.5,
             growth_interval: int = 1, hysteresis: int = 1,
             consecutive_hysteresis: bool = False, refill_after_backoff: bool = False,
             min_scale: float = 1.0, max_scale: float = 2.0**24,
             groups: norms_lib.NormGroups = None,
             axis_name: Optional[str] = None) -> optax.GradientTransformationExtraArgs:
  inner = validation.transformation("inner", inner)
  groups = validation.norm_groups("norm_groups", groups)
  axis_name = validation.axis_name("axis_name", axis_name)

  def init_fn(params):
    return LossScaleState(
        loss_scale=jnp.asarray(init_scale, jnp.float32),
        growth_count=jnp.zeros((), jnp.int32),
        hysteresis_left=jnp.asarray(hysteresis, jnp.int32),
        skip_state=skip_lib.init_state(inner, params, groups),
        step_scale=jnp.asarray(init_scale, jnp.float32))

  def next_scale(state: LossScaleState, overflow: jax.Array):
    scale, count, hyst = state.loss_scale, state.growth_count, state.hysteresis_left
    # Finite step.
    grown_count = count + 1
    grow = grown_count >= growth_interval
    ok_scale = jnp.where(grow, jnp.minimum(scale * growth_factor, max_scale), scale)
    ok_count = jnp.where(grow, 0, grown_count)
    refill = grow | consecutive_hysteresis
    ok_hyst = jnp.where(refill, hysteresis, hyst)
    # Overflowed step. Clamped at 0 so a long overflow burst cannot wrap the counter.
    bad_hyst = jnp.maximum(hyst - 1, 0)
    backoff = bad_hyst <= 0
    bad_scale = jnp.where(backoff, jnp.maximum(scale * backoff_factor, min_scale),
                          scale)
    if refill_after_backoff:
      bad_hyst = jnp.where(backoff, hysteresis, bad_hyst)
    return (jnp.where(overflow, bad_scale, ok_scale).astype(jnp.float32),
            jnp.where(overflow, 0, ok_count).astype(jnp.int32),
            jnp.where(overflow, bad_hyst, ok_hyst).astype(jnp.int32))

  def update_fn(grads, state, params=None, *, leaf_squares=None, **extra_args):
    del leaf_squares  # an outer wrapper's; these gradients are measured scaled below
    inv_scale = 1.0 / state.loss_scale
    raw = jax.tree_util.tree_map(lambda g: jnp.asarray(g).astype(jnp.float32), grads)
    # The reduction reads the gradient buffers themselves: summing (g * inv)**2 would
    # make XLA write the unscaled tree out first, two extra passes. Exact for
    # power-of-two scales; a scaled sum past float32's range counts as an overflow.
    scaled = norms_lib.measure(raw, norms_lib.splits_for(raw, groups))
    unscaled = jax.tree_util.tree_map(lambda g: g * inv_scale, raw)
    leaf_squares = scaled.scaled(jax.tree_util.tree_leaves(unscaled), inv_scale)
    updates, skip_state = skip_lib.apply_or_skip(
        inner, unscaled, state.skip_state, params, skip_nonfinite=skip_nonfinite,
        groups=groups, axis_name=axis_name, extra_args=extra_args,
        leaf_squares=leaf_squares)
    if dynamic:
      scale, count, hyst = next_scale(state, skip_state.overflow)
    else:
      scale, count, hyst = state.loss_scale, state.growth_count, state.hysteresis_left
    return updates, LossScaleState(scale, count, hyst, skip_state, state.loss_scale)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@_deprecated.renamed_keyword("groups", "norm_groups")
def dynamic_loss_scale(inner: optax.GradientTransformation, *,
                       init_scale: float = 2.0**15, growth_factor: float = 2.0,
                       backoff_factor: float = 0.5, growth_interval: int = 2000,
                       hysteresis: int = 1, consecutive_hysteresis: bool = False,
                       refill_after_backoff: bool = False,
                       min_scale: float = 1.0, max_scale: float = 2.0**24,
                       norm_groups: norms_lib.NormGroups = None,
                       axis_name: Optional[str] = None
                      ) -> optax.GradientTransformationExtraArgs:
  """Dynamic loss scaling around ``inner``, with overflow skipping and hysteresis.

  ``update(grads, state, params)`` takes the gradients of ``loss_scale_of(state) *
  loss``, unscales them in float32, checks them in a single pass, and either applies
  ``inner`` or skips the step (updates of ``-0.0``, inner state unchanged). See the
  module docstring for the rules.

  Args:
    inner: the optimizer to wrap, e.g. ``optax.adamw(1e-3)`` or an ``optax.chain``
      starting with `mpscale.global_norm_clip`.
    init_scale: the first scale; within ``[min_scale, max_scale]``.
    growth_factor: multiplier on growth; > 1.
    backoff_factor: multiplier on back-off; in (0, 1).
    growth_interval: the scale grows on this many consecutive finite steps; >= 1.
    hysteresis: overflows tolerated before a back-off (Megatron-LM); >= 1.
    consecutive_hysteresis: refill the hysteresis on every finite step (DeepSpeed)
      rather than only on growth.
    refill_after_backoff: refill the hysteresis after each back-off, so every
      ``hysteresis``-th overflow cuts the scale (TensorFlow's and Ascend's
      ``decr_every_n_nan_or_inf``; see the module docstring) rather than every
      overflow once it is spent (Megatron-LM).
    min_scale: floor of the scale; > 0.
    max_scale: ceiling of the scale; finite and >= ``min_scale``.
    norm_groups: how leaves map to the recorded group norms (see
      `mpscale.scaling.NormGroups`); default one group per top-level key.
    axis_name: when the update runs per replica (inside ``shard_map``/``pmap``), the
      axis over which the overflow decision is agreed.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state `LossScaleState`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, mpscale
    >>> params = {"w": jnp.ones(3)}
    >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
    >>> tx = mpscale.dynamic_loss_scale(optax.adamw(1e-3), growth_interval=1000)
    >>> opt_state = tx.init(params)
    >>> scale = mpscale.loss_scale_of(opt_state)
    >>> float(scale)
    32768.0
    >>> grads = jax.grad(lambda p: scale * loss_fn(p))(params)
    >>> updates, opt_state = tx.update(grads, opt_state, params)
  """
  min_scale = validation.positive_float("min_scale", min_scale)
  max_scale = validation.positive_float("max_scale", max_scale)
  if min_scale > max_scale:
    raise validation.ArgumentError(
        ("min_scale", "max_scale"),
        f"{{0}} ({min_scale:g}) must be <= {{1}} ({max_scale:g})")
  init_scale = validation.float_in("init_scale", init_scale, min_scale, max_scale)
  growth_factor = validation.float_in("growth_factor", growth_factor, 1.0,
                                      low_open=True)
  backoff_factor = validation.float_in("backoff_factor", backoff_factor, 0.0, 1.0,
                                       low_open=True, high_open=True)
  validation.positive_int("growth_interval", growth_interval)
  validation.positive_int("hysteresis", hysteresis)
  validation.boolean("consecutive_hysteresis", consecutive_hysteresis)
  validation.boolean("refill_after_backoff", refill_after_backoff)
  return _loss_scaling(
      inner, init_scale=init_scale, skip_nonfinite=True, dynamic=True,
      growth_factor=growth_factor, backoff_factor=backoff_factor,
      growth_interval=growth_interval, hysteresis=hysteresis,
      consecutive_hysteresis=consecutive_hysteresis,
      refill_after_backoff=refill_after_backoff, min_scale=min_scale,
      max_scale=max_scale, groups=norm_groups, axis_name=axis_name)


@_deprecated.renamed_keyword("groups", "norm_groups")
def fixed_loss_scale(inner: optax.GradientTransformation, scale: float, *,
                     skip_nonfinite: bool = True,
                     norm_groups: norms_lib.NormGroups = None,
                     axis_name: Optional[str] = None
                    ) -> optax.GradientTransformationExtraArgs:
  """A constant loss scale around ``inner``.

  The scale is data in the state (change it with `with_loss_scale` without
  recompiling).

  Args:
    inner: the optimizer to wrap.
    scale: the loss scale; positive and finite: a float, or an array of shape ``()``
      or ``(1,)`` (as MindSpore's ``scale_sense``), which may be traced.
    skip_nonfinite: skip non-finite steps (default). With ``False`` an overflowed
      step is still applied, as MindSpore's ``FixedLossScaleManager(...,
      skip_nonfinite=False)``; it is reported in ``overflow`` but not counted as
      skipped.
    norm_groups: how leaves map to the recorded group norms.
    axis_name: replica axis over which the overflow decision is agreed.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state `LossScaleState`.
  """
  scale = validation.positive_scalar("scale", scale)
  validation.boolean("skip_nonfinite", skip_nonfinite)
  return _loss_scaling(inner, init_scale=scale, skip_nonfinite=skip_nonfinite,
                       dynamic=False, groups=norm_groups, axis_name=axis_name)


@_deprecated.renamed_keyword("groups", "norm_groups")
def no_loss_scale(inner: optax.GradientTransformation, *,
                  norm_groups: norms_lib.NormGroups = None,
                  axis_name: Optional[str] = None
                 ) -> optax.GradientTransformationExtraArgs:
  """Scale 1 (for bfloat16/float32 training) with the same metrics and skipping.

  Args:
    inner: the optimizer to wrap.
    norm_groups: how leaves map to the recorded group norms.
    axis_name: replica axis over which the overflow decision is agreed.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state `LossScaleState`.
  """
  return fixed_loss_scale(inner, 1.0, norm_groups=norm_groups, axis_name=axis_name)


def policy_loss_scale(policy: Any, inner: optax.GradientTransformation, **kwargs: Any
                  ) -> optax.GradientTransformationExtraArgs:
  """``inner`` in the loss-scale wrapper a precision policy calls for.

  Args:
    policy: a `mpscale.Policy` (or anything with a ``needs_loss_scaling`` bool).
    inner: the optimizer, e.g. ``optax.adamw(1e-3)``.
    **kwargs: passed to `dynamic_loss_scale` (e.g. ``growth_interval``) when the
      policy needs loss scaling, else to `no_loss_scale` (e.g. ``norm_groups``).

  Returns:
    `dynamic_loss_scale` ``(inner)`` when ``policy.needs_loss_scaling`` (a float16
    dtype), else `no_loss_scale` ``(inner)``.
  """
  if policy.needs_loss_scaling:
    return dynamic_loss_scale(inner, **kwargs)
  return no_loss_scale(inner, **kwargs)


def _is_scale_state(x: Any) -> bool:
  return isinstance(x, LossScaleState)


def loss_scale_of(opt_state: Any) -> jax.Array:
  """The current loss scale in ``opt_state`` (anywhere inside a chain), else 1.

  Args:
    opt_state: an optimizer state that may contain a `LossScaleState`; or a Flax NNX
      ``nnx.Optimizer`` or its ``opt_state``.

  Returns:
    A float32 scalar (a plain array) to multiply the loss by before differentiation.
  """
  states = _tree.find(_tree.plain(opt_state), LossScaleState)
  if not states:
    return jnp.ones((), jnp.float32)
  return states[0].loss_scale


def scale_loss(loss: Any, opt_state: Any) -> Any:
  """``loss`` multiplied by the current loss scale of ``opt_state``: what to
  differentiate (jmp's ``loss_scale.scale``, PyTorch's ``GradScaler.scale``).

  The wrapper in ``opt_state`` divides the gradients by the same scale before its inner
  optimizer, so nothing else changes in a train step.

  Args:
    loss: a scalar loss, or any pytree of arrays (each leaf is scaled).
    opt_state: a state holding an mpscale loss-scale wrapper (else the scale is 1),
      or a Flax NNX ``nnx.Optimizer`` or its state.

  Returns:
    ``loss * scale``, leaf by leaf, in at least float32.

  Example:
    >>> import jax, jax.numpy as jnp, optax, mpscale
    >>> params = {"w": jnp.ones(3)}
    >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
    >>> tx = mpscale.dynamic_loss_scale(optax.sgd(0.1))
    >>> opt_state = tx.init(params)
    >>> grads = jax.grad(lambda p: mpscale.scale_loss(loss_fn(p), opt_state))(params)
    >>> updates, opt_state = tx.update(grads, opt_state, params)
  """
  scale = loss_scale_of(opt_state)
  return jax.tree_util.tree_map(lambda x: jnp.asarray(x) * scale, loss)


def with_loss_scale(opt_state: Any, scale: Any) -> Any:
  """``opt_state`` with the outermost loss scale replaced by ``scale`` (no recompile).

  Args:
    opt_state: an optimizer state holding a `LossScaleState`. A Flax NNX
      ``nnx.Optimizer`` is changed in place (NNX state is mutable) and returned; an
      NNX ``opt_state`` comes back with its loss-scale ``Variable`` holding ``scale``.
    scale: the new loss scale.

  Raises:
    ValueError: if ``opt_state`` holds no `LossScaleState`.
  """
  nnx = _tree.nnx_module()
  if nnx is not None and isinstance(opt_state, nnx.Optimizer):
    opt_state.opt_state = with_loss_scale(opt_state.opt_state, scale)
    return opt_state
  done = []

  def replace(x):
    if isinstance(x, LossScaleState) and not done:
      done.append(True)
      value = jnp.asarray(scale, jnp.float32)
      old = x.loss_scale
      if nnx is not None and isinstance(old, nnx.Variable):
        value = old.replace(value)
      return x._replace(loss_scale=value)
    return x

  new = jax.tree_util.tree_map(replace, opt_state, is_leaf=_is_scale_state)
  if not done:
    raise ValueError("opt_state holds no loss-scale state")
  return new
