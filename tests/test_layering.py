"""The library does not depend on the trainer built on it.

``mpscale/*.py`` (the Optax transforms, policy, norms, CAME, pipeline, train step) never
imports ``mpscale.trainer``; only ``mpscale/__main__.py``, the ``python -m mpscale``
shell, does. Checked twice: statically over every import statement, and by importing
the library in a fresh interpreter.
"""

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "mpscale"
LIBRARY = sorted(p for p in PACKAGE.glob("*.py") if p.name != "__main__.py")
TRAINER_ONLY = ("mpscale.trainer", "yaml", "orbax", "grain", "tensorboardX", "rich",
                "matplotlib")
"""The trainer and the libraries only it uses."""


def _imported(path):
  """Every module an import statement in ``path`` names (``from a import b`` gives
  both ``a`` and ``a.b``: ``b`` may be a module)."""
  names = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: from the package mpscale
        base = "mpscale" + ("." + base if base else "")
      names += [base] + [f"{base}.{alias.name}" for alias in node.names]
  return names


def _is_trainer_only(name):
  return any(name == m or name.startswith(m + ".") for m in TRAINER_ONLY)


def test_the_check_sees_imports_of_the_trainer(tmp_path):
  # The static check must recognize every spelling of the import it forbids.
  for text in ("import mpscale.trainer", "from mpscale import trainer",
               "from mpscale.trainer.loop import train", "from . import trainer",
               "from .trainer import cli", "def f():\n  import yaml"):
    path = tmp_path / "m.py"
    path.write_text(text + "\n")
    assert any(map(_is_trainer_only, _imported(path))), text


def test_no_library_module_imports_the_trainer():
  assert len(LIBRARY) > 10  # the glob found the library
  offending = {p.name: [n for n in _imported(p) if _is_trainer_only(n)]
               for p in LIBRARY}
  offending = {k: v for k, v in offending.items() if v}
  assert not offending, f"library modules import the trainer: {offending}"


def test_importing_the_library_loads_no_trainer_module():
  code = ("import sys, mpscale; from mpscale import *\n"
          f"bad = [m for m in sys.modules if m.split('.')[0] in {TRAINER_ONLY[1:]!r} "
          "or m.startswith('mpscale.trainer')]\n"
          "print(bad); assert not bad, bad")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert result.returncode == 0, result.stdout + result.stderr
