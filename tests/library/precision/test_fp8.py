"""Tests for mpscale.precision (FP8 products and their scaling state) and mpscale.precision.fp8_flax.

The casts are checked against a float64 reference that rounds to the nearest of the
format's values (every finite value, decoded from its 256 codes), ties to the even
code; the state's updates against TE's definitions written out by hand; the products'
gradients exactly on values FP8 holds exactly, and within the formats' rounding on
random ones, for each recipe.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from flax.core import FrozenDict
from flax.linen import fp8_ops
from flax.training import train_state
import optax

import mpscale
from mpscale.precision import _fp8 as fp8
from mpscale.precision import _fp8_state as fp8_state
from mpscale.precision.fp8_flax import (Fp8DotGeneral, NnxFp8DotGeneral, NnxFp8Einsum,
                              OverwriteWithGradient)

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FORMATS = [(E4M3, 448.0, 3, 2.0**-9), (E5M2, 57344.0, 2, 2.0**-16)]
"""(dtype, largest finite, mantissa bits, smallest subnormal)."""
DENSE = (((1,), (0,)), ((), ()))


# ------------------------------------------------------------------ the reference
def _positive_grid(dtype):
  """The format's finite values >= 0 as float64, indexed by their codes."""
  values = np.arange(256, dtype=np.uint8).view(ml_dtypes.finfo(dtype).dtype)
  values = values.astype(np.float64)[:128]  # sign bit clear
  return values[np.isfinite(values)]


def _reference_quantize(x, scale, dtype, bound):
  """``saturate(x * scale)`` rounded in float64 to the nearest value of ``dtype``,
  ties to the even code; the product ``x * scale`` is float32's, as `quantize`'s."""
  v = (np.float32(x) * np.float32(scale)).astype(np.float64)
  grid = _positive_grid(dtype)
  out = np.empty_like(v)
  for i, value in np.ndenumerate(v):
    if np.isnan(value):
      out[i] = np.nan
      continue
    a = min(abs(value), bound)
    hi = int(np.searchsorted(grid, a))
    if hi < len(grid) and grid[hi] == a:
      r = grid[hi]
    else:
      lo = hi - 1
      down, up = a - grid[lo], grid[hi] - a
      r = grid[lo] if down < up or (down == up and lo % 2 == 0) else grid[hi]
    out[i] = np.copysign(r, value)
  return out


def _sweep(dtype, bound, tiny):
  """Values over the format's range: subnormals, normals, every exact midpoint of two
  neighbours (a tie), past the largest value, infinities, NaN, zeros, both signs."""
  rng = np.random.default_rng(0)
  grid = _positive_grid(dtype)
  mags = np.concatenate([
      2.0 ** rng.uniform(np.log2(tiny) - 2, np.log2(bound) + 2, 400),
      np.arange(1, 12) * tiny / 2,                     # subnormal steps and ties
      (grid[1:] + grid[:-1]) / 2,
      [bound, bound * 1.01, bound * 1.1, 1e30, np.inf, 0.0]])
  values = np.concatenate([mags, -mags, [np.nan, -0.0]])
  return values.astype(np.float32)


def _bits_equal(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.array_equal(a, b, equal_nan=True)


# ------------------------------------------------------------------ casts
@pytest.mark.parametrize("dtype, bound, mantissa, tiny", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 2.0**-5, 3.0, 1.0 / 3.0])
def test_quantize_matches_a_float64_rounding_reference(dtype, bound, mantissa, tiny,
                                                       scale):
  x = _sweep(dtype, bound, tiny) / np.float32(scale)  # x * scale: the sweep, or near
  got = jax.jit(fp8.quantize, static_argnums=2)(x, scale, dtype)
  assert got.dtype == dtype
  assert _bits_equal(got.astype(jnp.float32), _reference_quantize(x, scale, dtype,
                                                                   bound))


@pytest.mark.parametrize("dtype, bound, mantissa, tiny", FORMATS)
def test_quantize_saturates_keeps_nan_and_holds_the_subnormals(dtype, bound, mantissa,
                                                               tiny):
  x = jnp.array([1e6, -1e6, jnp.inf, -jnp.inf, bound, -bound, jnp.nan, tiny,
                 3 * tiny, tiny / 2, tiny * 0.51, 0.0], jnp.float32)
  q = np.asarray(fp8.quantize(x, 1.0, dtype).astype(jnp.float32))
  np.testing.assert_array_equal(q[:6], [bound, -bound, bound, -bound, bound, -bound])
  assert np.isnan(q[6])
  # subnormals are exact; half the smallest rounds to 0 (tie, even), above it up
  np.testing.assert_array_equal(q[7:], [tiny, 3 * tiny, 0.0, tiny, 0.0])


@pytest.mark.parametrize("dtype, bound, mantissa, tiny", FORMATS)
def test_round_trip_error_is_half_a_step(dtype, bound, mantissa, tiny):
  rng = np.random.default_rng(1)
  scale = np.float32(448.0 / 5.0)
  x = rng.uniform(-5, 5, 4096).astype(np.float32)
  back = np.asarray(fp8.dequantize(fp8.quantize(x, scale, dtype), scale))
  scaled = np.abs(x * scale)
  normal = scaled >= float(ml_dtypes.finfo(dtype).tiny)
  # normal values: relative error <= 2**-(mantissa+1); subnormals: half their step
  assert np.all(np.abs(back - x)[normal] <= 2.0 ** -(mantissa + 1) * np.abs(x)[normal]
                * (1 + 1e-6))
  assert np.all(np.abs(back - x)[~normal] * scale <= tiny / 2 * (1 + 1e-5))
  assert fp8.dequantize(fp8.quantize(x, scale, dtype), scale, jnp.bfloat16).dtype == (
      jnp.bfloat16)


def test_amax_leaves_nans_out_and_records_inf():
  assert float(fp8.amax(jnp.array([1.0, -3.0, jnp.nan]))) == 3.0
  assert float(fp8.amax(jnp.array([jnp.nan, jnp.nan]))) == 0.0
  assert float(fp8.amax(jnp.array([1.0, -jnp.inf]))) == np.inf


# ------------------------------------------------------------------ scales and history
def test_the_history_rolls_as_transformer_engine_and_flax_roll_it():
  h = jnp.array([10.0, 11.0, 12.0, 13.0])  # [0] newest
  np.testing.assert_array_equal(fp8.record_amax(h, jnp.float32(7.0)),
                                [7.0, 12.0, 13.0, 10.0])
  # the window holds the latest len(h) amaxes, [0] the newest
  h = jnp.zeros(4)
  for a in range(1, 8):
    h = fp8.record_amax(h, jnp.float32(a))
  assert float(h[0]) == 7.0 and sorted(np.asarray(h).tolist()) == [4.0, 5.0, 6.0, 7.0]


@pytest.mark.parametrize("dtype, bound, mantissa, tiny", FORMATS)
def test_scale_is_fp8_max_over_amax_over_two_to_the_margin(dtype, bound, mantissa,
                                                            tiny):
  for a, margin in [(3.5, 0), (3.5, 2), (0.001, 1), (bound, 0)]:
    want = np.float32(np.float32(bound) / np.float32(a)) / np.float32(2.0**margin)
    got = fp8.scale_from_amax(jnp.float32(a), 5.0, dtype, margin)
    assert float(got) == float(want)
  # amax 0, inf or NaN keeps the old scale; a scale past float32's range is its max
  got = fp8.scale_from_amax(jnp.array([0.0, np.inf, np.nan, 1e-37]), 5.0, dtype)
  np.testing.assert_array_equal(got, [5.0, 5.0, 5.0, np.finfo(np.float32).max])


def _meta(scale, history):
  return fp8.Fp8Meta(jnp.float32(scale), jnp.asarray(history, jnp.float32))


def _state(scales=(1.0, 1.0, 1.0), history=(0.0, 0.0, 0.0, 0.0)):
  return fp8.Fp8State(*(_meta(s, history) for s in scales))


def _grads(x, w, state, recipe, dims=DENSE, loss=jnp.sum):
  fn = lambda x, w, s: loss(fp8.fp8_dot_general(x, w, dims, s, recipe))
  return jax.jit(jax.grad(fn, argnums=(0, 1, 2)))(x, w, state)


@pytest.mark.parametrize("amax_compute, margin", [("max", 0), ("max", 1),
                                                  ("most_recent", 0)])
def test_delayed_state_gradient_is_the_updated_state(amax_compute, margin):
  recipe = fp8.make_fp8_recipe("delayed", history_len=4, margin=margin,
                          amax_compute=amax_compute)
  x = jnp.full((2, 16), 0.5).at[0, 3].set(-3.0)       # amax 3
  w = jnp.full((16, 4), 0.25)                         # amax 0.25
  old = _state(scales=(2.0, 4.0, 8.0), history=(0.125, 1.5, 2.0, 0.5))
  _, _, new = _grads(x, w, old, recipe)
  reduce = (lambda h: max(h)) if amax_compute == "max" else (lambda h: h[0])
  for meta, a, bound in [(new.lhs, 3.0, 448.0), (new.rhs, 0.25, 448.0),
                         (new.grad, 1.0, 57344.0)]:
    history = [a, 2.0, 0.5, 0.125]                    # rolled, this step's first
    np.testing.assert_array_equal(meta.amax_history, history)
    want = np.float32(np.float32(bound) / np.float32(reduce(history)))
    assert float(meta.scale) == float(want / np.float32(2**margin))


def test_delayed_casts_with_the_old_scale_and_the_next_call_with_the_new():
  recipe = fp8.make_fp8_recipe("delayed", history_len=4)
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(8, 32)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)

  def expected(state):
    qx = fp8.dequantize(fp8.quantize(x, state.lhs.scale, E4M3), state.lhs.scale)
    qw = fp8.dequantize(fp8.quantize(w, state.rhs.scale, E4M3), state.rhs.scale)
    return qx @ qw

  state = _state(scales=(0.5, 2.0, 1.0))
  out = fp8.fp8_dot_general(x, w, DENSE, state, recipe)
  np.testing.assert_allclose(out, expected(state), rtol=1e-6, atol=1e-6)
  _, _, state = _grads(x, w, state, recipe)
  assert float(state.lhs.scale) == np.float32(448.0) / np.abs(np.asarray(x)).max()
  out = fp8.fp8_dot_general(x, w, DENSE, state, recipe)
  np.testing.assert_allclose(out, expected(state), rtol=1e-6, atol=1e-6)


def test_current_scales_each_tensor_by_its_own_amax_and_records_the_history():
  recipe = fp8.make_fp8_recipe("current", history_len=4)
  x = jnp.full((2, 16), 0.5).at[1, 0].set(7.0)
  w = jnp.full((16, 4), 0.25)
  old = _state(scales=(1e-3, 1e-3, 1e-3), history=(1.0, 2.0, 3.0, 4.0))
  out = fp8.fp8_dot_general(x, w, DENSE, old, recipe)
  sx, sw = np.float32(448.0) / np.float32(7.0), np.float32(448.0) / np.float32(0.25)
  want = (fp8.dequantize(fp8.quantize(x, sx, E4M3), sx)
          @ fp8.dequantize(fp8.quantize(w, sw, E4M3), sw))
  np.testing.assert_allclose(out, want, rtol=1e-6)   # not the old 1e-3 scales
  _, _, new = _grads(x, w, old, recipe)
  assert float(new.lhs.scale) == sx and float(new.rhs.scale) == sw
  np.testing.assert_array_equal(new.lhs.amax_history, [7.0, 3.0, 4.0, 1.0])
  assert float(new.grad.scale) == 57344.0              # g = ones
  # a tensor of zeros keeps the old scale
  _, _, new = _grads(jnp.zeros_like(x), w, old, recipe)
  assert float(new.lhs.scale) == np.float32(1e-3)


def test_blockwise_scales_come_from_their_own_blocks():
  x = jnp.ones((4, 256)).at[1, 130].set(1000.0)        # one outlier in tile (1, 1)
  q, scales = fp8.quantize_blockwise(x, (1, 128), E4M3)
  want = np.full((4, 2), 448.0, np.float32)
  want[1, 1] = np.float32(448.0) / np.float32(1000.0)
  np.testing.assert_array_equal(scales, want)
  back = np.array(fp8.dequantize_blockwise(q, scales, (1, 128)))
  back[1, 128:] = 1.0                                # the outlier's tile rounds
  np.testing.assert_array_equal(back, 1.0)           # the other tiles are exact
  # 128 x 128 weight blocks; a size that is not a multiple ends in a partial block
  w = jnp.ones((200, 300)).at[150, 10].set(-50.0)
  _, scales = fp8.quantize_blockwise(w, (128, 128), E4M3)
  assert scales.shape == (2, 3)
  want = np.full((2, 3), 448.0, np.float32)
  want[1, 0] = np.float32(448.0) / np.float32(50.0)
  np.testing.assert_array_equal(scales, want)
  # a block of zeros gets scale 1 (TE's compute_scale_from_amax)
  _, scales = fp8.quantize_blockwise(jnp.zeros((2, 4)), (1, 2), E4M3)
  np.testing.assert_array_equal(scales, 1.0)


def test_blockwise_forward_is_the_product_of_the_blockwise_rounded_operands():
  recipe = fp8.make_fp8_recipe("blockwise", history_len=4, block_size=8)
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(6, 20)) * np.exp(rng.normal(size=(6, 20))),
                  jnp.float32)
  w = jnp.asarray(rng.normal(size=(20, 12)), jnp.float32)
  out = jax.jit(fp8.fp8_dot_general, static_argnums=(2, 4))(x, w, DENSE,
                                                           _state(), recipe)

  def rounded(a, blocks):
    return fp8.dequantize_blockwise(*fp8.quantize_blockwise(a, blocks, E4M3), blocks)
  want = rounded(x, (1, 8)) @ rounded(w, (8, 8))
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
  # the state records the per-tensor amaxes
  _, _, new = _grads(x, w, _state(), recipe)
  assert float(new.lhs.amax_history[0]) == float(jnp.abs(x).max())


# ------------------------------------------------------------------ gradients
# Operands FP8 holds exactly (small integers, scale 1) make every cast exact: the
# FP8 product's gradients must equal lax.dot_general's, for any dimension numbers.
DIMS = {
    "dense": ((3, 5), (5, 4), DENSE),
    "dense_3d": ((2, 3, 5), (5, 4), (((2,), (0,)), ((), ()))),
    "dense_general": ((2, 3, 5), (3, 5, 4), (((1, 2), (0, 1)), ((), ()))),
    "contract_first": ((5, 3), (5, 4), (((0,), (0,)), ((), ()))),
    "attention_scores": ((2, 4, 3, 8), (2, 6, 3, 8), (((3,), (3,)), ((0, 2), (0, 2)))),
    "attention_values": ((2, 3, 4, 6), (2, 6, 3, 8), (((3,), (1,)), ((0, 1), (0, 2)))),
    "batch_last": ((5, 3, 2), (2, 4, 5), (((0,), (2,)), ((2,), (0,)))),
}


@pytest.mark.parametrize("name", list(DIMS))
def test_gradients_match_dot_general_on_exact_values(name):
  lhs_shape, rhs_shape, dims = DIMS[name]
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.integers(-4, 5, lhs_shape), jnp.float32)
  w = jnp.asarray(rng.integers(-4, 5, rhs_shape), jnp.float32)
  out_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dims), x, w).shape
  t = jnp.asarray(rng.integers(-2, 3, out_shape), jnp.float32)
  loss = lambda out: jnp.sum(out * t)
  recipe = fp8.make_fp8_recipe("delayed", history_len=4)
  dx, dw, _ = _grads(x, w, _state(), recipe, dims, loss)
  want = jax.grad(lambda a, b: loss(jax.lax.dot_general(a, b, dims)), (0, 1))(x, w)
  np.testing.assert_array_equal(dx, want[0])
  np.testing.assert_array_equal(dw, want[1])


def _rel(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


# e4m3 rounds each operand within 2**-4 relative, e5m2 the output gradient within
# 2**-3: a product of two e4m3 values errs at most 2 * 2**-4, a gradient (e5m2 times
# e4m3) 2**-3 + 2**-4. Measured on this case: 0.04 forward, 0.07 the kernel's.
FORWARD_BOUND, GRADIENT_BOUND = 2 * 2.0**-4, 2.0**-3 + 2.0**-4


@pytest.mark.parametrize("recipe_name", list(fp8.RECIPES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_dense_gradients_are_close_to_the_dense_layers(recipe_name, dtype):
  recipe = fp8.make_fp8_recipe(recipe_name, history_len=8, block_size=32)
  x = jax.random.normal(jax.random.key(0), (64, 96))
  t = jax.random.normal(jax.random.key(1), (64, 80))
  reference = nn.Dense(80, dtype=dtype)
  dense = nn.Dense(80, dtype=dtype, dot_general_cls=functools.partial(
      Fp8DotGeneral, recipe=recipe))
  variables = dense.init(jax.random.key(2), x)
  loss = lambda m: jax.jit(jax.grad(lambda v: jnp.sum(jnp.tanh(m.apply(v, x)) * t)))
  # one step sets delayed scaling's scales from the amaxes
  params, state = mpscale.split_overwrite(variables)
  variables = mpscale.join_overwrite(
      params, mpscale.split_overwrite(loss(dense)(variables))[1])
  grads = loss(dense)(variables)
  want = loss(reference)({"params": variables["params"]})
  out = dense.apply(variables, x)
  assert out.dtype == dtype
  assert _rel(out, reference.apply({"params": variables["params"]}, x)) < FORWARD_BOUND
  for name in ("kernel", "bias"):
    assert _rel(grads["params"][name], want["params"][name]) < GRADIENT_BOUND, name
  assert set(grads) == {"params", fp8.OVERWRITE_WITH_GRADIENT}


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_float16_products_accumulate_and_scale_in_float32(recipe_name):
  # e4m3 values scaled up to 448: 256 terms of 448 x 448 is 5e7, far past float16's
  # 65504 unscaled; the product and its gradients are the float32 ones within FP8's
  # error, and finite
  recipe = fp8.make_fp8_recipe(recipe_name)
  state = fp8.fp8_state(recipe)
  if recipe_name == "delayed":  # a history whose scale fits these operands
    state = jax.grad(lambda s: jnp.sum(fp8.fp8_dot_general(
        jnp.ones((4, 256), jnp.float16), jnp.ones((256, 8), jnp.float16),
        (((1,), (0,)), ((), ())), s, recipe)), allow_int=True)(state)
  x = jnp.ones((4, 256), jnp.float16)
  w = jnp.ones((256, 8), jnp.float16) * 0.5

  def loss(x, w):
    out = fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), state, recipe)
    return jnp.sum(out.astype(jnp.float32)), out

  (total, out), (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
  assert out.dtype == jnp.float16 and bool(jnp.all(jnp.isfinite(out)))
  np.testing.assert_allclose(np.asarray(out, np.float32), 128.0, rtol=2**-3)
  np.testing.assert_allclose(np.asarray(dx, np.float32), 4.0, rtol=2**-2)
  np.testing.assert_allclose(np.asarray(dw, np.float32), 4.0, rtol=2**-2)
  assert np.isfinite(float(total))


def test_jit_and_eager_agree():
  recipe = fp8.make_fp8_recipe("delayed", history_len=4)
  x = jax.random.normal(jax.random.key(0), (4, 32))
  w = jax.random.normal(jax.random.key(1), (32, 8))
  fn = jax.grad(lambda x, w, s: jnp.sum(fp8.fp8_dot_general(x, w, DENSE, s, recipe)
                                        ** 2), argnums=(0, 1, 2))
  eager, jitted = fn(x, w, _state()), jax.jit(fn)(x, w, _state())
  for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


# ------------------------------------------------------------------ merging updates
def _updates(recipe, *batches):
  w = jnp.full((16, 4), 0.25)
  old = {"layer": _state(scales=(2.0, 4.0, 8.0), history=(10.0, 1.0, 2.0, 0.5))}
  # compiled once a shape (eagerly each op compiles on its own: most of these tests'
  # time); the merges below are jitted alike
  grad = jax.jit(lambda x: jax.grad(lambda s: jnp.sum(fp8.fp8_dot_general(
      x, w, DENSE, s["layer"], recipe) * jnp.arange(4.0)))(old))
  return old, [grad(x) for x in batches]


_merge = jax.jit(fp8_state.merge, static_argnums=2)
_merge_stacked = jax.jit(fp8_state.merge_stacked, static_argnums=1)


def _assert_same(a, b):
  for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("recipe_name", list(fp8.RECIPES))
def test_merged_micro_batches_take_the_max_in_any_order(recipe_name):
  recipe = fp8.make_fp8_recipe(recipe_name, history_len=4)
  rng = np.random.default_rng(5)
  batches = [jnp.asarray(rng.normal(size=(3, 16)) * s, jnp.float32)
             for s in (1.0, 20.0, 3.0)]
  _, (a, b, c) = _updates(recipe, *batches)
  ab = _merge(a, b, recipe)
  _assert_same(ab, _merge(b, a, recipe))
  _assert_same(_merge(ab, c, recipe), _merge(a, _merge(b, c, recipe), recipe))
  np.testing.assert_array_equal(
      ab["layer"].lhs.amax_history,
      jnp.maximum(a["layer"].lhs.amax_history, b["layer"].lhs.amax_history))
  # the same state as one call on both micro-batches
  _, (whole,) = _updates(recipe, jnp.concatenate(batches[:2]))
  _assert_same(ab, whole)
  # a vmap's stacked updates, and the replicas of a named axis, merge alike
  stacked = jax.tree_util.tree_map(lambda *u: jnp.stack(u), a, b, c)
  abc = _merge(ab, c, recipe)
  _assert_same(_merge_stacked(stacked, recipe), abc)
  across = jax.jit(jax.vmap(lambda s: fp8_state.merge_across(s, recipe, "r"),
                            axis_name="r"))(stacked)
  _assert_same(jax.tree_util.tree_map(lambda u: u[1], across), abc)


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_a_vmap_over_replicas_stacks_updates_that_merge_stacked_combines():
  recipe = fp8.make_fp8_recipe("delayed", history_len=4)
  rng = np.random.default_rng(7)
  spread = np.array([1.0, 9.0, 4.0])[:, None, None]
  xs = jnp.asarray(rng.normal(size=(3, 2, 16)) * spread, jnp.float32)
  old, updates = _updates(recipe, *xs)
  w = jnp.full((16, 4), 0.25)
  per_replica = jax.jit(jax.vmap(jax.grad(lambda s, x: jnp.sum(fp8.fp8_dot_general(
      x, w, DENSE, s["layer"], recipe) * jnp.arange(4.0))), in_axes=(None, 0)))(old, xs)
  _assert_same(_merge_stacked(per_replica, recipe),
               functools.reduce(lambda p, q: _merge(p, q, recipe), updates))


def test_under_a_batch_sharded_jit_the_state_records_the_global_amax():
  recipe = fp8.make_fp8_recipe("delayed", history_len=4)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  x = jax.random.normal(jax.random.key(0), (16, 32)).at[13, 5].set(40.0)
  w = jax.random.normal(jax.random.key(1), (32, 8))
  one = _grads(x, w, _state(), recipe)
  split = _grads(jax.device_put(x, rows), w, _state(), recipe)
  assert float(split[2].lhs.amax_history[0]) == 40.0
  _assert_same(split[2], one[2])
  np.testing.assert_allclose(split[1], one[1], rtol=1e-6, atol=1e-6)


def test_merge_keeps_the_old_scale_where_the_merged_amax_gives_none():
  recipe = fp8.make_fp8_recipe("delayed", history_len=4, amax_compute="most_recent")
  zeros = jnp.zeros((3, 16))
  old, (a, z1, z2, inf) = _updates(recipe, jnp.ones((3, 16)), zeros, zeros,
                                   jnp.ones((3, 16)).at[0, 0].set(jnp.inf))
  # one update saw zeros: the other's amax decides
  assert float(_merge(z1, a, recipe)["layer"].lhs.scale) == float(
      a["layer"].lhs.scale) == 448.0
  # both zeros, or an inf in either: the old scale
  assert float(_merge(z1, z2, recipe)["layer"].lhs.scale) == 2.0
  for pair in ((a, inf), (inf, a)):
    assert float(_merge(*pair, recipe)["layer"].lhs.scale) == 2.0
  stacked = jax.tree_util.tree_map(lambda *u: jnp.stack(u), a, inf, z1)
  assert float(_merge_stacked(stacked, recipe)["layer"].lhs.scale) == 2.0


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_merge_across_replicas_of_a_shard_map():
  recipe = fp8.make_fp8_recipe("delayed", history_len=4)
  rng = np.random.default_rng(6)
  batches = [jnp.asarray(rng.normal(size=(3, 16)) * (i + 1), jnp.float32)
             for i in range(8)]
  _, updates = _updates(recipe, *batches)
  stacked = jax.tree_util.tree_map(lambda *u: jnp.stack(u), *updates)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  P = jax.sharding.PartitionSpec
  merged = jax.jit(jax.shard_map(
      lambda s: jax.tree_util.tree_map(
          lambda u: u[None], fp8_state.merge_across(
              jax.tree_util.tree_map(lambda u: u[0], s), recipe, "data")),
      mesh=mesh, in_specs=P("data"), out_specs=P("data")))(stacked)
  want = functools.reduce(lambda p, q: _merge(p, q, recipe), updates)
  for i in range(8):
    _assert_same(jax.tree_util.tree_map(lambda u: u[i], merged), want)


# ------------------------------------------------------------------ routing the state
def test_split_and_join_route_the_overwrite_with_gradient_collection():
  assert fp8.OVERWRITE_WITH_GRADIENT == fp8_ops.OVERWRITE_WITH_GRADIENT
  state = {"Dense_0": _state()}
  tree = {"params": {"w": jnp.ones(2)}, fp8.OVERWRITE_WITH_GRADIENT: state}
  rest, got = mpscale.split_overwrite(tree)
  assert set(rest) == {"params"} and got is state
  joined = mpscale.join_overwrite(rest, got)
  assert set(joined) == set(tree) and joined[fp8.OVERWRITE_WITH_GRADIENT] is state
  frozen_rest, got = mpscale.split_overwrite(FrozenDict(tree))
  assert isinstance(frozen_rest, FrozenDict) and set(frozen_rest) == {"params"}
  assert isinstance(got["Dense_0"], fp8.Fp8State)
  assert mpscale.split_overwrite({"params": 1}) == ({"params": 1}, None)
  assert mpscale.join_overwrite({"params": 1}, None) == {"params": 1}


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_flax_train_state_replaces_the_state_by_its_gradient():
  recipe = fp8.make_fp8_recipe("delayed", history_len=4)
  dense = nn.Dense(8, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=recipe))
  x = jax.random.normal(jax.random.key(0), (4, 16)) * 3
  ts = train_state.TrainState.create(apply_fn=dense.apply,
                                     params=dense.init(jax.random.key(1), x),
                                     tx=optax.sgd(0.1))
  grads = jax.grad(lambda v: jnp.sum(dense.apply(v, x)))(ts.params)
  ts = ts.apply_gradients(grads=grads)
  state = ts.params[fp8.OVERWRITE_WITH_GRADIENT]["Fp8DotGeneral_0"]["fp8_state"]
  assert float(state.lhs.amax_history[0]) == float(jnp.abs(x).max())


# ------------------------------------------------------------------ Flax layers
@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_linen_dense_general_and_einsum_hold_their_state():
  recipe = fp8.make_fp8_recipe("delayed", history_len=4)
  x = jax.random.normal(jax.random.key(0), (3, 2, 32))
  layer = nn.DenseGeneral((2, 4), axis=(-2, -1), dot_general_cls=functools.partial(
      Fp8DotGeneral, recipe=recipe))
  variables = layer.init(jax.random.key(1), x)
  assert layer.apply(variables, x).shape == (3, 2, 4)

  class Scores(nn.Module):
    subscripts: str

    @nn.compact
    def __call__(self, a, b):
      return Fp8DotGeneral(recipe=recipe).einsum(self.subscripts, a, b)

  q = jax.random.normal(jax.random.key(2), (6, 8)) * 5       # the input
  k = jax.random.normal(jax.random.key(3), (4, 8)) * 0.1     # the kernel
  direct = fp8.fp8_dot_general(q, k, (((1,), (1,)), ((), ())), fp8.fp8_state(recipe),
                               recipe)
  # for "nm", jnp.einsum calls dot_general(k, q): the kernel must stay rhs
  for subscripts, want in (("md,nd->mn", direct), ("md,nd->nm", direct.T)):
    module = Scores(subscripts)
    variables = module.init(jax.random.key(4), q, k)
    np.testing.assert_array_equal(module.apply(variables, q, k), want)
    grads = jax.grad(lambda v: jnp.sum(module.apply(v, q, k)))(variables)
    state = grads[fp8.OVERWRITE_WITH_GRADIENT]["Fp8DotGeneral_0"]["fp8_state"]
    assert float(state.lhs.amax_history[0]) == float(jnp.abs(q).max()), subscripts
    assert float(state.rhs.amax_history[0]) == float(jnp.abs(k).max()), subscripts


def _nnx_value(variable):
  get = getattr(variable, "get_value", None)  # flax >= 0.12; .value before
  return get() if get is not None else variable.value


def _only(state, kind):
  only = getattr(nnx, "filter_state", None)  # flax >= 0.12; State.filter before
  return only(state, kind) if only is not None else state.filter(kind)


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_nnx_linear_and_einsum_take_the_product_and_update_their_state():
  recipe = fp8.make_fp8_recipe("current", history_len=4)
  x = jax.random.normal(jax.random.key(0), (4, 2, 8)) * 2
  flat = x.reshape(4, 16)
  for model, product, inputs, dims in [
      (nnx.Linear(16, 8, dot_general=NnxFp8DotGeneral(recipe), rngs=nnx.Rngs(0)),
       "dot_general", flat, DENSE),
      (nnx.LinearGeneral((2, 8), 8, axis=(-2, -1), rngs=nnx.Rngs(0),
                         dot_general=NnxFp8DotGeneral(recipe)),
       "dot_general", x, (((1, 2), (0, 1)), ((), ()))),
      (nnx.Einsum("bd,dk->bk", (16, 8), einsum_op=NnxFp8Einsum(recipe),
                  rngs=nnx.Rngs(0)), "einsum_op", flat, DENSE)]:
    fp8_state = lambda: _nnx_value(getattr(model, product).fp8_state)
    kernel = _nnx_value(model.kernel)
    want = fp8.fp8_dot_general(inputs, kernel, dims, fp8_state(), recipe)
    if model.bias is not None:
      want = want + _nnx_value(model.bias)
    np.testing.assert_allclose(model(inputs), want, rtol=1e-6)
    both = nnx.DiffState(0, (nnx.Param, OverwriteWithGradient))
    grads = nnx.grad(lambda m: jnp.sum(m(inputs)), argnums=both)(model)
    nnx.update(model, _only(grads, OverwriteWithGradient))
    state = fp8_state()
    assert isinstance(state, fp8.Fp8State), type(state)
    assert float(state.lhs.amax_history[0]) == float(jnp.abs(x).max())
    # in float32 (NumPy 1.x would divide a float32 by a Python float in float64)
    assert float(state.lhs.scale) == float(np.float32(448.0)
                                           / np.float32(jnp.abs(x).max()))
    assert float(state.rhs.amax_history[0]) == float(jnp.abs(kernel).max())


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("call, exc, name", [
    (lambda: fp8.make_fp8_recipe("mxfp8"), ValueError, "recipe"),
    (lambda: fp8.make_fp8_recipe(margin=-1), ValueError, "margin"),
    (lambda: fp8.make_fp8_recipe(margin=0.5), TypeError, "margin"),
    (lambda: fp8.make_fp8_recipe(history_len=0), ValueError, "history_len"),
    (lambda: fp8.make_fp8_recipe(amax_compute="mean"), ValueError, "amax_compute"),
    (lambda: fp8.make_fp8_recipe("blockwise", block_size=0), ValueError, "block_size"),
    (lambda: fp8.quantize(jnp.ones(2), 1.0, jnp.float16), TypeError, "dtype"),
    (lambda: fp8.quantize(jnp.ones(2), 1.0, jnp.int8), TypeError, "dtype"),
    (lambda: fp8.quantize_blockwise(jnp.ones((2, 2)), (2,), E4M3), ValueError,
     "block_shape"),
    (lambda: fp8.fp8_state("delayed"), TypeError, "recipe"),
    (lambda: fp8.fp8_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), DENSE, _state(),
                                 "delayed"), TypeError, "recipe"),
    (lambda: fp8.fp8_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), DENSE,
                                 jax.tree_util.tree_map(
                                     lambda a: a.astype(jnp.bfloat16), _state()),
                                 fp8.make_fp8_recipe()), TypeError, "state"),
    (lambda: fp8.fp8_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), (1, 0), _state(),
                                 fp8.make_fp8_recipe()), TypeError, "dimension_numbers"),
    (lambda: fp8_state.merge({"a": 1.0}, {"a": 1.0}, fp8.make_fp8_recipe()), TypeError, "a"),
    (lambda: mpscale.split_overwrite([1]), TypeError, "tree"),
    (lambda: Fp8DotGeneral().init(jax.random.key(0), jnp.ones((2, 3)), jnp.ones((3, 4)),
                                  method=lambda m, a, b: m.einsum("...d,dk->...k",
                                                                  a, b)),
     ValueError, "subscripts"),
])
def test_bad_input_is_refused_by_name(call, exc, name):
  with pytest.raises(exc) as info:
    call()
  assert isinstance(info.value, mpscale.ArgumentError)
  assert info.value.name == name, str(info.value)
