"""A run's metrics log: ``metrics.csv`` and TensorBoard events, one row per log point.

A row sums up one log interval (`Interval`: the steps since the previous row, with
their metrics, `mpscale.step.StepMetrics`' names and ``loss``): `COLUMNS` says how
each fixed column is computed from it, and `csv_row` builds the row, the model's
evaluation metrics (``eval_<name>``) and the group norms (``norm/<group>``) after
them.
"""

from __future__ import annotations

import csv
import math
import os
import sys
from typing import Any, Callable, NamedTuple, Optional, Sequence

EVAL_PREFIX = "eval_"
"""Names the column of a model's evaluation metric: ``eval_<name>``."""
NORM_PREFIX = "norm/"
"""Names the column of a group's gradient norm: ``norm/<group>``."""
LR_PREFIX = "lr/"
"""Names the column of a parameter group's learning rate: ``lr/<group>``
(``optimizer.groups``, `mpscale.param_groups`)."""
MOE_PREFIX = "moe/"
"""Names the column of a mixture of experts' routing statistic: ``moe/<name>``
(`MOE_COLUMNS`)."""
MOE_COLUMNS = ("load_max", "load_min", "dropped", "aux_loss", "z_loss")
"""A mixture of experts' columns (the logged step's last micro-batch,
`mpscale.trainer.models.lm.TinyLM.routing_metrics`): the most and the least loaded
expert's share of the assignments (``1 / num_experts`` each when even; over every
block), the share of assignments dropped for capacity, and the load-balancing and
z-losses (means over the blocks)."""
DATA_PREFIX = "data/"
"""Names the column of a blended corpus's realised share of the samples trained on:
``data/<name>`` (``data.blend``, `mpscale.trainer.data.corpora`)."""


class Interval(NamedTuple):
  """The steps of one log interval, with what a row needs beside their metrics."""
  step: int
  """The last step done: the row's step."""
  metrics: list[dict[str, Any]]
  """Each step's metrics as host values, in order (the train step's: ``loss``,
  ``num_tokens`` and `mpscale.step.StepMetrics`' names)."""
  evaluation: Optional[dict[str, float]]
  """The evaluation at ``step`` (``"loss"`` and the model's metrics by name), or
  ``None`` when this row does not evaluate."""
  overflow_total: int
  """Overflowed steps of the run before this interval (a resumed run's included)."""
  tokens: int
  """Tokens (or rows) the interval's timed steps trained on: their global batches,
  whose size may change from step to step (a batch-size ramp-up). The first step a
  process trains (compiling the step) is not timed, nor counted here."""
  consumed_samples: int
  """Samples (rows of global batches) trained on by the end of ``step``, the run's
  before it included (Megatron's ``consumed_samples``)."""
  seconds: float
  """Seconds the interval's timed steps took (NaN when none is: a first row of one
  step)."""
  wall_s: float
  """Seconds since the run started training in this process."""
  flops: float = math.nan
  """FLOPs one device ran in the interval's timed steps: each step's compiled
  program's (`mpscale.trainer.runs.throughput.StepFlops`); NaN when not counted."""
  peak_flops: Optional[float] = None
  """The peak FLOP/s of a device for the step's compute dtype
  (`mpscale.trainer.runs.throughput.peak`); ``None`` without ``train.hardware``."""


def per_second(amount: float, seconds: float) -> float:
  """``amount`` over ``seconds`` (at least a nanosecond)."""
  return amount / max(seconds, 1e-9)


def tflops_per_device(flops: float, seconds: float) -> float:
  """TFLOP/s a device: the ``flops`` one device ran in ``seconds``, per second, over
  1e12."""
  return per_second(flops, seconds) / 1e12


def mfu(flops: float, seconds: float, peak_flops: Optional[float]) -> Optional[float]:
  """The share of ``peak_flops`` (FLOP/s) that ``flops`` in ``seconds`` reach (a
  device's); ``None`` without a peak."""
  return None if peak_flops is None else per_second(flops, seconds) / peak_flops


def _overflows(interval: Interval) -> int:
  return sum(int(m["overflow"]) for m in interval.metrics)


def _last(name: str, cast: Callable[[Any], Any]) -> Callable[[Interval], Any]:
  """The column of metric ``name`` of the interval's last step."""
  return lambda interval: cast(interval.metrics[-1][name])


class Column(NamedTuple):
  """A fixed column of ``metrics.csv``."""
  name: str
  """Its header."""
  value: Callable[[Interval], Any]
  """Its value from a log interval (``None``: an empty cell)."""


COLUMNS = (
    Column("step", lambda i: i.step),
    Column("consumed_samples", lambda i: i.consumed_samples),
    # The mean over the interval: the steps between rows are not lost.
    Column("loss",
           lambda i: sum(float(m["loss"]) for m in i.metrics) / len(i.metrics)),
    Column("eval_loss", lambda i: None if i.evaluation is None else i.evaluation["loss"]),
    Column("loss_scale", _last("loss_scale", float)),
    Column("overflows", _overflows),
    Column("overflow_total", lambda i: i.overflow_total + _overflows(i)),
    Column("skipped", _last("skipped", int)),
    # Empty without skip.spikes: not watched, rather than none seen.
    Column("spikes", lambda i: (int(i.metrics[-1]["spikes"])
                                if "spikes" in i.metrics[-1] else None)),
    Column("global_norm", _last("global_norm", float)),
    Column("learning_rate",
           lambda i: float(i.metrics[-1].get("learning_rate", math.nan))),
    Column("tokens_per_s", lambda i: per_second(i.tokens, i.seconds)),
    Column("tflops_per_device", lambda i: tflops_per_device(i.flops, i.seconds)),
    # Empty without train.hardware: no peak to divide by.
    Column("mfu", lambda i: mfu(i.flops, i.seconds, i.peak_flops)),
    Column("wall_s", lambda i: i.wall_s),
)
"""The fixed columns of ``metrics.csv``, in order, each computed from an `Interval`:
the samples consumed by the row's step, the interval's mean loss and overflow count, the last step's loss scale, skipped
total, spike total (empty without spike skipping; the skipped total counts them
too), global norm and learning rate (NaN when the optimizer records none), the
evaluation's loss (empty when the row does not evaluate), the throughput (tokens/s,
TFLOP/s a device, and MFU, empty without ``train.hardware``) and the time."""

TIMED = ("tokens_per_s", "tflops_per_device", "mfu", "wall_s")
"""The columns read off the clock, which differ between two runs of one config."""

CSV_FIELDS = tuple(column.name for column in COLUMNS)
"""The names of `COLUMNS`; the model's evaluation metrics follow as ``eval_<name>``,
then the group norms as ``norm/<group>`` and the parameter groups' learning rates as
``lr/<group>``."""


def csv_fields(eval_names: Sequence[str], group_names: Sequence[str],
               lr_groups: Sequence[str] = (),
               data_names: Sequence[str] = (), moe: bool = False) -> list[str]:
  """Every column of ``metrics.csv``: `CSV_FIELDS`, ``eval_<name>`` for each of the
  model's evaluation metrics, ``norm/<group>`` for each group of the norms,
  ``lr/<group>`` for each parameter group (``lr_groups``), ``data/<name>`` for
  each corpus of a blend (``data_names``) and, for a mixture of experts (``moe``),
  `MOE_COLUMNS`."""
  return (list(CSV_FIELDS) + [EVAL_PREFIX + n for n in eval_names]
          + [NORM_PREFIX + g for g in group_names]
          + [LR_PREFIX + g for g in lr_groups]
          + [DATA_PREFIX + n for n in data_names]
          + ([MOE_PREFIX + n for n in MOE_COLUMNS] if moe else []))


def csv_row(interval: Interval, eval_names: Sequence[str]) -> dict[str, Any]:
  """The row of ``metrics.csv`` for ``interval``: `COLUMNS`, then each of the model's
  evaluation metrics ``eval_names`` (``None`` when the row does not evaluate, NaN for
  one the evaluation lacks), then the last step's group norms and parameter groups'
  learning rates."""
  row = {column.name: column.value(interval) for column in COLUMNS}
  evaluation = interval.evaluation
  row.update({EVAL_PREFIX + n: (None if evaluation is None
                                else evaluation.get(n, math.nan))
              for n in eval_names})
  row.update({NORM_PREFIX + g: float(v)
              for g, v in interval.metrics[-1]["group_norms"].items()})
  row.update({LR_PREFIX + g: float(v) for g, v in
              interval.metrics[-1].get("group_learning_rates", {}).items()})
  row.update({MOE_PREFIX + n: float(v) for n, v in
              interval.metrics[-1].get("moe", {}).items()})
  return row


def read_rows(path: str) -> list[dict[str, str]]:
  if not os.path.exists(path):
    return []
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def to_float(text: Any) -> float:
  try:
    return float(text)
  except (TypeError, ValueError):
    return math.nan


class MetricsLog:
  """``metrics.csv`` and TensorBoard events of one run (on the main process only)."""

  def __init__(self, out_dir: str, group_names: Sequence[str], start_step: int,
               enabled: bool = True, eval_names: Sequence[str] = (),
               lr_groups: Sequence[str] = (), data_names: Sequence[str] = (),
               moe: bool = False):
    """Opens ``out_dir/metrics.csv`` (the rows of a resumed run up to
    ``start_step`` kept) and the TensorBoard events; with ``enabled`` false, only
    reads the kept rows. ``eval_names`` are the model's evaluation metrics (without
    the ``eval_`` prefix), ``lr_groups`` the parameter groups, ``data_names`` the
    corpora of a blend, ``moe`` whether the model routes to experts."""
    self.enabled = enabled
    self.path = os.path.join(out_dir, "metrics.csv")
    self.fields = csv_fields(eval_names, group_names, lr_groups, data_names, moe)
    kept = [r for r in read_rows(self.path) if int(r["step"]) <= start_step]
    self.last = kept[-1] if kept else {}
    if not enabled:
      return
    self.file = open(self.path, "w", newline="")
    self.writer = csv.DictWriter(self.file, self.fields, extrasaction="ignore")
    self.writer.writeheader()
    self.writer.writerows(kept)
    self.file.flush()
    # purge_step drops the events of steps a resumed run will log again.
    self.tb = _summary_writer()(os.path.join(out_dir, "tb"),
                                purge_step=start_step + 1 if start_step else None)

  def write(self, row: dict[str, Any]) -> None:
    if not self.enabled:
      return
    self.writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    self.file.flush()
    step = int(row["step"])
    for key, value in row.items():
      # Non-finite values (the norm of an overflowed step) stay in the CSV only.
      if (key in ("step", "wall_s") or value is None or value == ""
          or not math.isfinite(float(value))):
        continue
      tag = (f"norms/{key.removeprefix(NORM_PREFIX)}" if key.startswith(NORM_PREFIX)
             else f"learning_rate/{key.removeprefix(LR_PREFIX)}"
             if key.startswith(LR_PREFIX)
             else f"eval/{key.removeprefix(EVAL_PREFIX)}"
             if key.startswith(EVAL_PREFIX) else f"train/{key}")
      self.tb.add_scalar(tag, float(value), step)
    self.tb.flush()

  def close(self) -> None:
    if self.enabled:
      self.file.close()
      self.tb.close()


def _summary_writer() -> type:
  """tensorboardX's ``SummaryWriter``, imported when a run first writes events.

  tensorboardX's writer imports torch when torch is installed (about 2 s, to accept
  torch tensors); the log writes floats, so torch is kept out of that import where
  the process has not imported it already. A process that writes no events (an
  evaluation, a plan) imports neither.
  """
  if "tensorboardX" in sys.modules or "torch" in sys.modules:
    from tensorboardX import SummaryWriter  # noqa: PLC0415 - see the docstring
    return SummaryWriter
  sys.modules["torch"] = None  # an import of torch fails at once, as if absent
  try:
    from tensorboardX import SummaryWriter  # noqa: PLC0415
  finally:
    del sys.modules["torch"]
  return SummaryWriter
