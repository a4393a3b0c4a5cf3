"""The plot of a run's (or several runs') logged series."""

from __future__ import annotations

import math
from typing import Any, Optional

from mpscale.trainer.runs.metrics_log import (EVAL_PREFIX, MOE_PREFIX, NORM_PREFIX,
                                              read_rows, to_float)


def _series(rows: list[dict[str, str]], key: str) -> tuple[list[int], list[float]]:
  steps, values = [], []
  for r in rows:
    v = to_float(r.get(key))
    if not math.isnan(v):
      steps.append(int(r["step"]))
      values.append(v)
  return steps, values


def plot_runs(runs: dict[str, str], path: str, title: str = "",
              loss_unit: Optional[str] = "byte") -> Any:
  """One PNG of every logged series: loss (train solid, eval dashed), loss scale,
  global norm, learning rate, group ("local") norms, overflows and, when a run logs
  them, the model's evaluation metrics (``eval_<name>``, e.g. accuracy).

  The train loss is the mean over each logging interval and is drawn on a log axis
  whole, the first steps included; norms are the logged step's own values.

  Args:
    runs: run label -> its ``metrics.csv``.
    path: the PNG to write.
    title: the figure's title.
    loss_unit: what the loss is per (``"byte"``, ``"token"``), in nats; ``None``
      for a user's model (no unit said).

  Returns:
    The matplotlib ``Figure``.
  """
  from matplotlib.figure import Figure  # no pyplot: leaves the global backend alone

  all_rows = {label: read_rows(csv_path) for label, csv_path in runs.items()}
  # The model's evaluation metrics (eval_<name> beside eval_loss) get a panel.
  metric_keys = sorted({k for rows in all_rows.values() for k in (rows[0] if rows
                                                                   else {})
                        if k.startswith(EVAL_PREFIX) and k != "eval_loss"})
  # A mixture of experts' load (moe/load_max, moe/load_min) gets one too.
  moe = any(MOE_PREFIX + "load_max" in (rows[0] if rows else {})
            for rows in all_rows.values())
  wide = bool(metric_keys) or moe
  fig = Figure(figsize=(17 if wide else 13, 7), layout="constrained")
  axes = fig.subplots(2, 4 if wide else 3).ravel()
  styles = ("-", "--", ":", "-.")
  for i, (label, rows) in enumerate(all_rows.items()):
    color = f"C{i % 10}"
    axes[0].plot(*_series(rows, "loss"), color=color, label=label)
    steps, values = _series(rows, "eval_loss")
    if values:
      axes[0].plot(steps, values, "o--", color=color, ms=3)
    axes[1].plot(*_series(rows, "loss_scale"), color=color, label=label)
    axes[2].plot(*_series(rows, "global_norm"), color=color, label=label)
    axes[3].plot(*_series(rows, "learning_rate"), color=color, label=label)
    groups = [k for k in (rows[0] if rows else {}) if k.startswith(NORM_PREFIX)]
    for j, key in enumerate(groups):
      group = key.removeprefix(NORM_PREFIX)
      axes[4].plot(*_series(rows, key), color=color, ls=styles[j % len(styles)],
                   label=f"{label}: {group}" if len(runs) > 1 else group)
    axes[5].plot(*_series(rows, "overflow_total"), color=color, label=label)
    for j, key in enumerate((MOE_PREFIX + "load_max", MOE_PREFIX + "load_min")
                            if moe else ()):
      axes[7].plot(*_series(rows, key), color=color, ls=styles[j],
                   label=f"{label}: {key}" if len(runs) > 1 else key)
    for j, key in enumerate(metric_keys):
      metric = key.removeprefix(EVAL_PREFIX)
      axes[6].plot(*_series(rows, key), "o" + styles[j % len(styles)], color=color,
                   ms=3, label=f"{label}: {metric}" if len(runs) > 1 else metric)
  unit = "" if loss_unit is None else f", nats/{loss_unit}"
  titles = (f"loss{unit} (train: interval mean; dashed: eval)", "loss scale",
            "gradient global norm (logged step)", "learning rate",
            "group norms (logged step)", "overflows (skipped steps), total")
  if wide:
    titles += ("evaluation metrics (model.metrics)",
               "expert load: most and least loaded expert's share")
    for ax, shown in ((axes[6], metric_keys), (axes[7], moe)):
      if shown:
        ax.legend(fontsize=7)
      else:
        ax.set_visible(False)
  for ax, name in zip(axes, titles):
    ax.set_xlabel("step")
    ax.set_title(name, fontsize=10)
    ax.grid(alpha=0.3)
  axes[0].set_yscale("log")
  axes[1].set_yscale("log", base=2)
  for ax in (axes[2], axes[4]):
    if any(line.get_ydata().size for line in ax.get_lines()):
      ax.set_yscale("log")
  axes[0].legend(fontsize=7)
  if axes[4].get_lines():
    axes[4].legend(fontsize=6)
  if title:
    fig.suptitle(title)
  fig.savefig(path, dpi=100)
  return fig
