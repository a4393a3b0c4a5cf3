"""The code blocks of the README and of every docs page (docs/*.md) run as written, and
what they say they print is what they print.

Each page's ```python blocks run in one namespace, in order, as a reader would paste
them; a page's stated results are checked by ``CHECKS`` below. Each ```yaml block that
is not a file of examples/ (those begin ``# examples/...``) loads as a config. Blocks
shown as ```bash or ```text are not run.
"""

import ast
import glob
import os
import re

import jax
import jax.numpy as jnp
import pytest

from mpscale import _versions

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PAGES = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
"""The README and every docs page, as paths relative to the repository."""


def _blocks(page, language):
  """The ```<language> blocks of ``page``, in order."""
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    text = f.read()
  return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def _old_nnx():
  import flax
  return _versions._release(flax.__version__) < (0, 11)  # Optimizer.update(model, grads)


# ------------------------------------------------------------- each page's stated results
def _check_readme(namespace, code):
  stated = re.search(r"# history == (\[.*\])", code).group(1)
  assert namespace["history"] == ast.literal_eval(stated)
  metrics = namespace["metrics"]
  for key in ("loss", "overflow", "loss_scale", "global_norm", "group_norms",
              "group_sizes"):
    assert key in metrics, key
  assert bool(jnp.isfinite(metrics["loss"]))
  if not _old_nnx():  # NNX metrics come back as plain arrays, not nnx Variables
    assert all(isinstance(namespace["nnx_metrics"][k], jax.Array)
               for k in ("overflow", "loss_scale", "skipped"))


def _check_guide(namespace, code):
  stated = re.search(r'print\(float\(metrics\["learning_rate"\]\), '
                     r'bool\(metrics\["overflow"\]\), int\(metrics\["spikes"\]\)\)\n'
                     r"# (\S+) (\S+) (\S+)", code).groups()
  metrics = namespace["metrics"]
  assert float(metrics["learning_rate"]) == pytest.approx(float(stated[0]))
  assert str(bool(metrics["overflow"])) == stated[1]
  assert int(metrics["spikes"]) == int(stated[2])
  assert "no_decay" in metrics["group_learning_rates"]
  stated = re.search(r"print\(landed\)\n# (\{.*\})", code).group(1)
  assert namespace["landed"] == ast.literal_eval(stated)  # 16-bit parameters
  stated = re.search(r"float\(meta\.scale\)\)\n# (\[.*\]) (\S+)", code).groups()
  meta = namespace["meta"]  # FP8 products: the history advances per micro-batch
  assert [round(float(meta.amax_history[i]), 3) for i in (0, -1, 1)] == (
      ast.literal_eval(stated[0]))
  assert float(meta.scale) == float(stated[1])


def _check_trainer(namespace, code):
  stated = re.search(r'print\(summary\["steps"\], summary\["params"\]\) +# (\d+) (\d+)',
                     code)
  summary = namespace["summary"]
  assert (summary["steps"], summary["params"]) == tuple(map(int, stated.groups()))


def _check_pipelines(namespace, code):
  from jax.sharding import PartitionSpec
  stated = re.search(r"print\(state\.params\[\"w1\"\]\.sharding\.spec\) +# (.*)",
                     code).group(1)
  spec = namespace["state"].params["w1"].sharding.spec
  # JAX's newer releases print a PartitionSpec as P(...): compare values, not text.
  assert spec == eval(stated, {"PartitionSpec": PartitionSpec, "P": PartitionSpec})  # noqa: S307
  assert spec == PartitionSpec("fsdp", "tensor")
  assert not bool(namespace["sharded_metrics"]["overflow"])
  # The pipeline's loss is the unpipelined model's.
  assert "# the same loss" in code
  plain = namespace["head_fn"](namespace["params"], namespace["x"], namespace["batch"])
  assert float(namespace["pipe_metrics"]["loss"]) == pytest.approx(float(plain), rel=1e-5)


CHECKS = {
    "README.md": _check_readme,
    "docs/guide.md": _check_guide,
    "docs/trainer.md": _check_trainer,
    "docs/pipelines.md": _check_pipelines,
}
"""The pages whose Python blocks state results, and the check of each."""

PYTHON_PAGES = [page for page in PAGES if _blocks(page, "python")]
YAML_PAGES = [page for page in PAGES if _blocks(page, "yaml")]


def test_the_pages_with_stated_results_have_python_blocks():
  # A page that lost its blocks (a renamed fence, a moved section) fails here, not
  # silently.
  assert set(CHECKS) <= set(PYTHON_PAGES), set(CHECKS) - set(PYTHON_PAGES)
  assert len(_blocks("README.md", "python")) >= 3


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_blocks_run_and_their_stated_results_hold(page, monkeypatch):
  monkeypatch.chdir(ROOT)  # the blocks name examples/... as a reader in a clone would
  blocks = _blocks(page, "python")
  namespace: dict = {}
  old_nnx = _old_nnx()
  for code in blocks:  # one namespace per page, in order, as a reader would paste them
    if old_nnx and "from flax import nnx" in code:
      continue
    exec(compile(code, page, "exec"), namespace)  # noqa: S102
  if page in CHECKS:
    CHECKS[page](namespace, "".join(blocks))


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_a_page_whose_blocks_need_n_devices_says_how_to_simulate_them(page):
  """Issue #64: docs/pipelines.md's examples took 8 devices and never said how to get
  them on a CPU. A page whose Python blocks take ``jax.devices()[:N]`` gives the
  flag that makes N (the tests run with 8, conftest.py)."""
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    text = f.read()
  for code in _blocks(page, "python"):
    for n in re.findall(r"jax\.devices\(\)\[:(\d+)\]", code):
      assert f"XLA_FLAGS=--xla_force_host_platform_device_count={n}" in text, page


@pytest.mark.parametrize("page", YAML_PAGES)
def test_config_fragments_load(page):
  """Each YAML block of the page that is not a file of examples/ loads as a config
  (over the defaults) and passes every check."""
  from mpscale.trainer.config import load as config_lib
  for block in _blocks(page, "yaml"):
    if block.startswith("# examples/"):
      continue
    config_lib.config_from_dict(config_lib.parse_yaml(block, source=page))


def test_some_pages_have_config_fragments():
  fragments = [b for page in YAML_PAGES for b in _blocks(page, "yaml")
               if not b.startswith("# examples/")]
  assert len(fragments) >= 3


def test_the_readme_is_a_front_door():
  """The README stays short, opens with the commands that install, run the main job
  and run the tests, and its map of the docs names every page of docs/."""
  path = os.path.join(ROOT, "README.md")
  assert os.path.getsize(path) <= 15_500
  first = _blocks("README.md", "bash")[0].splitlines()
  commands = [line.split("#")[0].strip() for line in first[:3]]
  assert commands == ['pip install -e ".[trainer,test]"',
                      "mpscale train --config configs/tiny_lm_fp16.yaml",
                      "python -m pytest -n auto"], commands
  assert os.path.exists(os.path.join(ROOT, "configs", "tiny_lm_fp16.yaml"))
  with open(path, encoding="utf-8") as f:
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)\)", f.read()))
  pages = {p for p in PAGES if p.startswith("docs/")}
  assert linked <= pages, f"the README links pages that do not exist: {linked - pages}"
  assert pages <= linked, f"pages missing from the README's map: {pages - linked}"
