"""Training counted in samples through the trainer: ``train.samples``,
``schedule.warmup_samples``/``decay_samples``, Megatron's batch-size ramp-up
(``data.rampup_batch_size``), ``consumed_samples`` in metrics.csv, the summary and
the checkpoints, exact resume mid-ramp, and the step across a batch-size change.

The batch-size rule itself is checked against Megatron's in tests/trainer/data/test_batch_sizes.py."""

import csv
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpscale
import mpscale.trainer
from mpscale.trainer.config import build as builders
from mpscale.trainer.runs import checkpoints
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.data import loader
from mpscale.trainer.data import text as data_lib
from mpscale.trainer.data.batch_sizes import BatchSizes
from tests.library.optim.test_lr_schedules import megatron_lr

RAMP = {"train": {"samples": 2000}, "data": {"batch_size": 32,
                                             "rampup_batch_size": [8, 8, 480]}}
SMALL = {"model": {"d_model": 32, "num_heads": 2, "num_layers": 1, "d_ff": 64,
                   "seq_len": 16},
         "data": {"batch_size": 16, "eval_batches": 1, "rampup_batch_size": [4, 4, 96]},
         "train": {"samples": 320, "log_every": 2, "eval_every": 100,
                   "checkpoint_every": 6, "keep_checkpoints": 100},
         "schedule": {"warmup_samples": 64, "decay_samples": 320},
         "precision": {"policy": "O2"},
         "loss_scale": {"kind": "dynamic", "init_scale": 1024.0, "growth_interval": 4},
         "optimizer": {"name": "adamw", "learning_rate": 3e-3}}
"""A ramp 4, 8, 12, 16 over 96 samples (sizes change at steps 8, 12 and 15); 320
samples take 29 steps."""


def _config(raw):
  return config_lib.config_from_dict(raw, "<test>")


def _merge(base, **sections):
  return {**base, **{k: {**base.get(k, {}), **v} for k, v in sections.items()}}


def _rows(out):
  with open(os.path.join(out, "metrics.csv"), newline="") as f:
    return list(csv.DictReader(f))


# ------------------------------------------------------------------ the config


def test_train_samples_derive_the_steps():
  cfg = _config(RAMP)
  sizes = BatchSizes(32, (8, 8, 480))
  assert cfg.train.steps == sizes.steps_for(2000) == 85
  # The run ends at the first step whose samples reach train.samples.
  assert sizes.consumed_at(84) < 2000 <= sizes.consumed_at(85)
  assert _config({"train": {"samples": 100}, "data": {"batch_size": 32}}
                 ).train.steps == 4
  # An explicit count that agrees, or null (a file's count overridden), is taken.
  assert _config(_merge(RAMP, train={"steps": 85})).train.steps == 85
  assert config_lib.config_from_dict(
      {"train": {"steps": 300}}, "<test>",
      ["train.steps=null", "train.samples=2000", "data.batch_size=32",
       "data.rampup_batch_size=[8, 8, 480]"]).train.steps == 85


@pytest.mark.parametrize("raw, message", [
    (_merge(RAMP, train={"steps": 10}), "train.steps (10) disagrees with "
     "train.samples (2000), which takes 85 steps"),
    ({"train": {"steps": None}}, "train.steps is null: give train.steps or "
     "train.samples"),
    ({"data": {"rampup_batch_size": [8, 8, 480], "batch_size": 32}},
     "data.rampup_batch_size needs train.samples"),
    (_merge(RAMP, data={"rampup_batch_size": [8, 7, 480]}),
     "data.rampup_batch_size must climb from its start 8 to data.batch_size 32 in "
     "whole increments of 7"),
    (_merge(RAMP, data={"rampup_batch_size": [8, 8, 0]}),
     "data.rampup_batch_size[2] must be >= 1"),
    (_merge(RAMP, data={"rampup_batch_size": [8, 8]}),
     "data.rampup_batch_size: expected a list of 3 ints, got 2 items"),
    (_merge(RAMP, data={"rampup_batch_size": [2, 2, 480]}, mesh={"data": 4}),
     "a batch size of data.rampup_batch_size (2) is not divisible by mesh.data x "
     "mesh.fsdp (4)"),
    ({"train": {"samples": 0}}, "train.samples must be >= 1"),
    (_merge(RAMP, schedule={"warmup_steps": 5, "warmup_samples": 100}),
     "schedule.warmup_steps counts steps, but schedule.warmup_samples makes the "
     "schedule count samples"),
    (_merge(RAMP, schedule={"decay_steps": 50}),
     "schedule.decay_steps counts steps, but train.samples makes the schedule count "
     "samples: give schedule.decay_samples instead"),
    (_merge(RAMP, schedule={"warmup_fraction": 0.1, "warmup_samples": 100}),
     "give schedule.warmup_samples or schedule.warmup_fraction, not both"),
])
def test_bad_sample_keys_are_named(raw, message):
  with pytest.raises(config_lib.ConfigError, match="<test>: .*" + re.escape(message)):
    _config(raw)


def test_the_learning_rate_is_a_function_of_the_samples_consumed():
  cfg = _config(_merge(RAMP, schedule={"warmup_samples": 320, "style": "cosine",
                                       "min_lr": 1e-4}))
  schedule = builders.build_lr_schedule(cfg)
  by_samples = mpscale.lr_schedule(cfg.optimizer.learning_rate, warmup_steps=320,
                                   decay_steps=2000, style="cosine", min_lr=1e-4)
  sizes = BatchSizes(32, (8, 8, 480))
  for count in range(86):  # every step of the run, and one past it
    consumed = sizes.consumed_at(count)
    np.testing.assert_allclose(float(schedule(consumed)),
                               float(by_samples(consumed)), rtol=1e-6)
    # Megatron-LM's OptimizerParamScheduler.get_lr with num_steps = consumed samples.
    np.testing.assert_allclose(float(schedule(consumed)), megatron_lr(
        consumed, peak=cfg.optimizer.learning_rate, warmup=320, decay_steps=2000,
        style="cosine", min_lr=1e-4), rtol=1e-5)
  # The warm-up ends after 320 samples: 20 steps of 8 then 10 of 16.
  assert sizes.consumed_at(30) == 320


def _applied_lrs(cfg, steps, skipped):
  """The learning rate of each step of ``cfg``'s optimizer, stepped as the train step
  steps it (``samples=`` each step's batch size, from the samples consumed by all
  steps), the steps in ``skipped`` overflowing (their gradients NaN)."""
  opt = builders.build_optimizer(cfg)
  sizes = builders.build_batch_sizes(cfg)
  params = {"w": jnp.ones(3)}
  state = opt.init(params)
  update = jax.jit(lambda g, s, n: opt.update(g, s, params, samples=n))
  lrs = []
  for step in range(steps):
    g = jnp.full(3, jnp.nan if step in skipped else 1e-3)
    scale = mpscale.loss_scale_of(state)
    _, state = update({"w": g * scale}, state, sizes.size_at(step))
    lrs.append(float(mpscale.step_metrics(state)["learning_rate"]))
  return lrs, [sizes.size_at(s) for s in range(steps)]


def _megatron_rule(peak, warmup, decay, sizes, skipped, style="linear"):
  """Megatron-LM's scheduler as its train loop drives it: the rate of each step is
  the schedule at the samples of the steps applied before it; a skipped step does
  not step it (``update_successful`` false)."""
  applied, lrs = 0, []
  for step, size in enumerate(sizes):
    lrs.append(megatron_lr(applied, peak=peak, warmup=warmup, decay_steps=decay,
                           style=style))
    if step not in skipped:
      applied += size
  return lrs


RAMPED_SKIPS = _merge(
    RAMP, data={"batch_size": 64, "rampup_batch_size": [32, 32, 64]},
    train={"samples": 4000}, schedule={"warmup_samples": 1000, "style": "linear"},
    optimizer={"learning_rate": 1e-3}, loss_scale={"kind": "dynamic"},
    precision={"policy": "O2"})


def test_a_skipped_step_moves_no_learning_rate_during_a_ramp():
  """Issue #42's minimal case against Megatron's rule: batch 64 ramped up [32, 32,
  64], warm-up 1,000 samples, step 0 skipped. Megatron steps its scheduler by each
  *applied* step's batch size: at step 3 it has seen steps 1 (32) and 2 (64), lr
  9.6e-5 (mpscale used the first two steps' sizes, 6.4e-5). Then a run with skips
  in and after the ramp."""
  cfg = _config(RAMPED_SKIPS)
  lrs, _ = _applied_lrs(cfg, 4, {0})
  assert lrs[3] == pytest.approx(9.6e-5, rel=1e-5)
  skipped = {0, 1, 2, 5, 9, 10, 30}
  lrs, sizes = _applied_lrs(cfg, 40, skipped)
  want = _megatron_rule(1e-3, 1000, 4000, sizes, skipped)
  applied = [s for s in range(40) if s not in skipped]  # a skipped step uses none
  np.testing.assert_allclose([lrs[s] for s in applied], [want[s] for s in applied],
                             rtol=1e-5)


def test_megatron_cores_own_scheduler_agrees_on_a_ramped_run_with_skips():
  """Against Megatron-Core's own ``OptimizerParamScheduler`` and microbatch
  calculator (the optional ``megatron`` extra), driven as Megatron-LM's
  ``train_step`` drives them: the calculator sized by all consumed samples, the
  scheduler stepped by the batch size of each applied step only."""
  scheduler_lib = pytest.importorskip(
      "megatron.core.optimizer_param_scheduler",
      reason="Megatron-Core is not installed: pip install torch==2.13.0 && "
             "pip install -e '.[megatron]'")
  calculator_lib = pytest.importorskip("megatron.core.num_microbatches_calculator")
  import torch
  cfg = _config(RAMPED_SKIPS)
  skipped = {0, 1, 2, 5, 9, 10, 30}
  lrs, sizes = _applied_lrs(cfg, 40, skipped)
  optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
  scheduler = scheduler_lib.OptimizerParamScheduler(
      optimizer, init_lr=0.0, max_lr=1e-3, min_lr=0.0, lr_warmup_steps=1000,
      lr_decay_steps=4000, lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
      wd_incr_steps=4000, wd_incr_style="constant")
  calculator = calculator_lib.RampupBatchsizeNumMicroBatchesCalculator(
      64, 1, 1, False, 0, 32, 32, 64)
  consumed, want = 0, []
  for step in range(40):
    calculator.update(consumed, consistency_check=False)
    size = calculator.get_current_global_batch_size()
    assert size == sizes[step]
    want.append(optimizer.param_groups[0]["lr"])
    if step not in skipped:  # train_step: opt_param_scheduler.step(increment=size)
      scheduler.step(increment=size)
    consumed += size
  applied = [s for s in range(40) if s not in skipped]  # a skipped step uses none
  np.testing.assert_allclose([lrs[s] for s in applied], [want[s] for s in applied],
                             rtol=1e-5)


# ------------------------------------------------------------------ the loader


def test_ramped_text_batches_have_the_steps_sizes_and_split_across_processes():
  cfg = _config(RAMP)
  text = data_lib.load_data(None, 0.1)
  whole = loader.text_data(text, cfg)
  halves = [loader.text_data(text, cfg, rows) for rows in ((0, 16), (16, 32))]
  sizes = BatchSizes(32, (8, 8, 480))
  for step in (0, 19, 20, 40, 84):
    batch = whole.train[step]
    assert len(batch["inputs"]) == sizes.size_at(step) == whole.size_at(step)
    parts = [h.train[step] for h in halves]
    for key in batch:
      np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]),
                                    batch[key])
  assert whole.consumed_at(85) == sizes.consumed_at(85)
  assert whole.tokens_between(19, 21) == (8 + 16) * cfg.model.seq_len


def test_ramped_user_examples_are_read_once_each_in_order():
  """Each step takes the next size_at(step) examples of the stream; the processes'
  rows of it together are the whole batch."""
  cfg = _config(_merge(RAMP, data={"shuffle": False}))
  examples = [{"i": np.asarray(i)} for i in range(4000)]
  whole = loader.user_data(examples, cfg)
  halves = [loader.user_data(examples, cfg, rows=rows) for rows in ((0, 16), (16, 32))]
  read = np.concatenate([whole.train[s]["i"] for s in range(85)])
  np.testing.assert_array_equal(read, np.arange(whole.consumed_at(85)))
  for step in (0, 30, 84):
    np.testing.assert_array_equal(
        np.concatenate([h.train[step]["i"] for h in halves]), whole.train[step]["i"])
  # The iterator's saved state continues mid-ramp where it stood.
  it = whole.iterator()
  for _ in range(21):
    next(it)
  again = whole.iterator(it.get_state())
  np.testing.assert_array_equal(next(again)["i"], next(it)["i"])


# ------------------------------------------------------------------ the step


def test_the_step_carries_its_state_across_a_batch_size_change():
  """Loss scale, optimizer state and step count go on unchanged when the batch
  grows; the step compiles once per batch size; the per-token loss is the mean over
  the new batch's tokens."""
  traces = []

  def loss_fn(params, batch):
    traces.append(batch["x"].shape[0])
    err = (batch["x"] @ params["w"] - batch["y"]) ** 2
    return jnp.sum(err * batch["mask"]), jnp.sum(batch["mask"])

  tx = mpscale.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**10,
                                  growth_interval=3)
  init, step = mpscale.make_train_step(loss_fn, tx, policy="O2", per_token_loss=True)
  params = {"w": jnp.ones((4, 2), jnp.float32)}
  state = init(params)
  rng = np.random.default_rng(0)

  def batch(rows):
    x = rng.standard_normal((rows, 4)).astype(np.float32)
    mask = (rng.random((rows, 2)) < 0.7).astype(np.float32)
    return {"x": x, "y": np.zeros((rows, 2), np.float32), "mask": mask}

  scales, new_traces = [], []
  for rows in (4, 4, 8, 8, 8, 4):
    b, traced = batch(rows), len(traces)
    before = float(mpscale.loss_scale_of(state.opt_state))
    want = np.sum((b["x"] @ np.asarray(state.params["w"], np.float32)) ** 2
                  * b["mask"]) / np.sum(b["mask"])
    state, metrics = step(state, b)
    assert float(metrics["loss_scale"]) == before
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=2e-2)
    scales.append(float(mpscale.loss_scale_of(state.opt_state)))
    new_traces.append(len(traces) - traced)
  assert int(state.step) == 6
  assert scales == [1024.0, 1024.0, 2048.0, 2048.0, 2048.0, 4096.0]  # grows every 3
  # Traced (and compiled) at the first batch of each size only.
  assert new_traces[0] > 0 and new_traces[2] == new_traces[0]
  assert new_traces[1] == new_traces[3] == new_traces[4] == new_traces[5] == 0


# ------------------------------------------------------------------ the trainer


@pytest.fixture(scope="module")
def ramped_run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("runs") / "ramp")
  summary = mpscale.trainer.run(SMALL, out_dir=out, verbose=False, progress=False)
  return out, summary


def test_a_ramped_run_counts_its_samples_everywhere(ramped_run):
  out, summary = ramped_run
  sizes = BatchSizes(16, (4, 4, 96))
  steps = sizes.steps_for(320)
  assert summary["steps"] == steps == 29
  assert summary["consumed_samples"] == sizes.consumed_at(steps) >= 320
  rows = _rows(out)
  assert [int(r["consumed_samples"]) for r in rows] == [
      sizes.consumed_at(int(r["step"])) for r in rows]
  assert [sizes.size_at(s) for s in range(steps)] != [16] * steps  # it ramps
  ckpt = os.path.join(out, "checkpoints")
  for saved in (6, 12, 18, 24, 29):
    assert checkpoints.consumed_samples(ckpt, saved) == sizes.consumed_at(saved)
  # The loss scale carries across the size changes (steps 8, 12, 15): it moves
  # only by growth and by the backoffs of overflows, never back to its start.
  scales = np.log2([float(r["loss_scale"]) for r in rows])
  backoffs = -np.sum(np.minimum(np.diff(scales), 0))
  assert 0 < backoffs <= int(rows[-1]["overflow_total"])
  assert float(rows[-1]["loss"]) < float(rows[0]["loss"])


def test_a_ramped_run_resumes_exactly_mid_ramp(ramped_run, tmp_path):
  """A run that stops at a checkpoint inside the ramp-up (step 10, in the steps of
  size 8) and resumes ends as the uninterrupted run."""
  out, _ = ramped_run
  part = str(tmp_path / "part")
  # The same run cut short: fewer samples, the same schedule (decay_samples given).
  short = _merge(SMALL, train={"samples": BatchSizes(16, (4, 4, 96)).consumed_at(10)})
  mpscale.trainer.run(short, out_dir=part, verbose=False, progress=False)
  assert int(_rows(part)[-1]["step"]) == 10
  mpscale.trainer.run(SMALL, out_dir=part, resume=True, verbose=False,
                      progress=False)
  keys = ("step", "consumed_samples", "loss", "loss_scale", "global_norm",
          "learning_rate")
  assert [tuple(r[k] for k in keys) for r in _rows(part)] == [
      tuple(r[k] for k in keys) for r in _rows(out)]


def test_resuming_with_other_batch_sizes_is_refused_by_key(ramped_run, tmp_path):
  out, _ = ramped_run
  copy = str(tmp_path / "copy")
  shutil.copytree(out, copy)
  for step in (12, 18, 24, 29):  # resume from step 6
    shutil.rmtree(os.path.join(copy, "checkpoints", str(step)))
  other = _merge(SMALL, data={"rampup_batch_size": [8, 8, 96]})
  from mpscale.trainer.runs.loop import RunDirError  # noqa: PLC0415
  with pytest.raises(RunDirError, match=r"data.rampup_batch_size: \[4, 4, 96\] -> "
                     r"\[8, 8, 96\]"):  # against the run's config.yaml (#64 item 10)
    mpscale.trainer.run(other, out_dir=copy, resume=True, verbose=False,
                        progress=False)
  os.remove(os.path.join(copy, "config.yaml"))  # the checkpoints alone tell too
  with pytest.raises(config_lib.ConfigError,
                     match="data.rampup_batch_size: the checkpoint of step 6 .* was "
                     "trained on 24 samples, but this config's batch sizes make 48"):
    mpscale.trainer.run(other, out_dir=copy, resume=True, verbose=False,
                        progress=False)
