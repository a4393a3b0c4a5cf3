"""mpscale.parallel.pipeline: B's and W's gradients add up to the layer's, and B does
none of the tapped products' weight-side work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from mpscale.parallel.pipeline import _backward_split as bs

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


def _params(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), dtype)  # noqa: E731
  return {"w1": f(6, 12), "w2": f(12, 6), "b": f(12), "v": f(6, 12),
          "flat": f(72), "scale": f(6)}


def mlp(p, x):
  return x + jnp.tanh(x @ p["w1"] + p["b"]) @ p["w2"]


def shaped(p, x):  # weights through a transpose, a reshape and an einsum in a jit
  h = jnp.einsum("rd,df->rf", x * p["scale"], p["flat"].reshape(6, 12))
  return jax.jit(lambda h, v: h @ v.T)(jnp.tanh(h), p["v"])


def tied(p, x):  # one weight used twice, and a product of two weights (not tapped)
  h = jnp.tanh(x @ p["w1"])
  return h @ p["w1"].T + x @ (p["w1"] @ p["w2"])


def looped(p, x):  # a product inside a loop is left to B
  h, _ = lax.scan(lambda h, _: (jnp.tanh(h @ p["w2"] @ p["w1"]), None), x @ p["w1"],
                  None, length=2)
  return h @ p["w2"]


def split_grads(fn, p, x, g):
  """``(y, B's parameter gradients, W's, dx)`` the way ZB-H1 runs them."""
  split = bs.Split(fn, p, x)
  deltas = [jnp.zeros(d.shape, d.dtype) for d in split.delta_shapes()]
  y, pull, inputs = jax.vjp(lambda q, h, d: split.apply(q, p, h, d), p, x, deltas,
                            has_aux=True)
  dp, dx, dys = pull(g)
  return y, dp, split.weight_gradients(p, inputs, dys), dx


@pytest.mark.slow  # long: not in the floors job (.ci/run)
@pytest.mark.parametrize("fn, tapped", [
    (mlp, {"w1", "w2"}), (shaped, {"flat", "v"}), (tied, {"w1"}), (looped, {"w1", "w2"})])
def test_b_and_w_add_up_to_the_layers_gradients(fn, tapped):
  p = _params()
  x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 6)), jnp.float32)
  want_y, pull = jax.vjp(fn, p, x)
  g = jnp.asarray(np.random.default_rng(2).normal(size=want_y.shape), jnp.float32)
  want_dp, want_dx = pull(g)
  y, b, w, dx = split_grads(fn, p, x, g)
  np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
  for name in p:
    np.testing.assert_allclose(b[name] + w[name], want_dp[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)
  # W has the gradients of the tapped leaves (and only those)
  assert {k for k in p if np.abs(np.asarray(w[k])).max() > 0} == tapped
  assert [t.leaf for t in bs.Split(fn, p, x).taps]  # found


@pytest.mark.parametrize("fn, weight_only", [
    (mlp, {"w1", "w2"}), (shaped, {"flat", "v"}), (tied, set()), (looped, set())])
def test_leaves_only_tapped_products_use_get_no_gradient_from_b(fn, weight_only):
  """What ZB-H1 under FSDP reduce-scatters after B (the others' B gradients are
  zero, so only W sends them)."""
  p = _params()
  x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 6)), jnp.float32)
  split = bs.Split(fn, p, x)
  names = sorted(p)  # the leaves' order
  assert {names[i] for i in split.weight_only} == weight_only
  y, b, _, _ = split_grads(fn, p, x, jnp.ones_like(fn(p, x)))
  for name in weight_only:
    assert not np.asarray(b[name]).any(), name


def test_b_does_none_of_the_weight_side_products():
  """The weight of a tapped product is fixed for B: B's program has one product per
  tapped product (its input side), W's one each (its weight side); the layer's own
  backward has two each."""
  p, x = _params(), jnp.ones((5, 6), jnp.float32)
  split = bs.Split(mlp, p, x)

  def b(q, h, g):
    deltas = [jnp.zeros(d.shape, d.dtype) for d in split.delta_shapes()]
    _, pull, _ = jax.vjp(lambda q, h, d: split.apply(q, p, h, d), q, h, deltas,
                         has_aux=True)
    return pull(g)

  def w(q, h, g):
    deltas = [jnp.zeros(d.shape, d.dtype) for d in split.delta_shapes()]
    _, pull, inputs = jax.vjp(lambda q, h, d: split.apply(q, p, h, d), q, h, deltas,
                              has_aux=True)
    return split.weight_gradients(q, inputs, pull(g)[2])

  def products(fn):
    return str(jax.make_jaxpr(fn)(p, x, x)).count("dot_general")

  assert products(lambda q, h, g: jax.vjp(mlp, q, h)[1](g)) == 2 + 4  # F, B and W
  assert products(b) == 2 + 2            # the forward and the input side
  assert products(w) == 2 + 2 + 2        # then the weight side


def test_low_precision_products_keep_their_output_type():
  """A bfloat16 product accumulated in float32 (``preferred_element_type``): W's
  gradient is the weight's type, and B + W match the layer's backward."""
  p = _params(jnp.bfloat16)
  x = jnp.ones((4, 6), jnp.bfloat16)

  def fn(p, h):
    out = lax.dot_general(h, p["w1"], (((1,), (0,)), ((), ())),
                          preferred_element_type=jnp.float32)
    return jnp.tanh(out).astype(jnp.bfloat16) @ p["w2"]

  want_y, pull = jax.vjp(fn, p, x)
  g = jnp.ones_like(want_y)
  want_dp, _ = pull(g)
  _, b, w, _ = split_grads(fn, p, x, g)
  assert w["w1"].dtype == jnp.float32   # summed in float32
  for name in ("w1", "w2"):
    np.testing.assert_allclose(np.asarray(b[name] + w[name], np.float32),
                               np.asarray(want_dp[name], np.float32), rtol=2e-2,
                               atol=2e-2)
