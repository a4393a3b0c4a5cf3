"""Tests for mpscale.scaling: global/group norms and global_norm_clip."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpscale
from mpscale.scaling import _norms as norms
from tests import helpers

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


def _tree(seed=0):
  rng = np.random.default_rng(seed)
  return {
      "embed": {"table": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)},
      "layer_0": {
          "attn": {"w": jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)},
          "mlp": {"w": jnp.asarray(rng.normal(size=(8, 32)), jnp.float32),
                  "b": jnp.asarray(rng.normal(size=(32,)), jnp.float32)},
      },
      "scale": jnp.asarray(rng.normal(), jnp.float32),
  }


def _np_norm(leaves):
  return float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in leaves)))


def test_global_norm_matches_numpy():
  tree = _tree()
  np.testing.assert_allclose(
      mpscale.global_norm(tree), _np_norm(jax.tree.leaves(tree)), rtol=1e-6)


def test_global_norm_accumulates_half_precision_in_float32():
  # 300**2 overflows float16 (max 65504): accumulation must be in float32.
  tree = {"a": jnp.full((10,), 300.0, jnp.float16)}
  norm = mpscale.global_norm(tree)
  assert norm.dtype == jnp.float32
  np.testing.assert_allclose(norm, 300.0 * np.sqrt(10), rtol=1e-6)


def test_group_norms_default_is_one_group_per_top_level_key():
  tree = _tree()
  gn, sizes = mpscale.group_norms(tree)
  assert list(gn) == ["embed", "layer_0", "scale"]
  np.testing.assert_allclose(gn["layer_0"],
                             _np_norm(jax.tree.leaves(tree["layer_0"])), rtol=1e-6)
  assert {k: int(v) for k, v in sizes.items()} == {
      "embed": 128, "layer_0": 64 + 256 + 32, "scale": 1}
  total = np.sqrt(sum(float(v) ** 2 for v in gn.values()))
  np.testing.assert_allclose(total, mpscale.global_norm(tree), rtol=1e-6)


def test_group_norms_by_depth_and_callable():
  tree = _tree()
  gn, sizes = mpscale.group_norms(tree, norm_groups=2)
  assert set(gn) == {"embed/table", "layer_0/attn", "layer_0/mlp", "scale"}
  np.testing.assert_allclose(
      gn["layer_0/mlp"], _np_norm(jax.tree.leaves(tree["layer_0"]["mlp"])), rtol=1e-6)
  assert int(sizes["layer_0/mlp"]) == 256 + 32

  by_kind = lambda path: "bias" if norms.path_str(path[-1:]) == "b" else "weights"
  gn, sizes = mpscale.group_norms(tree, norm_groups=by_kind)
  np.testing.assert_allclose(gn["bias"], _np_norm([tree["layer_0"]["mlp"]["b"]]),
                             rtol=1e-6)
  assert int(sizes["bias"]) == 32


def test_group_norms_of_a_bare_array():
  gn, sizes = mpscale.group_norms(jnp.ones((3, 4)))
  assert list(gn) == ["params"] and int(sizes["params"]) == 12


@pytest.mark.parametrize("groups, exc", [
    ("layer", TypeError), (0, ValueError), (True, TypeError), (-1, ValueError)])
def test_bad_groups_are_rejected(groups, exc):
  with pytest.raises(exc, match="groups"):
    mpscale.group_norms(_tree(), norm_groups=groups)
  with pytest.raises(exc, match="groups"):
    mpscale.global_norm_clip(1.0, norm_groups=groups)


def test_groups_callable_must_return_str():
  with pytest.raises(TypeError, match="str"):
    mpscale.group_norms(_tree(), norm_groups=lambda path: 3)


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 100.0])
@pytest.mark.parametrize("use_jit", [False, True])
def test_clip_matches_optax(max_norm, use_jit):
  tree = _tree()
  ours = mpscale.global_norm_clip(max_norm)
  ref = optax.clip_by_global_norm(max_norm)
  update = jax.jit(ours.update) if use_jit else ours.update
  got, state = update(tree, ours.init(tree))
  want, _ = ref.update(tree, ref.init(tree))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               got, want)
  np.testing.assert_allclose(state.global_norm, mpscale.global_norm(tree), rtol=1e-6)
  assert float(mpscale.global_norm(got)) <= max_norm * (1 + 1e-6)
  assert set(state.group_norms) == {"embed", "layer_0", "scale"}


def test_clip_keeps_dtype():
  tree = {"a": jnp.ones((4,), jnp.bfloat16) * 10}
  tx = mpscale.global_norm_clip(1.0)
  out, _ = tx.update(tree, tx.init(tree))
  assert out["a"].dtype == jnp.bfloat16


@pytest.mark.parametrize("max_norm, exc", [
    (0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
    ("1", TypeError), (None, TypeError)])
def test_clip_validates_max_norm(max_norm, exc):
  with pytest.raises(exc, match="max_norm"):
    mpscale.global_norm_clip(max_norm)


def _reductions_over_gradients(fn, grads, *args):
  """Counts reduce ops over operands at least as large as the smallest non-scalar
  gradient leaf in ``fn``'s jaxpr (all sub-jaxprs; of a ``platform_dependent``, the
  branch every backend but CUDA runs)."""
  count = 0
  smallest = min(x.size for x in jax.tree.leaves(grads) if x.size > 1)

  def walk(jaxpr):
    nonlocal count
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_or",
                                "reduce_and", "argmax"):
        if any(np.prod(v.aval.shape) >= smallest for v in eqn.invars):
          count += 1
      platforms = eqn.params.get("branches_platforms")
      if platforms:
        walk(eqn.params["branches"][platforms.index(None)].jaxpr)
        continue
      for sub in helpers.sub_jaxprs(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(fn)(grads, *args).jaxpr)
  return count


def test_clip_inside_wrapper_reuses_the_single_pass():
  params = _tree()
  grads = _tree(1)
  n_leaves = sum(x.size > 1 for x in jax.tree.leaves(params))  # scalars need no reduce

  def reductions(tx):
    state = tx.init(params)
    return _reductions_over_gradients(lambda g, s: tx.update(g, s, params), grads,
                                      state)

  plain = reductions(mpscale.dynamic_loss_scale(optax.sgd(0.1)))
  clipped = reductions(mpscale.dynamic_loss_scale(
      optax.chain(mpscale.global_norm_clip(1.0), optax.sgd(0.1))))
  optax_clipped = reductions(mpscale.dynamic_loss_scale(
      optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))))
  assert plain == n_leaves  # one sum of squares per leaf, nothing else
  assert clipped == plain  # the clip adds no pass of its own
  assert optax_clipped == plain + n_leaves  # a foreign clip measures again


def test_clip_after_another_transform_measures_its_own_input():
  # The wrapper's sums describe the raw gradients; a clip behind a scale must not
  # reuse them.
  params = _tree()
  grads = _tree(1)
  inner = optax.chain(optax.scale(10.0), mpscale.global_norm_clip(1e9),
                      optax.sgd(1.0))
  tx = mpscale.no_loss_scale(inner)
  _, state = tx.update(grads, tx.init(params), params)
  clip_state = state.skip_state.inner_state[1]
  np.testing.assert_allclose(clip_state.global_norm, 10 * mpscale.global_norm(grads),
                             rtol=1e-6)


def test_per_stage_norms_of_a_tensor_parallel_stack_gather_nothing():
  """Norms per pipeline stage of stacked layers split over stage x tensor: each
  device sums its own block, and only the sums move (an all-reduce of a few floats);
  flattening the leaf would have gathered every layer over tensor."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: PLC0415
  from mpscale.trainer.planning import hlo  # noqa: PLC0415
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "stage", "tensor"))
  stack = jax.device_put(jnp.ones((4, 64, 192)),
                         NamedSharding(mesh, P("stage", None, "tensor")))
  fn = jax.jit(lambda t: norms.measure({"w": t}, splits=(2,)).sums)
  text = fn.lower(stack).compile().as_text()
  over = hlo.collectives_over(text, dict(mesh.shape))
  assert not [k for k in over if k.startswith("all-gather")], over
  assert sum(c["bytes"] for c in over.values()) < 1024
  (sums,) = fn(stack)
  np.testing.assert_allclose(np.asarray(sums), [2 * 64 * 192] * 2)


def _mixed_tree(poison=None):
  """Leaves of every kind the GPU path buckets: the same weight of three layers (two
  shapes), small leaves of several shapes and dtypes, a scalar, a split leaf."""
  rng = np.random.default_rng(3)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  tree = {
      "h": [{"w": normal(8, 16), "b": normal(16), "ln": normal(8).astype(jnp.bfloat16)}
            for _ in range(3)],
      "stack": normal(4, 300, 300),  # > _SMALL elements, split in 2 below
      "big": [normal(300, 260) for _ in range(2)],
      "head": normal(5),
      "t": normal(),
  }
  if poison is not None:
    tree["h"][1]["w"] = tree["h"][1]["w"].at[2, 3].set(poison)
  return tree


def _splits(tree):
  return tuple(2 if np.shape(x) == (4, 300, 300) else 1
               for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("poison", [None, float("nan"), float("inf")])
def test_gpu_buckets_measure_what_the_leafwise_pass_measures(monkeypatch, poison):
  """The CUDA branch of `measure` (stacked buckets) gives every leaf the sums the
  per-leaf branch gives, at the same positions, and so the same flags and norms."""
  tree = _mixed_tree(poison)
  splits = _splits(tree)
  default = norms.measure(tree, splits)
  monkeypatch.setattr(jax.lax, "platform_dependent",
                      lambda *args, cuda, default: cuda(*args))
  stacked = norms.measure(tree, splits)
  buckets = norms.stack_buckets(stacked.leaves, stacked.parts, stacked.paths)
  assert max(map(len, buckets)) == 3 and len(buckets) < len(stacked.leaves)
  assert stacked.starts == default.starts
  for a, b in zip(stacked.sums, default.sums):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)
  for x, s in zip(stacked.leaves, stacked.sums):  # against float64
    want = np.sum(np.asarray(x, np.float64).reshape(np.size(s), -1) ** 2, axis=1)
    np.testing.assert_allclose(np.asarray(s, np.float64), want, rtol=1e-5)
  by_layer = lambda path: norms.path_str(path[:2]) if path[0].key == "h" else "rest"
  got, sizes = norms.grouped(stacked, by_layer)
  want, want_sizes = norms.grouped(default, by_layer)
  assert list(got) == list(want) and set(want) == {"h/0", "h/1", "h/2", "rest"}
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5)
    assert int(sizes[k]) == int(want_sizes[k])
  assert bool(jnp.any(jnp.isnan(stacked.vector))) == (poison is not None and
                                                       np.isnan(poison))
  np.testing.assert_allclose(stacked.total(), default.total(), rtol=1e-5)


def test_gpu_buckets_keep_differently_named_weights_apart():
  """Same-shaped weights of different roles (a column- and a row-parallel matrix)
  may be sharded differently, which tracing under GSPMD's automatic axes cannot see:
  stacking them would make GSPMD move a whole leaf, so there only the same key path up
  to layer numbers shares a bucket; small leaves of one shape share one whatever
  their names."""
  w = jnp.zeros((300, 300))
  tree = {"layers": [{"q": w, "o": w, "b1": jnp.zeros(8), "b2": jnp.zeros(8)}
                     for _ in range(2)]}
  names = _bucket_names(tree)
  assert sorted(names) == [["layers/0/b1", "layers/0/b2", "layers/1/b1", "layers/1/b2"],
                           ["layers/0/o", "layers/1/o"], ["layers/0/q", "layers/1/q"]]


def _bucket_names(tree, traced=True):
  """`measure`'s GPU buckets of ``tree``'s leaves, as lists of key paths, with the
  leaves traced under ``jit`` (``traced``) or as they are."""
  got = []

  def record(t):
    measured = norms.measure(t)
    got.extend(sorted(norms.path_str(measured.paths[i]) for i in run)
               for run in norms.stack_buckets(measured.leaves, measured.parts,
                                         measured.paths))
    return measured.vector
  jax.jit(record).lower(tree) if traced else record(tree)
  return got


def _named_blocks(naming, layers=3):
  """A tree of ``layers`` blocks (two same-shaped weights of different roles, a wide
  one, a bias) spelled as a list ``h[i]``, a digit key ``h/i`` or linen's ``h_i``."""
  rng = np.random.default_rng(5)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  blocks = [{"q": normal(260, 260), "o": normal(260, 260), "up": normal(260, 300),
             "b": normal(260)} for _ in range(layers)]
  tree = {"embed": normal(300, 260)}
  if naming == "list":
    tree["h"] = blocks
  elif naming == "slash":
    tree["h"] = {str(i): b for i, b in enumerate(blocks)}
  else:
    tree.update({f"h_{i}": b for i, b in enumerate(blocks)})
  return tree


def _cuda_reductions(fn, *args):
  """``reduce_sum`` ops in the CUDA branch of ``fn``'s ``platform_dependent``."""
  count = 0

  def walk(jaxpr, in_cuda):
    nonlocal count
    for eqn in jaxpr.eqns:
      count += in_cuda and eqn.primitive.name == "reduce_sum"
      platforms = eqn.params.get("branches_platforms")
      if platforms:
        branch = next(i for i, ps in enumerate(platforms) if ps and "cuda" in ps)
        walk(eqn.params["branches"][branch].jaxpr, True)
        continue
      for sub in helpers.sub_jaxprs(eqn.params):
        walk(sub, in_cuda)

  walk(jax.make_jaxpr(fn)(*args).jaxpr, False)
  return count


@pytest.mark.parametrize("naming", ["slash", "linen"])
def test_gpu_buckets_do_not_depend_on_how_layers_are_named(monkeypatch, naming):
  """A linen model names its layers ``h_0``, ``h_1``, ...: the same weight of every
  layer stacks as it does under list (``h[0]``) or digit (``h/0``) names, with as
  many fused reductions, and the very same sums (issue 64)."""
  fused = lambda t: _cuda_reductions(lambda x: norms.measure(x).vector, t)
  listed, named = _named_blocks("list"), _named_blocks(naming)
  # embed alone, q, o and up stacked over 3 layers, the biases together: 5.
  assert fused(named) == fused(listed) == 5
  roles = lambda names: sorted(sorted(n.replace("h_", "h/") for n in run)
                               for run in names)
  assert roles(_bucket_names(named)) == roles(_bucket_names(listed))
  monkeypatch.setattr(jax.lax, "platform_dependent",
                      lambda *args, cuda, default: cuda(*args))
  measure = jax.jit(lambda t: norms.measure(t).sums)
  got, want = measure(named), measure(listed)
  order = lambda t: sorted(range(len(jax.tree.leaves(t))),
                           key=lambda i: norms.path_str(
                               jax.tree_util.tree_flatten_with_path(t)[0][i][0]
                           ).replace("h_", "h/"))
  for i, j in zip(order(named), order(listed)):
    np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want[j]))


def test_gpu_buckets_stack_by_known_sharding_not_by_name():
  """Where the sharding is known (concrete arrays), it decides: same-shaped weights of
  one sharding stack whatever their names, and the same weight sharded two ways does
  not."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: PLC0415
  mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
  put = lambda spec: jax.device_put(jnp.zeros((260, 260)), NamedSharding(mesh, spec))
  tree = {"h_0": {"q": put(P(None, "tensor")), "o": put(P("tensor", None))},
          "h_1": {"q": put(P(None, "tensor")), "o": put(P("tensor", None))},
          "odd": {"q": put(P("tensor", None))}}
  assert sorted(_bucket_names(tree, traced=False)) == [
      ["h_0/o", "h_1/o", "odd/q"], ["h_0/q", "h_1/q"]]
  plain = {"a": jnp.zeros((260, 260)), "b": {"c": jnp.zeros((260, 260))}}
  assert _bucket_names(plain, traced=False) == [["a", "b/c"]]


@pytest.mark.skipif(not hasattr(getattr(jax.sharding, "AxisType", None), "Explicit"),
                    reason="no explicit sharding in this JAX")
def test_gpu_buckets_read_explicit_shardings_under_jit():
  """Under ``jit`` on a mesh of explicit axes the abstract value carries the
  sharding: it decides as for concrete arrays."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415
  mesh = jax.make_mesh((2,), ("tensor",),
                       axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:2])
  put = lambda spec: jax.device_put(jnp.zeros((260, 260)), NamedSharding(mesh, spec))
  tree = {"h_0": {"q": put(P(None, "tensor")), "o": put(P("tensor", None))},
          "h_1": {"q": put(P(None, "tensor")), "o": put(P("tensor", None))},
          "odd": {"q": put(P("tensor", None))}}
  assert sorted(_bucket_names(tree)) == [["h_0/o", "h_1/o", "odd/q"],
                                         ["h_0/q", "h_1/q"]]
