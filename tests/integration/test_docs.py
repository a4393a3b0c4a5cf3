"""The API reference builds with Sphinx, warnings as errors, and documents every export.

Runs the same command as CI (``sphinx-build -W --keep-going -b html docs <out>``);
skipped when Sphinx is not installed (``pip install -e ".[docs]"``).
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
               "step_metrics", "clip_by_global_norm", "Pipeline"]:
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
