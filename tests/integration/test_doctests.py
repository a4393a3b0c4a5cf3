"""Every ``>>>`` example in the docstrings of ``mpscale/`` (the trainer included) runs, on its own.

Each module's examples run with ``doctest`` in empty globals: an example imports what it
uses and builds the ``params``, ``loss_fn`` or ``batch`` it needs, so it can be copied
into a session as it stands. Outputs shown must match (``ELLIPSIS`` and
``NORMALIZE_WHITESPACE`` are on). The examples run with the repository root as the
working directory, so one may name ``configs/...``.
"""

import doctest
import importlib
import pathlib
import pkgutil

import pytest

import mpscale

ROOT = pathlib.Path(__file__).resolve().parents[2]

MODULES = sorted(info.name for info in pkgutil.walk_packages(mpscale.__path__, "mpscale."))
"""Every module of the package; none has side effects on import (``mpscale.__main__``
runs the command line only as ``__main__``), so none is skipped."""

WITH_EXAMPLES = ("mpscale.optim._came", "mpscale.trainer.planning.hlo",
                 "mpscale.scaling._loss_scale", "mpscale.scaling._norms",
                 "mpscale.precision._policy", "mpscale.optim._rounding",
                 "mpscale.optim._lr_schedules", "mpscale.scaling._spikes",
                 "mpscale.step._train_step", "mpscale.trainer.config.load",
                 "mpscale.trainer.models.lm")
"""Modules whose docstrings have examples today: deleting them all fails a test."""

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _tests(module_name):
  module = importlib.import_module(module_name)
  finder = doctest.DocTestFinder(exclude_empty=True)
  # Empty globals: an example that uses a name it did not import or define fails.
  return [t for t in finder.find(module, module_name, globs={}) if t.examples]


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_run(module_name, monkeypatch):
  monkeypatch.chdir(ROOT)
  tests = _tests(module_name)
  if not tests:
    pytest.skip(f"{module_name} has no docstring examples")
  report = []
  runner = doctest.DocTestRunner(optionflags=FLAGS)
  for test in tests:
    runner.run(test, out=report.append)
  assert runner.failures == 0, (
      f"{runner.failures} of {runner.tries} examples in {module_name} failed:\n"
      + "".join(report))


def test_examples_exist():
  counts = {name: sum(len(t.examples) for t in _tests(name)) for name in MODULES}
  missing = [name for name in WITH_EXAMPLES if not counts.get(name)]
  assert not missing, f"no docstring examples left in {missing}; counts: {counts}"
