"""Tests for mpscale.precision: parsing, presets, casts and the keep-float32 predicate."""

from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpscale
from mpscale.precision import _policy as policy_lib

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)

F32, F16, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)


def dtypes(p):
  return (p.param_dtype, p.compute_dtype, p.output_dtype)


@pytest.mark.parametrize("spec, expected", [
    ("params=float32,compute=float16,output=float32", (F32, F16, F32)),
    ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
    ("param=fp16, compute=half, out=float16", (F16, F16, F16)),
    ("compute=bfloat16", (F32, BF16, F32)),
    ("bfloat16", (BF16, BF16, BF16)),
    ("float32", (F32, F32, F32)),
])
def test_get_policy_parses_role_dtype_strings(spec, expected):
  assert dtypes(mpscale.make_policy(spec)) == expected


@pytest.mark.parametrize("name, expected, needs_scaling, keeps", [
    ("O0", (F32, F32, F32), False, False),
    ("O1", (F32, F16, F32), True, True),
    ("o2", (F32, F16, F32), True, True),
    ("O3", (F16, F16, F16), True, False),
    ("bf16", (F32, BF16, F32), False, False),
    ("bf16-pure", (BF16, BF16, F32), False, False),
])
def test_presets(name, expected, needs_scaling, keeps):
  p = mpscale.make_policy(name)
  assert dtypes(p) == expected
  assert p.needs_loss_scaling is needs_scaling
  assert (p.keep_fp32 is mpscale.default_keep_fp32) is keeps


def test_str_round_trips():
  p = mpscale.Policy("float32", "bfloat16", "float16")
  assert str(p) == "params=float32,compute=bfloat16,output=float16"
  assert dtypes(mpscale.make_policy(str(p))) == dtypes(p)


def test_get_policy_returns_a_policy_unchanged():
  p = mpscale.Policy(jnp.float32, jnp.float16, jnp.float32)
  assert mpscale.make_policy(p) is p


@pytest.mark.parametrize("spec, error, match", [
    ("O4", ValueError, "unknown policy"),
    ("params=float8", ValueError, "unknown dtype"),
    ("weights=float32", ValueError, "bad policy entry"),
    ("params=float32,p=float16", ValueError, "twice"),
    (3, TypeError, "Policy or a str"),
])
def test_get_policy_errors(spec, error, match):
  with pytest.raises(error, match=match):
    mpscale.make_policy(spec)


def test_policy_rejects_non_float_dtypes_and_bad_predicates():
  with pytest.raises(TypeError, match="floating"):
    mpscale.Policy(jnp.int32)
  with pytest.raises(TypeError, match="keep_fp32"):
    mpscale.Policy(keep_fp32="norm")


def test_needs_loss_scaling_follows_float16():
  assert mpscale.Policy(compute_dtype=jnp.float16).needs_loss_scaling
  assert not mpscale.Policy(compute_dtype=jnp.bfloat16).needs_loss_scaling
  assert not mpscale.Policy().needs_loss_scaling


def test_loss_scale_for_picks_the_wrapper_the_policy_needs():
  params = {"w": jnp.ones(3)}
  scaled = mpscale.policy_loss_scale(mpscale.make_policy("O2"), optax.sgd(0.1),
                                  init_scale=64.0)
  assert float(mpscale.loss_scale_of(scaled.init(params))) == 64.0
  plain = mpscale.policy_loss_scale(mpscale.make_policy("bf16"), optax.sgd(0.1))
  assert float(mpscale.loss_scale_of(plain.init(params))) == 1.0
  assert isinstance(plain.init(params), mpscale.LossScaleState)


def test_casts_touch_only_floating_arrays():
  p = mpscale.make_policy("params=float32,compute=float16,output=bfloat16")
  tree = {"w": jnp.ones((2, 3), jnp.float32), "ids": jnp.arange(3),
          "lr": 0.5, "h": np.ones(2, np.float64)}
  out = p.cast_to_compute(tree)
  assert out["w"].dtype == F16 and out["h"].dtype == F16
  assert out["ids"].dtype == jnp.arange(3).dtype
  assert out["lr"] == 0.5 and isinstance(out["lr"], float)
  assert p.cast_to_output(tree)["w"].dtype == BF16
  assert p.cast_to_param(out)["w"].dtype == F32
  chex.assert_trees_all_equal(p.cast_to_param(out)["w"], tree["w"])


def test_casts_work_under_jit():
  p = mpscale.make_policy("O3")
  out = jax.jit(p.cast_to_compute)({"w": jnp.ones(3)})
  assert out["w"].dtype == F16


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.LayerNorm()(nn.Dense(4)(x)))


def test_default_keep_fp32_keeps_norm_and_bias_leaves():
  params = _Block().init(jax.random.PRNGKey(0), jnp.ones((1, 3)))["params"]
  cast = mpscale.make_policy("O2").cast_to_compute(params)
  assert cast["Dense_0"]["kernel"].dtype == F16
  assert cast["Dense_1"]["kernel"].dtype == F16
  assert cast["Dense_0"]["bias"].dtype == F32
  assert cast["LayerNorm_0"]["scale"].dtype == F32
  assert cast["LayerNorm_0"]["bias"].dtype == F32


def test_keep_fp32_by_name_is_case_insensitive_and_per_component():
  keep = mpscale.keep_fp32_by_name("norm")
  p = mpscale.Policy(jnp.float32, jnp.bfloat16, jnp.float32, keep_fp32=keep)
  tree = {"RMSNorm_3": {"w": jnp.ones(2)}, "mlp": {"w": jnp.ones(2)}}
  out = p.cast_to_compute(tree)
  assert out["RMSNorm_3"]["w"].dtype == F32
  assert out["mlp"]["w"].dtype == BF16
  with pytest.raises(ValueError):
    mpscale.keep_fp32_by_name()


def test_keep_fp32_sees_the_leaf():
  p = mpscale.Policy(jnp.float32, jnp.float16, jnp.float32,
                     keep_fp32=lambda path, x: np.ndim(x) < 2)
  out = p.cast_to_compute({"a": jnp.ones((2, 2)), "b": jnp.ones(2, jnp.float16)})
  assert out["a"].dtype == F16 and out["b"].dtype == F32


def test_policy_is_hashable_and_frozen():
  p = mpscale.make_policy("O1")
  assert hash(p) == hash(mpscale.make_policy("O2"))
  with pytest.raises(AttributeError):
    p.compute_dtype = jnp.float32


def test_module_names_the_presets_in_its_error():
  with pytest.raises(ValueError, match="O0"):
    policy_lib.make_policy("mixed")


def test_a_model_that_fixes_float32_under_a_16_bit_policy_is_warned_about():
  """Issue #42: Flax's ResNet fixes ``dtype=jnp.float32`` on its layers, so under O2
  it computed entirely in float32 and nothing said so. The step warns, naming the
  share of matrix FLOPs left in float32; a model whose layers follow the policy
  gets no warning."""
  import warnings

  class Net(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
      h = nn.relu(nn.Dense(64, dtype=self.dtype)(x))
      return nn.Dense(1, dtype=self.dtype)(h)[:, 0]

  batch = {"x": jnp.ones((16, 32)), "y": jnp.zeros((16,))}
  for dtype, warns in ((jnp.float32, True), (None, False)):
    net = Net(dtype)
    params = net.init(jax.random.key(0), batch["x"])["params"]

    def loss(p, b, net=net):
      out = net.apply({"params": p}, b["x"].astype(jnp.bfloat16))
      return jnp.mean((out.astype(jnp.float32) - b["y"]) ** 2)

    init, step = mpscale.make_train_step(loss, optax.sgd(0.1), policy="bf16")
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      step.lower(init(params), batch)
    said = [str(w.message) for w in caught if "matrix FLOPs" in str(w.message)]
    assert bool(said) == warns, said
    if warns:
      assert "100% of the loss's matrix FLOPs run in float32" in said[0]
