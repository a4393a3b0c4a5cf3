"""The progress display of a run: a rich bar and the metrics line under it."""

from __future__ import annotations

import math
from typing import Any


def fmt(x: float, digits: int = 4) -> str:
  return "nan" if x is None or math.isnan(x) else f"{x:.{digits}g}"


def scale_text(scale: float) -> str:
  """A loss scale as ``2^k`` when it is a power of two (as it is, with the defaults)."""
  if scale > 0 and math.isfinite(scale) and math.frexp(scale)[0] == 0.5:
    return f"2^{math.frexp(scale)[1] - 1}"
  return fmt(scale)


def progress_info(row: dict[str, Any], overflow_total: int, eval_loss: float, *,
                  scaled: bool = True) -> str:
  """The metrics line under the progress bar, most important first (it is cut at the
  terminal's width): the interval's mean loss, the last evaluation, the scale (not
  without loss scaling: ``scaled`` false), the overflows, the norm, tokens/s, TFLOP/s a
  device and the MFU (where the row has them: `mpscale.trainer.runs.metrics_log`)."""
  interval = row.get("interval", 1)
  parts = [f"loss {fmt(row['loss'])}" + (f" ({interval}-step mean)" if interval > 1
                                          else "")]
  if eval_loss is not None and not math.isnan(eval_loss):
    parts.append(f"eval {fmt(eval_loss)}")
  if scaled:
    parts.append(f"scale {scale_text(row['loss_scale'])}")
  parts += [f"overflows {overflow_total}", f"norm {fmt(row['global_norm'], 3)}"]
  rates = (row["tokens_per_s"], row.get("tflops_per_device"), row.get("mfu"))
  if math.isfinite(rates[0]):  # NaN: no step timed yet (the first compiles)
    parts.append(f"{rates[0] / 1e3:.1f}k tok/s")
  if rates[1] is not None and math.isfinite(rates[1]):
    parts.append(f"{fmt(rates[1], 3)} TFLOP/s a device")
  if rates[2] is not None and math.isfinite(rates[2]):
    parts.append(f"MFU {rates[2]:.1%}")
  return " | ".join(parts)


def make_progress(console: Any, *, disable: bool = False) -> Any:
  """A two-line rich progress display: name, bar, step counter, elapsed and remaining
  time on the first line (always whole), the metrics line (`progress_info`, cut
  with an ellipsis to the width) on the second."""
  from rich import progress as rich_progress  # noqa: PLC0415
  from rich.text import Text  # noqa: PLC0415

  class Progress(rich_progress.Progress):
    def get_renderables(self):
      yield self.make_tasks_table(self.tasks)
      for task in self.tasks:
        info = task.fields.get("info", "")
        if info:
          yield Text(info, no_wrap=True, overflow="ellipsis")

  return Progress(
      rich_progress.TextColumn("[bold]{task.description}"),
      rich_progress.BarColumn(bar_width=None),
      rich_progress.MofNCompleteColumn(), rich_progress.TimeElapsedColumn(),
      rich_progress.TextColumn("eta"), rich_progress.TimeRemainingColumn(),
      console=console, disable=disable, transient=False, expand=False)
