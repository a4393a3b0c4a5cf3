"""Tests for mpscale.scaling: skip_nonfinite on its own."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpscale
from tests import helpers

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


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
  inner, seen = helpers.recording_inner()
  tx = mpscale.skip_nonfinite(inner)
  params = _params()
  tx.update(params, tx.init(params), params, value=jnp.ones(()))
  assert "value" in seen and isinstance(seen["leaf_squares"], mpscale.LeafSquares)


def test_skip_nonfinite_validates():
  with pytest.raises(TypeError, match="inner"):
    mpscale.skip_nonfinite(None)
  with pytest.raises(ValueError, match="groups"):
    mpscale.skip_nonfinite(optax.sgd(1.0), norm_groups=0)


def test_initial_state_can_be_donated():
  # Two fields sharing one buffer would make donation fail ("donate the same buffer
  # twice").
  for tx in (mpscale.skip_nonfinite(optax.sgd(0.1)),
             mpscale.dynamic_loss_scale(
                 optax.chain(mpscale.global_norm_clip(1.0), optax.sgd(0.1)))):
    params = {"w": jnp.ones((3,))}
    state = tx.init(params)
    leaves = jax.tree.leaves(state)
    assert len({id(x) for x in leaves}) == len(leaves)
    step = jax.jit(lambda p, s: tx.update(p, s, p)[1], donate_argnums=(1,))
    jax.block_until_ready(step(params, state))


@pytest.mark.parametrize("clip", [False, True])
def test_donated_skip_step_copies_no_state(clip):
  # Selecting each state leaf where the inner update makes it lets XLA update the
  # donated Adam moments in place; a select at the end made XLA:CPU copy every moment.
  params = {"w": jnp.ones((64, 64)), "v": {"u": jnp.ones((128, 32)), "b": jnp.ones((64,))}}
  inner = optax.adamw(1e-3)
  if clip:
    inner = optax.chain(mpscale.global_norm_clip(1.0), inner)
  tx = mpscale.dynamic_loss_scale(inner)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  hlo = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile(
  ).as_text()
  assert not helpers.big_copies(hlo), helpers.big_copies(hlo)[:3]


def test_select_at_the_producer_keeps_skips_exact_for_many_optimizers():
  params = {"w": jnp.arange(12.0).reshape(3, 4) / 7, "b": jnp.array([-0.0, 1.0])}
  grads = jax.tree.map(lambda p: jnp.cos(p) + 0.5, params)
  bad = {"w": grads["w"].at[1, 1].set(jnp.inf), "b": grads["b"]}
  for inner in (optax.adamw(0.1), optax.sgd(0.1, momentum=0.9, nesterov=True),
                optax.lion(0.1), optax.adafactor(0.1),
                optax.MultiSteps(optax.adam(0.1), 2).gradient_transformation(),
                optax.chain(optax.adamw(0.1), mpscale.global_norm_clip(0.5))):
    tx = mpscale.skip_nonfinite(inner)

    @jax.jit
    def step(params, state, grads, tx=tx):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    p, s = step(params, tx.init(params), grads)
    p2, s2 = step(p, s, bad)
    assert jax.tree.map(lambda x: np.asarray(x).tobytes(), (p2, s2.inner_state)) == \
        jax.tree.map(lambda x: np.asarray(x).tobytes(), (p, s.inner_state))
    p3, _ = step(p, s, grads)  # a kept step does move
    assert not np.array_equal(np.asarray(p3["w"]), np.asarray(p["w"]))


@pytest.mark.parametrize("use_jit", [False, True])
def test_nested_wrappers_share_one_pass_and_agree_with_one_wrapper(use_jit):
  # dynamic_loss_scale(skip_nonfinite(...)) once raised TypeError: the outer wrapper's
  # sums of squares reached the inner one as an extra argument it passed on twice.
  params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
  nested = mpscale.dynamic_loss_scale(mpscale.skip_nonfinite(optax.adamw(1e-2)),
                                      init_scale=8.0, growth_interval=2)
  single = mpscale.dynamic_loss_scale(optax.adamw(1e-2), init_scale=8.0,
                                      growth_interval=2)
  update_n = jax.jit(nested.update) if use_jit else nested.update
  update_s = jax.jit(single.update) if use_jit else single.update
  state_n, state_s = nested.init(params), single.init(params)
  for step in range(4):
    grads = jax.tree.map(lambda p: jnp.cos(p + step), params)
    if step == 2:
      grads["b"] = grads["b"].at[0].set(jnp.inf)
    scale = mpscale.loss_scale_of(state_s)
    assert float(mpscale.loss_scale_of(state_n)) == float(scale)
    grads = jax.tree.map(lambda g: g * scale, grads)
    u_n, state_n = update_n(grads, state_n, params)
    u_s, state_s = update_s(grads, state_s, params)
    for a, b in zip(jax.tree.leaves(u_n), jax.tree.leaves(u_s)):
      np.testing.assert_allclose(a, b, rtol=1e-6)
    m_n, m_s = mpscale.step_metrics(state_n), mpscale.step_metrics(state_s)
    for key in ("overflow", "skipped", "global_norm", "loss_scale"):
      np.testing.assert_allclose(m_n[key], m_s[key], rtol=1e-6)
    # The inner wrapper's state is part of what a skipped step keeps as it was, so it
    # never records the overflow the outer one skipped.
    inner = state_n.skip_state.inner_state
    assert not bool(inner.overflow) and int(inner.skipped) == 0
