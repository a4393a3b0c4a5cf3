"""A user's own model and data for mpscale's trainer: a Flax NNX transformer that
learns to add numbers written as text.

Nothing here knows about mpscale except the three functions the config names:

- ``build(config)``: the model (a plain ``nnx.Module``), sized by ``model.args``,
  its layers computing in the run's compute dtype (``dtype=``, as Flax layers take
  it: under O2, float16; the policy keeps norm scales and biases in float32, which
  would otherwise promote every layer whose ``dtype`` is unset to float32);
- ``loss(model, batch)``: ``(loss_sum, num_tokens)`` over the answer digits;
- ``source(config)``: ``{"train": ..., "eval": ...}``, random-access sources of
  examples (``len`` and ``[i]``), each a dict of numpy arrays.

Train it with ``mpscale train --config examples/nnx_transformer/config.yaml`` or from
Python with ``python examples/nnx_transformer/train.py`` (see the README there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

VOCAB = 16
"""Tokens: the digits 0-9, then ``+ = ;`` and padding."""
PLUS, EQUALS, END, PAD = 10, 11, 12, 13


def attention(query, key, value, mask=None, **kwargs):
  """Softmax attention in the inputs' dtype (``jax.nn.dot_product_attention``, which
  ``nnx.MultiHeadAttention`` calls by default, accumulates float16 products in
  float32, which XLA's CPU backend cannot compile)."""
  del kwargs  # dropout and the like: none here
  scale = jnp.asarray(query.shape[-1] ** -0.5, query.dtype)
  logits = jnp.einsum("...qhd,...khd->...hqk", query * scale, key)
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
  # The softmax in float32 (an exponent and a sum), the products in the inputs' dtype.
  weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(value.dtype)
  return jnp.einsum("...hqk,...khd->...qhd", weights, value)


class Block(nnx.Module):
  """Pre-norm causal self-attention and MLP."""

  def __init__(self, d_model: int, num_heads: int, rngs: nnx.Rngs, dtype=None):
    self.norm1 = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(num_heads=num_heads, in_features=d_model,
                                            decode=False, dtype=dtype, rngs=rngs,
                                            attention_fn=attention)
    self.norm2 = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
    self.up = nnx.Linear(d_model, 4 * d_model, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(4 * d_model, d_model, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attention(self.norm1(x), mask=mask)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
  """A decoder-only transformer over `VOCAB` tokens with learned positions."""

  def __init__(self, *, d_model: int, num_heads: int, num_layers: int, max_len: int,
               rngs: nnx.Rngs, dtype=None):
    self.embed = nnx.Embed(VOCAB, d_model, dtype=dtype, rngs=rngs)
    self.position = nnx.Embed(max_len, d_model, dtype=dtype, rngs=rngs)
    # nnx.List holds submodules in flax >= 0.12; older flax takes a plain list.
    self.blocks = getattr(nnx, "List", list)(
        Block(d_model, num_heads, rngs, dtype) for _ in range(num_layers))
    self.norm = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(d_model, VOCAB, dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Logits ``[batch, length, VOCAB]`` of the next token at each position."""
    x = self.embed(tokens) + self.position(jnp.arange(tokens.shape[1]))
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.norm(x))


def build(config) -> Transformer:
  """The model provider: ``model.args`` gives the sizes, ``seed`` the initialization,
  ``precision.policy`` the dtype its layers compute in."""
  import mpscale  # noqa: PLC0415 (the run's policy: what its layers compute in)
  args = config.model.args
  return Transformer(d_model=args.get("d_model", 64), num_heads=args.get("num_heads", 4),
                     num_layers=args.get("num_layers", 2),
                     max_len=args.get("max_len", 32), rngs=nnx.Rngs(config.seed),
                     dtype=mpscale.make_policy(config.precision.policy).compute_dtype)


def loss(model: Transformer, batch: dict) -> tuple[jax.Array, jax.Array]:
  """Cross-entropy summed over the answer tokens, and their count (per-token loss).

  The logits are cast to float32 before the softmax (the model may compute in a
  16-bit dtype under the run's precision policy).
  """
  logits = model(batch["inputs"]).astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits)
  picked = jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)[..., 0]
  return -(picked * batch["mask"]).sum(), batch["mask"].sum()


class Additions:
  """Examples ``a+b=c;`` with ``a, b < 10**digits``, a pure function of ``(seed,
  index)``: a random-access source (``len`` and ``[i]``)."""

  def __init__(self, size: int, digits: int, length: int, seed: int):
    self.size, self.digits, self.length, self.seed = size, digits, length, seed

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> dict:
    rng = np.random.default_rng([self.seed, int(index)])
    a, b = rng.integers(0, 10**self.digits, size=2)
    tokens = [int(d) for d in str(a)] + [PLUS] + [int(d) for d in str(b)] + [EQUALS]
    answer_from = len(tokens)
    tokens += [int(d) for d in str(a + b)] + [END]
    tokens += [PAD] * (self.length + 1 - len(tokens))
    tokens = np.asarray(tokens[:self.length + 1], np.int32)
    mask = np.zeros(self.length, np.float32)
    mask[answer_from - 1:answer_from - 1 + len(str(a + b)) + 1] = 1.0  # c and ';'
    return {"inputs": tokens[:-1], "targets": tokens[1:], "mask": mask}

  def __repr__(self) -> str:
    return f"Additions(size={self.size}, digits={self.digits}, seed={self.seed})"


def source(config) -> dict:
  """The data provider: ``data.args`` gives the split sizes and the digits."""
  args = config.data.args
  digits, length = args.get("digits", 3), config.model.args.get("max_len", 32)
  return {"train": Additions(args.get("train_size", 20000), digits, length, seed=1),
          "eval": Additions(args.get("eval_size", 512), digits, length, seed=2)}
