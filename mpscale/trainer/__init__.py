"""The trainer: mpscale's library driven by a config, with run folders and resume.

What the ``mpscale`` command does, as a library a program can call with its own model
and data (`run`), or a config can name (``model.provider``, ``data.provider``). Its
rooms, from the bottom up:

- `config`: the typed YAML config (`load_config`, `RunConfig`) and, from it, the
  policy, optimizer, mesh and train step (`config.build`);
- `models`: the built-in `TinyLM`, or a user's Flax NNX, linen or plain `Model`;
- `data`: the embedded corpus, a text file, token corpora (Megatron's indexed
  datasets, flat token files, blends; ``mpscale tokenize``) or a user's source,
  through a `grain` loader whose position is checkpointed;
- `runs`: the loop (prepare, restore, train, finish), what a run writes
  (checkpoints, metrics, plots), its progress bar, its processes, and `compare`;
- `planning`: a step's memory, FLOPs and collectives compiled from shapes, its time
  on a hardware profile, and the search over layouts;
- `cli`: the command.

Each room's ``__init__`` says what it may import (``tests/test_layering.py``
checks it). The library (`mpscale`) never imports this package.
"""

import importlib.util

LIBRARIES = {"flax": "flax", "yaml": "PyYAML", "orbax.checkpoint": "orbax-checkpoint", "grain": "grain",
             "rich": "rich", "matplotlib": "matplotlib", "tensorboardX": "tensorboardX",
             "tokenizers": "tokenizers"}
"""The trainer's own libraries (module: distribution), which ``pip install
"mpscale[trainer]"`` installs and the library (`mpscale`) never imports."""


def _found(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package is missing
    return False


_missing = [dist for module, dist in LIBRARIES.items() if not _found(module)]
if _missing:
  raise ImportError(
      f"mpscale.trainer needs {', '.join(_missing)}, which the library alone does not "
      "install: pip install \"mpscale[trainer]\" (in a clone: pip install -e "
      "\".[trainer]\")")

from mpscale.trainer.runs.checkpoints import CheckpointError  # noqa: E402
from mpscale.trainer.config.load import ConfigError, RunConfig, load_config  # noqa: E402
from mpscale.trainer.data.text import TextData, load_data  # noqa: E402
from mpscale.trainer.models.lm import TinyLM  # noqa: E402
from mpscale.trainer.runs.loop import RunDirError, load, run, train  # noqa: E402
from mpscale.trainer.models.user import Model  # noqa: E402
from mpscale.trainer.runs.compare import compare  # noqa: E402
from mpscale.trainer.planning.compiled import Plan, plan  # noqa: E402

__all__ = [
    "CheckpointError",
    "Model",
    "ConfigError",
    "Plan",
    "RunConfig",
    "RunDirError",
    "TextData",
    "TinyLM",
    "compare",
    "load_config",
    "load",
    "load_data",
    "plan",
    "run",
    "train",
]
