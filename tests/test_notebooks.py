"""The notebooks are committed without outputs and run top to bottom on CPU."""

import glob
import os

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = {os.path.basename(p): p
             for p in sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))}
assert len(NOTEBOOKS) >= 3, "expected the three notebooks"
ALL = tuple(NOTEBOOKS)


@pytest.mark.parametrize("name", ALL)
def test_notebook_is_committed_without_outputs(name):
  nb = nbformat.read(NOTEBOOKS[name], as_version=4)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, name


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_notebook_runs(name):
  import nbclient
  nb = nbformat.read(NOTEBOOKS[name], as_version=4)
  client = nbclient.NotebookClient(
      nb, timeout=600, kernel_name="python3",
      resources={"metadata": {"path": os.path.dirname(NOTEBOOKS[name])}})
  client.execute()  # raises CellExecutionError on the first failing cell
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors
