"""The notebooks are stored executed, and still run top to bottom on CPU.

`python notebooks/execute.py` re-executes them in place. Each notebook's last code cell
prints ``summary: {...}`` (JSON) with the numbers its markdown states; the slow test
executes a fresh copy and checks those numbers still hold. The fresh copies run side by
side, one kernel per core (the `fresh_runs` fixture), so ``--durations`` shows their
time as the setup of the first of those tests.
"""

import glob
import json
import os

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = {os.path.basename(p): p
             for p in sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))}
assert len(NOTEBOOKS) >= 3, "expected the three notebooks"
ALL = tuple(NOTEBOOKS)
WITH_PLOTS = ("01_loss_scaling.ipynb", "02_came_vs_adamw.ipynb")


def _code_cells(nb):
  return [c for c in nb.cells if c.cell_type == "code"]


def _text(cell):
  return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def _summary(nb):
  lines = [line for c in _code_cells(nb) for line in _text(c).splitlines()
           if line.startswith("summary: ")]
  assert len(lines) == 1, lines
  return json.loads(lines[0][len("summary: "):])


@pytest.mark.parametrize("name", ALL)
def test_notebook_is_committed_executed(name):
  nb = nbformat.read(NOTEBOOKS[name], as_version=4)
  cells = _code_cells(nb)
  assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1)), (
      f"{name}: not executed top to bottom; run `python notebooks/execute.py`")
  outputs = [o for c in cells for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"], name
  assert "jax " in _text(cells[0]), f"{name}: the first code cell prints the jax version"
  if name in WITH_PLOTS:
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{name}: no plot stored"
  _summary(nb)  # the stored run has its summary line
  assert "notebooks/execute.py" in nb.cells[0].source, name


def _check_01(s):
  # Section 2: "about 60%" flush at scale 1, none at 2^15; weight gradients 2-9% off
  # (0.5% for the output projection) against about 0.1% at 2^15.
  assert 0.5 <= s["flushed_trained_scale1"] <= 0.7
  assert s["flushed_trained_scale2^15"] < 0.001
  lo1, hi1 = s["weight_grad_error_scale1"]
  lo15, hi15 = s["weight_grad_error_scale2^15"]
  assert 0.003 <= lo1 <= 0.01 and 0.06 <= hi1 <= 0.12, (lo1, hi1)
  assert 0.0003 <= lo15 and hi15 <= 0.003, (lo15, hi15)
  # Section 4: a sawtooth between 2^13 and 2^15 (one doubling of slack either way),
  # natural overflows at the top of it, recovery in log2(drop) x growth_interval steps.
  lo, hi = s["working_range_log2"]
  assert 12 <= lo <= 13 and hi == 15, (lo, hi)
  assert s["natural_overflow_scales_log2"] and max(s["natural_overflow_scales_log2"]) <= 15
  assert 13 <= s["scale_before_burst_log2"] <= 15
  assert s["lowest_scale"] == 1.0
  assert s["recovered_at_step"] == 1020 + 100 * s["scale_before_burst_log2"]
  assert s["injected"] == 20 and s["skipped"] == s["overflows"]


def _check_02(s):
  # State / params: AdamW 2, CAME about 1 plus vectors, Adafactor only the vectors.
  assert s["adamw"]["state_over_params_medium"] == pytest.approx(2.0, abs=0.01)
  assert s["came"]["state_over_params_medium"] == pytest.approx(1.0, abs=0.01)
  assert s["adafactor"]["state_over_params_medium"] < 0.01
  assert 1.0 < s["came"]["state_over_params_tiny"] < 1.1
  # "a few percent" apart after 150 steps.
  evals = [s[o]["final_eval_loss"] for o in ("came", "adamw", "adafactor")]
  assert max(evals) / min(evals) - 1 < 0.06, evals


def _check_03(s):
  assert s["bubble_S4_M8"] == {"gpipe": 0.273, "1f1b": 0.273}
  assert s["peak_inputs_kept_M32"] == {"gpipe": 32, "1f1b": 4}
  assert s["max_loss_difference"] < 1e-4 and s["max_gradient_difference"] < 1e-4


CHECKS = {"01_loss_scaling.ipynb": _check_01, "02_came_vs_adamw.ipynb": _check_02,
          "03_pipeline_schedules.ipynb": _check_03}


@pytest.mark.parametrize("name", ALL)
def test_stored_summary_matches_the_text(name):
  """The stored outputs say what the markdown says (same checks as the fresh run)."""
  CHECKS.get(name, lambda s: None)(_summary(nbformat.read(NOTEBOOKS[name], as_version=4)))


async def _execute_fresh(names, lanes):
  """``{name: executed notebook, or the exception that stopped it}``: each notebook
  run from scratch in its own kernel, ``lanes`` of them at a time."""
  import asyncio

  import nbclient
  gate = asyncio.Semaphore(lanes)

  async def run(name):
    nb = nbformat.read(NOTEBOOKS[name], as_version=4)
    for cell in _code_cells(nb):  # run from scratch, not on top of the stored outputs
      cell.outputs, cell.execution_count = [], None
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(NOTEBOOKS[name])}})
    async with gate:
      await client.async_execute()  # raises CellExecutionError on the first failing cell
    return nb

  done = await asyncio.gather(*(run(name) for name in names), return_exceptions=True)
  return dict(zip(names, done))


@pytest.fixture(scope="module")
def fresh_runs(request):
  """The notebooks this session's test_notebook_runs cases ask for, executed side by
  side: each kernel computes on about one core (XLA:CPU compiles on one thread, and
  the models are small), so on 2 cores two at a time take about half as long."""
  import asyncio
  names = [item.callspec.params["name"] for item in request.session.items
           if getattr(item, "originalname", None) == "test_notebook_runs"
           and item.module is request.module]
  cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
           else os.cpu_count() or 1)
  lanes = max(1, min(len(names), cores))
  return asyncio.run(_execute_fresh(names, lanes))


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_notebook_runs(name, fresh_runs):
  import asyncio
  nb = fresh_runs.get(name) or asyncio.run(_execute_fresh([name], 1))[name]
  if isinstance(nb, BaseException):
    raise nb
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors
  CHECKS.get(name, lambda s: None)(_summary(nb))
