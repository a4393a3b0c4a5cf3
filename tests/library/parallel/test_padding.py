"""FSDP on any device count: leaves split unevenly, stored padded (mpscale.parallel._padding)."""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import numpy as np
import optax
import pytest

import mpscale
from mpscale import parallel
from tests import helpers


_loss = helpers.tiny_mlp(7)[0]


def _problem():
  """The MLP's parameters and batch (none of whose dimensions 3 or 6 divides)."""
  return helpers.tiny_mlp(7)[1:]


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


def test_two_fsdp_axes_split_two_dimensions_padding_least():
  # MaxText's fsdp x fsdp_transpose: 1,120 = 32 x 35 GPUs and a 530B GPT's MLP
  # weight. One axis of 1,120 pads 81920 to 82880 (+1.2%); 32 and 35 apart pad it
  # to 81935 (+0.02%), 20480 being a multiple of 32.
  big = parallel.split_across(P(), (20480, 81920), "fsdp", "fsdp_transpose", (32, 35),
                              uneven=True)
  assert big == P("fsdp", "fsdp_transpose")
  # Apart and even wins over together; the first group on the larger dimension.
  assert parallel.split_across(P(), (6, 9), "a", "b", (2, 3)) == P("a", "b")
  assert parallel.split_across(P(), (9, 8), "a", "b", (2, 3)) == P("b", "a")
  # One free dimension: both groups on it together, padded where allowed.
  assert parallel.split_across(P(None, "tensor"), (9, 4), "a", "b", (2, 3),
                               uneven=True) == P(("a", "b"), "tensor")
  assert parallel.split_across(P(), (12,), "a", "b", (2, 3)) == P(("a", "b"))
  # Without uneven splits, each group where it divides alone (else replicated).
  assert parallel.split_across(P(), (9,), "a", "b", (2, 3)) == P("b")
  assert parallel.split_across(P(), (5, 7), "a", "b", (2, 3)) == P()
  # Padded, the placement of fewest elements: (5, 7) pads to (6, 8) with "b" on the
  # 5 and "a" on the 7, to (6, 9) the other way; 6 devices together fit neither.
  assert parallel.split_across(P(), (5, 7), "a", "b", (2, 3), uneven=True) == P(
      "b", "a")
  assert parallel.padded_shape((9, 5), P("a", "b"), Mesh(
      np.array(jax.devices()[:6]).reshape(2, 3), ("a", "b"))) == (10, 6)


def test_two_fsdp_axes_train_padded_as_one_device_holding_a_sixth():
  # The MLP (5, 9), (9,), (9, 2) over fsdp 2 x fsdp_transpose 3: w1 splits apart
  # (padded to (6, 9)), b1 together (padded to 12), w2 apart and even.
  params, batch = helpers.tiny_mlp(9)[1:]
  loss = helpers.tiny_mlp(9)[0]
  mesh = Mesh(np.array(jax.devices()[:6]).reshape(2, 3), ("fsdp", "fsdp_transpose"))
  specs = parallel.fsdp_specs(params, mesh, "fsdp", pad=True,
                              transpose_axis="fsdp_transpose")
  assert specs == {"w1": P("fsdp", "fsdp_transpose"),
                   "b1": P(("fsdp", "fsdp_transpose")),
                   "w2": P("fsdp_transpose", "fsdp")}
  tx = optax.adafactor(1e-2, min_dim_size_to_factor=2)
  got, want = [], []
  for mesh_, specs_, out in ((mesh, specs, got), (None, None, want)):
    axes = ("fsdp", "fsdp_transpose") if mesh_ is not None else "data"
    init, step = mpscale.make_train_step(loss, tx, mesh=mesh_, data_axis=axes,
                                         param_specs=specs_)
    state = init(params)
    for _ in range(4):
      state, metrics = step(state, batch)
      out.append(float(metrics["loss"]))
    if mesh_ is not None:
      for name in ("w1", "b1"):
        leaf = state.params[name]
        assert parallel.is_padded(leaf), name
        assert all(s.data.size * 6 == leaf.value.size
                   for s in leaf.value.addressable_shards)
      assert not parallel.is_padded(state.params["w2"])
  np.testing.assert_allclose(got, want, rtol=1e-6)


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


@pytest.mark.parametrize("n", [3, 6])
def test_float32_sums_gather_padded_shards_and_train_as_one_device(n):
  # bf16 compute, float32 masters and float32 sums (each shard gathered and cut to
  # its true size, its gradient padded and reduce-scattered) over 2 micro-batches.
  params, batch = _problem()
  mesh = _mesh(n)
  specs = parallel.fsdp_specs(params, mesh, "fsdp", pad=True)
  tx = optax.adam(1e-2)
  init, step = mpscale.make_train_step(_loss, tx, mesh=mesh, data_axis="fsdp",
                                       param_specs=specs, policy="bf16",
                                       grad_reduce_dtype=jnp.float32,
                                       num_microbatches=2)
  state = init(params)
  # The reference: the same rows on each device, the parameters replicated.
  ref_init, ref_step = mpscale.make_train_step(_loss, tx, mesh=mesh, data_axis="fsdp",
                                               policy="bf16",
                                               grad_reduce_dtype=jnp.float32,
                                               num_microbatches=2)
  ref = ref_init(params)
  state, metrics = step(state, batch)
  ref, ref_metrics = ref_step(ref, batch)
  # One step: the same bf16 weights, float32 sums in another order (a
  # reduce-scatter, not an all-reduce). Later steps would amplify the last bits
  # through bf16's rounding of the weights.
  # (bf16's products fuse otherwise: an even split differs from replicated weights
  # by 5e-6 here too; the gather itself is exact, test_a_padded_gather_...)
  np.testing.assert_allclose(metrics["global_norm"], ref_metrics["global_norm"],
                             rtol=1e-4)
  assert all(parallel.is_padded(x) for x in state.params.values())
  got = parallel.unpad(jax.device_get(state.params))
  for name in got:
    np.testing.assert_allclose(got[name], ref.params[name], rtol=1e-4, atol=1e-6)
  for _ in range(2):
    state, metrics = step(state, batch)
    ref, ref_metrics = ref_step(ref, batch)
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-3)


def test_a_padded_gather_is_the_true_array_and_its_gradient_the_padded_scatter():
  mesh = _mesh(3)
  x = jax.random.normal(jax.random.key(1), (5, 4))
  ct = jax.random.normal(jax.random.key(2), (3, 5, 4))  # each device's cotangent
  stored = jnp.pad(x, ((0, 1), (0, 0)))  # 5 rows -> 6, two a device

  def per_device(shard, ct):
    y, pull = jax.vjp(lambda s: parallel.gather_cast(s, jnp.float32,
                                                     [(0, ("fsdp",), 5)]), shard)
    return y[None], pull(ct[0])[0]

  gathered, grads = jax.shard_map(
      per_device, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")),
      out_specs=(P("fsdp"), P("fsdp")))(stored, ct)
  for copy in np.asarray(gathered):
    np.testing.assert_array_equal(copy, np.asarray(x))
  want = np.pad(np.asarray(ct).sum(0), ((0, 1), (0, 0)))  # the padding's share: 0
  np.testing.assert_allclose(np.asarray(grads), want, rtol=1e-6)


def test_steps_that_cannot_follow_a_padded_leaf_refuse_it_by_name():
  assert mpscale.step.unpaddable(pipelined=True) is not None
  assert "context" in mpscale.step.unpaddable(context=2)
  assert mpscale.step.unpaddable() is None
  params, _ = _problem()
  mesh = Mesh(np.array(jax.devices()[:6]).reshape(3, 2), ("fsdp", "context"))
  specs = parallel.fsdp_specs(params, mesh, "fsdp", pad=True)
  init, _ = mpscale.make_train_step(_loss, optax.adam(1e-3), mesh=mesh,
                                    data_axis="fsdp", param_specs=specs)
  with pytest.raises(ValueError, match=r"'params/b1' .* unevenly.*a context axis"):
    init(params)


def test_a_spec_over_a_non_data_axis_must_still_divide():
  params, _ = _problem()
  mesh = Mesh(np.array(jax.devices()[:6]).reshape(2, 3), ("data", "tensor"))
  init, _ = mpscale.make_train_step(_loss, optax.sgd(0.1), mesh=mesh,
                                    param_specs={"w1": P(None, "tensor"), "b1": P(),
                                                 "w2": P()})
  with pytest.raises(ValueError, match=r"'w1' dimension 1 \(size 7\) is not divisible "
                     r"by mesh axis 'tensor'"):
    init(params)
