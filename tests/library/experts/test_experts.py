"""`mpscale.experts`: the router (softmax and sigmoid top-k, the balancing bias and
its update), the losses against their formulas, the grouped product (tiled equals
``ragged_dot``, values and gradients), dropless experts against a plain reference
that runs every token through every expert, the capacity variant dropping exactly
what it reports, and the layer split over an ``expert`` axis (with data and tensor
axes beside it) equal to one device's, through both exchanges."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mpscale import experts
from mpscale import validation


def _weights(key, num, d, f):
  keys = jax.random.split(key, 4)
  w = experts.ExpertWeights(*(jax.random.normal(k, s) * 0.3 for k, s in zip(
      keys, ((num, d, f), (num, d, f), (num, f, d)))))
  return jax.random.normal(keys[3], (d, num)), w


def _reference(x, router, w, routing, bias=None):
  """Every token through every expert (numpy, float64), then the chosen ones
  weighted: what a dense layer that masks computes."""
  x, router = np.asarray(x, np.float64), np.asarray(router, np.float64)
  logits = x @ router
  if routing.score == "softmax":
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
  else:
    scores = 1 / (1 + np.exp(-logits))
  choose = scores + (0 if bias is None else np.asarray(bias))
  top = np.argsort(-choose, axis=-1, kind="stable")[:, :routing.top_k]
  weight = np.take_along_axis(scores, top, -1)
  if routing.normalize:
    weight /= weight.sum(-1, keepdims=True)
  weight *= routing.scale
  gate, up, down = (np.asarray(a, np.float64) for a in w)
  every = np.stack([(lambda g, u: (g / (1 + np.exp(-g)) * u) @ down[e])(
      x @ gate[e], x @ up[e]) for e in range(routing.num_experts)], 1)
  return np.einsum("nkd,nk->nd", np.take_along_axis(every, top[..., None], 1), weight)


@pytest.mark.parametrize("score,normalize,scale,bias", [
    ("softmax", True, 1.0, False), ("softmax", False, 1.0, False),
    ("sigmoid", True, 2.5, True)])
@pytest.mark.parametrize("implementation", ["tiled", "ragged"])
def test_dropless_experts_equal_every_token_through_every_expert(
    score, normalize, scale, bias, implementation):
  num, d, f = 6, 8, 12
  routing = experts.Routing(num, 2, score=score, normalize=normalize, scale=scale)
  router, w = _weights(jax.random.key(1), num, d, f)
  x = jax.random.normal(jax.random.key(2), (40, d))
  b = jax.random.normal(jax.random.key(3), (num,)) * 0.3 if bias else None
  y, stats = jax.jit(lambda x: experts.moe_mlp(
      x, router, w, routing, bias=b, implementation=implementation, tile=4))(x)
  np.testing.assert_allclose(y, _reference(x, router, w, routing, b), rtol=2e-5,
                             atol=2e-5)
  assert float(stats.dropped) == 0 and float(stats.counts.sum()) == 80


def test_tiled_grouped_product_equals_ragged_dot_values_and_gradients():
  x = jax.random.normal(jax.random.key(0), (50, 8))
  w = jax.random.normal(jax.random.key(1), (4, 8, 6))
  sizes = jnp.array([10, 0, 23, 12])  # an empty group, and 5 rows past the groups
  cot = jax.random.normal(jax.random.key(2), (50, 6))

  def loss(impl, x, w):
    return jnp.sum(cot * experts.grouped_matmul(x, w, sizes, implementation=impl,
                                                tile=4))
  # both compiled (eagerly each op compiles on its own)
  np.testing.assert_allclose(jax.jit(loss, static_argnums=0)("tiled", x, w),
                             jax.jit(loss, static_argnums=0)("ragged", x, w), rtol=1e-5)
  grads = jax.jit(jax.grad(loss, (1, 2)), static_argnums=0)("tiled", x, w)
  expect = jax.jit(jax.grad(loss, (1, 2)), static_argnums=0)("ragged", x, w)
  for a, b in zip(grads, expect):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert not np.any(grads[0][45:])  # rows past the groups get no gradient


def test_losses_and_bias_update_follow_their_formulas():
  routing = experts.Routing(4, 2)
  x = jax.random.normal(jax.random.key(0), (30, 8))
  router = jax.random.normal(jax.random.key(1), (8, 4))
  routes = jax.jit(lambda x: experts.route(x, router, routing))(x)  # one program
  counts = jax.jit(experts.expert_counts, static_argnums=1)(routes.experts, 4)
  probs = np.asarray(jax.nn.softmax(x @ router))
  chosen = np.zeros((30, 4))
  np.put_along_axis(chosen, np.asarray(routes.experts), 1, axis=1)
  # transformers' load_balancing_loss_func for one layer: E * sum(mean one-hot
  # over tokens and slots summed over slots * mean prob)
  expect = 4 * np.sum(chosen.mean(0) * probs.mean(0))
  loss = experts.load_balancing_loss(counts, routes.probs.sum(0), jnp.float32(30))
  np.testing.assert_allclose(loss, expect, rtol=1e-5)
  bias = experts.update_bias(jnp.zeros(4), jnp.array([1.0, 5, 3, 3]), 0.01)
  np.testing.assert_allclose(bias, [0.01, -0.01, 0, 0])


def test_capacity_drops_exactly_what_it_reports():
  num, d, f = 4, 8, 8
  routing = experts.Routing(num, 2, capacity_factor=0.5)
  router, w = _weights(jax.random.key(4), num, d, f)
  x = jax.random.normal(jax.random.key(5), (24, d))
  # compiled (eagerly each op compiles on its own: most of the test's time)
  y, stats = jax.jit(lambda x: experts.moe_mlp(x, router, w, routing))(x)
  cap = routing.capacity(24)  # 6 of the 48 assignments an expert
  routes = jax.jit(lambda x: experts.route(x, router, routing))(x)
  counts = np.asarray(experts.expert_counts(routes.experts, num))
  assert float(stats.dropped) == np.maximum(counts - cap, 0).sum() > 0
  # the dropped assignments are each expert's last in token order: zero them in
  # the reference's weights and the outputs agree
  flat = np.asarray(routes.experts).reshape(-1)
  seen, keep = np.zeros(num, int), np.zeros(flat.shape, bool)
  for i, e in enumerate(flat):
    keep[i], seen[e] = seen[e] < cap, seen[e] + 1
  w_np = [np.asarray(a, np.float64) for a in w]
  xs = np.asarray(x, np.float64)
  out = np.zeros_like(xs)
  for i, e in enumerate(flat):
    if keep[i]:
      g, u = xs[i // 2] @ w_np[0][e], xs[i // 2] @ w_np[1][e]
      out[i // 2] += np.asarray(routes.weights).reshape(-1)[i] * (
          (g / (1 + np.exp(-g)) * u) @ w_np[2][e])
  np.testing.assert_allclose(y, out, rtol=2e-5, atol=2e-5)


def _mesh(shape, names):
  return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


@pytest.mark.parametrize("shape,names,ragged", [
    ((2, 4), ("data", "expert"), False), ((2, 2, 2), ("data", "expert", "tensor"),
                                          False)])
def test_experts_split_over_an_expert_axis_equal_one_device(shape, names, ragged):
  num, d, f = 8, 8, 12
  routing = experts.Routing(num, 2)
  router, w = _weights(jax.random.key(6), num, d, f)
  x = jax.random.normal(jax.random.key(7), (8, 6, d))
  cot = jax.random.normal(jax.random.key(8), x.shape)
  mesh = _mesh(shape, names)
  spec = P(("data", "expert"))
  tensor = "tensor" if "tensor" in names else None

  def loss(x, router, w, mesh):
    y, stats = experts.moe_mlp(x, router, w, routing, mesh=mesh, spec=spec,
                               tensor_axis=tensor, tile=4, ragged=ragged)
    return jnp.sum(y * cot) + stats.aux_loss, stats

  one = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True),
                static_argnums=3)(x, router, w, None)
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  split = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True),
                  static_argnums=3)(xs, router, w, mesh)
  for a, b in zip(jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(split)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_padded_exchange_places_rows_as_the_ragged_one_would():
  mesh = _mesh((4,), ("expert",))
  # blocks[s, p]: rows device s sends device p
  blocks = np.array([[1, 2, 0, 1], [0, 0, 3, 1], [2, 2, 0, 0], [1, 0, 0, 3]])
  rows = np.arange(4 * 4 * 2, dtype=np.float32).reshape(16, 2)

  def go(x):
    me = jax.lax.axis_index("expert")
    plan = experts.Plan.of(jnp.asarray(blocks), me)
    return experts.exchange(x, 8, plan, "expert", False)

  out = jax.jit(jax.shard_map(go, mesh=mesh, in_specs=P("expert"),
                              out_specs=P("expert"), check_vma=False))(rows)
  out = np.asarray(out).reshape(4, 8, 2)
  local = rows.reshape(4, 4, 2)
  for p in range(4):  # device p gets each source's block for it, in source order
    expect = np.concatenate([local[s][blocks[s, :p].sum():blocks[s, :p + 1].sum()]
                             for s in range(4)])
    np.testing.assert_array_equal(out[p][:len(expect)], expect)
    assert not out[p][len(expect):].any()


def test_bad_routing_is_refused_by_name():
  with pytest.raises(validation.ArgumentError, match="top_k"):
    experts.Routing(4, 5)
  with pytest.raises(validation.ArgumentError, match="score"):
    experts.Routing(4, 2, score="relu")
  with pytest.raises(validation.ArgumentError, match="capacity_factor"):
    experts.Routing(4, 2, capacity_factor=0.0)
  router, w = _weights(jax.random.key(0), 6, 4, 4)
  with pytest.raises(validation.ArgumentError, match="num_experts"):
    experts.moe_mlp(jnp.ones((8, 4)), router, w, experts.Routing(6, 2),
                    mesh=_mesh((4,), ("expert",)), spec=P("expert"))


def test_the_flax_layers_compute_moe_mlp_of_their_weights():
  from flax import nnx  # noqa: PLC0415
  from mpscale.experts import moe_flax  # noqa: PLC0415
  routing = experts.Routing(4, 2, bias_rate=0.01)
  x = jax.random.normal(jax.random.key(0), (2, 5, 8))
  layer = moe_flax.NnxMoeMLP(routing, 8, 12, rngs=nnx.Rngs(0))
  layer.bias = moe_flax.RoutingBias(jnp.array([0.0, 0.5, 0.0, -0.5]))
  y, stats = layer(x)
  w = experts.ExpertWeights(layer.gate[...], layer.up[...], layer.down[...])
  expect, _ = experts.moe_mlp(x, layer.router[...], w, routing, bias=layer.bias[...])
  np.testing.assert_array_equal(y, expect)
  # the bias is state, not a parameter: an optimizer over nnx.Param leaves it
  assert not isinstance(layer.bias, nnx.Param)
  assert len(jax.tree_util.tree_leaves(nnx.state(layer, nnx.Param))) == 4
  linen = moe_flax.MoeMLP(routing, d_ff=12, shared_d_ff=6)
  # the linen layer and its reference compiled (eagerly each op compiles alone)
  variables = jax.jit(linen.init)(jax.random.key(1), x)
  assert set(variables) == {"params", "routing"}
  params = variables["params"]
  bias = jnp.array([0.3, 0.0, 0.0, 0.0])
  y, stats = jax.jit(linen.apply)({"params": params, "routing": {"bias": bias}}, x)
  routed, _ = jax.jit(lambda x, params, bias: experts.moe_mlp(
      x, params["router"], experts.ExpertWeights(
          params["gate"], params["up"], params["down"]), routing, bias=bias))(
              x, params, bias)
  h = x @ params["shared_gate"]["kernel"]
  shared = (jax.nn.silu(h) * (x @ params["shared_up"]["kernel"])) @ params[
      "shared_down"]["kernel"]
  np.testing.assert_allclose(y, routed + shared, rtol=1e-5, atol=1e-6)
  assert float(stats.counts.sum()) == 2 * 5 * 2
