"""Fault-injection soak: 10,000 steps, 5% poisoned with NaN/Inf in a random leaf and
replica, under shard_map over 8 fake devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

import mpscale
from mpscale.parallel import cast_varying

STEPS, POISON_RATE, REPLICAS = 10_000, 0.05, 8
MIN_SCALE, MAX_SCALE = 2.0**-4, 2.0**12


def _params():
  rng = np.random.default_rng(0)
  return {"a": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(8,)), jnp.float32),
          "c": {"d": jnp.asarray(rng.normal(size=(4, 4)), jnp.float32)}}


def _plan(seed=0):
  rng = np.random.default_rng(seed)
  poisoned = rng.random(STEPS) < POISON_RATE
  return {"poisoned": poisoned,
          "leaf": rng.integers(0, 3, STEPS),
          "replica": rng.integers(0, REPLICAS, STEPS),
          "value": rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), STEPS)}


def _run(step_ids, plan):
  """Runs the given step ids (each with its own clean gradient) under shard_map."""
  mesh = Mesh(np.array(jax.devices()[:REPLICAS]), ("data",))
  tx = mpscale.dynamic_loss_scale(
      optax.chain(mpscale.global_norm_clip(1.0), optax.adamw(1e-3)),
      init_scale=2.0**10, growth_interval=50, hysteresis=2, min_scale=MIN_SCALE,
      max_scale=MAX_SCALE, axis_name="data")
  params = _params()
  leaves, treedef = jax.tree.flatten(params)

  def per_replica(params, xs):
    replica = jax.lax.axis_index("data")

    def body(carry, x):
      params, state, bad_param, lo, hi = carry
      i, poisoned, leaf, bad_replica, value = x
      key = jax.random.fold_in(jax.random.PRNGKey(1), i)
      flat = jax.tree.leaves(params)
      grads = [0.1 * p + jax.random.normal(jax.random.fold_in(key, j), p.shape)
               for j, p in enumerate(flat)]
      scale = mpscale.loss_scale_of(state)
      hit = poisoned & (replica == bad_replica)
      grads = [scale * jnp.where(hit & (leaf == j) & (jnp.arange(g.size) == 0
                                                      ).reshape(g.shape), value, g)
               for j, g in enumerate(grads)]
      updates, state = tx.update(jax.tree.unflatten(treedef, grads), state, params)
      params = optax.apply_updates(params, updates)
      finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(p))
                                  for p in jax.tree.leaves(params)]))
      carry = (params, state, bad_param | ~finite,
               jnp.minimum(lo, state.loss_scale), jnp.maximum(hi, state.loss_scale))
      # The agreed skip decision comes out replica-invariant; the carry stays varying.
      return cast_varying(carry, ("data",)), None

    state = tx.init(params)
    init = (params, state, jnp.zeros((), bool), state.loss_scale, state.loss_scale)
    # Each replica carries its own copy (the gradients differ where poisoned).
    init = cast_varying(init, ("data",))
    (params, state, bad_param, lo, hi), _ = jax.lax.scan(body, init, xs)
    return jax.tree.map(lambda x: x[None], (params, state.skip_state.skipped, bad_param,
                                            lo, hi))

  xs = (jnp.asarray(step_ids, jnp.int32), jnp.asarray(plan["poisoned"][step_ids]),
        jnp.asarray(plan["leaf"][step_ids]), jnp.asarray(plan["replica"][step_ids]),
        jnp.asarray(plan["value"][step_ids]))
  fn = jax.jit(jax.shard_map(per_replica, mesh=mesh, in_specs=(P(), P()),
                             out_specs=P("data")))
  return fn(params, xs)


def test_soak_poisoned_steps_are_skipped_and_cost_nothing():
  plan = _plan()
  everything = np.arange(STEPS)
  clean = everything[~plan["poisoned"]]
  params, skipped, bad_param, lo, hi = _run(everything, plan)
  ref_params, ref_skipped, _, _, _ = _run(clean, plan)

  assert 0.03 * STEPS < plan["poisoned"].sum() < 0.07 * STEPS
  assert not np.asarray(bad_param).any()  # no parameter was ever non-finite
  np.testing.assert_array_equal(skipped, plan["poisoned"].sum())  # on every replica
  np.testing.assert_array_equal(ref_skipped, 0)
  assert MIN_SCALE <= float(np.min(lo)) and float(np.max(hi)) <= MAX_SCALE
  # Every replica holds the same params, equal bit for bit to the run without the
  # poisoned steps (the scales are powers of two, so unscaling is exact).
  for r in range(REPLICAS):
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
      np.testing.assert_array_equal(np.asarray(got[r]), np.asarray(want[0]))


def test_long_fp16_run_recovers_its_working_scale_after_an_overflow_burst():
  """Scaled float16 gradients overflow on their own once the scale passes ~2^10, so the
  scale settles in a working range; a burst of 12 poisoned steps knocks it far down;
  it grows back to the same range, and no burst step touches the params."""
  interval, steps, burst = 10, 1500, range(700, 712)
  tx = mpscale.dynamic_loss_scale(optax.sgd(1e-3), init_scale=1.0,
                                  growth_interval=interval, min_scale=2.0**-20)
  params = {"w": jnp.zeros((64,), jnp.float32)}
  g_true = jnp.linspace(10.0, 40.0, 64)  # fp16 max 65504: overflow above scale ~1638

  def body(carry, t):
    params, state = carry
    scaled = (mpscale.loss_scale_of(state) * g_true).astype(jnp.float16)  # may be inf
    poisoned = (t >= burst.start) & (t < burst.stop)
    scaled = jnp.where(poisoned, jnp.nan, scaled)
    updates, state = tx.update({"w": scaled}, state, params)
    return (optax.apply_updates(params, updates), state), (
        state.loss_scale, state.skip_state.skipped, jnp.all(jnp.isfinite(params["w"])))

  (params, state), (scales, skipped, finite) = jax.jit(
      lambda c: jax.lax.scan(body, c, jnp.arange(steps)))((params, tx.init(params)))
  scales = np.log2(np.asarray(scales))
  working = scales[500:700]  # settled: grows to the edge, overflows, backs off
  assert working.min() >= 8 and working.max() <= 11
  assert scales[burst.stop - 1] <= working.min() - 10  # the burst halved it 12 times
  recovered = scales[burst.stop + 12 * interval + 100:]
  assert recovered.min() >= working.min() and recovered.max() <= working.max()
  assert np.asarray(finite).all()
  assert int(state.skip_state.skipped) >= len(burst)
