"""Execute the notebooks in place, so they are stored with their outputs.

    python notebooks/execute.py                 # every notebooks/*.ipynb
    python notebooks/execute.py 01_loss_scaling.ipynb   # only the ones named

Each notebook runs top to bottom with nbclient in the ``python3`` kernel, with
``notebooks/`` as its working directory, on CPU (``JAX_PLATFORMS=cpu`` unless already
set, 8 fake host devices for the pipeline notebook), and is written back with nbformat.
No per-cell timing metadata is recorded, so a re-execution's diff is in the outputs
only (notebook 02's table of train times, in seconds, changes every run). A failing cell stops the script with the
error (and leaves that notebook as it was). The first code cell of each notebook prints
the jax version it was executed with. About 5.5 minutes in all on 2 shared, busy CPU
cores (01: 100 s, 02: 155 s, 03: 25 s, 04: 50 s); less on an idle machine. Notebook 04
plots the study's loss curves from ``docs/fidelity_curves.csv`` (written by
``python docs/fidelity_study.py``) when that file exists.
"""
import glob
import os
import sys
import time

import nbclient
import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
DEVICE_FLAG = "--xla_force_host_platform_device_count=8"


def execute(path: str, timeout: int = 600) -> nbformat.NotebookNode:
  """Runs the notebook at `path` and returns it with its outputs (not written)."""
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
      nb, timeout=timeout, kernel_name="python3", record_timing=False,
      resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}})
  client.execute()  # raises CellExecutionError on the first failing cell
  return nb


def main(argv: list[str]) -> None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + DEVICE_FLAG).strip()
  paths = ([p if os.path.exists(p) else os.path.join(HERE, p) for p in argv]
           or sorted(glob.glob(os.path.join(HERE, "*.ipynb"))))
  for path in paths:
    start = time.perf_counter()
    nb = execute(path)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    print(f"{os.path.basename(path)}: executed in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main(sys.argv[1:])
