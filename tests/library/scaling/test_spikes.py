"""Tests for mpscale.scaling: skip_spikes alone, under the loss-scale wrapper, in the
train step, and over a long ordinary run."""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import numpy as np
import optax
import pytest

import mpscale
from mpscale.parallel import cast_varying
from tests import helpers

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)

STEPS = 200
GRAD_SPIKES = (80, 81, 130, 150)
"""Steps whose gradients are multiplied by 100 (81: two in a row)."""
LOSS_SPIKES = (95, 150, 171)
"""Steps whose loss is multiplied by 100 (150: both)."""
SPIKES = tuple(sorted(set(GRAD_SPIKES) | set(LOSS_SPIKES)))


def _params():
  return {"a": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": {"c": jnp.ones((5,))}}


def _sequence(spiked=True):
  """A fixed sequence of clean gradients and losses (a slowly falling noisy loss),
  with the spikes injected when ``spiked``."""
  rng = np.random.default_rng(0)
  leaves, treedef = jax.tree.flatten(_params())
  grads = [rng.normal(0.5, 0.1, (STEPS,) + x.shape).astype(np.float32)
           for x in leaves]
  losses = (2.0 - np.arange(STEPS) / STEPS + rng.normal(0, 0.05, STEPS)).astype(
      np.float32)
  if spiked:
    for t in GRAD_SPIKES:
      for g in grads:
        g[t] *= 100.0
    losses[list(LOSS_SPIKES)] *= 100.0
  return jax.tree.unflatten(treedef, grads), losses


def _run(tx, steps, scaled=False):
  """Runs ``steps`` of the sequence under jit (a ``lax.scan``); returns the params
  and optimizer state after every step."""
  grads, losses = _sequence()
  grads = jax.tree.map(lambda g: g[np.asarray(steps)], grads)
  losses = losses[np.asarray(steps)]
  params = _params()

  def body(carry, x):
    params, state = carry
    g, loss = x
    if scaled:  # the loss-scale wrapper takes the gradients of scale * loss
      g = jax.tree.map(lambda v: v * mpscale.loss_scale_of(state), g)
    updates, state = tx.update(g, state, params, loss=loss)
    params = optax.apply_updates(params, updates)
    return (params, state), (params, state)

  _, history = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs))(
      (params, tx.init(params)), (grads, losses))
  return history


def _at(tree, t):
  return jax.tree.map(lambda x: x[t], tree)


def _inner():
  return optax.chain(mpscale.global_norm_clip(100.0), optax.adamw(1e-2))


def _check_run(params, spikes_state, inner_state):
  spike = np.asarray(spikes_state.spike)
  assert np.flatnonzero(spike).tolist() == list(SPIKES)
  np.testing.assert_array_equal(np.flatnonzero(spikes_state.norm_spike), GRAD_SPIKES)
  np.testing.assert_array_equal(np.flatnonzero(spikes_state.loss_spike), LOSS_SPIKES)
  assert int(spikes_state.spikes[-1]) == len(SPIKES)
  for t in SPIKES:  # untouched, bit for bit
    assert helpers.bits(_at(params, t)) == helpers.bits(_at(params, t - 1))
    assert helpers.bits(_at(inner_state, t)) == helpers.bits(_at(inner_state, t - 1))
  assert int(inner_state[1][0].count[-1]) == STEPS - len(SPIKES)  # adam's own count
  # The windows hold accepted values only: the largest is far below a spike's.
  assert float(np.max(spikes_state.norms[-1])) < 10 * float(
      np.median(spikes_state.norms[-1]))


def _clean_final_params(tx, scaled=False):
  clean = [t for t in range(STEPS) if t not in SPIKES]
  params, _ = _run(tx, clean, scaled)
  return _at(params, -1)


def _olmo_core_skips(losses, window=128, sigma=6.0):
  """OLMo-core's ``SkipStepOptimizer.get_step_factor`` for the loss alone, step by
  step (``olmo_core/optim/skip_step_optimizer.py``): the values kept include the
  current one (at most ``window + 1``); it judges once ``max(2, window // 2)`` are in,
  against the mean and sample std of the earlier ones."""
  kept, skips = [], []
  for x in losses:
    kept = (kept + [x])[-(window + 1):]
    if len(kept) < max(2, window // 2):
      skips.append(False)
      continue
    earlier = np.asarray(kept[:-1], np.float64)
    skips.append(bool(x - earlier.mean() > sigma * earlier.std(ddof=1)))
  return skips


@pytest.mark.parametrize("at", [62, 63, 64])
def test_the_default_warmup_is_olmo_cores(at):
  """A 100x loss spike after ``at`` ordinary steps, with the default window (128):
  OLMo-core's rule counts the current value in its length test, so it judges from
  the 64th value on (63 earlier ones); `skip_spikes`' default decides the same
  (issue #42: it waited for 64 earlier values, and let the spike at step 63 in)."""
  rng = np.random.default_rng(0)
  losses = (2.0 + rng.normal(0, 0.05, at + 1)).astype(np.float32)
  losses[at] *= 100.0
  want = _olmo_core_skips(losses.tolist())
  tx = mpscale.skip_spikes(optax.sgd(0.1), watch="loss")
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  update = jax.jit(lambda s, loss: tx.update({"w": jnp.ones(3)}, s, params,
                                             loss=loss)[1])
  got = []
  for loss in losses:
    state = update(state, jnp.float32(loss))
    got.append(bool(state.spike))
  assert got == want
  assert got[at] == (at >= 63)


def test_injected_spikes_are_skipped_and_cost_nothing():
  tx = mpscale.skip_spikes(_inner(), window=32)
  params, state = _run(tx, range(STEPS))
  _check_run(params, state, state.inner_state)
  ref = _clean_final_params(tx)
  assert helpers.bits(_at(params, -1)) == helpers.bits(ref)


def test_under_the_dynamic_loss_scale_a_spike_is_skipped_but_no_overflow():
  tx = mpscale.dynamic_loss_scale(mpscale.skip_spikes(_inner(), window=32),
                                  init_scale=2.0**10, growth_interval=20)
  params, state = _run(tx, range(STEPS), scaled=True)
  skip = state.skip_state
  spikes_state = skip.inner_state
  _check_run(params, spikes_state, spikes_state.inner_state)
  assert not np.asarray(skip.overflow).any()
  skipped = np.asarray(skip.skipped)
  np.testing.assert_array_equal(skipped, np.cumsum(np.asarray(spikes_state.spike)))
  assert int(skip.consecutive_skipped[81]) == 2  # 80 and 81
  scales = np.asarray(state.loss_scale)
  assert (np.diff(scales) >= 0).all() and scales[-1] > 2.0**10  # grew, never backed off
  # The scales are powers of two, so unscaling is exact: the run without the spikes
  # ends on the same params, bit for bit.
  ref = _clean_final_params(tx, scaled=True)
  assert helpers.bits(_at(params, -1)) == helpers.bits(ref)


def test_the_metrics_report_spike_and_spikes():
  tx = mpscale.no_loss_scale(mpscale.skip_spikes(optax.sgd(0.1), window=8))
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t, g in enumerate([1.0, 1.1, 0.9, 1.0, 1.2, 0.8, 1.0, 50.0, 1.0]):
    _, state = update({"w": g * jnp.ones(3)}, state, params, loss=jnp.float32(1.0))
    metrics = mpscale.step_metrics(state)
    assert bool(metrics["spike"]) == (t == 7)
    assert int(metrics["spikes"]) == int(metrics["skipped"]) == (t >= 7)
  assert "spike" not in mpscale.step_metrics(
      mpscale.no_loss_scale(optax.sgd(0.1)).init(params))


def test_a_nan_step_backs_the_scale_off_and_is_no_spike():
  tx = mpscale.dynamic_loss_scale(mpscale.skip_spikes(optax.sgd(0.1), window=8),
                                  init_scale=2.0**4)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in [1.0, 1.1, 0.9, 1.0, 1.2, 0.8, 1.0, 1.1, 0.9, 1.0]:
    _, state = update({"w": g * 16.0 * jnp.ones(3)}, state, params,
                      loss=jnp.float32(g))
  before = state.skip_state.inner_state
  _, state = update({"w": jnp.full(3, jnp.nan)}, state, params, loss=jnp.float32(jnp.nan))
  metrics = mpscale.step_metrics(state)
  assert bool(metrics["overflow"]) and not bool(metrics["spike"])
  assert int(metrics["skipped"]) == 1 and int(metrics["spikes"]) == 0
  assert float(state.loss_scale) == 8.0
  assert helpers.bits(state.skip_state.inner_state) == helpers.bits(before)


def test_alone_a_non_finite_value_is_no_spike_and_stays_out_of_the_window():
  tx = mpscale.skip_spikes(optax.sgd(0.1), window=4, warmup=2)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  for g, loss in [(1.0, 1.0), (1.1, 1.1), (0.9, 0.9), (1.0, jnp.inf),
                  (jnp.nan, 1.0)]:
    _, state = tx.update({"w": g * jnp.ones(3)}, state, params, loss=jnp.float32(loss))
    assert not bool(state.spike)
  assert int(state.filled) == 3
  np.testing.assert_allclose(state.losses, [1.0, 1.1, 0.9, 0.0])
  assert np.isfinite(np.asarray(state.norms)).all()


def test_only_upward_outliers_spike_and_only_what_is_watched():
  params = {"w": jnp.ones(3)}
  for watch, (loss_spike, norm_spike) in [("loss", (True, False)),
                                          (("global_norm",), (False, True)),
                                          (("loss", "global_norm"), (True, True))]:
    tx = mpscale.skip_spikes(optax.sgd(0.1), window=8, watch=watch)
    state = tx.init(params)
    for g in [1.0, 1.1, 0.9, 1.0, 1.2, 0.8, 1.0, 1.1]:
      _, state = tx.update({"w": g * jnp.ones(3)}, state, params, loss=jnp.float32(g))
    _, low = tx.update({"w": 1e-3 * jnp.ones(3)}, state, params, loss=jnp.float32(0.0))
    assert not bool(low.spike)  # a sudden drop is no spike
    _, high = tx.update({"w": 9.0 * jnp.ones(3)}, state, params, loss=jnp.float32(9.0))
    assert (bool(high.loss_spike), bool(high.norm_spike)) == (loss_spike, norm_spike)
  # Watching only the norm, no loss is needed.
  tx = mpscale.skip_spikes(optax.sgd(0.1), watch="global_norm")
  tx.update({"w": jnp.ones(3)}, tx.init(params), params)


def test_a_lasting_move_is_learned_after_reset_after_spikes():
  """The loss jumps for good at step 20: reset_after steps are skipped, the window
  starts over, the next warmup steps are applied, and the check is back on."""
  tx = mpscale.skip_spikes(optax.sgd(0.1), window=8, warmup=4, reset_after=3,
                           watch="loss")
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  rng = np.random.default_rng(0)
  spikes, filled = [], []
  for t in range(40):
    loss = (1.0 if t < 20 else 50.0) + 0.05 * rng.normal()
    if t == 35:
      loss = 5000.0
    _, state = tx.update({"w": jnp.ones(2)}, state, params, loss=jnp.float32(loss))
    spikes.append(bool(state.spike))
    filled.append(int(state.filled))
  assert np.flatnonzero(spikes).tolist() == [20, 21, 22, 35]
  assert filled[22] == 0 and filled[26] == 4  # warmed up again on the new level


def test_extra_args_reach_the_inner_transformation():
  inner, seen = helpers.recording_inner()
  tx = mpscale.skip_spikes(inner)
  params = {"w": jnp.ones(3)}
  tx.update(params, tx.init(params), params, loss=jnp.ones(()), value=jnp.ones(()))
  assert {"loss", "value"} <= set(seen)
  assert isinstance(seen["leaf_squares"], mpscale.LeafSquares)


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(window=1), ValueError, "window"),
    (dict(window=2.0), TypeError, "window"),
    (dict(threshold=0.0), ValueError, "threshold"),
    (dict(threshold=float("inf")), ValueError, "threshold"),
    (dict(window=8, warmup=9), ValueError, "warmup"),
    (dict(warmup=1), ValueError, "warmup"),
    (dict(watch=("loss", "norm")), ValueError, r"watch\[1\]"),
    (dict(watch=()), ValueError, "watch"),
    (dict(watch=("loss", "loss")), ValueError, "watch"),
    (dict(watch=3), TypeError, "watch"),
    (dict(reset_after=0), ValueError, "reset_after"),
    (dict(axis_name=3), TypeError, "axis_name"),
])
def test_bad_arguments_are_refused_by_name(kwargs, exc, name):
  with pytest.raises(exc, match=name) as err:
    mpscale.skip_spikes(optax.sgd(0.1), **kwargs)
  assert isinstance(err.value, mpscale.ArgumentError)
  assert err.value.name == name.replace("\\", "")


def test_a_watched_loss_must_be_passed_and_be_a_scalar():
  tx = mpscale.skip_spikes(optax.sgd(0.1))
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  with pytest.raises(TypeError, match="loss is missing") as err:
    jax.jit(tx.update)(params, state, params)
  assert err.value.name == "loss"
  with pytest.raises(TypeError, match="loss must be a scalar"):
    tx.update(params, state, params, loss=jnp.ones(2))
  with pytest.raises(TypeError, match="inner"):
    mpscale.skip_spikes(None)


def test_replicas_agree_on_the_window_and_the_decision():
  """Under shard_map the loss and norm are averaged over axis_name: one replica's
  spike skips the step on every replica, and every replica holds the same window."""
  replicas = 4
  mesh = Mesh(np.array(jax.devices()[:replicas]), ("data",))
  tx = mpscale.no_loss_scale(
      mpscale.skip_spikes(optax.sgd(0.1), window=8, axis_name="data"),
      axis_name="data")
  params = {"w": jnp.ones(3)}
  losses = 1.0 + 0.1 * np.random.default_rng(0).normal(size=(20, replicas))
  losses[15, 2] = 1000.0  # one replica's batch spikes

  def per_replica(params, losses):
    def body(carry, loss):
      params, state = carry
      updates, state = tx.update({"w": jnp.ones(3)}, state, params, loss=loss[0])
      carry = (optax.apply_updates(params, updates), state)
      return cast_varying(carry, ("data",)), state.skip_state.inner_state.spike
    init = cast_varying((params, tx.init(params)), ("data",))
    (params, state), spike = jax.lax.scan(body, init, losses)
    return jax.tree.map(lambda x: x[None], (params, state.skip_state, spike))

  fn = jax.jit(jax.shard_map(per_replica, mesh=mesh, in_specs=(P(), P(None, "data")),
                             out_specs=P("data")))
  params, skip, spike = fn(params, jnp.asarray(losses, jnp.float32))
  for r in range(replicas):
    assert np.flatnonzero(spike[r]).tolist() == [15]
    assert int(skip.skipped[r]) == 1
    assert helpers.bits(_at((params, skip), r)) == helpers.bits(_at((params, skip), 0))


# ---- the train step

def _bn_loss(params, batch, *, model_state):
  """A linear model that keeps a running mean of its inputs (BatchNorm-like)."""
  loss = jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
  return loss, {"mean": 0.9 * model_state["mean"] + 0.1 * jnp.mean(batch["x"], 0)}


def _batch(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(8, 3)).astype(np.float32)
  return {"x": scale * x, "y": scale * (x @ np.array([1.0, -1.0, 0.5], np.float32))}


def test_the_train_step_passes_the_loss_and_keeps_the_model_state_on_a_spike():
  tx = mpscale.dynamic_loss_scale(mpscale.skip_spikes(optax.sgd(0.01), window=8),
                                  init_scale=2.0**8)
  init, step = mpscale.make_train_step(_bn_loss, tx)
  state = init({"w": jnp.zeros(3)}, model_state={"mean": jnp.zeros(3)})
  for n in range(10):
    state, metrics = step(state, _batch(n))
    assert not bool(metrics["spike"])
  before = jax.device_get(state)
  state, metrics = step(state, _batch(99, scale=100.0))
  assert bool(metrics["spike"]) and not bool(metrics["overflow"])
  assert int(metrics["spikes"]) == int(metrics["skipped"]) == 1
  assert float(metrics["loss"]) > 1000.0
  after = jax.device_get(state)
  assert helpers.bits((before.params, before.model_state)) == helpers.bits(
      (after.params, after.model_state))
  assert float(mpscale.loss_scale_of(after.opt_state)) == 2.0**8
  state, metrics = step(state, _batch(11))
  assert not bool(metrics["spike"]) and int(metrics["consecutive_skipped"]) == 0


def test_the_train_step_refuses_skip_spikes_around_the_loss_scale():
  tx = mpscale.skip_spikes(mpscale.dynamic_loss_scale(optax.sgd(0.1)))
  init, step = mpscale.make_train_step(
      lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), tx)
  state = init({"w": jnp.zeros(3)})
  with pytest.raises(ValueError, match="optimizer: skip_spikes wraps"):
    step(state, _batch(0))


def test_the_train_step_still_takes_an_optimizer_without_extra_arguments():
  inner = mpscale.no_loss_scale(optax.sgd(0.1))
  plain = optax.GradientTransformation(inner.init, lambda u, s, p=None: inner.update(
      u, s, p))
  init, step = mpscale.make_train_step(
      lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), plain)
  state, metrics = step(init({"w": jnp.zeros(3)}), _batch(0))
  assert np.isfinite(float(metrics["loss"])) and "spike" not in metrics


# ---- a long ordinary run

def _soak_params():  # tests/integration/test_soak.py's
  rng = np.random.default_rng(0)
  return {"a": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(8,)), jnp.float32),
          "c": {"d": jnp.asarray(rng.normal(size=(4, 4)), jnp.float32)}}


def test_no_false_skip_in_10000_ordinary_steps():
  """tests/integration/test_soak.py's model and gradients (0.1 p + unit noise) under its dynamic
  loss scale, with the loss of a noisy quadratic: over 10,000 steps nothing is
  skipped; the same run with one 100x step skips that step only."""
  steps = 10_000
  tx = mpscale.dynamic_loss_scale(
      mpscale.skip_spikes(optax.chain(mpscale.global_norm_clip(1.0),
                                      optax.adamw(1e-3))),
      init_scale=2.0**10, growth_interval=50, min_scale=2.0**-4, max_scale=2.0**12)
  params = _soak_params()

  @jax.jit
  def run(spike_at):
    def body(carry, i):
      params, state = carry
      key = jax.random.fold_in(jax.random.PRNGKey(1), i)
      flat, treedef = jax.tree.flatten(params)
      residual = [0.1 * p + jax.random.normal(jax.random.fold_in(key, j), p.shape)
                  for j, p in enumerate(flat)]
      factor = jnp.where(i == spike_at, 100.0, 1.0)
      loss = 0.5 * sum(jnp.sum(r**2) for r in residual) / sum(r.size for r in residual)
      grads = [mpscale.loss_scale_of(state) * factor * r for r in residual]
      updates, state = tx.update(jax.tree.unflatten(treedef, grads), state, params,
                                 loss=factor * loss)
      return (optax.apply_updates(params, updates), state), None

    (_, state), _ = jax.lax.scan(body, (params, tx.init(params)), jnp.arange(steps))
    return state

  clean = run(-1)
  assert int(clean.skip_state.skipped) == 0
  assert int(clean.skip_state.inner_state.spikes) == 0
  assert int(clean.skip_state.inner_state.filled) == 128  # the check was on
  spiked = run(5000)
  assert int(spiked.skip_state.skipped) == int(spiked.skip_state.inner_state.spikes) == 1
