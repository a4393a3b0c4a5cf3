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
               "from mpscale.trainer.runs.loop import train", "from . import trainer",
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


# ------------------------------------------------------------------ the trainer's rooms
TRAINER = PACKAGE / "trainer"
ROOMS = ("config", "models", "data", "runs", "planning")
"""The trainer's subpackages, each one concern; ``cli`` (the command) sits above them."""
ROOM_IMPORTS = {
    "config": {"models", "data"},
    "models": set(),
    "data": {"config.schema", "config.errors", "runs.progress"},
    # planning.hardware reads its profiles with the schema's reader.
    "runs": {"config", "data", "models"},
    "planning": {"config", "data", "models", "runs"},
    "cli": set(ROOMS),
}
"""What each room may import from the others (a room, or one module of it), as its
``__init__`` says: the modules that import nothing of the trainer (``config.schema``,
``config.errors``, ``runs.progress``) may be imported from anywhere."""
BOTTOM = ("config.errors", "runs.progress", "planning.targets", "runs.devices",
          "models.lm", "models.user")
"""Modules that import nothing of the trainer."""
TRAINER_LAYERS = (
    ("config.errors", "runs.devices", "runs.progress", "runs.metrics_log",
     "runs.checkpoints", "data.text", "data.token_files", "data.batch_sizes", "models.lm",
     "models.user", "planning.targets"),
    ("config.schema",),
    ("data.loader", "runs.plots", "data.token_datasets", "data.tokenizing",
     "planning.hardware"),
    ("data.corpora", "planning.step_time"),
    ("config.build",),
    ("config.load", "planning.analytic"),
    ("runs.distributed",),
    ("runs.loop",),
    ("planning.compiled", "runs.compare"),
    ("planning.search",),
    ("cli",),
)
"""The trainer's modules from the bottom up: each imports only from layers below its
own (the ``__init__`` files are left out: the top one re-exports the public names,
the rooms' hold only their docstrings). ``config.errors`` turns any error into one
naming config keys; ``config.schema`` reads a config; ``config.build`` turns it into
the run's pieces; ``config.load`` loads a file and checks it by building it on
shapes; ``runs.loop`` trains; ``cli`` is the command."""


def _modules(package_dir):
  """``{dotted name: path}`` of every module under ``package_dir``, its subpackages
  too (``runs/loop.py`` is ``runs.loop``; a subpackage's ``__init__`` is
  ``runs.__init__``)."""
  return {".".join(p.relative_to(package_dir).with_suffix("").parts): p
          for p in sorted(package_dir.rglob("*.py"))}


def _module_graph(package_dir, package):
  """``{module: {modules of package it imports}}`` over every ``.py`` file under
  ``package_dir`` (dotted names relative to it), counting imports anywhere (inside
  functions too); ``from pkg import name`` counts as importing the module
  ``pkg.name`` when there is one, else ``pkg``."""
  modules = _modules(package_dir)
  graph = {}
  for name, path in modules.items():
    found = set()
    for imported in _imported(path):
      for candidate in (imported, imported.rpartition(".")[0]):
        if candidate.startswith(package + "."):
          rel = candidate[len(package) + 1:]
          if rel in modules:
            found.add(rel)
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


def _room(module):
  return module.split(".")[0]


def _trainer_graph():
  return _module_graph(TRAINER, "mpscale.trainer")


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path):
  pkg = tmp_path / "pkg"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "a.py").write_text("from pkg import b\n")
  (pkg / "b.py").write_text("def f():\n  from pkg.sub.c import g\n")
  (pkg / "sub" / "c.py").write_text("import pkg.a\n")
  (pkg / "d.py").write_text("from pkg.sub import c as a_c\nfrom pkg import a\n")
  graph = _module_graph(pkg, "pkg")
  assert graph == {"a": {"b"}, "b": {"sub.c"}, "sub.c": {"a"}, "d": {"a", "sub.c"}}
  assert _cycles(graph) == [["a", "b", "sub.c", "a"]]
  graph["sub.c"] = set()
  assert _cycles(graph) == []


def test_no_trainer_module_is_in_an_import_cycle():
  graph = _trainer_graph()
  assert {"config.load", "config.build", "models.lm", "runs.loop"} <= set(graph)
  assert not _cycles(graph), f"import cycles in mpscale/trainer: {_cycles(graph)}"


def test_trainer_modules_import_only_from_layers_below():
  graph = _trainer_graph()
  layer = {m: i for i, names in enumerate(TRAINER_LAYERS) for m in names}
  modules = {m for m in graph if not m.endswith("__init__")}
  assert set(layer) == modules, f"modules missing from the layers: {modules - set(layer)}"
  upward = [f"{m} -> {n}" for m in layer for n in graph[m] if layer[n] >= layer[m]]
  assert not upward, f"imports that do not run downward: {upward}"


def test_each_room_imports_only_what_its_init_allows():
  graph = _trainer_graph()
  assert {_room(m) for m in graph} - {"__init__", "cli"} == set(ROOMS)
  bad = []
  for module, imported in graph.items():
    room = _room(module)
    if module == "__init__":
      continue
    for other in imported:
      if _room(other) == room:
        continue
      allowed = ROOM_IMPORTS[room]
      if _room(other) not in allowed and other not in allowed:
        bad.append(f"{module} -> {other}")
  assert not bad, f"imports a room's __init__ does not allow: {bad}"


def test_each_room_init_says_what_it_holds_and_may_import():
  for room in ROOMS:
    init = TRAINER / room / "__init__.py"
    tree = ast.parse(init.read_text())
    doc = ast.get_docstring(tree)
    assert doc and "May import:" in doc, f"{init}: no 'May import:' line"
    assert len(tree.body) == 1, f"{init} holds more than its docstring"
    holds = {p.stem for p in (TRAINER / room).glob("*.py")} - {"__init__"}
    missing = [m for m in holds if f"`{m}`" not in doc]
    assert not missing, f"{init}'s docstring does not name {missing}"


def test_the_bottom_modules_import_nothing_of_the_trainer():
  graph = _trainer_graph()
  assert {m: graph[m] for m in BOTTOM if graph[m]} == {}


# -------------------------------------------------------------- private names stay home
def _is_module(name):
  """Whether the dotted ``name`` is a module of mpscale (a private module such as
  ``mpscale._versions`` is the package's own, not another module's private name)."""
  parts = name.split(".")
  return parts[0] == "mpscale" and (
      PACKAGE.joinpath(*parts[1:]).with_suffix(".py").exists()
      or PACKAGE.joinpath(*parts[1:], "__init__.py").exists())


def _private_uses(path, package):
  """``module._name`` uses in ``path`` of another ``package`` module's private names:
  ``from m import _x``, and ``alias._x`` where ``alias`` is bound to a module by an
  import."""
  tree = ast.parse(path.read_text(), str(path))
  aliases, found = {}, []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith(package) and a.asname:
          aliases[a.asname] = a.name
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package):
      for a in node.names:
        if (a.name.startswith("_") and not a.name.startswith("__")
            and not _is_module(f"{node.module}.{a.name}")):
          found.append(f"{node.module}.{a.name}")
        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases and node.attr.startswith("_")
        and not node.attr.startswith("__")):
      found.append(f"{aliases[node.value.id]}.{node.attr}")
  return found


def test_the_private_name_check_sees_both_spellings(tmp_path):
  path = tmp_path / "m.py"
  path.write_text("from mpscale.trainer.config import build as b\n"
                  "from mpscale.scaling._norms import _leafwise\nx = b._keyed\ny = b.keyed\n")
  assert sorted(_private_uses(path, "mpscale")) == [
      "mpscale.norms._leafwise", "mpscale.trainer.config.build._keyed"]


def test_no_module_uses_another_modules_private_names():
  found = {str(p.relative_to(PACKAGE)): _private_uses(p, "mpscale")
           for p in sorted(PACKAGE.rglob("*.py"))}
  found = {k: v for k, v in found.items() if v}
  assert not found, f"private names used across modules: {found}"
