"""The rows of metrics.csv (mpscale.trainer.runs.metrics_log): each column computed from a
log interval's step metrics, by hand, and the header the rows are written under."""

import importlib.util
import math
import subprocess
import sys

import numpy as np
import pytest

from mpscale.trainer.runs import metrics_log

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


def _step(loss, overflow, skipped, scale, norm, groups, **more):
  """One step's host metrics, as the train step returns them (numpy scalars)."""
  return {"loss": np.float32(loss), "num_tokens": np.float32(64),
          "loss_scale": np.float32(scale), "overflow": np.bool_(overflow),
          "nan": np.bool_(False), "inf": np.bool_(overflow),
          "skipped": np.int32(skipped), "consecutive_skipped": np.int32(overflow),
          "global_norm": np.float32(norm),
          "group_norms": {g: np.float32(v) for g, v in groups.items()},
          "group_sizes": {g: np.int32(4) for g in groups}, **more}


def _interval(evaluation=None, **more):
  return metrics_log.Interval(
      step=12, metrics=[
          _step(3.0, False, 1, 256.0, 0.5, {"a": 0.25, "b": 0.75}, **more),
          _step(2.0, True, 2, 128.0, math.inf, {"a": 1.0, "b": math.inf}, **more),
          _step(1.0, False, 2, 128.0, 2.0, {"a": 1.5, "b": 0.5}, **more)],
      evaluation=evaluation, overflow_total=5, tokens=3 * 64, consumed_samples=96,
      seconds=0.5, wall_s=7.25, flops=1.5e9)


def test_a_row_is_each_column_of_the_interval():
  row = metrics_log.csv_row(
      _interval({"loss": 1.25, "accuracy": 0.5}, learning_rate=np.float32(0.125)),
      ["accuracy", "top5"])
  assert row == {
      "step": 12,
      "consumed_samples": 96,
      "loss": 2.0,  # the interval's mean
      "eval_loss": 1.25,
      "loss_scale": 128.0,  # the last step's
      "overflows": 1,
      "overflow_total": 6,  # the run's before, plus the interval's
      "skipped": 2,
      "spikes": None,  # no skip_spikes: not watched
      "global_norm": 2.0,
      "learning_rate": 0.125,
      "tokens_per_s": 3 * 64 / 0.5,
      "tflops_per_device": 1.5e9 / 0.5 / 1e12,
      "mfu": None,  # no train.hardware: no peak
      "wall_s": 7.25,
      "eval_accuracy": 0.5,
      "eval_top5": row["eval_top5"],  # NaN: the evaluation lacks it
      "norm/a": 1.5, "norm/b": 0.5,
  }
  assert math.isnan(row["eval_top5"])
  assert list(row)[:len(metrics_log.CSV_FIELDS)] == list(metrics_log.CSV_FIELDS)
  assert list(row) == metrics_log.csv_fields(["accuracy", "top5"], ["a", "b"])


def test_the_spikes_column_is_the_last_steps_total():
  row = metrics_log.csv_row(_interval(spike=np.bool_(False), spikes=np.int32(3)), [])
  assert row["spikes"] == 3 and isinstance(row["spikes"], int)


def test_a_row_without_evaluation_or_learning_rate():
  row = metrics_log.csv_row(_interval(), ["accuracy"])
  assert row["eval_loss"] is None and row["eval_accuracy"] is None
  assert math.isnan(row["learning_rate"])


def test_the_header_is_the_columns_then_evaluation_then_groups(tmp_path):
  assert metrics_log.CSV_FIELDS == (
      "step", "consumed_samples", "loss", "eval_loss", "loss_scale", "overflows",
      "overflow_total", "skipped", "spikes", "global_norm", "learning_rate",
      "tokens_per_s", "tflops_per_device", "mfu", "wall_s")
  log = metrics_log.MetricsLog(str(tmp_path), ["a", "b"], 0, eval_names=["accuracy"])
  log.write(metrics_log.csv_row(_interval({"loss": 1.0, "accuracy": 0.5}),
                                ["accuracy"]))
  log.close()
  rows = metrics_log.read_rows(str(tmp_path / "metrics.csv"))
  assert list(rows[0]) == [*metrics_log.CSV_FIELDS, "eval_accuracy", "norm/a",
                           "norm/b"]
  assert rows[0]["overflow_total"] == "6" and rows[0]["eval_accuracy"] == "0.5"


def test_parameter_groups_learning_rates_are_columns_after_the_norms():
  interval = _interval(learning_rate=np.float32(0.5),
                       group_learning_rates={"embed": np.float32(0.05),
                                             "no_decay": np.float32(0.5)})
  row = metrics_log.csv_row(interval, [])
  assert row["lr/embed"] == np.float32(0.05) and row["lr/no_decay"] == 0.5
  fields = metrics_log.csv_fields([], ["a", "b"], ["embed", "no_decay"])
  assert fields[-4:] == ["norm/a", "norm/b", "lr/embed", "lr/no_decay"]
  assert list(row) == fields


def test_a_mixtures_routing_columns_are_the_last_steps_and_plotted(tmp_path):
  stats = lambda load: {"load_max": np.float32(load), "load_min": np.float32(0.05),  # noqa: E731
                        "dropped": np.float32(0.0), "aux_loss": np.float32(2.0),
                        "z_loss": np.float32(1.5)}
  interval = _interval()._replace(metrics=[
      {**m, "moe": stats(load)} for m, load in zip(_interval().metrics, (0.5, 0.4, 0.3))])
  row = metrics_log.csv_row(interval, [])
  assert row["moe/load_max"] == np.float32(0.3) and row["moe/z_loss"] == 1.5
  fields = metrics_log.csv_fields([], ["a", "b"], moe=True)
  assert list(row) == fields and fields[-5:] == [
      "moe/" + n for n in metrics_log.MOE_COLUMNS]
  log = metrics_log.MetricsLog(str(tmp_path), ["a", "b"], 0, moe=True)
  log.write(row)
  log.close()
  from mpscale.trainer.runs import plots  # noqa: PLC0415
  plots.plot_runs({"run": str(tmp_path / "metrics.csv")}, str(tmp_path / "m.png"))
  assert (tmp_path / "m.png").stat().st_size > 0


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch is not installed: there is no import of it to avoid")
def test_writing_events_does_not_import_torch(tmp_path):
  """tensorboardX's writer imports torch when it is installed (about 2 s a process);
  the log writes floats and keeps torch out, in a process that had not imported it,
  and the writer still writes its events."""
  code = ("import sys\nfrom mpscale.trainer.runs import metrics_log\n"
          f"log = metrics_log.MetricsLog({str(tmp_path)!r}, ['a'], 0)\n"
          "log.tb.add_scalar('loss', 1.5, 1)\nlog.close()\n"
          "assert 'torch' not in sys.modules, 'torch was imported'\n"
          "import torch  # still importable afterwards\n")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr
  assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
