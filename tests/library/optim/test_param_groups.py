"""Parameter groups: per-group learning rates, weight decays and options."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpscale
from mpscale.optim import _param_groups as param_groups_lib
from mpscale.optim._came import relative_step_size

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


def _params():
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return {"embed": {"embedding": normal(16, 8)},
          "block": {"ln": {"scale": normal(8), "bias": normal(8)},
                    "mlp": {"kernel": normal(8, 8), "bias": normal(8)}},
          "head": {"kernel": normal(8, 16)}}


def _grads(step):
  rng = np.random.default_rng(100 + step)
  return jax.tree_util.tree_map(
      lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), _params())


def _run(tx, params, steps=5, **extra):
  state = tx.init(params)
  update = jax.jit(functools.partial(tx.update, **extra))
  for step in range(steps):
    updates, state = update(_grads(step), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _subtree(tree, keys):
  return {k: tree[k] for k in keys}


def test_two_group_came_equals_two_came_optimizers_bit_for_bit():
  params = _params()
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
  groups = [{"match": "^embed", "lr_mult": 0.25, "weight_decay": 0.0, "name": "embed"}]
  tx = mpscale.param_groups(mpscale.came, groups, learning_rate=schedule,
                            weight_decay=0.1, beta1=0.8)
  got, _ = _run(tx, params)

  embed_tx = mpscale.came(lambda c: 0.25 * schedule(c), weight_decay=0.0, beta1=0.8)
  rest_tx = mpscale.came(schedule, weight_decay=0.1, beta1=0.8)
  state_e = embed_tx.init(_subtree(params, ["embed"]))
  state_r = rest_tx.init(_subtree(params, ["block", "head"]))
  pe, pr = _subtree(params, ["embed"]), _subtree(params, ["block", "head"])
  for step in range(5):
    g = _grads(step)
    u, state_e = jax.jit(embed_tx.update)(_subtree(g, ["embed"]), state_e, pe)
    pe = optax.apply_updates(pe, u)
    u, state_r = jax.jit(rest_tx.update)(_subtree(g, ["block", "head"]), state_r, pr)
    pr = optax.apply_updates(pr, u)
  want = {**pe, **pr}
  jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)
  # And the groups really differ from one CAME over everything.
  one, _ = _run(mpscale.came(schedule, weight_decay=0.1, beta1=0.8), params)
  assert not np.array_equal(one["embed"]["embedding"], got["embed"]["embedding"])
  np.testing.assert_array_equal(one["head"]["kernel"], got["head"]["kernel"])


def test_adamw_groups_equal_separate_adamw_with_masks():
  params = _params()
  groups = [mpscale.ParamGroup("bias|scale", weight_decay=0.0, name="no_decay")]
  tx = mpscale.param_groups(optax.adamw, groups, learning_rate=1e-2,
                            weight_decay=0.5)
  got, _ = _run(tx, params)
  mask = jax.tree_util.tree_map_with_path(
      lambda path, _: mpscale._tree.path_str(path).rsplit("/", 1)[-1] not in (
          "bias", "scale"), params)
  want, _ = _run(optax.adamw(1e-2, weight_decay=0.5, mask=mask), params)
  jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)


def test_lr_mult_zero_freezes_a_group_and_keeps_no_state_for_it():
  params = _params()
  tx = mpscale.param_groups(optax.adamw, [{"match": "^block/", "lr_mult": 0.0}],
                            learning_rate=1e-2)
  got, state = _run(tx, params)
  jax.tree_util.tree_map(np.testing.assert_array_equal, got["block"], params["block"])
  assert not np.allclose(got["head"]["kernel"], params["head"]["kernel"])
  assert float(state.group_learning_rates["^block/"]) == 0.0
  frozen_state = jax.tree_util.tree_leaves(state.inner_states["^block/"])
  assert frozen_state == []  # optax.set_to_zero: nothing kept for frozen leaves


def test_first_matching_group_wins_and_the_rest_are_default():
  params = _params()
  groups = [{"match": "bias", "name": "biases"}, {"match": "^block", "name": "block"}]
  labels = param_groups_lib.param_group_labels(params, groups)
  assert labels["block"]["mlp"]["bias"] == "biases"
  assert labels["block"]["ln"]["bias"] == "biases"
  assert labels["block"]["ln"]["scale"] == "block"
  assert labels["block"]["mlp"]["kernel"] == "block"
  assert labels["head"]["kernel"] == "default"
  predicate = [mpscale.ParamGroup(lambda path, leaf: leaf.ndim == 1, name="vectors")]
  labels = param_groups_lib.param_group_labels(params, predicate)
  assert labels["block"]["ln"]["scale"] == "vectors"
  assert labels["embed"]["embedding"] == "default"


def test_a_pattern_matching_nothing_is_refused_by_name():
  tx = mpscale.param_groups(optax.adamw, [{"match": "bias"}, {"match": "norm"}],
                            learning_rate=1e-3)
  with pytest.raises(mpscale.ArgumentError, match=r"groups\[1\]\.match 'norm' "
                     "matches no parameter") as e:
    tx.init(_params())
  assert e.value.name == "groups[1].match"
  # A pattern whose leaves an earlier group took matches nothing either.
  tx = mpscale.param_groups(optax.adamw, [{"match": "bias"}, {"match": "mlp/bias"}],
                            learning_rate=1e-3)
  with pytest.raises(mpscale.ArgumentError, match=r"groups\[1\]\.match"):
    tx.init(_params())


def test_group_learning_rates_follow_the_schedule_and_reach_the_metrics():
  params = _params()
  schedule = optax.linear_schedule(1e-2, 0.0, 10)
  inner = mpscale.param_groups(
      optax.adamw, [{"match": "^embed", "lr_mult": 0.5, "name": "embed"},
                    {"match": "^head", "learning_rate": 3e-3, "name": "head"}],
      learning_rate=schedule)
  tx = mpscale.dynamic_loss_scale(optax.chain(mpscale.global_norm_clip(1.0), inner),
                                  init_scale=1.0)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(3):
    _, state = update(_grads(step), state, params)
    metrics = mpscale.step_metrics(state)
    np.testing.assert_allclose(metrics["learning_rate"], schedule(step), rtol=1e-6)
    np.testing.assert_allclose(metrics["group_learning_rates"]["embed"],
                               0.5 * schedule(step), rtol=1e-6)
    np.testing.assert_allclose(metrics["group_learning_rates"]["head"], 3e-3)
  # A skipped step does not advance the groups' count: the rate stays.
  bad = jax.tree_util.tree_map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), _grads(3))
  _, state = update(bad, state, params)
  metrics = mpscale.step_metrics(state)
  assert bool(metrics["overflow"])
  _, state = update(_grads(4), state, params)
  np.testing.assert_allclose(mpscale.step_metrics(state)["learning_rate"],
                             schedule(3), rtol=1e-6)


def test_came_relative_step_groups_set_weight_decay_and_report_came_rate():
  params = _params()
  tx = mpscale.param_groups(
      functools.partial(mpscale.came, relative_step=True, warmup_init=True),
      [{"match": "bias|scale", "weight_decay": 0.0, "name": "no_decay"}],
      learning_rate=None, weight_decay=0.1)
  _, state = _run(tx, params, steps=3)
  rate = relative_step_size(jnp.asarray(2), warmup_init=True)
  np.testing.assert_allclose(state.learning_rate, rate, rtol=1e-6)
  np.testing.assert_allclose(state.group_learning_rates["no_decay"], rate, rtol=1e-6)
  with pytest.raises(mpscale.ArgumentError,
                     match=r"groups\[0\]\.lr_mult needs a default learning_rate"):
    mpscale.param_groups(functools.partial(mpscale.came, relative_step=True),
                         [{"match": "bias", "lr_mult": 0.1}], learning_rate=None)


def test_extra_args_pass_through_and_train_step_runs():
  params = {"w": jnp.ones(3), "b": jnp.zeros(())}
  tx = mpscale.dynamic_loss_scale(mpscale.param_groups(
      optax.sgd, [{"match": "^b$", "lr_mult": 0.0}], learning_rate=0.1))

  def loss_fn(p, batch):
    return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)

  init, step = mpscale.make_train_step(loss_fn, tx, policy="O2")
  state = init(params)
  batch = {"x": jnp.ones((4, 3)), "y": jnp.full((4,), 5.0)}
  for _ in range(3):
    state, metrics = step(state, batch)
  assert float(state.params["b"]) == 0.0
  assert float(state.params["w"][0]) != 1.0
  assert set(metrics["group_learning_rates"]) == {"^b$"}


@pytest.mark.parametrize("groups, kwargs, name, cls", [
    ([{"match": "a", "lr_mult": -1.0}], {}, "groups[0].lr_mult", ValueError),
    ([{"match": "a", "lr_mult": 0.5, "learning_rate": 1e-3}], {},
     "groups[0].learning_rate", ValueError),
    ([{"match": "a"}, {"match": "b", "name": "a"}], {}, "groups[1].name", ValueError),
    ([{"match": "a", "name": "default"}], {}, "groups[0].name", ValueError),
    ([{"match": "a", "lr": 1e-3}], {}, "groups[0].lr", ValueError),
    ([{"lr_mult": 2.0}], {}, "groups[0].match", ValueError),
    ([{"match": "(a"}], {}, "groups[0].match", ValueError),
    ([{"match": 3}], {}, "groups[0].match", TypeError),
    ([{"match": "a", "weight_decay": -0.1}], {}, "groups[0].weight_decay", ValueError),
    ("bias", {}, "groups", TypeError),
    ([3], {}, "groups[0]", TypeError),
    ([], {"learning_rate": -1.0}, "learning_rate", ValueError),
])
def test_bad_groups_are_refused_when_built(groups, kwargs, name, cls):
  kwargs = {"learning_rate": 1e-3, **kwargs}
  with pytest.raises(cls) as e:
    mpscale.param_groups(optax.adamw, groups, **kwargs)
  assert isinstance(e.value, mpscale.ArgumentError)
  assert e.value.name == name
  assert name in str(e.value)


def test_a_group_option_the_optimizer_refuses_names_the_group():
  with pytest.raises(mpscale.ArgumentError) as e:
    mpscale.param_groups(mpscale.came, [{"match": "a", "options": {"beta1": 2.0}}],
                         learning_rate=1e-3)
  assert e.value.name == "groups[0].options.beta1"
  assert str(e.value).startswith("groups[0].options.beta1 must be")
  with pytest.raises(mpscale.ArgumentError) as e:
    mpscale.param_groups(mpscale.came, [{"match": "a", "weight_decay": 2.0}],
                         learning_rate=1e-3, relative_step=False)
  assert e.value.name == "groups[0].weight_decay", str(e.value)
