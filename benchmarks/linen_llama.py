"""A user's Llama written as plain Flax linen, for `bench_maxtext.py`: the model a
user brings (``model.provider``), knowing nothing of mpscale.

MaxText's ``llama2-7b`` block: RMSNorm, rotary positions (base 10,000, halves
rotated), multi-head attention without biases, SwiGLU, an untied head. The layers
are one ``nn.scan`` over a ``nn.remat`` block (each layer recomputed, as MaxText's
``remat_policy=full``). Attention is ``model.args.attention``: ``cudnn``
(``jax.nn.dot_product_attention``'s cuDNN kernel) or ``xla``: the scores in the
compute dtype and the softmax in float32, as a linen user writes it (and as MaxText's
``dot_product`` computes).

Nothing here imports mpscale but ``build``, which reads the run's compute dtype.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  y = x.astype(jnp.float32)
  y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + eps)
  return (y * scale).astype(x.dtype)


def rotate(x: jax.Array, theta: float) -> jax.Array:
  """Rotary positions of ``[batch, length, heads, head_dim]``, halves rotated."""
  half = x.shape[-1] // 2
  freq = theta ** (-np.arange(half, dtype=np.float32) / half)
  angle = np.arange(x.shape[1], dtype=np.float32)[:, None] * freq
  cos, sin = (jnp.asarray(f(angle), x.dtype)[None, :, None, :] for f in (np.cos, np.sin))
  a, b = x[..., :half], x[..., half:]
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, kind: str) -> jax.Array:
  if kind == "cudnn":
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  length = q.shape[1]
  logits = jnp.einsum("bqhd,bkhd->bhqk", q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype), k)
  logits = jnp.where(jnp.tril(jnp.ones((length, length), bool)), logits,
                     jnp.finfo(logits.dtype).min)
  weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class Block(nn.Module):
  d_model: int
  num_heads: int
  d_ff: int
  attention: str
  dtype: jnp.dtype
  eps: float = 1e-5
  theta: float = 10000.0

  @nn.compact
  def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
    dense = lambda n, name: nn.DenseGeneral(  # noqa: E731
        n, use_bias=False, dtype=self.dtype, name=name,
        kernel_init=nn.initializers.normal(0.02))
    ones = nn.initializers.ones
    head_dim = self.d_model // self.num_heads
    h = rms_norm(x, self.param("attention_norm", ones, (self.d_model,)), self.eps)
    q, k, v = (dense((self.num_heads, head_dim), name)(h) for name in "qkv")
    # The trainer initializes a linen module by running it on the CPU, where cuDNN's
    # kernel does not lower; attention holds no parameters, so XLA's serves there.
    kind = "xla" if self.is_initializing() else self.attention
    o = attend(rotate(q, self.theta), rotate(k, self.theta), v, kind)
    x = x + nn.DenseGeneral(self.d_model, axis=(-2, -1), use_bias=False,
                            dtype=self.dtype, name="o",
                            kernel_init=nn.initializers.normal(0.02))(o)
    h = rms_norm(x, self.param("mlp_norm", ones, (self.d_model,)), self.eps)
    h = nn.silu(dense(self.d_ff, "gate")(h)) * dense(self.d_ff, "up")(h)
    return x + dense(self.d_model, "down")(h), None


class Llama(nn.Module):
  vocab: int
  d_model: int
  num_heads: int
  num_layers: int
  d_ff: int
  attention: str
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = nn.Embed(self.vocab, self.d_model, dtype=self.dtype, name="embed",
                 embedding_init=nn.initializers.normal(1.0))(tokens)
    layers = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                     split_rngs={"params": True}, length=self.num_layers)
    x, _ = layers(self.d_model, self.num_heads, self.d_ff, self.attention,
                  self.dtype, name="layers")(x, None)
    x = rms_norm(x, self.param("norm", nn.initializers.ones, (self.d_model,)), 1e-5)
    return nn.Dense(self.vocab, use_bias=False, dtype=self.dtype, name="head")(x)


def build(config) -> Llama:
  """The model provider: ``model.args`` gives the sizes and the attention."""
  import mpscale  # noqa: PLC0415 (the run's compute dtype)
  a = config.model.args
  return Llama(a["vocab"], a["d_model"], a["num_heads"], a["num_layers"], a["d_ff"],
               a.get("attention", "xla"),
               mpscale.make_policy(config.precision.policy).compute_dtype)


def loss(model: Llama, batch: dict) -> tuple[jax.Array, jax.Array]:
  """Cross-entropy summed over the tokens, and their count."""
  logits = model(batch["inputs"]).astype(jnp.float32)
  picked = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None],
                               axis=-1)[..., 0]
  return -picked.sum(), jnp.float32(picked.size)


class Tokens:
  """Random tokens, a pure function of the index (a random-access source)."""

  def __init__(self, size: int, length: int, vocab: int):
    self.size, self.length, self.vocab = size, length, vocab

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> dict:
    t = np.random.default_rng(int(index)).integers(0, self.vocab, self.length + 1,
                                                   dtype=np.int32)
    return {"inputs": t[:-1], "targets": t[1:]}


def source(config) -> dict:
  a = config.model.args
  return {"train": Tokens(1024, a["seq_len"], a["vocab"])}
