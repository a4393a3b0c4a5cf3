"""The fp16 fidelity study: when loss scaling matters, over three seeds.

::

  python docs/fidelity_study.py     # 10 configs x 3 seeds; ~13 minutes on 2 CPU cores
  python docs/fidelity_study.py --seeds 0 --steps 60 --runs fp16_noscale fp16_dynamic \\
      --out /tmp/study --no-docs

Each seed is one ``mpscale compare`` of the configs in ``configs/fidelity/`` (with
``--set seed=N``), into ``runs/fidelity/seed<N>/``; this script then writes the table
(``docs/fidelity.md``), the loss curves (``docs/fidelity_curves.csv``) and their plot
(``docs/fidelity.png``). The configs' header says why a scale on 2048 tokens stands for
256 times that scale on a 0.5M-token mean.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs", "fidelity")
TOKENS, REFERENCE_TOKENS = 2048, 524288
STUDY = (
    ("fp32", "reference"),
    ("fp16_noscale", "(b) O2 at 0.5M tokens"),
    ("fp16_dynamic", "(b) O2 at 0.5M tokens"),
    ("o3_noscale", "(a) O3"),
    ("o3_dynamic", "(a) O3"),
    ("o3_adamw_dynamic", "(a) O3"),
    ("fp16_fixed_low", "(c) fixed scales"),
    ("fp16_fixed_high", "(c) fixed scales"),
    ("bf16", "(d) bf16"),
    ("fp16_noscale_2k", "small batch"),
)
GROUPS = dict(STUDY)


def run_seed(seed: int, runs, out: str, steps: int | None = None, *,
             configs: str = CONFIGS, extra=()) -> float:
  """``mpscale compare`` of ``runs`` (configs in ``configs``, plus the arguments
  ``extra``) for one seed into ``out/seed<seed>``; seconds."""
  args = [sys.executable, "-m", "mpscale", "compare",
          *[os.path.join(configs, f"{r}.yaml") for r in runs], *extra,
          "--set", f"seed={seed}", "--out", os.path.join(out, f"seed{seed}"),
          "--overwrite", "--no-progress", "--quiet"]
  if steps:
    args += ["--set", f"train.steps={steps}"]
  env = dict(os.environ)
  # Seeds change data, not programs: later seeds reuse the first one's compiles.
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(out, "jax_cache"))
  start = time.perf_counter()
  subprocess.run(args, check=True, cwd=ROOT, env=env)
  seconds = time.perf_counter() - start
  with open(os.path.join(out, f"seed{seed}", "seconds.txt"), "w") as f:
    f.write(f"{seconds:.1f}\n")
  return seconds


def collect(out: str, seeds, runs) -> dict[str, list[dict]]:
  """Run name -> one record per seed: the summary plus its train-loss curve."""
  records = {}
  for run in runs:
    for seed in seeds:
      folder = os.path.join(out, f"seed{seed}", run)
      with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
      with open(os.path.join(folder, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r["loss"]]
      summary["seed"] = seed
      summary["curve"] = [(int(r["step"]), float(r["loss"])) for r in rows]
      summary["scales"] = [(int(r["step"]), float(r["loss_scale"])) for r in rows]
      summary["final_scale"] = float(rows[-1]["loss_scale"])
      records.setdefault(run, []).append(summary)
  return records


def table(records: dict[str, list[dict]]) -> list[dict]:
  """One row per run: mean, spread (max - min) and per-seed final eval losses."""
  ref = records.get("fp32")
  ref_mean = statistics.fmean(s["final_eval_loss"] for s in ref) if ref else None
  rows = []
  for run, seeds in records.items():
    evals = [s["final_eval_loss"] for s in seeds]
    mean = statistics.fmean(evals)
    rows.append({
        "run": run, "group": GROUPS.get(run, ""), "policy": seeds[0]["policy"],
        "optimizer": seeds[0]["optimizer"], "loss_scale": seeds[0]["loss_scale"],
        "mean": mean, "spread": max(evals) - min(evals), "evals": evals,
        "vs_fp32": (mean / ref_mean - 1) if ref_mean else None,
        "skipped": statistics.fmean(s["skipped"] for s in seeds),
        "steps": seeds[0]["steps"],
        "final_scale": statistics.fmean(s["final_scale"] for s in seeds),
    })
  return rows


def write_curves(records: dict[str, list[dict]], path: str, groups=None) -> None:
  """The train-loss curves as CSV rows: run, its group (in ``groups``, this study's
  by default), seed, step, loss."""
  groups = GROUPS if groups is None else groups
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["run", "group", "seed", "step", "loss"])
    for run, seeds in records.items():
      for s in seeds:
        for step, loss in s["curve"]:
          writer.writerow([run, groups.get(run, ""), s["seed"], step, f"{loss:.5f}"])


def plot(records: dict[str, list[dict]], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  groups = sorted({GROUPS[r] for r in records} - {"reference"})
  rows = (len(groups) + 3) // 3  # one more panel: the loss scales
  fig, axes = plt.subplots(rows, 3, figsize=(13, 3.6 * rows), squeeze=False)
  axes = axes.ravel()
  for ax, group in zip(axes, groups):
    for run in [r for r in records if GROUPS[r] in (group, "reference")]:
      steps = [s for s, _ in records[run][0]["curve"]]
      losses = np.array([[l for _, l in s["curve"]] for s in records[run]])
      style = {"color": "k", "ls": "--"} if run == "fp32" else {}
      finite = np.isfinite(losses).all(0)
      label = run if finite.all() else (
          f"{run}: NaN from step {steps[int(np.argmin(finite))]}")
      line, = ax.plot(steps, np.where(finite, losses.mean(0), np.nan), label=label,
                      **style)
      ax.fill_between(steps, losses.min(0), losses.max(0), alpha=0.2,
                      color=line.get_color())
    ax.set_title(group)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats per byte)")
    ax.set_ylim(2.3, 6.0)
    ax.legend(fontsize=7)
  ax = axes[len(groups)]
  for run in records:
    steps = [s for s, _ in records[run][0]["scales"]]
    scales = np.array([[v for _, v in s["scales"]] for s in records[run]])
    if run != "fp32" and np.ptp(scales) > 0 or "fixed" in run:
      ax.plot(steps, np.median(scales, 0) * REFERENCE_TOKENS / TOKENS, label=run)
  ax.set_yscale("log", base=2)
  ax.set_title("loss scale (median over seeds), at 0.5M tokens")
  ax.set_xlabel("step")
  ax.legend(fontsize=7)
  for ax in axes[len(groups) + 1:]:
    ax.axis("off")
  fig.suptitle(f"{len(next(iter(records.values())))} seeds: mean and min-max; "
               "fp16 scales stand for a 0.5M-token mean", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def write_markdown(rows: list[dict], path: str, seeds, seconds: float) -> None:
  lines = [
      "# When loss scaling matters: the fp16 fidelity study",
      "",
      f"Generated by `python docs/fidelity_study.py` (seeds {', '.join(map(str, seeds))}; "
      f"{seconds / 60:.1f} minutes on this machine). Final eval loss in nats per byte "
      "after the configs' steps; spread is max - min over the seeds. Every fp16 config "
      "but the last stands for a 0.5M-token mean (see `configs/fidelity/*.yaml`).",
      "",
      "| run | group | policy | optimizer | loss scale (this run) | eval loss, mean | "
      "spread | per seed | vs fp32 | skipped steps | final scale |",
      "| --- | --- | --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: |",
  ]
  for r in rows:
    vs = "" if r["vs_fp32"] is None or r["run"] == "fp32" else f"{r['vs_fp32']:+.1%}"
    if r["mean"] != r["mean"]:
      vs = "diverged (NaN)"
    lines.append(
        f"| {r['run']} | {r['group']} | {r['policy']} | {r['optimizer']} | "
        f"{r['loss_scale']} | {r['mean']:.4f} | {r['spread']:.4f} | "
        f"{', '.join(f'{e:.4f}' for e in r['evals'])} | {vs} | {r['skipped']:.0f} / "
        f"{r['steps']} | {r['final_scale']:g} |")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def study_parser(description: str, out: str) -> argparse.ArgumentParser:
  """The options every study takes: seeds, a shorter run, its folder (``out`` by
  default), no docs, collect only."""
  parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  parser.add_argument("--steps", type=int, help="override train.steps (a shorter study)")
  parser.add_argument("--out", default=out)
  parser.add_argument("--no-docs", action="store_true",
                      help="print the table only; do not write docs/")
  parser.add_argument("--collect-only", action="store_true",
                      help="do not train; tabulate the runs already in --out")
  return parser


def train_seeds(args: argparse.Namespace, run) -> float:
  """Runs ``run(seed)`` for each of ``args.seeds`` (unless ``--collect-only``);
  returns the seconds all the seeds' runs took, as each recorded."""
  if not args.collect_only:
    for seed in args.seeds:
      seconds = run(seed)
      print(f"seed {seed}: done in {seconds:.0f} s", flush=True)
  seconds = 0.0
  for seed in args.seeds:
    with open(os.path.join(args.out, f"seed{seed}", "seconds.txt")) as f:
      seconds += float(f.read())
  return seconds


def main(argv=None) -> None:
  parser = study_parser(__doc__, os.path.join(ROOT, "runs", "fidelity"))
  parser.add_argument("--runs", nargs="+", default=[r for r, _ in STUDY],
                      choices=[r for r, _ in STUDY])
  args = parser.parse_args(argv)
  seconds = train_seeds(args, lambda seed: run_seed(seed, args.runs, args.out,
                                                    args.steps))
  records = collect(args.out, args.seeds, args.runs)
  rows = table(records)
  for r in rows:
    print(f"{r['run']:18} {r['mean']:.4f} (spread {r['spread']:.4f}) "
          f"skipped {r['skipped']:.0f}", flush=True)
  if not args.no_docs:
    docs = os.path.join(ROOT, "docs")
    write_markdown(rows, os.path.join(docs, "fidelity.md"), args.seeds, seconds)
    write_curves(records, os.path.join(docs, "fidelity_curves.csv"))
    plot(records, os.path.join(docs, "fidelity.png"))
    print("wrote docs/fidelity.md, docs/fidelity_curves.csv, docs/fidelity.png")


if __name__ == "__main__":
  main()
