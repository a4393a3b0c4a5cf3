"""``mpscale compare``: train several configs and put them side by side."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
from typing import Any, Optional, Sequence

from mpscale.trainer.config import load as config_lib
from mpscale.trainer.data import corpora
from mpscale.trainer.runs.loop import check_out_dir, train
from mpscale.trainer.runs.plots import plot_runs


def _rate_cells(summary: dict[str, Any]) -> list[Any]:
  """A summary's ``TFLOP/s a device`` (3 significant digits) and ``MFU`` (a
  percentage, with ``train.hardware`` or ``--hardware``) cells; empty where the run
  has none (no timed step, no profile, a summary from before they were logged)."""
  tflops, mfu = summary.get("tflops_per_device"), summary.get("mfu")
  finite = lambda v: isinstance(v, (int, float)) and math.isfinite(v)
  return [float(f"{tflops:.3g}") if finite(tflops) else "",
          f"{100 * mfu:.1f}%" if finite(mfu) else ""]


def comparison_table(summaries: Sequence[dict[str, Any]]) -> tuple[list[str], list[list]]:
  """Header and rows of the comparison table (the first run is the reference): the
  runs' settings, losses, skips, optimizer state, time, and their TFLOP/s a device
  and MFU (``summary.json``'s ``tflops_per_device`` and ``mfu``)."""
  header = ["run", "policy", "loss scale", "optimizer", "steps", "final train loss",
            "final eval loss", "eval vs first", "skipped steps", "optimizer state (KiB)",
            "train time (s)", "TFLOP/s a device", "MFU"]
  ref = summaries[0]["final_eval_loss"] if summaries else math.nan
  rows = []
  for s in summaries:
    rel = (s["final_eval_loss"] / ref - 1) * 100 if ref else math.nan
    rows.append([s["name"], s["policy"], s["loss_scale"], s["optimizer"], s["steps"],
                 round(s["final_train_loss"], 4), round(s["final_eval_loss"], 4),
                 f"{rel:+.2f}%", s["skipped"],
                 round(s["optimizer_state_bytes"] / 1024, 1),
                 round(s["train_seconds"], 1), *_rate_cells(s)])
  return header, rows


def earlier_summaries(out_dir: str, names: Sequence[str]) -> list[dict[str, Any]]:
  """The summaries of the runs an earlier comparison in ``out_dir`` listed
  (``comparison.csv``) that ``names`` leaves out, in its order: ``compare --resume``
  with fewer configs keeps their rows (a run whose folder lost its ``summary.json``
  drops out)."""
  path = os.path.join(out_dir, "comparison.csv")
  if not os.path.exists(path):
    return []
  with open(path, newline="") as f:
    listed = [row["run"] for row in csv.DictReader(f) if row.get("run")]
  kept = []
  for name in listed:
    summary = os.path.join(out_dir, name, "summary.json")
    if name not in names and os.path.exists(summary):
      with open(summary) as f:
        kept.append(json.load(f))
  return kept


def _saved_loss_unit(run_dir: str) -> Optional[str]:
  """The loss unit of the run in ``run_dir`` (its ``config.yaml``); ``None`` where
  that no longer loads (the plot then names no unit)."""
  try:
    return corpora.loss_unit(config_lib.load_config(
        os.path.join(run_dir, "config.yaml"), checkpoint_sizes=False))
  except config_lib.ConfigError:
    return None


def compare(config_paths: Sequence[str], out_dir: str = os.path.join("runs", "compare"),
            *, overrides: Sequence[str] = (), data_path: Optional[str] = None,
            resume: bool = False, overwrite: bool = False,
            progress: Optional[bool] = None, plot_path: Optional[str] = None,
            verbose: bool = True) -> list[dict[str, Any]]:
  """Train every config into ``out_dir/<name>`` and compare them.

  Writes ``comparison.csv``, ``comparison.md`` and ``comparison.png`` (and ``plot_path``
  if given) into ``out_dir``. Every config is loaded and checked before any run starts.
  With ``resume`` the table and plot keep the earlier comparison's other runs
  (`earlier_summaries`), before the runs of ``config_paths``.

  Returns:
    The runs' summaries, in order.

  Raises:
    config_lib.ConfigError: for a bad config or two configs with the same name.
  """
  cfgs = [config_lib.load_config(p, overrides, data_path) for p in config_paths]
  names = [cfg.name for cfg in cfgs]
  if len(set(names)) != len(names):
    dup = next(n for n in names if names.count(n) > 1)
    raise config_lib.ConfigError(f"two configs are named {dup!r}; give each a distinct "
                                 "name (the name: key)")
  for cfg in cfgs:
    check_out_dir(os.path.join(out_dir, cfg.name), resume, overwrite)
  kept = earlier_summaries(out_dir, names) if resume else []
  summaries = [train(cfg, os.path.join(out_dir, cfg.name), resume=resume,
                     overwrite=overwrite, progress=progress, source=path,
                     verbose=verbose)
               for cfg, path in zip(cfgs, config_paths)]
  header, rows = comparison_table(kept + summaries)
  with open(os.path.join(out_dir, "comparison.csv"), "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(header)
    writer.writerows(rows)
  md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  md += ["| " + " | ".join(str(v) for v in r) + " |" for r in rows]
  with open(os.path.join(out_dir, "comparison.md"), "w") as f:
    f.write("\n".join(md) + "\n")
  runs = {s["name"]: os.path.join(out_dir, s["name"], "metrics.csv") for s in kept}
  runs.update({s["name"]: os.path.join(s["out_dir"], "metrics.csv") for s in summaries})
  png = os.path.join(out_dir, "comparison.png")
  units = {corpora.loss_unit(cfg) for cfg in cfgs} | {
      _saved_loss_unit(os.path.join(out_dir, s["name"])) for s in kept}
  plot_runs(runs, png, title="mpscale compare",
            loss_unit=units.pop() if len(units) == 1 else None)
  if plot_path:
    os.makedirs(os.path.dirname(plot_path) or ".", exist_ok=True)
    shutil.copyfile(png, plot_path)
  if verbose:
    print("\n".join(md))
  return summaries
