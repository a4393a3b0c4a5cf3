"""The built-in LM's families (mpscale.trainer.models.families): each equals itself
unpipelined under 1F1B and ZB-H1 (float32), FP8 names each family's matrices, the
rotary embedding and its Llama 3.1 scaling by hand, and bad settings refused by
name. Each family against transformers' own model: tests/trainer/hf/test_hf.py."""

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
import optax
import pytest

import mpscale
from mpscale.trainer.models import families
from mpscale.trainer.models.lm import TinyLM
from tests import helpers

FAMILY_SIZES = {
    "llama": dict(num_kv_heads=2),
    "mistral": dict(num_kv_heads=1, sliding_window=5),
    "qwen2": dict(num_kv_heads=2, tie_embeddings=True),
    "qwen3": dict(num_kv_heads=2, head_dim=12),
}


def _model(family, **kwargs):
  return TinyLM(vocab_size=64, d_model=32, num_heads=4, num_layers=4, d_ff=48,
                seq_len=12, family=family, **FAMILY_SIZES[family], **kwargs)


def _batch(rows=8, length=12, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 64, size=(rows, length + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


_UNPIPELINED = {}
"""A family's two unpipelined steps, computed once for both schedules' cases."""


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
@pytest.mark.parametrize("family", list(FAMILY_SIZES))
def test_every_family_pipelined_equals_itself_unpipelined(family, schedule):
  model = _model(family)
  params, batch = jax.jit(model.init)(jax.random.key(1)), _batch()
  pipeline = mpscale.Pipeline(model.embed_fn, model.stage_fn, model.head_fn, 4,
                              schedule=schedule)
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "stage"))
  tx = optax.sgd(0.5)  # the gradients themselves (Adam would amplify rounding)
  init, step = mpscale.make_train_step(pipeline, tx, mesh=mesh, per_token_loss=True)
  if family not in _UNPIPELINED:
    ref_init, ref_step = mpscale.make_train_step(model.loss_fn, tx,
                                                 per_token_loss=True)
    ref_state = ref_init(params)
    for _ in range(2):
      ref_state, ref_metrics = ref_step(ref_state, batch)
    _UNPIPELINED[family] = jax.device_get((ref_state.params, ref_metrics["loss"]))
  ref_params, ref_loss = _UNPIPELINED[family]
  state = init(params)
  for _ in range(2):
    state, metrics = step(state, batch)
  helpers.assert_close(metrics["loss"], ref_loss, 1e-5)
  helpers.assert_close(state.params, ref_params, 1e-5)


def test_fp8_multiplies_each_familys_matrices_for_the_roles_named():
  recipe = mpscale.make_fp8_recipe("delayed")
  model = _model("qwen3", fp8=recipe, fp8_products=("qkv", "fc"), bf16_layers=0)
  assert model.products == ("q", "k", "v", "gate", "up")
  state = model.init_model_state()
  stacked = state[mpscale.precision.OVERWRITE_WITH_GRADIENT]["stages"]
  assert set(stacked) == {"q", "k", "v", "gate", "up"}
  params, batch = jax.jit(model.init)(jax.random.key(0)), _batch()
  (fp8_loss, _), new_state = jax.jit(model.loss_fn)(params, batch, state)
  plain, _ = jax.jit(model.loss_fn)(params, batch)
  assert np.isfinite(fp8_loss) and fp8_loss != plain  # rounded through FP8
  np.testing.assert_allclose(fp8_loss, plain, rtol=0.05)


def test_rotary_embedding_rotates_each_pair_by_its_position():
  # one head of width 4: pairs (0, 2) and (1, 3) turn by position x frequency
  inv_freq = families.rope_frequencies(4, 100.0)
  np.testing.assert_allclose(inv_freq, [1.0, 0.1], rtol=1e-6)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 3, 1, 4)), jnp.float32)
  out = families.apply_rope(x, inv_freq)
  for pos in range(3):
    for i, freq in enumerate([1.0, 0.1]):
      c, s = math.cos(pos * freq), math.sin(pos * freq)
      a, b = x[0, pos, 0, i], x[0, pos, 0, i + 2]
      np.testing.assert_allclose(out[0, pos, 0, i], a * c - b * s, atol=1e-6)
      np.testing.assert_allclose(out[0, pos, 0, i + 2], b * c + a * s, atol=1e-6)


def test_llama_3_1_scaling_stretches_long_wavelengths_only():
  scaling = families.RopeScaling(factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0,
                                 original_max_position_embeddings=64)
  inv_freq = families.rope_frequencies(16, 10000.0)
  scaled = np.asarray(scaling.apply(inv_freq))
  wavelen = 2 * np.pi / np.asarray(inv_freq)
  short, long = wavelen < 64 / 4, wavelen > 64 / 1
  np.testing.assert_array_equal(scaled[short], np.asarray(inv_freq)[short])
  np.testing.assert_allclose(scaled[long], np.asarray(inv_freq)[long] / 8, rtol=1e-6)
  between = ~short & ~long
  assert between.any()
  assert np.all((scaled[between] < np.asarray(inv_freq)[between])
                & (scaled[between] > np.asarray(inv_freq)[between] / 8))


@pytest.mark.parametrize("kwargs, match", [
    (dict(family="falcon"), "family"),
    (dict(family="llama", num_kv_heads=3), r"num_heads.*num_kv_heads"),
    (dict(family="gpt", num_kv_heads=2), "num_kv_heads is not a setting of the gpt"),
    (dict(family="llama", sliding_window=4), "sliding_window.*only mistral"),
    (dict(family="llama", rope_scaling={"rope_type": "yarn"}),
     r"rope_scaling.*rope_type 'yarn'"),
])
def test_bad_family_settings_are_refused_by_name(kwargs, match):
  sizes = dict(vocab_size=64, d_model=32, num_heads=4, num_layers=2, d_ff=48,
               seq_len=12)
  with pytest.raises((ValueError, TypeError), match=match):
    if "rope_scaling" in kwargs:
      kwargs = {**kwargs, "rope_scaling": families.RopeScaling.from_dict(
          kwargs["rope_scaling"])}
    TinyLM(**sizes, **kwargs)


def test_fsdp_gathers_a_recomputed_layers_weights_at_most_twice():
  """The built-in Llama under FSDP 8 with each layer recomputed (``train.recompute:
  full``):
  all-gathered bytes at most twice the split parameters' (each layer's weights
  gathered for the forward and once more for the backward's recompute, whose
  gathers its products' backward uses; the embedding once). A checkpoint of each
  product inside the recomputed layer, as before, gathered them a third time."""
  from mpscale.trainer.config import build as builders  # noqa: PLC0415
  from mpscale.trainer.config import load as config_lib  # noqa: PLC0415
  from mpscale.trainer.planning import hlo  # noqa: PLC0415
  cfg = config_lib.config_from_dict({
      "model": {"family": "llama", "vocab_size": 256, "d_model": 128, "num_heads": 4,
                "num_kv_heads": 2, "num_layers": 2, "d_ff": 256, "seq_len": 64},
      "data": {"batch_size": 16}, "precision": {"policy": "fp32"},
      "mesh": {"data": 1, "fsdp": 8}, "train": {"recompute": "full"}}, "<test>")
  setup = builders.build(cfg)
  shapes = jax.eval_shape(setup.init_params)
  state = setup.init(shapes)  # from shapes: nothing allocated
  batch = {k: jax.ShapeDtypeStruct((16, 64), jnp.int32,
                                   sharding=builders.batch_sharding(setup.mesh))
           for k in ("inputs", "targets")}
  text = setup.step.lower(state, batch).compile().as_text()
  split = 4 * sum(x.size for x in jax.tree_util.tree_leaves(shapes) if x.ndim >= 2)
  gathered = hlo.collectives(text)["all-gather"]["bytes"]
  assert 1.0 * split <= gathered <= 2.0 * split, gathered / split
