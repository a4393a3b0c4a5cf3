"""The published runs (configs/published/runs.yaml) against the table of
docs/planning.md: every run is in the table, the runs said to agree are within the
band, and one run planned afresh gives the table's numbers."""

import os

import pytest
import yaml

from mpscale.trainer.config import schema
from mpscale.trainer.planning import targets
from tests.helpers import ROOT, load_script

TABLE = load_script("docs", "published_table.py")


def _table_rows():
  """docs/planning.md's published-run table: (name, GPUs) -> its cells."""
  stems = {run["config"][:-5] for run in TABLE.runs()}
  with open(os.path.join(ROOT, "docs", "planning.md")) as f:
    lines = [line for line in f
             if line.startswith("| ") and line[2:].split(" ")[0] in stems]
  rows = {}
  for line in lines:
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert (cells[0], int(cells[1])) not in rows, cells[:2]
    rows[cells[0], int(cells[1])] = cells
  return rows


def test_every_published_run_is_in_the_table_within_the_band_or_explained():
  rows = _table_rows()
  runs = TABLE.runs()
  assert len(runs) >= 4 and len(rows) == len(runs)
  for run in runs:
    with open(os.path.join(ROOT, "configs", "published", run["config"])) as f:
      cfg, _ = schema.apply_overrides(yaml.safe_load(f), run.get("set", []))
    schedule = ""
    if cfg["mesh"].get("stage", 1) > 1:
      schedule = cfg["mesh"].get("pipeline_schedule", "gpipe")
    name = run["config"][:-5] + (f" {schedule}" if schedule else "")
    assert (name, run["devices"]) in rows, (name, run["devices"])
    cells = rows[name, run["devices"]]
    published = run["tflops_per_gpu" if run["flops"] == "megatron"
                    else "tokens_per_gpu"]
    assert cells[3] == f"{published}" + ("" if run["flops"] == "megatron"
                                          else f" {TABLE.UNITS[run['flops']]}")
    assert cells[10] == TABLE.yaml_file()["sources"][run["source"]]["short"]
    if run.get("cpu", True) and TABLE.compiled(run):
      float(cells[9])  # planned on the CPU's compiler too
    else:
      assert cells[9] == "-"
    ratio = float(cells[5])
    assert ratio == pytest.approx(float(cells[4]) / published, abs=0.006)
    if run.get("in_band", True):
      assert TABLE.BAND[0] <= ratio <= TABLE.BAND[1], (name, ratio)
    else:
      assert run["why"]  # off, and the runs file says which term and why
  assert sum(run.get("in_band", True) for run in runs) >= 4


def test_the_rows_planned_from_shapes_give_the_tables_numbers_afresh():
  """The runs planned from shapes (``planner: analytic``: Megatron-Bridge's
  Qwen3-30B-A3B on 16 H100s, PP 2 x EP 8, a layout the trainer does not run yet)
  planned now: the table's estimate, ratio and step, in well under a second each
  (nothing compiles)."""
  rows = _table_rows()
  analytic_runs = [run for run in TABLE.runs() if not TABLE.compiled(run)]
  assert analytic_runs and any(run.get("in_band", True) for run in analytic_runs)
  for run in analytic_runs:
    row = TABLE.plan_row(run)
    cells = rows[TABLE.row_name(row), run["devices"]]
    assert row["estimate"] == pytest.approx(float(cells[4]), rel=0.005)
    assert row["ratio"] == pytest.approx(float(cells[5]), abs=0.006)
    assert cells[6].startswith(f"{row['step_seconds']:.2f}: ")
    assert cells[2] == " x ".join(f"{k} {v}" for k, v in row["mesh"].items())
    if run.get("in_band", True):
      assert TABLE.BAND[0] <= row["ratio"] <= TABLE.BAND[1]


def test_megatron_eq3_counts_the_papers_flops():
  # Table 1's 1.7B row: 137 TFLOP/s per GPU on 32 GPUs is 4.4 PFLOP/s in aggregate
  with open(os.path.join(ROOT, "configs", "published", "megatron_1.7b.yaml")) as f:
    cfg = yaml.safe_load(f)
  flops = TABLE.megatron_flops(cfg)
  b, s, l, h, v = 512, 2048, 24, 2304, 51200
  assert flops == pytest.approx(96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h)))
  assert 137e12 * 32 == pytest.approx(4.4e15, rel=0.01)


@pytest.mark.slow  # the table's numbers are the newest releases' compile
def test_one_run_planned_afresh_on_the_cpu_gives_the_tables_cpu_ratio():
  """Megatron's 1.7B on 32 simulated A100s (about 10 s), planned now on the CPU's
  compiler, against the table's last column (the CPU compiler's fusion may move a
  term slightly between JAX releases)."""
  run = TABLE.runs()[0]
  assert run["config"] == "megatron_1.7b.yaml"
  row = TABLE.plan_row(run, "cpu")
  cells = _table_rows()["megatron_1.7b", 32]
  assert row["ratio"] == pytest.approx(float(cells[9]), abs=0.02)
  assert row["fits"] and row["mesh"] == {"data": 32}


@pytest.mark.skipif(not targets.cuda_installed(), reason="JAX's CUDA plugin is not "
                    'installed (pip install "mpscale[plan-gpu]")')
def test_one_run_planned_afresh_on_the_gpus_compiler_gives_the_table_numbers():
  """The same run on XLA's CUDA compiler for 32 A100s: the table's estimate within
  2%, its ratio within the band."""
  run = TABLE.runs()[0]
  row = TABLE.plan_row(run, "target")
  cells = _table_rows()["megatron_1.7b", 32]
  assert "A100" in row["compiled_for"]
  assert row["estimate"] == pytest.approx(float(cells[4]), rel=0.02)
  assert row["ratio"] == pytest.approx(float(cells[5]), abs=0.02)
  assert TABLE.BAND[0] <= row["ratio"] <= TABLE.BAND[1]
