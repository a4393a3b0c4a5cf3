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
                "matplotlib", "tokenizers")
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


# ------------------------------------------------------------------ the trainer's layers
TRAINER = PACKAGE / "trainer"
TRAINER_LAYERS = (
    ("schema", "data", "devices", "progress", "metrics_log", "checkpoints",
     "token_files", "samples"),
    ("lm", "models", "loader", "plots", "tokens", "tokenizing", "hardware"),
    ("builders", "step_time"),
    ("corpora",),
    ("config",),
    ("distributed",),
    ("loop",),
    ("planning", "compare"),
    ("search",),
    ("cli",),
)
"""The trainer's modules from the bottom up: each imports only from layers below its
own (``__init__`` re-exports them all and is left out). ``schema`` reads a config and
imports nothing of the trainer; ``builders`` turns it into the run's pieces;
``config`` loads and checks a config by building them; ``loop`` trains; ``cli`` is
the command."""


def _module_graph(package_dir, package):
  """``{module: {modules of package it imports}}`` over every ``.py`` file in
  ``package_dir``, counting imports anywhere (inside functions too); ``from pkg
  import name`` counts as importing the module ``pkg.name`` when there is one, else
  ``pkg``."""
  modules = {p.stem: p for p in package_dir.glob("*.py")}
  graph = {}
  for name, path in modules.items():
    found = set()
    for imported in _imported(path):
      for candidate in (imported, imported.rpartition(".")[0]):
        head, _, last = candidate.rpartition(".")
        if head == package and last in modules:
          found.add(last)
          break
    graph[name] = found - {name}
  return graph


def _cycles(graph):
  """Every import cycle in ``graph`` (each as a list of modules, first repeated last),
  found by a depth-first search."""
  cycles, state = [], {}

  def visit(node, path):
    state[node] = "open"
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        cycles.append(path[path.index(nxt):] + [nxt])
      elif nxt not in state:
        visit(nxt, path + [nxt])
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node, [node])
  return cycles


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path):
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "a.py").write_text("from pkg import b\n")
  (pkg / "b.py").write_text("def f():\n  from pkg.c import g\n")
  (pkg / "c.py").write_text("import pkg.a\n")
  (pkg / "d.py").write_text("from pkg import a\n")
  graph = _module_graph(pkg, "pkg")
  assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert _cycles(graph) == [["a", "b", "c", "a"]]
  graph["c"] = set()
  assert _cycles(graph) == []


def test_no_trainer_module_is_in_an_import_cycle():
  graph = _module_graph(TRAINER, "mpscale.trainer")
  assert {"config", "builders", "lm", "loop"} <= set(graph)
  assert not _cycles(graph), f"import cycles in mpscale/trainer: {_cycles(graph)}"


def test_trainer_modules_import_only_from_layers_below():
  graph = _module_graph(TRAINER, "mpscale.trainer")
  layer = {m: i for i, names in enumerate(TRAINER_LAYERS) for m in names}
  assert set(layer) == set(graph) - {"__init__"}, "a module missing from the layers"
  upward = [f"{m} -> {n}" for m in layer for n in graph[m] if layer[n] >= layer[m]]
  assert not upward, f"imports that do not run downward: {upward}"


def test_the_schema_imports_nothing_of_the_trainer_and_lm_no_config():
  graph = _module_graph(TRAINER, "mpscale.trainer")
  assert graph["schema"] == set()
  assert graph["lm"] == set()
