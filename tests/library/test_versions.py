"""Tests for mpscale._versions: the import-time floor check, and that the three places
naming the floors (pyproject.toml, .ci/floors.txt, mpscale/_versions.py) agree."""

import os
import re
import tomllib

import pytest

from mpscale import _versions

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _pyproject_floors():
  """The lower bounds of the library's requirements and the trainer's extra."""
  with open(os.path.join(_ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  deps = project["dependencies"] + project["optional-dependencies"]["trainer"]
  return {m.group(1).lower(): m.group(2)
          for m in (re.match(r"([A-Za-z0-9_.\-]+)>=([0-9][^,;\s]*)", d) for d in deps) if m}


def _ci_pins():
  with open(os.path.join(_ROOT, ".ci", "floors.txt")) as f:
    return {m.group(1).lower(): m.group(2) for m in
            (re.match(r"([A-Za-z0-9_.\-]+)==(\S+)", line) for line in f) if m}


def test_installed_releases_pass():
  _versions.check()


def test_too_old_jax_fails_at_import_naming_it():
  floor = _versions.FLOORS["jax"]
  with pytest.raises(ImportError, match=rf"jax 0\.6\.2 \(needs >= {re.escape(floor)}\)"):
    _versions.check({"jax": "0.6.2", "jaxlib": floor, "optax": "0.2.8"})
  with pytest.raises(ImportError, match=r"optax 0\.2\.4 .*flax 0\.10\.0"):
    _versions.check({"optax": "0.2.4", "flax": "0.10.0"})
  _versions.check({"jax": f"{floor}rc1.dev20250101", "optax": "0.2.10", "flax": "0.12.8"})


def test_release_parsing():
  assert _versions._release("0.7.0") == (0, 7, 0)
  assert _versions._release("0.10.2.dev20251101+cuda12") == (0, 10, 2)
  assert _versions._release("1.26.4rc1") == (1, 26, 4)
  assert _versions._release("0.10.2") > _versions._release("0.9.10")


def test_floors_agree_everywhere():
  declared, pinned = _pyproject_floors(), _ci_pins()
  assert declared == pinned, "pyproject.toml's lower bounds and .ci/floors.txt differ"
  for name, floor in _versions.FLOORS.items():
    assert declared[name] == floor, name


def test_the_floors_job_compiles_as_the_readmes_test_command_does():
  """CI's floors job sets nothing of its own for the compiler: jax 0.7.0's CPU compiler
  passed the pipeline's bit-identity tests only at XLA's own optimization level, which
  the job once set, so the declared floor was a release the README's command fails on
  (0.7.1 is the first it passes on)."""
  with open(os.path.join(_ROOT, ".ci", "run")) as f:
    text = f.read()
  job = text[text.index('echo "== floors'):text.index("floors=$!")]
  assert "pytest" in job
  assert "MPSCALE_TEST" not in job and "XLA_FLAGS" not in job
