"""TFLOP/s a device and MFU in every log (mpscale.trainer.runs.throughput): the FLOPs a
run logs are its compiled step's count, the one ``mpscale plan`` gives; the rates are
those FLOPs over the measured seconds, and over the profile's peak for the compute
dtype; ``train.hardware`` is checked before anything is written."""

import csv
import glob
import json
import logging
import math
import struct

import jax
import jax.numpy as jnp
import pytest

import mpscale.trainer
from mpscale.trainer import cli
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.planning import compiled as plan_lib
from mpscale.trainer.planning import hlo
from mpscale.trainer.planning.hardware import load_hardware, peak_for
from mpscale.trainer.runs import metrics_log, progress, throughput

BATCH, SEQ = 8, 32
CONFIG = {"name": "rates",
          "model": {"d_model": 32, "num_heads": 2, "num_layers": 2, "d_ff": 64,
                    "seq_len": SEQ},
          "data": {"batch_size": BATCH, "eval_batches": 1},
          "mesh": {"data": 2},
          "train": {"steps": 6, "log_every": 2, "eval_every": 0,
                    "checkpoint_every": 0},
          "schedule": {"warmup_steps": 1}}
PROFILE = """name: cpu-test
peak_flops: {float32: 2.5e11, bfloat16: 5.0e11}
hbm_bandwidth: 1.0e11
hbm_bytes: 1.6e10
devices_per_node: 8
links:
  - {name: memory, span: node, bandwidth: 1.0e10, latency: 1.0e-6}
"""


def _config(**train):
  return {**CONFIG, "train": {**CONFIG["train"], **train}}


def _profile(tmp_path, text=PROFILE):
  path = tmp_path / "cpu-test.yaml"
  path.write_text(text)
  return str(path)


class _Said(logging.Handler):
  """Keeps what JAX logs (``jax.log_compiles``: each program it compiles)."""

  def __init__(self):
    super().__init__()
    self.lines = []

  def emit(self, record):
    self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A short CPU run on 2 devices (data parallel), MFU against a profile file's
  peak: its folder, the profile's path, and the compilations JAX logged."""
  tmp = tmp_path_factory.mktemp("rates")
  profile = _profile(tmp)
  out = tmp / "run"
  said, logger = _Said(), logging.getLogger("jax")
  logger.addHandler(said)
  try:
    with jax.log_compiles(True):
      mpscale.trainer.run(_config(hardware=profile), out_dir=str(out), verbose=False,
                          progress=False)
  finally:
    logger.removeHandler(said)
  return out, profile, [line for line in said.lines
                        if line.startswith("Finished XLA compilation of")]


def _rows(out):
  with open(out / "metrics.csv", newline="") as f:
    return list(csv.DictReader(f))


def _summary(out):
  return json.loads((out / "summary.json").read_text())


def test_the_logged_flops_are_the_compiled_programs_count(run):
  out, profile, _ = run
  summary = _summary(out)
  # mpscale plan compiles the same step from shapes and reads the same count.
  cfg = config_lib.config_from_dict(_config(hardware=profile), "<test>")
  planned = plan_lib.plan(cfg)
  assert summary["flops_per_device"] == planned.flops_per_device > 0
  # ... which is the matrix products of the program each of the 2 devices runs: half
  # the batch's rows, so less than the whole step's.
  whole = plan_lib.plan(config_lib.config_from_dict(
      {**CONFIG, "mesh": {"data": 1}}, "<test>"))
  assert planned.flops_per_device < whole.flops_per_device


def test_counting_compiles_nothing_more(run):
  # The train step is compiled once: the count's compile is the one the steps run.
  _, _, compiled = run
  steps = [line for line in compiled if "jit(step_fn)" in line]
  assert len(steps) == 1, compiled


def test_the_columns_are_the_flops_over_the_seconds_and_the_peak(run):
  out, profile, _ = run
  rows, summary = _rows(out), _summary(out)
  assert [r["step"] for r in rows] == ["2", "4", "6"]
  assert set(metrics_log.TIMED) <= set(rows[0])
  peak = peak_for(load_hardware(profile), "float32")
  flops_per_token = summary["flops_per_device"] / (BATCH * SEQ)
  for row in rows:
    tokens_per_s, tflops, mfu = (float(row[k]) for k in ("tokens_per_s",
                                                         "tflops_per_device", "mfu"))
    assert tflops > 0 and mfu > 0
    # Both rates are over the same timed steps and seconds: FLOPs per token.
    assert tflops * 1e12 / tokens_per_s == pytest.approx(flops_per_token, rel=1e-9)
    assert mfu == pytest.approx(tflops * 1e12 / peak, rel=1e-9)
  assert summary["hardware"] == "cpu-test" and summary["peak_tflops"] == peak / 1e12
  assert summary["mfu"] == pytest.approx(summary["tflops_per_device"] * 1e12 / peak,
                                         rel=1e-9)
  # The run's rate lies within its rows' (a mean of theirs, weighted by seconds).
  tflops = [float(r["tflops_per_device"]) for r in rows]
  assert min(tflops) * (1 - 1e-9) <= summary["tflops_per_device"] <= max(tflops) * (
      1 + 1e-9)


def test_the_comparison_table_carries_each_runs_tflops_and_mfu(run):
  from mpscale.trainer.runs import compare  # noqa: PLC0415
  out, _, _ = run
  summary = _summary(out)
  no_profile = {**summary, "name": "no profile", "mfu": None, "hardware": None}
  older = {k: v for k, v in summary.items() if k not in ("tflops_per_device", "mfu")}
  older["name"] = "older"
  untimed = {**summary, "name": "untimed", "tflops_per_device": float("nan")}
  header, rows = compare.comparison_table([summary, no_profile, older, untimed])
  cells = [dict(zip(header, row)) for row in rows]
  assert header[-2:] == ["TFLOP/s a device", "MFU"]
  tflops, mfu = cells[0]["TFLOP/s a device"], cells[0]["MFU"]
  assert tflops == pytest.approx(summary["tflops_per_device"], rel=5e-3) and tflops > 0
  assert mfu == f"{100 * summary['mfu']:.1f}%"
  assert cells[1]["TFLOP/s a device"] == tflops and cells[1]["MFU"] == ""
  assert cells[2]["TFLOP/s a device"] == cells[2]["MFU"] == ""
  assert cells[3]["TFLOP/s a device"] == ""


def _events(path):
  """``{tag: {step: value}}`` of a TensorBoard event file (TFRecord framing: length,
  its CRC, the record, its CRC)."""
  from tensorboardX.proto import event_pb2  # noqa: PLC0415
  data, i, found = open(path, "rb").read(), 0, {}
  while i < len(data):
    (length,) = struct.unpack("<Q", data[i:i + 8])
    event = event_pb2.Event.FromString(data[i + 12:i + 12 + length])
    i += 12 + length + 4
    for value in event.summary.value:
      found.setdefault(value.tag, {})[event.step] = value.simple_value
  return found


def test_tensorboard_carries_the_rates(run):
  out, _, _ = run
  (events,) = glob.glob(str(out / "tb" / "events.out.tfevents.*"))
  found = _events(events)
  for row in _rows(out):
    for key in ("tflops_per_device", "mfu"):
      assert found[f"train/{key}"][int(row["step"])] == pytest.approx(
          float(row[key]), rel=1e-6)


def test_a_row_without_a_peak_has_tflops_and_no_mfu():
  interval = metrics_log.Interval(
      step=4, metrics=[{"loss": 1.0, "loss_scale": 1.0, "overflow": False,
                        "skipped": 0, "global_norm": 1.0, "group_norms": {}}] * 2,
      evaluation=None, overflow_total=0, tokens=512, consumed_samples=32,
      seconds=0.25, wall_s=1.0, flops=3e9)
  row = metrics_log.csv_row(interval, [])
  assert row["tflops_per_device"] == 3e9 / 0.25 / 1e12 and row["mfu"] is None
  assert row["tokens_per_s"] == 512 / 0.25
  peaked = metrics_log.csv_row(interval._replace(peak_flops=1e11), [])
  assert peaked["mfu"] == 3e9 / 0.25 / 1e11
  # No step timed (a first row of one step, which compiled): no rates.
  untimed = metrics_log.csv_row(interval._replace(seconds=math.nan, tokens=0,
                                                  flops=0.0, peak_flops=1e11), [])
  assert all(math.isnan(untimed[k]) for k in ("tokens_per_s", "tflops_per_device",
                                              "mfu"))


def test_the_progress_line_shows_the_rates():
  row = {"loss": 3.17, "loss_scale": 1.0, "global_norm": 0.81, "tokens_per_s": 3e4,
         "tflops_per_device": 0.0123, "mfu": 0.4567}
  text = progress.progress_info(row, 0, math.nan, scaled=False)
  assert text.endswith("30.0k tok/s | 0.0123 TFLOP/s a device | MFU 45.7%"), text
  no_peak = progress.progress_info({**row, "mfu": None}, 0, math.nan, scaled=False)
  assert "TFLOP/s a device" in no_peak and "MFU" not in no_peak
  untimed = progress.progress_info({**row, "tokens_per_s": math.nan,
                                    "tflops_per_device": math.nan, "mfu": math.nan},
                                   0, math.nan, scaled=False)
  assert "tok/s" not in untimed and "TFLOP/s" not in untimed and "MFU" not in untimed


def test_counting_compiles_the_step_once_per_batch_shape():
  step = jax.jit(lambda s, b: (s + 1.0, {"y": (b @ b.T).sum()}), donate_argnums=(0,))
  state = jnp.zeros(())
  small, large = jnp.ones((8, 16)), jnp.ones((32, 16))
  compiles = []

  def listen(event, seconds, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    count = throughput.StepFlops(step)
    for batch in (small, small, large, small):
      flops = count(state, batch)
      state, _ = step(state, batch)  # runs the program the count compiled
      rows, width = batch.shape
      assert flops == 2 * rows * rows * width  # b @ b.T: rows x rows, width deep
  finally:
    unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
    if unregister is not None:
      unregister(listen)
    else:
      compiles.append("done")  # (older JAX: the listener stays, inert)
  assert compiles.count("/jax/core/compile/backend_compile_duration") == 2, compiles
  assert count.counted and len(count.counted) == 2


def test_the_count_is_the_plans_reading_of_the_program():
  step = jax.jit(lambda s, b: (s, {"y": (b @ b.T).sum()}))
  state, batch = jnp.zeros(()), jnp.ones((8, 16))
  text = step.lower(state, batch).compile().as_text()
  assert throughput.StepFlops(step)(state, batch) == hlo.matmul_flops(text)


def test_a_bad_hardware_name_is_refused_before_anything_is_written(tmp_path):
  out = tmp_path / "run"
  with pytest.raises(config_lib.ConfigError) as e:
    mpscale.trainer.run(_config(hardware="h100"), out_dir=str(out), verbose=False,
                        progress=False)
  assert e.value.keys[0] == "train.hardware"
  assert "train.hardware" in str(e.value) and "h100-80g" in str(e.value)  # a hint
  assert not out.exists()


def test_a_profile_without_the_compute_dtypes_peak_is_refused(tmp_path):
  profile = _profile(tmp_path, PROFILE.replace("float32: 2.5e11, ", ""))
  out = tmp_path / "run"
  with pytest.raises(config_lib.ConfigError) as e:
    mpscale.trainer.run(_config(hardware=profile), out_dir=str(out), verbose=False,
                        progress=False)
  assert e.value.keys == ("train.hardware", "precision.policy")
  assert "no peak for float32" in str(e.value) and "bfloat16" in str(e.value)
  assert not out.exists()


def test_the_command_takes_hardware_and_says_a_bad_name_by_key(tmp_path, capsys):
  path = tmp_path / "rates.yaml"
  import yaml  # noqa: PLC0415
  path.write_text(yaml.safe_dump(CONFIG))
  out = tmp_path / "run"
  assert cli.main(["train", "--config", str(path), "--hardware", "a100",
                   "--out", str(out), "--no-progress"]) == 2
  err = capsys.readouterr().err
  assert "train.hardware" in err and "a100-80g" in err, err
  assert not out.exists()


def test_the_key_is_a_string_and_a_resume_may_change_it():
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.config_from_dict(_config(hardware=3), "<test>")
  assert e.value.keys[0] == "train.hardware"
  saved = config_lib.config_from_dict(_config(), "<test>")
  assert config_lib.resume_changes(
      saved, config_lib.config_from_dict(_config(hardware="h100-80g"), "<test>")) == {}


def test_a_profile_file_is_relative_to_the_config_and_the_flag_to_here(tmp_path,
                                                                       monkeypatch):
  import yaml  # noqa: PLC0415
  folder = tmp_path / "configs"
  folder.mkdir()
  path = folder / "rates.yaml"
  path.write_text(yaml.safe_dump(_config(hardware="profiles/gpu.yaml")))
  cfg = config_lib.load_config(str(path))
  assert cfg.train.hardware == str(folder / "profiles" / "gpu.yaml")
  assert config_lib.load_config(str(path), ["train.hardware=h100-80g"]).train.hardware \
      == "h100-80g"  # a built-in profile's name stays a name
  # --hardware FILE is relative to the working directory, as a command's paths are.
  monkeypatch.chdir(tmp_path)
  _profile(tmp_path)
  args = cli._parser().parse_args(["train", "--config", str(path), "--hardware",
                                   "cpu-test.yaml"])
  cfg = config_lib.load_config(str(path), args.set + cli._hardware_set(args))
  assert cfg.train.hardware == str(tmp_path / "cpu-test.yaml")


def test_a_step_that_is_not_jitted_counts_nan_and_still_runs():
  """A plain function as the step (a wrapper, or a test's stand-in) has no program
  to read: its count is NaN, so the rate is empty, and the step is not called."""
  calls = []

  def step(state, batch):
    calls.append(batch)
    return state, {}

  count = throughput.StepFlops(step)
  assert math.isnan(count(jnp.zeros(()), jnp.ones((4, 2))))
  assert math.isnan(count.last) and not calls
