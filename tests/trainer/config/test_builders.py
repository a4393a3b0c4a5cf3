"""The trainer's builders (mpscale.trainer.config.build): config to optimizer and step."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpscale
from mpscale.optim._came import relative_step_size
from mpscale.trainer.config import build as builders
from mpscale.trainer.config import errors
from mpscale.trainer.config import load as config_lib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
SMALL = {"model": {"d_model": 32, "num_heads": 2, "num_layers": 1, "d_ff": 64,
                   "seq_len": 16},
         "data": {"batch_size": 4}, "train": {"steps": 10},
         "schedule": {"warmup_steps": 1}}


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_float16_parameters_keep_float32_hyperparameters(name):
  """With float16 parameters (policy O3), optax.inject_hyperparams would store eps in
  float16, where AdamW's 1e-8 is 0: a parameter with a zero gradient (an unused
  embedding row) then became 0/0 = NaN after the first step."""
  cfg = config_lib.config_from_dict({**SMALL, "precision": {"policy": "O3"},
                                     "loss_scale": {"kind": "dynamic", "init_scale": 16.0},
                                     "optimizer": {"name": name}})
  setup = builders.build(cfg)
  state = setup.init(setup.init_params())
  hyper = [x for path, x in jax.tree_util.tree_leaves_with_path(state.opt_state)
           if "hyperparams" in jax.tree_util.keystr(path)
           and jnp.issubdtype(x.dtype, jnp.floating)]
  assert hyper and all(x.dtype == jnp.float32 for x in hyper)
  if name != "adamw":
    return  # Adafactor's own float16 arithmetic is not this test's subject
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 8, (4, 17)).astype(np.int32)  # 248 of 256 rows unused
  batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
           "mask": jnp.ones((4, 16), jnp.float32)}
  for _ in range(2):
    state, metrics = setup.step(state, batch)
    assert not bool(metrics["overflow"])
  assert state.params["embed"]["token"].dtype == jnp.float16
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(state.params))


@pytest.mark.parametrize("override, names", [
    ({"loss_scale": {"kind": "dynamic", "backoff_factor": 2.0}},
     ("loss_scale.backoff_factor",)),
    ({"loss_scale": {"kind": "dynamic", "min_scale": 8.0, "max_scale": 4.0}},
     ("loss_scale.min_scale", "loss_scale.max_scale")),
    ({"loss_scale": {"kind": "fixed", "init_scale": 0.0}}, ("loss_scale.init_scale",)),
    ({"optimizer": {"name": "came", "came": {"eps": [1e-30, -1.0, 1e-16]}}},
     ("optimizer.came.eps[1]",)),
    ({"optimizer": {"name": "came", "came": {"relative_step": True}}},
     ("optimizer.learning_rate", "optimizer.came.relative_step")),
    ({"schedule": {"warmup_steps": 10}}, ("schedule.warmup_steps", "train.steps")),
    ({"model": {"d_model": 30, "num_heads": 4}}, ("model.d_model", "model.num_heads")),
    ({"precision": {"policy": "O7"}}, ("precision.policy",)),
])
def test_builder_errors_carry_the_config_keys(override, names):
  raw = {**SMALL, **override, "model": {**SMALL["model"], **override.get("model", {})}}
  cfg, _ = config_lib.read_config(raw)  # typed, values unchecked
  with pytest.raises(mpscale.ArgumentError) as err:
    builders.check(cfg)
  assert err.value.names == names
  assert str(err.value).startswith(names[0])


def test_keyed_renames_names_and_leaves_the_text_alone():
  def bad():
    raise mpscale.ArgumentError(("a", "b"), "{0} must be < {1}; a and b are sizes")
  with pytest.raises(mpscale.ArgumentError) as err:
    errors.keyed("section", bad, {"a": "s.a", "b": "t.b"})
  assert str(err.value) == "s.a must be < t.b; a and b are sizes"
  # An error the table does not know, or one without names, gets the section.
  with pytest.raises(mpscale.ArgumentTypeError) as err:
    errors.keyed("section", lambda: (_ for _ in ()).throw(TypeError("oops")), {})
  assert err.value.names == ("section",) and str(err.value) == "section: oops"


@pytest.mark.parametrize("rounding, kind", [
    ("nearest", None), ("stochastic", mpscale.StochasticRoundingState),
    ("kahan", mpscale.KahanSummationState)])
def test_update_rounding_ends_the_optimizer_chain_inside_the_skip(rounding, kind):
  cfg = config_lib.config_from_dict({**SMALL, "precision": {
      "policy": "bf16-pure", "update_rounding": rounding}})
  state = builders.build_optimizer(cfg).init({"w": jnp.ones((4, 4), jnp.bfloat16)})
  chain = state.skip_state.inner_state  # no_loss_scale(chain(clip, chain(opt, ..)))
  found = [s for s in (mpscale.StochasticRoundingState, mpscale.KahanSummationState)
           if mpscale._tree.find(state, s)]
  assert found == ([] if kind is None else [kind])
  if kind is not None:
    assert isinstance(chain[-1][-1], kind)


def test_a_bad_update_rounding_is_refused_by_key():
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.config_from_dict({**SMALL, "precision": {"update_rounding": "floor"}})
  assert err.value.keys[0] == "precision.update_rounding"
  assert "'stochastic'" in str(err.value)
  cfg = config_lib.config_from_dict(SMALL)  # built in Python, past the loader
  cfg = dataclasses.replace(cfg, precision=dataclasses.replace(
      cfg.precision, update_rounding="floor"))
  with pytest.raises(mpscale.ArgumentError) as err:
    builders.check(cfg)
  assert err.value.names == ("precision.update_rounding",)
  assert str(err.value).startswith("precision.update_rounding must be one of")


def test_bf16_pure_with_stochastic_rounding_trains_with_its_state_in_bfloat16():
  """``bf16-pure``: bfloat16 parameters and AdamW state (its first moment too: left to
  optax it turned float32 at the first step), updates landing by stochastic rounding."""
  cfg = config_lib.config_from_dict({
      **SMALL, "precision": {"policy": "bf16-pure", "update_rounding": "stochastic"},
      "optimizer": {"name": "adamw", "learning_rate": 1e-2}})
  setup = builders.build(cfg)
  state = setup.init(setup.init_params())
  dtypes = lambda s: [x.dtype for x in jax.tree_util.tree_leaves(s)]
  before = dtypes(state)
  adam = mpscale._tree.find(state.opt_state, optax.ScaleByAdamState)[0]
  assert {x.dtype for x in jax.tree_util.tree_leaves((adam.mu, adam.nu))} == {
      jnp.dtype(jnp.bfloat16)}
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 8, (4, 17)).astype(np.int32))
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "mask": jnp.ones((4, 16), jnp.float32)}
  losses = []
  for _ in range(4):
    state, metrics = setup.step(state, batch)
    losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  assert dtypes(state) == before
  rounding = mpscale._tree.find(state.opt_state, mpscale.StochasticRoundingState)
  assert int(rounding[0].count) == 4


@pytest.mark.parametrize("max_norm, clipped", [(0.0, False), (None, False),
                                               (1.0, True)])
def test_clip_max_norm_zero_or_null_means_no_clipping(max_norm, clipped):
  cfg = config_lib.config_from_dict({**SMALL, "clip": {"max_norm": max_norm}})
  params = {"w": jnp.ones((4, 4))}
  state = builders.build_optimizer(cfg).init(params)
  found = [x for x in jax.tree_util.tree_leaves(
      state, is_leaf=lambda x: isinstance(x, mpscale.GlobalNormClipState))
           if isinstance(x, mpscale.GlobalNormClipState)]
  assert bool(found) == clipped


def test_came_without_a_learning_rate_takes_its_relative_step_from_the_config():
  came = {"relative_step": True, "warmup_init": True}
  cfg = config_lib.config_from_dict({**SMALL, "optimizer": {
      "name": "came", "learning_rate": None, "came": came}})
  setup = builders.build(cfg)
  state = setup.init(setup.init_params())
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, (4, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "mask": np.ones((4, 16), np.float32)}
  before = np.array(state.params["head"]["out"]["kernel"])  # the step donates
  for count in range(3):
    state, metrics = setup.step(state, batch)
    want = relative_step_size(count, warmup_init=True)
    np.testing.assert_allclose(metrics["learning_rate"], want, rtol=1e-6)
  assert not np.allclose(state.params["head"]["out"]["kernel"], before)
  # Every other optimizer needs a learning rate; CAME with one refuses relative_step.
  with pytest.raises(config_lib.ConfigError, match="optimizer.learning_rate is null"):
    config_lib.config_from_dict({**SMALL, "optimizer": {"learning_rate": None}})
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.config_from_dict({**SMALL, "optimizer": {"name": "came", "came": came}})
  assert err.value.keys == ("optimizer.learning_rate", "optimizer.came.relative_step")


def test_came_stack_layers_from_the_config_trains_as_leaf_by_leaf():
  # The larger eps keep the key bias's zero gradient (rounding noise) from deciding
  # its update's sign (tests/library/parallel/test_layouts.py says more).
  opt = {"name": "came", "learning_rate": 1e-2}
  states = [_train(config_lib.config_from_dict({**SMALL, "optimizer": {
      **opt, "came": {"stack_layers": stacked, "eps": [1e-8, 1e-3, 1e-6]}}}))[0]
            for stacked in (False, True)]
  (came_state,) = [x for x in jax.tree_util.tree_leaves(
      states[1].opt_state, is_leaf=lambda x: isinstance(x, mpscale.ScaleByCameState))
                   if isinstance(x, mpscale.ScaleByCameState)]
  assert isinstance(came_state.mu, mpscale.Stacks)
  for a, b in zip(jax.tree_util.tree_leaves(states[0].params),
                  jax.tree_util.tree_leaves(states[1].params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)  # a step is ~1e-2
  with pytest.raises(config_lib.ConfigError, match="optimizer.came.stack_layers"):
    config_lib.config_from_dict({**SMALL, "optimizer": {
        **opt, "came": {"stack_layers": "yes"}}})
  # A pipeline stores its layers in device order, which stacks by role do not follow.
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.config_from_dict({**SMALL, "model": {**SMALL["model"], "num_layers": 2},
                                 "mesh": {"stage": 2}, "optimizer": {
                                     **opt, "came": {"stack_layers": True}}})
  assert err.value.keys == ("optimizer.came.stack_layers", "mesh.stage")


def _batch(seed=0):
  tokens = np.random.default_rng(seed).integers(0, 256, (4, 17)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "mask": np.ones((4, 16), np.float32)}


def _train(cfg, steps=3):
  setup = builders.build(cfg)
  state = setup.init(setup.init_params())
  for step in range(steps):
    state, metrics = setup.step(state, _batch(step))
  return state, metrics


@pytest.mark.parametrize("name", ["came", "adamw", "adafactor"])
def test_config_groups_do_what_the_weight_decay_mask_does(name):
  """A group of the biases and norm scales with weight decay 0 under the mask "all"
  is the mask "matrices": the same parameters, bit for bit."""
  opt = {"name": name, "weight_decay": 0.5, "learning_rate": 1e-2}
  masked = config_lib.config_from_dict({**SMALL, "optimizer": {
      **opt, "weight_decay_mask": "matrices"}})
  grouped = config_lib.config_from_dict({**SMALL, "optimizer": {
      **opt, "weight_decay_mask": "all",
      "groups": [{"match": "(bias|scale)$", "weight_decay": 0.0, "name": "no_decay"}]}})
  steps = 1 if name == "adafactor" else 3
  want, _ = _train(masked, steps)
  got, metrics = _train(grouped, steps)
  if name == "adafactor":
    # The same arithmetic, compiled in other fusions: XLA's CPU code for a leaf may
    # differ in its last bit, which Adafactor's update clipping (by the RMS of an
    # update near 0, a bias's) grows from the second step on. One step, to 1e-6.
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
        got.params, want.params)
  else:
    jax.tree_util.tree_map(np.testing.assert_array_equal, got.params, want.params)
  found = mpscale._tree.find(got.opt_state, mpscale.ParamGroupsState)
  assert set(found[0].inner_states) == {"default", "no_decay"}
  assert set(metrics["group_learning_rates"]) == {"no_decay"}
  # Without the group, "all" decays the norm scales too: a different result (two
  # steps for Adafactor, whose first decays them by less than allclose sees).
  decayed = config_lib.config_from_dict({**SMALL, "optimizer": {
      **opt, "weight_decay_mask": "all"}})
  if name == "adafactor":
    got, _ = _train(grouped, 2)
  other, _ = _train(decayed, max(steps, 2))
  assert not np.allclose(other.params["stages"]["ln_mlp"]["scale"],
                         got.params["stages"]["ln_mlp"]["scale"])


def test_config_group_lr_mult_scales_and_freezes():
  cfg = config_lib.config_from_dict({**SMALL, "optimizer": {
      "name": "adamw", "learning_rate": 1e-2,
      "groups": [{"match": "^embed/", "lr_mult": 0.0, "name": "embed"},
                 {"match": "^head/", "lr_mult": 0.5, "name": "head"}]}})
  setup = builders.build(cfg)
  state = setup.init(setup.init_params())
  before = jax.device_get(state.params)
  schedule = builders.build_lr_schedule(cfg)
  for step in range(3):
    state, metrics = setup.step(state, _batch(step))
    np.testing.assert_allclose(metrics["group_learning_rates"]["head"],
                               0.5 * schedule(step), rtol=1e-6)
    assert float(metrics["group_learning_rates"]["embed"]) == 0.0
  jax.tree_util.tree_map(np.testing.assert_array_equal, state.params["embed"],
                         before["embed"])
  assert not np.allclose(state.params["head"]["out"]["kernel"],
                         before["head"]["out"]["kernel"])


@pytest.mark.parametrize("groups, key", [
    ([{"match": "^encoder/"}], "optimizer.groups[0].match"),
    ([{"match": "bias"}, {"match": "fc/bias"}], "optimizer.groups[1].match"),
    ([{"lr_mult": 0.5}], "optimizer.groups[0].match"),
    ([{"match": "bias", "lr_mult": -1.0}], "optimizer.groups[0].lr_mult"),
    ([{"match": "bias", "name": "default"}], "optimizer.groups[0].name"),
    ([{"match": "bias", "weight_decay": 2.0}], "optimizer.groups[0].weight_decay"),
])
def test_bad_config_groups_name_their_key(groups, key):
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.config_from_dict({**SMALL, "optimizer": {"name": "came",
                                                        "groups": groups}})
  assert err.value.keys[0] == key, str(err.value)
  assert key in str(err.value)


def test_skip_spikes_goes_inside_the_loss_scale_and_outside_the_clip():
  cfg = config_lib.config_from_dict({
      **SMALL, "loss_scale": {"kind": "dynamic", "init_scale": 16.0},
      "skip": {"spikes": {"window": 16, "watch": ["loss"]}}})
  tx, params = builders.build_optimizer(cfg), {"w": jnp.ones((4, 4))}
  state = tx.init(params)
  spikes = state.skip_state.inner_state  # dynamic_loss_scale(skip_spikes(...))
  assert isinstance(spikes, mpscale.SkipSpikesState) and spikes.losses.shape == (16,)
  assert mpscale._tree.find(spikes.inner_state, mpscale.GlobalNormClipState)
  _, state = tx.update(params, state, params, loss=jnp.float32(2.0))
  metrics = mpscale.step_metrics(state)
  assert not bool(metrics["spike"]) and int(metrics["spikes"]) == 0
  np.testing.assert_array_equal(state.skip_state.inner_state.losses[:2], [2.0, 0.0])
  # Off by default: no state, no metrics.
  state = builders.build_optimizer(config_lib.config_from_dict(SMALL)).init(
      {"w": jnp.ones((4, 4))})
  assert not mpscale._tree.find(state, mpscale.SkipSpikesState)


@pytest.mark.parametrize("spikes, key", [
    ({"window": 1}, "skip.spikes.window"),
    ({"window": 8, "warmup": 9}, "skip.spikes.warmup"),
    ({"threshold": 0.0}, "skip.spikes.threshold"),
    ({"watch": []}, "skip.spikes.watch"),
    ({"watch": ["loss", "norm"]}, "skip.spikes.watch[1]"),
    ({"reset_after": 0}, "skip.spikes.reset_after"),
    ({"window": "big"}, "skip.spikes.window"),
])
def test_bad_skip_spikes_values_name_their_key(spikes, key):
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.config_from_dict({**SMALL, "skip": {"spikes": spikes}})
  assert err.value.keys[0] == key, str(err.value)
  assert key in str(err.value)


def test_skip_spikes_reads_from_yaml_with_defaults(tmp_path):
  path = tmp_path / "run.yaml"
  path.write_text("skip:\n  spikes: {watch: [global_norm]}\n")
  cfg = config_lib.load_config(str(path))
  assert cfg.skip.spikes.watch == ("global_norm",) and cfg.skip.spikes.window == 128
  assert config_lib.load_config(str(path), ["skip.spikes=null"]).skip.spikes is None


# ------------------------------------------------------------------ one path
def test_the_check_is_the_build_on_shapes(monkeypatch):
  """Loading a config builds its train step once, on an abstract mesh of the
  config's sizes (no devices, nothing allocated); `build` builds the same step on
  devices. One sequence: a rule only the step's builder knows is a config error."""
  seen = []
  real = mpscale.step.make_train_step

  def recording(*args, **kwargs):
    seen.append(kwargs["mesh"])
    return real(*args, **kwargs)

  monkeypatch.setattr(mpscale.step, "make_train_step", recording)
  raw = {**SMALL, "mesh": {"data": 2, "fsdp": 2}}
  cfg = config_lib.config_from_dict(raw)
  assert len(seen) == 1
  assert isinstance(seen[0], jax.sharding.AbstractMesh)
  assert dict(seen[0].shape) == {"data": 2, "fsdp": 2}
  builders.build(cfg, jax.devices()[:4])
  assert isinstance(seen[1], jax.sharding.Mesh)
  assert dict(seen[1].shape) == dict(seen[0].shape)
  # The step's own rule (a model state with float32 gradient sums), found at load.
  monkeypatch.setattr(mpscale.step, "make_train_step",
                      lambda *a, **k: (_ for _ in ()).throw(ValueError("nope")))
  with pytest.raises(config_lib.ConfigError, match=r"^<dict>: train: nope") as err:
    config_lib.config_from_dict(raw)
  assert err.value.keys == ("train",)


def test_building_a_config_of_a_users_model_needs_the_model():
  cfg = config_lib.config_from_dict({**SMALL, "model": {
      "provider": "examples/digits_cnn/model.py:build", "loss": "examples/digits_cnn/model.py:loss"}},
      base_dir=ROOT)
  with pytest.raises(ValueError, match="model.provider names a user's model"):
    builders.build(cfg)


def test_data_path_is_checked_with_the_rest_of_the_config(tmp_path):
  """``--data`` (``load_config(data_path=)``) replaces ``data.path`` before the one
  check, so its conflicts are config errors at load, not at the first batch."""
  tokens = tmp_path / "t.bin"
  np.arange(100, dtype=np.uint16).tofile(tokens)
  path = tmp_path / "run.yaml"
  path.write_text(f"data:\n  tokens: {tokens}\n  token_dtype: uint16\n  eod: 0\n")
  config_lib.load_config(path)
  with pytest.raises(config_lib.ConfigError, match="exclusive") as err:
    config_lib.load_config(path, data_path=str(tmp_path / "text.txt"))
  assert set(err.value.keys) == {"data.tokens", "data.path"}


def test_attention_is_chosen_for_the_devices_the_model_runs_on():
  """``model.attention``: ``auto`` on CPU devices is XLA's; ``cudnn`` loads (a config
  checked on shapes may be meant for GPUs, e.g. to plan on one) and is refused, by
  key, where the model is built on devices that cannot run it."""
  auto = config_lib.config_from_dict({**SMALL, "precision": {"policy": "bf16"}})
  assert builders.build_model(auto).attention == "xla"
  fused = config_lib.config_from_dict({**SMALL, "precision": {"policy": "bf16"},
                                       "model": {"attention": "cudnn"}})
  assert builders.build_model(fused, devices=()).attention == "xla"  # no device known
  with pytest.raises(ValueError, match=r"^model.attention: cuDNN's fused attention "
                     "cannot run here: it runs on NVIDIA GPUs") as err:
    builders.build(fused)
  assert err.value.name == "model.attention"
  with pytest.raises(config_lib.ConfigError, match="model.attention: expected one of"):
    config_lib.config_from_dict({**SMALL, "model": {"attention": "flash"}})


# ------------------------------------------------------------------ precision.fp8
FP8_RUN = {"model": {"d_model": 32, "num_heads": 2, "num_layers": 4, "d_ff": 64,
                     "seq_len": 32},
           "data": {"batch_size": 8, "eval_batches": 1},
           "train": {"steps": 20, "log_every": 1, "eval_every": 20,
                     "checkpoint_every": 20},
           "schedule": {"warmup_steps": 2},
           "optimizer": {"name": "adamw", "learning_rate": 3e-3}}


def _fp8_config(recipe, **fp8):
  return {**FP8_RUN, "precision": {"policy": "bf16", "fp8": {
      "recipe": recipe, "history_len": 16, **fp8}}}


def _losses(out):
  import csv
  with open(os.path.join(out, "metrics.csv"), newline="") as f:
    return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory):
  import mpscale.trainer
  out = str(tmp_path_factory.mktemp("bf16"))
  mpscale.trainer.run(_fp8_config(None), out_dir=out, verbose=False, progress=False)
  return _losses(out)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_the_tiny_lm_trains_with_fp8_blocks_near_bf16(recipe, bf16_losses, tmp_path):
  """20 steps on the built-in corpus: finite, falling, and within a loose bound of
  bf16's losses (how close FP8 stays is the fidelity study's question, not this
  test's); the state holds the two FP8 blocks' histories, a step an entry."""
  import mpscale.trainer
  summary = mpscale.trainer.run(_fp8_config(recipe), out_dir=str(tmp_path),
                                verbose=False, progress=False)
  losses = _losses(str(tmp_path))
  assert len(losses) == 20 and np.all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3
  np.testing.assert_allclose(losses, bf16_losses, rtol=0.05)
  assert np.isfinite(summary["final_eval_loss"])
  _, state = mpscale.trainer.load(str(tmp_path))
  stages = state["_overwrite_with_gradient"]["stages"]
  assert set(stages) == {"qkv", "out", "fc", "proj"}
  for meta in jax.tree_util.tree_leaves(
      stages, is_leaf=lambda x: isinstance(x, mpscale.Fp8Meta)):
    assert meta.amax_history.shape == (4, 16)  # 4 layers, 1 bf16 at each end
    assert np.count_nonzero(meta.amax_history, axis=1).tolist() == [0, 16, 16, 0]


def test_fp8_under_float16_compute_trains_near_bf16(bf16_losses, tmp_path):
  """O2 (float16 compute) with delayed scaling and the dynamic loss scale: the FP8
  products accumulate and scale in float32 before their float16 result, so nothing
  overflows (an unscaled float16 product did, from the second step on)."""
  import mpscale.trainer
  cfg = _fp8_config("delayed")
  cfg["precision"]["policy"] = "O2"
  cfg["loss_scale"] = {"kind": "dynamic"}
  mpscale.trainer.run(cfg, out_dir=str(tmp_path), verbose=False, progress=False)
  losses = _losses(str(tmp_path))
  assert len(losses) == 20 and np.all(np.isfinite(losses))
  np.testing.assert_allclose(losses, bf16_losses, rtol=0.05)


@pytest.mark.slow  # over 5 s on 2 cores: the quick loop skips it
def test_fp8_under_a_pipeline_trains_as_the_unpipelined_run(tmp_path):
  """The tiny LM's FP8 blocks over 2 stages x 2 data replicas (interleaved 1F1B, the
  blocks and their states stored in device order, float32 gradient sums): the
  losses and the FP8 state of the unpipelined run with the same micro-batches'
  whole batch (its state merged over micro-batches and replicas, as one call on
  the batch records it)."""
  import mpscale.trainer
  runs = {}
  for name, extra in (("plain", {}), ("pipelined", {
      "mesh": {"stage": 2, "data": 2, "pipeline_schedule": "1f1b",
               "virtual_stages": 2},
      "train": {"num_microbatches": 2}})):
    cfg = _fp8_config("delayed")
    # No evaluation (not compared here), and the schedule of the 20-step runs above:
    # the plain run's step is then test_the_tiny_lm_trains_with_fp8_blocks_near_bf16
    # [delayed]'s, loaded from the persistent compilation cache (conftest.py).
    cfg["train"] = {**cfg["train"], "steps": 4, "eval_every": 0,
                    "checkpoint_every": 4}
    cfg["schedule"] = {**cfg["schedule"], "decay_steps": 20}
    for section, values in extra.items():
      cfg[section] = {**cfg.get(section, {}), **values}
    if name == "pipelined":
      cfg["precision"] = {**cfg["precision"], "grad_reduce_dtype": "float32"}
    out = str(tmp_path / name)
    mpscale.trainer.run(cfg, out_dir=out, verbose=False, progress=False)
    runs[name] = (_losses(out), mpscale.trainer.load(out))
  np.testing.assert_allclose(runs["pipelined"][0], runs["plain"][0], rtol=2e-3)
  (_, plain_state), (_, piped_state) = runs["plain"][1], runs["pipelined"][1]
  for product in ("qkv", "fc"):
    got = piped_state["_overwrite_with_gradient"]["stages"][product]
    want = plain_state["_overwrite_with_gradient"]["stages"][product]
    assert not np.any(got.lhs.scale[[0, -1]])  # the bf16 ends, in model order
    np.testing.assert_allclose(got.lhs.amax_history, want.lhs.amax_history, rtol=2e-2)
    np.testing.assert_allclose(got.grad.scale, want.grad.scale, rtol=0.1)


@pytest.mark.slow  # over 5 s on 2 cores: the quick loop skips it
@pytest.mark.parametrize("mesh", [
    # FSDP's batch is split as data's is (each device's FP8 state merged), and its
    # weights gathered where used: the data case is extended
    pytest.param({"data": 2}, id="data", marks=pytest.mark.extended),
    pytest.param({"fsdp": 2}, id="fsdp")])
def test_fp8_with_float32_gradient_sums_trains_as_with_bf16_sums(tmp_path, mesh):
  """precision.grad_reduce_dtype: float32 over 2 data replicas and 2 micro-batches:
  each replica updates the FP8 state from its own rows and the step merges the
  replicas' updates (merge_state), so the state records the global amaxes, a
  history entry a micro-batch, as the bf16-sums run does. Under FSDP (mesh.fsdp 2)
  too: each FP8 product runs on its weights gathered where used, their gradients
  reduce-scattered in float32 (Megatron-Bridge's FSDP runs train FP8 so)."""
  import mpscale.trainer
  runs = {}
  for name, sums in (("bf16", None), ("float32", "float32")):
    cfg = _fp8_config("delayed")
    # No evaluation: not compared here, and each run compiled it.
    cfg["train"] = {**cfg["train"], "steps": 4, "eval_every": 0,
                    "checkpoint_every": 4, "num_microbatches": 2}
    cfg["mesh"] = mesh
    cfg["precision"] = {**cfg["precision"], "grad_reduce_dtype": sums}
    out = str(tmp_path / name)
    mpscale.trainer.run(cfg, out_dir=out, verbose=False, progress=False)
    runs[name] = (_losses(out), mpscale.trainer.load(out)[1])
  np.testing.assert_allclose(runs["float32"][0], runs["bf16"][0], rtol=2e-3)
  got, want = (runs[k][1]["_overwrite_with_gradient"]["stages"]["fc"]
               for k in ("float32", "bf16"))
  assert np.count_nonzero(got.lhs.amax_history, axis=1).tolist() == [0, 8, 8, 0]
  np.testing.assert_allclose(got.lhs.amax_history, want.lhs.amax_history, rtol=2e-2)


@pytest.mark.parametrize("fp8, extra, names", [
    ({"recipe": "fast"}, {}, ("precision.fp8.recipe",)),
    ({"amax_compute": "mean"}, {}, ("precision.fp8.amax_compute",)),
    ({"history_len": 0}, {}, ("precision.fp8.history_len",)),
    ({"products": ["qkv", "mlp"]}, {}, ("precision.fp8.products",)),
    ({"bf16_layers": 2}, {}, ("precision.fp8.bf16_layers", "model.num_layers")),
])
def test_bad_fp8_settings_are_refused_by_key(fp8, extra, names):
  raw = _fp8_config(**{"recipe": "delayed", **fp8})
  for section, values in extra.items():
    raw[section] = {**raw.get(section, {}), **values}
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.config_from_dict(raw)
  assert err.value.keys[:len(names)] == names
  for name in names:
    assert name in str(err.value)


def test_fp8_with_float32_sums_under_fsdp_is_taken():
  """FP8 with precision.grad_reduce_dtype: float32 and mesh.fsdp 2 (refused until
  issue 64 item 9) checks; it trains in
  test_fp8_with_float32_gradient_sums_trains_as_with_bf16_sums[fsdp]."""
  raw = _fp8_config("delayed")
  raw["precision"] = {**raw["precision"], "grad_reduce_dtype": "float32"}
  raw["mesh"] = {"fsdp": 2}
  cfg = config_lib.config_from_dict(raw)
  assert (cfg.precision.grad_reduce_dtype, cfg.mesh.fsdp) == ("float32", 2)


def test_a_user_model_without_fp8_state_refuses_precision_fp8():
  import mpscale.trainer
  cfg = config_lib.config_from_dict(_fp8_config("delayed"))
  model = mpscale.trainer.Model(init=lambda key: {"w": jnp.ones(2)},
                                loss_fn=lambda p, b: jnp.sum(p["w"]))
  with pytest.raises(mpscale.ArgumentError) as err:
    builders.build(cfg, model=model)
  assert err.value.names == ("precision.fp8.recipe", "model.provider")


def test_a_user_models_fsdp_lays_out_two_axes_where_one_would_pad():
  """mesh.fsdp 6 and a user's (10, 9) weight: one axis of 6 divides neither
  dimension (padded to (12, 9)); fsdp 3 x fsdp_transpose 2 splits it evenly, 1/6 a
  device, so the mesh is laid out so (issue #63)."""
  import mpscale.trainer
  cfg = config_lib.config_from_dict({"mesh": {"fsdp": 6}, "data": {"batch_size": 6}})
  model = mpscale.trainer.Model(
      init=lambda key: {"w": jax.random.normal(key, (10, 9))},
      loss_fn=lambda p, b: (jnp.sum((b["x"] @ p["w"]) ** 2), jnp.float32(54)))
  assert builders.fsdp_transpose(cfg, model) == 2
  setup = builders.build(cfg, jax.devices()[:6], model=model)
  assert dict(setup.mesh.shape) == {"data": 1, "fsdp": 3, "fsdp_transpose": 2}
  state = setup.init(setup.init_params())
  w = state.params["w"]
  assert not mpscale.parallel.is_padded(w)
  assert {s.data.shape for s in w.addressable_shards} == {(5, 3)}
  state, metrics = setup.step(state, {"x": jnp.ones((6, 10))})
  assert np.isfinite(metrics["loss"])
