"""The model families of the built-in LM: GPT-2's block, and the Llama block that
Llama, Mistral and Qwen share, with each family's variations.

============  =========  =================  ==========  ===========  ============
family        norm       positions          attention   MLP          extras
============  =========  =================  ==========  ===========  ============
``gpt``       LayerNorm  learned            fused qkv   GELU         biases
``llama``     RMSNorm    RoPE (+ Llama 3.1  q, k, v     SwiGLU       none
                         scaling)           (grouped)
``mistral``   RMSNorm    RoPE               q, k, v     SwiGLU       sliding window
``qwen2``     RMSNorm    RoPE               q, k, v     SwiGLU       q, k, v biases
``qwen3``     RMSNorm    RoPE               q, k, v     SwiGLU       q and k RMSNorms
============  =========  =================  ==========  ===========  ============

The Llama block computes what Hugging Face's ``LlamaDecoderLayer`` (and
``MistralDecoderLayer``, ``Qwen2DecoderLayer``, ``Qwen3DecoderLayer``) compute:
``x + o(attention(rope(q_norm(q(n(x)))), rope(k_norm(k(n(x)))), v(n(x))))``, then
``x + down(silu(gate(n(x))) * up(n(x)))``, where ``n`` is an RMSNorm of its own; grouped
K/V heads serve ``num_heads / num_kv_heads`` query heads each (query head ``i`` reads
K/V head ``i // (num_heads / num_kv_heads)``, as ``repeat_kv`` does). Norm statistics,
the SiLU, the attention softmax and the rotary embedding's angles are computed in
float32, the rotation itself in the activations' dtype (as transformers rotates).

The mixture-of-experts families replace the MLP by ``num_experts`` SwiGLU experts
of which each token goes to ``experts_per_token`` (`mpscale.experts`), as
transformers' ``MixtralSparseMoeBlock`` and ``Qwen3MoeSparseMoeBlock`` compute: the
router's softmax over every expert, the top ``k`` chosen, their weights divided by
their sum (Mixtral always, Qwen3-MoE with ``norm_topk_prob``), each chosen expert's
output weighted and summed.

References:
  Touvron et al., "Llama 2" (2023) and Grattafiori et al., "The Llama 3 Herd of
  Models" (2024), https://arxiv.org/abs/2407.21783 (RoPE scaling: Meta's Llama 3.1
  release); Su et al., "RoFormer" (2021), https://arxiv.org/abs/2104.09864;
  Shazeer, "GLU Variants Improve Transformer" (2020); Ainslie et al., "GQA" (2023);
  Jiang et al., "Mistral 7B" (2023); Qwen team, "Qwen2 / Qwen3 Technical Report".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from mpscale import validation

FAMILIES = ("gpt", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
"""``model.family``'s choices; ``gpt`` is GPT-2's block (`mpscale.trainer.models.lm.Block`),
the others the Llama block (`mpscale.trainer.models.lm.LlamaBlock`)."""

ROLES = {"qkv": ("q", "k", "v"), "out": ("o",), "fc": ("gate", "up"), "proj": ("down",)}
"""The FP8 products of ``precision.fp8.products`` (GPT-2's four: the attention's input
and output projections, the MLP's two) as the Llama block names its matrices."""


@dataclasses.dataclass(frozen=True)
class Traits:
  """What a family changes in the Llama block."""
  qkv_bias: bool = False
  """Biases on the q, k and v projections (Qwen2)."""
  qk_norm: bool = False
  """An RMSNorm over each head's q and k, before the rotary embedding (Qwen3)."""
  sliding_window: bool = False
  """Whether ``sliding_window`` may be set (Mistral)."""
  experts: bool = False
  """A mixture of experts for the MLP (``num_experts`` > 0)."""


TRAITS = {"llama": Traits(), "mistral": Traits(sliding_window=True),
          "qwen2": Traits(qkv_bias=True), "qwen3": Traits(qk_norm=True),
          "mixtral": Traits(sliding_window=True, experts=True),
          "qwen3_moe": Traits(qk_norm=True, experts=True)}


def products(family: str, roles: tuple[str, ...]) -> tuple[str, ...]:
  """The matrices of ``family``'s block that multiply in FP8 for these ``roles``
  (`ROLES`' keys, the names ``precision.fp8.products`` takes)."""
  if family == "gpt":
    return tuple(roles)
  return tuple(name for role in roles for name in ROLES[role])


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.1's rotary-frequency scaling (Hugging Face's ``rope_scaling`` with
  ``rope_type: llama3``): wavelengths longer than ``original_max_position_embeddings
  / low_freq_factor`` are stretched by ``factor``, those shorter than ``... /
  high_freq_factor`` kept, and those between interpolated; ``rope_type: linear``
  divides every frequency by ``factor``."""
  rope_type: str = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  TYPES = ("llama3", "linear")

  @classmethod
  def from_dict(cls, value: Any) -> Optional["RopeScaling"]:
    """A `RopeScaling` of a config's (or ``config.json``'s) ``rope_scaling``
    mapping (``None``: none).

    Raises:
      ArgumentError: naming ``rope_scaling`` (and in its message the key) for a
        type not in `TYPES` or a key of none of the fields.
    """
    if value is None or isinstance(value, cls):
      return value
    if not isinstance(value, dict):
      raise validation.fail("rope_scaling", f" must be a mapping; got {value!r}",
                            validation.ArgumentTypeError)
    value = dict(value)
    kind = value.pop("rope_type", value.pop("type", "llama3"))
    if kind not in cls.TYPES:
      raise validation.fail("rope_scaling", f": rope_type {kind!r} is not supported; "
                            f"choose from {', '.join(cls.TYPES)}")
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in value:
      if key not in fields:
        raise validation.fail("rope_scaling", f": {key!r} is not a setting of the "
                              f"{kind!r} scaling; it takes "
                              f"{', '.join(sorted(fields - {'rope_type'}))}")
    return cls(rope_type=kind, **value)

  def to_dict(self) -> dict[str, Any]:
    """The ``rope_scaling`` mapping Hugging Face's ``config.json`` holds."""
    if self.rope_type == "linear":
      return {"rope_type": "linear", "factor": self.factor}
    return dataclasses.asdict(self)

  def apply(self, inv_freq: jax.Array) -> jax.Array:
    """The scaled inverse frequencies."""
    if self.rope_type == "linear":
      return inv_freq / self.factor
    old = self.original_max_position_embeddings
    low_wavelen = old / self.low_freq_factor
    high_wavelen = old / self.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    stretched = jnp.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
    smooth = ((old / wavelen - self.low_freq_factor)
              / (self.high_freq_factor - self.low_freq_factor))
    between = (1 - smooth) * stretched / self.factor + smooth * stretched
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, between, stretched)


def rope_frequencies(head_dim: int, theta: float,
                     scaling: Optional[RopeScaling] = None) -> jax.Array:
  """The ``head_dim / 2`` inverse frequencies of the rotary embedding, float32."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32)
                              / head_dim))
  return inv_freq if scaling is None else scaling.apply(inv_freq)


def apply_rope(x: jax.Array, inv_freq: jax.Array,
               positions: Optional[Any] = None) -> jax.Array:
  """``x`` (``[batch, length, heads, head_dim]``) rotated by its positions
  (``positions``, one per row; ``None``: ``0..length-1``), the two halves of each
  head as the pairs (Hugging Face's ``rotate_half`` layout). The angles' cosines and sines are computed in float32
  and cast to ``x``'s dtype, and the rotation is done in that dtype, as
  transformers does (a 16-bit rotation keeps its values, and so any collective
  GSPMD places on them, 16-bit)."""
  if positions is None:
    positions = jnp.arange(x.shape[1])
  angles = jnp.asarray(positions, jnp.float32)[:, None] * inv_freq[None, :]
  angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  first, second = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-second, first], axis=-1)
  return x * cos + rotated * sin


class RMSNorm(nn.Module):
  """Root-mean-square norm over the last axis: the statistics in float32, the
  normalized input cast back to its dtype, then times ``scale`` (Llama's order)."""
  eps: float = 1e-6
  dtype: Optional[Any] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = self.dtype or x.dtype
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
    return _rms_norm(x, scale.astype(dtype), self.eps)


@functools.partial(jax.checkpoint, static_argnums=(2,))
def _rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """`RMSNorm` of ``x`` times ``scale``, in ``scale``'s dtype. Under
  ``jax.checkpoint``: the backward keeps ``x`` alone (in its dtype, the compute
  dtype in a block) and recomputes the float32 ``x`` and its norm, which it kept
  otherwise (about ``10 * d_model`` bytes a token)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return scale * x32.astype(scale.dtype)
