"""Mixtures of experts in and out of Hugging Face checkpoints (Mixtral, Qwen3-MoE):
the logits against transformers' own PyTorch models on random checkpoints the tests
draw (each expert one tensor there, stacked into ``[layers, E, ...]`` here), the
load-balancing loss's weight as transformers applies it and the loss itself,
exact round trips read back by transformers, the experts read into their layout
on an expert axis, and the configs and models neither side can hold refused
naming the key.

Needs the optional ``outside`` extra (transformers) and the CPU build of torch;
Qwen3-MoE needs transformers >= 4.51."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpscale.trainer import hf
from mpscale.trainer.hf import tensors as _safetensors
from mpscale.trainer.models.lm import TinyLM
from tests.trainer.hf.test_hf import LENGTH, _checkpoint, _close, _torch_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = {"mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig"}
EXPERTS = 4


def _config(family, rng, **overrides):
  """A small random mixture of ``family`` (transformers' config class): width 32, 2
  layers, 4 experts, each token to 1 to 3 of them."""
  name = FAMILIES[family]
  if not hasattr(transformers, name):
    pytest.skip(f"transformers {transformers.__version__} has no {name} "
                "(Qwen3-MoE: transformers >= 4.51)")
  width = int(rng.integers(24, 48))
  settings = dict(vocab_size=int(rng.integers(64, 96)), hidden_size=32,
                  num_attention_heads=4, num_key_value_heads=int(rng.choice([1, 2])),
                  num_hidden_layers=2, num_experts_per_tok=int(rng.integers(1, 4)),
                  rope_theta=float(rng.uniform(1e3, 1e6)),
                  rms_norm_eps=float(rng.choice([1e-5, 1e-6])),
                  max_position_embeddings=64, tie_word_embeddings=False)
  if family == "mixtral":
    settings.update(num_local_experts=EXPERTS, intermediate_size=width)
  else:  # the dense width is another than the experts'; head_dim is its own
    settings.update(num_experts=EXPERTS, moe_intermediate_size=width,
                    intermediate_size=int(rng.integers(48, 96)), head_dim=12)
  settings.update(overrides)
  return getattr(transformers, name)(**settings)


@pytest.mark.parametrize("family, overrides", [
    ("mixtral", {"sliding_window": 6}),
    ("qwen3_moe", {"norm_topk_prob": True}),
    ("qwen3_moe", {"norm_topk_prob": False}),
], ids=["mixtral-window", "qwen3_moe-normalized", "qwen3_moe-unnormalized"])
def test_logits_equal_transformers(family, overrides, tmp_path):
  rng = np.random.default_rng([len(family), len(str(overrides))])
  config = _config(family, rng, **overrides)
  theirs = _checkpoint(config, tmp_path, seed=int(rng.integers(1 << 30)))
  model, params = hf.load(str(tmp_path), seq_len=LENGTH)
  assert (model.family, model.num_experts, model.experts_per_token) == (
      family, EXPERTS, config.num_experts_per_tok)
  assert model.router_normalize == overrides.get("norm_topk_prob", True)
  assert model.sliding_window == overrides.get("sliding_window")
  width = config.intermediate_size if family == "mixtral" else (
      config.moe_intermediate_size)
  assert params["stages"]["moe"]["gate"].shape == (2, EXPERTS, 32, width)
  assert params["stages"]["moe"]["router"].shape == (2, 32, EXPERTS)
  tokens = rng.integers(0, config.vocab_size, (2, LENGTH))
  logits = model.logits(params, jnp.asarray(tokens, jnp.int32))
  assert logits.dtype == jnp.float32
  _close(logits, _torch_logits(theirs, tokens))


def test_the_load_balancing_loss_is_transformers_own_when_it_is_on(tmp_path):
  """``aux_loss_coef`` is ``router_aux_loss_coef`` when ``output_router_logits``
  is on (transformers adds the loss then only), else 0; with one layer the loss is
  transformers' own (with more, transformers takes one product of means over
  every layer's tokens, mpscale the mean of the blocks' own)."""
  rng = np.random.default_rng(17)
  on = _config("qwen3_moe", rng, num_hidden_layers=1, output_router_logits=True,
               router_aux_loss_coef=0.25, norm_topk_prob=True)
  theirs = _checkpoint(on, tmp_path / "on", seed=17)
  model, params = hf.load(str(tmp_path / "on"), seq_len=LENGTH)
  assert model.aux_loss_coef == 0.25
  tokens = rng.integers(0, on.vocab_size, (2, LENGTH))
  batch = {"inputs": jnp.asarray(tokens, jnp.int32),
           "targets": jnp.asarray(np.roll(tokens, -1, axis=1), jnp.int32)}
  _, state = model.loss_fn(params, batch, model_state=model.init_model_state())
  with torch.no_grad():
    expected = theirs(torch.as_tensor(tokens)).aux_loss.item()
  np.testing.assert_allclose(float(state["moe"]["aux_loss"][0]), expected, rtol=1e-5)
  off = _config("mixtral", rng, output_router_logits=False, router_aux_loss_coef=0.25)
  (tmp_path / "off").mkdir()
  (tmp_path / "off" / "config.json").write_text(off.to_json_string())
  assert hf.model_fields(str(tmp_path / "off"))["aux_loss_coef"] == 0.0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_is_read_by_transformers_and_round_trips_exactly(family, tmp_path):
  rng = np.random.default_rng([7, len(family)])
  config = _config(family, rng, output_router_logits=True, router_aux_loss_coef=0.02)
  _checkpoint(config, tmp_path / "in", seed=7)
  model, params = hf.load(str(tmp_path / "in"), seq_len=LENGTH)
  assert model.aux_loss_coef == 0.02
  params = jax.tree_util.tree_map(lambda x: x + 0.01, params)  # "trained"
  hf.save(model, params, str(tmp_path / "out"))
  exported = json.loads((tmp_path / "out" / "config.json").read_text())
  assert exported["output_router_logits"] and exported["router_aux_loss_coef"] == 0.02
  down = ("model.layers.1.block_sparse_moe.experts.3.w2.weight" if family ==
          "mixtral" else "model.layers.1.mlp.experts.3.down_proj.weight")
  written = _safetensors.Tensors(str(tmp_path / "out"))
  np.testing.assert_array_equal(written.get(down),
                                np.asarray(params["stages"]["moe"]["down"][1, 3]).T)
  theirs = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "out", torch_dtype=torch.float32, attn_implementation="eager")
  again, loaded = hf.load(str(tmp_path / "out"), seq_len=LENGTH)
  assert again == model
  jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, params)
  tokens = rng.integers(0, config.vocab_size, (2, LENGTH))
  _close(again.logits(loaded, jnp.asarray(tokens)), _torch_logits(theirs, tokens))


def test_experts_load_into_their_layout_on_an_expert_axis(tmp_path):
  # 4 experts over expert 2 and each expert's width over tensor 2: each device
  # reads its experts' slices of their tensors, and holds what a plain load holds
  config = _config("mixtral", np.random.default_rng(3), intermediate_size=32)
  _checkpoint(config, tmp_path, seed=3)
  _, plain = hf.load(str(tmp_path), seq_len=LENGTH)
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2, 2),
                           ("fsdp", "expert", "tensor"))
  _, sharded = hf.load(str(tmp_path), seq_len=LENGTH, mesh=mesh)
  gate = sharded["stages"]["moe"]["gate"]
  assert gate.sharding.shard_shape(gate.shape)[1] == EXPERTS // 2
  assert gate.sharding.shard_shape(gate.shape)[3] == 32 // 2
  jax.tree_util.tree_map(np.testing.assert_array_equal, sharded, plain)


@pytest.mark.parametrize("family, edit, match", [
    ("qwen3_moe", {"mlp_only_layers": [0]},
     r"mlp_only_layers = \[0\].*dense MLPs among the mixtures"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, r"decoder_sparse_step = 2"),
    ("mixtral", {"router_jitter_noise": 0.1}, r"router_jitter_noise = 0\.1"),
    ("qwen3_moe", {"moe_intermediate_size": None}, r"moe_intermediate_size is missing"),
    ("mixtral", {"num_experts": 4}, r"num_experts: not a key"),
], ids=["mlp_only_layers", "decoder_sparse_step", "jitter", "missing", "foreign"])
def test_configs_mpscale_does_not_compute_are_refused_naming_the_key(
    family, edit, match, tmp_path):
  config = json.loads(_config(family, np.random.default_rng(1)).to_json_string())
  config.update(edit)
  (tmp_path / "config.json").write_text(json.dumps(
      {k: v for k, v in config.items() if v is not None}))
  with pytest.raises(hf.HFCheckpointError, match=r"config\.json: " + match):
    hf.load(str(tmp_path), seq_len=LENGTH)


@pytest.mark.parametrize("family, setting", [
    ("mixtral", {"router_normalize": False}), ("mixtral", {"router": "sigmoid"}),
    ("qwen3_moe", {"shared_d_ff": 16}), ("qwen3_moe", {"router_bias_rate": 0.001}),
], ids=["mixtral-unnormalized", "sigmoid", "shared", "bias"])
def test_save_refuses_a_mixture_transformers_cannot_hold_and_writes_nothing(
    family, setting, tmp_path):
  model = TinyLM(vocab_size=64, d_model=32, num_heads=4, num_layers=2, d_ff=48,
                 seq_len=16, family=family, num_experts=EXPERTS, num_kv_heads=2,
                 **setting)
  params = jax.eval_shape(model.init, jax.random.key(0))  # refused before it is read
  (name, _), = setting.items()
  with pytest.raises(hf.HFCheckpointError, match=rf"model\.{name} = "):
    hf.save(model, params, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")


def test_init_from_reads_a_mixtures_sizes(tmp_path):
  """``model.init_from`` of a mixture takes its experts' sizes and routing from
  ``config.json`` (``norm_topk_prob`` false here: not the default)."""
  from mpscale.trainer.config import load as config_lib
  config = _config("qwen3_moe", np.random.default_rng(5), norm_topk_prob=False,
                   vocab_size=256)
  (tmp_path / "moe").mkdir()
  (tmp_path / "moe" / "config.json").write_text(config.to_json_string())
  cfg = config_lib.config_from_dict(
      {"model": {"init_from": "moe", "seq_len": 16}}, "<test>",
      base_dir=str(tmp_path))
  assert (cfg.model.family, cfg.model.num_experts, cfg.model.experts_per_token,
          cfg.model.expert_d_ff, cfg.model.router_normalize) == (
              "qwen3_moe", EXPERTS, config.num_experts_per_tok,
              config.moe_intermediate_size, False)


def test_a_key_config_json_leaves_out_means_what_transformers_makes_of_it(tmp_path):
  # Qwen3MoeConfig's norm_topk_prob defaults to false; Mixtral always renormalizes
  for family, normalize in (("qwen3_moe", False), ("mixtral", True)):
    config = json.loads(_config(family, np.random.default_rng(2)).to_json_string())
    config.pop("norm_topk_prob", None)
    (tmp_path / family).mkdir()
    (tmp_path / family / "config.json").write_text(json.dumps(config))
    model = TinyLM(**hf.model_fields(str(tmp_path / family)))
    assert model.router_normalize == normalize
