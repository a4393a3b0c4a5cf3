"""Tests for mpscale.opt_state: finding mpscale's states inside an optimizer state."""

import jax.numpy as jnp
import optax

import mpscale
from mpscale import opt_state


def _nested():
  return mpscale.dynamic_loss_scale(mpscale.skip_nonfinite(optax.chain(
      mpscale.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(1e-3))))


def test_find_returns_every_state_of_a_kind_outermost_first():
  state = _nested().init({"w": jnp.ones(3)})
  skips = opt_state.find(state, mpscale.SkipNonfiniteState)
  assert len(skips) == 2
  assert skips[0] is state.skip_state
  assert skips[1] is state.skip_state.inner_state
  assert opt_state.find(state, mpscale.LossScaleState) == [state]
  assert len(opt_state.find(state, mpscale.ClipByGlobalNormState)) == 1
  assert opt_state.find(state, mpscale.ScaleByCameState) == []


def test_find_all_gives_the_key_paths_and_the_state_itself_first():
  state = mpscale.skip_nonfinite(optax.sgd(0.1)).init({"w": jnp.ones(3)})
  found = opt_state.find_all(state, mpscale.SkipNonfiniteState)
  assert found[0] == ((), state) and len(found) == 1


def test_plain_leaves_non_nnx_states_alone():
  state = _nested().init({"w": jnp.ones(3)})
  assert opt_state.plain(state) is state
