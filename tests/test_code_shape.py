"""The code's shape: folders a newcomer can read, functions a reader can hold.

- No folder of ``mpscale/`` holds more than `MAX_MODULES` modules (``__init__.py``
  counted): a folder past that is two concerns.
- No function or method of ``mpscale/`` is longer than `MAX_LINES` lines, its
  docstring aside (blank lines and comments count: they are read too).
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "mpscale"
MAX_MODULES = 14
MAX_LINES = 100


def _folders():
  return sorted({p.parent for p in PACKAGE.rglob("*.py")})


def _function_lengths(path):
  """``{qualified name: lines}`` of every function in ``path``, its docstring left
  out, nested functions counted in their parent too."""
  tree = ast.parse(path.read_text(), str(path))
  found = {}

  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        start = min([child.lineno] + [d.lineno for d in child.decorator_list])
        lines = child.end_lineno - start + 1
        body = child.body
        if (body and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
          lines -= body[0].end_lineno - body[0].lineno + 1
        found[f"{prefix}{child.name}"] = lines
        visit(child, f"{prefix}{child.name}.")
      elif isinstance(child, ast.ClassDef):
        visit(child, f"{prefix}{child.name}.")
      else:
        visit(child, prefix)

  visit(tree, "")
  return found


def test_the_length_count_leaves_the_docstring_out(tmp_path):
  path = tmp_path / "m.py"
  path.write_text('def f():\n  """Doc\n\n  more.\n  """\n  x = 1\n\n  return x\n\n\n'
                  'class C:\n  @staticmethod\n  def g():\n    def h():\n      pass\n'
                  '    return h\n')
  assert _function_lengths(path) == {"f": 4, "C.g": 5, "C.g.h": 2}


def test_no_folder_holds_more_than_fourteen_modules():
  assert len(_folders()) > 10  # the library's rooms and the trainer's
  crowded = {str(folder.relative_to(PACKAGE.parent)): n for folder in _folders()
             if (n := len(list(folder.glob("*.py")))) > MAX_MODULES}
  assert not crowded, f"folders past {MAX_MODULES} modules: {crowded}"


def test_no_function_is_longer_than_a_hundred_lines():
  long = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    for name, lines in _function_lengths(path).items():
      if lines > MAX_LINES:
        long[f"{path.relative_to(PACKAGE.parent)}:{name}"] = lines
  assert not long, f"functions past {MAX_LINES} lines (docstrings aside): {long}"
