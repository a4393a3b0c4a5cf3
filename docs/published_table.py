"""Prints docs/planning.md's table of `mpscale plan --hardware` against the per-GPU
throughputs that others measured (configs/published/runs.yaml): each run planned on
its GPU's own compiler (XLA's CUDA compiler, no GPU needed: ``pip install
"mpscale[plan-gpu]"``) and, for the last column, on the CPU's.

::

  python docs/published_table.py                 # every run, ~40 s each
  python docs/published_table.py --rows 0 1      # the first two
  python docs/published_table.py --cpu-only      # without the CUDA plugin

A run marked ``cpu: false`` is planned on the GPU's compiler alone: JAX's CPU backend
does not compile for that many simulated devices. A run marked ``planner: analytic``
is planned from shapes alone (`mpscale.trainer.planning.analytic`, no compile), as
laid out by its ``set`` overrides: a layout the trainer does not run yet (a
pipelined mixture of experts), with the run's ``attention``.

Each row is planned in its own process (``mpscale plan --devices N --hardware H
--json``: the number of simulated devices is fixed when JAX starts). A publication's
TFLOP/s per GPU are its FLOPs a step over its step time; the estimate divides the same
FLOPs (Megatron-LM's Eq. 3 for ``flops: megatron``) by the estimated step time, so
``ratio = estimate / published``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import yaml

from mpscale.trainer.config import schema
from mpscale.trainer.planning import analytic
from mpscale.trainer.planning.hardware import load_hardware

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(ROOT, "configs", "published", "runs.yaml")
BAND = (0.75, 1.33)
"""The agreement aimed at: estimate / published within it."""


def megatron_flops(cfg: dict) -> float:
  """Narayanan et al. (2021) Eq. 3: ``96 B s l h^2 (1 + s / 6h + V / 16lh)``, the
  matrix products of one step with activation recomputation."""
  m = cfg["model"]
  b, s, l, h, v = (cfg["data"]["batch_size"], m["seq_len"], m["num_layers"],
                   m["d_model"], m["vocab_size"])
  return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


UNITS = {"megatron": "TFLOP/s", "tokens": "tokens/s"}
"""What a run's published figure per GPU counts, by its ``flops``: ``megatron``,
TFLOP/s by Eq. 3 (``tflops_per_gpu``); ``tokens``, tokens a second
(``tokens_per_gpu``: the batch's tokens over the step time, whatever the model)."""


def measure(run: dict, cfg: dict, seconds: float) -> tuple[float, float]:
  """``(published, estimate)`` per GPU in the run's unit (`UNITS`), the estimate
  from a step of ``seconds``."""
  if run["flops"] == "megatron":
    return run["tflops_per_gpu"], megatron_flops(cfg) / seconds / run["devices"] / 1e12
  if run["flops"] == "tokens":
    tokens = cfg["data"]["batch_size"] * cfg["model"]["seq_len"]
    return run["tokens_per_gpu"], tokens / seconds / run["devices"]
  raise ValueError(f"{run['config']}: unknown flops {run['flops']!r}")


def yaml_file() -> dict:
  """configs/published/runs.yaml: its ``sources`` and ``runs``."""
  with open(RUNS) as f:
    return yaml.safe_load(f)


def runs() -> list[dict]:
  return yaml_file()["runs"]


def compiled(run: dict) -> bool:
  """Whether ``run`` is planned by compiling its step (not ``planner: analytic``)."""
  return run.get("planner", "compiled") == "compiled"


def _row(run: dict, cfg: dict, seconds: float) -> dict:
  """The columns every row has: the run, the published figure, the estimate from a
  step of ``seconds`` and their ratio."""
  published, estimate = measure(run, cfg, seconds)
  return {"config": run["config"], "set": run.get("set", []),
          "source": run["source"], "devices": run["devices"],
          "in_band": run.get("in_band", True), "why": run.get("why", ""),
          "published": published, "estimate": round(estimate, 1),
          "unit": UNITS[run["flops"]], "ratio": round(estimate / published, 2),
          "step_seconds": round(seconds, 3)}


def analytic_row(run: dict) -> dict:
  """One row planned from shapes (``planner: analytic``): the config as read with
  the run's ``set`` (unchecked: the trainer refuses a pipelined mixture of experts
  yet), its model's sizes and its layout priced by `analytic.estimate` on the
  run's hardware, the attention the run's (``attention``, default ``xla``)."""
  path = os.path.join(ROOT, "configs", "published", run["config"])
  start = time.perf_counter()
  with open(path) as f:
    raw, _ = schema.apply_overrides(yaml.safe_load(f), run.get("set", []))
  cfg, _ = schema.read_config(raw, path, default_name=run["config"][:-5])
  model = analytic.Model.from_config(cfg)._replace(
      attention=run.get("attention", "xla"))
  layout = analytic.Layout.from_config(cfg)
  hardware = load_hardware(run["hardware"])
  est = analytic.estimate(model, layout, hardware)
  terms = {"compute": est.compute, "memory": est.memory,
           "collectives": est.collectives}
  mesh = {"data": layout.data, **{a: n for a, n in layout.mesh.items()
                                  if n > 1 and a != "data"}}
  return {**_row(run, raw, est.seconds), "mesh": mesh,
          "fits": analytic.fits(model, layout, hardware.hbm_bytes),
          "peak_gib": round(est.peak_bytes / 2**30, 1),
          "schedule": layout.schedule if layout.stage > 1 else "",
          "compute": round(est.compute, 3), "memory": round(est.memory, 3),
          "collectives": round(est.collectives + est.hidden, 3),  # before hiding,
          # as a compiled row's
          "bubble": round(est.bubble, 3),
          "hidden": round(est.hidden, 3), "dominant": max(terms, key=terms.get),
          "compiled_for": "nothing: planned from shapes (analytic)",
          "plan_seconds": round(time.perf_counter() - start, 1)}


def plan_row(run: dict, compiler: str = "auto") -> dict:
  """One row: the run, its plan's estimate and the ratio (a subprocess), compiled
  by ``compiler`` (``mpscale plan --compiler``); from shapes for ``planner:
  analytic`` (`analytic_row`, whatever ``compiler``)."""
  if not compiled(run):
    return analytic_row(run)
  path = os.path.join(ROOT, "configs", "published", run["config"])
  start = time.perf_counter()
  sets = [x for item in run.get("set", []) for x in ("--set", item)]
  out = subprocess.run(
      [sys.executable, "-m", "mpscale", "plan", "--config", path, "--devices",
       str(run["devices"]), "--hardware", run["hardware"], "--compiler", compiler,
       "--json", *sets],
      capture_output=True, text=True, check=True, cwd=ROOT)
  planned = json.loads(out.stdout)
  with open(path) as f:
    cfg = yaml.safe_load(f)
  cfg, _ = schema.apply_overrides(cfg, run.get("set", []))  # as the plan ran it
  est = planned["estimate"]
  return {**_row(run, cfg, est["seconds"]),
          "mesh": planned["mesh"], "fits": planned["fits"],
          "peak_gib": round(planned["bytes"]["peak"] / 2**30, 1),
          "schedule": next((r["schedule"] for r in planned["schedules"]
                            if r["config"]), ""),
          "compute": round(est["compute"], 3), "memory": round(est["memory"], 3),
          "collectives": round(est["collectives"], 3),
          "bubble": round(est["bubble"], 3), "hidden": round(est["hidden"], 3),
          "dominant": est["dominant"], "compiled_for": planned["compiled_for"],
          "plan_seconds": round(time.perf_counter() - start, 1)}


def row_name(r: dict) -> str:
  """``megatron_39.1b 1f1b``: the config's stem and, pipelined, its schedule."""
  return r["config"][:-5] + (f" {r['schedule']}" if r["schedule"] else "")


def table(rows: list[dict]) -> str:
  lines = ["| run | GPUs | mesh | published a GPU (TFLOP/s unless said) | estimate | "
           "ratio | step (s): "
           "compute + memory + collectives - hidden | dominant | peak GiB | ratio on "
           "the CPU's compile | source |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  sources = yaml_file()["sources"]
  for r in rows:
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
    lines.append(
        f"| {row_name(r)} | {r['devices']} | {mesh} | {r['published']}"
        f"{'' if r.get('unit', 'TFLOP/s') == 'TFLOP/s' else ' ' + r['unit']} | "
        f"{r['estimate']:.1f} | {r['ratio']:.2f} | {r['step_seconds']:.2f}: "
        f"{r['compute']:.2f} + {r['memory']:.2f} + {r['collectives']:.2f} - "
        f"{r.get('hidden', 0.0):.2f} | "
        f"{r['dominant']} | {r['peak_gib']:.0f} | {r.get('cpu_ratio', '-')} | "
        f"{sources[r['source']]['short']} |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, nargs="*", help="row indices (default all)")
  parser.add_argument("--json", help="also write the rows as JSON here")
  parser.add_argument("--cpu-only", action="store_true",
                      help="plan on the CPU's compiler alone (the table's last "
                      "column); by default each run is planned on the GPU's compiler "
                      "(pip install \"mpscale[plan-gpu]\") and on the CPU's")
  args = parser.parse_args()
  chosen = runs()
  if args.rows:
    chosen = [chosen[i] for i in args.rows]
  rows = []
  if args.cpu_only:
    chosen = [run for run in chosen if run.get("cpu", True)]
  for run in chosen:
    if args.cpu_only:
      rows.append(plan_row(run, "cpu"))
    else:
      row = plan_row(run, "target")
      if run.get("cpu", True) and compiled(run):
        row["cpu_ratio"] = plan_row(run, "cpu")["ratio"]
      rows.append(row)
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  print(table(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
