"""Two processes on localhost (jax.distributed, CPU collectives, 4 fake devices each)
train exactly like one process with 8 devices."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests import _multiprocess_worker as worker
from tests import helpers

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["data", "pipeline"])
def test_two_processes_match_one_process(kind, tmp_path):
  port, out = helpers.free_port(), tmp_path / "result.npz"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  # No persistent compilation cache (conftest.py) for the two workers: they compile
  # the same program at the same moment, so one could read the entry the other is
  # still writing; and nothing else compiles it (other XLA flags), so it saves nothing.
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  procs = [subprocess.Popen(
      [sys.executable, "-m", "tests._multiprocess_worker", str(i), str(port), kind,
       str(out)], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for i in range(2)]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=240)[0].decode()[-3000:])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("multi-process run timed out")
  assert all(p.returncode == 0 for p in procs), "\n".join(logs)
  got = dict(np.load(out))
  want = worker.flatten(worker.train(kind))  # the same run on this process's 8 devices
  assert set(got) == set(want)
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6, err_msg=key)
  assert float(got["scale"]) == 2.0**8
