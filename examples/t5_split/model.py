"""A small T5-shaped encoder-decoder, pipelined with its encoder on the first stages
and its decoder on the rest (``mesh.pipeline_split``, Megatron-LM's
``pipeline_model_parallel_split_rank``), trained by mpscale's trainer::

  mpscale train --config examples/t5_split/config.yaml --devices 4

The task: read a sequence of digits, write it reversed. The encoder's layers are
bidirectional self-attention and an MLP; the decoder's, causal self-attention,
attention to the encoder's output, and an MLP (pre-norm, residual), all in plain JAX
functions of stacked parameters, as `mpscale.SplitPipeline` takes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import mpscale
import mpscale.trainer

DIGITS, BOS = 10, 10
VOCAB = 11


def _norm(x):
  x = x.astype(jnp.float32)
  return ((x - x.mean(-1, keepdims=True))
          * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-6))


def _attend(p, x, context, causal):
  """Single-head scaled dot-product attention of ``x`` over ``context``."""
  q, k, v = x @ p["q"], context @ p["k"], context @ p["v"]
  scores = (q @ jnp.swapaxes(k, -1, -2)).astype(jnp.float32) / np.sqrt(q.shape[-1])
  if causal:
    n = x.shape[-2]
    scores = jnp.where(jnp.tril(jnp.ones((n, n), bool)), scores, -1e9)
  weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return (weights @ v) @ p["o"]


def _mlp(p, x):
  return jax.nn.gelu(x @ p["up"]) @ p["down"]


def encoder_layer(lp, x):
  """One encoder layer: bidirectional self-attention, then an MLP."""
  h = _norm(x).astype(x.dtype)
  x = x + _attend(lp["self"], h, h, causal=False)
  return x + _mlp(lp["mlp"], _norm(x).astype(x.dtype))


def decoder_layer(lp, y, memory):
  """One decoder layer: causal self-attention, attention to the encoder's output
  ``memory``, then an MLP."""
  h = _norm(y).astype(y.dtype)
  y = y + _attend(lp["self"], h, h, causal=True)
  y = y + _attend(lp["cross"], _norm(y).astype(y.dtype), memory.astype(y.dtype),
                  causal=False)
  return y + _mlp(lp["mlp"], _norm(y).astype(y.dtype))


def embed(params, batch):
  """The encoder's input: token and position embeddings of ``src``."""
  return (params["embed"][batch["src"]]
          + params["enc_pos"][: batch["src"].shape[-1]])


def decoder_embed(params, batch):
  """The decoder's input: the target shifted right (``BOS`` first)."""
  return (params["embed"][batch["tgt_in"]]
          + params["dec_pos"][: batch["tgt_in"].shape[-1]])


def head(params, y, batch):
  """Cross-entropy summed over the target tokens, and their count."""
  logits = (_norm(y) @ params["embed"].T.astype(jnp.float32))
  log_probs = jax.nn.log_softmax(logits)
  picked = jnp.take_along_axis(log_probs, batch["tgt_out"][..., None], axis=-1)[..., 0]
  return -(picked * batch["mask"]).sum(), batch["mask"].sum()


def init(key, *, d_model, encoder_layers, decoder_layers, length):
  """Float32 parameters: shared embeddings, positions, the two stacks."""
  keys = iter(jax.random.split(key, 32))
  normal = lambda *shape, scale=0.02: (  # noqa: E731
      scale * jax.random.normal(next(keys), shape, jnp.float32))
  d, f = d_model, 4 * d_model

  def attention(n):
    return {name: normal(n, d, d, scale=d ** -0.5) for name in ("q", "k", "v", "o")}

  def mlp(n):
    return {"up": normal(n, d, f, scale=d ** -0.5), "down": normal(n, f, d,
                                                                   scale=f ** -0.5)}

  return {"embed": normal(VOCAB, d, scale=1.0), "enc_pos": normal(length, d),
          "dec_pos": normal(length, d),
          "encoder": {"self": attention(encoder_layers), "mlp": mlp(encoder_layers)},
          "decoder": {"self": attention(decoder_layers), "cross": attention(
              decoder_layers), "mlp": mlp(decoder_layers)}}


def unpipelined(params, batch):
  """The loss of the whole model on one device: the encoder's layers, then the
  decoder's (the same parameters as the pipeline's, in the same order)."""
  x = embed(params, batch)
  x, _ = jax.lax.scan(lambda h, lp: (encoder_layer(lp, h), None), x, params["encoder"])
  y = decoder_embed(params, batch)
  y, _ = jax.lax.scan(lambda h, lp: (decoder_layer(lp, h, x), None), y,
                      params["decoder"])
  return head(params, y, batch)


def build(config) -> mpscale.trainer.Model:
  """The model provider: ``model.args`` gives the sizes, ``mesh.pipeline_split``
  the stages of the encoder (``mesh.stage`` the stages in all). On one stage (``mpscale
  eval`` or ``sample`` of a run in a process with fewer devices than its mesh, which
  rebuilds it on one device) the model is not pipelined."""
  args, mesh = config.model.args, config.mesh
  sizes = dict(d_model=args.get("d_model", 32),
               encoder_layers=args.get("encoder_layers", 2),
               decoder_layers=args.get("decoder_layers", 2),
               length=args.get("length", 8))
  loss_fn = unpipelined
  if mesh.stage > 1:
    loss_fn = mpscale.SplitPipeline(
        embed, encoder_layer, head, config.train.num_microbatches,
        decoder_embed_fn=decoder_embed, decoder_fn=decoder_layer,
        split=mesh.pipeline_split, num_stages=mesh.stage,
        stages_key="encoder", decoder_key="decoder")
  return mpscale.trainer.Model(init=lambda key: init(key, **sizes), loss_fn=loss_fn,
                               evaluate=unpipelined)


class Reversals:
  """Digit sequences and their reversal, a pure function of ``(seed, index)``."""

  def __init__(self, size: int, length: int, seed: int):
    self.size, self.length, self.seed = size, length, seed

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> dict:
    digits = np.random.default_rng([self.seed, int(index)]).integers(
        0, DIGITS, self.length).astype(np.int32)
    out = digits[::-1].copy()
    return {"src": digits, "tgt_in": np.concatenate([[BOS], out[:-1]]).astype(np.int32),
            "tgt_out": out, "mask": np.ones(self.length, np.float32)}

  def __repr__(self) -> str:
    return f"Reversals(size={self.size}, length={self.length}, seed={self.seed})"


def source(config) -> dict:
  """The data provider: ``data.args`` gives the split sizes."""
  args, length = config.data.args, config.model.args.get("length", 8)
  return {"train": Reversals(args.get("train_size", 20000), length, seed=1),
          "eval": Reversals(args.get("eval_size", 256), length, seed=2)}
