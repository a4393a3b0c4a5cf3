"""The keys a stochastic model's draws use: one rule for the step and the pipeline.

A run holds one key ``rng`` (raw ``uint32`` key data in a `mpscale.TrainState`), and
every draw derives from it by ``jax.random.fold_in``::

  step n         step_key(rng, n)            = fold_in(rng, n)
  micro-batch k  microbatch_key(that, k)     = fold_in(step key, k)
  replica r      replica_key(that, r)        = fold_in(micro-batch key, r)
                 (only where each data replica draws for its own rows)
  layer l        fold_in(that, 1 + l)        (a `mpscale.Pipeline`'s layers; its
                                              embedding 0, its head 1 + num_layers)

So masks differ by step, micro-batch, replica and layer, and a resumed run draws
exactly what an uninterrupted one would.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def typed(rng: jax.Array) -> jax.Array:
  """``rng`` as a typed key (raw ``uint32`` key data is wrapped)."""
  if jnp.issubdtype(jnp.result_type(rng), jax.dtypes.prng_key):
    return rng
  return jax.random.wrap_key_data(rng)


def step_key(rng: jax.Array, step: Any) -> jax.Array:
  """The key of step ``step`` of a run whose `TrainState` holds ``rng``:
  ``fold_in(rng, step)`` (a typed key)."""
  return jax.random.fold_in(typed(rng), step)


def microbatch_key(rng: jax.Array, microbatch: Any) -> jax.Array:
  """The key micro-batch ``microbatch`` of a step draws from: ``fold_in(rng, k)``
  (``rng`` the step's key, `step_key`)."""
  return jax.random.fold_in(typed(rng), microbatch)


def replica_key(rng: jax.Array, replica: Any) -> jax.Array:
  """The key data replica ``replica`` draws from for its rows of one micro-batch:
  ``fold_in(rng, r)`` (``rng`` the micro-batch's key, `microbatch_key`)."""
  return jax.random.fold_in(typed(rng), replica)
