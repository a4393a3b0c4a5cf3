"""Flax NNX: an nnx.Optimizer around an mpscale wrapper, with step_metrics,
loss_scale_of and with_loss_scale taking the optimizer or its state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mpscale

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


class MLP(nnx.Module):
  def __init__(self, rngs):
    # float32 parameters, float16 compute (O2).
    self.l1 = nnx.Linear(8, 16, dtype=jnp.float16, rngs=rngs)
    self.l2 = nnx.Linear(16, 1, dtype=jnp.float16, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.tanh(self.l1(x)))


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 8)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(np.sin(x.sum(1, keepdims=True)), jnp.float32)


def _optimizer(model):
  tx = mpscale.dynamic_loss_scale(optax.adam(3e-2), init_scale=2.0**10,
                                  growth_interval=5)
  try:
    return nnx.Optimizer(model, tx, wrt=nnx.Param)
  except TypeError:  # flax < 0.11: no wrt argument
    return nnx.Optimizer(model, tx)


@nnx.jit
def _train_step(model, optimizer, x, y, poison):
  scale = mpscale.loss_scale_of(optimizer)

  def loss_fn(model):
    # The loss is scaled before the float16 backward pass.
    pred = model(x.astype(jnp.float16)).astype(jnp.float32)
    loss = jnp.mean((pred - y) ** 2)
    return scale * loss * poison, loss

  grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
  try:
    optimizer.update(model, grads)
  except TypeError:  # flax < 0.11: update(grads)
    optimizer.update(grads)
  return loss, mpscale.step_metrics(optimizer)


def test_nnx_optimizer_loop_in_float16_with_an_injected_overflow():
  model = MLP(nnx.Rngs(0))
  optimizer = _optimizer(model)
  x, y = _data()
  losses, scales, nexts, overflows = [], [], [], []
  before_poison = None
  for step in range(40):
    poison = jnp.asarray(jnp.inf if step == 20 else 1.0, jnp.float32)  # a factor
    if step == 20:
      before_poison = jax.tree.map(np.array, nnx.state(model, nnx.Param))
    loss, metrics = _train_step(model, optimizer, x, y, poison)
    # Plain arrays, not NNX Variables: usable as Python values and by device_get.
    for key in ("overflow", "loss_scale", "skipped", "global_norm"):
      assert isinstance(metrics[key], jax.Array), (key, type(metrics[key]))
    assert isinstance(jax.device_get(metrics)["skipped"], np.ndarray)
    overflows.append(bool(metrics["overflow"]))
    scales.append(float(metrics["loss_scale"]))
    nexts.append(float(metrics["next_loss_scale"]))
    losses.append(float(loss))
    if step == 20:
      after = jax.tree.map(np.array, nnx.state(model, nnx.Param))
      assert all(a.tobytes() == b.tobytes() for a, b in
                 zip(jax.tree.leaves(before_poison), jax.tree.leaves(after)))
  assert overflows[20] and sum(overflows) == 1
  assert int(metrics["skipped"]) == 1
  # The overflowed step 20 backed its scale off for step 21.
  assert nexts[20] == scales[20] / 2 == scales[21]
  assert losses[-1] < 0.5 * losses[0]  # it trains
  assert isinstance(mpscale.loss_scale_of(optimizer.opt_state), jax.Array)


def test_with_loss_scale_sets_an_nnx_optimizers_scale():
  model = MLP(nnx.Rngs(1))
  optimizer = _optimizer(model)
  assert float(mpscale.loss_scale_of(optimizer)) == 2.0**10
  assert mpscale.with_loss_scale(optimizer, 8.0) is optimizer
  assert float(mpscale.loss_scale_of(optimizer)) == 8.0
  state = mpscale.with_loss_scale(optimizer.opt_state, 4.0)
  assert float(mpscale.loss_scale_of(state)) == 4.0
  assert type(state.loss_scale) is type(optimizer.opt_state.loss_scale)
  with pytest.raises(ValueError, match="no loss-scale state"):
    mpscale.with_loss_scale({"a": jnp.zeros(())}, 1.0)
