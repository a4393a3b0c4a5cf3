"""A catalogue of bad input: every public constructor and every config key.

Each bad value must raise a ValueError or TypeError naming the culprit when the object
is built (or the config loaded), before any training step.
"""

import os

import optax
import pytest

import mpscale
from mpscale.trainer.config import load as config_lib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CONFIG = os.path.join(ROOT, "configs", "tiny_lm_fp16.yaml")
sgd = optax.sgd(0.1)
embed, stage, head = (lambda p, b: b), (lambda lp, x: x), (lambda p, x, b: 0.0)

CATALOGUE = [
    # (builder, bad kwargs, exception, name the message must contain)
    (mpscale.dynamic_loss_scale, dict(inner=sgd, init_scale=-1.0), ValueError, "init_scale"),
    (mpscale.dynamic_loss_scale, dict(inner=sgd, growth_factor=1.0), ValueError, "growth_factor"),
    (mpscale.dynamic_loss_scale, dict(inner=sgd, backoff_factor=1.5), ValueError, "backoff_factor"),
    (mpscale.dynamic_loss_scale, dict(inner=sgd, growth_interval=0), ValueError, "growth_interval"),
    (mpscale.dynamic_loss_scale, dict(inner=sgd, hysteresis=0), ValueError, "hysteresis"),
    (mpscale.dynamic_loss_scale, dict(inner=sgd, min_scale=8.0, max_scale=4.0, init_scale=4.0), ValueError, "min_scale"),
    (mpscale.dynamic_loss_scale, dict(inner="adam"), TypeError, "inner"),
    (mpscale.fixed_loss_scale, dict(inner=sgd, scale=0.0), ValueError, "scale"),
    (mpscale.fixed_loss_scale, dict(inner=sgd, scale=2.0, skip_nonfinite=None), TypeError, "skip_nonfinite"),
    (mpscale.no_loss_scale, dict(inner=None), TypeError, "inner"),
    (mpscale.skip_nonfinite, dict(inner=sgd, norm_groups=0), ValueError, "norm_groups"),
    (mpscale.global_norm_clip, dict(max_norm=0.0), ValueError, "max_norm"),
    (mpscale.global_norm_clip, dict(max_norm="1"), TypeError, "max_norm"),
    (mpscale.came, dict(learning_rate=None), ValueError, "learning_rate"),
    (mpscale.came, dict(learning_rate=1e-3, beta1=1.5), ValueError, "beta1"),
    (mpscale.came, dict(learning_rate=1e-3, beta3=-0.1), ValueError, "beta3"),
    (mpscale.came, dict(learning_rate=1e-3, decay_rate=2.0), ValueError, "decay_rate"),
    (mpscale.came, dict(learning_rate=1e-3, weight_decay=1.5), ValueError, "weight_decay"),
    (mpscale.came, dict(learning_rate=1e-3, eps=(1e-30, 1e-3)), ValueError, "eps"),
    (mpscale.came, dict(learning_rate=1e-3, loss_scale=0.0), ValueError, "loss_scale"),
    (mpscale.came, dict(learning_rate=1e-3, clip_threshold=0.0), ValueError, "clip_threshold"),
    (mpscale.lr_schedule, dict(peak=-1.0, decay_steps=10), ValueError, "peak"),
    (mpscale.lr_schedule, dict(peak=1.0, decay_steps=10, style="step"), ValueError, "style"),
    (mpscale.weight_decay_schedule, dict(start=0.1, end=0.0, steps=0), ValueError, "steps"),
    (mpscale.make_policy, dict(policy="O9"), ValueError, "O9"),
    (mpscale.Policy, dict(param_dtype="float17"), (TypeError, ValueError), "float17"),
    (mpscale.make_train_step, dict(loss_fn=3, optimizer=sgd), TypeError, "loss_fn"),
    (mpscale.make_train_step, dict(loss_fn=lambda p, b: 0.0, optimizer="sgd"), TypeError, "optimizer"),
    (mpscale.make_train_step, dict(loss_fn=lambda p, b: 0.0, optimizer=sgd, num_microbatches=0), ValueError, "num_microbatches"),
    (mpscale.make_train_step, dict(loss_fn=lambda p, b: 0.0, optimizer=sgd, shard_optimizer_state=True), ValueError, "shard_optimizer_state"),
    (mpscale.stochastic_rounding, dict(seed="0"), TypeError, "seed"),
    (mpscale.stochastic_rounding, dict(seed=-1), ValueError, "seed"),
    (mpscale.stochastic_round, dict(x=1.0, dtype="float32", key=None), ValueError, "dtype"),
    (mpscale.Pipeline, dict(embed_fn=embed, stage_fn=stage, head_fn=head, num_microbatches=0), ValueError, "num_microbatches"),
    (mpscale.Pipeline, dict(embed_fn=embed, stage_fn=stage, head_fn=head, num_microbatches=2, schedule="interleaved"), ValueError, "schedule"),
    (mpscale.Pipeline, dict(embed_fn=embed, stage_fn=stage, head_fn=head, num_microbatches=2, remat="yes"), TypeError, "remat"),
]


@pytest.mark.parametrize("builder, kwargs, exc, name", CATALOGUE,
                         ids=[f"{b.__name__}-{n}" for b, _, _, n in CATALOGUE])
def test_public_constructors_reject_bad_input_by_name(builder, kwargs, exc, name):
  args = []
  if builder is mpscale.make_policy:
    args, kwargs = [kwargs["policy"]], {}
  with pytest.raises(exc, match=name):
    builder(*args, **kwargs)


def _leaf_keys(tree, prefix=()):
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      yield from _leaf_keys(value, prefix + (key,))
    else:
      yield ".".join(prefix + (key,))


BASE = config_lib.to_dict(config_lib.load_config(CONFIG))
FREE_FORM = ("model.args", "data.args")
"""Settings for a user's providers: any mapping is right, anything else is not."""
CONFIG_KEYS = sorted(k for k in _leaf_keys(BASE) if k not in FREE_FORM)
SECTIONS = sorted({k.split(".")[0] for k in CONFIG_KEYS if "." in k})


@pytest.mark.parametrize("key", CONFIG_KEYS)
def test_every_config_key_rejects_a_wrong_type_naming_key_and_file(key):
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.load_config(CONFIG, [f"{key}={{bogus: 1}}"])
  assert key in str(err.value) and "tiny_lm_fp16.yaml" in str(err.value)


@pytest.mark.parametrize("key", FREE_FORM)
def test_free_form_config_keys_take_a_mapping_only(key):
  assert key in _leaf_keys(BASE)
  cfg = config_lib.load_config(CONFIG, [f"{key}={{width: 1}}"])
  assert config_lib.to_dict(cfg)[key.split(".")[0]]["args"] == {"width": 1}
  with pytest.raises(config_lib.ConfigTypeError, match=f"{key}: expected a mapping"):
    config_lib.load_config(CONFIG, [f"{key}=3"])


@pytest.mark.parametrize("section", SECTIONS)
def test_every_config_section_rejects_an_unknown_key(section):
  with pytest.raises(config_lib.ConfigError, match=f"{section}.no_such_key"):
    config_lib.load_config(CONFIG, [f"{section}.no_such_key=1"])


@pytest.mark.parametrize("override, key", [
    ("train.steps=-5", "train.steps"), ("model.num_layers=3", "mesh"),
    ("loss_scale.backoff_factor=2.0", "loss_scale.backoff_factor"),
    ("optimizer.name=sgd", "optimizer.name"), ("precision.policy=O7", "precision.policy"),
    ("precision.update_rounding=floor", "precision.update_rounding"),
    ("precision.fp8.recipe=fast", "precision.fp8.recipe"),
])
def test_impossible_config_values_name_their_key(override, key):
  overrides = [override]
  if key == "mesh":  # 3 layers cannot split over 2 stages
    overrides += ["mesh.stage=2"]
  with pytest.raises(config_lib.ConfigError, match=key.split(".")[0]):
    config_lib.load_config(CONFIG, overrides)
