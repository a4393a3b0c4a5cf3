"""Configs: every shipped file loads; every mistake names the key and the file."""

import glob
import os
import pickle

import pytest

from mpscale.trainer.config import load as config

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
# Every run config shipped; configs/published/runs.yaml lists published measurements
# (docs/published_table.py), not a run.
RUNS_LIST = os.path.join(ROOT, "configs", "published", "runs.yaml")
CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"),
                                      recursive=True) if p != RUNS_LIST)


def write(tmp_path, text, name="run.yaml"):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def test_shipped_configs_exist():
  names = {os.path.basename(p) for p in CONFIGS}
  for required in ("tiny_lm_fp32.yaml", "tiny_lm_fp16.yaml", "tiny_lm_fp16_noscale.yaml",
                   "tiny_lm_bf16.yaml", "tiny_lm_dp_pp.yaml", "tiny_lm_fp32_adamw.yaml",
                   "tiny_lm_bpe.yaml"):
    assert required in names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_loads_and_round_trips(path, tmp_path):
  cfg = config.load_config(path)
  assert cfg.name == os.path.splitext(os.path.basename(path))[0]
  again = config.load_config(write(tmp_path, config.dump_config(cfg)))
  assert again == cfg


def test_defaults_and_yaml_12_floats(tmp_path):
  cfg = config.load_config(write(tmp_path, "optimizer:\n  learning_rate: 1e-3\n"))
  assert cfg.optimizer.learning_rate == 1e-3
  assert cfg.name == "run"  # the file's stem
  assert cfg.model == config.ModelConfig()
  cfg = config.load_config(write(tmp_path, "clip:\n"))  # an empty section: defaults
  assert cfg.clip == config.ClipConfig()


def test_unknown_key_names_key_and_file(tmp_path):
  path = write(tmp_path, "model:\n  nun_layers: 4\n")
  with pytest.raises(config.ConfigError) as e:
    config.load_config(path)
  message = str(e.value)
  assert path in message and "model.nun_layers" in message
  assert "did you mean 'num_layers'" in message


def test_unknown_section(tmp_path):
  path = write(tmp_path, "trian:\n  steps: 4\n")
  with pytest.raises(config.ConfigError, match=r"run\.yaml: trian: unknown key"):
    config.load_config(path)


@pytest.mark.parametrize("text, key", [
    ("model:\n  num_layers: four\n", "model.num_layers"),
    ("model:\n  num_layers: 2.5\n", "model.num_layers"),
    ("train:\n  remat: 1\n", "train.remat"),
    ("train:\n  recompute_layers: two\n", "train.recompute_layers"),
    ("optimizer:\n  learning_rate: '1e-3'\n", "optimizer.learning_rate"),
    ("optimizer:\n  came:\n    eps: [1.0, x, 1.0]\n", "optimizer.came.eps[1]"),
    ("model: 4\n", "model"),
    ("seed: true\n", "seed"),
])
def test_wrong_type_is_a_type_error_naming_key_and_file(tmp_path, text, key):
  path = write(tmp_path, text)
  with pytest.raises(TypeError) as e:
    config.load_config(path)
  assert isinstance(e.value, config.ConfigError)
  assert f"{path}: {key}:" in str(e.value)


@pytest.mark.parametrize("text, fragments", [
    ("model:\n  num_layers: 3\nmesh:\n  stage: 2\n",
     ["model.num_layers (3)", "mesh.stage (2)"]),
    ("model:\n  d_model: 30\n  num_heads: 4\n", ["model.d_model", "model.num_heads"]),
    ("data:\n  batch_size: 6\nmesh:\n  data: 4\n", ["data.batch_size", "mesh.data"]),
    ("train:\n  steps: 0\n", ["train.steps"]),
    ("loss_scale:\n  kind: dynamic\n  init_scale: 0.5\n", ["loss_scale.init_scale"]),
    ("loss_scale:\n  kind: dynamic\n  backoff_factor: 2.0\n",
     ["loss_scale.backoff_factor"]),
    ("loss_scale:\n  kind: dynmaic\n", ["loss_scale.kind", "'dynamic'"]),
    ("optimizer:\n  came:\n    eps: [1.0, 1.0]\n", ["optimizer.came.eps", "3"]),
    ("schedule:\n  warmup_steps: 400\ntrain:\n  steps: 300\n",
     ["train.steps (300)", "schedule.warmup_steps (400)"]),
    ("schedule:\n  warmup_steps: 400\n  decay_steps: 200\n",
     ["schedule.warmup_steps (400)", "schedule.decay_steps (200)"]),
    ("data:\n  eval_fraction: 1.5\n", ["data.eval_fraction"]),
    ("model:\n  num_heads: 4\nmesh:\n  tensor: 8\n",
     ["model.num_heads (4)", "mesh.tensor (8)"]),
    ("model:\n  num_layers: 4\nmesh:\n  stage: 2\n  virtual_stages: 4\n",
     ["model.num_layers (4)", "mesh.stage (2)", "mesh.virtual_stages (4)"]),
    ("mesh:\n  stage: 2\n  pipeline_schedule: zb\n",
     ["mesh.pipeline_schedule", "'gpipe'", "'1f1b'", "'zb_h1'"]),
    ("model:\n  num_layers: 4\nmesh:\n  stage: 2\n  virtual_stages: 2\n"
     "  pipeline_schedule: zb_h1\n", ["mesh.pipeline_schedule='zb_h1'",
                                       "mesh.virtual_stages must be 1"]),
    ("model:\n  num_layers: 4\nmesh:\n  stage: 2\n  virtual_stages: 2\n"
     "train:\n  num_microbatches: 3\n",
     ["train.num_microbatches (3)", "mesh.stage (2)"]),
    ("mesh:\n  virtual_stages: 2\n", ["mesh.virtual_stages", "mesh.stage > 1"]),
    ("mesh:\n  stage: 2\ntrain:\n  recompute: some\n",
     ["train.recompute", "'none'", "'selective'", "'full'"]),
    ("train:\n  recompute: some\n", ["train.recompute", "'none'", "'selective'",
                                       "'full'"]),
    ("mesh:\n  stage: 2\ntrain:\n  remat: true\n  recompute: selective\n",
     ["train.remat=True is train.recompute='full'"]),
    ("train:\n  remat: true\n  recompute: selective\n",
     ["train.remat=True is train.recompute='full'"]),
    ("train:\n  recompute_layers: 1\n",
     ["train.recompute_layers", "train.recompute='none' recomputes nothing"]),
    ("train:\n  recompute: full\n  recompute_layers: 3\n",
     ["train.recompute_layers=3", "2 layers to recompute"]),
    ("train:\n  recompute: full\n  recompute_layers: -1\n",
     ["train.recompute_layers", ">= 0"]),
    ("model:\n  num_layers: 4\nmesh:\n  stage: 2\ntrain:\n  recompute: full\n"
     "  recompute_layers: 3\n", ["train.recompute_layers (3)", "which holds 2",
                                 "mesh.stage"]),
    ("model:\n  num_layers: 4\nmesh:\n  stage: 2\n  pipeline_schedule: 1f1b\n"
     "train:\n  recompute: full\n  recompute_layers: 1\n",
     ["train.recompute_layers: mesh.pipeline_schedule='1f1b'", "'gpipe'"]),
    ("mesh:\n  sequence_parallel: true\n", ["mesh.sequence_parallel", "mesh.tensor"]),
    ("data:\n  batch_size: 8\nmesh:\n  fsdp: 16\n", ["data.batch_size", "mesh.fsdp (16)"]),
    ("mesh:\n  fsdp: 0\n", ["mesh.fsdp"]),
])
def test_impossible_value_names_keys_and_file(tmp_path, text, fragments):
  path = write(tmp_path, text)
  with pytest.raises(ValueError) as e:
    config.load_config(path)
  message = str(e.value)
  assert message.startswith(path)
  for fragment in fragments:
    assert fragment in message


def test_invalid_yaml_and_duplicate_keys_name_the_file(tmp_path):
  path = write(tmp_path, "model: [unclosed\n")
  with pytest.raises(config.ConfigError, match="invalid YAML"):
    config.load_config(path)
  path = write(tmp_path, "seed: 1\nseed: 2\n")
  with pytest.raises(config.ConfigError, match="duplicate key 'seed'"):
    config.load_config(path)
  with pytest.raises(config.ConfigError, match="cannot read config"):
    config.load_config(str(tmp_path / "missing.yaml"))


def test_overrides_are_yaml_scalars(tmp_path):
  path = write(tmp_path, "train:\n  steps: 10\n")
  cfg = config.load_config(path, ["train.steps=20", "precision.policy=bf16",
                                  "clip.max_norm=null", "optimizer.learning_rate=1e-4",
                                  "optimizer.came.eps=[1e-30, 1e-3, 1e-16]",
                                  "name=other"])
  assert cfg.train.steps == 20
  assert cfg.precision.policy == "bf16"
  assert cfg.clip.max_norm is None
  assert cfg.optimizer.learning_rate == 1e-4
  assert cfg.optimizer.came.eps == (1e-30, 1e-3, 1e-16)
  assert cfg.name == "other"


def test_override_errors_say_set_by_set(tmp_path):
  path = write(tmp_path, "train:\n  steps: 10\n")
  with pytest.raises(config.ConfigError) as e:
    config.load_config(path, ["train.stepz=20"])
  assert path in str(e.value) and "train.stepz" in str(e.value)
  assert "(set by --set)" in str(e.value)
  with pytest.raises(TypeError, match=r"train\.steps: expected an int.*set by --set"):
    config.load_config(path, ["train.steps=many"])
  with pytest.raises(config.ConfigError, match="expected key.sub=value"):
    config.load_config(path, ["train.steps"])
  with pytest.raises(config.ConfigError, match="train.steps is not a section"):
    config.load_config(path, ["train.steps.x=1"])


def test_config_errors_hold_their_keys_and_set_by_set_comes_from_them(tmp_path):
  path = write(tmp_path, "train:\n  steps: 300\n")
  # The message starts with train.steps; the override set the other key it names.
  with pytest.raises(config.ConfigError) as e:
    config.load_config(path, ["schedule.warmup_steps=400"])
  assert e.value.keys == ("train.steps", "schedule.warmup_steps")
  assert str(e.value).startswith(f"{path}: train.steps (300)")
  assert str(e.value).endswith("(set by --set)")
  # A key set by --set that the error does not speak of is not blamed.
  with pytest.raises(config.ConfigError) as e:
    config.load_config(path, ["seed=3", "loss_scale.kind=dynamic",
                              "loss_scale.backoff_factor=1.5"])
  assert e.value.keys == ("loss_scale.backoff_factor",)
  assert "(set by --set)" in str(e.value)
  path = write(tmp_path, "loss_scale:\n  kind: dynamic\n  backoff_factor: 1.5\n")
  with pytest.raises(config.ConfigError) as e:
    config.load_config(path, ["seed=3"])
  assert e.value.keys == ("loss_scale.backoff_factor",)
  assert "(set by --set)" not in str(e.value)
  assert pickle.loads(pickle.dumps(e.value)).keys == e.value.keys
