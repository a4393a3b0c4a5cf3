"""Loading a run's configuration: read it (`mpscale.trainer.config.schema`), then check it.

One YAML file fully describes a run. `load_config` reads it, applies command-line
overrides (``--set train.steps=50``, values parsed as YAML scalars), converts the result
into a frozen `RunConfig` and checks it. Every mistake is a `ConfigError` naming the
file and the dotted key, and holding the keys (``keys``)::

  configs/x.yaml: model.num_layers: expected an int, got 'four' (str)
  configs/x.yaml: model.nun_layers: unknown key (did you mean 'num_layers'?)
  configs/x.yaml: model.num_layers (3) must be divisible by mesh.stage (2)

A value is checked once: its type where the schema reads it, its value by the
constructor that uses it (`check` asks `mpscale.trainer.config.build.check` to build the
pieces, whose errors name the config keys), and the rules that span sections here.
The schema's names (`RunConfig`, its sections, `ConfigError`, `to_dict`,
`dump_config`, ...) are re-exported here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Sequence, Union

from mpscale import parallel as parallel_lib
from mpscale import validation
from mpscale.trainer.config import build as builders
from mpscale.trainer.config import errors
from mpscale.trainer.config.errors import as_config_error  # noqa: F401 (re-exported)
from mpscale.trainer.data import corpora
from mpscale.trainer.hf import checkpoint as hf
from mpscale.trainer.config.schema import (  # noqa: F401 (re-exported)
    AdafactorConfig, AdamWConfig, BlendConfig, CameConfig, ClipConfig, ConfigError,
    ConfigTypeError, DataConfig, Fp8Config, LossScaleConfig, MeshConfig, ModelConfig,
    OptimizerConfig, ParamGroupConfig, PrecisionConfig, RunConfig, ScheduleConfig,
    TokenizeConfig, TrainConfig,
    apply_overrides, dump_config, flat_keys, parse_override, parse_yaml, read_config,
    to_dict)


def _check_experts(model: Any, mesh: Any) -> None:
  """The mixture of experts' keys against the mesh (the model checks its own)."""
  if mesh.expert > 1 and not model.num_experts:
    raise ConfigError("mesh.expert > 1 splits a mixture's experts, and the model has "
                      "none (model.num_experts is 0; family mixtral or qwen3_moe)",
                      ("mesh.expert", "model.num_experts"))
  if model.num_experts and model.num_experts % mesh.expert:
    raise ConfigError(f"model.num_experts ({model.num_experts}) is not divisible by "
                      f"mesh.expert ({mesh.expert})",
                      ("model.num_experts", "mesh.expert"))
  if model.num_experts and mesh.stage > 1:
    raise ConfigError("model.num_experts: a mixture of experts does not run in "
                      "pipeline stages yet (its router losses and routing state "
                      "would not reach the step); set mesh.stage: 1",
                      ("model.num_experts", "mesh.stage"))


def _check_stacked_state(optimizer: Any, mesh: Any) -> None:
  """CAME's state stacked by role against a pipeline's layer order."""
  if optimizer.came.stack_layers and mesh.stage > 1:
    raise ConfigError(
        "optimizer.came.stack_layers keeps CAME's state stacked by role, and a pipeline "
        "stores its layers in device order, which that state does not follow; a "
        "pipelined model stacks its layers already: set one of them off",
        ("optimizer.came.stack_layers", "mesh.stage"))


def check(cfg: RunConfig) -> None:
  """Checks the values of ``cfg``: the keys no constructor takes, then each section's
  constructors (`mpscale.trainer.config.build.check`), then the rules that span sections.

  Raises:
    ConfigError: naming the keys (``keys``; no file: `load_config` adds it).
  """
  model, data, mesh, train = cfg.model, cfg.data, cfg.mesh, cfg.train
  if model.loss is not None and model.provider is None:
    raise ConfigError("model.loss needs model.provider (the built-in model has its "
                      "own loss)", ("model.loss", "model.provider"))
  if model.metrics is not None and model.provider is None:
    raise ConfigError("model.metrics needs model.provider (the built-in model "
                      "reports its loss)", ("model.metrics", "model.provider"))
  if model.provider is not None:
    check_user_model(cfg)
  if data.provider is not None and data.path is not None:
    raise ConfigError("data.path and data.provider are exclusive (one source of data)",
                      ("data.path", "data.provider"))
  _check_stacked_state(cfg.optimizer, mesh)
  # Keys no constructor takes.
  errors.checked(validation.integer, "seed", cfg.seed, 0)
  errors.checked(lambda: validation.float_in("data.eval_fraction", data.eval_fraction, 0.0,
                                       1.0, low_open=True, high_open=True))
  errors.checked(validation.positive_int, "data.batch_size", data.batch_size)
  errors.checked(validation.integer, "data.eval_batches", data.eval_batches, 0)
  for key in ("data", "fsdp", "stage", "context", "expert", "tensor"):
    errors.checked(validation.positive_int, f"mesh.{key}", getattr(mesh, key))
  for key in ("steps", "num_microbatches", "log_every", "keep_checkpoints"):
    errors.checked(validation.positive_int, f"train.{key}", getattr(train, key))
  for key in ("eval_every", "checkpoint_every"):
    errors.checked(validation.integer, f"train.{key}", getattr(train, key), 0)
  if mesh.virtual_stages > 1 and mesh.stage == 1:
    raise ConfigError("mesh.virtual_stages > 1 needs mesh.stage > 1",
                      ("mesh.virtual_stages", "mesh.stage"))
  if mesh.pipeline_split is not None:
    errors.checked(validation.positive_int, "mesh.pipeline_split", mesh.pipeline_split)
    if mesh.pipeline_split >= mesh.stage:
      raise ConfigError(
          f"mesh.pipeline_split ({mesh.pipeline_split}) must be below mesh.stage "
          f"({mesh.stage}): the encoder takes the first pipeline_split stages and the "
          "decoder the rest, each at least one", ("mesh.pipeline_split", "mesh.stage"))
  if mesh.sequence_parallel and mesh.tensor == 1:
    raise ConfigError("mesh.sequence_parallel needs mesh.tensor > 1 (it splits the "
                      "sequence over the tensor axis)",
                      ("mesh.sequence_parallel", "mesh.tensor"))
  if mesh.context > 1 and mesh.stage > 1 and mesh.tensor > 1:
    raise ConfigError(
        "mesh.context: with both mesh.stage and mesh.tensor > 1, XLA's SPMD "
        "partitioner (jax 0.10) aborts compiling a stage whose sequence is split "
        "over context and heads over tensor; drop one of the three, or take tensor's "
        "devices as mesh.fsdp or mesh.data",
        ("mesh.context", "mesh.stage", "mesh.tensor"))
  if (mesh.context > 1 and mesh.stage > 1 and mesh.pipeline_schedule != "gpipe"
      and model.context_parallel == "ring"):
    raise ConfigError(
        f"model.context_parallel: ring passes K/V blocks between devices inside the "
        f"{mesh.pipeline_schedule} schedule's per-stage branches, where the stages "
        "run different code at a time and the transfers would not pair up; use "
        "all_gather (or pipeline_schedule: gpipe)",
        ("model.context_parallel", "mesh.pipeline_schedule", "mesh.context"))
  _check_experts(model, mesh)
  if mesh.shard_optimizer_state and mesh.data == 1:
    raise ConfigError("mesh.shard_optimizer_state needs mesh.data > 1",
                      ("mesh.shard_optimizer_state", "mesh.data"))
  # The schedule decays over train.steps unless told otherwise: say so, not
  # decay_steps, when the warm-up outlasts the run.
  schedule = cfg.schedule
  if (schedule.decay_steps is None and schedule.warmup_steps
      and schedule.warmup_steps >= train.steps and not builders.counts_samples(cfg)):
    raise ConfigError(f"train.steps ({train.steps}) must be > schedule.warmup_steps "
                      f"({schedule.warmup_steps}): the learning rate decays over "
                      "train.steps after the warm-up; lower schedule.warmup_steps "
                      "too (e.g. --set schedule.warmup_steps="
                      f"{max(0, train.steps // 10)})",
                      ("train.steps", "schedule.warmup_steps"))
  if model.provider is None:  # before the build, whose layout needs them
    _check_model_sizes(cfg)
  # Each section's own rules, checked by the constructors it feeds: the run built on
  # shapes.
  errors.checked(builders.check, cfg)
  errors.checked(corpora.check, cfg)
  if (model.provider is None and mesh.virtual_stages > 1
      and train.num_microbatches % mesh.stage):
    raise ConfigError(f"train.num_microbatches ({train.num_microbatches}) must be "
                      f"divisible by mesh.stage ({mesh.stage}) with "
                      "mesh.virtual_stages > 1",
                      ("train.num_microbatches", "mesh.stage", "mesh.virtual_stages"))
  try:
    parallel_lib.check_batch_size(data.batch_size, mesh.data * mesh.fsdp,
                              train.num_microbatches)
  except validation.ArgumentError as e:
    keys = {"batch_size": "data.batch_size", "data_size": "mesh.data x mesh.fsdp",
            "num_microbatches": "train.num_microbatches"}
    raise ConfigError(str(e.renamed(keys.get)), ("data.batch_size", "mesh.data",
                                                 "mesh.fsdp", "train.num_microbatches")
                      ) from None
  _check_rampup_sizes(cfg)
  if model.provider is None and mesh.stage > 1 and not train.per_token_loss:
    raise ConfigError("train.per_token_loss must be true with mesh.stage > 1 (the "
                      "pipeline's head returns a loss sum and a token count)",
                      ("train.per_token_loss", "mesh.stage"))


def _check_rampup_sizes(cfg: RunConfig) -> None:
  """Every batch size of ``data.rampup_batch_size``'s ramp-up splits over the data
  replicas and micro-batches (`mpscale.parallel.check_batch_size`), as
  ``data.batch_size`` must; each process's rows then scale with it (a process holds
  a whole number of the ``mesh.data x mesh.fsdp`` shards)."""
  mesh, train = cfg.mesh, cfg.train
  sizes = errors.checked(builders.build_batch_sizes, cfg).sizes()
  for size in sizes[:-1]:
    try:
      parallel_lib.check_batch_size(size, mesh.data * mesh.fsdp, train.num_microbatches)
    except validation.ArgumentError as e:
      keys = {"batch_size": "a batch size of data.rampup_batch_size",
              "data_size": "mesh.data x mesh.fsdp",
              "num_microbatches": "train.num_microbatches"}
      raise ConfigError(
          f"{e.renamed(keys.get)}: every size of the ramp-up "
          f"({', '.join(map(str, sizes))}) must split as data.batch_size does; "
          "make its start and increment multiples of that", (
              "data.rampup_batch_size", "mesh.data", "mesh.fsdp",
              "train.num_microbatches")) from None


def steps_from_samples(cfg: RunConfig, explicit_steps: bool = False) -> RunConfig:
  """``cfg`` with ``train.steps`` derived from ``train.samples`` when that is set
  (`mpscale.trainer.config.build.train_steps`), so every reader of ``train.steps``
  sees the run's step count; ``cfg`` itself without it.

  Args:
    cfg: the config as read.
    explicit_steps: whether ``train.steps`` was given (in the file or by ``--set``);
      it must then be the derived count (a dumped config gives it, equal).

  Raises:
    ConfigError: naming ``train.steps`` and ``train.samples`` when an explicit
      ``train.steps`` differs, or the keys of a bad ``train.samples`` or ramp-up.
  """
  if cfg.train.samples is None:
    if cfg.train.steps is None:
      raise ConfigError("train.steps is null: give train.steps or train.samples",
                        ("train.steps", "train.samples"))
    return cfg
  steps = errors.checked(builders.train_steps, cfg)
  if explicit_steps and cfg.train.steps is not None and cfg.train.steps != steps:
    raise ConfigError(
        f"train.steps ({cfg.train.steps}) disagrees with train.samples "
        f"({cfg.train.samples}), which takes {steps} steps: leave train.steps out "
        "(it is derived from train.samples)", ("train.steps", "train.samples"))
  return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))


def _check_model_sizes(cfg: RunConfig) -> None:
  """The built-in model's sizes against the data and the mesh."""
  model, mesh = cfg.model, cfg.mesh
  if model.vocab_size < 256 and not corpora.uses_tokens(cfg.data):
    raise ConfigError(f"model.vocab_size: byte-level data needs >= 256, got "
                      f"{model.vocab_size}", ("model.vocab_size",))
  chunks = mesh.stage * mesh.virtual_stages
  if model.num_layers % chunks:
    raise ConfigError(f"model.num_layers ({model.num_layers}) must be divisible by "
                      f"mesh.stage ({mesh.stage}) x mesh.virtual_stages "
                      f"({mesh.virtual_stages})",
                      ("model.num_layers", "mesh.stage", "mesh.virtual_stages"))
  recompute_layers = cfg.train.recompute_layers
  if chunks > 1 and recompute_layers is not None and (
      recompute_layers > model.num_layers // chunks):
    raise ConfigError(
        f"train.recompute_layers ({recompute_layers}) counts the layers of each "
        f"pipeline stage's chunk, which holds {model.num_layers // chunks} "
        f"(model.num_layers / (mesh.stage x mesh.virtual_stages)): recompute at most "
        f"{model.num_layers // chunks}",
        ("train.recompute_layers", "model.num_layers", "mesh.stage"))
  for key, size in (("num_heads", model.num_heads), ("d_ff", model.d_ff),
                    ("vocab_size", model.vocab_size)):
    if size % mesh.tensor:
      raise ConfigError(f"model.{key} ({size}) must be divisible by mesh.tensor "
                        f"({mesh.tensor})", (f"model.{key}", "mesh.tensor"))
  if mesh.sequence_parallel and model.seq_len % (mesh.tensor * mesh.context):
    raise ConfigError(f"model.seq_len ({model.seq_len}) must be divisible by "
                      f"mesh.tensor ({mesh.tensor}) x mesh.context ({mesh.context}) "
                      "with mesh.sequence_parallel",
                      ("model.seq_len", "mesh.tensor", "mesh.sequence_parallel"))
  errors.checked(parallel_lib.check_context_length, model.seq_len, mesh.context, True,
                 "model.seq_len")


_CHECKPOINT_SIZES = ("family", "vocab_size", "d_model", "num_heads", "num_layers",
                     "d_ff", "num_kv_heads", "head_dim", "rope_theta", "rope_scaling",
                     "norm_eps", "tie_embeddings", "sliding_window", "init_std",
                     "num_experts", "experts_per_token", "expert_d_ff", "router",
                     "router_normalize", "shared_d_ff")


def with_checkpoint_sizes(cfg: RunConfig) -> RunConfig:
  """``cfg`` with ``model.family`` and the model's sizes read from the
  ``config.json`` of ``model.init_from`` (when set); ``model.seq_len`` stays.

  Raises:
    ConfigError: naming ``model.init_from`` for a checkpoint mpscale cannot load
      (`mpscale.trainer.hf.HFCheckpointError`), or a size key the config sets to
      another value than the checkpoint's.
  """
  path = cfg.model.init_from
  if path is None:
    return cfg
  if cfg.model.provider is not None:
    raise ConfigError("model.init_from: starts the built-in model from a checkpoint; "
                      "a user's model (model.provider) loads its own",
                      ("model.init_from", "model.provider"))
  try:
    found = hf.model_fields(path, cfg.model.seq_len)
  except hf.HFCheckpointError as e:
    raise ConfigError(f"model.init_from: {e}", ("model.init_from",)) from None
  found = {k: v for k, v in found.items() if k != "seq_len"}
  if found.get("rope_scaling") is not None:
    found["rope_scaling"] = found["rope_scaling"].to_dict()
  default = type(cfg.model)()
  for key in _CHECKPOINT_SIZES:
    ours, theirs = getattr(cfg.model, key), found.get(key, getattr(default, key))
    if ours != getattr(default, key) and ours != theirs:
      raise ConfigError(f"model.{key}: {ours!r} is set, and model.init_from's "
                        f"config.json makes it {theirs!r}; remove it",
                        (f"model.{key}", "model.init_from"))
  return dataclasses.replace(cfg, model=dataclasses.replace(
      cfg.model, **{k: found.get(k, getattr(default, k)) for k in _CHECKPOINT_SIZES}))


def check_user_model(cfg: RunConfig) -> None:
  """Refuses the keys that act on the built-in model only, for a run of a user's
  model: what mpscale does to the built-in model's blocks it cannot do to a user's.

  Raises:
    ConfigError: naming the key.
  """
  if cfg.train.remat:
    raise ConfigError("train.remat: recomputes the built-in model's blocks; a user's "
                      "model rematerializes its own (nnx.remat / nn.remat / "
                      "jax.checkpoint of its blocks): set train.remat: false",
                      ("train.remat",))
  if cfg.train.recompute != "none":
    raise ConfigError("train.recompute: recomputes the built-in model's blocks; a "
                      "user's model rematerializes its own (jax.checkpoint of its "
                      "blocks, or its mpscale.Pipeline's recompute=): set "
                      "train.recompute: none", ("train.recompute",))
  if cfg.mesh.sequence_parallel:
    raise ConfigError("mesh.sequence_parallel: lays out the built-in model's "
                      "activations; a user's model lays out its own: set "
                      "mesh.sequence_parallel: false", ("mesh.sequence_parallel",))


RESUME_MAY_CHANGE = ("train.steps", "train.samples",
                     "train.log_every", "train.eval_every", "train.checkpoint_every",
                     "train.keep_checkpoints", "train.hardware",
                     "mesh", "train.num_microbatches", "train.remat", "train.recompute",
                     "train.recompute_layers", "train.offload", "model.attention")
"""The keys (or sections) a resumed run may set otherwise than the run it continues:
its length (``train.steps``, or ``train.samples``, to extend it), the cadence of its
logs, evaluations and checkpoints, the hardware its MFU is logged against, and how a
step is laid out and computed (the mesh, the micro-batches, recomputation, host
offload, the attention kernel), which change its losses at most by float rounding. Every other
key changes what the run trains."""


def resume_changes(saved: RunConfig, cfg: RunConfig) -> dict[str, tuple[Any, Any]]:
  """The keys whose value ``cfg`` changes from ``saved`` (a run's ``config.yaml``)
  beyond `RESUME_MAY_CHANGE`: ``{key: (saved value, cfg's value)}``, in the
  config's order.

  ``data.path`` is compared as an absolute path (``--data`` is relative to the
  working directory), and a ``loss_scale.init_scale`` left ``null`` in ``cfg`` is
  the one the run derived (its scale is in the checkpoint).
  """
  old, new = flat_keys(saved), flat_keys(cfg)
  changed = {}
  for key in dict.fromkeys([*new, *old]):
    before, after = old.get(key), new.get(key)
    if key == "data.path" and before is not None and after is not None:
      before, after = os.path.abspath(before), os.path.abspath(after)
    if key == "loss_scale.init_scale" and after is None:
      continue
    if before != after and not any(key == k or key.startswith(k + ".")
                                   for k in RESUME_MAY_CHANGE):
      changed[key] = (old.get(key), new.get(key))
  return changed


def config_from_dict(raw: Optional[Mapping[str, Any]], source: str = "<dict>",
                     overrides: Sequence[str] = (), default_name: str = "run",
                     base_dir: Optional[str] = None,
                     data_path: Optional[str] = None,
                     checkpoint_sizes: bool = True) -> RunConfig:
  """A checked `RunConfig` from a parsed mapping plus ``--set`` overrides: read by
  `mpscale.trainer.config.schema.read_config` (same arguments), the model's sizes
  read from ``model.init_from`` (`with_checkpoint_sizes`; not with
  ``checkpoint_sizes=False``: a run folder's ``config.yaml``, which holds them since
  its run started, and whose checkpoint folder may be gone), ``data.path``
  replaced by ``data_path`` when given (the command's ``--data``), ``train.steps``
  derived from ``train.samples`` (`steps_from_samples`), then `check`, once.

  Returns:
    The frozen `RunConfig`.

  Raises:
    ConfigError: (a ``ValueError``; `ConfigTypeError` is also a ``TypeError``) naming
      ``source`` and the key, with ``(set by --set)`` for an overridden key.
  """
  cfg, touched = read_config(raw, source, overrides, default_name, base_dir)
  try:
    cfg = with_checkpoint_sizes(cfg) if checkpoint_sizes else cfg
  except ConfigError as e:
    raise e.located(source, touched) from None
  train = (raw or {}).get("train") if isinstance(raw, Mapping) else None
  explicit_steps = "train.steps" in touched or (isinstance(train, Mapping)
                                               and "steps" in train)
  if data_path is not None:
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=data_path))
  try:
    cfg = steps_from_samples(cfg, explicit_steps)
    check(cfg)
  except ConfigError as e:
    raise e.located(source, touched) from None
  return cfg


def load_config(path: Union[str, os.PathLike], overrides: Sequence[str] = (),
                data_path: Optional[str] = None,
                checkpoint_sizes: bool = True) -> RunConfig:
  """The `RunConfig` in the YAML file ``path``, with ``--set`` overrides applied.

  Args:
    path: a YAML file.
    overrides: ``key.sub=value`` strings, values parsed as YAML scalars.
    data_path: replaces ``data.path`` (the command's ``--data``).
    checkpoint_sizes: read the model's sizes from ``model.init_from``'s
      ``config.json`` (`config_from_dict`); ``False`` for a run folder's own.

  Returns:
    The frozen, checked `RunConfig`; its ``name`` defaults to the file's stem.

  Raises:
    ConfigError: for a missing file, invalid YAML, an unknown key, a wrong type or an
      impossible value, naming the file and the key.

  Example:
    >>> from mpscale.trainer.config.load import load_config
    >>> cfg = load_config("configs/tiny_lm_fp16.yaml", ["train.steps=50"])
    >>> cfg.train.steps
    50
  """
  path = os.fspath(path)
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except OSError as e:
    raise ConfigError(f"{path}: cannot read config: {e.strerror}") from None
  stem = os.path.splitext(os.path.basename(path))[0]
  cfg = config_from_dict(parse_yaml(text, source=path), source=path,
                         overrides=overrides, default_name=stem,
                         base_dir=os.path.dirname(os.path.abspath(path)),
                         data_path=data_path, checkpoint_sizes=checkpoint_sizes)
  return cfg
