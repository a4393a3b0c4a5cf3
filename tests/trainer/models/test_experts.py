"""The built-in LM's mixtures of experts (``mixtral``, ``qwen3_moe``) in the trainer:
experts split over ``mesh.expert`` 2 and 4, with data, FSDP, tensor and context axes
beside it, train as one device does (float32, two steps, the routing state included); a
skipped (overflowed) step leaves the balancing bias bit-identical on every device;
the capacity variant's drops reach the log's columns; bad settings are refused by
key."""

import jax
import numpy as np
import pytest

from mpscale.trainer.config import build as builders
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.config.errors import ConfigError
import mpscale
from mpscale import validation

SIZES = {"mixtral": {"num_kv_heads": 2},
         "qwen3_moe": {"num_kv_heads": 2, "head_dim": 12, "expert_d_ff": 24}}


def _config(family="mixtral", mesh=None, **sections):
  model = {"family": family, "vocab_size": 256, "d_model": 32, "num_heads": 4,
           "num_layers": 2, "d_ff": 48, "seq_len": 16, "num_experts": 4,
           "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "router_bias_rate": 0.01,
           **SIZES[family], **sections.pop("model", {})}
  raw = {"model": model, "data": {"batch_size": 8},
         "precision": {"policy": "fp32"}, "clip": {"max_norm": None},
         # Adam with eps 1: steps of about lr x the gradient itself
         "optimizer": {"name": "adamw", "learning_rate": 1e-2, "adamw": {"eps": 1.0}},
         "mesh": mesh or {"data": 1}, **sections}
  return config_lib.config_from_dict(raw, "<test>")


def _tokens(seed=0):
  tokens = np.random.default_rng(seed).integers(0, 256, (8, 17)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _run(cfg, batches):
  setup = builders.build(cfg)
  state = setup.init(setup.init_params())
  out = []
  for batch in batches:
    if setup.mesh is not None:
      batch = jax.device_put(batch, builders.batch_sharding(setup.mesh))
    state, metrics = setup.step(state, batch)
    out.append(jax.device_get((metrics, state.model_state["moe"]["bias"])))
  return jax.device_get(state), out


_ONE = {}


@pytest.mark.parametrize("family,mesh", [
    ("mixtral", {"data": 2, "expert": 2}), ("mixtral", {"fsdp": 2, "expert": 4}),
    ("qwen3_moe", {"expert": 2, "tensor": 2, "data": 2}),
    ("mixtral", {"context": 2, "expert": 2, "data": 2})])
def test_experts_split_over_the_expert_axis_train_as_one_device(family, mesh):
  batches = [_tokens(0), _tokens(1)]
  if family not in _ONE:
    _ONE[family] = _run(_config(family), batches)
  one, one_metrics = _ONE[family]
  split, split_metrics = _run(_config(family, mesh), batches)
  for a, b in zip(jax.tree_util.tree_leaves((one.params, one.model_state)),
                  jax.tree_util.tree_leaves((split.params, split.model_state))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  for (a, bias_a), (b, bias_b) in zip(one_metrics, split_metrics):
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
    np.testing.assert_array_equal(bias_a, bias_b)
    for key in a["moe"]:
      np.testing.assert_allclose(a["moe"][key], b["moe"][key], rtol=1e-5, atol=1e-6)
  # the bias moved (the test would not see a bias the step never updated)
  assert np.abs(one_metrics[0][1]).max() > 0


def test_a_skipped_step_leaves_the_routing_bias_bit_identical_on_every_device():
  cfg = _config(mesh={"data": 2, "expert": 4},
                precision={"policy": "O2"},
                loss_scale={"kind": "dynamic", "init_scale": 2.0 ** 8})
  setup = builders.build(cfg)
  state = setup.init(setup.init_params())
  place = lambda b: jax.device_put(b, builders.batch_sharding(setup.mesh))  # noqa: E731
  state, metrics = setup.step(state, place(_tokens(0)))
  assert int(metrics["skipped"]) == 0
  before = np.asarray(jax.device_get(state.model_state["moe"]["bias"]))
  assert np.abs(before).max() > 0  # the first step moved it
  # a loss scale the float16 backward overflows at: the step is skipped
  state, metrics = setup.step(_with_scale(state, 2.0 ** 120), place(_tokens(1)))
  assert int(metrics["skipped"]) == 1
  after = state.model_state["moe"]["bias"]
  for shard in after.addressable_shards:  # each device's copy
    np.testing.assert_array_equal(np.asarray(shard.data), before[shard.index])


def _with_scale(state, scale):
  """``state`` with its dynamic loss scale set to ``scale``."""
  def set_scale(x):
    if isinstance(x, mpscale.LossScaleState):
      return x._replace(loss_scale=jax.numpy.full_like(x.loss_scale, scale))
    return x
  return state._replace(opt_state=jax.tree_util.tree_map(
      set_scale, state.opt_state,
      is_leaf=lambda x: isinstance(x, mpscale.LossScaleState)))


def test_the_capacity_variant_logs_its_drops_and_dropless_none():
  dropless = _run(_config(), [_tokens(0)])[1][0][0]["moe"]
  capped = _run(_config(model={"capacity_factor": 0.5}), [_tokens(0)])[1][0][0]["moe"]
  assert float(dropless["dropped"]) == 0
  # half the capacity of an even load: at least half the assignments are dropped
  assert float(capped["dropped"]) >= 0.5
  assert float(dropless["load_max"]) >= 1 / 4 >= float(dropless["load_min"])


@pytest.mark.parametrize("model,mesh,key", [
    ({"num_experts": 6}, {"expert": 4}, "model.num_experts"),
    ({"experts_per_token": 5}, None, "model.experts_per_token"),
    ({"num_experts": 0}, None, "model.num_experts"),
    ({}, {"stage": 2}, "model.num_experts"),
])
def test_bad_expert_settings_are_refused_by_key(model, mesh, key):
  with pytest.raises((ConfigError, validation.ArgumentError), match=key):
    builders.build(_config(model=model, mesh=mesh), devices=jax.devices()[:8])
  with pytest.raises(ConfigError, match="mesh.expert"):
    config_lib.config_from_dict({"model": {"family": "llama"}, "mesh": {"expert": 2}},
                                "<test>")
