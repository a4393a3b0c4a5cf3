"""A run's metrics log: ``metrics.csv`` and TensorBoard events, one row per log point."""

from __future__ import annotations

import csv
import math
import os
from typing import Any, Sequence


CSV_FIELDS = ("step", "loss", "eval_loss", "loss_scale", "overflows", "overflow_total",
              "skipped", "global_norm", "learning_rate", "tokens_per_s", "wall_s")
"""The fixed columns of ``metrics.csv``; the model's evaluation metrics follow as
``eval_<name>``, then the group norms as ``norm/<group>``."""


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
               enabled: bool = True, eval_names: Sequence[str] = ()):
    self.enabled = enabled
    self.path = os.path.join(out_dir, "metrics.csv")
    self.fields = (list(CSV_FIELDS) + list(eval_names)
                   + [f"norm/{g}" for g in group_names])
    kept = [r for r in read_rows(self.path) if int(r["step"]) <= start_step]
    self.last = kept[-1] if kept else {}
    if not enabled:
      return
    self.file = open(self.path, "w", newline="")
    self.writer = csv.DictWriter(self.file, self.fields, extrasaction="ignore")
    self.writer.writeheader()
    self.writer.writerows(kept)
    self.file.flush()
    from tensorboardX import SummaryWriter
    # purge_step drops the events of steps a resumed run will log again.
    self.tb = SummaryWriter(os.path.join(out_dir, "tb"),
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
      tag = (f"norms/{key[5:]}" if key.startswith("norm/")
             else f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}")
      self.tb.add_scalar(tag, float(value), step)
    self.tb.flush()

  def close(self) -> None:
    if self.enabled:
      self.file.close()
      self.tb.close()
