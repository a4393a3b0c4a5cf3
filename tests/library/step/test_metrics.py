"""Tests for mpscale.step.step_metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpscale

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)

KEYS = {"loss_scale", "next_loss_scale", "overflow", "nan", "inf", "skipped", "consecutive_skipped",
        "global_norm", "group_norms", "group_sizes"}


def _params():
  return {"enc": {"w": jnp.ones((3, 4))}, "dec": {"w": jnp.ones((4, 2)),
                                                   "b": jnp.zeros((2,))}}


def test_metrics_of_a_clean_step():
  sched = optax.cosine_decay_schedule(1e-2, 100)
  tx = mpscale.dynamic_loss_scale(
      optax.chain(mpscale.global_norm_clip(1.0, norm_groups=2),
                  optax.inject_hyperparams(optax.adamw)(learning_rate=sched)),
      init_scale=16.0)
  params = _params()
  grads = jax.tree.map(lambda x: jnp.full(x.shape, 2.0), params)
  state = tx.init(params)
  _, state = jax.jit(tx.update)(jax.tree.map(lambda g: g * 16.0, grads), state, params)
  m = jax.jit(mpscale.step_metrics)(state)
  assert set(m) == KEYS | {"learning_rate"}
  # The names, in order (a jitted call's dict comes back sorted), are StepMetrics'
  # fields, the optional ones this optimizer does not record left out: declared
  # there once.
  assert tuple(mpscale.step_metrics(state)) == tuple(
      f for f in mpscale.step.StepMetrics._fields if f in m)
  np.testing.assert_allclose(m["global_norm"], mpscale.global_norm(grads), rtol=1e-6)
  np.testing.assert_allclose(m["learning_rate"], sched(0), rtol=1e-6)
  # The clip's depth-2 groups are the ones reported.
  assert set(m["group_norms"]) == {"enc/w", "dec/w", "dec/b"}
  np.testing.assert_allclose(m["group_norms"]["dec/w"], np.sqrt(8 * 4.0), rtol=1e-6)
  assert int(m["group_sizes"]["dec/b"]) == 2
  assert float(m["loss_scale"]) == 16.0 and not bool(m["overflow"])
  assert float(m["next_loss_scale"]) == float(mpscale.loss_scale_of(state))


def test_skipped_step_reports_its_own_norms():
  tx = mpscale.dynamic_loss_scale(
      optax.chain(mpscale.global_norm_clip(1.0), optax.sgd(1.0)), init_scale=4.0)
  params = _params()
  state = tx.init(params)
  grads = jax.tree.map(lambda x: jnp.full(x.shape, 4.0), params)
  _, state = tx.update(grads, state, params)
  grads["enc"]["w"] = grads["enc"]["w"].at[0, 0].set(jnp.nan)
  grads["dec"]["w"] = grads["dec"]["w"] * 3.0
  _, state = tx.update(grads, state, params)
  m = mpscale.step_metrics(state)
  assert bool(m["overflow"]) and bool(m["nan"]) and int(m["skipped"]) == 1
  assert np.isnan(m["group_norms"]["enc"])
  np.testing.assert_allclose(m["group_norms"]["dec"], np.sqrt(8 * 9.0 + 2 * 1.0),
                             rtol=1e-6)
  # One meaning everywhere (issue #42): the scale the step used; the next one apart.
  assert float(m["loss_scale"]) == 4.0 and float(m["next_loss_scale"]) == 2.0


def test_metrics_without_learning_rate_and_for_skip_nonfinite():
  tx = mpscale.skip_nonfinite(optax.sgd(1.0))
  params = _params()
  m = mpscale.step_metrics(tx.init(params))
  assert set(m) == KEYS and float(m["loss_scale"]) == float(m["next_loss_scale"]) == 1.0
  assert tuple(m) == tuple(  # no learning_rate, none of the other optional ones
      f for f in mpscale.step.StepMetrics._fields if f in KEYS)
  assert set(m["group_norms"]) == {"enc", "dec"}


def test_metrics_need_an_mpscale_state():
  with pytest.raises(ValueError, match="mpscale"):
    mpscale.step_metrics(optax.adam(1e-3).init(_params()))
