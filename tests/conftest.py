"""Test configuration: every test sees 8 fake CPU devices.

Fixtures that several test modules use live here; plain helper functions they share
(bit-for-bit comparison, tolerances, HLO copy counting) live in tests/helpers.py.

The flag must be set before jax is imported anywhere, which is why it lives at the
top of conftest.py (pytest imports it before any test module).

``MPSCALE_TEST_PLATFORM=gpu`` (or ``tpu``) runs the suite on that backend instead, with
the devices it has: there the tests that build meshes of several devices need that
many, so on one accelerator run the single-device and numerical files, e.g.
``tests/library/scaling/test_loss_scale.py tests/library/optim/test_came.py tests/library/scaling/test_producer_select.py``.

JAX's persistent compilation cache is on for the session, in a fresh temporary folder
(removed at exit), so nothing carries over from one test run to the next. It is set
through the environment, so every pytest-xdist worker (started by the session that
made the folder) and every process the tests start (``mpscale train`` in
test_resume.py, the notebook kernels) share it: a train step compiled once is loaded,
not compiled again, by the next test, worker or process that builds the same one
(the cache key is the whole compiled program, its options, XLA flags and the
jax/jaxlib versions, so a hit is the same executable). ``MPSCALE_TEST_COMPILATION_CACHE``
names a folder to use instead, or ``off`` turns the cache off.

On the CPU the tests' own process compiles with LLVM's optimizations off
(``--xla_backend_optimization_level=0``) and XLA's older, LLVM-IR fusion emitters
instead of its MLIR ones (``--xla_cpu_use_fusion_emitters=false``): most of a test's
time is XLA compiling small programs, about 30% less with the first and half again
with the second. The partitioned HLO, and so every collective a test reads, is the
same; the fusions are the older emitters' (fewer, larger: a CPU program's fusion
count and temporaries differ from XLA's defaults), and programs a test compares are
compiled alike. The GPU-compile tier compiles for the GPU as a user's run does. The processes the tests start (a run of ``mpscale
train``, a notebook's kernel) train for many steps and compile at XLA's own level,
where the code runs faster. ``MPSCALE_TEST_XLA_OPT=default`` keeps XLA's level
everywhere (the GPU-compile tier).
"""
import atexit
import os
import shutil
import tempfile

from tests import quick_compile  # no jax import

PLATFORM = os.environ.get("MPSCALE_TEST_PLATFORM", "cpu")
_DEVICES = "--xla_force_host_platform_device_count=8"
_FAST_COMPILE = quick_compile.FLAGS
_FLAGS_BEFORE = os.environ.get("XLA_FLAGS", "")
if PLATFORM == "cpu":
  if _DEVICES not in _FLAGS_BEFORE:
    _FLAGS_BEFORE = (_FLAGS_BEFORE + " " + _DEVICES).strip()
  os.environ["XLA_FLAGS"] = _FLAGS_BEFORE
  if (os.environ.get("MPSCALE_TEST_XLA_OPT", "") != "default"
      and "xla_backend_optimization_level" not in _FLAGS_BEFORE):
    os.environ["XLA_FLAGS"] = f"{_FLAGS_BEFORE} {_FAST_COMPILE}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
else:
  os.environ["JAX_PLATFORMS"] = PLATFORM

_CACHE = os.environ.get("MPSCALE_TEST_COMPILATION_CACHE", "")
if _CACHE.lower() in ("off", "0", "no", "false"):
  os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
  os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
else:
  if not _CACHE:
    _CACHE = tempfile.mkdtemp(prefix="mpscale-test-jax-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    # Named in the environment, so the xdist workers this session starts use it too
    # (and only this session, which made it, removes it).
    os.environ["MPSCALE_TEST_COMPILATION_CACHE"] = _CACHE
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "true"
  # Every compile is cached, not only those over a second: many steps take less.
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = os.environ.get(
      "MPSCALE_TEST_CACHE_MIN_SECS", "0")

import jax  # noqa: E402  (after the flag on purpose)

if PLATFORM == "cpu":
  assert jax.device_count() == 8, "tests expect 8 fake CPU devices"
  # XLA has read its flags (the CPU client is up): the processes the tests start
  # get the device count without the optimization level.
  os.environ["XLA_FLAGS"] = _FLAGS_BEFORE


_LONGEST_FIRST = (
    "tests/trainer/planning/test_search.py",
    "tests/trainer/runs/test_distributed.py",
    "tests/trainer/runs/test_resume.py",
    "tests/library/parallel/test_pipeline.py",
    "tests/trainer/config/test_builders.py",
    "tests/library/parallel/test_layouts.py",
    "tests/trainer/planning/test_plan.py",
    "tests/trainer/test_cli.py",
    "tests/integration/test_notebooks.py",
    "tests/trainer/models/test_context.py",
    "tests/trainer/hf/test_hf.py",
    "tests/trainer/models/test_experts.py",
    "tests/trainer/hf/test_hf_experts.py",
    "tests/integration/test_fidelity.py",
)
"""The test files that take longest (``--durations``), started first: with one worker
per core a long file started last would keep one core busy after the other ran out
of work."""


def pytest_addoption(parser):
  parser.addoption(
      "--extended", action="store_true", default=False,
      help="also run the tests marked extended (the studies' reproductions and the "
      "long cross-products' other cases; without it they are skipped, saying so)")


_EXTENDED_SKIP = ("the extended tier (a study's reproduction, or a cross-product's "
                  "other case: a quicker test of the default run checks the same "
                  "feature); run it with --extended")


def pytest_collection_modifyitems(config, items):
  """The longest files first (`_LONGEST_FIRST`); the tests marked ``extended``
  skipped unless ``--extended`` is given."""
  rank = {path: i for i, path in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
  if not config.getoption("--extended"):
    import pytest
    skip = pytest.mark.skip(reason=_EXTENDED_SKIP)
    for item in items:
      if "extended" in item.keywords:
        item.add_marker(skip)
