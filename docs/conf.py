"""Sphinx configuration for mpscale's docs: the Markdown pages and the API reference.

Build (``-W``: every warning is an error; tests/integration/test_docs.py runs the same command)::

  python -m pip install -e ".[docs]"
  sphinx-build -W --keep-going -b html docs /tmp/mpscale-docs
"""

import importlib
import os
import pkgutil
import re
import sys

# The repository root, so ``import mpscale`` works without installing the package.
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

# Importing mpscale imports JAX; keep it on the CPU and quiet wherever the docs build.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import mpscale  # noqa: E402  (after the sys.path change)

project = "mpscale"
author = "mpscale authors"
copyright = "mpscale authors"
release = mpscale.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",  # the Markdown pages (guide.md, trainer.md, ...)
]

# The sources: index.rst, api.rst and the Markdown pages (*.md, read by myst_parser);
# fidelity.png and the scripts are not pages.
root_doc = "index"
exclude_patterns = ["_build"]

# ---- Markdown (myst_parser). Headings get GitHub's anchors, so a link such as
# ``trainer.md#several-hosts`` works both here and on GitHub. Pages name the
# repository's other files (examples/, configs/) in code spans, not links: Sphinx
# could not resolve a link outside docs/ (a warning, so an error under -W).
myst_heading_anchors = 3

# ---- docstrings: Google style (Args/Returns/Raises/Yields/References/Example).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_include_init_with_doc = False
# ``Attributes:`` sections become ``.. attribute::`` entries (not ivar fields), so a
# dataclass's fields are listed under the class like a NamedTuple's documented fields.
napoleon_use_ivar = False
# "Returns:\n  (init, step): ..." names the returned values; keep that text with the
# description ("Returns: (init, step) -- ...") and take the return type from the
# annotation, rather than printing "(init, step)" as a "Return type".
napoleon_use_rtype = False
# The types of ``Attributes:`` entries are left out: Napoleon's own annotation lookup
# would print the type aliases below as raw forward refs (``TypeAliasForwardRef(...)``).
napoleon_attr_annotations = False
# "References:" is not a built-in napoleon section; render it like "Notes" (and see
# _reference_lines below).
napoleon_custom_sections = [("References", "notes_style")]

# ---- autodoc
autodoc_member_order = "bysource"
# Signatures stay readable: the annotations go into the parameter descriptions.
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
# Defaults as written in the source (``jnp.float32``, not ``<class '...float32'>``).
autodoc_preserve_defaults = True
# mpscale's type aliases by name (documented in api.rst), not expanded into long unions.
_ALIASES = {
    "mpscale.scaling.NormGroups": ("NormGroups", "norms_lib.NormGroups", "norms.NormGroups"),
    "mpscale.optim.ScalarOrSchedule": ("ScalarOrSchedule",),
    "mpscale.optim.Compression": ("Compression",),
    "mpscale.precision.KeepFp32": ("KeepFp32",),
    "mpscale.step.LossFn": ("LossFn",),
    "mpscale.step.DataAxis": ("DataAxis",),
    "optax.Schedule": ("optax.Schedule",),
}
autodoc_type_aliases = {name: target for target, names in _ALIASES.items()
                        for name in names}

# The docstrings write cross-references with single backticks (`mpscale.came`,
# `loss_scale_of`): make them Python references. Those Sphinx cannot resolve (an
# optax/JAX name, a private helper) render as code; nitpicky stays off so they are
# not warnings, while every other warning fails the build (-W).
default_role = "py:obj"
nitpicky = False
add_module_names = False
python_display_short_literal_types = True

# ---- HTML: the built-in theme, so the extra needs nothing past Sphinx itself.
html_theme = "alabaster"
html_title = f"mpscale {release}"
html_static_path = []
html_show_sourcelink = False


# Names in the docstrings are written as the user sees them (`mpscale.dynamic_loss_scale`,
# `loss_scale_of(opt_state)` inside mpscale.scaling, `Policy.cast_to_compute`) while
# api.rst documents each public object once, as ``mpscale.<name>``. Resolve a reference
# Sphinx could not find to that documented object when there is exactly one reading.
def _resolve_public_name(app, env, node, contnode):
  if node.get("refdomain") != "py":
    return None
  target = node.get("reftarget", "").split("(", 1)[0].strip()
  rest = target.removeprefix("mpscale.")
  if not rest or (rest == target and rest.split(".")[0] not in mpscale.__all__):
    return None  # neither `mpscale.<...>` nor a bare public name: leave it as code
  objects = env.get_domain("py").objects
  parts = rest.split(".")
  candidates = {f"mpscale.{rest}"}
  if len(parts) > 1:  # `mpscale.<module>.<name>`, documented as `mpscale.<name>`
    candidates.add("mpscale." + ".".join(parts[1:]))
  # A module-level object documented under its module (`default_keep_fp32`).
  candidates.update(k for k in objects if k.count(".") == rest.count(".") + 2
                    and k.startswith("mpscale.") and k.endswith(f".{rest}"))
  found = sorted(c for c in candidates if c in objects)
  if len(found) != 1:
    return None
  return env.get_domain("py").resolve_xref(
      env, node["refdoc"], app.builder, node.get("reftype", "obj"), found[0], node,
      contnode)


# Napoleon reads an attribute's docstring as Google-style ``type: description`` and
# would turn "Names the run (...); default: the config file's stem." into a type
# "Names the run (...); default". mpscale's attribute and property docstrings are plain
# prose (the type comes from the annotation), so they bypass Napoleon: the text is
# saved before Napoleon's handler (priority 500) and put back after it.
_PROSE_KINDS = ("attribute", "data", "property")
_saved_lines: list = []


def _save_prose(app, what, name, obj, options, lines):
  if what in _PROSE_KINDS:
    _saved_lines[:] = [(name, list(lines))]
  else:
    _reference_lines(lines)


# A "References:" section lists one reference per source line (a long one wraps onto
# the next); as a reST line block it keeps those line breaks instead of running every
# reference into one paragraph.
def _reference_lines(lines):
  section_indent = None
  for i, line in enumerate(lines):
    indent = len(line) - len(line.lstrip())
    if line.strip() == "References:":
      section_indent = indent
    elif section_indent is not None and line.strip():
      if indent <= section_indent:
        section_indent = None
      else:
        lines[i] = f"{line[:indent]}| {line[indent:]}"


def _restore_prose(app, what, name, obj, options, lines):
  if what in _PROSE_KINDS and _saved_lines and _saved_lines[0][0] == name:
    lines[:] = _saved_lines.pop()[1]


# A dataclass's generated ``__init__`` has no source, so autodoc_preserve_defaults cannot
# apply: write ``jnp.float32`` (Policy's dtype defaults) as in the source.
def _short_defaults(app, what, name, obj, options, signature, return_annotation):
  if signature:
    signature = re.sub(r"<class 'jax\.numpy\.(\w+)'>", r"jnp.\1", signature)
  return signature, return_annotation


# A room re-exports its data from the private module that defines them
# (``mpscale.parallel.AVERAGED_DIMS`` is ``mpscale.parallel._optimizer_state``'s);
# the attribute docstring is there, so autodoc would show the value's type's own
# docstring (a dict's, a tuple's). Take the defining module's.
def _reexported_data_doc(app, what, name, obj, options, lines):
  if what != "data":
    return
  module_name, _, attr = name.rpartition(".")
  from sphinx.pycode import ModuleAnalyzer  # pylint: disable=import-outside-toplevel
  try:
    if ("", attr) in ModuleAnalyzer.for_module(module_name).find_attr_docs():
      return
    module = importlib.import_module(module_name)
  except Exception:  # noqa: BLE001 - not a module of ours: leave it
    return
  for info in pkgutil.walk_packages(getattr(module, "__path__", []), module_name + "."):
    try:
      docs = ModuleAnalyzer.for_module(info.name).find_attr_docs()
    except Exception:  # noqa: BLE001
      continue
    if ("", attr) in docs and getattr(importlib.import_module(info.name), attr,
                                      None) is obj:
      lines[:] = list(docs[("", attr)])
      return


def setup(app):
  app.connect("autodoc-process-docstring", _reexported_data_doc, priority=50)
  app.connect("autodoc-process-signature", _short_defaults)
  app.connect("missing-reference", _resolve_public_name)
  app.connect("autodoc-process-docstring", _save_prose, priority=100)
  app.connect("autodoc-process-docstring", _restore_prose, priority=900)
