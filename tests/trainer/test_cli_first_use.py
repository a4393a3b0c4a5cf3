"""What a new user found by trying the documented commands on a fresh clone (issue
#64): each as the docs write it, on a CPU-only install.

Small models and few steps, as in test_cli.py (whose helpers this reuses).
"""

import csv
import json
import os
import runpy
import shutil
import subprocess
import sys

import jax
import pytest

from mpscale.trainer import cli
from mpscale.trainer.config import build as builders
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.data import tokenizing
from mpscale.trainer.runs import compare
from mpscale.trainer.runs import devices
from mpscale.trainer.runs import loop
from mpscale.trainer.runs import progress
from tests import quick_compile
from tests.trainer.test_cli import FP32, ROOT, SMALL, sets

T5 = os.path.join(ROOT, "examples", "t5_split", "config.yaml")


def test_plan_without_devices_simulates_the_configs_mesh():
  """docs/planning.md's ``mpscale plan --config ... --hardware h100-80g`` has no
  ``--devices``: on a CPU-only install the plan's CPU compile simulates as many
  devices as the config's mesh needs (here data 2), where before it said "needs 2
  devices, but 1 are available"."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=quick_compile.FLAGS)
  done = subprocess.run(
      [sys.executable, "-m", "mpscale", "plan", "--config", FP32,
       *sets(SMALL + ["mesh.data=2"])], capture_output=True, text=True, env=env,
      cwd=ROOT, timeout=300)
  assert done.returncode == 0, done.stderr
  assert "2 devices (data 2)" in done.stdout.splitlines()[0], done.stdout


def test_the_simulated_devices_are_at_least_the_meshs(monkeypatch):
  flag = "--xla_force_host_platform_device_count"
  monkeypatch.setattr(devices, "_backends_are_initialized", lambda: False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
  devices.host_devices_at_least(8)
  assert os.environ["XLA_FLAGS"] == f"--xla_foo=1 {flag}=8"
  monkeypatch.setenv("XLA_FLAGS", f"{flag}=16")  # a larger count given: kept
  devices.host_devices_at_least(8)
  assert os.environ["XLA_FLAGS"] == f"{flag}=16"
  monkeypatch.setenv("XLA_FLAGS", f"{flag}=2")   # too few for the mesh: raised
  devices.host_devices_at_least(8)
  assert os.environ["XLA_FLAGS"] == f"{flag}=8"
  monkeypatch.setattr(devices, "_backends_are_initialized", lambda: True)
  monkeypatch.setenv("XLA_FLAGS", "")            # JAX running: nothing to change
  devices.host_devices_at_least(64)
  assert os.environ["XLA_FLAGS"] == ""


def test_tokenize_makes_the_folder_of_out(tmp_path, capsys):
  """docs/data.md's ``mpscale tokenize docs.jsonl --vocab-size 32000 --out data/web``
  on a fresh clone, which has no data/ folder."""
  text = tmp_path / "in.txt"
  text.write_text("the cat sat on the mat\n\nthe dog sat on the log\n",
                  encoding="utf-8")
  out = tmp_path / "data" / "web"
  assert cli.main(["tokenize", str(text), "--vocab-size", "260", "--out",
                   str(out)]) == 0, capsys.readouterr().err
  assert (tmp_path / "data" / "web.bin").exists()
  assert tokenizing.vocabulary_size(tokenizing.load_tokenizer(
      str(tmp_path / "data" / "tokenizer.json"))) <= 260
  # A mistyped input makes no folder.
  assert cli.main(["tokenize", str(tmp_path / "nope.txt"), "--vocab-size", "260",
                   "--out", str(tmp_path / "other" / "web")]) == 2
  assert not (tmp_path / "other").exists()


@pytest.mark.slow  # a short pipelined run: about 30 s on 2 cores
def test_a_t5_split_run_evaluates_on_one_device(tmp_path):
  """docs/trainer.md promises one-device eval of a run whose mesh needs more:
  examples/t5_split's provider builds its model unpipelined on the one-stage mesh
  that eval rebuilds it on (before: "split must be an int; got NoneType"), to the
  loss its own mesh gives."""
  out = tmp_path / "t5"
  small = ["model.args.d_model=16", "model.args.encoder_layers=1",
           "model.args.decoder_layers=1", "data.batch_size=8", "data.eval_batches=1",
           "data.args.train_size=64", "data.args.eval_size=8", "train.steps=1",
           "train.log_every=1", "train.eval_every=1", "train.checkpoint_every=1",
           "schedule.warmup_steps=0", "mesh.stage=2", "train.num_microbatches=2"]
  assert cli.main(["train", "--config", T5, "--out", str(out), "--quiet",
                   "--no-progress", *sets(small)]) == 0
  with open(out / "summary.json") as f:
    final_eval = json.load(f)["final_eval_loss"]
  values, step = loop.evaluate_run_metrics(str(out), devices=1)
  assert step == 1
  assert values["loss"] == pytest.approx(final_eval, rel=1e-5)


@pytest.mark.parametrize("example", ["nnx_transformer", "digits_cnn"])
def test_the_python_examples_refuse_a_folder_that_holds_a_run(example, tmp_path,
                                                              capsys):
  """As ``mpscale train`` does: before, examples/*/train.py trained over the run in
  ``--out`` (``overwrite=True``)."""
  if example == "digits_cnn":
    pytest.importorskip("sklearn")
  out = tmp_path / "earlier"
  out.mkdir()
  (out / "metrics.csv").write_text("step,loss\n1,2.0\n")
  train_py = runpy.run_path(os.path.join(ROOT, "examples", example, "train.py"))
  with pytest.raises(SystemExit) as exit_:
    train_py["main"](["--steps", "30", "--out", str(out)])
  assert exit_.value.code == 2
  assert "already holds a run" in capsys.readouterr().err
  assert os.listdir(out) == ["metrics.csv"]
  with pytest.raises(SystemExit):  # one of them
    train_py["main"](["--out", str(out), "--resume", "--overwrite"])


def test_a_run_without_loss_scaling_shows_no_scale(tmp_path, capsys):
  """A float32 or bfloat16 run (``loss_scale.kind: none``) printed ``scale 2^0`` in
  its progress: its scale is always 1, so it shows none; a scaled run shows its."""
  row = {"loss": 3.17, "loss_scale": 1.0, "global_norm": 0.81, "tokens_per_s": 3e4}
  assert "scale" not in progress.progress_info(row, 0, 2.4, scaled=False)
  assert "scale 2^0" in progress.progress_info(row, 0, 2.4)
  assert cli.main(["train", "--config", FP32, "--out", str(tmp_path / "fp32"),
                   "--no-progress", *sets(SMALL + ["train.steps=2"])]) == 0
  said = "".join(capsys.readouterr())
  assert "step 2/2: loss" in said and "overflows 0" in said, said
  assert "scale" not in said, said


def test_one_device_is_said_in_the_singular():
  """"needs 2 devices, but 1 are available" said a mesh too large for one device."""
  cfg = config_lib.load_config(FP32, SMALL + ["mesh.data=2"])
  with pytest.raises(ValueError, match="needs 2 devices, but 1 is available; on CPU"):
    builders.build_mesh(cfg, jax.devices()[:1])


@pytest.mark.slow  # one short run
def test_compare_resume_with_fewer_configs_keeps_the_earlier_rows(tmp_path):
  """``compare a b --resume`` and then ``compare b --resume`` wrote a table of b
  alone: the earlier comparison's other runs stay in the table and the plot, first,
  and the first row stays the reference."""
  out = tmp_path / "cmp"
  args = ["compare", FP32, "--out", str(out), "--quiet", "--no-progress",
          *sets(SMALL + ["train.steps=2"])]
  assert cli.main(args) == 0
  shutil.copytree(out / "tiny_lm_fp32", out / "other")  # as if compared before it
  with open(out / "other" / "summary.json") as f:
    other = json.load(f)
  other.update(name="other", final_eval_loss=2 * other["final_eval_loss"])
  with open(out / "other" / "summary.json", "w") as f:
    json.dump(other, f)
  with open(out / "tiny_lm_fp32" / "summary.json") as f:
    header, table = compare.comparison_table([other, json.load(f)])
  with open(out / "comparison.csv", "w", newline="") as f:
    csv.writer(f).writerows([header, *table])
  assert cli.main(args + ["--resume"]) == 0  # the one run is finished: not trained
  with open(out / "comparison.csv", newline="") as f:
    rows = list(csv.DictReader(f))
  assert [r["run"] for r in rows] == ["other", "tiny_lm_fp32"]
  assert [r["eval vs first"] for r in rows] == ["+0.00%", "-50.00%"]
  assert "| other |" in (out / "comparison.md").read_text()


def test_extending_a_cosine_run_restarts_its_decay_as_docs_trainer_says():
  """docs/trainer.md: ``--set train.steps=N --resume`` stretches the decay over the
  new steps (a finished cosine run's rate goes back up, half-way to the peak at a
  10-step run extended to 20, without warm-up), unless ``schedule.decay_steps`` was
  set from the start. Behaviour unchanged; this pins what the page now says."""
  def rates(*sets_):
    cfg = config_lib.load_config(FP32, SMALL + ["schedule.style=cosine",
                                                "schedule.warmup_steps=0",
                                                "schedule.min_lr=1e-4", *sets_])
    peak = cfg.optimizer.learning_rate
    schedule = builders.build_lr_schedule(cfg)
    return peak, [float(schedule(n)) for n in (10, 15, 20)]
  peak, finished = rates("train.steps=10")
  assert finished[0] == pytest.approx(1e-4)
  _, extended = rates("train.steps=20")
  assert extended[0] == pytest.approx(1e-4 + (peak - 1e-4) / 2)
  assert extended[2] == pytest.approx(1e-4)
  _, planned = rates("train.steps=20", "schedule.decay_steps=10")
  assert planned == pytest.approx([1e-4] * 3)
  with open(os.path.join(ROOT, "docs", "trainer.md"), encoding="utf-8") as f:
    page = " ".join(f.read().split())
  assert "a cosine run that had decayed to `min_lr` goes back up" in page
