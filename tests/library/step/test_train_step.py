"""Tests for mpscale.step on 8 fake CPU devices (see conftest.py)."""

import warnings

import chex
import flax.linen as nn
from flax import nnx
from flax.training import train_state as flax_train_state
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
import optax
import pytest

import mpscale
from tests import helpers

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)

BATCH = 32


def mlp_init(seed=0, sizes=(8, 16, 4)):
  rng = np.random.RandomState(seed)
  return {f"layer{i}": {
      "kernel": jnp.asarray(rng.randn(a, b) / np.sqrt(a), jnp.float32),
      "bias": jnp.asarray(0.1 * rng.randn(b), jnp.float32)}
          for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}


def mlp_apply(params, x):
  n = len(params)
  for i in range(n):
    layer = params[f"layer{i}"]
    x = x @ layer["kernel"] + layer["bias"]
    if i < n - 1:
      x = jnp.tanh(x)
  return x


def mse_loss(params, batch):
  return jnp.mean((mlp_apply(params, batch["x"]) - batch["y"]) ** 2)


def make_batch(seed=1, rows=BATCH):
  rng = np.random.RandomState(seed)
  x = rng.randn(rows, 8).astype(np.float32)
  return {"x": x, "y": np.tanh(x[:, :4] * 2).astype(np.float32)}


def adamw_chain():
  return mpscale.dynamic_loss_scale(
      optax.chain(mpscale.global_norm_clip(1.0), optax.adamw(1e-2)),
      init_scale=2.0**10, growth_interval=2)


def mesh_of(n, axis="data"):
  return Mesh(np.array(jax.devices()[:n]), (axis,))


def run(step, state, batches):
  losses = []
  for batch in batches:
    state, metrics = step(state, batch)
    losses.append(metrics["loss"])
  return jax.device_get(state), np.asarray(jax.device_get(losses))


def batches(n=5):
  return [make_batch(seed) for seed in range(n)]


def assert_close(a, b, tol=1e-6):
  helpers.assert_close(a, b, tol)


@pytest.fixture(scope="module")
def single_device_run():
  init, step = mpscale.make_train_step(mse_loss, adamw_chain())
  return run(step, init(mlp_init()), batches())


# ---------------------------------------------------------------- data parallel


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_data_parallel_matches_single_device(devices, single_device_run):
  init, step = mpscale.make_train_step(mse_loss, adamw_chain(), mesh=mesh_of(devices))
  state = init(mlp_init())
  assert state.params["layer0"]["kernel"].sharding.is_fully_replicated
  got_state, got_losses = run(step, state, batches())
  want_state, want_losses = single_device_run
  assert_close(got_losses, want_losses)
  assert_close(got_state, want_state)


@pytest.mark.parametrize("shape, axes, data_axis", [
    ((2, 2), ("data", "model"), "data"),
    ((2, 4), ("replica", "data"), ("replica", "data")),
])
def test_multi_axis_meshes_match_single_device(shape, axes, data_axis,
                                               single_device_run):
  mesh = Mesh(np.array(jax.devices()[:np.prod(shape)]).reshape(shape), axes)
  init, step = mpscale.make_train_step(mse_loss, adamw_chain(), mesh=mesh,
                                       data_axis=data_axis, shard_optimizer_state=True)
  got_state, got_losses = run(step, init(mlp_init()), batches())
  assert_close(got_losses, single_device_run[1])
  assert_close(got_state, single_device_run[0])


@pytest.mark.parametrize("microbatches", [4, 8])
def test_microbatches_match_one_batch(microbatches, single_device_run):
  init, step = mpscale.make_train_step(mse_loss, adamw_chain(),
                                       num_microbatches=microbatches)
  got_state, got_losses = run(step, init(mlp_init()), batches())
  assert_close(got_losses, single_device_run[1])
  assert_close(got_state, single_device_run[0])


def test_microbatches_on_a_mesh_match_one_batch(single_device_run):
  init, step = mpscale.make_train_step(mse_loss, adamw_chain(), mesh=mesh_of(4),
                                       num_microbatches=2)
  got_state, got_losses = run(step, init(mlp_init()), batches())
  assert_close(got_losses, single_device_run[1])
  assert_close(got_state, single_device_run[0])


def test_microbatches_on_a_mesh_all_reduce_once():
  init, step = mpscale.make_train_step(mse_loss, adamw_chain(), mesh=mesh_of(4),
                                       num_microbatches=4)
  state = init(mlp_init())
  hlo = step.lower(state, make_batch()).compile().as_text()
  # Computations are printed callees first: the loop body, then the entry.
  body = hlo[:hlo.index("ENTRY")]
  assert "all-reduce(" not in body
  assert "all-reduce(" in hlo[hlo.index("ENTRY"):]


def test_sharded_optimizer_state_matches_and_is_sharded(single_device_run):
  traces = []

  def loss_fn(params, batch):
    traces.append(None)
    return mse_loss(params, batch)

  init, step = mpscale.make_train_step(loss_fn, adamw_chain(), mesh=mesh_of(8),
                                       shard_optimizer_state=True)
  state = init(mlp_init())
  sharded = 0
  for leaf in jax.tree_util.tree_leaves(state.opt_state):
    divisible = any(n % 8 == 0 for n in leaf.shape)
    assert leaf.sharding.is_fully_replicated is not divisible, (leaf.shape,
                                                                leaf.sharding)
    sharded += divisible
  assert sharded == 6  # mu and nu of both kernels and of the 16-wide bias
  for leaf in jax.tree_util.tree_leaves(state.params):
    assert leaf.sharding.is_fully_replicated

  state, metrics = step(state, make_batch(0))
  traced_once = len(traces)
  mu = state.opt_state.skip_state.inner_state[1][0].mu["layer0"]["kernel"]  # [8, 16]
  assert mu.addressable_shards[0].data.shape == (8, 2)
  assert state.params["layer0"]["kernel"].sharding.is_fully_replicated

  got_state, got_losses = run(step, state, batches()[1:])
  assert len(traces) == traced_once  # the step's output state needs no new compile
  assert_close(np.concatenate([[metrics["loss"]], got_losses]), single_device_run[1])
  assert_close(got_state, single_device_run[0])


# ---------------------------------------------------------------- per-token loss


def token_batch(seed=3, rows=16, tokens=6):
  rng = np.random.RandomState(seed)
  x = rng.randn(rows, tokens, 8).astype(np.float32)
  y = rng.randn(rows, tokens, 4).astype(np.float32)
  # Uneven: row r has r % 7 real tokens (some rows none), so the micro-batches and
  # replicas hold very different token counts.
  mask = (np.arange(tokens)[None, :] < (np.arange(rows) % 7)[:, None])
  return {"x": x, "y": y, "mask": mask.astype(np.float32)}


def token_loss(params, batch):
  per_token = jnp.sum((mlp_apply(params, batch["x"]) - batch["y"]) ** 2, axis=-1)
  return jnp.sum(per_token * batch["mask"]), jnp.sum(batch["mask"])


def reference_token_grads(params, batch):
  def mean_loss(p):
    loss_sum, tokens = token_loss(p, batch)
    return loss_sum / tokens
  return jax.value_and_grad(mean_loss)(params)


@pytest.mark.parametrize("mesh", [None, "zero1"])
def test_init_of_shapes_is_the_state_it_would_place_allocating_nothing(mesh):
  m = mesh_of(8) if mesh else None
  init, step = mpscale.make_train_step(mse_loss, mpscale.dynamic_loss_scale(
      adamw_chain()), mesh=m, shard_optimizer_state=mesh is not None)
  shapes = jax.eval_shape(mlp_init)
  abstract = init(shapes)
  real = init(mlp_init())
  assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure(real)
  for a, r in zip(jax.tree_util.tree_leaves(abstract), jax.tree_util.tree_leaves(real)):
    assert isinstance(a, jax.ShapeDtypeStruct)
    assert (a.shape, a.dtype) == (r.shape, r.dtype)
    if m is None:
      assert a.sharding is None
    else:
      assert a.sharding.is_equivalent_to(r.sharding, r.ndim), (a.sharding, r.sharding)
  # Enough to compile the step ahead of time: the same program as the real state's.
  batch = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), make_batch(0))
  compiled = step.lower(abstract, batch).compile()
  assert compiled.as_text() == step.lower(real, make_batch(0)).compile().as_text()


@pytest.mark.parametrize("devices, microbatches", [(1, 1), (1, 4), (4, 1), (2, 4)])
def test_per_token_gradient_is_the_full_batch_gradient(devices, microbatches):
  params, batch = mlp_init(), token_batch()
  want_loss, want_grads = reference_token_grads(params, batch)
  mesh = mesh_of(devices) if devices > 1 else None

  @jax.jit
  def grads_of(p, b):
    return mpscale.accumulate_gradients(
        token_loss, p, b, num_microbatches=microbatches, per_token_loss=True,
        mesh=mesh)

  if mesh is not None:
    batch = jax.device_put(batch, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("data")))
  grads, loss, tokens = grads_of(params, batch)
  assert int(tokens) == int(token_batch()["mask"].sum())
  assert_close(loss, want_loss)
  assert_close(grads, want_grads)


def test_per_token_step_applies_the_full_batch_gradient():
  params, batch = mlp_init(), token_batch()
  want_loss, want_grads = reference_token_grads(params, batch)
  init, step = mpscale.make_train_step(
      token_loss, optax.sgd(1.0), mesh=mesh_of(4), num_microbatches=2,
      per_token_loss=True, donate=False)
  state = init(params)
  new_state, metrics = step(state, batch)
  applied = jax.tree_util.tree_map(lambda a, b: a - b, state.params, new_state.params)
  assert_close(applied, want_grads)
  assert_close(metrics["loss"], want_loss)
  assert int(metrics["num_tokens"]) == int(batch["mask"].sum())


# ---------------------------------------------------------------- overflow


def bits(x):
  x = np.asarray(x)
  return x.view(np.dtype(f"u{x.dtype.itemsize}"))


@pytest.mark.parametrize("microbatches", [1, 2])
def test_nan_on_one_replica_skips_everywhere(microbatches):
  init, step = mpscale.make_train_step(mse_loss, adamw_chain(), mesh=mesh_of(8),
                                       num_microbatches=microbatches)
  state, _ = step(init(mlp_init()), make_batch(0))
  before = jax.device_get(state)
  bad = make_batch(1)
  bad["x"][13, 2] = np.nan  # rows 12..15 live on device 3

  state, metrics = step(state, bad)
  assert bool(metrics["overflow"]) and bool(metrics["nan"])
  assert int(metrics["skipped"]) == 1
  assert float(metrics["loss_scale"]) == float(before.opt_state.loss_scale)
  assert float(mpscale.loss_scale_of(state.opt_state)) == float(
      before.opt_state.loss_scale) / 2
  for new, old in zip(jax.tree_util.tree_leaves(state.params),
                      jax.tree_util.tree_leaves(before.params)):
    shards = [bits(s.data) for s in new.addressable_shards]
    assert len(shards) == 8
    for shard in shards:
      np.testing.assert_array_equal(shard, bits(old))
  chex.assert_trees_all_equal(jax.device_get(state.opt_state.skip_state.inner_state),
                              before.opt_state.skip_state.inner_state)

  state, metrics = step(state, make_batch(2))
  assert not bool(metrics["overflow"])
  assert int(metrics["consecutive_skipped"]) == 0


# ---------------------------------------------------------------- precision


TINY = 1e-6  # fp16 gradients of a loss this small flush to zero without scaling


class TeacherMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.tanh(nn.Dense(32)(x)))


def tiny_loss(model, policy):
  def loss_fn(params, batch):
    x = policy.cast_to_compute(batch["x"])
    out = policy.cast_to_output(model.apply({"params": params}, x))
    return TINY * jnp.mean((out - batch["y"]) ** 2)
  return loss_fn


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_fp16_with_dynamic_scaling_matches_fp32_and_without_it_stalls():
  rng = np.random.RandomState(0)
  x = rng.randn(64, 8).astype(np.float32)
  batch = {"x": x, "y": np.tanh(x @ rng.randn(8, 4)).astype(np.float32)}
  model = TeacherMLP()
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  fp32 = mpscale.make_policy("O0")
  fp16 = mpscale.make_policy("params=float32,compute=float16,output=float32")
  adam = lambda: optax.adam(1e-2, eps=1e-20)  # gradients are ~1e-8

  def train(policy, tx, steps=40):
    init, step = mpscale.make_train_step(tiny_loss(model, policy), tx, policy=policy)
    state = init(params)
    for _ in range(steps):
      state, metrics = step(state, batch)
    assert state.params["Dense_0"]["kernel"].dtype == jnp.float32  # master params
    return float(metrics["loss"]) / TINY, metrics

  start = float(tiny_loss(model, fp32)(params, batch)) / TINY
  fp32_loss, _ = train(fp32, adam())
  scaled_loss, metrics = train(fp16, mpscale.dynamic_loss_scale(adam(),
                                                                growth_interval=10))
  with pytest.warns(UserWarning, match="no loss scaling"):
    unscaled_loss, _ = train(fp16, adam())

  assert fp32_loss < 0.5 * start
  assert abs(scaled_loss - fp32_loss) < 0.03 * fp32_loss
  assert float(metrics["loss_scale"]) > 2.0**15
  assert unscaled_loss > 0.9 * start  # the float16 gradients were all zero


def test_compute_cast_and_keep_fp32_reach_the_loss_function():
  seen = {}

  def loss_fn(params, batch):
    seen.update(jax.tree_util.tree_map(lambda p: p.dtype, params))
    return mse_loss(params, batch)

  init, step = mpscale.make_train_step(
      loss_fn, mpscale.dynamic_loss_scale(optax.sgd(0.1)), policy="O2")
  state, metrics = step(init(mlp_init()), make_batch())
  assert seen["layer0"]["kernel"] == jnp.float16
  assert seen["layer0"]["bias"] == jnp.float32
  assert state.params["layer0"]["kernel"].dtype == jnp.float32
  assert float(metrics["loss_scale"]) == 2.0**15


def test_float16_master_params_stay_float16():
  init, step = mpscale.make_train_step(
      mse_loss, mpscale.dynamic_loss_scale(optax.adam(1e-3)), policy="O3")
  state = init(mlp_init())
  assert state.params["layer0"]["kernel"].dtype == jnp.float16
  for batch in batches(3):
    state, metrics = step(state, batch)
  assert state.params["layer0"]["kernel"].dtype == jnp.float16
  assert np.isfinite(float(metrics["loss"]))


# ---------------------------------------------------------------- flax


def test_linen_model_and_flax_train_state():
  model = TeacherMLP()
  batch = make_batch()
  params = model.init(jax.random.PRNGKey(1), batch["x"])["params"]

  def loss_fn(p, b):
    return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

  @jax.jit
  def flax_step(ts, b):
    return ts.apply_gradients(grads=jax.grad(loss_fn)(ts.params, b))

  ts = flax_train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adam(1e-2))
  ts = flax_step(ts, batch)

  init, step = mpscale.make_train_step(loss_fn, ts.tx, mesh=mesh_of(2))
  state = init(ts)
  assert int(state.step) == 1
  assert_close(jax.device_get(state.opt_state.skip_state.inner_state),
               jax.device_get(ts.opt_state))
  for b in batches(3):
    state, _ = step(state, b)
    ts = flax_step(ts, b)
  assert int(state.step) == int(ts.step) == 4
  assert_close(jax.device_get(state.params), jax.device_get(ts.params))

  same = mpscale.TrainState.from_flax(ts)
  assert same.params is ts.params and int(same.step) == 4


def test_nnx_model_through_split_and_merge():
  model = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.LayerNorm(
      16, rngs=nnx.Rngs(0)), nnx.Linear(16, 4, rngs=nnx.Rngs(1)))
  graphdef, params = nnx.split(model, nnx.Param)

  def loss_fn(p, b):
    return jnp.mean((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2)

  tx = optax.adam(1e-2)
  init, step = mpscale.make_train_step(loss_fn, tx, mesh=mesh_of(4),
                                       num_microbatches=2)
  state = init(params)
  want, opt_state = params, tx.init(params)

  @jax.jit
  def reference_step(p, o, b):
    updates, o = tx.update(jax.grad(loss_fn)(p, b), o, p)
    return optax.apply_updates(p, updates), o

  for b in batches(3):
    state, metrics = step(state, b)
    want, opt_state = reference_step(want, opt_state, b)
  assert_close(jax.device_get(state.params), jax.device_get(want))
  nnx.update(model, state.params)  # back into the module
  assert np.isfinite(float(metrics["loss"]))


# ---------------------------------------------------------------- metrics, state


def test_metrics_are_device_arrays_with_the_scale_used():
  tx = mpscale.dynamic_loss_scale(
      optax.inject_hyperparams(optax.adam)(learning_rate=3e-3), init_scale=8.0,
      growth_interval=1)
  init, step = mpscale.make_train_step(mse_loss, tx)
  state, metrics = step(init(mlp_init()), make_batch())
  expected = {"loss", "overflow", "nan", "inf", "loss_scale", "next_loss_scale",
              "learning_rate",
              "global_norm", "group_norms", "group_sizes", "skipped",
              "consecutive_skipped", "num_tokens"}
  assert set(metrics) == expected
  assert all(isinstance(v, jax.Array) for v in jax.tree_util.tree_leaves(metrics))
  assert float(metrics["loss_scale"]) == 8.0  # the scale this step used
  assert float(mpscale.loss_scale_of(state.opt_state)) == 16.0  # the next one
  assert float(metrics["next_loss_scale"]) == 16.0
  # step_metrics of the new state says the same: one meaning of loss_scale.
  assert float(mpscale.step_metrics(state.opt_state)["loss_scale"]) == 8.0
  assert float(metrics["learning_rate"]) == pytest.approx(3e-3)
  assert int(metrics["num_tokens"]) == BATCH
  assert set(metrics["group_norms"]) == {"layer0", "layer1"}
  assert_close(metrics["loss"], mse_loss(mlp_init(), make_batch()))


def test_plain_optimizer_is_wrapped_in_no_loss_scale():
  init, step = mpscale.make_train_step(mse_loss, optax.sgd(0.1))
  state = init(mlp_init())
  assert isinstance(state.opt_state, mpscale.LossScaleState)
  bad = make_batch()
  bad["y"][0, 0] = np.inf
  state, metrics = step(state, bad)
  assert bool(metrics["overflow"]) and int(metrics["skipped"]) == 1
  chex.assert_trees_all_equal(jax.device_get(state.params),
                              jax.device_get(init(mlp_init()).params))
  assert int(state.step) == 1


def test_donation_and_checkpointable_state():
  init, step = mpscale.make_train_step(mse_loss, optax.sgd(0.1))
  state = init(mlp_init())
  new_state, _ = step(state, make_batch())
  assert state.params["layer0"]["kernel"].is_deleted()
  restored = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(new_state),
      [np.asarray(x) for x in jax.tree_util.tree_leaves(new_state)])
  placed = init(restored)  # a restored TrainState is taken as it is
  chex.assert_trees_all_equal(jax.device_get(placed), jax.device_get(new_state))


# ---------------------------------------------------------------- errors


def test_batch_not_divisible_by_replicas_times_microbatches():
  init, step = mpscale.make_train_step(mse_loss, optax.sgd(0.1), mesh=mesh_of(4),
                                       num_microbatches=2)
  state = init(mlp_init())
  with pytest.raises(ValueError, match=r"leaf 'x' \(12\) is not divisible by "
                     r"data-parallel size \(4\) x num_microbatches \(2\) = 8"):
    step(state, make_batch(rows=12))


def test_mesh_without_the_data_axis():
  with pytest.raises(ValueError, match="no data axis 'data'"):
    mpscale.make_train_step(mse_loss, optax.sgd(0.1), mesh=mesh_of(2, "batch"))
  init, step = mpscale.make_train_step(mse_loss, optax.sgd(0.1),
                                       mesh=mesh_of(2, "batch"), data_axis="batch")
  step(init(mlp_init()), make_batch())


@pytest.mark.parametrize("per_token, returns", [
    (False, lambda loss, n: loss * jnp.ones(3)),
    (False, lambda loss, n: (loss, n)),
    (True, lambda loss, n: loss),
    (True, lambda loss, n: (loss, n, n)),
])
def test_loss_fn_with_the_wrong_structure(per_token, returns):
  def loss_fn(params, batch):
    return returns(mse_loss(params, batch), jnp.sum(batch["x"] > 0))

  init, step = mpscale.make_train_step(loss_fn, optax.sgd(0.1),
                                       per_token_loss=per_token)
  with pytest.raises(TypeError, match="loss_fn"):
    step(init(mlp_init()), make_batch())


def test_build_time_argument_errors():
  with pytest.raises(ValueError, match="needs a mesh"):
    mpscale.make_train_step(mse_loss, optax.sgd(0.1), shard_optimizer_state=True)
  with pytest.raises(ValueError, match="num_microbatches"):
    mpscale.make_train_step(mse_loss, optax.sgd(0.1), num_microbatches=0)
  with pytest.raises(TypeError, match="optimizer"):
    mpscale.make_train_step(mse_loss, lambda g: g)
  with pytest.raises(ValueError, match="unknown policy"):
    mpscale.make_train_step(mse_loss, optax.sgd(0.1), policy="O7")


def test_fp16_policy_without_loss_scaling_warns():
  init, _ = mpscale.make_train_step(mse_loss, optax.sgd(0.1), policy="O1")
  with pytest.warns(UserWarning, match="no loss scaling"):
    init(mlp_init())
  init, _ = mpscale.make_train_step(
      mse_loss, mpscale.dynamic_loss_scale(optax.sgd(0.1)), policy="O1")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    init(mlp_init())


def test_mismatched_opt_state_is_rejected():
  init, step = mpscale.make_train_step(mse_loss, optax.adam(0.1))
  wrong = mpscale.TrainState(mlp_init(), optax.sgd(0.1, momentum=0.9).init(mlp_init()),
                             jnp.zeros((), jnp.int32))
  with pytest.raises(ValueError, match="does not match"):
    init(wrong)
  with pytest.raises(ValueError, match="does not match"):
    step(wrong, make_batch())


def test_init_rejects_a_non_finite_parameter():
  params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.array([0.0, jnp.inf])}}
  init, _ = mpscale.make_train_step(lambda p, b: jnp.sum(p["dense"]["kernel"]),
                                    optax.sgd(0.1))
  with pytest.raises(ValueError, match="dense/bias"):
    init(params)
