"""The README's Python code blocks run as written, and what they say they print is what
they print."""

import ast
import os
import re

import jax.numpy as jnp

from mpscale import _versions

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _blocks():
  with open(os.path.join(ROOT, "README.md")) as f:
    return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_python_blocks_run_and_their_stated_results_hold(monkeypatch):
  monkeypatch.chdir(ROOT)  # the blocks name examples/... as a reader in a clone would
  blocks = _blocks()
  assert len(blocks) >= 2
  namespace: dict = {}
  import flax
  old_nnx = _versions._release(flax.__version__) < (0, 11)  # Optimizer.update(model, grads)
  for code in blocks:  # one namespace, in order, as a reader would paste them
    if old_nnx and "from flax import nnx" in code:
      continue
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
  stated = re.search(r"# history == (\[.*\])", blocks[0]).group(1)
  assert namespace["history"] == ast.literal_eval(stated)
  metrics = namespace["metrics"]
  for key in ("loss", "overflow", "loss_scale", "global_norm", "group_norms",
              "group_sizes"):
    assert key in metrics, key
  assert bool(jnp.isfinite(metrics["loss"]))
  from jax.sharding import PartitionSpec
  assert namespace["state"].params["w1"].sharding.spec == PartitionSpec("fsdp", "tensor")
  assert not bool(namespace["sharded_metrics"]["overflow"])
  stated = re.search(r'print\(summary\["steps"\], summary\["params"\]\) +# (\d+) (\d+)',
                     "".join(blocks))
  summary = namespace["summary"]
  assert (summary["steps"], summary["params"]) == tuple(map(int, stated.groups()))
  if not old_nnx:  # NNX metrics come back as plain arrays, not nnx Variables
    import jax
    assert all(isinstance(namespace["nnx_metrics"][k], jax.Array)
               for k in ("overflow", "loss_scale", "skipped"))


def test_readme_config_fragments_load():
  """Each YAML block of the README that is not a file of examples/ loads as a config
  (over the defaults) and passes every check."""
  from mpscale.trainer.config import load as config_lib
  with open(os.path.join(ROOT, "README.md")) as f:
    blocks = re.findall(r"```yaml\n(.*?)```", f.read(), flags=re.S)
  fragments = [b for b in blocks if not b.startswith("# examples/")]
  assert fragments
  for block in fragments:
    config_lib.config_from_dict(config_lib.parse_yaml(block, source="README.md"))
