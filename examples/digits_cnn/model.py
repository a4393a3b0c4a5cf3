"""A user's own stateful, stochastic model for mpscale's trainer: a small ResNet-style
CNN in Flax NNX, with BatchNorm and dropout, that classifies scikit-learn's handwritten
digits (8x8 grey images, 10 classes).

Nothing here knows about mpscale except the four functions the config names:

- ``build(config)``: the model (a plain ``nnx.Module``), sized by ``model.args``;
- ``loss(model, batch)``: ``(loss_sum, num_examples)``, float32 cross-entropy;
- ``metrics(model, batch)``: ``{"accuracy": (num_correct, num_examples)}``;
- ``source(config)``: ``{"train": ..., "eval": ...}``, random-access sources of
  examples (``len`` and ``[i]``), each a dict of numpy arrays.

The model has state beside its parameters: BatchNorm's running mean and variance
(``nnx.BatchStat``), updated by every training step, and the dropout RNG stream
(``nnx.Rngs``), advanced by every training step. ``model.train()`` uses the batch's
statistics and drops units; ``model.eval()`` uses the running statistics and keeps
every unit.

Mixed precision: under a 16-bit policy (O2: float16 compute) the trainer hands the
model float16 weights. The model computes in its convolution kernels' dtype, with
two exceptions kept in float32, as MindSpore's O2 level does: BatchNorm (its
statistics, a mean of squares, overflow or lose precision in float16) and the
softmax cross-entropy (the logits are cast to float32 first). The convolutions have no
bias (BatchNorm's shift follows each), so no float32 bias promotes them to float32.

Train it with ``mpscale train --config examples/digits_cnn/config.yaml`` or from
Python with ``python examples/digits_cnn/train.py`` (see the examples' README).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

NUM_CLASSES = 10
IMAGE_SHAPE = (8, 8, 1)
"""Height, width, channels of one digit."""


def _batch_norm(norm: nnx.BatchNorm, x: jax.Array) -> jax.Array:
  """``norm(x)`` computed in float32, returned in ``x``'s dtype."""
  return norm(x.astype(jnp.float32)).astype(x.dtype)


def _norm(features: int, rngs: nnx.Rngs) -> nnx.BatchNorm:
  # momentum 0.9, not flax's 0.99: a run is a few hundred steps, and the running
  # statistics evaluation uses should follow the weights that closely.
  return nnx.BatchNorm(features, momentum=0.9, dtype=jnp.float32, rngs=rngs)


def _conv(in_features: int, out_features: int, rngs: nnx.Rngs) -> nnx.Conv:
  return nnx.Conv(in_features, out_features, kernel_size=(3, 3), padding="SAME",
                  use_bias=False, rngs=rngs)


class ResidualBlock(nnx.Module):
  """``relu(x + bn(conv(relu(bn(conv(x))))))``, at a constant width."""

  def __init__(self, features: int, rngs: nnx.Rngs):
    self.conv1 = _conv(features, features, rngs)
    self.norm1 = _norm(features, rngs)
    self.conv2 = _conv(features, features, rngs)
    self.norm2 = _norm(features, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    y = nnx.relu(_batch_norm(self.norm1, self.conv1(x)))
    y = _batch_norm(self.norm2, self.conv2(y))
    return nnx.relu(x + y)


class DigitsCNN(nnx.Module):
  """Stem convolution, residual blocks at 8x8, global average pooling, dropout and a
  linear head: logits ``[batch, NUM_CLASSES]`` of images ``[batch, 8, 8, 1]``."""

  def __init__(self, *, channels: int, blocks: int, dropout: float, rngs: nnx.Rngs):
    self.stem = _conv(IMAGE_SHAPE[-1], channels, rngs)
    self.stem_norm = _norm(channels, rngs)
    # nnx.List holds submodules in flax >= 0.12; older flax takes a plain list.
    self.blocks = getattr(nnx, "List", list)(
        ResidualBlock(channels, rngs) for _ in range(blocks))
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.head = nnx.Linear(channels, NUM_CLASSES, rngs=rngs)

  def __call__(self, images: jax.Array) -> jax.Array:
    # Compute in the weights' dtype (float16 under O2), whatever the images' dtype.
    x = images.astype(self.stem.kernel.dtype)
    x = nnx.relu(_batch_norm(self.stem_norm, self.stem(x)))
    for block in self.blocks:
      x = block(x)
    x = self.dropout(x.mean(axis=(1, 2)))
    return self.head(x)


def build(config) -> DigitsCNN:
  """The model provider: ``model.args`` gives the sizes, ``seed`` the initialization
  (stream ``params``) and the dropout masks (stream ``dropout``)."""
  args = getattr(config.model, "args", {}) or {}
  return DigitsCNN(channels=args.get("channels", 32), blocks=args.get("blocks", 2),
                   dropout=args.get("dropout", 0.2),
                   rngs=nnx.Rngs(params=config.seed, dropout=config.seed + 1))


def _logits(model: DigitsCNN, batch: dict) -> jax.Array:
  return model(batch["image"]).astype(jnp.float32)


def loss(model: DigitsCNN, batch: dict) -> tuple[jax.Array, jax.Array]:
  """Softmax cross-entropy summed over the batch, in float32, and the example count
  (the trainer divides the one by the other)."""
  log_probs = jax.nn.log_softmax(_logits(model, batch))
  picked = jnp.take_along_axis(log_probs, batch["label"][:, None], axis=-1)[:, 0]
  return -picked.sum(), jnp.asarray(picked.shape[0], jnp.float32)


def metrics(model: DigitsCNN, batch: dict) -> dict[str, tuple[jax.Array, jax.Array]]:
  """Evaluation metrics as ``name -> (sum, count)``, averaged as ``sum / count`` over
  the evaluation batches: the accuracy."""
  predicted = _logits(model, batch).argmax(axis=-1)
  correct = (predicted == batch["label"]).sum().astype(jnp.float32)
  return {"accuracy": (correct, jnp.asarray(predicted.shape[0], jnp.float32))}


# ------------------------------------------------------------------ data


class Digits:
  """Some of scikit-learn's 1,797 digits, in a fixed order: a random-access source
  (``len`` and ``[i]``) of ``{"image": float32 [8, 8, 1] in [0, 1],
  "label": int32}``."""

  def __init__(self, images: np.ndarray, labels: np.ndarray, name: str):
    self.images, self.labels, self.name = images, labels, name

  def __len__(self) -> int:
    return len(self.labels)

  def __getitem__(self, index: int) -> dict:
    return {"image": self.images[index], "label": self.labels[index]}

  def __repr__(self) -> str:
    return f"Digits({self.name}, {len(self)} examples)"


def load_digits(test_size: int, split_seed: int = 0) -> dict[str, Digits]:
  """``{"train": ..., "eval": ...}``: scikit-learn's digits (shipped inside the
  package: nothing is downloaded), split by a permutation seeded with ``split_seed``,
  the last ``test_size`` of it held out."""
  try:
    from sklearn import datasets  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ImportError("the digits example reads scikit-learn's digits data set: "
                      "pip install scikit-learn (or pip install 'mpscale[examples]')"
                      ) from None
  digits = datasets.load_digits()
  images = (digits.images / 16.0).astype(np.float32).reshape(-1, *IMAGE_SHAPE)
  labels = digits.target.astype(np.int32)
  if not 0 < test_size < len(labels):
    raise ValueError(f"test_size must be in (0, {len(labels)}), got {test_size}")
  order = np.random.default_rng(split_seed).permutation(len(labels))
  train, test = order[:-test_size], order[-test_size:]
  return {"train": Digits(images[train], labels[train], "train"),
          "eval": Digits(images[test], labels[test], "test")}


def source(config) -> dict:
  """The data provider: ``data.args.test_size`` examples held out (default 384: six
  batches of 64, as the trainer evaluates whole batches), the other 1,413 trained on;
  ``data.args.split_seed`` fixes the split."""
  args = getattr(config.data, "args", {}) or {}
  return load_digits(args.get("test_size", 384), args.get("split_seed", 0))
