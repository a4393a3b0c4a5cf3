"""The trainer with a user's model and data: providers named by a config, objects
passed to `mpscale.trainer.run`, the grain loader, and the errors that name the key.

The user's pieces are the NNX transformer and data source of examples/nnx_transformer,
a Flax linen module, and a plain `mpscale.trainer.Model`.
"""

import csv
import json
import os
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpscale.trainer
from mpscale.trainer import cli
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.data import loader
from mpscale.trainer.runs import checkpoints

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
EXAMPLE = os.path.join(ROOT, "examples", "nnx_transformer")
EXAMPLE_CONFIG = os.path.join(EXAMPLE, "config.yaml")
SMALL = ["model.args.d_model=32", "model.args.num_layers=1", "data.batch_size=8",
         "data.eval_batches=2", "train.steps=16", "train.log_every=2",
         "train.eval_every=8", "train.checkpoint_every=8", "schedule.warmup_steps=2",
         "data.args.train_size=2000"]
RUN_FILES = ("config.yaml", "metrics.csv", "summary.json", "metrics.png", "tb",
             "checkpoints")


def sets(overrides):
  return [arg for o in overrides for arg in ("--set", o)]


def rows(out):
  with open(os.path.join(out, "metrics.csv"), newline="") as f:
    return list(csv.DictReader(f))


def trained(out, keys=("step", "loss", "eval_loss", "loss_scale", "global_norm")):
  return [tuple(r[k] for k in keys) for r in rows(out)]


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("runs") / "nnx"
  assert cli.main(["train", "--config", EXAMPLE_CONFIG, "--out", str(out), "--quiet",
                   "--no-progress", *sets(SMALL)]) == 0
  return str(out)


# ------------------------------------------------------------------ the example


def test_the_default_initial_scale_skips_at_most_one_step_of_the_example(example_run):
  """Issue #42: a user's LM (a per-token loss, the sum over its tokens) skipped its
  first steps from 2^15 until the scale fell to fit. ``loss_scale.init_scale:
  null`` starts it at 2^15 over the micro-batch's tokens (8 rows x 16: 2^15 / 2^7),
  written into the run's config.yaml; the example (float16, O2) then skips at most
  one step, and its layers compute in float16 (no float32-compute warning)."""
  cfg = config_lib.load_config(os.path.join(example_run, "config.yaml"))
  assert cfg.loss_scale.init_scale == 2.0**15 / 2**7
  with open(os.path.join(example_run, "summary.json")) as f:
    assert json.load(f)["skipped"] <= 1
  assert float(rows(example_run)[0]["loss_scale"]) == 2.0**8


def test_the_command_trains_a_user_nnx_model_from_its_config(example_run):
  for name in RUN_FILES:
    assert os.path.exists(os.path.join(example_run, name)), name
  with open(os.path.join(example_run, "summary.json")) as f:
    summary = json.load(f)
  # The user's model was trained: its parameter count, not the tiny LM's.
  cfg = config_lib.load_config(os.path.join(example_run, "config.yaml"))
  example = runpy.run_path(os.path.join(EXAMPLE, "model.py"))
  from flax import nnx
  module = example["build"](cfg)
  want = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(module, nnx.Param)))
  assert summary["params"] == want
  assert summary["data"].endswith("model.py:source")
  assert summary["steps"] == 16 and np.isfinite(summary["final_eval_loss"])
  losses = [float(r["loss"]) for r in rows(example_run)]
  assert losses[-1] < losses[0]  # it learns
  # The saved config names the providers by absolute path: the run folder stands alone.
  assert os.path.isabs(cfg.model.provider.rpartition(":")[0])
  # A checkpoint holds the data loader's position beside the state.
  run, step = mpscale.trainer.runs.loop.load_run(example_run)
  assert step == 16 and run.data_state == {"next_index": 16}

def test_loading_a_run_does_not_trace_its_train_step(example_run):
  """Loading a run to evaluate or sample builds its step but does not trace it (a
  pipelined step takes seconds to trace); training traces it before the first
  write, to check the model takes the batches."""
  traced = []
  def record(event, seconds, **kwargs):
    del seconds
    if event.endswith("jaxpr_trace_duration"):
      traced.append(kwargs.get("fun_name"))
  jax.monitoring.register_event_duration_secs_listener(record)
  try:
    run, _ = mpscale.trainer.runs.loop.load_run(example_run)
    assert "step_fn" not in traced and run.metric_shapes == {}
    jax.eval_shape(run.setup.step, run.state, mpscale.trainer.runs.loop
                   .global_batch_shapes(run.data, run.data.train[0]))
    assert "step_fn" in traced  # what training's check would have traced
  finally:
    traced.clear()
    unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
    if unregister is not None:  # jax >= 0.8; before, the listener stays, recording
      unregister(record)          # into a list nothing reads


def test_python_run_with_objects_equals_the_command(example_run, tmp_path):
  train_py = runpy.run_path(os.path.join(EXAMPLE, "train.py"))
  others = [s for s in SMALL if not s.startswith("train.steps=")]
  summary = train_py["main"](["--steps", "16", "--out", str(tmp_path / "py"),
                              *sets(others)])
  assert summary["steps"] == 16
  assert trained(tmp_path / "py") == trained(example_run)


def test_eval_of_a_user_model_run_and_sample_refuses_it(example_run, capsys):
  assert cli.main(["eval", example_run]) == 0
  with open(os.path.join(example_run, "summary.json")) as f:
    final_eval = json.load(f)["final_eval_loss"]
  assert f"{final_eval:.4f}" in capsys.readouterr().out
  assert cli.main(["sample", example_run]) == 2
  assert "user's model" in capsys.readouterr().err


# ------------------------------------------------------------------ other kinds


def _regression(n=256, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 4)).astype(np.float32)
  y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32))[:, None]
  return [{"x": x[i], "y": y[i]} for i in range(n)]


CONFIG = {"optimizer": {"name": "adamw", "learning_rate": 0.05},
          "schedule": {"warmup_steps": 0},
          "data": {"batch_size": 16, "eval_batches": 2},
          "train": {"steps": 30, "log_every": 5, "eval_every": 30,
                    "checkpoint_every": 30}}


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_a_linen_module_is_initialized_through_its_loss(tmp_path):
  from flax import linen as nn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(1)(nn.tanh(nn.Dense(16)(x)))

  def mse(model, batch):  # a mean: counted as one token per batch
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

  summary = mpscale.trainer.run(CONFIG, model=MLP(), loss=mse,
                                data={"train": _regression(), "eval": _regression(64, 1)},
                                out_dir=str(tmp_path / "linen"), verbose=False,
                                progress=False)
  assert summary["params"] == 4 * 16 + 16 + 16 + 1
  losses = [float(r["loss"]) for r in rows(tmp_path / "linen")]
  assert losses[-1] < 0.5 * losses[0]
  assert np.isfinite(summary["final_eval_loss"])


def _linear_model():
  def init(key):
    return {"w": 0.1 * jax.random.normal(key, (4, 1)), "b": jnp.zeros((1,))}

  def loss_fn(params, batch):  # a per-token pair
    err = batch["x"] @ params["w"] + params["b"] - batch["y"]
    return jnp.sum(err**2), jnp.asarray(err.size, jnp.float32)

  return mpscale.trainer.Model(init=init, loss_fn=loss_fn)


def test_a_plain_model_trains_on_a_data_x_fsdp_mesh_as_on_one_device(tmp_path):
  # A function (config) -> model works as well as the model itself.
  provider = lambda cfg: _linear_model()  # noqa: E731
  data = {"train": _regression()}
  one = mpscale.trainer.run(CONFIG, model=provider, data=data,
                            out_dir=str(tmp_path / "one"), verbose=False,
                            progress=False)
  mpscale.trainer.run({**CONFIG, "mesh": {"data": 2, "fsdp": 2}}, model=provider,
                      data=data, out_dir=str(tmp_path / "mesh"), verbose=False,
                      progress=False)
  assert np.isnan(one["final_eval_loss"])  # no eval split: no evaluation
  a = [float(r["loss"]) for r in rows(tmp_path / "one")]
  b = [float(r["loss"]) for r in rows(tmp_path / "mesh")]
  np.testing.assert_allclose(b, a, rtol=1e-4)
  assert a[-1] < 0.7 * a[0]  # it learns


def test_user_data_is_shuffled_each_epoch_and_batched(tmp_path):
  cfg = config_lib.config_from_dict({"data": {"batch_size": 4}}, "<test>")
  examples = [{"i": np.asarray(i)} for i in range(8)]
  data = loader.user_data(examples, cfg)
  it = data.iterator()
  epoch1 = np.concatenate([next(it)["i"] for _ in range(2)])
  epoch2 = np.concatenate([next(it)["i"] for _ in range(2)])
  assert sorted(epoch1) == sorted(epoch2) == list(range(8))
  assert list(epoch1) != list(epoch2)
  # The iterator's state is where it stands: a restored iterator goes on the same.
  state = it.get_state()
  again = data.iterator(state)
  np.testing.assert_array_equal(next(again)["i"], next(it)["i"])
  unshuffled = loader.user_data(
      examples, config_lib.config_from_dict({"data": {"batch_size": 4,
                                                      "shuffle": False}}, "<test>"))
  np.testing.assert_array_equal(unshuffled.train[1]["i"], [4, 5, 6, 7])


# ------------------------------------------------------------------ errors


def _write(folder, name, text):
  path = os.path.join(folder, name)
  with open(path, "w") as f:
    f.write(text)
  return path


PROVIDERS = '''
import numpy as np
def number(config):
  return 42
def wrong_keys(config):
  rng = np.random.default_rng(0)
  return [{"tokens": rng.integers(0, 16, 8).astype(np.int32)} for _ in range(64)]
def wrong_length(config):  # targets shorter than inputs
  t = np.arange(12, dtype=np.int32)
  return [{"inputs": t[:8], "targets": t[:5], "mask": np.ones(5, np.float32)}] * 64
def broken(config):
  raise RuntimeError("the user's bug")
'''


@pytest.mark.parametrize("overrides, message", [
    (["model.provider=no_such_module_xyz:build"],
     "model.provider: cannot import 'no_such_module_xyz'"),
    (["model.provider=model.py:nothing_here"],
     "model.py' has no attribute 'nothing_here'"),
    (["model.provider=model.py"], "model.provider: expected 'package.module:attribute'"),
    (["model.provider=providers.py:number"],
     "model.provider: expected a flax.nnx.Module, a flax.linen.Module or an "
     "mpscale.trainer.Model; got builtins.int"),
    (["model.provider=providers.py:broken"],
     "model.provider: broken raised RuntimeError: the user's bug"),
    (["data.provider=providers.py:number"],
     "data.provider: expected a random-access source of examples"),
    (["data.provider=providers.py:wrong_keys"],
     "data.provider: its batches do not fit model.provider"),
    (["data.provider=providers.py:wrong_length"],
     "data.provider: its batches do not fit model.provider"),
    (["model.loss=providers.py:number", "model.provider=null"],
     "model.loss needs model.provider"),
    # Another function named for the loss: its own key, not the data's (#64 item 16).
    (["model.loss=model.py:source"], "model.loss: source(config) -> 'dict' cannot be "
     "called as loss(model, batch): too many positional arguments"),
    (["data.path=x.txt"], "data.path and data.provider are exclusive"),
    (["mesh.stage=2"], "mesh.stage (2) > 1 needs model.provider to return an "
     "mpscale.trainer.Model whose loss_fn is an mpscale.Pipeline"),
    (["mesh.tensor=2"], "mesh.tensor (2) > 1 needs the model's layout"),
    (["model.args=3"], "model.args: expected a mapping"),
])
def test_bad_user_pieces_are_refused_by_key_before_any_write(tmp_path, capsys, overrides,
                                                            message):
  # The example's files, beside providers that go wrong in each way.
  folder = tmp_path / "cfg"
  folder.mkdir()
  for name in ("model.py", "config.yaml"):
    with open(os.path.join(EXAMPLE, name)) as f:
      _write(folder, name, f.read())
  _write(folder, "providers.py", PROVIDERS)
  out = tmp_path / "out"
  code = cli.main(["train", "--config", str(folder / "config.yaml"), "--out", str(out),
                   "--no-progress", "--devices", "8", *sets(SMALL + overrides)])
  err = capsys.readouterr().err
  assert code == 2, err
  assert message in err, err
  assert not out.exists()  # nothing written


def test_python_arguments_are_checked_by_name(tmp_path):
  with pytest.raises(config_lib.ConfigError, match=r"model \(argument\): gave a Model"):
    mpscale.trainer.run(CONFIG, model=_linear_model(), loss=lambda m, b: 0.0,
                        data=_regression(), out_dir=str(tmp_path / "a"))
  with pytest.raises(config_lib.ConfigError, match=r"model \(argument\): expected a "
                     r"flax.nnx.Module"):
    mpscale.trainer.run(CONFIG, model=object(), data=_regression(),
                        out_dir=str(tmp_path / "b"))
  with pytest.raises(config_lib.ConfigError, match=r"data \(argument\): the train "
                     r"split has 3 examples, fewer than data.batch_size \(16\)"):
    mpscale.trainer.run(CONFIG, model=_linear_model(), data=_regression(3),
                        out_dir=str(tmp_path / "c"))
  with pytest.raises(TypeError, match="config: expected a RunConfig"):
    mpscale.trainer.run(3)
  assert not any(os.listdir(tmp_path))


def test_provider_settings_parse_and_take_set_overrides():
  cfg = config_lib.load_config(EXAMPLE_CONFIG, ["model.args.d_model=48",
                                                "data.args.digits=2"])
  assert cfg.model.args == {"d_model": 48, "num_heads": 4, "num_layers": 2,
                            "max_len": 16}
  assert cfg.data.args["digits"] == 2
  # Dumped and read back, the config is the same (the run folder's config.yaml).
  again = config_lib.config_from_dict(
      config_lib.parse_yaml(config_lib.dump_config(cfg)), "<dump>")
  assert again == cfg


def test_skip_spikes_by_config_fills_the_spikes_column(tmp_path):
  """Two corrupted examples (targets x 1000) in an unshuffled regression: the
  batches holding them spike and are skipped; metrics.csv counts them."""
  data = _regression()
  for i in (200, 250):  # batches 12 and 15 of each epoch (16 batches of 16)
    data[i] = {"x": data[i]["x"], "y": 1000.0 * data[i]["y"]}
  cfg = {**CONFIG, "data": {**CONFIG["data"], "shuffle": False},
         "train": {**CONFIG["train"], "log_every": 1},
         "skip": {"spikes": {"window": 8}}}
  mpscale.trainer.run(cfg, model=_linear_model(), data={"train": data},
                      out_dir=str(tmp_path / "spikes"), verbose=False, progress=False)
  table = rows(tmp_path / "spikes")
  spikes = [int(r["spikes"]) for r in table]
  # Rows are numbered by steps done: batches 12, 15 and 16 + 12 of 30.
  assert [int(r["step"]) for r, new in zip(table, np.diff([0] + spikes)) if new] == [
      13, 16, 29]
  assert all(int(r["skipped"]) == s for r, s in zip(table, spikes))
  assert all(r["overflows"] == "0" for r in table)


# ------------------------------------------------------------------ encoder-decoder

T5_CONFIG = os.path.join(ROOT, "examples", "t5_split", "config.yaml")
# No evaluation (train.eval_every=0): the test compares training losses only, and
# each of its three runs compiled a pipelined evaluation.
T5_SMALL = ["model.args.d_model=16", "model.args.encoder_layers=3",
            "model.args.decoder_layers=3", "data.batch_size=8", "data.eval_batches=1",
            "data.args.train_size=512", "train.steps=6", "train.log_every=1",
            "train.eval_every=0", "train.checkpoint_every=3", "train.keep_checkpoints=5",
            "schedule.warmup_steps=1", "mesh.stage=2", "mesh.data=2",
            "train.num_microbatches=2", "mesh.pipeline_split=1"]


@pytest.mark.slow  # three runs of a pipeline: about a minute on 2 cores
def test_an_encoder_decoder_trains_split_over_the_stages(tmp_path):
  """examples/t5_split (3 encoder and 3 decoder layers): ``mesh.pipeline_split``
  puts the encoder on the first stages. On 4 stages, splits 1 and 3 are the same
  model placed otherwise: the same losses. A checkpoint saved on 4 stages (padded
  stacks in the state, model order saved) resumes on 2 stages split at 1 and goes
  on with the same losses."""
  def train(out, *overrides, resume=False):
    assert cli.main(["train", "--config", T5_CONFIG, "--out", str(out), "--quiet",
                     "--no-progress", "--devices", "4", *(["--resume"] if resume
                                                          else []),
                     *sets(T5_SMALL + list(overrides))]) == 0
    return [float(r["loss"]) for r in rows(out)]

  split1 = train(tmp_path / "split1", "mesh.stage=4", "mesh.data=1",
                 "mesh.pipeline_split=1")
  split3 = train(tmp_path / "split3", "mesh.stage=4", "mesh.data=1",
                 "mesh.pipeline_split=3")
  assert len(split1) == 6 and split1[-1] < split1[0]
  np.testing.assert_allclose(split3, split1, rtol=1e-5)
  import shutil
  shutil.copytree(tmp_path / "split1", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "6")
  resumed = train(tmp_path / "resumed", "mesh.stage=2", "mesh.data=2",
                  "mesh.pipeline_split=1", resume=True)
  np.testing.assert_allclose(resumed, split1, rtol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (["mesh.pipeline_split=2"], "mesh.pipeline_split (2) must be below mesh.stage (2)"),
    (["mesh.pipeline_split=0"], "mesh.pipeline_split must be"),
])
def test_a_bad_split_is_refused_by_key(overrides, message, capsys):
  assert cli.main(["train", "--config", T5_CONFIG, "--quiet", "--no-progress",
                   *sets(T5_SMALL + overrides)]) != 0
  assert message in capsys.readouterr().err


def test_a_split_needs_an_encoder_decoder_model():
  with pytest.raises(config_lib.ConfigError,
                     match="mesh.pipeline_split splits an encoder-decoder; the "
                     "built-in tiny LM is decoder-only"):
    config_lib.config_from_dict({"mesh": {"stage": 2, "pipeline_split": 1},
                                 "train": {"per_token_loss": True}}, "<test>")


# ------------------------------------------------- FSDP on any device count (#63)
def _uneven_runs(steps: int, every: int):
  """``(overrides, train)``: a model none of whose dimensions 3 or 6 divides
  (d_model 20, vocab 256, d_ff 40), run ``steps`` steps with checkpoints every
  ``every``, and ``train(out, steps, *extra_args)``, which runs it to ``steps``."""
  config = os.path.join(ROOT, "configs", "tiny_lm_fp32.yaml")
  small = ["model.d_model=20", "model.num_heads=2", "model.d_ff=40",
           "model.num_layers=1", "model.seq_len=16", "data.batch_size=12",
           "data.eval_batches=1", "train.log_every=1", f"train.eval_every={steps}",
           f"train.checkpoint_every={every}", "schedule.warmup_steps=1",
           f"schedule.decay_steps={steps}"]

  def train(out, steps, *extra):
    assert cli.main(["train", "--config", config, "--out", str(out), "--quiet",
                     "--no-progress", *sets(small + [f"train.steps={steps}"]),
                     *extra]) == 0
  return small, train


def _assert_same_losses(one, moved):
  a = [float(r["loss"]) for r in rows(one)]
  b = [float(r["loss"]) for r in rows(moved)]
  np.testing.assert_allclose(b, a, rtol=1e-4)  # sums in other orders


@pytest.mark.slow  # several runs: the main suite's, not the floors job's
def test_a_padded_fsdp_run_resumes_on_another_device_count_as_on_one_device(tmp_path):
  """FSDP on 3 devices, which divide none of the model's dimensions (issue #63):
  its checkpoints restore on 4 (each padded array cut to its true shape), then on 3
  again (padded back), and the run's losses are one device's."""
  _, train = _uneven_runs(8, 2)
  train(tmp_path / "one", 8)
  train(tmp_path / "moved", 4, "--set", "mesh.fsdp=3")
  # The checkpoint holds the padded arrays as stored (no device gathers a whole
  # one to save it) and records their true shapes.
  shapes = checkpoints._saved_shapes(str(tmp_path / "moved" / "checkpoints" / "4"))
  assert shapes["params.embed.token"] == (258, 20)
  meta = checkpoints._meta(str(tmp_path / "moved" / "checkpoints"), 4)
  assert meta["true_shapes"]["params.embed.token"] == [256, 20]
  train(tmp_path / "moved", 6, "--set", "mesh.fsdp=4", "--resume")
  train(tmp_path / "moved", 8, "--set", "mesh.fsdp=3", "--resume")
  _assert_same_losses(tmp_path / "one", tmp_path / "moved")


@pytest.mark.slow  # several runs: the main suite's, not the floors job's
def test_fsdp_on_six_devices_lays_out_two_axes_and_resumes_on_four(tmp_path):
  """``mesh.fsdp`` 6, which pads the model's weights less as ``fsdp 3 x
  fsdp_transpose 2`` (each weight split on two dimensions) than on one axis of 6:
  the run trains as one device does, and its checkpoint restores on 4 devices."""
  from mpscale.trainer.config import build as builders
  small, train = _uneven_runs(6, 3)
  config = os.path.join(ROOT, "configs", "tiny_lm_fp32.yaml")
  assert builders.fsdp_transpose(config_lib.load_config(config, small + [
      "mesh.fsdp=6"])) == 2
  assert builders.fsdp_transpose(config_lib.load_config(config, small + [
      "mesh.fsdp=4"])) == 1  # 4 divides every dimension it splits
  train(tmp_path / "one", 6)
  train(tmp_path / "moved", 3, "--set", "mesh.fsdp=6")
  # The MLP's (20, 40): 20 over fsdp_transpose 2, 40 padded to 42 over fsdp 3.
  shapes = checkpoints._saved_shapes(str(tmp_path / "moved" / "checkpoints" / "3"))
  assert shapes["params.stages.fc.kernel"] == (1, 20, 42)
  train(tmp_path / "moved", 6, "--set", "mesh.fsdp=4", "--resume")
  _assert_same_losses(tmp_path / "one", tmp_path / "moved")


# ------------------------------------------------------ host offload (#63 item 1)
@pytest.mark.slow  # several runs: the main suite's, not the floors job's
def test_an_offloaded_run_resumes_exactly_and_bad_offload_names_the_key(tmp_path,
                                                                        capsys):
  """``train.offload``: the optimizer state and master parameters in host memory
  between steps train and checkpoint as on the devices, bit for bit, and a resume
  may change what is offloaded."""
  config = os.path.join(ROOT, "configs", "tiny_lm_fp16.yaml")
  small = ["model.d_model=32", "model.d_ff=64", "model.num_layers=1",
           "model.seq_len=16", "data.batch_size=8", "data.eval_batches=1",
           "train.log_every=1", "train.eval_every=6", "train.checkpoint_every=3",
           "schedule.warmup_steps=1", "schedule.decay_steps=6", "mesh.fsdp=2"]

  def train(out, steps, *extra):
    return cli.main(["train", "--config", config, "--out", str(out), "--quiet",
                     "--no-progress", *sets(small + [f"train.steps={steps}"]), *extra])

  assert train(tmp_path / "plain", 6) == 0
  assert train(tmp_path / "off", 3, "--set", "train.offload=[opt_state,params]") == 0
  assert train(tmp_path / "off", 6, "--set", "train.offload=[opt_state]",
               "--resume") == 0
  keys = ("step", "loss", "loss_scale", "global_norm")  # (the first run evaluates at 3)
  assert trained(tmp_path / "off", keys) == trained(tmp_path / "plain", keys)
  capsys.readouterr()
  assert train(tmp_path / "bad", 3, "--set", "train.offload=[optimizer]") == 2
  assert "train.offload must be one of" in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "bad")


# ------------------------------------------------------ a resumed run's summary
def test_a_resumed_run_reads_its_earlier_seconds_before_it_trains(tmp_path, monkeypatch):
  """With several processes the main one writes ``summary.json`` at the end while the
  others finish: every process reads the earlier run's training seconds when it
  resumes, before anyone writes. (Read at the end, a process met the file
  half-written, a JSONDecodeError, and exited 1: tests/trainer/runs/test_distributed.py
  saw it.) Here the file is emptied while the resumed run trains, as an open for
  writing does."""
  import dataclasses
  from mpscale.trainer.runs import loop
  cfg = config_lib.load_config(os.path.join(ROOT, "configs", "tiny_lm_fp16.yaml"), [
      "model.d_model=32", "model.d_ff=64", "model.seq_len=16", "data.batch_size=4",
      "train.steps=4", "train.log_every=2", "train.eval_every=4",
      "train.checkpoint_every=4", "schedule.warmup_steps=1"])
  out = str(tmp_path / "run")
  first = loop.train(cfg, out, progress=False, verbose=False)
  trained = loop._loop

  def trained_while_written(*args, **kwargs):
    state = trained(*args, **kwargs)
    open(os.path.join(out, "summary.json"), "w").close()  # the main process writing
    return state
  monkeypatch.setattr(loop, "_loop", trained_while_written)
  longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=8))
  second = loop.train(longer, out, resume=True, progress=False, verbose=False)
  assert second["steps"] == 8 and second["resumed_from"] == 4
  assert second["train_seconds"] > first["train_seconds"] > 0
