"""The router of a mixture of experts: which experts each token goes to, with what
weight, and the losses and state that keep the experts' loads even.

::

  logits = x @ router                                 # float32, [tokens, experts]
  scores = softmax(logits)  or  sigmoid(logits)       # Routing.score
  chosen = top_k(scores + bias)                       # the bias only chooses
  weights = scores[chosen]  (/ their sum, Routing.normalize) * Routing.scale
  aux_loss = experts * sum_e (tokens sent to e / tokens) * mean(probs[:, e])
  z_loss = mean(logsumexp(logits) ** 2)
  bias += bias_rate * sign(mean load - load)          # after the step (update_bias)

The router's math is float32 whatever the activations' dtype: its logits are where
16-bit training overflows first.

References:
  Fedus et al., "Switch Transformers" (2021), https://arxiv.org/abs/2101.03961 (the
  load-balancing loss); Zoph et al., "ST-MoE" (2022), https://arxiv.org/abs/2202.08906
  (the router z-loss); Jiang et al., "Mixtral of Experts" (2024); DeepSeek-AI,
  "DeepSeek-V3 Technical Report" (2024), https://arxiv.org/abs/2412.19437 (sigmoid
  gating and the auxiliary-loss-free balancing bias); Hugging Face transformers'
  ``MixtralSparseMoeBlock`` and ``load_balancing_loss_func``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from mpscale import validation

SCORES = ("softmax", "sigmoid")
"""`Routing.score`'s choices."""


@dataclasses.dataclass(frozen=True)
class Routing:
  """How tokens are routed to experts (checked when made).

  Attributes:
    num_experts: routed experts (``E``).
    top_k: experts each token goes to (``k <= E``).
    score: ``softmax`` (Mixtral, Qwen3-MoE) or ``sigmoid`` (DeepSeek-V3) of the
      router's logits.
    normalize: divide the chosen experts' weights by their sum (Mixtral always;
      Qwen3-MoE's ``norm_topk_prob``; DeepSeek-V3's ``norm_topk_prob``).
    scale: a factor on every weight (DeepSeek-V3's ``routed_scaling_factor``).
    bias_rate: the auxiliary-loss-free balancing bias's step (DeepSeek-V3's
      ``gamma``, 0.001); 0: no bias.
    capacity_factor: ``None``: dropless (every assignment is computed); else each
      expert takes at most ``ceil(capacity_factor * tokens * k / E)`` of a device's
      assignments, in token order, and drops the rest (GShard's capacity).
  """
  num_experts: int
  top_k: int
  score: str = "softmax"
  normalize: bool = True
  scale: float = 1.0
  bias_rate: float = 0.0
  capacity_factor: Optional[float] = None

  def __post_init__(self):
    validation.positive_int("num_experts", self.num_experts)
    validation.positive_int("top_k", self.top_k)
    if self.top_k > self.num_experts:
      raise validation.ArgumentError(
          ("top_k", "num_experts"),
          f"{{0}} ({self.top_k}) is above {{1}} ({self.num_experts}): a token "
          "cannot go to more experts than there are")
    validation.one_of("score", self.score, SCORES)
    validation.boolean("normalize", self.normalize)
    validation.positive_float("scale", self.scale)
    validation.non_negative_float("bias_rate", self.bias_rate)
    if self.capacity_factor is not None:
      validation.positive_float("capacity_factor", self.capacity_factor)

  def capacity(self, tokens: int) -> int:
    """Assignments an expert takes of ``tokens`` tokens (``capacity_factor``)."""
    assert self.capacity_factor is not None
    return max(1, -(-int(self.capacity_factor * tokens * self.top_k)
                    // self.num_experts))


class Routes(NamedTuple):
  """Where a batch of tokens goes (`route`)."""
  experts: jax.Array
  """``[tokens, k]`` int32: each token's chosen experts, best first."""
  weights: jax.Array
  """``[tokens, k]`` float32: the weight of each chosen expert's output."""
  probs: jax.Array
  """``[tokens, E]`` float32: the scores the load-balancing loss averages (softmax;
  for sigmoid scores, each token's scores over their sum)."""
  z: jax.Array
  """``[tokens]`` float32: the logits' log-sum-exp (the z-loss's)."""


def route(x: jax.Array, router: jax.Array, routing: Routing,
          bias: Optional[jax.Array] = None) -> Routes:
  """The routes of tokens ``x`` (``[tokens, d]``) by ``router`` (``[d, E]``), in
  float32; ``bias`` (``[E]``, `Routing.bias_rate`) shifts which experts are chosen
  but not their weights."""
  logits = _logits(x, router)
  if routing.score == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
    probs = scores
  else:
    scores = jax.nn.sigmoid(logits)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
  choose = scores if bias is None else scores + bias.astype(jnp.float32)
  _, experts = jax.lax.top_k(choose, routing.top_k)
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if routing.normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  weights = weights * jnp.float32(routing.scale)
  return Routes(experts.astype(jnp.int32), weights, probs,
                jax.nn.logsumexp(logits, axis=-1))


@jax.checkpoint
def _logits(x: jax.Array, router: jax.Array) -> jax.Array:
  """``x @ router`` in float32. Under ``jax.checkpoint``: the backward keeps ``x``
  in its own dtype (the compute dtype in a model) and casts it again, rather than
  keeping its float32 copy (``4 * d`` bytes a token)."""
  return jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)


def expert_counts(experts: jax.Array, num_experts: int) -> jax.Array:
  """Assignments to each expert (``[E]`` float32) of ``experts`` (any shape)."""
  return jnp.zeros((num_experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)


def load_balancing_loss(counts: jax.Array, prob_sums: jax.Array, tokens: jax.Array
                        ) -> jax.Array:
  """The load-balancing loss ``E * sum_e (counts_e / tokens) * (prob_sums_e /
  tokens)``: 1 per chosen expert (``k``) when the load and the probabilities are
  uniform. ``counts`` are the assignments to each expert, ``prob_sums`` each
  expert's probabilities summed over the tokens (`Routes.probs`): sums, so that a
  batch split over devices adds them up before the product (the loss of the whole
  batch, as transformers' ``load_balancing_loss_func`` computes it for a layer)."""
  num_experts = counts.shape[-1]
  return num_experts * jnp.sum(counts * prob_sums) / jnp.square(tokens)


def update_bias(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3's auxiliary-loss-free balancing: each expert's bias raised by
  ``rate`` where it took fewer assignments than the mean (``counts``, ``[..., E]``),
  lowered where more (unchanged where equal). Shapes ``[..., E]``; float32."""
  mean = jnp.mean(counts, axis=-1, keepdims=True)
  return (bias + jnp.float32(rate) * jnp.sign(mean - counts)).astype(bias.dtype)
