"""Exact resume: a real training process killed with SIGKILL at a random moment and
resumed from its last checkpoint ends bit-identical to an uninterrupted run, data
position included: for the tiny LM on its corpus, and for a user's NNX transformer
and data source named by a config (examples/nnx_transformer)."""

import csv
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import helpers, quick_compile

pytestmark = pytest.mark.slow

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
STEPS, EVERY = 12, 2
SETTINGS = [f"train.steps={STEPS}", f"train.checkpoint_every={EVERY}",
            f"train.log_every={EVERY}", f"train.eval_every={STEPS}",
            "train.keep_checkpoints=100", "model.d_model=32", "model.d_ff=64",
            "model.num_layers=2", "model.seq_len=32", "data.batch_size=8",
            "data.eval_batches=1", "schedule.warmup_steps=1",
            # The default (train.steps) for these runs, stated so that the shorter run
            # of test_corrupt_checkpoint_is_refused_by_name compiles the same step,
            # which the persistent compilation cache (conftest.py) then loads.
            f"schedule.decay_steps={STEPS}"]


EXAMPLE_SETTINGS = [s for s in SETTINGS if not s.startswith("model.")] + [
    "model.args.d_model=32", "model.args.num_layers=1", "data.args.train_size=500"]
"""The same schedule for the example's model (sized by ``model.args``)."""
RUNS = {"tiny_lm": (os.path.join(ROOT, "configs", "tiny_lm_fp16.yaml"), SETTINGS),
        "user_nnx_model": (os.path.join(ROOT, "examples", "nnx_transformer",
                                        "config.yaml"), EXAMPLE_SETTINGS),
        # Dropout and BatchNorm: the keys and the statistics resume exactly too.
        "user_cnn_dropout_batchnorm": (
            os.path.join(ROOT, "examples", "digits_cnn", "config.yaml"),
            [s for s in SETTINGS if not s.startswith("model.")]
            + ["model.args.channels=8", "model.args.blocks=1"])}


def _command(out, *extra, run="tiny_lm"):
  config, settings = RUNS[run]
  sets = [arg for s in settings for arg in ("--set", s)]
  return [sys.executable, "-m", "mpscale", "train", "--config", config, "--out",
          str(out), *sets, *extra]


def _env(compilation_cache=True):
  env = dict(os.environ)
  # The runs are short, so mostly XLA compiling: they compile with LLVM's
  # optimizations off and the older fusion emitters, as the tests' own process does
  # (conftest.py), several times faster; the CLI adds the devices the mesh needs.
  env["XLA_FLAGS"] = quick_compile.FLAGS
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  if not compilation_cache:
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  return env


def _restore(run_dir, step):
  """The checkpoint's state (a flat dict of arrays) and data iterator state."""
  import orbax.checkpoint as ocp
  with ocp.CheckpointManager(os.path.join(os.path.abspath(run_dir),
                                          "checkpoints")) as manager:
    saved = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore()))
  return saved.state, saved.data


@pytest.mark.parametrize("run", list(RUNS))
def test_sigkill_then_resume_is_bit_identical(tmp_path, run):
  whole, killed = tmp_path / "whole", tmp_path / "killed"
  # The two runs are independent processes, so they run side by side (one core each
  # on a 2-core machine). The one to be killed compiles for itself, without the
  # persistent compilation cache: as in a first run, compiling the evaluation at the
  # last step leaves time between the last two checkpoints. The kill comes up to
  # 0.5 s after checkpoint STEPS - 2 * EVERY at the latest, so that with the quick
  # compile (tests.quick_compile) it still lands before the run ends.
  whole_log = tmp_path / "whole.log"
  with open(whole_log, "wb") as log:
    whole_proc = subprocess.Popen(_command(whole, run=run), env=_env(), cwd=ROOT,
                                  stdout=log,
                                  stderr=subprocess.STDOUT)
  proc = None
  try:
    # Kill at a random moment after a random checkpoint has landed.
    target = random.Random().choice(range(EVERY, STEPS - 2 * EVERY + 1, EVERY))
    proc = subprocess.Popen(_command(killed, run=run),
                            env=_env(compilation_cache=False),
                            cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not [s for s in helpers.steps_saved(killed) if s >= target]:
      assert proc.poll() is None, "the run ended before it could be killed"
      assert time.time() < deadline, "no checkpoint appeared"
      time.sleep(0.05)
    time.sleep(random.Random().uniform(0.0, 0.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    whole_proc.wait(timeout=600)
  finally:
    for p in (whole_proc, proc):  # a no-op for one that has exited
      if p is not None and p.poll() is None:
        p.kill()
        p.wait()
  assert whole_proc.returncode == 0, whole_log.read_text()[-3000:]
  saved_at_kill = helpers.steps_saved(killed)
  assert saved_at_kill and saved_at_kill[-1] < STEPS, "killed too late to test resume"

  # A checkpoint cut off half-written (orbax writes into a temporary folder and
  # renames it when complete) is never taken for a valid one.
  junk = killed / "checkpoints" / f"{STEPS + 2}.orbax-checkpoint-tmp-1234"
  junk.mkdir()
  (junk / "half_written").write_bytes(b"\0" * 10)

  result = subprocess.run(_command(killed, "--resume", run=run), env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]

  (want, want_data), (got, got_data) = _restore(whole, STEPS), _restore(killed, STEPS)
  assert got_data == want_data == {"next_index": STEPS}  # the grain loader's position
  assert set(want) == set(got)
  for key in want:  # params, optimizer state, loss scale, skip counters, step
    np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]),
                                  err_msg=key)
  assert any("loss_scale" in k for k in want) and "step" in want
  if run == "user_cnn_dropout_batchnorm":  # BatchNorm statistics and the run's key
    assert any(k.startswith("model_state.") for k in want) and "rng" in want
  assert int(got["step"]) == STEPS
  # The logged losses of the resumed run (the rows after the kill included) are the
  # uninterrupted run's.
  assert _losses(killed) == _losses(whole)


def _losses(run_dir):
  with open(os.path.join(run_dir, "metrics.csv")) as f:
    rows = list(csv.DictReader(f))
  return [(r["step"], r["loss"], r["eval_loss"], r["loss_scale"]) for r in rows]


def test_corrupt_checkpoint_is_refused_by_name(tmp_path):
  run = tmp_path / "run"
  subprocess.run(_command(run, "--set", f"train.steps={EVERY}"), check=True,
                 env=_env(), cwd=ROOT, capture_output=True, timeout=600)
  step_dir = run / "checkpoints" / str(EVERY)
  for root, _, files in os.walk(step_dir):
    for name in files:
      if name.endswith((".zarray", "zarr.json", ".ocdbt", "manifest.ocdbt")) or \
          "d" == os.path.basename(root):
        path = os.path.join(root, name)
        with open(path, "r+b") as f:
          f.truncate(max(os.path.getsize(path) // 3, 1))
  before = (run / "metrics.csv").read_bytes()
  result = subprocess.run(_command(run, "--resume", "--set", f"train.steps={STEPS}"),
                          env=_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 2, result.stderr[-3000:]
  assert str(step_dir) in result.stderr and "cannot restore" in result.stderr
  assert (run / "metrics.csv").read_bytes() == before  # nothing overwritten


def test_resume_of_a_run_with_no_checkpoint_is_refused_and_writes_nothing(tmp_path):
  """``--resume`` on a folder holding a run's record but an empty ``checkpoints/``
  would start over at step 0 and replace the record: refused, by the folder, before
  anything is built or written. A folder with no run yet still starts."""
  from mpscale.trainer.config import load as config_lib  # noqa: PLC0415
  from mpscale.trainer.runs import loop  # noqa: PLC0415
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  for name in ("metrics.csv", "summary.json", "config.yaml"):
    (run / name).write_text(f"{name} of the first 340 steps\n")
  cfg = config_lib.config_from_dict({"train": {"steps": 2}}, "<test>")
  with pytest.raises(loop.RunDirError, match="no checkpoint .* to resume from"):
    loop.train(cfg, str(run), resume=True, verbose=False)
  for name in ("metrics.csv", "summary.json", "config.yaml"):
    assert (run / name).read_text() == f"{name} of the first 340 steps\n"


def test_a_corrupt_checkpoint_record_is_refused_by_name(tmp_path):
  """A checkpoint's ``meta/metadata`` (the samples it was trained on) that is not
  JSON: a `CheckpointError` naming the file, as other corruptions are, not a
  ``JSONDecodeError`` traceback."""
  from mpscale.trainer.runs import checkpoints  # noqa: PLC0415
  meta = tmp_path / "checkpoints" / "20" / "meta"
  meta.mkdir(parents=True)
  (meta / "metadata").write_text('{"consumed_sam')
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"meta/metadata: cannot read the samples checkpoint 20"):
    checkpoints.consumed_samples(str(tmp_path / "checkpoints"), 20)


@pytest.mark.parametrize("layout", [
    "plain", pytest.param("pipelined", marks=pytest.mark.slow)])
def test_an_fp8_run_resumes_to_the_same_losses_and_fp8_state(tmp_path, layout):
  """The FP8 scaling state is the TrainState's model state: checkpointed, restored,
  and carried on as the uninterrupted run carries it (in process, from step 2 of 4;
  2 micro-batches, so two history entries a step). Pipelined (2 stages, interleaved
  1F1B, the blocks and their states stored in device order, checkpointed in model
  order): one entry a step, for each of the 2 FP8 blocks of 4."""
  import shutil
  import jax
  import mpscale.trainer
  layers = 3 if layout == "plain" else 4
  cfg = {"model": {"d_model": 32, "num_heads": 2, "num_layers": layers, "d_ff": 64,
                   "seq_len": 32},
         "data": {"batch_size": 8, "eval_batches": 1},
         # No evaluation: not compared here, and each run compiled it.
         "train": {"steps": 4, "log_every": 1, "eval_every": 0, "checkpoint_every": 2,
                   "keep_checkpoints": 10, "num_microbatches": 2},
         "schedule": {"warmup_steps": 1},
         "precision": {"policy": "bf16", "fp8": {"recipe": "delayed",
                                                 "history_len": 32}}}
  if layout == "pipelined":
    cfg["mesh"] = {"stage": 2, "pipeline_schedule": "1f1b", "virtual_stages": 2}
  whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
  mpscale.trainer.run(cfg, out_dir=whole, verbose=False, progress=False)
  shutil.copytree(whole, part)
  shutil.rmtree(os.path.join(part, "checkpoints", "4"))
  mpscale.trainer.run(cfg, out_dir=part, resume=True, verbose=False, progress=False)

  def losses(out):
    with open(os.path.join(out, "metrics.csv"), newline="") as f:
      return [(r["step"], r["loss"]) for r in csv.DictReader(f)]
  assert losses(part) == losses(whole) and len(losses(whole)) == 4
  (_, resumed), (_, uninterrupted) = (mpscale.trainer.load(part),
                                      mpscale.trainer.load(whole))
  for a, b in zip(jax.tree_util.tree_leaves(resumed),
                  jax.tree_util.tree_leaves(uninterrupted)):
    np.testing.assert_array_equal(a, b)
  history = resumed["_overwrite_with_gradient"]["stages"]["fc"].lhs.amax_history
  # 4 steps x 2 micro-batches, 1 FP8 block; pipelined 4 steps x 2 FP8 blocks
  assert np.count_nonzero(history, axis=1).tolist() == (
      [0, 8, 0] if layout == "plain" else [0, 4, 4, 0])
