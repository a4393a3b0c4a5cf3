"""Tests for mpscale.finite: skip_nonfinite on its own."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpscale


def _params():
  return {"a": jnp.arange(6.0).reshape(2, 3), "b": {"c": jnp.ones((4,))}}


@pytest.mark.parametrize("use_jit", [False, True])
def test_skip_nonfinite_counts_and_reports_nan_and_inf_apart(use_jit):
  tx = mpscale.skip_nonfinite(optax.adam(0.1))
  update = jax.jit(tx.update) if use_jit else tx.update
  params = _params()
  state = tx.init(params)
  good = jax.tree.map(jnp.ones_like, params)
  nan = {"a": good["a"].at[1, 2].set(jnp.nan), "b": good["b"]}
  inf = {"a": good["a"], "b": {"c": good["b"]["c"].at[0].set(-jnp.inf)}}
  both = {"a": nan["a"], "b": inf["b"]}
  expected = [  # nan, inf, skipped, consecutive
      (good, False, False, 0, 0), (nan, True, False, 1, 1),
      (inf, False, True, 2, 2), (both, True, True, 3, 3), (good, False, False, 3, 0)]
  for grads, want_nan, want_inf, skipped, consecutive in expected:
    _, state = update(grads, state, params)
    assert bool(state.nan) == want_nan and bool(state.inf) == want_inf
    assert bool(state.overflow) == (want_nan or want_inf)
    assert int(state.skipped) == skipped
    assert int(state.consecutive_skipped) == consecutive
  assert int(state.inner_state[0].count) == 2  # only the two finite steps ran adam


def test_huge_finite_gradient_counts_as_inf():
  # Its squared norm leaves float32's range, so its norm (and any clip) is infinite.
  tx = mpscale.skip_nonfinite(optax.sgd(1.0))
  params = {"w": jnp.zeros((2,))}
  _, state = tx.update({"w": jnp.array([1e20, 0.0])}, tx.init(params), params)
  assert bool(state.inf) and not bool(state.nan) and int(state.skipped) == 1


def test_finite_step_equals_inner_step():
  params = _params()
  grads = jax.tree.map(lambda x: x * 0.3 + 1.0, params)
  inner = optax.adamw(0.1)
  want, _ = inner.update(grads, inner.init(params), params)
  tx = mpscale.skip_nonfinite(inner)
  got, state = tx.update(grads, tx.init(params), params)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  np.testing.assert_allclose(state.global_norm, mpscale.global_norm(grads), rtol=1e-6)
  norms, sizes = mpscale.group_norms(grads)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               state.group_norms, norms)
  assert {k: int(v) for k, v in state.group_sizes.items()} == {"a": 6, "b": 4}


def test_extra_args_reach_the_inner_transformation():
  seen = {}

  def update(updates, state, params=None, **extra):
    seen.update(extra)
    return updates, state

  inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
  tx = mpscale.skip_nonfinite(inner)
  params = _params()
  tx.update(params, tx.init(params), params, value=jnp.ones(()))
  assert "value" in seen and isinstance(seen["grad_sum_squares"], mpscale.LeafSquares)


def test_skip_nonfinite_validates():
  with pytest.raises(TypeError, match="inner"):
    mpscale.skip_nonfinite(None)
  with pytest.raises(ValueError, match="groups"):
    mpscale.skip_nonfinite(optax.sgd(1.0), groups=0)


def test_initial_state_can_be_donated():
  # Two fields sharing one buffer would make donation fail ("donate the same buffer
  # twice").
  for tx in (mpscale.skip_nonfinite(optax.sgd(0.1)),
             mpscale.dynamic_loss_scale(
                 optax.chain(mpscale.clip_by_global_norm(1.0), optax.sgd(0.1)))):
    params = {"w": jnp.ones((3,))}
    state = tx.init(params)
    leaves = jax.tree.leaves(state)
    assert len({id(x) for x in leaves}) == len(leaves)
    step = jax.jit(lambda p, s: tx.update(p, s, p)[1], donate_argnums=(1,))
    jax.block_until_ready(step(params, state))
