"""Frictions of the command (issue #29): ``eval``/``sample`` of a run trained on more
devices than there are, and ``--set train.steps=N --resume`` extending a finished run.

Small models and few steps, as in test_cli.py (whose helpers this reuses).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mpscale.trainer import cli
from mpscale.trainer.config import load as config
from mpscale.trainer.runs import loop
from tests.trainer.test_cli import FP16, ROOT, SMALL, rows, sets
from tests import quick_compile

DP_PP = os.path.join(ROOT, "configs", "tiny_lm_dp_pp.yaml")
# data 2 x stage 2 on 4 devices, shrunk as in test_cli.test_data_by_stage_mesh_trains
# (the same step: compiled once for both when the compilation cache is on).
DP_PP_SMALL = ["model.d_model=32", "model.num_heads=2", "model.d_ff=64",
               "model.seq_len=16", "data.batch_size=8", "data.eval_batches=1",
               "train.steps=2", "train.log_every=1", "train.eval_every=0",
               "train.checkpoint_every=0", "schedule.warmup_steps=0"]


@pytest.fixture(scope="module")
def dp_pp_run(tmp_path_factory):
  """A finished data x stage run on 4 devices, and its final eval loss (evaluated
  on its mesh)."""
  out = tmp_path_factory.mktemp("runs") / "dp_pp"
  assert cli.main(["train", "--config", DP_PP, "--out", str(out), "--devices", "4",
                   "--quiet", "--no-progress", *sets(DP_PP_SMALL)]) == 0
  with open(out / "summary.json") as f:
    summary = json.load(f)
  assert summary["steps"] == 2 and np.isfinite(summary["final_eval_loss"])
  return str(out), summary["final_eval_loss"]


def test_a_data_by_stage_run_evaluates_on_one_device_as_on_its_mesh(dp_pp_run):
  out, final_eval = dp_pp_run
  run, step = loop.load_run(out)  # on its own mesh: the whole state is read
  assert step == 2 and run.setup.mesh.devices.size == 4
  assert run.state.opt_state is not None
  own = loop.evaluate(run.setup, run.state, run.data)
  assert own == pytest.approx(final_eval, rel=1e-6)
  run, step = loop.load_run(out, devices=1)
  assert run.cfg.mesh == config.MeshConfig() and run.setup.mesh is None
  assert run.state.opt_state is None  # laid out for the 4-device mesh: not read
  assert step == int(run.state.step) == 2
  np.testing.assert_allclose(loop.evaluate(run.setup, run.state, run.data), own,
                             rtol=1e-5)


def test_eval_and_sample_in_a_process_with_one_device(dp_pp_run):
  """The commands themselves, where JAX has a single device (no --devices)."""
  out, final_eval = dp_pp_run
  code = ("import jax, sys; from mpscale.trainer import cli; "
          "assert jax.device_count() == 1, jax.devices(); "
          "assert cli.main(['eval', sys.argv[1]]) == 0; "
          "assert cli.main(['sample', sys.argv[1], '--prompt', 'ab', '--tokens', "
          "'3']) == 0")
  # One device, and conftest.py's quick compile (LLVM's optimizations off).
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=quick_compile.FLAGS)
  done = subprocess.run([sys.executable, "-c", code, out], capture_output=True,
                        text=True, env=env, cwd=ROOT, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  evaluated, sampled = done.stdout.splitlines()
  prefix = f"{out}: eval loss "
  assert evaluated.startswith(prefix) and evaluated.endswith(" nats/byte at step 2")
  loss = float(evaluated[len(prefix):].split()[0])
  assert loss == pytest.approx(final_eval, abs=1e-4)  # printed to 4 decimals
  assert sampled.startswith("ab")


def test_eval_takes_devices(dp_pp_run, capsys):
  out, final_eval = dp_pp_run
  with pytest.raises(SystemExit):
    cli.main(["eval", "--help"])
  assert "--devices N" in capsys.readouterr().out
  assert cli.main(["eval", out, "--devices", "2"]) == 0  # 2 < 4: on one device
  assert f"eval loss {final_eval:.4f} nats/byte at step 2" in capsys.readouterr().out
  assert cli.main(["eval", out, "--devices", "0"]) == 2
  assert "--devices must be >= 1" in capsys.readouterr().err


def _small_config(tmp_path):
  """A config file of the small fp16 run (4 steps), so its run goes to
  ``runs/<name>`` without overrides."""
  cfg = config.load_config(FP16, SMALL + ["schedule.decay_steps=4"])
  path = tmp_path / "small.yaml"
  path.write_text(config.dump_config(cfg))
  return str(path), cfg.name


def test_resume_with_more_steps_extends_the_finished_run_in_its_folder(
    tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  path, name = _small_config(tmp_path)
  train = ["train", "--config", path, "--no-progress"]
  assert cli.main([*train, "--quiet"]) == 0
  out = os.path.join("runs", name)
  assert [int(r["step"]) for r in rows(out)] == [1, 2, 3, 4]
  capsys.readouterr()
  assert cli.main([*train, "--set", "train.steps=6", "--resume"]) == 0
  err = capsys.readouterr().err
  extended = cli.default_out_dir(name, ["train.steps=6"])
  assert f"{extended} holds no run; continuing {out}" in err
  assert not os.path.exists(extended)
  assert [int(r["step"]) for r in rows(out)] == [1, 2, 3, 4, 5, 6]
  with open(os.path.join(out, "summary.json")) as f:
    summary = json.load(f)
  assert summary["steps"] == 6 and summary["resumed_from"] == 4
  assert config.load_config(os.path.join(out, "config.yaml")).train.steps == 6


def test_resume_folder_prefers_the_overrides_own_then_the_extended_run(tmp_path,
                                                                       capsys):
  root = str(tmp_path / "runs")

  def make_run(folder):
    os.makedirs(folder)
    open(os.path.join(folder, "config.yaml"), "w").close()

  base = cli.default_out_dir("tiny", ["model.d_model=32"], root)
  make_run(base)
  # train.steps among other overrides: the run of the others.
  steps = ["model.d_model=32", "train.steps=600"]
  assert cli.resume_out_dir("tiny", steps, root) == base
  assert f"continuing {base}" in capsys.readouterr().err
  # The overrides' own folder, when it holds a run, comes first (and silently).
  own = cli.default_out_dir("tiny", steps, root)
  make_run(own)
  assert cli.resume_out_dir("tiny", steps, root) == own
  assert capsys.readouterr().err == ""
  # Neither: a new run, naming where it looked and the runs of the config.
  other = ["model.d_model=64", "train.steps=600"]
  new = cli.default_out_dir("tiny", other, root)
  assert cli.resume_out_dir("tiny", other, root) == new
  err = capsys.readouterr().err
  looked = cli.default_out_dir("tiny", ["model.d_model=64"], root)
  assert f"no run in {new} or {looked}; starting one in {new}" in err
  assert f"runs of tiny under {root}: {base}, {own};" in err
  assert cli.resume_out_dir("tiny", other, root, verbose=False) == new
  assert capsys.readouterr().err == ""
  # Without train.steps only the overrides' own folder is looked in.
  assert cli.resume_out_dir("other", [], root) == os.path.join(root, "other")
  assert (f"no run in {os.path.join(root, 'other')}; starting one" in
          (err := capsys.readouterr().err)) and f"under {root}: none;" in err
