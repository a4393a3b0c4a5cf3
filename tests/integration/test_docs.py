"""The docs build with Sphinx, warnings as errors: every Markdown page of docs/ and the
API reference, which documents every export.

Runs the same command as CI (``sphinx-build -W --keep-going -b html docs <out>``);
skipped when Sphinx or myst-parser is not installed (``pip install -e ".[docs]"``).
The pages' code blocks are run by tests/integration/test_readme.py.
"""

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
  api = (built_docs / "api.html").read_text(encoding="utf-8")
  undocumented = [name for name in mpscale.__all__
                  if not re.search(rf'id="mpscale\.(\w+\.)?{re.escape(name)}"', api)]
  assert not undocumented, (
      f"exported by mpscale/__init__.py but missing from docs/api.rst: {undocumented}")
  undocumented = [name for name in mpscale.trainer.__all__
                  if not re.search(rf'id="mpscale\.trainer\.(\w+\.)?{re.escape(name)}"',
                                   api)]
  assert not undocumented, (
      f"exported by mpscale/trainer/__init__.py but missing from docs/api.rst: "
      f"{undocumented}")


def test_every_markdown_page_is_built(built_docs):
  # -W already fails on a page left out of the toctree; this checks the build saw them.
  pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
  assert {"guide", "trainer", "data", "pipelines", "planning", "guarantees",
          "architecture"} <= set(pages)
  for page in pages:
    assert (built_docs / f"{page}.html").exists(), page
  index = (built_docs / "index.html").read_text(encoding="utf-8")
  assert all(f'href="{page}.html"' in index for page in pages), index
