"""What ``pip install mpscale`` gives: the library alone, with the trainer as an extra.

``pip install mpscale`` installs jax, optax, chex and numpy; the trainer's libraries
(flax, PyYAML, orbax, grain, rich, matplotlib, tensorboardX, tokenizers) come with
``mpscale[trainer]``. Checked on pyproject.toml, and by running the library in a fresh
interpreter where importing any of the trainer's libraries fails, as it would where
they are not installed.
"""

import re
import subprocess
import sys
import tomllib

from tests.test_layering import PACKAGE

import mpscale.trainer

_PYPROJECT = PACKAGE.parent / "pyproject.toml"


def _name(requirement):
  """A requirement's distribution name, normalized: ``"PyYAML>=6"`` -> ``pyyaml``."""
  return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _project():
  return tomllib.loads(_PYPROJECT.read_text())["project"]


def test_the_library_requires_none_of_the_trainers_libraries():
  project = _project()
  core = {_name(r) for r in project["dependencies"]}
  assert {"jax", "jaxlib", "optax", "chex", "numpy"} <= core
  trainer = {_name(r) for r in project["optional-dependencies"]["trainer"]}
  assert trainer == {_name(d) for d in mpscale.trainer.LIBRARIES.values()}
  assert not core & trainer, f"the library requires the trainer's {core & trainer}"


_BLOCKED_RUN = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Missing(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in BLOCKED:
      raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Missing())
import jax, jax.numpy as jnp, optax
import mpscale
tx = mpscale.dynamic_loss_scale(optax.adamw(1e-3), init_scale=2.0 ** 4)
params = {{"w": jnp.ones((3, 2))}}
state = tx.init(params)
ok = {{"w": jnp.full((3, 2), 16.0)}}
bad = {{"w": jnp.full((3, 2), jnp.inf)}}
step = jax.jit(tx.update)
updates, state = step(ok, state, params)
assert float(jnp.abs(updates["w"]).max()) > 0
updates, state = step(bad, state, params)
assert float(jnp.abs(updates["w"]).max()) == 0.0  # the overflowed step is skipped
assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED]
for flax_module in ("mpscale.precision.fp8_flax", "mpscale.experts.moe_flax"):
  try:
    __import__(flax_module)
  except ImportError as e:
    assert 'pip install "mpscale[flax]"' in str(e), e
  else:
    raise AssertionError(f"{{flax_module}} imported without Flax")
try:
  import mpscale.trainer
except ImportError as e:
  print("TRAINER:", e)
else:
  raise AssertionError("the trainer imported without its libraries")
from mpscale.__main__ import main  # the `mpscale` command
assert main(["--help"]) == 1
"""


def test_the_library_runs_without_the_trainers_libraries_and_the_trainer_says_why():
  blocked = sorted({m.split(".")[0] for m in mpscale.trainer.LIBRARIES})
  result = subprocess.run(
      [sys.executable, "-c", _BLOCKED_RUN.format(blocked=blocked)],
      capture_output=True, text=True, cwd=PACKAGE.parent)
  assert result.returncode == 0, result.stdout + result.stderr
  message = result.stdout.split("TRAINER:", 1)[1]
  # The command says the same in one line, without a traceback.
  assert result.stderr.strip().splitlines() == [f"mpscale: {message.strip()}"]
  assert 'pip install "mpscale[trainer]"' in message
  for dist in mpscale.trainer.LIBRARIES.values():
    assert dist in message, dist
