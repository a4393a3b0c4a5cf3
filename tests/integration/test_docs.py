"""The docs build with Sphinx, warnings as errors: every Markdown page of docs/ and the
API reference, which documents every export.

Runs the same command as CI (``sphinx-build -W --keep-going -b html docs <out>``);
skipped when Sphinx or myst-parser is not installed (``pip install -e ".[docs]"``).
The pages' code blocks are run by tests/integration/test_readme.py.
"""

import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

import mpscale
import mpscale.trainer

pytest.importorskip("sphinx")
pytest.importorskip("myst_parser")  # the Markdown pages

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built_docs(tmp_path_factory):
  out = tmp_path_factory.mktemp("docs-html")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html",
       str(ROOT / "docs"), str(out)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, (
      f"sphinx-build failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n"
      f"{proc.stderr[-4000:]}")
  assert "WARNING" not in proc.stderr, proc.stderr
  return out


def test_docs_build_and_api_page_names_key_functions(built_docs):
  api = (built_docs / "api.html").read_text(encoding="utf-8")
  for name in ["dynamic_loss_scale", "skip_nonfinite", "came", "make_train_step",
               "step_metrics", "global_norm_clip", "Pipeline"]:
    assert f'id="mpscale.{name}"' in api, f"no entry for mpscale.{name}"
  # The module docstrings (with their pseudocode) are part of the page.
  assert "Dynamic loss scaling, per step" in api
  assert "hysteresis_left" in api
  # Google-style sections are rendered by napoleon, not left as raw text.
  assert "Args:" not in api
  assert re.search(r">Parameters<", api)
  assert (built_docs / "index.html").exists()


def test_every_public_name_is_documented(built_docs):
  """Each room's names where they import from: ``mpscale.<name>`` for those the top
  level exports, else ``mpscale.<room>.<name>`` (a pipeline name the parallel room
  exports too may be documented there)."""
  api = (built_docs / "api.html").read_text(encoding="utf-8")
  documented = lambda dotted: f'id="{dotted}"' in api  # noqa: E731
  undocumented = [name for name in mpscale.__all__ if not documented(f"mpscale.{name}")]
  assert not undocumented, (
      f"exported by mpscale/__init__.py but missing from docs/api.rst: {undocumented}")
  rooms = {"scaling": mpscale.scaling, "optim": mpscale.optim,
           "precision": mpscale.precision, "parallel": mpscale.parallel,
           "parallel.pipeline": mpscale.parallel.pipeline, "step": mpscale.step,
           "experts": mpscale.experts}
  for room, module in rooms.items():
    homes = [f"mpscale.{room}", "mpscale.parallel"] if "." in room else [f"mpscale.{room}"]
    missing = [name for name in module.__all__
               if not (name in mpscale.__all__ or any(documented(f"{h}.{name}")
                                                      for h in homes))]
    assert not missing, f"exported by mpscale.{room} but missing from docs/api.rst: {missing}"
    # A name the top level exports is documented there only, not twice.
    twice = [name for name in module.__all__
             if name in mpscale.__all__ and documented(f"mpscale.{room}.{name}")]
    assert not twice, f"documented twice: {twice}"
  undocumented = [name for name in mpscale.trainer.__all__
                  if not re.search(rf'id="mpscale\.trainer\.(\w+\.)?{re.escape(name)}"',
                                   api)]
  assert not undocumented, (
      f"exported by mpscale/trainer/__init__.py but missing from docs/api.rst: "
      f"{undocumented}")


def test_the_api_page_says_where_each_name_imports_from(built_docs):
  # What index.rst and api.rst promise: every name documented as mpscale.<name>
  # imports from the top level, every mpscale.<room>.<name> from its room.
  api = (built_docs / "api.html").read_text(encoding="utf-8")
  ids = set(re.findall(r'id="(mpscale\.[\w.]+)"', api))
  rooms = ("scaling", "optim", "precision", "parallel", "step", "experts")

  def home_and_name(dotted):  # members (a class's fields, methods) are left out
    parts = dotted.split(".")
    if parts[1:3] == ["parallel", "pipeline"] and len(parts) == 4:
      return "mpscale.parallel.pipeline", parts[3]
    if parts[1] in rooms and len(parts) == 3:
      return f"mpscale.{parts[1]}", parts[2]
    if len(parts) == 2 and parts[1] not in rooms:
      return "mpscale", parts[1]
    return None

  names = [found for dotted in ids if (found := home_and_name(dotted))]
  assert len(names) > 100, len(names)
  wrong = [f"{home}.{name}" for home, name in names
           if not hasattr(importlib.import_module(home), name)]
  assert not wrong, f"documented names that do not import from where they say: {wrong}"


def test_every_markdown_page_is_built(built_docs):
  # -W already fails on a page left out of the toctree; this checks the build saw them.
  pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
  assert {"guide", "trainer", "data", "pipelines", "planning", "guarantees",
          "architecture"} <= set(pages)
  for page in pages:
    assert (built_docs / f"{page}.html").exists(), page
  index = (built_docs / "index.html").read_text(encoding="utf-8")
  assert all(f'href="{page}.html"' in index for page in pages), index
