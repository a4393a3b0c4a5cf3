"""Tests for mpscale.scaling: dynamic/fixed/no loss scaling around Optax."""

import functools
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings, strategies as st
from jax.sharding import Mesh, PartitionSpec as P

import mpscale
from tests import helpers

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


def _params():
  rng = np.random.default_rng(0)
  return {
      "dense": {"kernel": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
                "bias": jnp.asarray([0.0, -0.0, 1.5], jnp.float32)},
      "head": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
  }


def _grads(scale, poison=None, leaf=0, seed=1):
  """Gradients of ``scale * loss``, with ``poison`` (nan/inf) put into one leaf."""
  rng = np.random.default_rng(seed)
  leaves, treedef = jax.tree.flatten(_params())
  out = [jnp.asarray(rng.normal(size=x.shape), jnp.float32) * scale for x in leaves]
  if poison is not None:
    out[leaf] = out[leaf].reshape(-1).at[0].set(poison).reshape(out[leaf].shape)
  return jax.tree.unflatten(treedef, out)


class ReferenceScaler:
  """The rules of `mpscale.scaling`'s module docstring, in plain Python, one step at
  a time."""

  def __init__(self, init, growth, backoff, interval, hysteresis, consecutive,
               lo, hi):
    self.scale, self.count, self.hyst = init, 0, hysteresis
    self.growth, self.backoff, self.interval = growth, backoff, interval
    self.hysteresis, self.consecutive, self.lo, self.hi = hysteresis, consecutive, lo, hi

  def step(self, finite):
    # The scale is a float32 array: each product is rounded to float32, as there.
    # (Exactly: a float32 times these factors is exact in float64 before rounding.)
    if finite:
      self.count += 1
      if self.consecutive:
        self.hyst = self.hysteresis
      if self.count == self.interval:
        self.scale = min(_f32(self.scale * self.growth), self.hi)
        self.count = 0
        self.hyst = self.hysteresis
    else:
      self.count = 0
      self.hyst -= 1
      if self.hyst <= 0:
        self.scale = max(_f32(self.scale * self.backoff), self.lo)
    return self.scale


def _f32(x):
  return float(np.float32(x))


def grad_scaler_trajectory(steps, init, growth, backoff, interval, lo, hi):
  """PyTorch GradScaler's update rule (bounded), written independently."""
  scale, tracker, out = init, 0, []
  for finite in steps:
    if not finite:
      scale, tracker = max(_f32(scale * backoff), lo), 0
    else:
      tracker += 1
      if tracker == interval:
        scale, tracker = min(_f32(scale * growth), hi), 0
    out.append(scale)
  return out


CONFIGS = [
    # init, growth, backoff, interval, hysteresis, consecutive, min, max
    (2.0**4, 2.0, 0.5, 3, 1, False, 1.0, 2.0**7),
    (2.0**4, 2.0, 0.5, 2, 2, False, 1.0, 2.0**8),
    (2.0**4, 2.0, 0.5, 2, 3, True, 2.0, 2.0**8),
    (100.0, 3.0, 0.25, 1, 2, True, 0.5, 1e4),
]


@functools.lru_cache(maxsize=None)
def _jitted(config):
  init, growth, backoff, interval, hyst, consecutive, lo, hi = config
  tx = mpscale.dynamic_loss_scale(
      optax.sgd(0.1), init_scale=init, growth_factor=growth, backoff_factor=backoff,
      growth_interval=interval, hysteresis=hyst, consecutive_hysteresis=consecutive,
      min_scale=lo, max_scale=hi)
  return tx, jax.jit(tx.update)


def _run_scales(config, pattern):
  """Scales after each step for a sequence of (finite, poison kind, leaf)."""
  tx, update = _jitted(config)
  params = _params()
  state = tx.init(params)
  scales = []
  for finite, kind, leaf in pattern:
    scale = float(mpscale.loss_scale_of(state))
    grads = _grads(scale, None if finite else kind, leaf)
    _, state = update(grads, state, params)
    scales.append(float(state.loss_scale))
    assert bool(state.skip_state.overflow) == (not finite)
  return scales


steps_strategy = st.lists(
    st.tuples(st.booleans(), st.sampled_from([np.nan, np.inf, -np.inf]),
              st.integers(0, 2)),
    min_size=1, max_size=40)


@pytest.mark.parametrize("config", CONFIGS)
@settings(max_examples=25, deadline=None)
@given(pattern=steps_strategy)
@example(pattern=[(False, np.nan, 0)] * 4 + [(True, np.nan, 0)] * 3
         + [(False, np.nan, 0)] * 4 + [(True, np.nan, 0)] * 3 + [(False, np.nan, 0)] * 2
         + [(True, np.nan, 0)] * 7)  # growth 3.0: float32 rounding of the scale
def test_scale_trajectory_matches_reference(config, pattern):
  ref = ReferenceScaler(*config)
  want = [ref.step(finite) for finite, _, _ in pattern]
  assert _run_scales(config, pattern) == want


@settings(max_examples=25, deadline=None)
@given(pattern=steps_strategy)
def test_hysteresis_one_is_grad_scaler(pattern):
  config = CONFIGS[0]
  init, growth, backoff, interval, _, _, lo, hi = config
  want = grad_scaler_trajectory([f for f, _, _ in pattern], init, growth, backoff,
                                interval, lo, hi)
  assert _run_scales(config, pattern) == want


def test_growth_on_the_interval_th_finite_step():
  config = (8.0, 2.0, 0.5, 3, 1, False, 1.0, 1e6)
  assert _run_scales(config, [(True, None, 0)] * 7) == [8, 8, 16, 16, 16, 32, 32]


def test_hysteresis_delays_backoff_and_refills_on_growth():
  config = (8.0, 2.0, 0.5, 2, 2, False, 1.0, 1e6)
  bad, good = (False, np.nan, 0), (True, None, 0)
  # 1st overflow tolerated, 2nd backs off, 3rd backs off again (tracker exhausted),
  # growth refills, after which one overflow is tolerated again; a finite step that
  # does not grow does not refill, so the next overflow backs off.
  got = _run_scales(config, [bad, bad, bad, good, good, bad, good, bad, bad])
  assert got == [8, 4, 2, 2, 4, 4, 4, 2, 1]


def test_consecutive_hysteresis_refills_on_every_finite_step():
  config = (8.0, 2.0, 0.5, 100, 2, True, 1.0, 1e6)
  bad, good = (False, np.inf, 1), (True, None, 0)
  assert _run_scales(config, [bad, good, bad, good, bad, bad]) == [8, 8, 8, 8, 8, 4]
  config = (8.0, 2.0, 0.5, 100, 2, False, 1.0, 1e6)
  assert _run_scales(config, [bad, good, bad, good, bad, bad]) == [8, 8, 4, 4, 2, 1]


@pytest.mark.parametrize("kind", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("leaf", [0, 1, 2])
def test_skipped_step_is_bit_identical(kind, leaf):
  inner = optax.chain(mpscale.global_norm_clip(1.0),
                      optax.inject_hyperparams(optax.adamw)(
                          learning_rate=optax.linear_schedule(1e-2, 1e-3, 10)))
  tx = mpscale.dynamic_loss_scale(inner, init_scale=2.0**10, growth_interval=1)
  params = _params()
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for i in range(3):  # move the inner state away from its initial values
    params, state = step(params, state, _grads(mpscale.loss_scale_of(state), seed=i))
  before_params, before_inner = helpers.bits(params), helpers.bits(state.skip_state.inner_state)
  grads = _grads(mpscale.loss_scale_of(state), kind, leaf)
  new_params, new_state = step(params, state, grads)
  assert helpers.bits(new_params) == before_params  # -0.0 in 'bias' survives too
  assert helpers.bits(new_state.skip_state.inner_state) == before_inner
  assert int(new_state.skip_state.skipped) == 1
  assert float(new_state.loss_scale) == float(state.loss_scale) / 2
  assert bool(new_state.skip_state.nan) == bool(np.isnan(kind))
  assert bool(new_state.skip_state.inf) == bool(np.isinf(kind))


def test_scale_stays_within_bounds_over_10000_random_steps():
  lo, hi = 4.0, 2.0**12
  tx = mpscale.dynamic_loss_scale(optax.sgd(0.1), init_scale=64.0, growth_interval=1,
                                  growth_factor=4.0, backoff_factor=0.125,
                                  hysteresis=2, min_scale=lo, max_scale=hi)
  params = {"w": jnp.ones((8,))}

  def body(state, key):
    bad = jax.random.bernoulli(key, 0.4)
    g = jnp.where(bad, jnp.nan, 1.0) * jnp.ones((8,)) * mpscale.loss_scale_of(state)
    _, state = tx.update({"w": g}, state, params)
    return state, state.loss_scale

  keys = jax.random.split(jax.random.PRNGKey(0), 10_000)
  state, scales = jax.jit(lambda s: jax.lax.scan(body, s, keys))(tx.init(params))
  scales = np.asarray(scales)
  assert np.all(np.isfinite(scales)) and scales.min() == lo and scales.max() == hi
  assert int(state.skip_state.skipped) > 3000


def test_growth_never_reaches_inf():
  big = float(np.finfo(np.float32).max)
  tx = mpscale.dynamic_loss_scale(optax.sgd(0.1), init_scale=big / 2, max_scale=big,
                                  growth_factor=10.0, growth_interval=1)
  params = {"w": jnp.zeros((2,))}
  state = tx.init(params)
  for _ in range(3):
    _, state = jax.jit(tx.update)({"w": jnp.zeros((2,))}, state, params)
  assert float(state.loss_scale) == big


def test_backoff_never_reaches_zero():
  tx = mpscale.dynamic_loss_scale(optax.sgd(0.1), init_scale=1.0, min_scale=1e-30,
                                  backoff_factor=1e-10)
  params = {"w": jnp.zeros((2,))}
  state = tx.init(params)
  for _ in range(5):
    _, state = jax.jit(tx.update)({"w": jnp.full((2,), jnp.inf)}, state, params)
  assert float(state.loss_scale) == np.float32(1e-30)


def test_unscales_in_float32_before_inner():
  seen = []

  def spy_update(updates, state, params=None):
    seen.append(jax.tree.map(lambda u: u.dtype, updates))
    return updates, state

  spy = optax.GradientTransformation(lambda p: optax.EmptyState(), spy_update)
  tx = mpscale.dynamic_loss_scale(spy, init_scale=1024.0)
  params = {"w": jnp.ones((3,), jnp.float16)}
  grads = {"w": jnp.full((3,), 2048.0, jnp.float16)}
  updates, _ = tx.update(grads, tx.init(params), params)
  assert seen[0]["w"] == jnp.float32
  np.testing.assert_array_equal(updates["w"], np.full((3,), 2.0, np.float32))


def test_fixed_scale_drops_or_applies_overflow():
  params = _params()
  bad = _grads(8.0, np.inf, 0)
  dropped = mpscale.fixed_loss_scale(optax.sgd(1.0), 8.0)
  upd, state = dropped.update(bad, dropped.init(params), params)
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(upd))
  assert int(state.skip_state.skipped) == 1 and float(state.loss_scale) == 8.0

  applied = mpscale.fixed_loss_scale(optax.sgd(1.0), 8.0, skip_nonfinite=False)
  upd, state = applied.update(bad, applied.init(params), params)
  assert np.isinf(np.asarray(upd["dense"]["bias"])).any()
  assert bool(state.skip_state.overflow) and int(state.skip_state.skipped) == 0
  np.testing.assert_allclose(upd["head"], -np.asarray(bad["head"]) / 8.0)


def test_fixed_scale_is_data_and_changing_it_does_not_recompile():
  tx = mpscale.fixed_loss_scale(optax.sgd(1.0), 4.0)
  params = {"w": jnp.ones((2,))}
  update = jax.jit(tx.update)
  state = tx.init(params)
  u1, _ = update({"w": jnp.full((2,), 8.0)}, state, params)
  state = mpscale.with_loss_scale(state, 2.0)
  u2, _ = update({"w": jnp.full((2,), 8.0)}, state, params)
  assert float(mpscale.loss_scale_of(state)) == 2.0
  np.testing.assert_allclose(u1["w"], -2.0)
  np.testing.assert_allclose(u2["w"], -4.0)
  assert update._cache_size() == 1
  with pytest.raises(ValueError, match="loss-scale"):
    mpscale.with_loss_scale(optax.sgd(1.0).init(params), 2.0)


def test_no_loss_scale_is_scale_one_and_still_skips():
  tx = mpscale.no_loss_scale(optax.sgd(1.0))
  params = {"w": jnp.ones((2,))}
  state = tx.init(params)
  assert float(mpscale.loss_scale_of(state)) == 1.0
  upd, state = tx.update({"w": jnp.array([1.0, jnp.nan])}, state, params)
  assert int(state.skip_state.skipped) == 1
  np.testing.assert_array_equal(optax.apply_updates(params, upd)["w"], params["w"])


def test_loss_scale_of_finds_the_scale_inside_a_chain():
  params = {"w": jnp.ones((2,))}
  tx = optax.chain(optax.identity(),
                   mpscale.dynamic_loss_scale(optax.sgd(1.0), init_scale=64.0))
  assert float(mpscale.loss_scale_of(tx.init(params))) == 64.0
  assert float(mpscale.loss_scale_of(optax.sgd(1.0).init(params))) == 1.0


@pytest.mark.parametrize("kwargs, exc, name", [
    ({"init_scale": 0.0}, ValueError, "init_scale"),
    ({"init_scale": -1.0}, ValueError, "init_scale"),
    ({"init_scale": 2.0**30}, ValueError, "init_scale"),
    ({"init_scale": "big"}, TypeError, "init_scale"),
    ({"growth_factor": 1.0}, ValueError, "growth_factor"),
    ({"growth_factor": 0.5}, ValueError, "growth_factor"),
    ({"backoff_factor": 1.0}, ValueError, "backoff_factor"),
    ({"backoff_factor": 0.0}, ValueError, "backoff_factor"),
    ({"growth_interval": 0}, ValueError, "growth_interval"),
    ({"growth_interval": 2.5}, TypeError, "growth_interval"),
    ({"hysteresis": 0}, ValueError, "hysteresis"),
    ({"hysteresis": True}, TypeError, "hysteresis"),
    ({"consecutive_hysteresis": 1}, TypeError, "consecutive_hysteresis"),
    ({"refill_after_backoff": 1}, TypeError, "refill_after_backoff"),
    ({"min_scale": 0.0}, ValueError, "min_scale"),
    ({"max_scale": float("inf")}, ValueError, "max_scale"),
    ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 2.0}, ValueError, "min_scale"),
    ({"axis_name": 3}, TypeError, "axis_name"),
    ({"norm_groups": "x"}, TypeError, "norm_groups"),
])
def test_dynamic_validates_arguments(kwargs, exc, name):
  with pytest.raises(exc, match=name):
    mpscale.dynamic_loss_scale(optax.sgd(0.1), **kwargs)


def test_validates_inner_and_fixed_scale():
  with pytest.raises(TypeError, match="inner"):
    mpscale.dynamic_loss_scale(lambda g: g)
  with pytest.raises(ValueError, match="scale"):
    mpscale.fixed_loss_scale(optax.sgd(0.1), 0.0)
  with pytest.raises(TypeError, match="skip_nonfinite"):
    mpscale.fixed_loss_scale(optax.sgd(0.1), 2.0, skip_nonfinite="no")


def test_skipped_steps_do_not_advance_inner_schedules():
  sched = optax.linear_schedule(1.0, 0.0, 10)
  tx = mpscale.dynamic_loss_scale(
      optax.inject_hyperparams(optax.sgd)(learning_rate=sched), init_scale=4.0)
  params = {"w": jnp.ones((2,))}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in [1.0, jnp.nan, jnp.nan, 1.0]:
    _, state = update({"w": jnp.full((2,), g) * state.loss_scale}, state, params)
  # Two applied steps: the inner count is 2, and the last lr used is sched(1).
  inner = state.skip_state.inner_state
  assert int(inner.count) == 2
  np.testing.assert_allclose(mpscale.step_metrics(state)["learning_rate"], sched(1))


def test_flax_train_state_loop_with_fp16_model_converges():
  from flax import linen as nn
  from flax.training import train_state

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.tanh(nn.Dense(16, dtype=jnp.float16)(x))
      return nn.Dense(1, dtype=jnp.float16)(x)

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(64, 4)), jnp.float32)
  y = jnp.sin(x.sum(axis=1, keepdims=True))
  model = MLP()
  tx = mpscale.dynamic_loss_scale(
      optax.chain(mpscale.global_norm_clip(1.0), optax.adam(1e-2)),
      init_scale=2.0**15, growth_interval=20)
  ts = train_state.TrainState.create(
      apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), x)["params"],
      tx=tx)

  @jax.jit
  def train_step(ts):
    scale = mpscale.loss_scale_of(ts.opt_state)

    def loss_fn(p):
      pred = ts.apply_fn({"params": p}, x).astype(jnp.float32)
      return jnp.mean((pred - y) ** 2)

    loss, grads = jax.value_and_grad(lambda p: scale * loss_fn(p))(ts.params)
    return ts.apply_gradients(grads=grads), loss / scale

  ts, first = train_step(ts)
  for _ in range(300):
    ts, loss = train_step(ts)
  metrics = mpscale.step_metrics(ts.opt_state)
  assert float(loss) < 0.2 * float(first)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(ts.params))
  assert float(metrics["loss_scale"]) >= 1.0 and not bool(metrics["overflow"])


def test_shard_map_one_poisoned_replica_makes_all_skip():
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  tx = mpscale.dynamic_loss_scale(optax.adam(0.1), init_scale=8.0, axis_name="data")
  params = {"w": jnp.ones((4,)), "b": jnp.zeros((2,))}
  state = tx.init(params)

  def per_replica(grads, state, params):
    grads = jax.tree.map(lambda g: g[0], grads)  # this replica's gradient
    updates, state = tx.update(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    return (jax.tree.map(lambda x: x[None], new_params), state.loss_scale[None],
            state.skip_state.skipped[None])

  def run(poison_replica):
    g = {"w": jnp.ones((8, 4)) * 8.0, "b": jnp.ones((8, 2)) * 8.0}
    if poison_replica is not None:
      g["b"] = g["b"].at[poison_replica, 1].set(jnp.nan)
    fn = jax.shard_map(per_replica, mesh=mesh,
                       in_specs=(P("data"), P(), P()), out_specs=P("data"))
    return jax.jit(fn)(g, state, params)

  new_params, scales, skipped = run(poison_replica=5)
  for leaf, before in [(new_params["w"], params["w"]), (new_params["b"], params["b"])]:
    for r in range(8):
      assert helpers.bits(leaf[r]) == helpers.bits(before)
  np.testing.assert_array_equal(scales, np.full((8,), 4.0))
  np.testing.assert_array_equal(skipped, np.ones((8,)))

  new_params, scales, skipped = run(poison_replica=None)
  assert not np.allclose(new_params["w"], 1.0)
  np.testing.assert_array_equal(skipped, np.zeros((8,)))
  chex.assert_trees_all_equal(*[jax.tree.map(lambda x: x[r], new_params)
                                for r in range(8)])


def test_scale_loss_multiplies_by_the_current_scale_and_the_wrapper_undoes_it():
  params = _params()
  tx = mpscale.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**8)
  state = tx.init(params)
  loss_fn = lambda p: jnp.sum(p["dense"]["kernel"] ** 2) + jnp.sum(p["head"])
  assert float(mpscale.scale_loss(jnp.float32(3.0), state)) == 3.0 * 2**8
  half = mpscale.scale_loss(jnp.float16(3.0), state)
  assert half.dtype == jnp.float32 and float(half) == 768.0  # not an fp16 overflow
  tree = mpscale.scale_loss({"a": 1.0, "b": jnp.ones(2)}, state)
  assert float(tree["a"]) == 256.0 and tree["b"].tolist() == [256.0, 256.0]
  grads = jax.grad(lambda p: mpscale.scale_loss(loss_fn(p), state))(params)
  got, _ = tx.update(grads, state, params)
  want, _ = optax.sgd(0.1).update(jax.grad(loss_fn)(params), optax.sgd(0.1).init(params))
  chex.assert_trees_all_close(got, want, rtol=1e-6)
  # Without a loss-scale wrapper the scale is 1.
  assert float(mpscale.scale_loss(2.0, optax.adam(1e-3).init(params))) == 2.0


@pytest.mark.parametrize("scale", [jnp.float32(8.0), jnp.array([8.0]),
                                   np.array([8.0], np.float32)],
                         ids=["jnp_scalar", "jnp_shape_1", "numpy_shape_1"])
def test_fixed_scale_takes_a_scalar_or_shape_1_array(scale):
  params = {"w": jnp.ones(3)}
  tx = mpscale.fixed_loss_scale(optax.sgd(1.0), scale)
  state = tx.init(params)
  assert mpscale.loss_scale_of(state).shape == () and float(
      mpscale.loss_scale_of(state)) == 8.0
  updates, _ = jax.jit(tx.update)({"w": jnp.full(3, 8.0)}, state, params)
  np.testing.assert_allclose(updates["w"], -1.0)  # unscaled by 8


def test_a_traced_fixed_scale_works_under_jit_without_recompiling():
  params = {"w": jnp.ones(3)}

  @jax.jit
  def step(scale, grads):
    tx = mpscale.fixed_loss_scale(optax.sgd(1.0), scale)
    updates, state = tx.update(grads, tx.init(params), params)
    return updates["w"], mpscale.loss_scale_of(state)

  for s in (2.0, 4.0, 16.0):
    updates, scale = step(jnp.array([s]), {"w": jnp.full(3, s)})
    np.testing.assert_allclose(updates, -1.0)
    assert float(scale) == s
  assert step._cache_size() == 1


@pytest.mark.parametrize("scale, error", [
    (jnp.array([1.0, 2.0]), TypeError), (jnp.array(2), TypeError),
    (jnp.array([0.0]), ValueError), (jnp.array(jnp.inf), ValueError)])
def test_fixed_scale_refuses_other_arrays_by_name(scale, error):
  with pytest.raises(error, match="scale"):
    mpscale.fixed_loss_scale(optax.sgd(1.0), scale)


def tf_exponential_update_trajectory(steps, init, incr_every_n_steps,
                                     decr_every_n_nan_or_inf, incr_ratio, decr_ratio):
  """TensorFlow's ``ExponentialUpdateLossScaleManager.update_loss_scale`` (the NPU
  seed's manager), written independently from its source
  (tensorflow/contrib/mixed_precision/python/loss_scale_manager.py): a finite step
  grows the scale on the n-th good step and clears both counts, else counts a good
  step; a non-finite step cuts the scale (floor 1) on the n-th bad step and clears
  both counts, else counts a bad step and clears the good ones."""
  scale, good, bad, out = init, 0, 0, []
  for finite in steps:
    if finite:
      if good + 1 >= incr_every_n_steps:
        grown = _f32(scale * incr_ratio)
        scale, good, bad = (grown if np.isfinite(grown) else scale), 0, 0
      else:
        good += 1
    elif bad + 1 >= decr_every_n_nan_or_inf:
      scale, good, bad = max(1.0, _f32(scale * decr_ratio)), 0, 0
    else:
      bad, good = bad + 1, 0
    out.append(scale)
  return out


@functools.lru_cache(maxsize=None)
def _tf_mode(init, incr_n, decr_n, incr_ratio, decr_ratio):
  tx = mpscale.dynamic_loss_scale(
      optax.sgd(0.1), init_scale=init, growth_interval=incr_n, hysteresis=decr_n,
      growth_factor=incr_ratio, backoff_factor=decr_ratio, refill_after_backoff=True,
      min_scale=1.0, max_scale=1e30)
  return tx, jax.jit(tx.update)


def _scales_of(tx, update, pattern):
  params = _params()
  state = tx.init(params)
  scales = []
  for finite, kind, leaf in pattern:
    grads = _grads(float(mpscale.loss_scale_of(state)), None if finite else kind, leaf)
    _, state = update(grads, state, params)
    scales.append(float(state.loss_scale))
  return scales


@pytest.mark.parametrize("decr_n", [1, 2, 3, 4])
@settings(max_examples=20, deadline=None)
@given(pattern=steps_strategy, incr_n=st.integers(1, 4))
def test_refill_after_backoff_is_tensorflows_exponential_update(decr_n, incr_n,
                                                                pattern):
  args = (2.0**10, incr_n, decr_n, 2.0, 0.5)
  want = tf_exponential_update_trajectory([f for f, _, _ in pattern], *args)
  assert _scales_of(*_tf_mode(*args), pattern) == want


def test_the_three_hysteresis_modes_on_the_seeds_example():
  bad, good = (False, np.inf, 0), (True, None, 0)

  def scales(pattern, **mode):
    tx = mpscale.dynamic_loss_scale(optax.sgd(0.1), init_scale=1024.0,
                                    growth_interval=100, hysteresis=2, **mode)
    return _scales_of(tx, jax.jit(tx.update), pattern)

  # The seed's example, n = 2 and three overflows: TF's count restarts after a cut.
  assert scales([bad] * 3, refill_after_backoff=True) == [1024, 512, 512]
  assert scales([bad] * 3) == [1024, 512, 256]  # Megatron-LM
  assert scales([bad] * 3, consecutive_hysteresis=True) == [1024, 512, 256]
  # A finite step between overflows refills DeepSpeed's only.
  assert scales([bad, good, bad]) == [1024, 1024, 512]
  assert scales([bad, good, bad], consecutive_hysteresis=True) == [1024, 1024, 1024]
  assert scales([bad, good, bad], refill_after_backoff=True) == [1024, 1024, 512]


# ------------------------------------------------------------- the compiled program

_H100_SPEC = (Path(__file__).resolve().parents[3] / "mpscale" / "trainer" /
              "planning" / "target_specs" / "h100_sxm.txtpb")


def _h100():
  """One H100 of XLA's compile-only CUDA topology, or a skip where this JAX has no
  CUDA compiler (a plain CPU install)."""
  try:
    from jax.experimental import topologies  # noqa: PLC0415
    topo = topologies.get_topology_desc("h100", "cuda", topology="1x1x1",
                                        target_config=_H100_SPEC.read_text())
  except Exception as e:  # noqa: BLE001  (no jax_cuda12_plugin here)
    pytest.skip(f"no CUDA compiler in this JAX: {type(e).__name__}")
  return topo.devices[0]


def _gpt2_like(layers=12, d=64):
  """GPT-2 small's leaves (149: 12 a block), narrow: what the H100 ratio is set on."""
  block = lambda: {
      "ln_1": {"scale": (d,), "bias": (d,)}, "ln_2": {"scale": (d,), "bias": (d,)},
      "attn": {"c_attn": {"kernel": (d, 3 * d), "bias": (3 * d,)},
               "c_proj": {"kernel": (d, d), "bias": (d,)}},
      "mlp": {"c_fc": {"kernel": (d, 4 * d), "bias": (4 * d,)},
              "c_proj": {"kernel": (4 * d, d), "bias": (d,)}}}
  return {"embed": {"wte": (512, d), "wpe": (256, d)},
          "h": [block() for _ in range(layers)],
          "ln_f": {"scale": (d,), "bias": (d,)}, "lm_head": (d, 512)}


def _compiled_step(tx, device, step=None):
  """``step(params, opt_state, grads)`` (an optimizer step, params and state
  donated) compiled for ``device`` from shapes, as a parsed module."""
  from mpscale.trainer.planning import hlo  # noqa: PLC0415
  sharding = jax.sharding.SingleDeviceSharding(device)
  on = lambda t: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), t)
  params = on(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
                           _gpt2_like(), is_leaf=lambda x: isinstance(x, tuple)))

  def optimizer_step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  compiled = jax.jit(step or optimizer_step, donate_argnums=(0, 1)).lower(
      params, on(jax.eval_shape(tx.init, params)), params).compile()
  return hlo.parse(compiled.as_text()), params


def _leaf_copies(module, params):
  """The entry's copies at least as large as the smallest parameter leaf."""
  from mpscale.trainer.planning import hlo  # noqa: PLC0415
  smallest = min(x.size * 4 for x in jax.tree.leaves(params))
  return [ins.result for ins in module.computations[module.entry]
          if ins.op == "copy" and hlo._shape_bytes(ins.result) >= smallest]


def _copying_step(tx):
  """An optimizer step that reads the old params after writing the new ones into
  their (donated) buffers: XLA must copy a whole leaf to keep them."""
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    new = optax.apply_updates(p, u)
    return new, s, jax.tree.map(lambda a, b: a[::-1] - b, p, new)
  return step


@pytest.mark.parametrize("target", ["cpu", "h100"])
def test_dynamic_loss_scale_step_copies_no_donated_leaf(target):
  """The skip's select sits at each state leaf's producer, so XLA updates donated
  params and state in place: no whole-leaf copy on the CPU program nor on the one
  XLA compiles for an H100; and there, the wrapper launches at most 1.2x AdamW's
  kernels (one reduction per bucket of like leaves, not one per leaf)."""
  from mpscale.trainer.planning import hlo  # noqa: PLC0415
  device = jax.devices("cpu")[0] if target == "cpu" else _h100()
  adamw = optax.adamw(1e-3)
  module, params = _compiled_step(mpscale.dynamic_loss_scale(adamw), device)
  assert _leaf_copies(module, params) == []
  # The check would see a copy: a step that keeps the old params makes them.
  copying, _ = _compiled_step(adamw, device, _copying_step(adamw))
  assert _leaf_copies(copying, params)
  if target == "h100":
    plain, _ = _compiled_step(adamw, device)
    assert hlo.launches(module) <= 1.2 * hlo.launches(plain), (
        hlo.launches(module), hlo.launches(plain))
