"""The result every gradient source of a train step returns, and the dtype its sums
may be asked to take."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpscale import validation


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


def check_grad_reduce_dtype(value: Any) -> Optional[np.dtype]:
  """``grad_reduce_dtype`` (of `make_train_step`, `accumulate_gradients`) checked:
  ``None`` or float32 (a dtype, or its name ``"float32"``).

  A 16-bit dtype is refused: a sum narrower than XLA's own choice (which is float32
  after the loop of micro-batches on replicated parameters) is no option here.

  Raises:
    ArgumentError: naming ``grad_reduce_dtype``, for another dtype
      (`mpscale.validation`; an ``ArgumentTypeError`` for what is no dtype).
  """
  if value is None:
    return None
  try:
    dtype = jnp.dtype(value)
  except (TypeError, ValueError):
    raise validation.fail("grad_reduce_dtype", " must be None or float32; got "
                          f"{value!r}", validation.ArgumentTypeError) from None
  if dtype != jnp.float32:
    raise validation.fail("grad_reduce_dtype", " must be None (XLA's choice) or "
                          f"float32; got {dtype}")
  return dtype
