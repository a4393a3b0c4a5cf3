"""The README's Python code blocks run as written, and what they say they print is what
they print."""

import ast
import os
import re

import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _blocks():
  with open(os.path.join(ROOT, "README.md")) as f:
    return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_python_blocks_run_and_their_stated_results_hold():
  blocks = _blocks()
  assert len(blocks) >= 2
  namespace: dict = {}
  for code in blocks:  # one namespace, in order, as a reader would paste them
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
  stated = re.search(r"# history == (\[.*\])", blocks[0]).group(1)
  assert namespace["history"] == ast.literal_eval(stated)
  metrics = namespace["metrics"]
  for key in ("loss", "overflow", "loss_scale", "global_norm", "group_norms",
              "group_sizes"):
    assert key in metrics, key
  assert bool(jnp.isfinite(metrics["loss"]))
