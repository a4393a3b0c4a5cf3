"""Stochastic and stateful models through `make_train_step` and `Pipeline`: the keys
each draw uses, BatchNorm statistics across devices and micro-batches, the skip, and
Flax NNX and linen models with dropout and BatchNorm (via `mpscale.trainer.models.user`)."""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
import optax
import pytest

import mpscale
from mpscale import keys
from mpscale.trainer.models import user as models

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


def _mesh(shape, names):
  return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


def _batch(rows=32, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, 6)).astype(np.float32)
  return {"x": x, "y": (x[:, :3].sum(1) > 0).astype(np.float32)}


# ---- the keys

def _draw_loss(params, batch, *, rng, model_state):
  """Records its key's draw in the model state."""
  draw = jax.random.uniform(rng, (4,))
  return jnp.mean((batch["x"] @ params["w"]) ** 2), {"draw": draw}


def test_step_draws_from_seed_step_and_microbatch():
  init, step = mpscale.make_train_step(_draw_loss, optax.sgd(0.1), num_microbatches=2)
  state = init({"w": jnp.ones((6, 1))}, model_state={"draw": jnp.zeros(4)}, rng=7)
  draws = []
  for n in range(2):
    state, _ = step(state, _batch())
    expected = jax.random.uniform(keys.microbatch_key(
        keys.step_key(jax.random.key_data(jax.random.key(7)), n), 1), (4,))
    np.testing.assert_array_equal(state.model_state["draw"], expected)
    draws.append(np.asarray(state.model_state["draw"]))
  assert not np.array_equal(*draws)  # a new mask each step


def _uniform_loss(params, batch, *, rng):
  return jnp.sum(params["w"] * jax.random.uniform(rng, params["w"].shape))


@pytest.mark.parametrize("replicas,microbatches", [(1, 4), (4, 2)])
def test_replicas_and_microbatches_draw_their_own_keys(replicas, microbatches):
  """Each data replica's micro-batch gets fold_in(microbatch_key(rng, k), r): the
  gradient of sum(w * uniform(key)) is the mean of those draws."""
  mesh = _mesh((replicas,), ("data",)) if replicas > 1 else None
  key = jax.random.key(3)
  out = mpscale.accumulate_gradients(
      _uniform_loss, {"w": jnp.zeros(5)}, _batch(8), mesh=mesh,
      num_microbatches=microbatches, rng=key)
  draws = []
  for k in range(microbatches):
    mk = keys.microbatch_key(key, k)
    for r in range(replicas):
      draws.append(jax.random.uniform(
          keys.replica_key(mk, r) if replicas > 1 else mk, (5,)))
  np.testing.assert_allclose(out.grads["w"], np.mean(draws, axis=0), rtol=1e-6)
  assert len({tuple(np.asarray(d)) for d in draws}) == len(draws)


def test_loss_without_the_keyword_is_refused_naming_it():
  init, step = mpscale.make_train_step(
      lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1))
  state = init({"w": jnp.ones((6, 1))}, rng=0)
  with pytest.raises(TypeError, match="takes no 'rng'"):
    step(state, _batch())


def test_a_pipeline_refuses_a_model_state():
  pipe = mpscale.Pipeline(lambda p, b: b["x"], lambda p, x: x * p, lambda p, x, b:
                          jnp.mean(x), num_microbatches=2)
  init, _ = mpscale.make_train_step(pipe, optax.sgd(0.1),
                                    mesh=_mesh((1, 2), ("data", "stage")))
  with pytest.raises(ValueError, match="model_state"):
    init({"stages": jnp.ones((2, 6))}, model_state={"m": jnp.zeros(2)})


def test_model_state_is_float32_under_o3():
  init, _ = mpscale.make_train_step(_draw_loss, optax.sgd(0.1), policy="O3")
  state = init({"w": jnp.ones((6, 1))}, model_state={"draw": jnp.zeros(4, jnp.float16)},
               rng=0)
  assert state.params["w"].dtype == jnp.float16
  assert state.model_state["draw"].dtype == jnp.float32


# ---- BatchNorm statistics and the skip

def _bn_loss(params, batch, *, model_state):
  """A BatchNorm'd linear model: normalizes with the batch's statistics and keeps
  running averages (momentum 0.9)."""
  h = batch["x"] @ params["w"]
  mean, var = jnp.mean(h, 0), jnp.var(h, 0)
  out = (h - mean) / jnp.sqrt(var + 1e-5) * params["g"]
  new = {"mean": 0.9 * model_state["mean"] + 0.1 * mean,
         "var": 0.9 * model_state["var"] + 0.1 * var}
  return jnp.mean((out[:, 0] - batch["y"]) ** 2), new


def _bn_run(mesh, microbatches, batches, data_axis="data", specs=None):
  init, step = mpscale.make_train_step(
      _bn_loss, mpscale.dynamic_loss_scale(optax.adam(1e-2)), mesh=mesh,
      data_axis=data_axis, num_microbatches=microbatches, param_specs=specs)
  state = init({"w": jnp.full((6, 2), 0.3), "g": jnp.ones(2)},
               model_state={"mean": jnp.zeros(2), "var": jnp.ones(2)})
  for batch in batches:
    state, _ = step(state, batch)
  return jax.device_get(state)


def _microbatch_order(rows, shards, microbatches):
  """Rows in the order one device would need to see 8 devices' micro-batches:
  micro-batch k holds piece k of each data shard."""
  per = rows // (shards * microbatches)
  return np.concatenate([np.arange(d * rows // shards + k * per,
                                   d * rows // shards + (k + 1) * per)
                         for k in range(microbatches) for d in range(shards)])


@pytest.mark.parametrize("microbatches", [1, 2])
def test_batchnorm_statistics_on_8_devices_equal_one_device(microbatches):
  batches = [_batch(32, seed) for seed in range(3)]
  order = _microbatch_order(32, 8, microbatches)
  one = _bn_run(None, microbatches,
                [{k: v[order] for k, v in b.items()} for b in batches])
  eight = _bn_run(_mesh((8,), ("data",)), microbatches, batches)
  for name in ("mean", "var"):
    np.testing.assert_allclose(eight.model_state[name], one.model_state[name],
                               rtol=2e-6, atol=1e-7)
  np.testing.assert_allclose(eight.params["w"], one.params["w"], rtol=1e-5, atol=1e-7)
  assert not np.allclose(one.model_state["mean"], 0.0)  # the statistics moved


def test_batchnorm_statistics_with_fsdp_equal_one_device():
  mesh = _mesh((2, 4), ("data", "fsdp"))
  batches = [_batch(32, seed) for seed in range(2)]
  one = _bn_run(None, 1, batches)
  params = {"w": jnp.zeros((6, 2)), "g": jnp.zeros(2)}
  specs = mpscale.fsdp_specs(params, mesh, "fsdp")
  sharded = _bn_run(mesh, 2, batches, ("data", "fsdp"), specs)
  # With micro-batches the rows each sees follow the documented order.
  order = _microbatch_order(32, 8, 2)
  reference = _bn_run(None, 2, [{k: v[order] for k, v in b.items()} for b in batches])
  np.testing.assert_allclose(sharded.model_state["mean"],
                             reference.model_state["mean"], rtol=2e-6, atol=1e-7)
  assert not np.allclose(one.model_state["mean"], reference.model_state["mean"])


def test_overflow_leaves_params_optimizer_and_model_state_bit_identical():
  init, step = mpscale.make_train_step(
      _bn_loss, mpscale.dynamic_loss_scale(optax.adam(1e-2)), policy="O2",
      mesh=_mesh((8,), ("data",)))
  state = init({"w": jnp.full((6, 2), 0.3), "g": jnp.ones(2)},
               model_state={"mean": jnp.zeros(2), "var": jnp.ones(2)})
  state, _ = step(state, _batch())
  before = jax.device_get(state)
  bad = _batch(seed=1)
  bad["x"][3, 2] = np.inf
  state, metrics = step(state, bad)
  after = jax.device_get(state)
  assert bool(metrics["overflow"]) and int(metrics["skipped"]) == 1
  for a, b in zip(jax.tree_util.tree_leaves((before.params, before.model_state)),
                  jax.tree_util.tree_leaves((after.params, after.model_state))):
    np.testing.assert_array_equal(a, b)
  inner = lambda s: mpscale.SkipNonfiniteState.inner_state.__get__(  # noqa: E731
      s.opt_state.skip_state)
  for a, b in zip(jax.tree_util.tree_leaves(inner(before)),
                  jax.tree_util.tree_leaves(inner(after))):
    np.testing.assert_array_equal(a, b)
  state, metrics = step(state, _batch(seed=2))  # and the next clean step applies
  assert not bool(metrics["overflow"])
  assert not np.array_equal(jax.device_get(state.model_state["mean"]),
                            after.model_state["mean"])


# ---- Flax models with dropout and BatchNorm

class _NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(6, 32, rngs=rngs)
    self.bn = nnx.BatchNorm(32, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)
    self.l2 = nnx.Linear(32, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))[:, 0]


class _LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    h = nn.BatchNorm(use_running_average=not train)(nn.Dense(32)(x))
    h = nn.Dropout(0.2, deterministic=not train)(nn.relu(h))
    return nn.Dense(1)(h)[:, 0]


def _nnx_loss(model, batch):
  err = (model(batch["x"]).astype(jnp.float32) - batch["y"]) ** 2
  return jnp.sum(err), batch["x"].shape[0]


def _linen_loss(model, batch, train):
  err = (model(batch["x"], train).astype(jnp.float32) - batch["y"]) ** 2
  return jnp.sum(err), batch["x"].shape[0]


def _flax_model(kind):
  if kind == "nnx":
    return models.as_model(_NnxNet(nnx.Rngs(0)), _nnx_loss)
  return models.as_model(_LinenNet(), _linen_loss, _batch(8))


LAYOUTS = {
    "1 device": (None, 1, "data"),
    "2 devices": ((2,), 1, "data"),
    "8 devices, 2 micro-batches": ((8,), 2, "data"),
    "data 2 x fsdp 4": ((2, 4), 1, ("data", "fsdp")),
}


@pytest.mark.parametrize("kind", ["nnx", "linen"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flax_dropout_batchnorm_models_train(kind, layout):
  shape, microbatches, data_axis = LAYOUTS[layout]
  model = _flax_model(kind)
  assert model.stochastic and model.init_state is not None
  mesh = None if shape is None else _mesh(
      shape, ("data",) if len(shape) == 1 else ("data", "fsdp"))
  params = model.init(None)
  specs = (mpscale.fsdp_specs(params, mesh, "fsdp")
           if mesh is not None and "fsdp" in mesh.axis_names else None)
  init, step = mpscale.make_train_step(
      model.loss_fn, mpscale.dynamic_loss_scale(optax.adam(3e-2)), policy="O2",
      mesh=mesh, data_axis=data_axis, num_microbatches=microbatches,
      per_token_loss=True, param_specs=specs)
  state = init(params, model_state=model.init_state(None), rng=0)
  batch = _batch(64)
  losses = []
  for _ in range(25):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
  stats = jax.tree_util.tree_leaves(state.model_state)
  assert all(x.dtype == jnp.float32 for x in stats)
  assert any(not np.allclose(x, 0) and not np.allclose(x, 1) for x in stats)
  # Evaluation: inference mode, deterministic, the running averages.
  evaluate = jax.jit(lambda s, b: model.evaluate(
      s.params, b, model_state=s.model_state))
  first, second = evaluate(state, batch), evaluate(state, batch)
  np.testing.assert_array_equal(first[0], second[0])


# ---- dropout inside pipeline stages

def _dropout(x, rng, rate=0.5):
  return jnp.where(jax.random.bernoulli(rng, 1 - rate, x.shape), x / (1 - rate), 0.0)


def _stochastic_pipeline(schedule, recompute="none"):
  return mpscale.Pipeline(
      lambda p, b, rng: _dropout(b["x"] @ p["embed"], rng),
      lambda p, x, rng: _dropout(jnp.tanh(x @ p["w"]), rng),
      lambda p, x, b, rng: (jnp.sum((_dropout(x, rng)[:, 0] - b["y"]) ** 2),
                            jnp.asarray(x.shape[0], jnp.float32)),
      num_microbatches=4, schedule=schedule, recompute=recompute)


@pytest.mark.parametrize("schedule, recompute", [
    ("gpipe", "none"), ("1f1b", "none"), ("1f1b", "full"), ("zb_h1", "selective")])
def test_pipeline_dropout_equals_the_unpipelined_model(schedule, recompute):
  """A layer draws the same mask on whichever stage it runs: pipelined gradients
  equal the unpipelined model's, accumulated with the same keys (also when the
  backward recomputes a layer from its kept input and key)."""
  pipe = _stochastic_pipeline(schedule, recompute)
  init_keys = jax.random.split(jax.random.key(0), 2)
  params = {"embed": jax.random.normal(init_keys[0], (6, 8)) * 0.5,
            "stages": {"w": jax.random.normal(init_keys[1], (4, 8, 8)) * 0.5}}
  mesh = _mesh((2, 4), ("data", "stage"))
  batch = _batch(32)
  rng = jax.random.key(11)
  piped = jax.jit(lambda p, b: pipe.value_and_grad(
      p, b, mesh=mesh, per_token_loss=True, rng=rng))(params, batch)
  # the reference compiled once, for both keys (eagerly its ops compile one by one)
  unpiped = jax.jit(lambda p, b, rng: mpscale.accumulate_gradients(
      pipe.apply, p, b, num_microbatches=4, per_token_loss=True,
      mesh=_mesh((2,), ("data",)), rng=rng))
  reference = unpiped(params, batch, rng)
  np.testing.assert_allclose(piped.loss, reference.loss, rtol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(piped.grads),
                  jax.tree_util.tree_leaves(reference.grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  without = unpiped(params, batch, jax.random.key(12))
  assert not np.allclose(without.loss, reference.loss)  # the masks matter


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_pipeline_step_with_dropout_trains():
  pipe = _stochastic_pipeline("gpipe")
  mesh = _mesh((2, 2), ("data", "stage"))
  init, step = mpscale.make_train_step(
      pipe, mpscale.dynamic_loss_scale(optax.adam(1e-2)), mesh=mesh,
      per_token_loss=True)
  init_keys = jax.random.split(jax.random.key(0), 2)
  state = init({"embed": jax.random.normal(init_keys[0], (6, 8)) * 0.5,
                "stages": {"w": jax.random.normal(init_keys[1], (4, 8, 8)) * 0.3}},
               rng=1)
  losses = []
  for _ in range(20):
    state, metrics = step(state, _batch(32))
    losses.append(float(metrics["loss"]))
  assert np.mean(losses[-5:]) < np.mean(losses[:5])
  assert state.rng is not None and int(state.step) == 20


# ---- FP8 scaling state (an _overwrite_with_gradient collection)

FP8_RECIPE = mpscale.make_fp8_recipe("delayed", history_len=16)


def _fp8_loss(params, batch, *, model_state):
  """One FP8 product; the state passes through (its gradient is its update)."""
  state = model_state["_overwrite_with_gradient"]["dense"]
  h = mpscale.fp8_dot_general(batch["x"], params["w"], (((1,), (0,)), ((), ())),
                              state, FP8_RECIPE)
  return jnp.mean((h[:, 0] + params["b"] - batch["y"]) ** 2), model_state


def _fp8_params():
  return {"w": jnp.full((6, 2), 0.3), "b": jnp.zeros(())}


def _fp8_run(mesh, microbatches, batches, tx=None):
  init, step = mpscale.make_train_step(
      _fp8_loss, tx or optax.adam(1e-2), mesh=mesh, num_microbatches=microbatches)
  state = init(_fp8_params(), model_state={
      "_overwrite_with_gradient": {"dense": mpscale.fp8_state(FP8_RECIPE)}})
  for batch in batches:
    state, _ = step(state, batch)
  return jax.device_get(state)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_fp8_state_on_8_devices_equals_one_device(microbatches):
  """Replicas record the global tensors' amaxes (GSPMD reduces them), so 8 devices
  keep the state one device keeps; each micro-batch's amaxes enter the history."""
  batches = [_batch(32, seed) for seed in range(3)]
  order = _microbatch_order(32, 8, microbatches)
  one = _fp8_run(None, microbatches,
                 [{k: v[order] for k, v in b.items()} for b in batches])
  eight = _fp8_run(_mesh((8,), ("data",)), microbatches, batches)
  for a, b in zip(jax.tree_util.tree_leaves(eight.model_state),
                  jax.tree_util.tree_leaves(one.model_state)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  state = eight.model_state["_overwrite_with_gradient"]["dense"]
  for meta in state:  # history_len 16 > 3 steps x 2: every entry written is kept
    assert np.count_nonzero(meta.amax_history) == 3 * microbatches
  # The newest entries are the last step's: its micro-batches' input amaxes, the
  # last micro-batch's at [0], the one before at [-1] (TE's roll moves [0] to the
  # end); the scale comes from the history (delayed).
  x = batches[-1]["x"][order].reshape(microbatches, -1, 6)
  expected = np.abs(x).max(axis=(1, 2))[::-1]
  newest = state.lhs.amax_history[np.arange(0, -microbatches, -1)]
  np.testing.assert_array_equal(newest, expected)
  np.testing.assert_allclose(state.lhs.scale, 448.0 / state.lhs.amax_history.max(),
                             rtol=1e-6)
  assert float(state.rhs.amax_history[0]) != 0.3  # the kernel trained


def test_an_overflow_leaves_the_fp8_state_bit_identical():
  """The overflowed step's amax (inf) is never committed: a skipped step keeps the
  state as it was, bit for bit, and the next clean step records again. (An inf in
  an FP8 product's input saturates, to 448: the overflow comes from the target,
  through the bias's gradient, and the output gradient's amax is inf.)"""
  init, step = mpscale.make_train_step(
      _fp8_loss, mpscale.dynamic_loss_scale(optax.adam(1e-2)), policy="bf16",
      mesh=_mesh((8,), ("data",)), num_microbatches=2)
  state = init(_fp8_params(), model_state={
      "_overwrite_with_gradient": {"dense": mpscale.fp8_state(FP8_RECIPE)}})
  state, metrics = step(state, _batch())
  assert int(metrics["skipped"]) == 0
  before = jax.device_get(state.model_state)
  bad = _batch(seed=1)
  bad["y"][3] = np.inf
  state, metrics = step(state, bad)
  assert bool(metrics["overflow"]) and int(metrics["skipped"]) == 1
  after = jax.device_get(state.model_state)
  for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
    np.testing.assert_array_equal(a, b)
  state, metrics = step(state, _batch(seed=2))
  assert not bool(metrics["overflow"])
  history = jax.device_get(
      state.model_state["_overwrite_with_gradient"]["dense"].lhs.amax_history)
  assert np.count_nonzero(history) == 4 and np.all(np.isfinite(history))


def test_an_fp8_state_no_product_reaches_keeps_its_value():
  """A state outside the loss's graph gets a zero gradient: it is kept, not zeroed."""
  def loss(params, batch, *, model_state):
    return jnp.mean((batch["x"] @ params["w"])[:, 0] ** 2), model_state

  state0 = {"_overwrite_with_gradient": {"dense": mpscale.fp8_state(FP8_RECIPE)},
            "other": jnp.ones(2)}
  init, step = mpscale.make_train_step(loss, optax.sgd(0.1))
  state, _ = step(init({"w": jnp.ones((6, 2))}, model_state=state0), _batch())
  for a, b in zip(jax.tree_util.tree_leaves(state.model_state),
                  jax.tree_util.tree_leaves(state0)):
    np.testing.assert_array_equal(a, b)
