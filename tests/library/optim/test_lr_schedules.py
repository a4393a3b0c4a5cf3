"""Tests for mpscale.optim: Megatron-LM's formulas, validation, use in optimizers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpscale

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


def megatron_lr(n, *, peak, warmup, decay_steps, style, min_lr=0.0, init_lr=0.0):
  """Megatron-LM's OptimizerParamScheduler.get_lr, with num_steps = n."""
  if warmup > 0 and n <= warmup:
    return init_lr + (peak - init_lr) * n / warmup
  if style == "constant":
    return peak
  if n > decay_steps:
    return min_lr
  if style == "inverse_sqrt":
    return max(min_lr, peak * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
  ratio = (n - warmup) / (decay_steps - warmup)
  coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
  return min_lr + coeff * (peak - min_lr)


def megatron_wd(n, *, start, end, steps, style):
  """Megatron-LM's OptimizerParamScheduler.get_wd."""
  if n > steps or style == "constant":
    return end
  ratio = n / steps
  coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
  return start + coeff * (end - start)


STEPS = np.arange(0, 130)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse_sqrt"])
@pytest.mark.parametrize("warmup,min_lr,init_lr", [(0, 0.0, 0.0), (10, 1e-4, 0.0),
                                                    (7, 0.0, 2e-4), (1, 3e-4, 0.0)])
def test_lr_schedule_matches_megatron(style, warmup, min_lr, init_lr):
  peak, decay_steps = 1e-3, 100
  schedule = mpscale.lr_schedule(peak, warmup_steps=warmup, decay_steps=decay_steps,
                                 style=style, min_lr=min_lr, init_lr=init_lr)
  want = [megatron_lr(int(n), peak=peak, warmup=warmup, decay_steps=decay_steps,
                      style=style, min_lr=min_lr, init_lr=init_lr) for n in STEPS]
  eager = np.asarray([schedule(int(n)) for n in STEPS])
  jitted = np.asarray(jax.jit(jax.vmap(schedule))(jnp.asarray(STEPS, jnp.int32)))
  # float32 arithmetic: errors of a few ulps of the peak (XLA may divide by a
  # reciprocal multiply).
  np.testing.assert_allclose(eager, want, rtol=1e-6, atol=1e-6 * peak)
  np.testing.assert_allclose(jitted, want, rtol=1e-6, atol=1e-6 * peak)


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse_sqrt"])
def test_warmup_fraction_is_a_fraction_of_decay_steps(style):
  schedule = mpscale.lr_schedule(1.0, warmup_fraction=0.025, decay_steps=100,
                                 style=style, min_lr=0.1)
  # 2.5 warm-up steps, not rounded (as in Megatron).
  want = [megatron_lr(int(n), peak=1.0, warmup=2.5, decay_steps=100, style=style,
                      min_lr=0.1) for n in STEPS]
  np.testing.assert_allclose([schedule(int(n)) for n in STEPS], want, rtol=1e-6)


def test_lr_schedule_landmarks():
  s = mpscale.lr_schedule(1.0, warmup_steps=4, decay_steps=12, style="linear",
                          min_lr=0.2)
  np.testing.assert_allclose([s(0), s(2), s(4), s(8), s(12), s(100)],
                             [0.0, 0.5, 1.0, 0.6, 0.2, 0.2], rtol=1e-6)
  inv = mpscale.lr_schedule(1.0, warmup_steps=4, decay_steps=100, style="inverse_sqrt")
  np.testing.assert_allclose([inv(4), inv(16), inv(64), inv(101)], [1.0, 0.5, 0.25, 0.0])
  const = mpscale.lr_schedule(2.0, warmup_steps=2, style="constant")
  np.testing.assert_allclose([const(0), const(1), const(2), const(10**6)],
                             [0.0, 1.0, 2.0, 2.0])


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_weight_decay_schedule_matches_megatron(style):
  start, end = (0.1, 0.1) if style == "constant" else (0.01, 0.1)
  schedule = mpscale.weight_decay_schedule(start, end, 100, style=style)
  want = [megatron_wd(int(n), start=start, end=end, steps=100, style=style)
          for n in STEPS]
  np.testing.assert_allclose([schedule(int(n)) for n in STEPS], want, rtol=1e-6)
  np.testing.assert_allclose(
      jax.jit(jax.vmap(schedule))(jnp.asarray(STEPS, jnp.int32)), want, rtol=1e-6)


def test_weight_decay_schedule_may_decrease():
  s = mpscale.weight_decay_schedule(0.2, 0.0, 10, style="cosine")
  np.testing.assert_allclose([s(0), s(5), s(10), s(20)], [0.2, 0.1, 0.0, 0.0], atol=1e-7)


@pytest.mark.parametrize("kwargs,error,name", [
    (dict(peak=0.0, decay_steps=10), ValueError, "peak"),
    (dict(peak="1", decay_steps=10), TypeError, "peak"),
    (dict(peak=1.0), ValueError, "decay_steps"),
    (dict(peak=1.0, decay_steps=0), ValueError, "decay_steps"),
    (dict(peak=1.0, decay_steps=10.0), TypeError, "decay_steps"),
    (dict(peak=1.0, decay_steps=10, style="exp"), ValueError, "style"),
    (dict(peak=1.0, decay_steps=10, min_lr=2.0), ValueError, "min_lr"),
    (dict(peak=1.0, decay_steps=10, min_lr=-1.0), ValueError, "min_lr"),
    (dict(peak=1.0, decay_steps=10, init_lr=2.0), ValueError, "init_lr"),
    (dict(peak=1.0, decay_steps=10, warmup_steps=-1), ValueError, "warmup_steps"),
    (dict(peak=1.0, decay_steps=10, warmup_steps=10), ValueError, "warmup_steps .10. must be < decay_steps"),
    (dict(peak=1.0, decay_steps=10, warmup_steps=2, warmup_fraction=0.1), ValueError,
     "warmup_fraction"),
    (dict(peak=1.0, decay_steps=10, warmup_fraction=1.0), ValueError,
     "warmup_fraction"),
    (dict(peak=1.0, style="constant", warmup_fraction=0.1), ValueError, "decay_steps"),
])
def test_lr_schedule_validation(kwargs, error, name):
  peak = kwargs.pop("peak")
  with pytest.raises(error, match=name):
    mpscale.lr_schedule(peak, **kwargs)


@pytest.mark.parametrize("args,kwargs,error,name", [
    ((0.1, 0.2, 10), dict(style="constant"), ValueError, "start == end"),
    ((-0.1, 0.2, 10), {}, ValueError, "start"),
    ((0.1, 1.5, 10), {}, ValueError, "end"),
    ((0.1, 0.2, 0), {}, ValueError, "steps"),
    ((0.1, 0.2, 10.0), {}, TypeError, "steps"),
    ((0.1, 0.2, 10), dict(style="inverse_sqrt"), ValueError, "style"),
])
def test_weight_decay_schedule_validation(args, kwargs, error, name):
  with pytest.raises(error, match=name):
    mpscale.weight_decay_schedule(*args, **kwargs)


def _problem():
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal((6, 4)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal((4,)), jnp.float32)}
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype),
                        params) for _ in range(6)]
  return params, grads


def test_schedules_drive_adamw_and_the_learning_rate_metric():
  params, grads = _problem()
  lr = mpscale.lr_schedule(1e-2, warmup_steps=2, decay_steps=5, style="cosine",
                           min_lr=1e-3)
  wd = mpscale.weight_decay_schedule(0.0, 0.1, 5, style="linear")
  tx = mpscale.dynamic_loss_scale(
      optax.inject_hyperparams(optax.adamw)(learning_rate=lr, weight_decay=wd),
      init_scale=1.0)
  ref = optax.adamw(lr, weight_decay=wd)  # plain Optax with the same schedules
  state, ref_state = tx.init(params), ref.init(params)
  p, p_ref = params, params
  for count, g in enumerate(grads):
    u, state = tx.update(g, state, p)
    p = optax.apply_updates(p, u)
    u_ref, ref_state = ref.update(g, ref_state, p_ref)
    p_ref = optax.apply_updates(p_ref, u_ref)
    # inject_hyperparams records the value used at this step, as came does.
    np.testing.assert_allclose(mpscale.step_metrics(state)["learning_rate"],
                               lr(count), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
               p, p_ref)


def test_schedules_drive_came_and_the_learning_rate_metric():
  params, grads = _problem()
  lr = mpscale.lr_schedule(1e-2, warmup_fraction=0.4, decay_steps=5,
                           style="inverse_sqrt")
  wd = mpscale.weight_decay_schedule(0.0, 0.1, 5, style="cosine")
  tx = mpscale.dynamic_loss_scale(mpscale.came(lr, weight_decay=wd), init_scale=1.0)
  state = tx.init(params)
  p = params
  for count, g in enumerate(grads):
    u, state = tx.update(g, state, p)
    p = optax.apply_updates(p, u)
    # came records the learning rate it used at this step.
    np.testing.assert_allclose(mpscale.step_metrics(state)["learning_rate"], lr(count),
                               rtol=1e-6)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(p))
