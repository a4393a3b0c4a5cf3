"""What may import what: the library's rooms, the trainer's rooms, and the two layers.

- The library (``mpscale/`` outside ``trainer/``) never imports ``mpscale.trainer``;
  only ``mpscale/__main__.py``, the ``python -m mpscale`` shell, does. Checked twice:
  statically over every import statement, and by importing the library in a fresh
  interpreter.
- The library's rooms (``precision``, ``scaling``, ``optim``, ``parallel``, ``step``)
  sit on a core of small modules, and each imports only the rooms below it
  (`LIBRARY_ROOM_IMPORTS`); the trainer imports a room only through its public
  package, never its private modules.
- The trainer's rooms (``config``, ``models``, ``data``, ``runs``, ``planning``) import
  as their ``__init__`` says, in layers (`TRAINER_LAYERS`).
- No module is in an import cycle, and none uses another module's private names.
"""

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "mpscale"
LIBRARY = sorted(p for p in PACKAGE.rglob("*.py")
                 if p.name != "__main__.py" and "trainer" not in p.relative_to(PACKAGE).parts)
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
  assert len(LIBRARY) > 30  # the glob found the library, its rooms included
  offending = {str(p.relative_to(PACKAGE)): [n for n in _imported(p) if _is_trainer_only(n)]
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
ROOMS = ("config", "models", "hf", "data", "runs", "planning")
"""The trainer's subpackages, each one concern; ``cli`` (the command) sits above them."""
API_ROOMS = ("hf",)
"""Rooms whose ``__init__`` re-exports their API from their own modules
(``from mpscale.trainer import hf; hf.load(...)``); the others hold a docstring."""
ROOM_IMPORTS = {
    "config": {"models", "data", "hf"},
    "models": set(),
    "hf": {"models"},
    "data": {"config.schema", "config.errors", "runs.progress"},
    # planning.hardware reads its profiles with the schema's reader.
    # runs.throughput counts the compiled step's FLOPs as a plan does (planning.hlo,
    # which imports nothing of the trainer) against a profile's peak (planning.hardware,
    # which imports config.schema and planning.targets only).
    "runs": {"config", "data", "models", "hf", "planning.hlo", "planning.hardware"},
    "planning": {"config", "data", "models", "runs", "hf"},
    "cli": set(ROOMS),
}
"""What each room may import from the others (a room, or one module of it), as its
``__init__`` says: the modules that import nothing of the trainer (``config.schema``,
``config.errors``, ``runs.progress``) may be imported from anywhere."""
BOTTOM = ("config.errors", "runs.progress", "runs.interrupts", "planning.targets",
          "planning.hlo",
          "runs.devices", "models.families", "models.user", "hf.tensors")
"""Modules that import nothing of the trainer."""
TRAINER_LAYERS = (
    ("config.errors", "runs.devices", "runs.progress", "runs.interrupts",
     "runs.metrics_log",
     "runs.checkpoints", "data.text", "data.token_files", "data.batch_sizes",
     "models.families", "models.user", "planning.targets", "planning.hlo",
     "hf.tensors"),
    ("models.lm", "config.schema"),
    ("hf.names",),
    ("hf.checkpoint",),
    ("data.loader", "runs.plots", "data.token_datasets", "data.tokenizing",
     "planning.hardware"),
    ("data.corpora", "planning.step_time", "runs.throughput"),
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
  ``pkg.name`` when there is one, else ``pkg`` (a subpackage: its ``__init__``)."""
  modules = _modules(package_dir)

  def resolve(dotted):
    if not dotted.startswith(package + "."):
      return None
    rel = dotted[len(package) + 1:]
    return rel if rel in modules else (rel + ".__init__" if rel + ".__init__" in modules
                                       else None)

  graph = {}
  for name, path in modules.items():
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        found |= {resolve(a.name) for a in node.names}
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the package
          base = package + ("." + base if base else "")
        for alias in node.names:
          found.add(resolve(f"{base}.{alias.name}") or resolve(base))
    graph[name] = found - {name, None}
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


def _room_violations(graph, room_of, allowed):
  """``"module -> other"`` for each import ``graph`` holds from one room into another
  that ``allowed[room]`` (rooms, or single modules) does not list; ``room_of(module)``
  names a module's room (``None``: the module is under no rule, e.g. an ``__init__``
  that re-exports)."""
  bad = []
  for module, imported in graph.items():
    room = room_of(module)
    if room is None:
      continue
    for other in imported:
      if room_of(other) == room:
        continue
      if room_of(other) not in allowed[room] and other not in allowed[room]:
        bad.append(f"{module} -> {other}")
  return bad


def test_each_room_imports_only_what_its_init_allows():
  graph = _trainer_graph()
  assert {_room(m) for m in graph} - {"__init__", "cli"} == set(ROOMS)
  bad = _room_violations(graph, lambda m: None if m == "__init__" else _room(m),
                         ROOM_IMPORTS)
  assert not bad, f"imports a room's __init__ does not allow: {bad}"


def test_each_room_init_says_what_it_holds_and_may_import():
  for room in ROOMS:
    init = TRAINER / room / "__init__.py"
    tree = ast.parse(init.read_text())
    doc = ast.get_docstring(tree)
    assert doc and "May import:" in doc, f"{init}: no 'May import:' line"
    extra = tree.body[1:]
    if room in API_ROOMS:  # its API, re-exported from its own modules
      extra = [n for n in extra if not (isinstance(n, ast.ImportFrom) and
                                        n.module.startswith(f"mpscale.trainer.{room}."))]
    assert not extra, f"{init} holds more than its docstring"
    holds = {p.stem for p in (TRAINER / room).glob("*.py")} - {"__init__"}
    missing = [m for m in holds if f"`{m}`" not in doc]
    assert not missing, f"{init}'s docstring does not name {missing}"


def test_the_bottom_modules_import_nothing_of_the_trainer():
  graph = _trainer_graph()
  assert {m: graph[m] for m in BOTTOM if graph[m]} == {}


# ------------------------------------------------------------------ the library's rooms
LIBRARY_ROOMS = ("precision", "scaling", "optim", "parallel", "step", "experts")
"""The library's subpackages, each one concern (``parallel.pipeline`` is part of
``parallel``)."""
CORE = ("_deprecated", "_jaxprs", "_tree", "_versions", "gradients", "keys",
        "validation")
"""The modules at the top of ``mpscale/`` under the rooms: argument checks, keys,
what gradient sources return, and the private tree and jaxpr helpers."""
LIBRARY_ROOM_IMPORTS = {
    "core": set(),
    "precision": {"core"},
    "scaling": {"core"},
    "optim": {"core"},
    "parallel": {"core"},
    "step": {"core", "precision", "scaling", "optim", "parallel"},
    "experts": {"core", "parallel"},
}
"""What each room may import besides itself, as its ``__init__``'s ``May import:``
line says: the four concerns stand side by side on the core, and the step, which
puts them together, is on top of all of them."""


def _library_graph():
  graph = _module_graph(PACKAGE, "mpscale")
  return {m: {n for n in imported if _library_room(n) != "trainer"}
          for m, imported in graph.items() if _library_room(m) not in ("trainer", None)}


def _library_room(module):
  """The room of a library module (``core`` for `CORE`), ``trainer``, or ``None``
  for the top package's ``__init__`` and ``__main__`` (they import every room)."""
  first = module.split(".")[0]
  if first in CORE:
    return "core"
  if first in ("__init__", "__main__"):
    return None
  return first


def test_the_room_check_fails_when_a_lower_room_imports_a_higher_one(tmp_path):
  # mpscale's own rules on a package where the scaling room imports the step: the
  # check names the import, and the same package without it passes.
  pkg = tmp_path / "pkg"
  for room in ("scaling", "step"):
    (pkg / room).mkdir(parents=True)
    (pkg / room / "__init__.py").write_text("")
  (pkg / "validation.py").write_text("")
  (pkg / "step" / "_train_step.py").write_text("from pkg.scaling import _loss_scale\n")
  (pkg / "scaling" / "_loss_scale.py").write_text(
      "from pkg import validation\n\ndef f():\n  from pkg.step import _train_step\n")
  room_of = lambda m: _library_room(m) if m.split(".")[-1] != "__init__" else None
  graph = _module_graph(pkg, "pkg")
  assert _room_violations(graph, room_of, LIBRARY_ROOM_IMPORTS) == [
      "scaling._loss_scale -> step._train_step"]
  assert _cycles(graph) == [["scaling._loss_scale", "step._train_step",
                             "scaling._loss_scale"]]
  (pkg / "scaling" / "_loss_scale.py").write_text("from pkg import validation\n")
  graph = _module_graph(pkg, "pkg")
  assert _room_violations(graph, room_of, LIBRARY_ROOM_IMPORTS) == []
  assert _cycles(graph) == []


def test_the_library_is_its_rooms_on_the_core():
  graph = _library_graph()
  rooms = {_library_room(m) for m in graph} - {None}
  assert rooms == set(LIBRARY_ROOMS) | {"core"}, rooms
  on_top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
  assert on_top == set(CORE), on_top


def test_each_library_room_imports_only_the_rooms_below_it():
  graph = _library_graph()
  room_of = lambda m: None if m.split(".")[-1] == "__init__" else _library_room(m)
  bad = _room_violations(graph, room_of, LIBRARY_ROOM_IMPORTS)
  assert not bad, f"imports a library room's rules do not allow: {bad}"
  # An __init__ re-exports its own room only.
  inits = [f"{m} -> {n}" for m, imported in graph.items()
           if m.endswith("__init__") and m != "__init__"
           for n in imported if _library_room(n) not in (_library_room(m), "core")]
  assert not inits, inits


def test_no_library_module_is_in_an_import_cycle():
  graph = _module_graph(PACKAGE, "mpscale")
  graph = {m: set(v) for m, v in graph.items() if not m.startswith("trainer")}
  assert {"scaling._loss_scale", "step._train_step", "parallel.pipeline._ticked"} <= set(
      graph)
  assert not _cycles(graph), f"import cycles in mpscale: {_cycles(graph)}"


def test_each_library_room_init_says_what_it_holds_and_may_import():
  for init in sorted(PACKAGE.glob("*/__init__.py")) + sorted(PACKAGE.glob("*/*/__init__.py")):
    if "trainer" in init.parts:
      continue
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc and "May import:" in doc, f"{init}: no 'May import:' line"
    holds = {p.stem for p in init.parent.glob("*.py")} - {"__init__"}
    holds |= {p.parent.name for p in init.parent.glob("*/__init__.py")}
    missing = [m for m in holds if f"``{m}``" not in doc and f"`{m}`" not in doc
               and f"`mpscale.{init.parent.name}.{m}`" not in doc]
    assert not missing, f"{init}'s docstring does not name {missing}"


def test_the_trainer_imports_the_library_through_its_rooms_public_names():
  """A trainer module imports a library room's package (``from mpscale import
  parallel``), never one of its private modules; the core's private helpers
  (``_tree``, ``_jaxprs``, ``_versions``) are shared plumbing and may be imported."""
  bad = {}
  for path in sorted(TRAINER.rglob("*.py")):
    names = [n for n in _imported(path) if n.startswith("mpscale.")
             and not n.startswith("mpscale.trainer")]
    private = [n for n in names if any(
        part.startswith("_") for part in n.split(".")[2:])
        and n.split(".")[1] in LIBRARY_ROOMS]
    if private:
      bad[str(path.relative_to(PACKAGE))] = private
  assert not bad, f"trainer modules import a library room's private modules: {bad}"


FLAX_MODULES = ("precision.fp8_flax", "experts.moe_flax")
"""The library's modules written against Flax (which ``pip install mpscale`` does
not install: the extra ``flax`` does); no room's ``__init__`` imports them."""


def _module_level_imports(tree):
  """The modules imported when a module is (``try`` blocks included; a function's
  imports run only when it is called)."""
  names = []
  for node in ast.iter_child_nodes(tree):
    if isinstance(node, ast.Import):
      names += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      names.append(node.module or "")
    elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names += _module_level_imports(node)
  return names


def test_only_the_flax_modules_import_flax_at_the_top():
  top_level = {}
  for path in LIBRARY:
    names = _module_level_imports(ast.parse(path.read_text()))
    if any(n == "flax" or n.startswith("flax.") for n in names):
      top_level[".".join(path.relative_to(PACKAGE).with_suffix("").parts)] = names
  assert set(top_level) == set(FLAX_MODULES), top_level


def test_importing_the_library_and_its_rooms_loads_no_flax():
  code = ("import sys, mpscale\n"
          "from mpscale import optim, parallel, precision, scaling, step\n"
          "from mpscale.parallel import pipeline\n"
          "bad = [m for m in sys.modules if m.split('.')[0] == 'flax']\n"
          "print(bad); assert not bad, bad")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert result.returncode == 0, result.stdout + result.stderr


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
      "mpscale.scaling._norms._leafwise", "mpscale.trainer.config.build._keyed"]


def test_no_module_uses_another_modules_private_names():
  found = {str(p.relative_to(PACKAGE)): _private_uses(p, "mpscale")
           for p in sorted(PACKAGE.rglob("*.py"))}
  found = {k: v for k, v in found.items() if v}
  assert not found, f"private names used across modules: {found}"
