"""``--resume`` continues the run a folder holds, not another one (issue #64, items 10
and 16): a config that changes what the run trains (its data, a learning rate, a
model size) is refused before anything is built or written, naming each key with
its run's and its new value; what a resume may change (`RESUME_MAY_CHANGE`) passes.
A checkpoint whose arrays do not fit the config's model names the arrays and both
shapes; a corrupt one gives orbax's whole cause, not one cut mid-word.

No step is compiled: the runs are a config and a checkpoint of a few arrays.
"""

import dataclasses
import os
import re

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from mpscale.trainer import cli
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.runs import checkpoints

RECORD = ("config.yaml", "metrics.csv", "summary.json")


def _save(ckpt_dir, step, state):
  with ocp.CheckpointManager(str(ckpt_dir)) as manager:
    checkpoints.save(manager, step, state, {"next_index": step})
    manager.wait_until_finished()


@pytest.fixture
def finished_run(tmp_path):
  """A run folder of ``tmp_path/c.yaml`` as a finished run leaves it: its record and
  a checkpoint (of a few arrays: the refusal comes before any is read)."""
  config = tmp_path / "c.yaml"
  config.write_text("train: {steps: 340}\n")
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.yaml").write_text(config_lib.dump_config(
      config_lib.load_config(config)))
  for name in ("metrics.csv", "summary.json"):
    (run / name).write_text(f"{name} of the first 340 steps\n")
  _save(run / "checkpoints", 340, {"x": jnp.zeros(2)})
  return config, run


def _record(run):
  return {name: (run / name).read_bytes() for name in RECORD}


@pytest.mark.parametrize("flags, said", [
    (["--data", "other.txt"], "data.path: None -> 'other.txt'"),
    (["--set", "optimizer.learning_rate=0.01"], "optimizer.learning_rate: 0.001 -> 0.01"),
    # Item 16: a model size, named up front, not orbax's "strict=False" from the restore.
    (["--set", "model.d_model=32"], "model.d_model: 64 -> 32"),
])
def test_a_resume_that_changes_what_the_run_trains_is_refused_and_writes_nothing(
    finished_run, tmp_path, monkeypatch, capsys, flags, said):
  config, run = finished_run
  (tmp_path / "other.txt").write_text("another corpus\n" * 100)
  monkeypatch.chdir(tmp_path)  # --data is relative to the working directory
  before = _record(run)
  assert cli.main(["train", "--config", str(config), "--out", str(run), "--resume",
                   "--set", "train.steps=360", "--no-progress", *flags]) == 2
  err = capsys.readouterr().err
  assert "--resume would change what this run trains" in err, err
  assert said in err, err
  assert "train.steps" not in err.split("A resume may change only")[0]  # extending
  assert "--out" in err and "--overwrite" in err
  assert _record(run) == before  # config.yaml, summary.json, metrics.csv as they were
  assert sorted(os.listdir(run)) == sorted(["checkpoints", *RECORD])


def test_what_a_resume_may_change_passes_and_every_other_key_is_named():
  saved = config_lib.config_from_dict({"data": {"path": "corpus.txt"}}, "<test>")
  replace = dataclasses.replace
  extended = replace(
      saved, train=replace(saved.train, steps=600, samples=None, log_every=1,
                           eval_every=0, checkpoint_every=7, keep_checkpoints=9,
                           num_microbatches=2, recompute="full"),
      mesh=replace(saved.mesh, data=2, fsdp=2),
      model=replace(saved.model, attention="xla"),
      data=replace(saved.data, path=os.path.abspath("corpus.txt")),  # the same file
      loss_scale=replace(saved.loss_scale, init_scale=None))  # derived by the run
  assert config_lib.resume_changes(saved, extended) == {}
  other = replace(saved, seed=1, model=replace(saved.model, d_model=32,
                                                 args={"width": 3}),
                  data=replace(saved.data, path="other.txt"),
                  loss_scale=replace(saved.loss_scale, init_scale=2.0 ** 10))
  assert config_lib.resume_changes(saved, other) == {
      "seed": (0, 1), "model.d_model": (64, 32), "model.args.width": (None, 3),
      "data.path": ("corpus.txt", "other.txt"),
      "loss_scale.init_scale": (saved.loss_scale.init_scale, 2.0 ** 10)}


@pytest.mark.filterwarnings(  # orbax's reads of the other arrays, left unawaited
    "ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_checkpoint_of_other_shapes_names_the_arrays_and_both_shapes(tmp_path):
  """Item 16: however a model of other sizes reaches the restore (a run folder
  without its config.yaml, say), the error names the arrays, not orbax's
  ``ArrayRestoreArgs``, and does not offer another checkpoint (``--step``): every
  one of that run has those shapes."""
  _save(tmp_path, 2, {"params": {"embed": jnp.zeros((8, 4)), "bias": jnp.zeros(3)},
                      "step": jnp.zeros((), jnp.int32)})
  like = {"params": {"embed": jnp.zeros((8, 2)), "bias": jnp.zeros(3)},
          "step": jnp.zeros((), jnp.int32)}
  with pytest.raises(checkpoints.CheckpointError) as raised:
    checkpoints.restore_latest(str(tmp_path), like)
  message = str(raised.value)
  assert message.startswith(f"{tmp_path / '2'}: the checkpoint's array shapes differ "
                            "from this config's model: params.embed is (8, 4) there, "
                            "(8, 2) for this config."), message
  assert "params.bias" not in message and "--step" not in message
  assert "ArrayRestoreArgs" not in message


def test_a_truncated_array_file_gives_the_whole_cause(tmp_path):
  """Item 16: a checkpoint whose array files are cut short names the file and what
  is wrong with it, whole: the message was cut at 160 characters, mid-word,
  before the file; TensorStore's JSON spec dump after it is left out."""
  _save(tmp_path, 2, {"params": {"w": jnp.arange(4096.0)}})
  data = tmp_path / "2" / "state" / "d"
  for name in os.listdir(data):
    with open(data / name, "r+b") as f:
      f.truncate(os.path.getsize(data / name) // 3)
  with pytest.raises(checkpoints.CheckpointError) as raised:
    checkpoints.restore_latest(str(tmp_path), {"params": {"w": jnp.zeros(4096)}})
  message = str(raised.value)
  assert message.startswith(f"{tmp_path / '2'}: cannot restore this run's state "
                            "from it (corrupt"), message
  assert message.endswith("); no others there"), message
  assert "tensorstore_spec" not in message
  # The cause goes on to the file at fault and what is wrong with it, to its end.
  # (its files relative to the checkpoint's folder, named first).
  assert re.search(r'local file "state/d/\w+": [^"]+ size \d+\); no others there$',
                   message), message
