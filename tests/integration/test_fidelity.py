"""The fp16 fidelity study (docs/fidelity_study.py, configs/fidelity/): its premise, its
configs, its table, and a shortened run that shows the effect it reports."""

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpscale.trainer.config import load as config_lib
from mpscale.trainer.data import text as data_lib
from mpscale.trainer.models import lm
from tests.helpers import load_script

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _study():
  return load_script("docs", "fidelity_study.py")


def test_every_config_is_in_the_study_and_loads():
  study = _study()
  files = {os.path.basename(p)[:-5]
           for p in glob.glob(os.path.join(study.CONFIGS, "*.yaml"))}
  assert files == {run for run, _ in study.STUDY}
  for run in files:
    cfg = config_lib.load_config(os.path.join(study.CONFIGS, f"{run}.yaml"))
    assert cfg.name == run
    assert cfg.data.batch_size * cfg.model.seq_len == study.TOKENS
    assert not cfg.train.per_token_loss  # the mean loss is the premise


def test_a_scale_on_n_tokens_is_the_scale_times_k_on_k_n_tokens():
  """The study's premise, exactly: the float16 gradient at every logit of a mean over
  2048 tokens scaled by 1/8 equals, bit for bit, that of the same tokens repeated 8
  times (a mean over 16384) at scale 1."""
  cfg = config_lib.ModelConfig()
  model = lm.TinyLM.from_sizes(cfg)
  params = jax.jit(model.init)(jax.random.key(0))  # one program, not op by op
  batch = {k: jnp.asarray(v) for k, v in
           data_lib.load_data().train_batch(0, 0, 32, cfg.seq_len).items()}
  assert batch["targets"].size == 2048
  half = jax.tree_util.tree_map(lambda x: x.astype(jnp.float16), params)
  logits = jax.jit(lambda p, b: model.logits_fn(p, model.hidden_fn(p, b)))(
      half, batch).astype(jnp.float16)

  def logit_grads(logits, targets, scale):
    def loss(z):
      total, count = lm.cross_entropy_sum(z, targets, jnp.ones(targets.shape))
      return scale * total / count
    return jax.grad(loss)(logits)

  small = logit_grads(logits, batch["targets"], 1 / 8)
  big = logit_grads(jnp.tile(logits, (8, 1, 1)), jnp.tile(batch["targets"], (8, 1)), 1.0)
  assert small.dtype == big.dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(big[:32]), np.asarray(small))
  # The study's setting: scale 1/256 on 2048 tokens (1 on 0.5M) flushes the gradients
  # of the untrained model's near-uniform logits, scale 1 on 2048 tokens does not.
  flushed = lambda scale: float(jnp.mean(logit_grads(logits, batch["targets"], scale) == 0))
  assert flushed(1 / 256) > 0.9 and flushed(1.0) == 0


def _records(evals):
  return {run: [{"final_eval_loss": e, "policy": "O2", "optimizer": "came",
                 "loss_scale": "none", "skipped": i, "steps": 10, "final_scale": 1.0}
                for i, e in enumerate(values)] for run, values in evals.items()}


def test_the_table_reports_mean_spread_and_the_gap_to_fp32():
  study = _study()
  rows = {r["run"]: r for r in study.table(_records(
      {"fp32": [2.0, 2.2, 2.1], "fp16_noscale": [3.0, 3.3, 3.6]}))}
  assert rows["fp32"]["mean"] == pytest.approx(2.1)
  assert rows["fp16_noscale"]["spread"] == pytest.approx(0.6)
  assert rows["fp16_noscale"]["vs_fp32"] == pytest.approx(3.3 / 2.1 - 1)
  assert rows["fp16_noscale"]["skipped"] == pytest.approx(1.0)
  assert rows["fp16_noscale"]["group"] == "(b) O2 at 0.5M tokens"


def _no_plots(monkeypatch):
  """The runs' and comparison's PNGs are drawn by matplotlib (about a quarter of a
  shortened run's time here); these tests read the runs' logs and summaries only."""
  from mpscale.trainer.runs import compare, loop
  for module in (compare, loop):
    monkeypatch.setattr(module, "plot_runs", lambda *args, **kwargs: None)


@pytest.mark.slow
@pytest.mark.extended  # 3 seeds x 2 runs, ~50 s: a study's reproduction
def test_without_scaling_fp16_trains_worse_by_more_than_the_seed_spread(tmp_path,
                                                                        monkeypatch):
  """A shortened experiment (b): 20 steps, seeds 0-2, with and without the dynamic
  scale, where the per-token gradients are those of a 0.5M-token mean (at 20 steps
  no-scaling is already about 0.45 nats behind, against a spread of about 0.13)."""
  from mpscale.trainer.runs.compare import compare
  _no_plots(monkeypatch)
  study = _study()
  runs, seeds = ["fp16_noscale", "fp16_dynamic"], [0, 1, 2]
  for seed in seeds:  # what study.run_seed runs, in this process (its compile cache)
    compare([os.path.join(study.CONFIGS, f"{r}.yaml") for r in runs],
            str(tmp_path / f"seed{seed}"), overrides=[f"seed={seed}", "train.steps=20"],
            progress=False, verbose=False)
  rows = {r["run"]: r for r in study.table(study.collect(str(tmp_path), seeds, runs))}
  gap = rows["fp16_noscale"]["mean"] - rows["fp16_dynamic"]["mean"]
  spread = max(rows[r]["spread"] for r in runs)
  assert gap > spread, rows
  assert rows["fp16_dynamic"]["skipped"] == 0
