"""Training a run: prepare, restore, the loop (log, evaluate, checkpoint), finish."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from typing import Any, Mapping, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from rich.console import Console
from rich.progress import TaskID

from mpscale import parallel as parallel_lib
from mpscale import validation
from mpscale.step import TrainState
from mpscale.trainer.config import build as builders
from mpscale.trainer.runs import checkpoints
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.data import corpora
from mpscale.trainer.data import text as data_lib
from mpscale.trainer.runs import distributed
from mpscale.trainer.models import lm as lm_lib
from mpscale.trainer.data import loader
from mpscale.trainer.runs import metrics_log
from mpscale.trainer.runs import throughput
from mpscale.trainer.models import user as models
from mpscale.trainer.data import tokenizing
from mpscale.trainer.hf import checkpoint as hf
from mpscale.trainer.hf import names as hf_names
from mpscale.trainer.runs.metrics_log import MetricsLog, read_rows, to_float
from mpscale.trainer.runs.interrupts import Interrupts
from mpscale.trainer.runs.plots import plot_runs
from mpscale.trainer.runs.progress import fmt, make_progress, progress_info, scale_text


RUN_FILES = ("config.yaml", "metrics.csv", "summary.json", "metrics.png", "tb",
             "checkpoints")
"""What a run writes into its folder (and what ``--overwrite`` removes)."""


class RunDirError(ValueError):
  """The output folder holds a run that this command would overwrite."""


def existing_run_files(out_dir: str) -> list[str]:
  """The `RUN_FILES` already present in ``out_dir``."""
  return [f for f in RUN_FILES if os.path.exists(os.path.join(out_dir, f))]


def check_out_dir(out_dir: str, resume: bool, overwrite: bool) -> None:
  if resume and overwrite:
    raise RunDirError("--resume and --overwrite are exclusive")
  found = existing_run_files(out_dir)
  if found and not (resume or overwrite):
    raise RunDirError(f"{out_dir} already holds a run ({', '.join(found)}); pass "
                      "--resume to continue it or --overwrite to replace it")


def _global_batch(batch: dict[str, Any], setup: builders.Setup,
                  data: loader.Data) -> Any:
  """The host batch, or across processes one global array from every process's rows
  of it (`mpscale.trainer.runs.distributed.global_batch`)."""
  return distributed.global_batch(batch, builders.batch_sharding(setup.mesh),
                                  data.batch_size, data.rows)


def evaluate_metrics(setup: builders.Setup, state: TrainState,
                     data: loader.Data) -> dict[str, float]:
  """The model's loss (``"loss"``, the mean per-token loss) and metrics (each total
  sum over total count) on the evaluation batches of ``data`` (a
  `mpscale.trainer.data.loader.Data`), in inference mode (no dropout, running averages:
  `mpscale.trainer.models.user`); NaN when it has none. Across processes each reads its
  rows of each batch and every process gets the same values."""
  sums: dict[str, list[float]] = {}
  for batch in data.eval_batches():
    out = jax.device_get(setup.evaluate(state, _global_batch(batch, setup, data)))
    for name, (total, count) in out.items():
      acc = sums.setdefault(name, [0.0, 0.0])
      acc[0], acc[1] = acc[0] + float(total), acc[1] + float(count)
  sums.setdefault("loss", [0.0, 0.0])
  return {name: total / count if count else math.nan
          for name, (total, count) in sums.items()}


def evaluate(setup: builders.Setup, state: TrainState, data: loader.Data) -> float:
  """The mean per-token loss of ``state`` (a `mpscale.TrainState`) over the
  evaluation batches of ``data`` (`evaluate_metrics`); NaN when it has none."""
  return evaluate_metrics(setup, state, data)["loss"]


@dataclasses.dataclass
class _Run:
  """One run being trained: what `_prepare` built, and where its files go."""
  cfg: config_lib.RunConfig
  out_dir: str
  setup: builders.Setup
  """Model, policy, optimizer, mesh, step, evaluate."""
  data: loader.Data
  """Training batches by step, evaluation batches."""
  state: TrainState
  """The state, initial or restored."""
  data_state: Optional[Mapping[str, Any]]
  """The data iterator's state to start from (``None``: the first batch)."""
  metric_shapes: dict[str, Any]
  """What the step returns as metrics (``jax.ShapeDtypeStruct``s); empty for a run
  loaded to evaluate or sample (`load_run`), whose step is not traced."""
  eval_names: list[str]
  """The model's evaluation metrics beside the loss (logged as ``eval_<name>``);
  empty for a loaded run."""
  num_params: int
  opt_bytes: int
  main_process: bool
  peak: Optional[throughput.Peak] = None
  """The peak of ``train.hardware`` for the step's compute dtype, for the logged MFU
  (`mpscale.trainer.runs.throughput.peak`); ``None`` without it, or for a loaded
  run."""

  @property
  def ckpt_dir(self) -> str:
    return checkpoint_dir(self.out_dir)

  @property
  def summary_path(self) -> str:
    return os.path.join(self.out_dir, "summary.json")


def _provided(given: Any, spec: Optional[str], key: str,
              cfg: config_lib.RunConfig) -> tuple[Any, str]:
  """A user's piece: ``given`` (a Python argument; a function is called with
  ``cfg``), else what the config's ``spec`` names (called with ``cfg``), else
  ``None``; and the key that names it in errors."""
  name = key.split(".")[0]
  if given is not None:
    if callable(given) and not _is_model_object(given):
      return models.call_provider(given, cfg, f"{name} (argument)"), f"{name} (argument)"
    return given, f"{name} (argument)"
  if spec is None:
    return None, key
  return models.call_provider(models.load_object(spec, key), cfg, key), key


def _is_model_object(obj: Any) -> bool:
  """Whether ``obj`` is a model itself rather than a function returning one (Flax
  modules and grain datasets are callable or have methods, too)."""
  if isinstance(obj, models.Model):
    return True
  for module, name in (("flax.nnx", "Module"), ("flax.linen", "Module")):
    cls = getattr(sys.modules.get(module), name, None)
    if cls is not None and isinstance(obj, cls):
      return True
  return False


def open_data(cfg: config_lib.RunConfig, given: Any) -> loader.Data:
  """The run's data: a user's source, a token corpus, or the text; across
  processes, this process's rows of each batch."""
  rows = distributed.process_rows(builders.batch_sharding(builders.build_mesh(cfg)),
                                  cfg.data.batch_size)
  source, key = _provided(given, cfg.data.provider, "data.provider", cfg)
  if source is not None:
    data = loader.user_data(source, cfg, key, rows)
    if given is None:
      data.source = cfg.data.provider
    return data
  if corpora.uses_tokens(cfg.data):
    # data.tokenize's first use tokenizes: a bar on the main process's terminal.
    return corpora.token_data(cfg, rows,
                              progress=None if jax.process_index() == 0 else False)
  try:
    text = data_lib.load_data(cfg.data.path, cfg.data.eval_fraction)
  except (OSError, ValueError) as e:
    raise validation.fail("data.path", f": {e}") from None
  return loader.text_data(text, cfg, rows)


def open_model(cfg: config_lib.RunConfig, given: Any, loss: Any, first_batch: Any,
                metrics: Any = None) -> tuple[Optional[models.Model], str]:
  """A user's `mpscale.trainer.models.user.Model` (``None`` for the tiny LM) and its key."""
  obj, key = _provided(given, cfg.model.provider, "model.provider", cfg)
  if obj is None:
    if loss is not None:
      raise ValueError("loss (argument): the built-in model has its own loss; pass "
                       "model= too")
    return None, key
  config_lib.check_user_model(cfg)
  if loss is None and cfg.model.loss is not None and given is None:
    loss = models.load_object(cfg.model.loss, "model.loss")
  if metrics is None and cfg.model.metrics is not None:
    metrics = models.load_object(cfg.model.metrics, "model.metrics")
  return models.as_model(obj, loss, first_batch, key, seed=cfg.seed,
                         metrics=metrics), key


def _without_init_from(cfg: config_lib.RunConfig) -> config_lib.RunConfig:
  """``cfg`` starting from its seed, not ``model.init_from``'s weights (a checkpoint
  replaces them)."""
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                            init_from=None))


def checkpoint_dir(out_dir: str) -> str:
  """A run folder's checkpoint folder."""
  return os.path.abspath(os.path.join(out_dir, "checkpoints"))


def _prepare(cfg: config_lib.RunConfig, out_dir: str, source: str, *,
             model: Any = None, data: Any = None, loss: Any = None,
             trace_step: bool = True, resuming: bool = False) -> _Run:
  """Loads the data and builds the model, step and initial state. Everything that can
  fail on the config or on the user's pieces happens here, before the first write:
  a provider that cannot be imported or returns the wrong type, and batches the model
  cannot take (the step is traced on the first batch with ``jax.eval_shape``; the
  trace is jit's, so the first step does not trace it again). ``trace_step=False``
  (a trained run loaded to evaluate or sample, `load_run`) skips that trace: the
  step is not run, and tracing a pipelined one takes seconds. ``resuming``: a
  checkpoint will replace the initial parameters, so ``model.init_from``'s weights
  are not read (its sizes are in ``cfg`` already).

  Raises:
    config_lib.ConfigError: naming ``source`` and the key.
  """
  def fail(e: Exception) -> None:
    if isinstance(e, config_lib.ConfigError):
      raise e
    raise config_lib.as_config_error(e).located(source) from None

  try:
    run_data = open_data(cfg, data)
    first_batch = run_data.train[0]
    user_model, model_key = open_model(cfg, model, loss, first_batch)
    # loss_scale.init_scale: null starts a per-token (sum) loss's scale from its tokens.
    user = user_model is not None
    cfg = builders.with_initial_scale(
        cfg, user or cfg.train.per_token_loss,
        builders.micro_batch_tokens(cfg, first_batch if user else None))
    setup = builders.build(_without_init_from(cfg) if resuming else cfg,
                           model=user_model)
    params = setup.init_params()
    state = setup.init(params)
    peak = (throughput.peak(cfg.train.hardware, setup.policy.compute_dtype)
            if trace_step else None)
  except (ValueError, TypeError) as e:
    fail(e)
  batch_shapes = global_batch_shapes(run_data, first_batch)
  metric_shapes, eval_names = {}, []
  if trace_step:
    try:
      metric_shapes = jax.eval_shape(setup.step, state, batch_shapes)[1]
      eval_names = sorted(set(jax.eval_shape(setup.evaluate, state, batch_shapes))
                          - {"loss"})
    except Exception as e:  # the user's loss on the user's batch may raise anything
      if user_model is None and cfg.data.provider is None and data is None:
        if isinstance(e, (ValueError, TypeError)):
          fail(e)
        raise
      data_key = "data (argument)" if data is not None else (
          "data.provider" if cfg.data.provider else "the built-in data")
      if models.unbound_axis_name(e) is not None:  # the model's own collectives
        fail(validation.fail(model_key, f": {e}: the model names an axis no "
                             "transformation binds (a collective such as lax.pmean over "
                             "it); mpscale binds those of Flax modules (axis_name=...) "
                             "as the batch axis", validation.ArgumentTypeError))
      shapes = {k: (v.shape, str(v.dtype)) for k, v in batch_shapes.items()}
      fail(validation.fail(data_key, f": its batches do not fit {model_key}: "
                           f"training on the first batch {shapes} raised "
                           f"{type(e).__name__}: {str(e)[:500]}"))
  return _Run(cfg, out_dir, setup, run_data, state, None, metric_shapes, eval_names,
              num_params=lm_lib.num_params(params),
              opt_bytes=parallel_lib.tree_bytes(state.opt_state, per_device=False),
              main_process=jax.process_index() == 0, peak=peak)


def global_batch_shapes(data: loader.Data, batch: dict[str, Any]) -> dict[str, Any]:
  """The shapes of a global batch of ``data`` like ``batch``: ``data.batch_size``
  rows (a process reads only its rows of it)."""
  return {k: jax.ShapeDtypeStruct((data.batch_size,) + np.shape(v)[1:],
                                  np.asarray(v).dtype) for k, v in batch.items()}


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
  ``metrics.csv``/TensorBoard row per log point, the evaluation, the progress bar.

  A context: inside it the progress bar shows. Each step's metrics go to `record`; a
  row is written by `flush` when one is due; `close` closes the log."""

  def __init__(self, run: _Run, start: int, progress: Optional[bool], verbose: bool):
    self.run, self.start, self.verbose = run, start, verbose
    self.log = MetricsLog(
        run.out_dir, sorted(run.metric_shapes["group_norms"]), start,
        run.main_process, eval_names=run.eval_names,
        lr_groups=list(run.metric_shapes.get("group_learning_rates", {})),
        data_names=run.data.shares.names if run.data.shares else (),
        moe="moe" in run.metric_shapes)
    previous = to_float(self.log.last.get("overflow_total")) if start else math.nan
    self.overflow_total = 0 if math.isnan(previous) else int(previous)
    self.console = Console(stderr=True)
    self.show = self.console.is_terminal if progress is None else progress
    self.t_run = self.t_mark = time.perf_counter()
    self.pending: list[dict[str, Any]] = []
    # FLOPs a device: of each pending step, of the latest step (its compiled
    # program's, `throughput.StepFlops`), and of the rows logged, with their seconds.
    self.pending_flops: list[float] = []
    self.step_flops = math.nan
    self.logged_flops = self.logged_seconds = 0.0
    self.untimed = 0  # pending steps run before the clock started (compiling)
    self.eval_loss = math.nan
    self.eval_values: dict[str, float] = {}
    self.bar = make_progress(self.console, disable=not (self.show and run.main_process))
    self.task: Optional[TaskID] = None

  def __enter__(self) -> _Logger:
    """Shows the bar at step ``start`` while the first step compiles."""
    self.bar.start()
    self.task = self.bar.add_task(
        self.run.cfg.name, total=self.run.cfg.train.steps, completed=self.start,
        info="compiling the step (the first step waits for it)")
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.bar.stop()

  @property
  def path(self) -> str:
    """The run's ``metrics.csv``."""
    return self.log.path

  @property
  def seconds(self) -> float:
    """Seconds since this logger started (the run's training in this process)."""
    return time.perf_counter() - self.t_run

  def record(self, metrics: dict[str, Any], done: int, flops: float) -> None:
    """Keeps the metrics of the step that made ``done`` steps, and the FLOPs a device
    of its program, for the next row."""
    self.pending.append(metrics)
    self.pending_flops.append(flops)
    self.step_flops = flops
    if done == self.start + 1:
      # Compiled and run once: the time estimate leaves compilation out.
      jax.block_until_ready(metrics)
      self._started(done)
    elif self.show and len(self.pending) >= 2:
      # Steps are dispatched ahead of the device: count the ones it has finished
      # (keeping one in flight), so the counter never runs ahead of the metrics.
      jax.block_until_ready(self.pending[-2]["loss"])
      self.bar.update(self.task, completed=done - 1)

  def _started(self, done: int) -> None:
    """The first step ran (compiled): restart the clock, say when metrics come."""
    every, steps = self.run.cfg.train.log_every, self.run.cfg.train.steps
    first_log = min(steps, (done // every + 1) * every) if every > 0 else steps
    self.bar.reset(self.task, total=steps, completed=done,
                   info=f"training; the first metrics come at step {first_log}")
    self.t_mark = time.perf_counter()
    self.untimed = len(self.pending)  # its rate leaves the compiled step out

  def evaluate(self, state: TrainState) -> None:
    """Evaluates ``state``: the loss into ``eval_loss``, every value into
    ``eval_values``."""
    self.eval_values = evaluate_metrics(self.run.setup, state, self.run.data)
    self.eval_loss = self.eval_values["loss"]

  def flush(self, state: TrainState, done: int,
            evaluating: bool) -> Optional[dict[str, Any]]:
    """Logs one row (`mpscale.trainer.runs.metrics_log.csv_row`) for the steps recorded
    since the last (ending at ``done``), evaluating ``state`` first if
    ``evaluating``; returns it, or ``None`` when no step is recorded."""
    if not self.pending:
      return None
    host = jax.device_get(self.pending)
    now = time.perf_counter()
    if evaluating:
      self.evaluate(state)
    timed = len(host) - self.untimed  # the steps the clock saw
    flops = sum(self.pending_flops[self.untimed:])
    seconds = now - self.t_mark if timed else math.nan
    row = metrics_log.csv_row(metrics_log.Interval(
        step=done, metrics=host, evaluation=self.eval_values if evaluating else None,
        overflow_total=self.overflow_total,
        tokens=self.run.data.tokens_between(done - timed, done),
        consumed_samples=self.run.data.consumed_at(done), seconds=seconds,
        wall_s=now - self.t_run, flops=flops,
        peak_flops=None if self.run.peak is None else self.run.peak.flops),
        self.run.eval_names)
    if self.run.data.shares is not None:  # a blend: each corpus's share so far
      row.update({metrics_log.DATA_PREFIX + name: share for name, share
                  in self.run.data.shares.fractions(done).items()})
    self.overflow_total = row["overflow_total"]
    self.log.write(row)
    row["interval"] = len(host)
    if timed:
      self.logged_flops, self.logged_seconds = (self.logged_flops + flops,
                                                self.logged_seconds + seconds)
    self.pending, self.pending_flops, self.untimed = [], [], 0
    self.t_mark = time.perf_counter()
    scaled = self.run.cfg.loss_scale.kind != "none"  # else the scale is always 1
    self.bar.update(self.task, completed=done,
                    info=progress_info(row, self.overflow_total, self.eval_loss,
                                       scaled=scaled))
    if evaluating and not self.show:
      cfg = self.run.cfg
      scale = f"scale {scale_text(row['loss_scale'])}, " if scaled else ""
      self.say(f"{cfg.name} step {done}/{cfg.train.steps}: loss {fmt(row['loss'])}, "
               f"eval {fmt(self.eval_loss)}, {scale}overflows {self.overflow_total}")
    return row

  def say(self, text: str) -> None:
    """Prints ``text`` to the console when verbose (on the main process)."""
    if self.verbose and self.run.main_process:
      self.console.print(text, soft_wrap=True)

  def rates(self) -> dict[str, Any]:
    """The summary's arithmetic: ``flops_per_device`` (a step's, its compiled
    program's: what ``mpscale plan`` says), ``tflops_per_device`` (the logged rows'
    FLOPs over their seconds: this process's training, since its resume for a
    resumed run), and with ``train.hardware`` its ``hardware``, ``peak_tflops`` and
    ``mfu`` (``None`` without)."""
    peak = self.run.peak
    flops, seconds = self.logged_flops, self.logged_seconds
    return {"flops_per_device": self.step_flops,
            "tflops_per_device": (metrics_log.tflops_per_device(flops, seconds)
                                  if seconds else math.nan),
            "hardware": None if peak is None else peak.hardware,
            "peak_tflops": None if peak is None else peak.flops / 1e12,
            "mfu": (metrics_log.mfu(flops, seconds, peak.flops)
                    if peak is not None and seconds else None)}

  def close(self) -> None:
    """Closes ``metrics.csv`` and the TensorBoard events."""
    self.log.close()


def _loop(run: _Run, start: int, logger: _Logger,
          interrupts: Interrupts) -> TrainState:
  """Trains from step ``start`` to ``train.steps``, logging, evaluating and saving
  checkpoints when due; returns the final state. Interrupted (Ctrl-C, held by
  ``interrupts`` until a step boundary), it logs and saves what was done, step 0
  included, so ``--resume`` continues from there, then re-raises."""
  train_cfg, state = run.cfg.train, run.state
  steps = train_cfg.steps
  manager = ocp.CheckpointManager(run.ckpt_dir, options=ocp.CheckpointManagerOptions(
      max_to_keep=train_cfg.keep_checkpoints, create=True))
  batches = run.data.iterator(run.data_state)
  # Checkpoints hold the layers in model order: any mesh and schedule restores them.
  save = lambda done: checkpoints.save(manager, done, run.setup.to_model_order(state),
                                      batches.get_state(),
                                      consumed_samples=run.data.consumed_at(done))
  due = lambda done, every: done == steps or (every > 0 and done % every == 0)
  count_flops = throughput.StepFlops(run.setup.step)  # compiles the step, once
  try:
    with logger:
      for step in range(start, steps):
        interrupts.check()  # the state is whole here: a Ctrl-C stops the run
        batch = _global_batch(next(batches), run.setup, run.data)
        flops = count_flops(state, batch)
        state, metrics = run.setup.step(state, batch)  # donates the old state
        done = step + 1
        logger.record(metrics, done, flops)
        evaluating = due(done, train_cfg.eval_every)
        checkpointing = due(done, train_cfg.checkpoint_every)
        if not (due(done, train_cfg.log_every) or evaluating or checkpointing):
          continue
        logger.flush(state, done, evaluating)
        if checkpointing:
          save(done)
      interrupts.check()
  except KeyboardInterrupt:
    # Preempted: the steps since the last row get their row, the state a checkpoint.
    # Across processes the others may be at another step (saving is collective), so
    # the run resumes from its last regular checkpoint instead.
    done = int(jax.device_get(state.step))
    logger.flush(state, done, evaluating=False)
    latest = manager.latest_step()
    if (latest is None or done > latest) and jax.process_count() == 1:
      save(done)
    manager.wait_until_finished()
    manager.close()
    logger.close()
    raise
  manager.wait_until_finished()
  manager.close()
  return state


def _finish(run: _Run, state: TrainState, start: int, logger: _Logger,
            previous_seconds: float) -> dict[str, Any]:
  """Evaluates a resumed finished run, writes ``summary.json`` and ``metrics.png``,
  and returns the summary; ``previous_seconds``: `_previous_seconds`, read before
  training (here the main process may be writing that file while another reads)."""
  cfg, out_dir = run.cfg, run.out_dir
  final_step = int(jax.device_get(state.step))
  if math.isnan(logger.eval_loss):  # a finished run resumed: evaluate its final state
    logger.evaluate(state)
  logger.close()
  rows = read_rows(logger.path)
  train_loss = to_float(rows[-1]["loss"]) if rows else math.nan
  summary = {
      "name": cfg.name, **builders.describe(cfg), "steps": final_step,
      "consumed_samples": run.data.consumed_at(final_step),
      "final_train_loss": train_loss, "final_eval_loss": logger.eval_loss,
      **{f"final_eval_{n}": logger.eval_values.get(n, math.nan)
         for n in run.eval_names},
      "skipped": int(to_float(rows[-1]["skipped"])) if rows else 0,
      "overflow_total": logger.overflow_total, "params": run.num_params,
      "optimizer_state_bytes": run.opt_bytes,
      "train_seconds": previous_seconds + (
          logger.seconds if final_step > start else 0.0),
      **logger.rates(),
      "resumed_from": start, "data": run.data.source, "out_dir": out_dir,
  }
  if run.data.shares is not None:  # a blend: the share of each corpus trained on
    summary["data_fractions"] = run.data.shares.fractions(final_step)
  if run.main_process:
    with open(run.summary_path, "w") as f:
      json.dump(summary, f, indent=2)
    plot_runs({cfg.name: logger.path}, os.path.join(out_dir, "metrics.png"),
              title=f"{cfg.name} ({summary['policy']}, loss scale "
                    f"{summary['loss_scale']}, {summary['optimizer']})",
              loss_unit=corpora.loss_unit(cfg))
    logger.say(f"{cfg.name}: {final_step} steps, train loss {fmt(train_loss)}, eval "
               f"loss {fmt(logger.eval_loss)}, skipped {summary['skipped']} -> "
               f"{out_dir}")
  return summary


def train(cfg: config_lib.RunConfig, out_dir: Optional[str] = None, *,
          resume: bool = False, overwrite: bool = False,
          progress: Optional[bool] = None, source: str = "<config>",
          verbose: bool = True, model: Any = None, data: Any = None,
          loss: Any = None, step: Optional[int] = None) -> dict[str, Any]:
  """Train ``cfg``'s model on its data, writing the run's files into ``out_dir``.

  The model and data are the tiny LM and its corpus, or what ``model.provider`` and
  ``data.provider`` name, or the ``model``, ``data`` and ``loss`` given here (see
  `run`).

  The parts, in order: `_prepare` (data, model, step, initial state; every config
  error is raised here, before any write), restore (`checkpoints.restore_latest`),
  `_start_files`, `_loop` (steps, logs, evaluations, checkpoints, via a `_Logger`),
  `_finish` (summary and plot).

  Args:
    cfg: the run.
    out_dir: the run's folder; default ``runs/<cfg.name>``.
    resume: continue from the latest checkpoint in ``out_dir``; a finished run
      only re-evaluates. A folder with no run yet starts from scratch; one that
      holds a run's files but no checkpoint is refused (nothing to resume, and its
      record would be replaced), and so is a ``cfg`` that changes a key of the
      run's ``config.yaml`` beyond `config_lib.RESUME_MAY_CHANGE` (the data, the
      learning rate, a model size: another run).
    overwrite: replace the files of a run already in ``out_dir``.
    progress: show a progress bar; default: when the console is a terminal.
    source: names the config in error messages (its path).
    verbose: print a line per evaluation and a final summary.
    model: a user's model, or a function ``(cfg) ->`` one (`run`).
    data: a user's data source, or a function ``(cfg) ->`` one (`run`).
    loss: the loss of a Flax ``model`` (`run`).
    step: with ``resume``, the checkpoint to continue from (default: the latest);
      the later ones are deleted, so that the run goes on from there (a corrupt
      latest checkpoint is the reason to pick one).

  Returns:
    The summary also written to ``summary.json``.

  Raises:
    RunDirError: if ``out_dir`` holds a run and neither ``resume`` nor ``overwrite``,
      or ``resume`` finds a run there but no checkpoint, or a run of other keys
      (naming them), before anything is written.
    config_lib.ConfigError: for a setup the config makes impossible (naming ``source``
      and the key), before anything is written.
  """
  out_dir = out_dir or os.path.join("runs", cfg.name)
  # Across processes: the same config, options and code everywhere, or nothing runs.
  distributed.check_same_run(
      cfg, source, out_dir=os.path.abspath(out_dir), resume=resume, overwrite=overwrite,
      model=_kind(model), data=_kind(data), loss=_kind(loss))
  check_out_dir(out_dir, resume, overwrite)
  if step is not None and not resume:
    raise RunDirError("--step picks the checkpoint to resume from: give --resume too")
  resuming = resume and bool(checkpoints.saved_steps(checkpoint_dir(out_dir)))
  found = existing_run_files(out_dir)
  if resume and not resuming and set(found) - {"checkpoints"}:
    # a run's record with nothing to resume from: starting over would replace it
    raise RunDirError(
        f"{out_dir} holds a run ({', '.join(found)}) but no checkpoint in "
        f"{checkpoint_dir(out_dir)} to resume from; pass --overwrite to train it "
        "again from step 0 (its files replaced), or --out another folder")
  if resuming:
    _check_resumed_config(cfg, out_dir)
  with Interrupts() as interrupts:  # Ctrl-C held until the run can stop cleanly
    run = _prepare(cfg, out_dir, source, model=model, data=data, loss=loss,
                   resuming=resuming)
    start = 0
    if resume:
      run.state, start, run.data_state = _restore(run, step=step)
      _check_consumed(run, start, source)
    interrupts.check(started=False)  # nothing written yet
    if resume and step is not None:
      _drop_later_checkpoints(run, step, verbose)
    if resume and start >= cfg.train.steps and os.path.exists(run.summary_path):
      return _already_finished(run, start, verbose)
    previous_seconds = _previous_seconds(out_dir, start)  # before anyone writes it
    _start_files(run, overwrite)
    logger = _Logger(run, start, progress, verbose)
    state = _loop(run, start, logger, interrupts)
    summary = _finish(run, state, start, logger, previous_seconds)
  export = getattr(run.setup.model, "export", None)
  if model is not None and export is not None:
    # A Flax NNX module given here is updated in place (its export does that).
    export(*parallel_lib.unpad(jax.device_get(run.setup.to_model_order(
        (state.params, state.model_state)))))
  return summary


def _already_finished(run: _Run, start: int, verbose: bool) -> dict[str, Any]:
  """A finished run resumed with nothing to train: says so and returns its summary,
  leaving its files as they are."""
  with open(run.summary_path) as f:
    finished = json.load(f)
  if verbose and run.main_process:
    Console(stderr=True).print(
        f"{run.cfg.name}: already finished at step {start} of {run.cfg.train.steps} "
        f"in {run.out_dir}; nothing to resume (raise train.steps to train on)",
        soft_wrap=True)
  return finished


def _check_resumed_config(cfg: config_lib.RunConfig, out_dir: str) -> None:
  """``cfg`` trains what the run in ``out_dir`` trained (its ``config.yaml``): it
  changes no key but those `config_lib.RESUME_MAY_CHANGE` names. Another corpus,
  learning rate or model size would continue the run as another one and rewrite
  the record of what its first steps were trained on.

  Raises:
    RunDirError: naming each key that differs, its value in the run and in ``cfg``.
  """
  path = os.path.join(out_dir, "config.yaml")
  if not os.path.exists(path):  # checkpoints alone: nothing recorded to compare
    return
  with open(path, encoding="utf-8") as f:
    saved = config_lib.read_config(config_lib.parse_yaml(f.read(), path), path)[0]
  changed = config_lib.resume_changes(saved, cfg)
  if changed:
    changes = "; ".join(f"{key}: {old!r} -> {new!r}"
                        for key, (old, new) in changed.items())
    allowed = ", ".join(k if "." in k else f"{k}.*"
                        for k in config_lib.RESUME_MAY_CHANGE)
    raise RunDirError(
        f"{out_dir}: --resume would change what this run trains: {changes} (its "
        f"config.yaml -> this config). A resume may change only {allowed}; train the "
        "changed config in another folder (--out) or from step 0 (--overwrite)")


def _restore(run: _Run, opt_state: bool = True, step: Optional[int] = None
            ) -> tuple[TrainState, int, Any]:
  """`checkpoints.restore_latest` into ``run.state``: the checkpoint's layers are in
  model order, the state's as the step stores them (`builders.Setup.to_model_order`).
  """
  restored, step, data_state = checkpoints.restore_latest(
      run.ckpt_dir, run.setup.to_model_order(run.state), opt_state=opt_state,
      step=step)
  return (builders.place_like(run.setup.to_device_order(restored), run.state), step,
          data_state)


def _drop_later_checkpoints(run: _Run, step: int, verbose: bool) -> None:
  """Deletes the checkpoints after ``step`` (main process), saying so: the run
  resumed from ``step`` writes its own."""
  if not run.main_process:
    return
  with ocp.CheckpointManager(run.ckpt_dir) as manager:
    later = [s for s in manager.all_steps() if s > step]
    for s in later:
      manager.delete(s)
  if later and verbose:
    Console(stderr=True).print(
        f"{run.cfg.name}: resuming from step {step}; deleted the later checkpoints "
        f"(steps {', '.join(map(str, sorted(later)))})", soft_wrap=True)


def _check_consumed(run: _Run, start: int, source: str) -> None:
  """The checkpoint a run resumes from was trained on as many samples as this
  config's batch sizes say its steps take: else its data position and sample-counted
  schedule would silently shift (``data.batch_size`` or ``data.rampup_batch_size``
  changed since)."""
  saved = checkpoints.consumed_samples(run.ckpt_dir, start) if start else None
  if saved is not None and saved != run.data.consumed_at(start):
    raise config_lib.ConfigError(
        f"{source}: data.batch_size, data.rampup_batch_size: the checkpoint of step "
        f"{start} in {run.ckpt_dir} was trained on {saved} samples, but this config's "
        f"batch sizes make {run.data.consumed_at(start)} by that step; resume with "
        "the batch sizes it was trained with")


def _kind(obj: Any) -> Optional[str]:
  """The type of a Python-given piece, for comparing processes."""
  return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


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


def run(config: Any, *, model: Any = None, data: Any = None, loss: Any = None,
        out_dir: Optional[str] = None, overrides: Any = (), resume: bool = False,
        overwrite: bool = False, progress: Optional[bool] = None,
        verbose: bool = True) -> dict[str, Any]:
  """Train a user's model on a user's data with everything ``mpscale train`` does:
  mixed precision, loss scaling, the mesh, checkpoints and exact resume, metrics
  (CSV, TensorBoard, plot), evaluation and a summary, in the run folder.

  Args:
    config: a `RunConfig`, a YAML file's path, or a mapping of the YAML's keys.
    model: a Flax NNX module (built), a Flax linen module, an
      `mpscale.trainer.models.user.Model`, or a function ``(config) ->`` one; default:
      what ``model.provider`` names, else the tiny LM.
    data: a random-access source of examples (dicts of arrays), ``{"train": source,
      "eval": source}``, or a function ``(config) ->`` one; default: what
      ``data.provider`` names, else the corpus (`mpscale.trainer.data.loader`).
    loss: for a Flax module, ``loss(model, batch) -> (loss_sum, num_tokens)`` or a
      mean; default: what ``model.loss`` names.
    out_dir: the run's folder; default ``runs/<name>``.
    overrides: ``key.sub=value`` strings applied to a path or mapping ``config``.
    resume: continue from the latest checkpoint in ``out_dir``.
    overwrite: replace the files of a run already in ``out_dir``.
    progress: show a progress bar; default: when the console is a terminal.
    verbose: print a line per evaluation and a final summary.

  Returns:
    The run's summary (``summary.json``).

  Raises:
    config_lib.ConfigError: for a bad config, or pieces that do not fit (naming the
      key or argument), before anything is written.
    RunDirError: if ``out_dir`` holds a run and neither ``resume`` nor ``overwrite``,
      or ``resume`` finds a run there but no checkpoint, or a run of other keys.

  Example::

    import mpscale.trainer
    summary = mpscale.trainer.run({"train": {"steps": 100}}, model=MyModule(rngs),
                                  loss=my_loss, data={"train": train, "eval": test})
  """
  if isinstance(config, config_lib.RunConfig):
    if overrides:
      raise TypeError("overrides: apply them to a path or mapping config, or use "
                      "dataclasses.replace on a RunConfig")
    cfg, source = config, "<config>"
  elif isinstance(config, (str, os.PathLike)):
    cfg, source = config_lib.load_config(config, overrides), os.fspath(config)
  elif isinstance(config, dict):
    cfg = config_lib.config_from_dict(config, "<config>", overrides,
                                      default_name="run")
    source = "<config>"
  else:
    raise TypeError(f"config: expected a RunConfig, a path or a mapping; got "
                    f"{type(config).__name__}")
  return train(cfg, out_dir, resume=resume, overwrite=overwrite, progress=progress,
               source=source, verbose=verbose, model=model, data=data, loss=loss)


def load_run(out_dir: str, devices: Optional[int] = None,
             step: Optional[int] = None) -> tuple[_Run, int]:
  """A finished or interrupted run, rebuilt from its ``config.yaml`` (providers
  included) with the state of its latest checkpoint (or of ``step``), and that
  checkpoint's step.

  On fewer devices than the run's mesh needs (a run trained with ``--devices 4``,
  read in a process that has one), the run is rebuilt on one device (every mesh
  axis 1, nothing split or pipelined; ``run.cfg.mesh`` says so) and its parameters,
  step and model state are restored onto it: the tiny LM's parameters are the same
  tree on any mesh (the layers stacked). Its optimizer state, laid out for the mesh
  it was trained on, is not read: ``run.state.opt_state`` is then ``None``.
  Evaluation and sampling need only the parameters, and give what they give on the
  run's own mesh (to float rounding).

  Args:
    out_dir: the run's folder.
    devices: how many devices it may use; default (and at most) all JAX has.

  Returns:
    ``(run, step)``.

  Raises:
    RunDirError: if ``out_dir`` holds no run or no checkpoint, or the run cannot be
      rebuilt on one device (a user's pipelined model).
    ValueError: if ``devices`` < 1.
  """
  return _load_saved(out_dir, _saved_config(out_dir), devices, step)


def _saved_config(out_dir: str) -> Any:
  """A run folder's ``config.yaml``, as the run started: its sizes as saved, its
  ``model.init_from`` checkpoint (which may be gone since) not read.

  Raises:
    RunDirError: if ``out_dir`` holds no run.
  """
  path = os.path.join(out_dir, "config.yaml")
  if not os.path.exists(path):
    raise RunDirError(f"{out_dir} holds no run (no config.yaml)")
  return config_lib.load_config(path, checkpoint_sizes=False)


def _load_saved(out_dir: str, saved: Any, devices: Optional[int],
                step: Optional[int]) -> tuple[_Run, int]:
  """`load_run` of the run whose config is ``saved`` (`_saved_config`)."""
  path = os.path.join(out_dir, "config.yaml")
  if devices is not None and devices < 1:
    raise ValueError(f"devices must be >= 1; got {devices}")
  # The checkpoint holds the weights: a Hugging Face start is not read again.
  saved = _without_init_from(saved)
  available = jax.device_count() if devices is None else min(devices,
                                                              jax.device_count())
  own_mesh = saved.mesh.num_devices <= available
  cfg = saved if own_mesh else dataclasses.replace(saved, mesh=config_lib.MeshConfig())
  try:
    run = _prepare(cfg, out_dir, path, trace_step=False)
  except config_lib.ConfigError as e:
    if own_mesh:
      raise
    raise RunDirError(f"{out_dir}: its mesh ({saved.mesh.shape_text}) needs "
                      f"{saved.mesh.num_devices} devices, {available} here, and it "
                      f"cannot be rebuilt on one: {e}") from None
  run.state, step, run.data_state = _restore(run, opt_state=own_mesh, step=step)
  if step == 0:
    raise RunDirError(f"{out_dir} holds no checkpoint yet")
  if not own_mesh:
    run.state = run.state._replace(opt_state=None)
  return run, step


def evaluate_run(out_dir: str, devices: Optional[int] = None,
                 step: Optional[int] = None) -> tuple[float, int]:
  """``(eval loss, step)`` of a run's latest checkpoint (or ``step``'s) on its
  evaluation data, on the run's mesh or, with fewer devices than it needs, on one
  (`load_run`)."""
  values, step = evaluate_run_metrics(out_dir, devices, step)
  return values["loss"], step


def evaluate_run_metrics(out_dir: str, devices: Optional[int] = None,
                         step: Optional[int] = None) -> tuple[dict[str, float], int]:
  """`evaluate_run` with the model's evaluation metrics too (``model.metrics``, e.g.
  ``accuracy``): ``({"loss": ..., name: ...}, step)``."""
  run, step = load_run(out_dir, devices, step)
  return evaluate_metrics(run.setup, run.state, run.data), step


def export_run(out_dir: str, hf_dir: str, *, dtype: str = "float32",
               devices: Optional[int] = None, step: Optional[int] = None) -> list[str]:
  """Write a run's latest checkpoint (or ``step``'s) as a Hugging Face checkpoint
  folder ``hf_dir`` (`mpscale.trainer.hf.save`: ``dtype`` float32 or bfloat16),
  with the tokenizer files of its ``model.init_from`` folder, or its
  ``data.tokenizer``, when it had them. Returns the files written.

  Raises:
    RunDirError: for a run of a user's model, or of the ``gpt`` family (no Hugging
      Face form here), naming the run; nothing is written.
  """
  saved = _saved_config(out_dir)
  if saved.model.provider is not None:
    raise RunDirError(f"{out_dir}: export writes the built-in model's families; this "
                      "run trained a user's model (model.provider)")
  if saved.model.family not in hf_names.ARCHITECTURES:
    raise RunDirError(f"{out_dir}: model.family {saved.model.family!r} has no Hugging "
                      f"Face form here; {', '.join(hf_names.ARCHITECTURES)} do")
  if os.path.exists(os.path.join(hf_dir, "config.json")):
    raise RunDirError(f"{hf_dir} holds a checkpoint already; choose a new folder")
  run, _ = _load_saved(out_dir, saved, devices, step)
  params = parallel_lib.unpad(jax.device_get(
      run.setup.to_model_order(run.state.params)))
  written = hf.save(run.setup.model, params, hf_dir, dtype=dtype,
                    source=saved.model.init_from)
  tokenizer = saved.data.tokenizer
  if "tokenizer.json" not in written and tokenizer and os.path.exists(tokenizer):
    shutil.copy(tokenizer, os.path.join(hf_dir, "tokenizer.json"))
    written.append("tokenizer.json")
  return written


def sample_run(out_dir: str, prompt: str, num_tokens: int, *, temperature: float = 1.0,
               seed: int = 0, devices: Optional[int] = None,
               step: Optional[int] = None) -> str:
  """Text the run's latest checkpoint writes after ``prompt`` (the tiny LM only),
  on the run's mesh or, with fewer ``devices`` than it needs, on one (`load_run`):
  ``num_tokens`` bytes, or with a token corpus ``num_tokens`` tokens encoded and
  decoded with its tokenizer (``data.tokenizer``, or ``data.tokenize``'s); an empty
  prompt then starts a document (after its end-of-document token).

  Raises:
    RunDirError: for a run of a user's model, or of tokens without a tokenizer.
  """
  run, _ = load_run(out_dir, devices, step)
  if not isinstance(run.setup.model, lm_lib.TinyLM):
    raise RunDirError(f"{out_dir}: sample writes text with the built-in tiny LM; this "
                      "run trained a user's model (model.provider)")
  params = run.setup.policy.cast_to_compute(parallel_lib.unpad(
      run.setup.to_model_order(run.state.params)))
  key = jax.random.key(seed)
  if not corpora.uses_tokens(run.cfg.data):
    return data_lib.detokenize(run.setup.model.generate(
        params, data_lib.tokenize(prompt), num_tokens, rng=key,
        temperature=temperature))
  if run.data.tokenizer is None:
    raise RunDirError(f"{out_dir}: this run's tokens have no tokenizer to write text "
                      "with; set data.tokenizer (a tokenizer.json) in its config.yaml")
  tokenizer = tokenizing.load_tokenizer(run.data.tokenizer, "data.tokenizer")
  eod = run.cfg.data.eod
  eod = tokenizing.eod_id(tokenizer, name=None) if eod is None else eod
  tokens = run.setup.model.generate(params, tokenizing.encode(tokenizer, prompt),
                                    num_tokens, rng=key, temperature=temperature,
                                    start=eod)
  return tokenizing.decode(tokenizer, tokens)


def load(out_dir: str, devices: Optional[int] = None,
         step: Optional[int] = None) -> Any:
  """The trained model of a run's latest checkpoint (or ``step``'s), in the form it
  was given:

  - a Flax NNX module: the module ``model.provider`` builds, with the trained
    parameters and model state (BatchNorm statistics) put in, in ``eval()`` mode;
  - a Flax linen module: its variables, ``{"params": ..., "batch_stats": ...}``,
    for ``module.apply(variables, x, ...)``;
  - an `mpscale.trainer.Model`: ``params``, or ``(params, model_state)`` when it has a
    state (or what its ``export`` gives);
  - the built-in tiny LM: its ``params`` (``TinyLM.generate`` takes them); with FP8
    blocks (``precision.fp8``), ``(params, model_state)``, the state their scales.

  Parameters come back in float32 (the masters). A run trained with a model passed
  from Python (not ``model.provider``) cannot be rebuilt from its folder; an NNX
  module passed to `run` is updated in place with what it trained.

  Raises:
    RunDirError: if ``out_dir`` holds no run or no checkpoint.
  """
  run_, _ = load_run(out_dir, devices, step)
  params, model_state = run_.setup.to_model_order(
      (run_.state.params, run_.state.model_state))
  state = parallel_lib.unpad(jax.device_get(
      run_.state._replace(params=params, model_state=model_state)))
  export = getattr(run_.setup.model, "export", None)
  if export is not None:
    return export(state.params, state.model_state)
  if state.model_state is not None:
    return state.params, state.model_state
  return state.params
