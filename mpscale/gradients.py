"""The result every gradient source of a train step returns."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class Gradients(NamedTuple):
  """What `mpscale.accumulate_gradients` and `mpscale.Pipeline.value_and_grad` return.
  """
  grads: Any
  """float32 gradients of ``loss_scale * loss``, shaped like the params."""
  loss: jax.Array
  """The unscaled float32 loss: the mean over micro-batches, or the loss sum over the
  token count with ``per_token_loss``."""
  num_tokens: jax.Array
  """The token count with ``per_token_loss``; else the number of batch rows (or, for
  a pipeline, of micro-batches x data replicas)."""
