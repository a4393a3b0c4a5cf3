"""FSDP on any device count: leaves split unevenly, stored padded (mpscale.parallel._padding)."""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import numpy as np
import optax
import pytest

import mpscale
from mpscale import parallel


def _loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _problem():
  """A model none of whose dimensions (5, 7, 2) 3 or 6 divides; 12 rows a batch."""
  k = jax.random.split(jax.random.key(0), 4)
  params = {"w1": jax.random.normal(k[0], (5, 7)), "b1": jnp.full((7,), 0.1),
            "w2": jax.random.normal(k[1], (7, 2))}
  batch = {"x": jax.random.normal(k[2], (12, 5)), "y": jax.random.normal(k[3], (12, 2))}
  return params, batch


def _mesh(n):
  return Mesh(np.array(jax.devices()[:n]), ("fsdp",))


def _train(n, tx, steps=4, pad=True):
  params, batch = _problem()
  mesh = _mesh(n)
  specs = parallel.fsdp_specs(params, mesh, "fsdp", pad=pad)
  init, step = mpscale.make_train_step(_loss, tx, mesh=mesh, data_axis="fsdp",
                                       param_specs=specs)
  state = init(params)
  losses = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return state, losses


def test_the_split_pads_least_where_nothing_divides():
  # (5, 7) on 3: padding 5 -> 6 adds 7 elements, 7 -> 9 adds 10.
  assert parallel.split_largest(P(), (5, 7), "fsdp", 3) == P()
  assert parallel.split_largest(P(), (5, 7), "fsdp", 3, uneven=True) == P("fsdp")
  assert parallel.split_largest(P(), (7, 5), "fsdp", 3, uneven=True) == P(None, "fsdp")
  # A dimension the axis divides still wins, padding or not.
  assert parallel.split_largest(P(), (7, 6), "fsdp", 3, uneven=True) == P(None, "fsdp")
  # Below the axis size a dimension is never split (devices of padding only).
  assert parallel.split_largest(P(), (2, 2), "fsdp", 3, uneven=True) == P()
  assert parallel.padded_shape((5, 7), P("fsdp"), _mesh(3)) == (6, 7)


@pytest.mark.parametrize("n", [3, 6])
@pytest.mark.parametrize("tx", [optax.adamw(1e-2, weight_decay=0.1),
                                optax.adafactor(1e-2, min_dim_size_to_factor=2)],
                         ids=["adamw", "adafactor"])
def test_padded_fsdp_trains_as_one_device_and_holds_a_share(n, tx):
  # Adafactor's row and column means would change if the padding reached them.
  state, losses = _train(n, tx)
  params, batch = _problem()
  init, step = mpscale.make_train_step(_loss, tx)
  ref = init(params)
  ref_losses = []
  for _ in range(4):
    ref, metrics = step(ref, batch)
    ref_losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  for name in ("w1", "b1", "w2"):
    leaf = state.params[name]
    assert parallel.is_padded(leaf), name
    true = ref.params[name].shape
    assert leaf.shape == true
    # Every device holds 1/n of the padded leaf, and the padding stays zeros.
    shards = leaf.value.addressable_shards
    assert len({s.device for s in shards}) == n
    assert all(s.data.size * n == leaf.value.size for s in shards)
    whole = np.asarray(jax.device_get(leaf.value))
    cut = tuple(slice(0, k) for k in true)
    np.testing.assert_allclose(whole[cut], np.asarray(ref.params[name]), rtol=1e-5,
                               atol=1e-6)
    rest = whole.copy()
    rest[cut] = 0
    assert not rest.any(), f"{name}: the padding holds non-zeros"
  # The optimizer state is padded alike (Adam's moments; Adafactor's factored rows).
  padded = [x for x in jax.tree_util.tree_leaves(state.opt_state,
                                                 is_leaf=parallel.is_padded)
            if parallel.is_padded(x)]
  assert padded


def test_an_abstract_padded_state_compiles_with_its_padded_shapes():
  params, batch = _problem()
  mesh = _mesh(3)
  specs = parallel.fsdp_specs(params, mesh, "fsdp", pad=True)
  init, step = mpscale.make_train_step(_loss, optax.adam(1e-3), mesh=mesh,
                                       data_axis="fsdp", param_specs=specs)
  shapes = init(jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
  assert shapes.params["w1"].shape == (5, 7)
  assert shapes.params["w1"].value.shape == (6, 7)
  assert shapes.params["w1"].value.sharding.spec == P("fsdp")
  step.lower(shapes, batch).compile()


def test_steps_that_sum_in_a_shard_map_refuse_padding_by_name():
  params, _ = _problem()
  mesh = _mesh(3)
  specs = parallel.fsdp_specs(params, mesh, "fsdp", pad=True)
  init, _ = mpscale.make_train_step(_loss, optax.adam(1e-3), mesh=mesh,
                                    data_axis="fsdp", param_specs=specs, policy="O2",
                                    grad_reduce_dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"'params/b1' .* unevenly.*grad_reduce_dtype"):
    init(params)
  assert mpscale.step.unpaddable("O2", jnp.float32) is not None
  assert mpscale.step.unpaddable("O2") is None
  # Where nothing needs padding, such a step builds as before.
  assert mpscale.step.unpaddable("O0", jnp.float32) is None


def test_a_spec_over_a_non_data_axis_must_still_divide():
  params, _ = _problem()
  mesh = Mesh(np.array(jax.devices()[:6]).reshape(2, 3), ("data", "tensor"))
  init, _ = mpscale.make_train_step(_loss, optax.sgd(0.1), mesh=mesh,
                                    param_specs={"w1": P(None, "tensor"), "b1": P(),
                                                 "w2": P()})
  with pytest.raises(ValueError, match=r"'w1' dimension 1 \(size 7\) is not divisible "
                     r"by mesh axis 'tensor'"):
    init(params)
