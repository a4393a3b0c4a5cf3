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
  with pytest.raises(ImportError, match=r"jax 0\.6\.2 \(needs >= 0\.7\.0\)"):
    _versions.check({"jax": "0.6.2", "jaxlib": "0.7.0", "optax": "0.2.8"})
  with pytest.raises(ImportError, match=r"optax 0\.2\.4 .*flax 0\.10\.0"):
    _versions.check({"optax": "0.2.4", "flax": "0.10.0"})
  _versions.check({"jax": "0.7.0rc1.dev20250101", "optax": "0.2.10", "flax": "0.12.8"})


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
