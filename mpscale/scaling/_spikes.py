"""Spike skipping: a step whose loss or gradient norm is an outlier changes nothing.

A finite but huge step (a bad batch, the start of an instability) is applied by every
optimizer, and `skip_nonfinite` lets it through: nothing in it is NaN or Inf. Large
runs skip it instead: OLMo-core's ``SkipStepOptimizer`` skips a step whose loss or
gradient norm is more than ``sigma_factor`` (6) standard deviations above the mean of
the last ``rolling_interval_length`` (128) steps, once half of them are in (the current
one counted: 63 earlier values).
`skip_spikes` is that rule as an mpscale wrapper: the global norm is read from the
per-leaf sums of squares the loss-scale wrapper measured (`mpscale.scaling`, no new
pass), the loss arrives as the update's extra argument ``loss``, and the skip is
`skip_nonfinite`'s select (`mpscale.scaling`): updates of ``-0.0`` and the
inner state kept bit for bit.

Per step::

  x = {"loss": loss, "global_norm": sqrt(sum(s))}  # those in `watch`; float32
  for each watched value v, with its window w of accepted values (n of them):
    spike_v = n >= warmup and isfinite(v) and v > mean(w) + threshold * std(w)
  spike = any(spike_v)                                      # only upward outliers
  new_updates, new_inner = inner.update(g, inner_state)     # always computed
  if spike:                                                 # skip: nothing changes
    updates = -0.0; inner_state kept; spikes += 1; consecutive += 1
    if consecutive == reset_after:                          # the level has moved
      empty the windows; consecutive = 0                    # warm up again
  else:
    updates, inner_state = new_updates, new_inner; consecutive = 0
    if every watched value is finite: push it into its window

``std`` is the sample standard deviation (``n - 1``, as ``torch.std_mean``). Choices
against OLMo-core's rule, each for a reason:

* A skipped step's values do not enter the window, so a spike does not inflate the
  statistics that judge the next one: 100x spikes a few steps apart are each caught
  (OLMo-core pushes every value, and a few spikes in the window hide the next).
* ``reset_after`` spikes in a row empty the window. Without this, a lasting upward
  move of the loss (a new data mixture) would be skipped forever, the parameters
  frozen and the level never learned; emptying the window re-learns it after
  ``warmup`` applied steps.
* A NaN or Inf value is no spike and never enters the window: a non-finite step is
  the loss-scale (or `skip_nonfinite`) wrapper's to skip and to count as an overflow.

Put it inside the loss-scale wrapper, outside any clip::

  tx = dynamic_loss_scale(skip_spikes(optax.chain(global_norm_clip(1.0), adamw)))

The wrapper hands down the unscaled gradients' sums of squares (``leaf_squares``) and
the loss, counts a spike step in its ``skipped`` and ``consecutive_skipped`` (so
``skipped`` is every skipped step, and `mpscale.make_train_step` keeps the model state
on it), and does not take it for an overflow: the scale does not back off (the step
was finite at this scale, so it counts toward growth). Around a loss-scale wrapper it
would judge scaled gradients; `mpscale.make_train_step` refuses that nesting.

The code reads the same way (``update_fn``)::

  values = {"loss": loss, "global_norm": sqrt(leaf_squares.total())}  # pmean
  loss_spike = _is_outlier(values["loss"], state.losses, state.filled, ...)
  norm_spike = _is_outlier(values["global_norm"], state.norms, state.filled, ...)
  new_updates, new_inner, _ = producer_select.update_or_skip(
      run_inner, spike, state.inner_state)                # the select, per leaf
  new_updates = producer_select.updates_or_skip(new_updates, spike)   # -0.0
  losses = _pushed(state.losses, values["loss"], state.position, ~spike & finite)
  reset = consecutive >= reset_after     # position, filled, consecutive = 0

References:
  OLMo-core, ``olmo_core.optim.SkipStepOptimizer`` (``rolling_interval_length=128``,
  ``sigma_factor=6``), https://github.com/allenai/OLMo-core; Levanter's
  ``levanter.optim.skipstep`` (the same rule as an optax wrapper, every value pushed).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax
import optax

from mpscale.scaling import _norms as norms_lib
from mpscale.scaling import _producer_select as producer_select
from mpscale import validation

_WATCHABLE = ("loss", "global_norm")  # the step's loss, its gradients' global norm


class SkipSpikesState(NamedTuple):
  """State of `skip_spikes`."""
  inner_state: Any
  """State of the wrapped transformation; untouched by a spike step."""
  losses: jax.Array
  """float32 ``[window]`` ring buffer of the accepted steps' losses (zeros when the
  loss is not watched)."""
  norms: jax.Array
  """float32 ``[window]`` ring buffer of the accepted steps' global gradient norms
  (zeros when the norm is not watched)."""
  position: jax.Array
  """int32 slot the next accepted values go to."""
  filled: jax.Array
  """int32 number of values in each window (at most ``window``); the check is on
  once it reaches ``warmup``."""
  consecutive: jax.Array
  """int32 spike steps since the last applied step (or the last reset)."""
  spike: jax.Array
  """bool: the latest step was skipped as a spike."""
  loss_spike: jax.Array
  """bool: the latest step's loss was an outlier."""
  norm_spike: jax.Array
  """bool: the latest step's global gradient norm was an outlier."""
  spikes: jax.Array
  """int32 total number of spike steps."""


def _check_watch(watch: Union[str, Sequence[str]]) -> tuple[str, ...]:
  names = (watch,) if isinstance(watch, str) else watch
  if not isinstance(names, (tuple, list)):
    raise validation.fail(
        "watch", " must be a tuple of 'loss' and/or 'global_norm'; got "
        f"{type(watch).__name__}", validation.ArgumentTypeError)
  if not names:
    raise validation.fail("watch", " must name 'loss', 'global_norm' or both")
  names = tuple(validation.one_of(f"watch[{i}]", n, _WATCHABLE)
                for i, n in enumerate(names))
  if len(set(names)) != len(names):
    raise validation.fail("watch", f" names a value twice: {names!r}")
  return names


def _is_outlier(value: jax.Array, window: jax.Array, filled: jax.Array,
                threshold: float, warmup: int) -> jax.Array:
  """Whether ``value`` > mean + threshold * std of the first ``filled`` entries of
  ``window`` (sample std), once ``filled >= warmup``; never for a non-finite value."""
  held = jnp.arange(window.shape[0]) < filled
  n = jnp.maximum(filled, 2).astype(jnp.float32)  # filled >= warmup >= 2 when it counts
  mean = jnp.sum(jnp.where(held, window, 0.0)) / n
  var = jnp.sum(jnp.where(held, jnp.square(window - mean), 0.0)) / (n - 1.0)
  return ((filled >= warmup) & jnp.isfinite(value)
          & (value > mean + threshold * jnp.sqrt(var)))


def _mean_across(x: jax.Array, axis_name: Optional[Any]) -> jax.Array:
  return x if axis_name is None else lax.pmean(x, axis_name)


def _scalar_loss(loss: Any) -> jax.Array:
  if jnp.size(loss) != 1:
    raise validation.fail("loss", " must be a scalar (the step's unscaled loss); got "
                          f"shape {jnp.shape(loss)}", validation.ArgumentTypeError)
  return jnp.reshape(jnp.asarray(loss), ()).astype(jnp.float32)


def skip_spikes(inner: optax.GradientTransformation, *, window: int = 128,
                threshold: float = 6.0, warmup: Optional[int] = None,
                watch: Union[str, Sequence[str]] = _WATCHABLE, reset_after: int = 16,
                axis_name: Optional[str] = None
               ) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that a step whose loss or gradient norm spikes changes nothing.

  A value is a spike when it exceeds the mean of the last ``window`` accepted values
  by more than ``threshold`` standard deviations (a z-score), once ``warmup`` values
  are in (see the module docstring for the rule and how it differs from OLMo-core's).
  On a spike step the returned updates are ``-0.0`` everywhere (``optax.apply_updates``
  leaves every parameter bit-identical) and the inner state is kept as it was; the
  step is counted in ``spikes``. Wrapped in a loss-scale wrapper (or
  `skip_nonfinite`), it is counted in that wrapper's ``skipped`` too, not as an
  overflow.

  ``update(grads, state, params, *, loss=..., leaf_squares=...)`` takes the step's
  unscaled loss as the extra argument ``loss`` (`mpscale.make_train_step` passes it)
  and, inside an mpscale wrapper, that wrapper's ``leaf_squares``, from which the
  global norm is read with no new pass over the gradients. Both, and any other extra
  argument, are passed on to ``inner``.

  Args:
    inner: the transformation to wrap, e.g. ``optax.chain(global_norm_clip(1.0),
      optax.adamw(1e-3))``.
    window: how many accepted steps the statistics cover; >= 2.
    threshold: how many standard deviations above the mean make a spike; > 0.
    warmup: accepted earlier values the check needs before it judges a step; in
      ``[2, window]``. Default ``max(2, window // 2 - 1)``: OLMo-core's rule, which
      judges once ``max(2, window // 2)`` values are in counting the current one
      (63 earlier values for its window of 128), never with fewer than 2 (OLMo-core's
      standard deviation of one value is NaN).
    watch: ``"loss"``, ``"global_norm"`` or both (the default); a spike
      in either skips the step. Watching the loss needs ``loss=`` in every update.
    reset_after: this many spike steps in a row empty the windows, so that a lasting
      move of the loss or norm is learned (after ``warmup`` applied steps) instead
      of skipping every step from then on; >= 1.
    axis_name: when the update runs per replica (inside ``shard_map``/``pmap``), the
      mapped axis over which the loss and the norm are averaged: every replica then
      holds the same windows and takes the same decision.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state `SkipSpikesState`.

  Raises:
    ArgumentError: for a bad argument, naming it. At trace time, a ``TypeError``
      naming ``loss`` when the loss is watched and ``update`` is called without it.

  References:
    OLMo-core ``SkipStepOptimizer``, https://github.com/allenai/OLMo-core
    (``olmo_core/optim/skip_step_optimizer.py``); Levanter ``levanter.optim.skipstep``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, mpscale
    >>> tx = mpscale.dynamic_loss_scale(mpscale.skip_spikes(optax.sgd(0.1), window=8))
    >>> params = {"w": jnp.ones(3)}
    >>> opt_state = tx.init(params)
    >>> for g in [1.0, 1.1, 0.9, 1.0, 1.2, 0.8, 1.0, 100.0]:  # the last one spikes
    ...   grads = {"w": g * mpscale.loss_scale_of(opt_state) * jnp.ones(3)}
    ...   updates, opt_state = tx.update(grads, opt_state, params, loss=jnp.float32(g))
    ...   params = optax.apply_updates(params, updates)
    >>> metrics = mpscale.step_metrics(opt_state)
    >>> bool(metrics["spike"]), int(metrics["skipped"]), bool(metrics["overflow"])
    (True, 1, False)
  """
  inner = validation.transformation("inner", inner)
  window = validation.integer("window", window, 2)
  threshold = validation.positive_float("threshold", threshold)
  if warmup is None:  # OLMo-core: len(values with the current) >= max(2, window // 2)
    warmup = max(2, window // 2 - 1)
  warmup = validation.integer("warmup", warmup, 2)
  if warmup > window:
    raise validation.ArgumentError(
        ("warmup", "window"), f"{{0}} ({warmup}) must be <= {{1}} ({window})")
  watched = _check_watch(watch)
  reset_after = validation.positive_int("reset_after", reset_after)
  axis_name = validation.axis_name("axis_name", axis_name)

  def init_fn(params):
    # A fresh array per field: one buffer shared by two fields cannot be donated.
    zero_i = lambda: jnp.zeros((), jnp.int32)
    false = lambda: jnp.zeros((), jnp.bool_)
    return SkipSpikesState(
        inner_state=inner.init(params),
        losses=jnp.zeros((window,), jnp.float32),
        norms=jnp.zeros((window,), jnp.float32),
        position=zero_i(), filled=zero_i(), consecutive=zero_i(),
        spike=false(), loss_spike=false(), norm_spike=false(), spikes=zero_i())

  def update_fn(updates, state, params=None, *, leaf_squares=None, **extra_args):
    updates = jax.tree_util.tree_map(jnp.asarray, updates)
    false = jnp.zeros((), jnp.bool_)
    values, outliers = {}, {}
    if "loss" in watched:
      if extra_args.get("loss") is None:
        raise validation.fail(
            "loss", " is missing: skip_spikes watches the loss (watch includes 'loss'), "
            "so its update needs the step's unscaled loss as the extra argument "
            "loss= (mpscale.make_train_step passes it); or watch only "
            "watch=('global_norm',)", validation.ArgumentTypeError)
      values["loss"] = _mean_across(_scalar_loss(extra_args["loss"]), axis_name)
      outliers["loss"] = _is_outlier(values["loss"], state.losses, state.filled,
                                     threshold, warmup)
    if "global_norm" in watched:
      leaf_squares = norms_lib.reuse_or_measure(updates, leaf_squares)
      values["global_norm"] = _mean_across(
          jnp.sqrt(leaf_squares.total()), axis_name)
      outliers["global_norm"] = _is_outlier(values["global_norm"], state.norms,
                                            state.filled, threshold, warmup)
    loss_spike = outliers.get("loss", false)
    norm_spike = outliers.get("global_norm", false)
    spike = loss_spike | norm_spike

    inner_extra = dict(extra_args)
    if leaf_squares is not None:
      inner_extra["leaf_squares"] = leaf_squares
    run_inner = lambda: inner.update(updates, state.inner_state, params, **inner_extra)
    new_updates, new_inner, _ = producer_select.update_or_skip(
        run_inner, spike, state.inner_state)
    new_updates = producer_select.updates_or_skip(new_updates, spike)

    # An applied step with finite values joins the windows; a spike step does not.
    finite = jnp.all(jnp.stack([jnp.isfinite(v) for v in values.values()]))
    push = ~spike & finite
    losses = _pushed(state.losses, values.get("loss"), state.position, push)
    norms = _pushed(state.norms, values.get("global_norm"), state.position, push)
    position = jnp.where(push, (state.position + 1) % window, state.position)
    filled = jnp.where(push, jnp.minimum(state.filled + 1, window), state.filled)
    consecutive = jnp.where(spike, state.consecutive + 1, 0)
    # reset_after spikes in a row: the level has moved; warm up on the new one.
    reset = consecutive >= reset_after
    position = jnp.where(reset, 0, position).astype(jnp.int32)
    filled = jnp.where(reset, 0, filled).astype(jnp.int32)
    consecutive = jnp.where(reset, 0, consecutive).astype(jnp.int32)

    return new_updates, SkipSpikesState(
        inner_state=new_inner, losses=losses, norms=norms, position=position,
        filled=filled, consecutive=consecutive, spike=spike, loss_spike=loss_spike,
        norm_spike=norm_spike, spikes=state.spikes + spike.astype(jnp.int32))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _pushed(buffer: jax.Array, value: Optional[jax.Array], position: jax.Array,
            push: jax.Array) -> jax.Array:
  """``buffer`` with ``value`` at ``position`` where ``push`` (unchanged without a
  value: that quantity is not watched)."""
  if value is None:
    return buffer
  return jnp.where(push, buffer.at[position].set(value), buffer)
