"""The trainer: mpscale's library driven by a config, with run folders and resume.

What the ``mpscale`` command does, as a library a program can call with its own model
and data (`run`), or a config can name (``model.provider``, ``data.provider``):

- `config`: the typed YAML config (`load_config`, `RunConfig`);
- `builders`: from a config to the policy, optimizer, mesh and train step;
- `models` and `data`: the model (the built-in `TinyLM`, or a user's Flax NNX, linen or
  plain model) and the data (the embedded corpus, a text file, or a user's source,
  through a `grain` loader whose position is checkpointed);
- `token_files`, `tokens`, `tokenizing`, `corpora`: token corpora (Megatron's indexed
  datasets, flat token files, blends; ``mpscale tokenize``) as a run's data;
- `loop`: prepare, restore, train (log, evaluate, checkpoint), finish;
- `checkpoints`, `metrics_log`, `plots`, `progress`: what a run writes and shows;
- `distributed`: one run across processes (hosts) on JAX's distributed runtime;
- `planning`: a step's per-device memory, FLOPs and collectives, compiled from shapes;
- `compare` and `cli`: the command.

The library (`mpscale`) never imports this package.
"""

from mpscale.trainer.checkpoints import CheckpointError
from mpscale.trainer.config import ConfigError, RunConfig, load_config
from mpscale.trainer.data import TextData, load_data
from mpscale.trainer.lm import TinyLM
from mpscale.trainer.loop import RunDirError, load, run, train
from mpscale.trainer.models import Model
from mpscale.trainer.compare import compare
from mpscale.trainer.planning import Plan, plan

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
