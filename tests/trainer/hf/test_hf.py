"""Hugging Face checkpoints in and out (mpscale.trainer.hf): each family's logits
against transformers' own PyTorch models, on random checkpoints the tests draw and
save with ``save_pretrained``; sharded checkpoints; tied and untied heads; Llama 3.1's
RoPE scaling; Mistral's sliding window; grouped K/V heads under tensor parallelism;
exact round trips; bad checkpoints refused naming their cause, nothing written.

Needs the optional ``outside`` extra (transformers) and the CPU build of torch; Qwen3
needs transformers >= 4.51."""

import csv
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpscale.trainer import hf
from mpscale.trainer.hf import tensors as _safetensors
from mpscale.trainer.models.lm import TinyLM

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = {"llama": "LlamaConfig", "mistral": "MistralConfig",
            "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
LENGTH = 24


def _config(family, rng, **overrides):
  """A small random config of ``family`` (transformers' class), drawn from ``rng``."""
  name = FAMILIES[family]
  if not hasattr(transformers, name):
    pytest.skip(f"transformers {transformers.__version__} has no {name} "
                "(Qwen3: transformers >= 4.51)")
  heads = int(rng.choice([4, 8]))
  kv = int(rng.choice([h for h in (1, 2, 4) if heads % h == 0]))
  settings = dict(vocab_size=int(rng.integers(96, 160)), hidden_size=64,
                  num_attention_heads=heads, num_key_value_heads=kv,
                  num_hidden_layers=2, intermediate_size=int(rng.integers(80, 140)),
                  rope_theta=float(rng.uniform(1e3, 1e6)),
                  rms_norm_eps=float(rng.choice([1e-5, 1e-6])),
                  max_position_embeddings=64, tie_word_embeddings=False)
  if family == "qwen3":
    settings["head_dim"] = 24  # not hidden / heads: Qwen3 sets it on its own
  if family == "mistral":
    settings["sliding_window"] = None
  settings.update(overrides)
  return getattr(transformers, name)(**settings)


def _checkpoint(config, folder, seed, **save_kwargs):
  """A transformers model of ``config`` with every weight random (norms too; a
  mixture's routers at unit scale, so that each token's experts are chosen by
  clear margins and with unequal weights), saved to ``folder``; returns the
  model."""
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(
      config, attn_implementation="eager", torch_dtype=torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.1 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.1 * torch.randn_like(p))
      elif name.endswith(".gate.weight"):  # a router: mlp.gate, block_sparse_moe.gate
        p.copy_(torch.randn_like(p))
  model.save_pretrained(folder, safe_serialization=True, **save_kwargs)
  return model


def _torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens))).logits.numpy()


def _close(ours, theirs, rtol=1e-4):
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  assert ours.shape == theirs.shape
  error = np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))
  assert error < rtol, error


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_equal_transformers(family, tied, tmp_path):
  rng = np.random.default_rng([len(family), tied])
  config = _config(family, rng, tie_word_embeddings=tied)
  theirs = _checkpoint(config, tmp_path, seed=int(rng.integers(1 << 30)))
  model, params = hf.load(str(tmp_path), seq_len=LENGTH)
  assert model.family == family and model.tie_embeddings == tied
  assert ("out" in params["head"]) == (not tied)
  tokens = rng.integers(0, config.vocab_size, (2, LENGTH))
  logits = model.logits(params, jnp.asarray(tokens, jnp.int32))
  assert logits.dtype == jnp.float32
  _close(logits, _torch_logits(theirs, tokens))


def test_llama_3_1_rope_scaling_and_a_sharded_checkpoint(tmp_path):
  rng = np.random.default_rng(31)
  # original_max_position_embeddings 8: every band of the scaling is met in 24
  # positions (long wavelengths stretched, short ones kept, those between blended)
  scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
  config = _config("llama", rng, rope_scaling=scaling, rope_theta=500000.0)
  theirs = _checkpoint(config, tmp_path, seed=3, max_shard_size="30KB")
  assert os.path.exists(tmp_path / _safetensors.INDEX)
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
  model, params = hf.load(str(tmp_path), seq_len=LENGTH)
  assert model.rope_scaling.factor == 8.0
  tokens = rng.integers(0, config.vocab_size, (2, LENGTH))
  _close(model.logits(params, jnp.asarray(tokens)), _torch_logits(theirs, tokens))
  # and without the scaling the logits differ: the scaling is applied
  plain = TinyLM(**{**model.__dict__, "rope_scaling": None})
  assert np.max(np.abs(plain.logits(params, jnp.asarray(tokens))
                       - _torch_logits(theirs, tokens))) > 1e-3


def test_mistrals_sliding_window(tmp_path):
  rng = np.random.default_rng(7)
  config = _config("mistral", rng, sliding_window=6)
  theirs = _checkpoint(config, tmp_path, seed=7)
  model, params = hf.load(str(tmp_path), seq_len=LENGTH)
  assert model.sliding_window == 6
  tokens = rng.integers(0, config.vocab_size, (2, LENGTH))
  _close(model.logits(params, jnp.asarray(tokens)), _torch_logits(theirs, tokens))


def test_grouped_kv_heads_under_tensor_parallelism_load_into_the_layout(tmp_path):
  # 8 query heads over 2 K/V heads: on tensor 4 the K/V heads are replicated, on
  # tensor 2 split; either way each device holds only its slices and the logits
  # are the unsharded ones
  rng = np.random.default_rng(2)
  config = _config("qwen2", rng, num_attention_heads=8, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=128)
  _checkpoint(config, tmp_path, seed=2)
  model, params = hf.load(str(tmp_path), seq_len=LENGTH)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (4, LENGTH)), jnp.int32)
  expected = model.logits(params, tokens)
  for tensor in (4, 2):
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8 // tensor, tensor),
                             ("fsdp", "tensor"))
    sharded_model, sharded = hf.load(str(tmp_path), seq_len=LENGTH, mesh=mesh)
    k = sharded["stages"]["k"]["kernel"]
    q = sharded["stages"]["q"]["kernel"]
    assert q.sharding.shard_shape(q.shape)[2] == q.shape[2] // tensor
    kv_split = k.sharding.shard_shape(k.shape)[2] < k.shape[2]
    assert kv_split == (tensor == 2)
    logits = jax.jit(sharded_model.logits)(sharded, tokens)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_is_read_by_transformers_and_round_trips_exactly(dtype, tmp_path):
  rng = np.random.default_rng(5)
  config = _config("llama", rng, tie_word_embeddings=dtype == "bfloat16")
  _checkpoint(config, tmp_path / "in", seed=5)
  (tmp_path / "in" / "tokenizer.json").write_text("{}")
  model, params = hf.load(str(tmp_path / "in"), seq_len=LENGTH)
  params = jax.tree_util.tree_map(lambda x: x + 0.01, params)  # "trained"
  written = hf.save(model, params, str(tmp_path / "out"), dtype=dtype,
                    source=str(tmp_path / "in"), shard_bytes=40_000)
  assert "tokenizer.json" in written and _safetensors.INDEX in written
  exported = json.loads((tmp_path / "out" / "config.json").read_text())
  assert exported["eos_token_id"] == config.eos_token_id
  theirs = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "out", torch_dtype=torch.float32, attn_implementation="eager")
  again, loaded = hf.load(str(tmp_path / "out"), seq_len=LENGTH)
  assert again == model
  if dtype == "float32":  # exact
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, params)
  else:  # exactly the bfloat16 rounding of each weight
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_array_equal(
            a, np.asarray(b).astype(jnp.bfloat16).astype(np.float32)), loaded, params)
  tokens = rng.integers(0, config.vocab_size, (2, LENGTH))
  _close(again.logits(loaded, jnp.asarray(tokens)), _torch_logits(theirs, tokens))


def _rewrite(folder, drop=None, config_edit=None):
  tensors = _safetensors.Tensors(str(folder))
  arrays = [(n, np.array(tensors.get(n))) for n in tensors.names() if n != drop]
  for f in folder.glob("model*.safetensors*"):
    f.unlink()
  _safetensors.write(str(folder), arrays)
  if config_edit:
    config = json.loads((folder / "config.json").read_text())
    config.update(config_edit)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("fault, match", [
    ({"drop": "model.layers.1.mlp.up_proj.weight"},
     r"model\.layers\.1\.mlp\.up_proj\.weight is missing"),
    ({"config_edit": {"intermediate_size": 100}},
     r"mlp\.\w+_proj\.weight has shape .*config\.json makes it"),
    ({"config_edit": {"model_type": "gemma"}}, r"model_type 'gemma'"),
    ({"config_edit": {"hidden_act": "gelu"}}, r"hidden_act = 'gelu'"),
    ({"config_edit": {"attention_bias": True}}, r"attention_bias = True"),
    ({"config_edit": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}},
     r"rope_scaling.*rope_type 'yarn'"),
    ({"config_edit": {"logit_softcapping": 30.0}}, r"logit_softcapping: not a key"),
], ids=["missing", "shape", "family", "activation", "bias", "rope", "unknown"])
def test_bad_checkpoints_are_refused_naming_the_cause(fault, match, tmp_path):
  config = _config("llama", np.random.default_rng(0))
  _checkpoint(config, tmp_path, seed=0)
  _rewrite(tmp_path, **fault)
  with pytest.raises(hf.HFCheckpointError, match=match):
    hf.load(str(tmp_path), seq_len=LENGTH)


def test_save_refuses_what_it_cannot_write_and_writes_nothing(tmp_path):
  gpt = TinyLM(vocab_size=64, d_model=32, num_heads=4, num_layers=2, d_ff=64,
               seq_len=16)
  params = gpt.init(jax.random.key(0))
  with pytest.raises(hf.HFCheckpointError, match=r"family 'gpt'"):
    hf.save(gpt, params, str(tmp_path / "gpt"))
  llama = TinyLM(vocab_size=64, d_model=32, num_heads=4, num_layers=2, d_ff=64,
                 seq_len=16, family="llama")
  params = llama.init(jax.random.key(0))
  with pytest.raises(hf.HFCheckpointError, match=r"dtype 'float16'"):
    hf.save(llama, params, str(tmp_path / "f16"), dtype="float16")
  assert not os.listdir(tmp_path)
  hf.save(llama, params, str(tmp_path / "ok"))
  before = sorted(os.listdir(tmp_path / "ok"))
  with pytest.raises(hf.HFCheckpointError, match=r"holds a checkpoint already"):
    hf.save(llama, params, str(tmp_path / "ok"))
  assert sorted(os.listdir(tmp_path / "ok")) == before


def test_import_train_on_data_fsdp_tensor_export_and_transformers_reads_it(
    tmp_path, monkeypatch):
  """``model.init_from`` starts a run from a Qwen2 checkpoint (byte-level: 256
  ids; 2 K/V heads for 4 query heads on tensor 2); it trains on data x FSDP x
  tensor from the checkpoint's weights (its first loss is the checkpoint's own, as
  transformers computes it); ``mpscale export`` writes what transformers reads, with
  the run's logits. Resuming reads the run's checkpoint, not the Hugging Face
  weights again; once the Hugging Face folder is gone, the run still loads and
  exports from its own folder."""
  from mpscale.trainer import cli
  from mpscale.trainer.config import build as builders
  from mpscale.trainer.runs import loop
  rng = np.random.default_rng(11)
  config = _config("qwen2", rng, vocab_size=256, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=96)
  theirs = _checkpoint(config, tmp_path / "qwen", seed=11)
  (tmp_path / "qwen" / "tokenizer.json").write_text("{}")
  yaml_text = f"""
name: from_qwen
model: {{init_from: {tmp_path / 'qwen'}, seq_len: {LENGTH}}}
data: {{batch_size: 8, eval_batches: 1}}
mesh: {{data: 2, fsdp: 2, tensor: 2}}
optimizer: {{name: adamw, learning_rate: 1.0e-3}}
train: {{steps: 3, log_every: 1, eval_every: 3, checkpoint_every: 3}}
"""
  (tmp_path / "run.yaml").write_text(yaml_text)
  run = tmp_path / "run"
  assert cli.main(["train", "--config", str(tmp_path / "run.yaml"), "--out", str(run),
                   "--quiet", "--no-progress"]) == 0
  loaded, step = loop.load_run(str(run))
  assert step == 3 and loaded.setup.model.family == "qwen2"
  assert loaded.cfg.model.d_model == 64 and loaded.cfg.model.num_kv_heads == 2
  # the first step's loss is the checkpoint's own mean cross-entropy on its batch
  with open(run / "metrics.csv", newline="") as f:
    first = next(csv.DictReader(f))
  assert int(first["step"]) == 1
  batch = loaded.data.train[0]
  tokens, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
  logp = torch.log_softmax(torch.as_tensor(_torch_logits(theirs, tokens)), -1).numpy()
  nll = -np.take_along_axis(logp, targets[..., None], -1).mean()
  np.testing.assert_allclose(float(first["loss"]), nll, rtol=1e-4)
  assert cli.main(["export", str(run), "--hf", str(tmp_path / "out")]) == 0
  assert (tmp_path / "out" / "tokenizer.json").exists()
  exported = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "out", torch_dtype=torch.float32, attn_implementation="eager")
  params = loaded.setup.to_model_order(loaded.state.params)
  ours = jax.jit(loaded.setup.model.logits)(params, jnp.asarray(tokens))
  _close(ours, _torch_logits(exported, tokens))
  trained = np.max(np.abs(_torch_logits(exported, tokens)
                          - _torch_logits(theirs, tokens)))
  assert trained > 1e-4  # the export holds the trained weights, not the start
  assert cli.main(["export", str(run), "--hf", str(tmp_path / "out")]) == 2
  # --resume of the finished run: its checkpoint holds the weights
  def read_again(*args, **kwargs):
    raise AssertionError("the Hugging Face weights were read again")
  monkeypatch.setattr(builders.hf, "load_params", read_again)
  assert cli.main(["train", "--config", str(tmp_path / "run.yaml"), "--out", str(run),
                   "--resume", "--quiet", "--no-progress"]) == 0
  os.rename(tmp_path / "qwen", tmp_path / "moved")
  again, _ = loop.load_run(str(run))
  assert again.cfg.model.d_model == 64
  assert cli.main(["export", str(run), "--hf", str(tmp_path / "out2")]) == 0
  assert (tmp_path / "out2" / "config.json").exists()


def test_a_config_reads_config_json_alone_and_refuses_a_conflicting_size(tmp_path):
  """``model.init_from`` takes the family and sizes from ``config.json`` alone (what
  ``mpscale plan`` needs: no weights read, none there); a size the config sets to
  another value is refused naming both keys; a user's model cannot start from it."""
  from mpscale.trainer.config import load as config_lib
  config = _config("qwen3", np.random.default_rng(3), vocab_size=256)
  (tmp_path / "only").mkdir()
  (tmp_path / "only" / "config.json").write_text(config.to_json_string())
  cfg = config_lib.config_from_dict(
      {"model": {"init_from": "only", "seq_len": 16}}, "<test>",
      base_dir=str(tmp_path))
  assert cfg.model.init_from == str(tmp_path / "only")
  assert (cfg.model.family, cfg.model.d_model, cfg.model.head_dim,
          cfg.model.num_kv_heads) == ("qwen3", 64, 24, config.num_key_value_heads)
  assert cfg.model.seq_len == 16
  with pytest.raises(config_lib.ConfigError, match=r"model\.d_model: 128 is set.*64"):
    config_lib.config_from_dict(
        {"model": {"init_from": "only", "d_model": 128}}, "<test>",
        base_dir=str(tmp_path))
  with pytest.raises(config_lib.ConfigError, match=r"model\.init_from.*model_type"):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps(
        {**json.loads(config.to_json_string()), "model_type": "gemma"}))
    config_lib.config_from_dict({"model": {"init_from": "bad"}}, "<test>",
                                base_dir=str(tmp_path))


def test_a_checkpoint_loads_onto_a_mesh_no_dimension_divides(tmp_path):
  """3 FSDP devices divide none of a Llama's dimensions here (issue #63): each
  weight is read whole along them, equal to the unsharded load, for the step's init
  to store it padded."""
  from jax.sharding import Mesh
  config = _config("llama", np.random.default_rng(3))
  _checkpoint(config, tmp_path, seed=3)
  model, params = hf.load(str(tmp_path), seq_len=LENGTH)
  mesh = Mesh(np.array(jax.devices()[:3]), ("fsdp",))
  specs = model.param_specs(mesh, pad=True)
  assert any("fsdp" in str(s) for s in jax.tree_util.tree_leaves(
      specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
  placed = hf.load_params(str(tmp_path), model, mesh, specs)
  for a, b in zip(jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
