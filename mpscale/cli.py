"""The ``mpscale`` command: train the tiny LM from a config, or compare several configs.

::

  mpscale train --config configs/tiny_lm_fp16.yaml [--set train.steps=50 ...]
                [--out runs/NAME] [--resume | --overwrite] [--devices N] [--data PATH]
  mpscale compare configs/a.yaml configs/b.yaml ... [--out runs/compare]
                  [--plot docs/fidelity.png] [--set ...] [--resume | --overwrite]

A run writes into its own folder (default ``runs/<config name>``)::

  config.yaml     the resolved config (every default filled in)
  metrics.csv     one row per logged step: loss, eval_loss, loss_scale, overflows, ...
  tb/             TensorBoard event files (tensorboardX)
  checkpoints/    orbax checkpoints of the whole TrainState
  metrics.png     loss, loss scale and gradient norm
  summary.json    final train/eval loss, skipped steps, optimizer-state bytes, time

The data order is a pure function of ``(seed, step)``, so ``--resume`` continues from
the latest checkpoint with the same batches, and the same losses, as an uninterrupted
run. An existing run is never overwritten without ``--resume`` or ``--overwrite``, and
a run whose config or setup fails writes nothing.

Arguments are parsed before JAX touches a device, so ``--devices N`` can still make the
CPU backend simulate ``N`` devices (``--xla_force_host_platform_device_count``). With
``JAX_COORDINATOR_ADDRESS`` and ``JAX_NUM_PROCESSES`` (and ``JAX_PROCESS_ID``) set, the
command calls ``jax.distributed.initialize`` first (multi-host).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from typing import Any, Optional, Sequence

from mpscale import config as config_lib

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
RUN_FILES = ("config.yaml", "metrics.csv", "summary.json", "metrics.png", "tb",
             "checkpoints")
"""What a run writes into its folder (and what ``--overwrite`` removes)."""
CSV_FIELDS = ("step", "loss", "eval_loss", "loss_scale", "overflows", "overflow_total",
              "skipped", "global_norm", "learning_rate", "tokens_per_s", "wall_s")
"""The fixed columns of ``metrics.csv``; group norms follow as ``norm/<group>``."""


class RunDirError(ValueError):
  """The output folder holds a run that this command would overwrite."""


class CheckpointError(ValueError):
  """A checkpoint to resume from is corrupt or belongs to another run."""


# ------------------------------------------------------------------ devices


def _backends_are_initialized() -> bool:
  """Whether JAX has started its backends (then XLA_FLAGS no longer apply). JAX has
  no public API for this; where its private one moved, assume they have not: the
  flag is then set, and a mesh that needs more devices than exist fails by name."""
  try:
    from jax._src import xla_bridge  # noqa: PLC0415
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):  # pragma: no cover - a JAX that moved it
    return False


def set_host_device_count(n: Optional[int]) -> None:
  """Make the CPU backend simulate ``n`` devices (before JAX initializes a backend).

  Raises:
    ValueError: if ``n`` < 1, or JAX is already running with fewer than ``n`` devices.
  """
  if n is None:
    return
  if n < 1:
    raise ValueError(f"--devices must be >= 1; got {n}")
  if "jax" in sys.modules and _backends_are_initialized():
    import jax
    if jax.device_count() < n:
      raise ValueError(f"--devices {n}: JAX is already running with "
                       f"{jax.device_count()} devices; set XLA_FLAGS={_DEVICE_FLAG}="
                       f"{n} before starting Python")
    return
  flags = re.sub(rf"{_DEVICE_FLAG}=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()
  os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={n}".strip()


def init_distributed() -> bool:
  """``jax.distributed.initialize`` from ``JAX_COORDINATOR_ADDRESS``,
  ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, when the first two are set.

  Returns:
    Whether it initialized.
  """
  address = os.environ.get("JAX_COORDINATOR_ADDRESS")
  num_processes = os.environ.get("JAX_NUM_PROCESSES")
  if not address or not num_processes:
    return False
  import jax
  jax.distributed.initialize(
      coordinator_address=address, num_processes=int(num_processes),
      process_id=int(os.environ.get("JAX_PROCESS_ID", "0")))
  return True


# ------------------------------------------------------------------ run folder


def existing_run_files(out_dir: str) -> list[str]:
  """The `RUN_FILES` already present in ``out_dir``."""
  return [f for f in RUN_FILES if os.path.exists(os.path.join(out_dir, f))]


def _check_out_dir(out_dir: str, resume: bool, overwrite: bool) -> None:
  if resume and overwrite:
    raise RunDirError("--resume and --overwrite are exclusive")
  found = existing_run_files(out_dir)
  if found and not (resume or overwrite):
    raise RunDirError(f"{out_dir} already holds a run ({', '.join(found)}); pass "
                      "--resume to continue it or --overwrite to replace it")


def _read_rows(path: str) -> list[dict[str, str]]:
  if not os.path.exists(path):
    return []
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def _float(text: Any) -> float:
  try:
    return float(text)
  except (TypeError, ValueError):
    return math.nan


class _MetricsLog:
  """``metrics.csv`` and TensorBoard events of one run (on the main process only)."""

  def __init__(self, out_dir: str, group_names: Sequence[str], start_step: int,
               enabled: bool = True):
    self.enabled = enabled
    self.path = os.path.join(out_dir, "metrics.csv")
    self.fields = list(CSV_FIELDS) + [f"norm/{g}" for g in group_names]
    if not enabled:
      return
    kept = [r for r in _read_rows(self.path) if int(r["step"]) <= start_step]
    self.file = open(self.path, "w", newline="")
    self.writer = csv.DictWriter(self.file, self.fields, extrasaction="ignore")
    self.writer.writeheader()
    self.writer.writerows(kept)
    self.file.flush()
    from tensorboardX import SummaryWriter
    # purge_step drops the events of steps a resumed run will log again.
    self.tb = SummaryWriter(os.path.join(out_dir, "tb"),
                            purge_step=start_step + 1 if start_step else None)
    self.last = kept[-1] if kept else {}

  def write(self, row: dict[str, Any]) -> None:
    if not self.enabled:
      return
    self.writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    self.file.flush()
    step = int(row["step"])
    for key, value in row.items():
      # Non-finite values (the norm of an overflowed step) stay in the CSV only.
      if (key in ("step", "wall_s") or value is None or value == ""
          or not math.isfinite(float(value))):
        continue
      tag = (f"norms/{key[5:]}" if key.startswith("norm/")
             else "eval/loss" if key == "eval_loss" else f"train/{key}")
      self.tb.add_scalar(tag, float(value), step)
    self.tb.flush()

  def close(self) -> None:
    if self.enabled:
      self.file.close()
      self.tb.close()


# ------------------------------------------------------------------ checkpoints


def _checkpoint_key(path: Any) -> str:
  import jax
  return jax.tree_util.keystr(tuple(path), simple=True, separator=".")


def _checkpoint_tree(state: Any) -> dict[str, Any]:
  """``state`` as a flat dict ``"opt_state.skip_state...kernel" -> array`` without its
  zero-size leaves (CAME keeps empty placeholders, which orbax refuses to save)."""
  import jax
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  return {_checkpoint_key(path): leaf for path, leaf in flat
          if getattr(leaf, "size", 1) > 0}


def _from_checkpoint_tree(like: Any, saved: dict[str, Any]) -> Any:
  """The state shaped like ``like`` with the leaves of ``saved`` (zero-size leaves
  taken from ``like``), every leaf committed to its ``like`` leaf's sharding. Orbax
  gives committed arrays back; a state mixing them with uncommitted ones (the
  zero-size leaves) would make the step compile once for it and again for its own
  (committed) outputs."""
  import jax

  def restored(path, leaf):
    value = saved.get(_checkpoint_key(path), leaf)
    sharding = getattr(leaf, "sharding", None)
    return value if sharding is None else jax.device_put(value, sharding)

  flat, treedef = jax.tree_util.tree_flatten_with_path(like)
  return jax.tree_util.tree_unflatten(treedef, [restored(p, x) for p, x in flat])


def restore_latest(ckpt_dir: str, state: Any) -> tuple[Any, int]:
  """``state`` restored from the latest checkpoint in ``ckpt_dir`` and its step, or
  ``(state, 0)`` when there is none.

  Raises:
    CheckpointError: naming the checkpoint, when it cannot be restored into a state
      shaped like ``state`` (corrupt, or written by another config).
  """
  import jax
  import orbax.checkpoint as ocp
  if not os.path.isdir(ckpt_dir):
    return state, 0
  with ocp.CheckpointManager(ckpt_dir) as reader:
    latest = reader.latest_step()
    if latest is None:
      return state, 0
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct,
                                      _checkpoint_tree(state))
    try:
      saved = reader.restore(latest, args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # orbax raises many kinds; all mean "not this run's"
      raise CheckpointError(
          f"{os.path.join(ckpt_dir, str(latest))}: cannot restore this run's state "
          f"from it (corrupt, or written by another config): "
          f"{type(e).__name__}: {str(e)[:300]}") from None
  state = _from_checkpoint_tree(state, saved)
  return state, int(jax.device_get(state.step))


def load_run(out_dir: str) -> tuple[config_lib.RunConfig, Any, Any, int]:
  """A finished or interrupted run: ``(cfg, setup, state, step)`` from its
  ``config.yaml`` and latest checkpoint.

  Raises:
    RunDirError: if ``out_dir`` holds no run or no checkpoint.
  """
  from mpscale import builders
  path = os.path.join(out_dir, "config.yaml")
  if not os.path.exists(path):
    raise RunDirError(f"{out_dir} holds no run (no config.yaml)")
  cfg = config_lib.load_config(path)
  setup = builders.build(cfg)
  state = setup.init(builders.init_params(cfg, setup.model))
  state, step = restore_latest(os.path.abspath(os.path.join(out_dir, "checkpoints")),
                               state)
  if step == 0:
    raise RunDirError(f"{out_dir} holds no checkpoint yet")
  return cfg, setup, state, step


def evaluate_run(out_dir: str) -> tuple[float, int]:
  """``(eval loss, step)`` of a run's latest checkpoint on its held-out split."""
  from mpscale import data as data_lib
  cfg, setup, state, step = load_run(out_dir)
  data = data_lib.load_data(cfg.data.path, cfg.data.eval_fraction)
  return evaluate(setup, state.params, data, cfg), step


def sample_run(out_dir: str, prompt: str, num_tokens: int, *, temperature: float = 1.0,
               seed: int = 0) -> str:
  """Text the run's latest checkpoint writes after ``prompt`` (byte level)."""
  import jax
  from mpscale import data as data_lib
  _, setup, state, _ = load_run(out_dir)
  tokens = setup.model.generate(setup.policy.cast_to_compute(state.params),
                                data_lib.tokenize(prompt), num_tokens,
                                rng=jax.random.key(seed), temperature=temperature)
  return data_lib.detokenize(tokens)


# ------------------------------------------------------------------ plots


def _series(rows: list[dict[str, str]], key: str) -> tuple[list[int], list[float]]:
  steps, values = [], []
  for r in rows:
    v = _float(r.get(key))
    if not math.isnan(v):
      steps.append(int(r["step"]))
      values.append(v)
  return steps, values


def plot_runs(runs: dict[str, str], path: str, title: str = "") -> Any:
  """One PNG of every logged series: loss (train solid, eval dashed), loss scale,
  global norm, learning rate, group ("local") norms and overflows.

  The train loss is the mean over each logging interval and is drawn on a log axis
  whole, the first steps included; norms are the logged step's own values.

  Args:
    runs: run label -> its ``metrics.csv``.
    path: the PNG to write.
    title: the figure's title.

  Returns:
    The matplotlib ``Figure``.
  """
  from matplotlib.figure import Figure  # no pyplot: leaves the global backend alone

  fig = Figure(figsize=(13, 7), layout="constrained")
  axes = fig.subplots(2, 3).ravel()
  styles = ("-", "--", ":", "-.")
  for i, (label, csv_path) in enumerate(runs.items()):
    rows = _read_rows(csv_path)
    color = f"C{i % 10}"
    axes[0].plot(*_series(rows, "loss"), color=color, label=label)
    steps, values = _series(rows, "eval_loss")
    if values:
      axes[0].plot(steps, values, "o--", color=color, ms=3)
    axes[1].plot(*_series(rows, "loss_scale"), color=color, label=label)
    axes[2].plot(*_series(rows, "global_norm"), color=color, label=label)
    axes[3].plot(*_series(rows, "learning_rate"), color=color, label=label)
    groups = [k for k in (rows[0] if rows else {}) if k.startswith("norm/")]
    for j, key in enumerate(groups):
      axes[4].plot(*_series(rows, key), color=color, ls=styles[j % len(styles)],
                   label=f"{label}: {key[5:]}" if len(runs) > 1 else key[5:])
    axes[5].plot(*_series(rows, "overflow_total"), color=color, label=label)
  titles = ("loss, nats/byte (train: interval mean; dashed: eval)", "loss scale",
            "gradient global norm (logged step)", "learning rate",
            "group norms (logged step)", "overflows (skipped steps), total")
  for ax, name in zip(axes, titles):
    ax.set_xlabel("step")
    ax.set_title(name, fontsize=10)
    ax.grid(alpha=0.3)
  axes[0].set_yscale("log")
  axes[1].set_yscale("log", base=2)
  for ax in (axes[2], axes[4]):
    if any(line.get_ydata().size for line in ax.get_lines()):
      ax.set_yscale("log")
  axes[0].legend(fontsize=7)
  if axes[4].get_lines():
    axes[4].legend(fontsize=6)
  if title:
    fig.suptitle(title)
  fig.savefig(path, dpi=100)
  return fig


# ------------------------------------------------------------------ training


def _fmt(x: float, digits: int = 4) -> str:
  return "nan" if x is None or math.isnan(x) else f"{x:.{digits}g}"


def _scale_text(scale: float) -> str:
  """A loss scale as ``2^k`` when it is a power of two (as it is, with the defaults)."""
  if scale > 0 and math.isfinite(scale) and math.frexp(scale)[0] == 0.5:
    return f"2^{math.frexp(scale)[1] - 1}"
  return _fmt(scale)


def progress_info(row: dict[str, Any], overflow_total: int, eval_loss: float) -> str:
  """The metrics line under the progress bar, most important first (it is cut at the
  terminal's width): the interval's mean loss, the last evaluation, the scale, ..."""
  interval = row.get("interval", 1)
  parts = [f"loss {_fmt(row['loss'])}" + (f" ({interval}-step mean)" if interval > 1
                                          else "")]
  if eval_loss is not None and not math.isnan(eval_loss):
    parts.append(f"eval {_fmt(eval_loss)}")
  parts += [f"scale {_scale_text(row['loss_scale'])}", f"overflows {overflow_total}",
            f"norm {_fmt(row['global_norm'], 3)}",
            f"{row['tokens_per_s'] / 1e3:.1f}k tok/s"]
  return " | ".join(parts)


def make_progress(console: Any, *, disable: bool = False) -> Any:
  """A two-line rich progress display: name, bar, step counter, elapsed and remaining
  time on the first line (always whole), the metrics line (`progress_info`, cut
  with an ellipsis to the width) on the second."""
  from rich import progress as rich_progress  # noqa: PLC0415
  from rich.text import Text  # noqa: PLC0415

  class Progress(rich_progress.Progress):
    def get_renderables(self):
      yield self.make_tasks_table(self.tasks)
      for task in self.tasks:
        info = task.fields.get("info", "")
        if info:
          yield Text(info, no_wrap=True, overflow="ellipsis")

  return Progress(
      rich_progress.TextColumn("[bold]{task.description}"),
      rich_progress.BarColumn(bar_width=None),
      rich_progress.MofNCompleteColumn(), rich_progress.TimeElapsedColumn(),
      rich_progress.TextColumn("eta"), rich_progress.TimeRemainingColumn(),
      console=console, disable=disable, transient=False, expand=False)


def _global_batch(batch: dict[str, Any], mesh: Any) -> Any:
  """The host batch, or across processes a global array built from every process's
  identical copy (the batch is a pure function of seed and step)."""
  import jax
  if mesh is None or jax.process_count() == 1:
    return batch
  from jax.sharding import NamedSharding, PartitionSpec
  from mpscale import builders
  sharding = NamedSharding(mesh, PartitionSpec(builders.data_axes(mesh)))
  return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
          for k, v in batch.items()}


def evaluate(setup: Any, params: Any, data: Any, cfg: config_lib.RunConfig) -> float:
  """Mean per-token loss on the held-out split (``data.eval_batches`` batches)."""
  import jax
  total, tokens = 0.0, 0.0
  for batch in data.eval_batches(cfg.data.batch_size, cfg.model.seq_len,
                                 cfg.data.eval_batches):
    loss_sum, count = jax.device_get(setup.evaluate(params, batch))
    total, tokens = total + float(loss_sum), tokens + float(count)
  return total / max(tokens, 1.0)


@dataclasses.dataclass
class _Run:
  """One run being trained: what `_prepare` built, and where its files go."""
  cfg: config_lib.RunConfig
  out_dir: str
  setup: Any
  """`mpscale.builders.Setup`: model, policy, optimizer, mesh, step, evaluate."""
  data: Any
  """`mpscale.data.TextData`."""
  state: Any
  """The `mpscale.TrainState`, initial or restored."""
  metric_shapes: Any
  """What the step returns as metrics (shapes only)."""
  num_params: int
  opt_bytes: int
  main_process: bool

  @property
  def ckpt_dir(self) -> str:
    return os.path.abspath(os.path.join(self.out_dir, "checkpoints"))

  @property
  def summary_path(self) -> str:
    return os.path.join(self.out_dir, "summary.json")


def _prepare(cfg: config_lib.RunConfig, out_dir: str, source: str) -> _Run:
  """Loads the data and builds the model, step and initial state. Everything that can
  fail on the config happens here, before the first write.

  Raises:
    config_lib.ConfigError: naming ``source`` and the key.
  """
  import jax
  from mpscale import builders
  from mpscale import data as data_lib
  from mpscale import lm as lm_lib

  try:
    data = data_lib.load_data(cfg.data.path, cfg.data.eval_fraction)
  except (OSError, ValueError) as e:
    raise config_lib.ConfigError(f"{source}: data.path: {e}") from None
  try:
    setup = builders.build(cfg)
    params = builders.init_params(cfg, setup.model)
    state = setup.init(params)
    first_batch = data.train_batch(cfg.seed, 0, cfg.data.batch_size, cfg.model.seq_len)
    metric_shapes = jax.eval_shape(setup.step, state, first_batch)[1]
  except (ValueError, TypeError) as e:
    if isinstance(e, config_lib.ConfigError):
      raise
    raise config_lib.ConfigError(f"{source}: {e}") from None
  return _Run(cfg, out_dir, setup, data, state, metric_shapes,
              num_params=lm_lib.num_params(params),
              opt_bytes=builders.tree_bytes(state.opt_state),
              main_process=jax.process_index() == 0)


def _start_files(run: _Run, overwrite: bool) -> None:
  """Clears an overwritten run's files and writes ``config.yaml`` (main process)."""
  if not run.main_process:
    return
  if overwrite:
    for name in existing_run_files(run.out_dir):
      path = os.path.join(run.out_dir, name)
      shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
  os.makedirs(run.out_dir, exist_ok=True)
  with open(os.path.join(run.out_dir, "config.yaml"), "w") as f:
    f.write(config_lib.dump_config(run.cfg))


class _Logger:
  """Collects the step metrics between log points and writes them: one
  ``metrics.csv``/TensorBoard row per log point, the evaluation, the progress bar."""

  def __init__(self, run: _Run, start: int, progress: Optional[bool], verbose: bool):
    from rich.console import Console
    cfg = run.cfg
    self.run, self.verbose = run, verbose
    self.log = _MetricsLog(run.out_dir, sorted(run.metric_shapes["group_norms"]),
                           start, run.main_process)
    previous = _float(self.log.last.get("overflow_total")) if start else math.nan
    self.overflow_total = 0 if math.isnan(previous) else int(previous)
    self.console = Console(stderr=True)
    self.show = self.console.is_terminal if progress is None else progress
    self.tokens_per_step = cfg.data.batch_size * cfg.model.seq_len
    self.t_run = self.t_mark = time.perf_counter()
    self.pending: list = []
    self.eval_loss = math.nan
    self.bar = make_progress(self.console, disable=not (self.show and run.main_process))
    self.task = None

  def started(self, done: int) -> None:
    """The first step ran (compiled): restart the clock, say when metrics come."""
    every, steps = self.run.cfg.train.log_every, self.run.cfg.train.steps
    first_log = min(steps, (done // every + 1) * every) if every > 0 else steps
    self.bar.reset(self.task, total=steps, completed=done,
                   info=f"training; the first metrics come at step {first_log}")
    self.t_mark = time.perf_counter()

  def flush(self, state: Any, done: int, evaluating: bool) -> dict:
    """Logs one row for the steps in ``pending`` (ending at ``done``)."""
    import jax
    host = jax.device_get(self.pending)
    now = time.perf_counter()
    overflows = sum(int(m["overflow"]) for m in host)
    self.overflow_total += overflows
    last = host[-1]
    if evaluating:
      self.eval_loss = evaluate(self.run.setup, state.params, self.run.data, self.run.cfg)
    row = {
        "step": done,
        "loss": sum(float(m["loss"]) for m in host) / len(host),
        "eval_loss": self.eval_loss if evaluating else None,
        "loss_scale": float(last["loss_scale"]),
        "overflows": overflows, "overflow_total": self.overflow_total,
        "skipped": int(last["skipped"]),
        "global_norm": float(last["global_norm"]),
        "learning_rate": float(last.get("learning_rate", math.nan)),
        "tokens_per_s": len(host) * self.tokens_per_step / max(now - self.t_mark, 1e-9),
        "wall_s": now - self.t_run,
    }
    row.update({f"norm/{k}": float(v) for k, v in last["group_norms"].items()})
    self.log.write(row)
    row["interval"] = len(host)
    self.pending, self.t_mark = [], time.perf_counter()
    self.bar.update(self.task, completed=done,
                    info=progress_info(row, self.overflow_total, self.eval_loss))
    if evaluating and self.verbose and not self.show and self.run.main_process:
      cfg = self.run.cfg
      self.console.print(
          f"{cfg.name} step {done}/{cfg.train.steps}: loss {_fmt(row['loss'])}, "
          f"eval {_fmt(self.eval_loss)}, scale {_scale_text(row['loss_scale'])}, "
          f"overflows {self.overflow_total}", soft_wrap=True)
    return row


def _loop(run: _Run, start: int, logger: _Logger) -> Any:
  """Trains from step ``start`` to ``train.steps``, logging, evaluating and saving
  checkpoints when due; returns the final state. Interrupted (Ctrl-C), it logs and
  saves what was done so ``--resume`` continues from there, then re-raises."""
  import jax
  import orbax.checkpoint as ocp
  cfg, train_cfg, state = run.cfg, run.cfg.train, run.state
  steps = train_cfg.steps
  manager = ocp.CheckpointManager(run.ckpt_dir, options=ocp.CheckpointManagerOptions(
      max_to_keep=train_cfg.keep_checkpoints, create=True))
  save = lambda done: manager.save(done, args=ocp.args.StandardSave(
      _checkpoint_tree(state)))
  due = lambda done, every: done == steps or (every > 0 and done % every == 0)
  try:
    with logger.bar:
      logger.task = logger.bar.add_task(
          cfg.name, total=steps, completed=start,
          info="compiling the step (the first step waits for it)")
      for step in range(start, steps):
        batch = run.data.train_batch(cfg.seed, step, cfg.data.batch_size,
                                     cfg.model.seq_len)
        state, metrics = run.setup.step(state, _global_batch(batch, run.setup.mesh))
        logger.pending.append(metrics)
        done = step + 1
        if step == start:
          # Compiled and run once: the time estimate leaves compilation out.
          jax.block_until_ready(metrics)
          logger.started(done)
        elif logger.show and len(logger.pending) >= 2:
          # Steps are dispatched ahead of the device: count the ones it has finished
          # (keeping one in flight), so the counter never runs ahead of the metrics.
          jax.block_until_ready(logger.pending[-2]["loss"])
          logger.bar.update(logger.task, completed=done - 1)
        evaluating = due(done, train_cfg.eval_every)
        checkpointing = due(done, train_cfg.checkpoint_every)
        if not (due(done, train_cfg.log_every) or evaluating or checkpointing):
          continue
        logger.flush(state, done, evaluating)
        if checkpointing:
          save(done)
  except KeyboardInterrupt:
    # Preempted: the steps since the last row get their row, the state a checkpoint.
    done = int(jax.device_get(state.step))
    if logger.pending:
      logger.flush(state, done, evaluating=False)
    if done > (manager.latest_step() or 0):
      save(done)
    manager.wait_until_finished()
    manager.close()
    logger.log.close()
    raise
  manager.wait_until_finished()
  manager.close()
  return state


def _finish(run: _Run, state: Any, start: int, logger: _Logger) -> dict[str, Any]:
  """Evaluates a resumed finished run, writes ``summary.json`` and ``metrics.png``,
  and returns the summary."""
  import jax
  from mpscale import builders
  cfg, out_dir = run.cfg, run.out_dir
  final_step = int(jax.device_get(state.step))
  if math.isnan(logger.eval_loss):  # a finished run resumed: evaluate its final state
    logger.eval_loss = evaluate(run.setup, state.params, run.data, cfg)
  logger.log.close()
  rows = _read_rows(logger.log.path)
  train_loss = _float(rows[-1]["loss"]) if rows else math.nan
  summary = {
      "name": cfg.name, **builders.describe(cfg), "steps": final_step,
      "final_train_loss": train_loss, "final_eval_loss": logger.eval_loss,
      "skipped": int(_float(rows[-1]["skipped"])) if rows else 0,
      "overflow_total": logger.overflow_total, "params": run.num_params,
      "optimizer_state_bytes": run.opt_bytes,
      "train_seconds": _previous_seconds(out_dir, start) + (
          time.perf_counter() - logger.t_run if final_step > start else 0.0),
      "resumed_from": start, "data": run.data.source, "out_dir": out_dir,
  }
  if run.main_process:
    with open(run.summary_path, "w") as f:
      json.dump(summary, f, indent=2)
    plot_runs({cfg.name: logger.log.path}, os.path.join(out_dir, "metrics.png"),
              title=f"{cfg.name} ({summary['policy']}, loss scale "
                    f"{summary['loss_scale']}, {summary['optimizer']})")
    if logger.verbose:
      logger.console.print(
          f"{cfg.name}: {final_step} steps, train loss {_fmt(train_loss)}, eval loss "
          f"{_fmt(logger.eval_loss)}, skipped {summary['skipped']} -> {out_dir}",
          soft_wrap=True)
  return summary


def train(cfg: config_lib.RunConfig, out_dir: Optional[str] = None, *,
          resume: bool = False, overwrite: bool = False,
          progress: Optional[bool] = None, source: str = "<config>",
          verbose: bool = True) -> dict[str, Any]:
  """Train ``cfg``'s tiny LM, writing the run's files into ``out_dir``.

  The parts, in order: `_prepare` (data, model, step, initial state; every config
  error is raised here, before any write), restore (`restore_latest`), `_start_files`,
  `_loop` (steps, logs, evaluations, checkpoints, via a `_Logger`), `_finish` (summary
  and plot).

  Args:
    cfg: the run.
    out_dir: the run's folder; default ``runs/<cfg.name>``.
    resume: continue from the latest checkpoint in ``out_dir`` (from scratch if it
      has none); a finished run only re-evaluates.
    overwrite: replace the files of a run already in ``out_dir``.
    progress: show a progress bar; default: when the console is a terminal.
    source: names the config in error messages (its path).
    verbose: print a line per evaluation and a final summary.

  Returns:
    The summary also written to ``summary.json``.

  Raises:
    RunDirError: if ``out_dir`` holds a run and neither ``resume`` nor ``overwrite``.
    config_lib.ConfigError: for a setup the config makes impossible (naming ``source``
      and the key), before anything is written.
  """
  out_dir = out_dir or os.path.join("runs", cfg.name)
  _check_out_dir(out_dir, resume, overwrite)
  run = _prepare(cfg, out_dir, source)
  start = 0
  if resume:
    run.state, start = restore_latest(run.ckpt_dir, run.state)
  if resume and start >= cfg.train.steps and os.path.exists(run.summary_path):
    # Nothing to train: say so, and leave the finished run's files as they are.
    with open(run.summary_path) as f:
      finished = json.load(f)
    if verbose and run.main_process:
      from rich.console import Console
      Console(stderr=True).print(
          f"{cfg.name}: already finished at step {start} of {cfg.train.steps} in "
          f"{out_dir}; nothing to resume (raise train.steps to train on)",
          soft_wrap=True)
    return finished
  _start_files(run, overwrite)
  logger = _Logger(run, start, progress, verbose)
  state = _loop(run, start, logger)
  return _finish(run, state, start, logger)


def _previous_seconds(out_dir: str, start: int) -> float:
  """Training seconds already spent by the run resumed at ``start`` (0 if none)."""
  path = os.path.join(out_dir, "summary.json")
  if not start or not os.path.exists(path):
    return 0.0
  with open(path) as f:
    previous = json.load(f)
  # Only the part up to the checkpoint counts; the rest is trained again.
  fraction = min(1.0, start / max(previous.get("steps", start), 1))
  return float(previous.get("train_seconds", 0.0)) * fraction


# ------------------------------------------------------------------ compare


def comparison_table(summaries: Sequence[dict[str, Any]]) -> tuple[list[str], list[list]]:
  """Header and rows of the comparison table (the first run is the reference)."""
  header = ["run", "policy", "loss scale", "optimizer", "steps", "final train loss",
            "final eval loss", "eval vs first", "skipped steps", "optimizer state (KiB)",
            "train time (s)"]
  ref = summaries[0]["final_eval_loss"] if summaries else math.nan
  rows = []
  for s in summaries:
    rel = (s["final_eval_loss"] / ref - 1) * 100 if ref else math.nan
    rows.append([s["name"], s["policy"], s["loss_scale"], s["optimizer"], s["steps"],
                 round(s["final_train_loss"], 4), round(s["final_eval_loss"], 4),
                 f"{rel:+.2f}%", s["skipped"],
                 round(s["optimizer_state_bytes"] / 1024, 1),
                 round(s["train_seconds"], 1)])
  return header, rows


def compare(config_paths: Sequence[str], out_dir: str = os.path.join("runs", "compare"),
            *, overrides: Sequence[str] = (), data_path: Optional[str] = None,
            resume: bool = False, overwrite: bool = False,
            progress: Optional[bool] = None, plot_path: Optional[str] = None,
            verbose: bool = True) -> list[dict[str, Any]]:
  """Train every config into ``out_dir/<name>`` and compare them.

  Writes ``comparison.csv``, ``comparison.md`` and ``comparison.png`` (and ``plot_path``
  if given) into ``out_dir``. Every config is loaded and checked before any run starts.

  Returns:
    The runs' summaries, in order.

  Raises:
    config_lib.ConfigError: for a bad config or two configs with the same name.
  """
  cfgs = [_load(p, overrides, data_path) for p in config_paths]
  names = [cfg.name for cfg in cfgs]
  if len(set(names)) != len(names):
    dup = next(n for n in names if names.count(n) > 1)
    raise config_lib.ConfigError(f"two configs are named {dup!r}; give each a distinct "
                                 "name (the name: key)")
  for cfg in cfgs:
    _check_out_dir(os.path.join(out_dir, cfg.name), resume, overwrite)
  summaries = [train(cfg, os.path.join(out_dir, cfg.name), resume=resume,
                     overwrite=overwrite, progress=progress, source=path,
                     verbose=verbose)
               for cfg, path in zip(cfgs, config_paths)]
  header, rows = comparison_table(summaries)
  with open(os.path.join(out_dir, "comparison.csv"), "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(header)
    writer.writerows(rows)
  md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  md += ["| " + " | ".join(str(v) for v in r) + " |" for r in rows]
  with open(os.path.join(out_dir, "comparison.md"), "w") as f:
    f.write("\n".join(md) + "\n")
  runs = {s["name"]: os.path.join(s["out_dir"], "metrics.csv") for s in summaries}
  png = os.path.join(out_dir, "comparison.png")
  plot_runs(runs, png, title="mpscale compare")
  if plot_path:
    os.makedirs(os.path.dirname(plot_path) or ".", exist_ok=True)
    shutil.copyfile(png, plot_path)
  if verbose:
    print("\n".join(md))
  return summaries


# ------------------------------------------------------------------ command line


def _load(path: str, overrides: Sequence[str], data_path: Optional[str]
         ) -> config_lib.RunConfig:
  cfg = config_lib.load_config(path, overrides)
  if data_path is not None:
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=data_path))
  return cfg


def default_out_dir(name: str, overrides: Sequence[str], root: str = "runs") -> str:
  """``runs/<name>``, or with ``--set`` overrides ``runs/<name>+<overrides>``, so a
  shortened or changed run never lands in the folder of the config's own run."""
  if not overrides:
    return os.path.join(root, name)
  slug = "+".join(re.sub(r"[^A-Za-z0-9_.=\-]+", "_", o) for o in overrides)
  if len(slug) > 60:
    digest = hashlib.sha1("\0".join(overrides).encode()).hexdigest()[:8]
    slug = f"{slug[:50]}-{digest}"
  return os.path.join(root, f"{name}+{slug}")


def _warn_unused_devices(cfg: config_lib.RunConfig, devices: Optional[int]) -> None:
  mesh = cfg.mesh
  needed = mesh.num_devices
  if devices is not None and devices > needed:
    print(f"mpscale: warning: --devices {devices}, but the config's mesh is data "
          f"{mesh.data} x fsdp {mesh.fsdp} x stage {mesh.stage} x tensor "
          f"{mesh.tensor}, so the run uses {needed} device(s); e.g. --set mesh.data="
          f"{devices // (needed // mesh.data)} for data parallelism", file=sys.stderr)


def _version_text() -> str:
  """``mpscale X (jax Y, optax Z, flax W)``, read without importing JAX."""
  from mpscale import _versions  # noqa: PLC0415

  def version(name):
    return _versions.installed(name) or "not installed"
  deps = ", ".join(f"{n} {version(n)}" for n in ("jax", "jaxlib", "optax", "flax"))
  return f"mpscale {version('mpscale')} ({deps}; floors: " + ", ".join(
      f"{n}>={v}" for n, v in _versions.FLOORS.items()) + ")"


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="mpscale", description="Train the tiny mixed-precision LM from a config.")
  parser.add_argument("--version", action="version", version=_version_text())
  sub = parser.add_subparsers(dest="command", required=True)

  def common(command: argparse.ArgumentParser) -> None:
    command.add_argument("--set", action="append", default=[], metavar="KEY.SUB=VALUE",
                         help="override a config value (parsed as YAML); repeatable")
    command.add_argument("--data", metavar="PATH",
                         help="a text file or folder instead of the embedded corpus")
    command.add_argument("--devices", type=int, metavar="N", help=(
        "simulate N devices on CPU (XLA host platform device count)"))
    group = command.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true",
                       help="continue the run(s) from the latest checkpoint")
    group.add_argument("--overwrite", action="store_true",
                       help="replace the files of an existing run")
    command.add_argument("--progress", action=argparse.BooleanOptionalAction,
                         default=None, help="show a progress bar (default: on a terminal)")
    command.add_argument("--quiet", action="store_true", help="print only errors")

  train_cmd = sub.add_parser("train", help="train one config")
  train_cmd.add_argument("--config", required=True, help="the run's YAML config")
  train_cmd.add_argument("--out", help="the run's folder (default runs/<config name>, "
                         "plus +<overrides> with --set)")
  common(train_cmd)
  compare_cmd = sub.add_parser("compare",
                               help="train several configs, plot and tabulate them")
  compare_cmd.add_argument("configs", nargs="+", help="YAML configs")
  compare_cmd.add_argument("--out", help="folder of the runs and the comparison "
                           "(default runs/compare, plus +<overrides> with --set)")
  compare_cmd.add_argument("--plot", metavar="PNG",
                           help="also copy the comparison plot here")
  common(compare_cmd)
  evaluate_cmd = sub.add_parser("eval", help="evaluate a run's latest checkpoint")
  evaluate_cmd.add_argument("run", help="the run's folder")
  sample_cmd = sub.add_parser("sample",
                              help="write text with a run's latest checkpoint")
  sample_cmd.add_argument("run", help="the run's folder")
  sample_cmd.add_argument("--prompt", default="",
                          help="text to continue (default: none)")
  sample_cmd.add_argument("--tokens", type=int, default=200, help="bytes to write")
  sample_cmd.add_argument("--temperature", type=float, default=0.8,
                          help="sampling temperature; 0 picks the likeliest byte")
  sample_cmd.add_argument("--seed", type=int, default=0)
  for command in (evaluate_cmd, sample_cmd):
    command.add_argument("--devices", type=int, metavar="N", help=argparse.SUPPRESS)
  return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the command; returns the exit status (2 for a config or run-folder error)."""
  args = _parser().parse_args(argv)
  try:
    set_host_device_count(args.devices)
  except ValueError as e:
    print(f"mpscale: error: {e}", file=sys.stderr)
    return 2
  init_distributed()
  try:
    if args.command == "train":
      cfg = _load(args.config, args.set, args.data)
      _warn_unused_devices(cfg, args.devices)
      out = args.out or default_out_dir(cfg.name, args.set)
      train(cfg, out, resume=args.resume, overwrite=args.overwrite,
            progress=args.progress, source=args.config, verbose=not args.quiet)
    elif args.command == "eval":
      loss, step = evaluate_run(args.run)
      print(f"{args.run}: eval loss {loss:.4f} nats/byte at step {step}")
    elif args.command == "sample":
      if args.tokens < 1 or args.temperature < 0:
        raise config_lib.ConfigError("--tokens must be >= 1 and --temperature >= 0")
      print(sample_run(args.run, args.prompt, args.tokens,
                       temperature=args.temperature, seed=args.seed))
    else:
      for path in args.configs:
        _warn_unused_devices(_load(path, args.set, args.data), args.devices)
      compare(args.configs, args.out or default_out_dir("compare", args.set),
              overrides=args.set, data_path=args.data,
              resume=args.resume, overwrite=args.overwrite, progress=args.progress,
              plot_path=args.plot, verbose=not args.quiet)
  except (config_lib.ConfigError, RunDirError, CheckpointError) as e:
    print(f"mpscale: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("mpscale: interrupted; continue with --resume", file=sys.stderr)
    return 130
  return 0
