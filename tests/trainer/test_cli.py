"""The command end to end: outputs, resume, refusing to overwrite, config errors.

Runs in-process through `cli.main` (a subprocess would pay JAX's import again), on a
model shrunk with ``--set`` so each compile is short.
"""

import csv
import glob
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mpscale.trainer import cli
from mpscale.trainer.runs import metrics_log
from mpscale.trainer.runs import plots
from mpscale.trainer.runs import progress
from mpscale.trainer.config import load as config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FP16 = os.path.join(ROOT, "configs", "tiny_lm_fp16.yaml")
FP32 = os.path.join(ROOT, "configs", "tiny_lm_fp32.yaml")
SMALL = ["model.d_model=32", "model.num_heads=2", "model.num_layers=1", "model.d_ff=64",
         "model.seq_len=16", "data.batch_size=8", "data.eval_batches=2",
         "train.steps=4", "train.log_every=1", "train.eval_every=2",
         "train.checkpoint_every=2", "train.keep_checkpoints=3",
         "schedule.warmup_steps=1"]


def sets(overrides):
  return [arg for o in overrides for arg in ("--set", o)]


def train_args(config_path, out, *extra, overrides=SMALL):
  return ["train", "--config", config_path, "--out", str(out), "--quiet",
          "--no-progress", *sets(overrides), *extra]


def rows(out):
  with open(os.path.join(out, "metrics.csv"), newline="") as f:
    return list(csv.DictReader(f))


def snapshot(folder):
  """Every file under ``folder`` with its bytes."""
  found = {}
  for path in sorted(glob.glob(os.path.join(folder, "**"), recursive=True)):
    if os.path.isfile(path):
      with open(path, "rb") as f:
        found[os.path.relpath(path, folder)] = f.read()
  return found


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  out = tmp_path_factory.mktemp("runs") / "fp16"
  assert cli.main(train_args(FP16, out)) == 0
  return str(out)


def test_train_writes_every_output(run):
  table = rows(run)
  assert [int(r["step"]) for r in table] == [1, 2, 3, 4]
  assert set(metrics_log.CSV_FIELDS) <= set(table[0])
  assert any(k.startswith("norm/") for k in table[0])
  assert all(np.isfinite(float(r["loss"])) for r in table)
  assert [bool(r["eval_loss"]) for r in table] == [False, True, False, True]
  assert float(table[0]["loss_scale"]) <= 32768.0  # the fp16 config's dynamic scale
  with open(os.path.join(run, "metrics.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  events = glob.glob(os.path.join(run, "tb", "events.out.tfevents.*"))
  assert events and os.path.getsize(events[0]) > 0
  assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["2", "4"]
  with open(os.path.join(run, "summary.json")) as f:
    summary = json.load(f)
  assert summary["steps"] == 4 and summary["policy"] == "O2"
  assert summary["final_eval_loss"] == pytest.approx(float(table[-1]["eval_loss"]))
  assert summary["optimizer_state_bytes"] > 0
  saved = config.load_config(os.path.join(run, "config.yaml"))
  assert saved == config.load_config(FP16, SMALL)


def test_resume_continues_the_step_count_with_the_same_losses(run, tmp_path):
  copy = tmp_path / "resumed"
  shutil.copytree(run, copy)
  shutil.rmtree(copy / "checkpoints" / "4")  # as if stopped after step 2's checkpoint
  assert cli.main(train_args(FP16, copy, "--resume")) == 0
  before, after = rows(run), rows(copy)
  assert [int(r["step"]) for r in after] == [1, 2, 3, 4]
  for key in ("loss", "loss_scale", "global_norm", "eval_loss"):
    np.testing.assert_allclose([_num(r[key]) for r in after],
                               [_num(r[key]) for r in before], rtol=1e-6)
  with open(copy / "summary.json") as f:
    summary = json.load(f)
  assert summary["resumed_from"] == 2 and summary["steps"] == 4
  # A finished run resumed again: nothing to train, and its summary is left alone.
  assert cli.main(train_args(FP16, copy, "--resume")) == 0
  with open(copy / "summary.json") as f:
    assert json.load(f)["resumed_from"] == 2


def _num(text):
  return float(text) if text else np.nan


def test_an_existing_run_is_not_overwritten(run, capsys):
  before = snapshot(run)
  assert cli.main(train_args(FP16, run)) == 2
  assert "--resume" in capsys.readouterr().err
  assert snapshot(run) == before


@pytest.mark.parametrize("text, overrides, fragments", [
    ("model:\n  nun_layers: 2\n", [], ["model.nun_layers", "unknown key"]),
    ("train:\n  steps: many\n", [], ["train.steps", "expected an int"]),
    ("model:\n  num_layers: 3\nmesh:\n  stage: 2\n", [],
     ["model.num_layers (3)", "mesh.stage (2)"]),
    ("{}\n", ["train.stepz=3"], ["train.stepz", "set by --set"]),
    ("{}\n", ["precision.policy=O7"], ["precision.policy", "unknown policy"]),
    ("{}\n", ["mesh.data=16", "data.batch_size=16"], ["mesh", "--devices 16"]),
    ("{}\n", ["data.path=/no/such/file"], ["data.path", "/no/such/file"]),
])
def test_config_errors_name_key_and_file_and_write_nothing(tmp_path, capsys, text,
                                                           overrides, fragments):
  path = tmp_path / "bad.yaml"
  path.write_text(text)
  out = tmp_path / "out"
  assert cli.main(["train", "--config", str(path), "--out", str(out), "--quiet",
                   *sets(overrides)]) == 2
  err = capsys.readouterr().err
  assert str(path) in err
  for fragment in fragments:
    assert fragment in err
  assert not out.exists()


def test_a_failed_overwrite_keeps_the_old_run(run, tmp_path):
  copy = tmp_path / "kept"
  shutil.copytree(run, copy)
  before = snapshot(copy)
  assert cli.main(train_args(FP16, copy, "--overwrite",
                             overrides=SMALL + ["precision.policy=O7"])) == 2
  assert snapshot(copy) == before


def test_devices_cannot_exceed_a_running_backend(capsys):
  assert cli.main(["train", "--config", FP16, "--devices", "64"]) == 2
  assert "already running with 8 devices" in capsys.readouterr().err
  cli.set_host_device_count(4)  # fewer than the 8 running: fine


def test_devices_flag_sets_the_host_device_count_before_jax_starts():
  code = ("from mpscale.trainer import cli; cli.set_host_device_count(3); import jax; "
          "print(jax.device_count())")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env=env, cwd=ROOT, timeout=120)
  assert done.stdout.strip() == "3", done.stderr
  done = subprocess.run([sys.executable, "-m", "mpscale", "--help"],
                        capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert done.returncode == 0 and "compare" in done.stdout


@pytest.mark.slow  # two short runs
def test_compare_writes_a_table_and_a_plot(tmp_path):
  out, png = tmp_path / "compare", tmp_path / "docs" / "cmp.png"
  # decay_steps as in the `run` fixture's 4 steps: the fp16 run's step is then the
  # one compiled there, which the persistent compilation cache (conftest.py) loads.
  args = ["compare", FP32, FP16, "--out", str(out), "--plot", str(png), "--quiet",
          "--no-progress", *sets(SMALL + ["train.steps=2", "schedule.decay_steps=4"])]
  assert cli.main(args) == 0
  with open(out / "comparison.csv", newline="") as f:
    table = list(csv.DictReader(f))
  assert [r["run"] for r in table] == ["tiny_lm_fp32", "tiny_lm_fp16"]
  assert table[0]["eval vs first"] == "+0.00%"
  assert "| tiny_lm_fp16 | O2 | dynamic" in (out / "comparison.md").read_text()
  assert png.read_bytes()[:4] == b"\x89PNG"
  assert (out / "tiny_lm_fp16" / "metrics.csv").exists()


def test_compare_refuses_two_configs_with_one_name(tmp_path, capsys):
  assert cli.main(["compare", FP16, FP16, "--out", str(tmp_path / "c")]) == 2
  assert "two configs are named 'tiny_lm_fp16'" in capsys.readouterr().err


@pytest.mark.slow
def test_data_by_stage_mesh_trains(tmp_path):
  path = os.path.join(ROOT, "configs", "tiny_lm_dp_pp.yaml")
  out = tmp_path / "dp_pp"
  small = ["model.d_model=32", "model.num_heads=2", "model.d_ff=64", "model.seq_len=16",
           "data.batch_size=8", "data.eval_batches=1", "train.steps=2",
           "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0",
           "schedule.warmup_steps=0"]
  assert cli.main(["train", "--config", path, "--out", str(out), "--devices", "4",
                   "--quiet", "--no-progress", *sets(small)]) == 0
  table = rows(out)
  assert [int(r["step"]) for r in table] == [1, 2]
  assert {"norm/stage_0", "norm/stage_1"} <= set(table[0])
  assert all(np.isfinite(float(r["loss"])) for r in table)


def test_version_names_mpscale_jax_and_the_floors(capsys):
  with pytest.raises(SystemExit) as done:
    cli.main(["--version"])
  assert done.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith("mpscale 0.") and "jax " in out and "jax>=0.7.1" in out


EIGHT_STEPS = SMALL + ["train.steps=8", "train.log_every=4", "train.eval_every=0",
                      "train.checkpoint_every=4"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The uninterrupted run of `EIGHT_STEPS` the two Ctrl-C tests resume to."""
  out = tmp_path_factory.mktemp("runs") / "straight"
  assert cli.main(train_args(FP16, out, overrides=EIGHT_STEPS)) == 0
  return out


@pytest.mark.slow  # two short runs
def test_ctrl_c_logs_the_interrupted_interval_and_resume_continues(tmp_path, monkeypatch,
                                                                  capsys, straight):
  from mpscale.trainer.data import text as data_lib
  out = tmp_path / "interrupted"
  overrides = EIGHT_STEPS
  real = data_lib.TextData.train_batch

  def interrupt_at_step_6(self, seed, step, *args):
    if step == 6:  # steps 5 and 6 are done, the row of step 8 not yet written
      raise KeyboardInterrupt
    return real(self, seed, step, *args)

  monkeypatch.setattr(data_lib.TextData, "train_batch", interrupt_at_step_6)
  assert cli.main(train_args(FP16, out, overrides=overrides)) == 130
  assert "--resume" in capsys.readouterr().err
  assert [int(r["step"]) for r in rows(out)] == [4, 6]  # the partial interval's row
  monkeypatch.setattr(data_lib.TextData, "train_batch", real)
  assert cli.main(train_args(FP16, out, "--resume", overrides=overrides)) == 0
  resumed = rows(out)
  assert [int(r["step"]) for r in resumed] == [4, 6, 8]
  # The same training: the state at step 8 is the uninterrupted run's.
  assert resumed[-1]["loss_scale"] == rows(straight)[-1]["loss_scale"]
  assert float(resumed[0]["loss"]) == float(rows(straight)[0]["loss"])


@pytest.fixture
def python_sigint():
  """SIGINT as a terminal's Python process handles it (`signal.default_int_handler`:
  a KeyboardInterrupt) for the test, restored after. The run defers a held Ctrl-C to
  the handler it found; a handler that does not raise, left by an earlier test in
  the same worker, made it train on and return 0 (CI, twice; reproduced by
  installing a no-op handler first)."""
  import signal
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)


@pytest.mark.slow  # two short runs
def test_ctrl_c_inside_the_steps_dispatch_keeps_the_completed_step(tmp_path,
                                                                   monkeypatch,
                                                                   python_sigint,
                                                                   straight):
  """Ctrl-C (a real SIGINT) arriving while a step is dispatched, after it donated the
  old state and before the new one is bound (issue #42: one interrupt in four
  crashed with 'Array has been deleted' and saved nothing): the run exits as
  interrupted with the completed step checkpointed and logged, and the resume
  trains exactly as an uninterrupted run."""
  import signal

  from jax import core as jax_core

  from mpscale.trainer.config import build as builders
  out = tmp_path / "interrupted"
  overrides = EIGHT_STEPS
  real_build = builders.build

  def build(*args, **kwargs):
    setup = real_build(*args, **kwargs)
    if kwargs.get("abstract"):  # the config's check, on shapes
      return setup
    calls = []

    def step(state, batch):
      out = setup.step(state, batch)
      if not isinstance(state.step, jax_core.Tracer):  # a real step, not a trace
        calls.append(1)
      if len(calls) == 6:  # the state of step 5 is donated, step 6's not yet bound
        calls.append(1)
        os.kill(os.getpid(), signal.SIGINT)
      return out
    return setup._replace(step=step)

  monkeypatch.setattr(builders, "build", build)
  assert cli.main(train_args(FP16, out, overrides=overrides)) == 130
  assert [int(r["step"]) for r in rows(out)] == [4, 6]  # step 6 completed, logged
  assert sorted(int(d) for d in os.listdir(out / "checkpoints")
                if d.isdigit()) == [4, 6]
  monkeypatch.setattr(builders, "build", real_build)
  assert cli.main(train_args(FP16, out, "--resume", overrides=overrides)) == 0
  assert [int(r["step"]) for r in rows(out)] == [4, 6, 8]
  assert rows(out)[-1]["loss_scale"] == rows(straight)[-1]["loss_scale"]
  # The same final state: the evaluation of step 8's parameters.
  summaries = [json.load(open(os.path.join(d, "summary.json"))) for d in (out, straight)]
  assert summaries[0]["final_eval_loss"] == pytest.approx(
      summaries[1]["final_eval_loss"], rel=1e-6)


@pytest.mark.slow  # a short resume
def test_a_corrupt_latest_checkpoint_names_the_good_ones_and_step_picks_one(
    run, tmp_path, capsys):
  """Issue #42: with a corrupt latest checkpoint, eval, sample and --resume had no
  way back, and the error (cut off in a TensorStore dump) named no other one. The
  error is short and lists the checkpoints left; --step picks one for eval and
  sample, and --resume --step continues from it (deleting the later, corrupt one)
  to the same final state as an uninterrupted run."""
  # A copy of the `run` fixture's run (the same command), which is the straight one.
  out, straight = tmp_path / "run", run
  shutil.copytree(run, out)
  for blob in glob.glob(str(out / "checkpoints" / "4" / "state" / "**" / "d" / "*"),
                        recursive=True):
    with open(blob, "wb") as f:
      f.write(b"not a checkpoint")
  capsys.readouterr()
  assert cli.main(["eval", str(out)]) == 2
  err = capsys.readouterr().err
  assert "steps 2" in err and "--step" in err and len(err) < 700, err
  assert cli.main(["eval", str(out), "--step", "2"]) == 0
  assert "at step 2" in capsys.readouterr().out
  assert cli.main(["sample", str(out), "--step", "2", "--tokens", "5"]) == 0
  assert cli.main(["eval", str(out), "--step", "3"]) == 2
  assert "no checkpoint of step 3" in capsys.readouterr().err
  assert cli.main(train_args(FP16, out, "--step", "2")) == 2  # needs --resume
  assert cli.main(train_args(FP16, out, "--resume", "--step", "2")) == 0
  assert [int(r["step"]) for r in rows(out)] == [1, 2, 3, 4]
  assert rows(out)[-1]["eval_loss"] == rows(straight)[-1]["eval_loss"]


def test_progress_at_80_columns_shows_the_counter_the_time_and_the_loss():
  import io
  from rich.console import Console
  buffer = io.StringIO()
  console = Console(file=buffer, width=80, force_terminal=True, color_system=None)
  bar = progress.make_progress(console)
  task = bar.add_task("tiny_lm_fp16_long_name", total=300, completed=0)
  bar.update(task, completed=120, info=progress.progress_info(
      {"loss": 3.1712, "loss_scale": 32768.0, "global_norm": 0.8123,
       "tokens_per_s": 31900.0, "interval": 10}, overflow_total=3, eval_loss=2.377))
  console.print(bar.get_renderable())
  lines = buffer.getvalue().splitlines()
  assert all(len(line) <= 80 for line in lines), lines
  text = "\n".join(lines)
  assert "120/300" in text and "eta" in text
  assert "loss 3.171 (10-step mean)" in text and "eval 2.377" in text
  assert "scale 2^15" in text and "overflows 3" in text


def test_resuming_a_finished_run_says_so_and_changes_nothing(run, tmp_path, capsys):
  copy = tmp_path / "finished"
  shutil.copytree(run, copy)
  before = snapshot(copy)
  capsys.readouterr()
  assert cli.main(["train", "--config", FP16, "--out", str(copy), "--resume",
                   "--no-progress", *sets(SMALL)]) == 0
  assert "already finished at step 4 of 4" in capsys.readouterr().err
  assert snapshot(copy) == before


def test_overrides_get_their_own_default_run_folder_and_unused_devices_warn(capsys):
  assert cli.default_out_dir("tiny", []) == os.path.join("runs", "tiny")
  short = cli.default_out_dir("tiny", ["train.steps=50"])
  assert short == os.path.join("runs", "tiny+train.steps=50")
  long = cli.default_out_dir("tiny", [f"model.d_model={i}" for i in range(20)])
  assert len(os.path.basename(long)) < 80 and long != cli.default_out_dir(
      "tiny", [f"model.d_model={i}" for i in range(21)])
  cfg = config.load_config(FP16)
  cli._warn_unused_devices(cfg, 4)
  assert ("--devices 4, but the config's mesh is data 1 x fsdp 1 x stage 1 x tensor 1"
          in capsys.readouterr().err)
  cli._warn_unused_devices(cfg, None)
  cli._warn_unused_devices(cfg, 1)
  assert capsys.readouterr().err == ""


def test_plot_shows_the_whole_loss_the_learning_rate_and_the_group_norms(run, tmp_path):
  table = rows(run)
  fig = plots.plot_runs({"fp16": os.path.join(run, "metrics.csv")}, str(tmp_path / "p.png"))
  loss_ax, _, _, lr_ax, groups_ax, _ = fig.axes
  losses = [float(r["loss"]) for r in table]
  low, high = loss_ax.get_ylim()
  assert low <= min(losses) and high >= max(losses)  # nothing cut off
  assert "interval mean" in loss_ax.get_title()
  assert lr_ax.get_lines()[0].get_ydata().size == len(table)
  group_keys = [k for k in table[0] if k.startswith("norm/")]
  assert group_keys and len(groups_ax.get_lines()) == len(group_keys)
  assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # compiles the sampler several times: about a minute on 2 cores
def test_eval_and_sample_read_the_latest_checkpoint(run, capsys):
  with open(os.path.join(run, "summary.json")) as f:
    summary = json.load(f)
  loss, step = cli.evaluate_run(run)
  assert step == summary["steps"] == 4
  assert loss == pytest.approx(summary["final_eval_loss"], rel=1e-6)
  capsys.readouterr()
  assert cli.main(["eval", run]) == 0
  assert f"eval loss {loss:.4f} nats/byte at step 4" in capsys.readouterr().out
  greedy = cli.sample_run(run, "def ", 12, temperature=0.0)
  assert greedy.startswith("def ") and greedy == cli.sample_run(run, "def ", 12,
                                                               temperature=0.0)
  a = cli.sample_run(run, "x", 30, seed=1)
  assert a == cli.sample_run(run, "x", 30, seed=1) != cli.sample_run(run, "x", 30, seed=2)
  assert cli.main(["sample", run, "--prompt", "ab", "--tokens", "5"]) == 0
  assert capsys.readouterr().out.startswith("ab")
  assert cli.main(["eval", os.path.dirname(run)]) == 2
  assert "holds no run" in capsys.readouterr().err


PIPELINED = {"model": {"d_model": 32, "num_heads": 2, "num_layers": 8, "d_ff": 64,
                       "seq_len": 16},
             "data": {"batch_size": 8, "eval_batches": 1},
             "mesh": {"stage": 2, "virtual_stages": 2, "pipeline_schedule": "1f1b"},
             # No evaluation: only the training losses are compared, and each of the
             # three runs compiled its pipelined evaluation.
             "train": {"steps": 4, "num_microbatches": 2, "per_token_loss": True,
                       "log_every": 1, "eval_every": 0, "checkpoint_every": 2,
                       "keep_checkpoints": 10},
             "schedule": {"warmup_steps": 1}, "optimizer": {"name": "adamw"}}


@pytest.mark.slow
def test_a_checkpoint_of_interleaved_stages_resumes_under_other_virtual_stages(
    tmp_path):
  """The step stores the layers in device order; checkpoints hold model order, so a
  run saved under v=2 resumes under v=1 and v=4 (other groupings of the norms too)
  and continues as it would have; load() gives the model-order parameters."""
  import mpscale.trainer
  whole = str(tmp_path / "v2")
  mpscale.trainer.run(PIPELINED, out_dir=whole, verbose=False, progress=False)
  losses = [float(r["loss"]) for r in rows(whole)]
  for virtual in (1, 4):
    part = str(tmp_path / f"v{virtual}")
    shutil.copytree(whole, part)
    shutil.rmtree(os.path.join(part, "checkpoints", "4"))  # resume from step 2
    cfg = {**PIPELINED, "mesh": {**PIPELINED["mesh"], "virtual_stages": virtual}}
    mpscale.trainer.run(cfg, out_dir=part, resume=True, verbose=False, progress=False)
    table = rows(part)
    np.testing.assert_allclose([float(r["loss"]) for r in table], losses, rtol=1e-5)
    assert {f"norm/stage_{i}" for i in range(2 * virtual)} <= set(table[-1])
    if virtual == 1:  # stored order == model order: load() must agree
      import jax
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                           atol=1e-6),
                   mpscale.trainer.load(whole), mpscale.trainer.load(part))
