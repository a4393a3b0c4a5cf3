"""Tests for mpscale.optim: stochastic rounding and Kahan summation of updates."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import mpscale
from mpscale import keys as keys_lib
from tests import helpers

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)

BF16, F16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)


@functools.cache
def _finite_values(dtype):
  """Every finite value of a 16-bit ``dtype``, sorted, as float64 (from its bit
  patterns: a reference independent of the code under test)."""
  values = np.arange(2**16, dtype=np.uint16).view(dtype)
  values = values[np.isfinite(values.astype(np.float32))]
  return np.unique(values.astype(np.float64))


def _neighbours(x, dtype):
  """The values of ``dtype`` at or below and at or above each ``x`` (float64)."""
  values = _finite_values(dtype)
  hi_index = np.searchsorted(values, x, side="left")
  lo_index = np.searchsorted(values, x, side="right") - 1
  return values[lo_index], values[hi_index]


# Compiled as one program (eagerly each of its ops compiles on its own, most of these
# tests' time); test_jit_gives_what_eager_gives holds the eager path to it bit for bit.
_jit_round = jax.jit(mpscale.stochastic_round, static_argnums=1)


def _round(x, dtype, seed=0):
  return np.asarray(_jit_round(
      jnp.asarray(x, jnp.float32), dtype, jax.random.key(seed))).astype(np.float64)


# Values between two neighbours, just below and above a power of two (where the
# spacing changes), negative ones, and float16's subnormals.
BETWEEN = {
    BF16: [1.001, 1.9999, 2.0001, -0.7001, 3.3e-3, -123.45, 1e30],
    F16: [1.0001, 0.99999, 2.0004, -0.7001, 3.3e-3, -123.45, 3e-6, -1e-7],
}


@pytest.mark.parametrize("dtype, x", [(d, x) for d, xs in BETWEEN.items() for x in xs],
                         ids=lambda v: str(v))
def test_stochastic_round_is_unbiased_and_gives_only_the_two_neighbours(dtype, x):
  x = float(np.float32(x))
  n = 200_000
  got = _round(np.full(n, x), dtype)
  lo, hi = _neighbours(np.float64(x), dtype)
  assert lo < x < hi
  assert set(np.unique(got)) <= {lo, hi}
  p = (x - lo) / (hi - lo)
  error = (hi - lo) * np.sqrt(p * (1 - p) / n)  # the standard error of the mean
  assert abs(got.mean() - x) < 5 * error
  assert 0 < np.mean(got == hi) < 1  # both neighbours do occur


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_representable_values_are_kept_bit_for_bit(dtype):
  values = np.arange(2**16, dtype=np.uint16).view(dtype)
  values = values[np.isfinite(values.astype(np.float32))]
  if dtype == BF16:  # bfloat16's subnormals are float32's, which XLA:CPU flushes
    tiny = float(ml_dtypes.finfo(dtype).smallest_normal)
    values = values[(np.abs(values.astype(np.float32)) >= tiny)
                    | (values.astype(np.float32) == 0)]
  got = np.asarray(_jit_round(
      jnp.asarray(values.astype(np.float32)), dtype, jax.random.key(3)))
  np.testing.assert_array_equal(got.view(np.uint16), values.view(np.uint16))


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_non_finite_and_huge_values_round_as_a_cast_would(dtype):
  info = ml_dtypes.finfo(dtype)
  big = float(info.max)
  spacing = 2.0 ** (info.maxexp - 1 - info.nmant)  # from max to the next power of 2
  got = _round(np.array([np.nan, np.inf, -np.inf], np.float32), dtype)
  assert np.isnan(got[0]) and list(got[1:]) == [np.inf, -np.inf]
  if dtype == F16:  # one spacing past max and beyond: Inf, as a cast gives
    got = _round(np.array([big + spacing, -(big + spacing), 3e38], np.float32), dtype)
    assert list(got) == [np.inf, -np.inf, np.inf]
  # Halfway from max to the next power of two: max or Inf, each half the time.
  for sign in (1, -1):
    half = _round(np.full(100_000, sign * (big + spacing / 2), np.float32), dtype)
    assert set(np.unique(half)) == {sign * big, sign * np.inf}
    assert abs(np.mean(np.isinf(half)) - 0.5) < 0.01


def test_zeros_keep_their_sign():
  x = jnp.array([0.0, -0.0], jnp.float32)
  for dtype in (BF16, F16):
    got = np.asarray(mpscale.stochastic_round(x, dtype, jax.random.key(0)))
    assert list(np.signbit(got.astype(np.float32))) == [False, True]


def test_reproducible_from_the_key_and_different_keys_differ():
  x = jnp.linspace(1.0, 2.0, 10_000, dtype=jnp.float32) + 1e-3
  a = mpscale.stochastic_round(x, BF16, jax.random.key(7))
  b = mpscale.stochastic_round(x, BF16, jax.random.key_data(jax.random.key(7)))
  c = mpscale.stochastic_round(x, BF16, jax.random.key(8))
  np.testing.assert_array_equal(helpers.bits(a), helpers.bits(b))
  assert np.mean(np.asarray(a) != np.asarray(c)) > 0.1


def test_jit_gives_what_eager_gives():
  x = jax.random.normal(jax.random.key(0), (1000,), jnp.float32) * 100
  key = jax.random.key(1)
  for dtype in (BF16, F16):
    eager = mpscale.stochastic_round(x, dtype, key)
    jitted = jax.jit(mpscale.stochastic_round, static_argnums=1)(x, dtype, key)
    assert jitted.dtype == dtype
    np.testing.assert_array_equal(helpers.bits(eager), helpers.bits(jitted))


def _mixed_params():
  rng = np.random.default_rng(0)
  return {"a": jnp.asarray(rng.normal(size=(64, 8)), jnp.bfloat16),
          "b": {"c": jnp.asarray(rng.normal(size=(300,)) * 300, jnp.float16)},
          "f": jnp.asarray(rng.normal(size=(16,)), jnp.float32)}


def _updates(params, seed, scale=1e-3):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * scale *
                                            10.0 ** rng.integers(-4, 4, p.shape),
                                            jnp.float32), params)


@pytest.mark.parametrize("use_jit", [False, True])
def test_the_update_lands_apply_updates_exactly_on_the_stochastic_rounding(use_jit):
  params = _mixed_params()
  tx = mpscale.stochastic_rounding(seed=5)
  update = jax.jit(tx.update) if use_jit else tx.update
  state = tx.init(params)
  for step in range(3):
    updates = _updates(params, step)
    out, state = update(updates, state, params)
    assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(out))
    new = optax.apply_updates(params, out)
    step_key = keys_lib.step_key(jax.random.key_data(jax.random.key(5)), step)
    leaves = jax.tree.leaves(params)
    for i, (p, u, got) in enumerate(zip(leaves, jax.tree.leaves(updates),
                                        jax.tree.leaves(new))):
      assert got.dtype == p.dtype
      if p.dtype == jnp.float32:  # passed unchanged
        np.testing.assert_array_equal(helpers.bits(got), helpers.bits(p + u))
        continue
      want = mpscale.stochastic_round(p.astype(jnp.float32) + u, p.dtype,
                                      jax.random.fold_in(step_key, i))
      np.testing.assert_array_equal(helpers.bits(got), helpers.bits(want))
    params = new
  assert int(state.count) == 3


def test_float32_parameters_and_their_updates_pass_untouched():
  params = {"w": jnp.ones((5,), jnp.float32)}
  updates = {"w": jnp.full((5,), 1e-9, jnp.float32)}
  for tx in (mpscale.stochastic_rounding(), mpscale.kahan_summation()):
    out, _ = tx.update(updates, tx.init(params), params)
    assert out["w"] is updates["w"]
  state = mpscale.kahan_summation().init(params)
  assert state.compensation["w"].shape == (0,)  # no buffer for float32


def test_resuming_from_a_saved_state_draws_what_an_uninterrupted_run_draws():
  tx = optax.chain(optax.sgd(1e-3), mpscale.stochastic_rounding(seed=11))
  step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)))
  grads = [_updates(_mixed_params(), i, 1.0) for i in range(4)]
  params, state = _mixed_params(), tx.init(_mixed_params())
  for i, g in enumerate(grads):
    params, state = step(params, state, g)
    if i == 1:
      saved = jax.tree.map(np.asarray, (params, state))  # as a checkpoint holds it
  params_2, state_2 = jax.tree.map(jnp.asarray, saved)
  for g in grads[2:]:
    params_2, state_2 = step(params_2, state_2, g)
  assert helpers.bits((params, state)) == helpers.bits((params_2, state_2))
  # A new transform from the same seed runs the same: the seed is all there is.
  again = optax.chain(optax.sgd(1e-3), mpscale.stochastic_rounding(seed=11))
  assert helpers.bits(again.init(_mixed_params())) == helpers.bits(
      tx.init(_mixed_params()))


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_a_skipped_step_leaves_state_and_params_bit_identical(use_jit, rounding):
  last = (mpscale.stochastic_rounding(3) if rounding == "stochastic"
          else mpscale.kahan_summation())
  tx = mpscale.dynamic_loss_scale(optax.chain(optax.adam(1e-3), last),
                                  init_scale=1.0)
  update = jax.jit(tx.update) if use_jit else tx.update
  params = _mixed_params()
  state = tx.init(params)
  updates, state = update(_updates(params, 0, 1.0), state, params)  # an applied step
  params = optax.apply_updates(params, updates)
  assert int(state.skip_state.skipped) == 0
  bad = _updates(params, 1, 1.0)
  bad["b"]["c"] = bad["b"]["c"].at[3].set(jnp.nan)
  updates, skipped = update(bad, state, params)
  assert int(skipped.skip_state.skipped) == 1
  assert helpers.bits(skipped.skip_state.inner_state) == helpers.bits(
      state.skip_state.inner_state)
  assert helpers.bits(optax.apply_updates(params, updates)) == helpers.bits(params)


def _sum_tiny_updates(dtype, last, steps=10_000, width=1024):
  """A 16-bit parameter of ones plus ``steps`` updates near 1e-4 (far below half its
  spacing), through ``chain(sgd(1), last)``; with the float32 sum of the updates."""
  tx = optax.chain(optax.sgd(1.0), last) if last is not None else optax.sgd(1.0)
  tiny = -1e-4 * (1.0 + 0.5 * jnp.sin(jnp.arange(steps, dtype=jnp.float32)))

  @jax.jit
  def run(params):
    def body(carry, g):
      params, state = carry
      updates, state = tx.update({"w": jnp.full((width,), g)}, state, params)
      return (optax.apply_updates(params, updates), state), None
    (params, _), _ = jax.lax.scan(body, (params, tx.init(params)), tiny)
    return params["w"].astype(jnp.float32)

  exact = 1.0 - float(np.sum(np.asarray(tiny, np.float64)))
  return np.asarray(run({"w": jnp.ones((width,), dtype)})), exact


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_kahan_and_stochastic_rounding_track_the_float32_sum(dtype):
  plain, exact = _sum_tiny_updates(dtype, None)
  assert abs(exact - 2.0) < 0.01  # the updates add up to about 1
  assert np.all(plain == 1.0)  # round-to-nearest loses every one of them
  kahan, _ = _sum_tiny_updates(dtype, mpscale.kahan_summation())
  spacing = 2.0 ** -(ml_dtypes.finfo(dtype).nmant - 1)  # at 2: 2^-6 or 2^-9
  assert np.max(np.abs(kahan - exact)) <= spacing / 2
  stochastic, _ = _sum_tiny_updates(dtype, mpscale.stochastic_rounding(0))
  assert abs(stochastic.mean() - exact) < 0.01  # unbiased: right on average
  assert np.max(np.abs(stochastic - exact)) < 0.5


def test_kahan_state_holds_a_buffer_per_16_bit_parameter_in_its_dtype():
  params = _mixed_params()
  state = mpscale.kahan_summation().init(params)
  assert jax.tree.structure(state.compensation) == jax.tree.structure(params)
  assert state.compensation["a"].dtype == BF16
  assert state.compensation["a"].shape == (64, 8)
  assert state.compensation["b"]["c"].dtype == F16


@pytest.mark.parametrize("call, exc, name", [
    (lambda: mpscale.stochastic_round(jnp.ones(2), jnp.float32, jax.random.key(0)),
     ValueError, "dtype"),
    (lambda: mpscale.stochastic_round(jnp.ones(2), "float17", jax.random.key(0)),
     TypeError, "dtype"),
    (lambda: mpscale.stochastic_round(jnp.ones(2, jnp.int32), BF16, jax.random.key(0)),
     TypeError, "x"),
    (lambda: mpscale.stochastic_rounding(seed="0"), TypeError, "seed"),
    (lambda: mpscale.stochastic_rounding(seed=1.5), TypeError, "seed"),
    (lambda: mpscale.stochastic_rounding(seed=-1), ValueError, "seed"),
    (lambda: mpscale.stochastic_rounding(seed=jnp.zeros(2)), TypeError, "seed"),
])
def test_bad_input_is_refused_by_name(call, exc, name):
  with pytest.raises(exc, match=name) as e:
    call()
  assert isinstance(e.value, mpscale.ArgumentError) and e.value.name == name


def test_the_update_needs_params():
  for tx in (mpscale.stochastic_rounding(), mpscale.kahan_summation()):
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    with pytest.raises(ValueError, match="params"):
      tx.update({"w": jnp.ones(2)}, tx.init(params))
