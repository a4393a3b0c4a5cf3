"""`mpscale.parallel`: context parallelism. Attention over a sequence split along a
``context`` axis equals causal attention of the whole sequence (values and
gradients; ring and all-gather; balanced and in order; grouped K/V; a sliding
window); the balanced order balances causal work; a user's Flax model attending with
``jax.nn.dot_product_attention`` trains under ``make_train_step`` with a context axis
as it does on one device, and a model attending otherwise is refused by name."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import mpscale
from mpscale import parallel
from mpscale.trainer.models.lm import causal_attention
from mpscale.trainer.planning import hlo
from tests import helpers


def _mesh(data, context):
  return Mesh(np.array(jax.devices()[:data * context]).reshape(data, context),
              ("data", "context"))


def _qkv(length=32, heads=4, kv_heads=2, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (2, length, heads, 8))
  k, v = (jax.random.normal(key, (2, length, kv_heads, 8)) for key in keys[1:3])
  weights = jax.random.normal(keys[3], q.shape)  # a cotangent that is not all ones
  return (q, k, v), weights


@pytest.mark.parametrize("context,mode,balanced,window", [
    (4, "ring", True, None), (4, "all_gather", True, 5), (2, "ring", False, 7),
    (2, "all_gather", False, None), (4, "ring", True, 5)])
def test_attention_across_the_split_equals_causal_attention(context, mode, balanced,
                                                            window):
  (q, k, v), weights = _qkv()
  order = parallel.context_order(q.shape[1], context, balanced)
  back = np.argsort(order)

  def whole(q, k, v):
    return jnp.sum(causal_attention(q, k, v, window) * weights)

  def split(q, k, v):
    out = parallel.context_attention(
        q[:, order], k[:, order], v[:, order], mesh=_mesh(2, context),
        spec=P("data"), mode=mode, balanced=balanced, window=window)
    return jnp.sum(out[:, back] * weights)

  # The reference compiled as one program too: run eagerly its ops compiled one by
  # one (about 10 s of the test); the same arithmetic either way.
  want, want_grads = jax.jit(jax.value_and_grad(whole, argnums=(0, 1, 2)))(q, k, v)
  got, got_grads = jax.jit(jax.value_and_grad(split, argnums=(0, 1, 2)))(q, k, v)
  helpers.assert_close(got, want, 1e-5)
  helpers.assert_close(got_grads, want_grads, 1e-5)


def test_the_ring_passes_kv_heads_around_the_context_axis_only():
  """Ring: ``context - 1`` K/V transfers forward (two arrays each: K and V, at the
  K/V heads' size), and the backward's K/V and gradients; no all-gather. All-gather:
  no transfer, K and V gathered once each way."""
  (q, k, v), _ = _qkv(heads=4, kv_heads=1)
  mesh = _mesh(2, 4)

  def compiled(mode):
    loss = lambda q, k, v: jnp.sum(parallel.context_attention(  # noqa: E731
        q, k, v, mesh=mesh, spec=P("data"), mode=mode) ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()

  ring = hlo.collectives(compiled("ring"))
  kv_bytes = 4 * k.size // 8  # one device's K (or V): its rows and batch
  assert ring["collective-permute"]["count"] >= 3 * 2
  assert ring["collective-permute"]["bytes"] % kv_bytes == 0
  assert "all-gather" not in ring
  gathered = hlo.collectives(compiled("all_gather"))
  assert "collective-permute" not in gathered
  assert gathered["all-gather"]["count"] >= 2


def test_balanced_order_balances_causal_work():
  """Each device's causal (query, key) pairs: the balanced order within 1.1x of the
  mean (the issue's target), the sequence in order about 2x."""
  length, size = 1024, 8
  for balanced, bound in ((True, 1.1), (False, None)):
    order = parallel.context_order(length, size, balanced)
    work = [int(np.sum(rows + 1)) for rows in np.split(order, size)]
    ratio = max(work) / np.mean(work)
    if bound:
      assert ratio <= bound, ratio
    else:
      assert ratio > 1.8, ratio
  assert sorted(parallel.context_order(length, size)) == list(range(length))


def test_bad_input_is_refused_by_name():
  (q, k, v), _ = _qkv(length=30)
  with pytest.raises(ValueError, match=r"seq_len \(30\).*2 x mesh.context \(8\)"):
    parallel.context_attention(q, k, v, mesh=_mesh(2, 4), spec=P("data"))
  (q, k, v), _ = _qkv()
  with pytest.raises(ValueError, match="context_parallel"):
    parallel.context_attention(q, k, v, mesh=_mesh(2, 4), spec=P("data"),
                               mode="ulysses")


# ------------------------------------------------------------------ a user's model
class Attention(nn.Module):
  own: bool = False  # flax's own attention, which the split cannot follow

  @nn.compact
  def __call__(self, x):
    b, t, w = x.shape
    q = nn.Dense(w)(x).reshape(b, t, 4, w // 4)
    k, v = (nn.Dense(w // 2)(x).reshape(b, t, 2, w // 4) for _ in range(2))
    if self.own:
      k, v = (jnp.repeat(a, 2, axis=2) for a in (k, v))
      mask = nn.make_causal_mask(jnp.ones((b, t)))
      out = nn.dot_product_attention(q, k, v, mask=mask)
    else:
      out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return nn.Dense(w)(out.reshape(b, t, w))


class UserLM(nn.Module):
  own: bool = False

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(64, 32)(tokens) + nn.Embed(16, 32)(jnp.arange(tokens.shape[1]))
    for _ in range(2):
      x = x + Attention(self.own)(nn.LayerNorm()(x))
    return nn.Dense(64)(x)


def _user_loss(model):
  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["inputs"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["targets"]))
  return loss_fn


def _tokens():
  tokens = np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@pytest.mark.parametrize("context,mode", [(2, "ring"), (4, "all_gather")])
def test_a_users_flax_model_equals_itself_on_context_one(context, mode):
  model, batch = UserLM(), _tokens()
  # init as one program (eagerly, each of its ops compiles on its own)
  params = jax.jit(model.init)(jax.random.key(0), batch["inputs"][:1])["params"]
  tx = optax.sgd(0.5)
  init, step = mpscale.make_train_step(_user_loss(model), tx)
  want, want_metrics = step(init(params), batch)
  init, step = mpscale.make_train_step(_user_loss(model), tx,
                                       mesh=_mesh(8 // context, context),
                                       context_parallel=mode)
  got, got_metrics = step(init(params), batch)
  helpers.assert_close(got_metrics["loss"], want_metrics["loss"], 1e-5)
  helpers.assert_close(got.params, want.params, 1e-5)


def test_a_model_attending_otherwise_is_refused_naming_it_and_the_axis():
  model, batch = UserLM(own=True), _tokens()
  params = model.init(jax.random.key(0), batch["inputs"][:1])["params"]
  init, step = mpscale.make_train_step(_user_loss(model), optax.sgd(0.5),
                                       mesh=_mesh(4, 2))
  with pytest.raises(ValueError, match=r"mesh.context \(2\).*loss_fn.*"
                     r"jax.nn.dot_product_attention"):
    step(init(params), batch)
