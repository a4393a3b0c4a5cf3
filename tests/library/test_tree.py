"""Tests for mpscale._tree: finding mpscale's states inside an optimizer state."""

import jax
import jax.numpy as jnp
import optax
import pytest

import mpscale
from mpscale import _tree as opt_state

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


def _nested():
  return mpscale.dynamic_loss_scale(mpscale.skip_nonfinite(optax.chain(
      mpscale.global_norm_clip(1.0), optax.inject_hyperparams(optax.adamw)(1e-3))))


def test_find_returns_every_state_of_a_kind_outermost_first():
  state = _nested().init({"w": jnp.ones(3)})
  skips = opt_state.find(state, mpscale.SkipNonfiniteState)
  assert len(skips) == 2
  assert skips[0] is state.skip_state
  assert skips[1] is state.skip_state.inner_state
  assert opt_state.find(state, mpscale.LossScaleState) == [state]
  assert len(opt_state.find(state, mpscale.GlobalNormClipState)) == 1
  assert opt_state.find(state, mpscale.ScaleByCameState) == []


def test_find_all_gives_the_key_paths_and_the_state_itself_first():
  state = mpscale.skip_nonfinite(optax.sgd(0.1)).init({"w": jnp.ones(3)})
  found = opt_state.find_all(state, mpscale.SkipNonfiniteState)
  assert found[0] == ((), state) and len(found) == 1


def test_plain_leaves_non_nnx_states_alone():
  state = _nested().init({"w": jnp.ones(3)})
  plain = opt_state.plain(state)  # the same tree (a copy of it once nnx is imported)
  assert jax.tree.structure(plain) == jax.tree.structure(state)
  assert all(a is b for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(state)))


def test_plain_unwraps_an_nnx_optimizer():
  from flax import nnx
  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  tx = mpscale.dynamic_loss_scale(optax.adamw(1e-3), init_scale=16.0)
  try:
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  except TypeError:  # flax < 0.11 has no wrt
    optimizer = nnx.Optimizer(model, tx)
  plain = opt_state.plain(optimizer)
  assert isinstance(plain, mpscale.LossScaleState)
  assert float(plain.loss_scale) == 16.0
  assert not any(isinstance(x, nnx.Variable) for x in jax.tree.leaves(
      plain, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def _paths(tree):
  return [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_layer_stacks_group_one_role_and_shape_whatever_the_layer_names():
  linen = {f"h_{i}": {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)} for i in range(3)}
  listed = {"h": [{"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)} for _ in range(3)]}
  for tree in (linen, listed):
    leaves = jax.tree.leaves(tree)
    runs = opt_state.layer_stacks(_paths(tree), [x.shape for x in leaves])
    assert runs == [[0, 2, 4], [1, 3, 5]]  # the biases, the kernels (tree order)
  # A role whose layers differ in shape makes one stack per shape; other roles of
  # the same shape do not join it.
  mixed = {"h_0": {"w": jnp.zeros((4, 3))}, "h_1": {"w": jnp.zeros((4, 5))},
           "h_2": {"w": jnp.zeros((4, 3))}, "head": jnp.zeros((4, 3))}
  runs = opt_state.layer_stacks(_paths(mixed), [x.shape for x in jax.tree.leaves(mixed)])
  assert runs == [[0, 2], [1], [3]]


def test_stacks_are_a_pytree_with_their_members_in_the_structure():
  stacks = opt_state.Stacks([jnp.zeros((2, 3)), jnp.ones((1, 4))],
                            [("h_0/b", "h_1/b"), ("wte",)])
  leaves, treedef = jax.tree_util.tree_flatten(stacks)
  assert [x.shape for x in leaves] == [(2, 3), (1, 4)]
  back = jax.tree_util.tree_unflatten(treedef, leaves)
  assert back.members == stacks.members
  keys = [jax.tree_util.keystr(p) for p in _paths(stacks)]
  assert keys == ["[0]", "[1]"]
  other = opt_state.Stacks(leaves, [("h_0/b", "h_1/b"), ("wpe",)])
  assert jax.tree_util.tree_structure(other) != treedef
  shapes = jax.tree.map(lambda x: x.shape, stacks)
  assert shapes == opt_state.Stacks([(2, 3), (1, 4)], stacks.members)
