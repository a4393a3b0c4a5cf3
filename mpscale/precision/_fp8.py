"""FP8 matrix products with their scaling state: delayed, current and blockwise scaling.

A product ``fp8_dot_general(lhs, rhs, dimension_numbers, state, recipe)`` casts both
operands to e4m3 (``float8_e4m3fn``, largest finite 448) and its output gradient to
e5m2 (``float8_e5m2``, 57344): Transformer Engine's ``Format.HYBRID``. Each cast
multiplies by a float32 ``scale`` first and saturates at the format's largest value;
the product divides by the operands' scales after the matrix product. The ``state``
is three per-tensor `Fp8Meta` ``(scale, amax_history)``: lhs (the input), rhs (the
kernel), grad (the output gradient). It flows as Flax's own FP8 products keep theirs
(``flax.linen.fp8_ops``): it lives in the ``_overwrite_with_gradient`` collection
(`OVERWRITE_WITH_GRADIENT`), and the product's ``jax.custom_vjp`` returns as the
*gradient* of the state its updated value, so a train step replaces the state by its
gradient instead of handing it to the optimizer (`split_overwrite`).

Delayed scaling (TE's ``DelayedScaling``), per product and step::

  for x, meta in (lhs, state.lhs), (rhs, state.rhs):          # forward, e4m3
    q_x = saturate(x * meta.scale)                 # the scale earlier steps chose
    history = roll(meta.amax_history, amax(x))     # history[0] is this step's amax
    new_meta = Fp8Meta(scale_from(reduce(history), meta.scale), history)
  out = dot(q_lhs, q_rhs) / (lhs_scale * rhs_scale)          # one FP8 GEMM
  # backward, the output gradient g, e5m2, its meta updated the same way
  q_g = saturate(g * state.grad.scale)
  d_lhs = dot(q_g, q_rhs) / (g_scale * rhs_scale)            # FP8 GEMMs, e5m2 x e4m3
  d_rhs = dot(q_lhs, q_g) / (lhs_scale * g_scale)
  d_state = Fp8State(new lhs meta, new rhs meta, new grad meta)

  scale_from(a, old) = fp8_max / a / 2**margin   if 0 < a < inf, else old
  reduce(history) = max(history)  ("max")  or  history[0]  ("most_recent")
  amax(x) = max |x| over x's elements, NaNs left out (TE's fmaxf reductions)

Current scaling (TE's ``Float8CurrentScaling``) quantizes each tensor with the scale
of its own amax, ``scale_from(amax(x), meta.scale)`` (one more reduction over x); the
state still records the histories (for logs and studies) and that scale. Blockwise
scaling (DeepSeek-V3's fine-grained recipe) gives each 1 x 128 tile of an operand
along its contraction, and each 128 x 128 block of the kernel (rhs), a scale of its
own amax (``scale_from(a, 1)``; no history); the state records the per-tensor amaxes.

A scale past float32's range (an amax under 448 / 3.4e38) is float32's largest
(TE's ``compute_scale_from_amax``), never inf. Where ``fp8_max / amax`` is not a power
of two, ``1 / (lhs_scale * rhs_scale)`` is rounded to the output dtype (bfloat16:
2**-9 relative), as XLA's FP8 GEMM takes it.

On Hopper GPUs XLA turns the per-tensor products (delayed and current) into FP8
GEMMs: cuBLASLt's ``__cublas$lt$matmul$f8`` custom calls, or Triton GEMMs of f8
operands where XLA's Triton GEMMs are on (its default); both compute from the f8
values, one e5m2 operand in the backward. The f8 values feed the GEMMs directly (not
as an FP8-to-compute-dtype round trip before a ``dot``): XLA's GPU compiler elides such
round trips (``xla_allow_excess_precision``, on by default) where no FP8 GEMM takes
them, which would silently skip the rounding. Blockwise scales vary along the
contraction, which no FP8 GEMM of XLA's takes: its operands are quantized, held in
FP8 behind ``lax.optimization_barrier`` (so the rounding happens) and dequantized to
the compute dtype, and the products run in it (DeepSeek's own kernels, DeepGEMM, are
not XLA's). ``tests/integration/test_fp8_gpu_compile.py`` reads the H100 programs.

Under data parallelism with ``jit`` the amaxes are global reductions (every replica
records the same); where replicas or micro-batches differentiate separately (a
``shard_map``, a ``vmap`` or a ``scan`` over micro-batches), their updated states
combine with `merge`, `merge_stacked` or `merge_across` into one. A state is used
by one call of its product per differentiation (as Flax's): two calls' updates would
be summed.

References:
  Micikevicius et al., "FP8 Formats for Deep Learning", 2022.
  https://arxiv.org/abs/2209.05433
  Transformer Engine, ``transformer_engine.common.recipe.DelayedScaling`` and
  ``Float8CurrentScaling``:
  https://docs.nvidia.com/deeplearning/transformer-engine/user-guide/api/common.html;
  the amax history roll and scale update: the kernel of
  ``transformer_engine/common/recipe/delayed_scaling.cu``, and
  ``compute_scale_from_amax`` of ``recipe_common.cuh``.
  Flax, ``flax/linen/fp8_ops.py`` (the ``_overwrite_with_gradient`` collection;
  Flax's ``scale`` is the reciprocal of this module's).
  DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 3.3.
  https://arxiv.org/abs/2412.19437
  XLA's FP8 GEMM rewrite: https://github.com/openxla/xla/discussions/22; the elided
  round trips: https://github.com/openxla/xla/issues/41605.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpscale import validation

E4M3 = jnp.float8_e4m3fn
"""The forward operands' format (largest finite 448)."""
E5M2 = jnp.float8_e5m2
"""The gradients' format (largest finite 57344)."""
_FP8_MAX = {np.dtype(E4M3): 448.0, np.dtype(E5M2): 57344.0}

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"
"""The Flax collection holding FP8 scaling state (``flax.linen.fp8_ops``' name): its
leaves are replaced by their gradients, not updated by the optimizer."""

RECIPES = ("delayed", "current", "blockwise")
AMAX_COMPUTE = ("max", "most_recent")


# ------------------------------------------------------------------ recipe and state
@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
  """How an FP8 product scales its operands (build it with `make_fp8_recipe`)."""
  name: str
  """``"delayed"``, ``"current"`` or ``"blockwise"``."""
  history_len: int
  """Steps of amax history each meta keeps."""
  margin: int
  """``scale = fp8_max / amax / 2**margin``."""
  amax_compute: str
  """How delayed scaling reduces the history: ``"max"`` or ``"most_recent"``."""
  block_size: int
  """Blockwise tiles' and blocks' side (DeepSeek-V3: 128)."""


def make_fp8_recipe(name: str = "delayed", *, history_len: int = 1024, margin: int = 0,
               amax_compute: str = "max", block_size: int = 128) -> Fp8Recipe:
  """A checked `Fp8Recipe`.

  Args:
    name: ``"delayed"`` (the scale from earlier steps' amaxes, TE's
      ``DelayedScaling``), ``"current"`` (each tensor's own amax, TE's
      ``Float8CurrentScaling``) or ``"blockwise"`` (DeepSeek-V3: a scale per 1 x
      ``block_size`` tile of an operand along its contraction and per ``block_size``
      squared block of the kernel).
    history_len: amax steps each meta keeps; >= 1 (TE's ``amax_history_len``,
      default 1024).
    margin: the scale leaves ``2**margin`` of headroom; an int >= 0 (TE's
      ``margin``).
    amax_compute: ``"max"`` of the history or its ``"most_recent"`` entry (delayed
      scaling; TE's ``amax_compute_algo``).
    block_size: blockwise tiles' side; >= 1.

  Returns:
    The `Fp8Recipe`.

  Raises:
    ArgumentError: naming the argument at fault.
  """
  validation.one_of("recipe", name, RECIPES)
  validation.positive_int("history_len", history_len)
  validation.integer("margin", margin, 0)
  validation.one_of("amax_compute", amax_compute, AMAX_COMPUTE)
  validation.positive_int("block_size", block_size)
  return Fp8Recipe(name, int(history_len), int(margin), amax_compute, int(block_size))


class Fp8Meta(NamedTuple):
  """One tensor's scaling state."""
  scale: jax.Array
  """float32 ``()``: the multiplier before the cast (``q = saturate(x * scale)``);
  delayed scaling quantizes the next step with it."""
  amax_history: jax.Array
  """float32 ``(history_len,)``: the latest amaxes, ``[0]`` the newest (TE's and
  Flax's roll: ``roll(h, -1)`` then ``[0] = amax``)."""


class Fp8State(NamedTuple):
  """An FP8 product's state: the metas of its two operands and output gradient."""
  lhs: Fp8Meta
  """The input's (e4m3)."""
  rhs: Fp8Meta
  """The kernel's (e4m3)."""
  grad: Fp8Meta
  """The output gradient's (e5m2)."""


def fp8_state(recipe: Fp8Recipe) -> Fp8State:
  """A product's first state: scales 1, histories of ``recipe.history_len`` zeros.

  Args:
    recipe: an `Fp8Recipe`.

  Returns:
    An `Fp8State` of float32 arrays.
  """
  recipe = recipe_of(recipe)
  meta = lambda: Fp8Meta(jnp.ones((), jnp.float32),
                         jnp.zeros((recipe.history_len,), jnp.float32))
  return Fp8State(meta(), meta(), meta())


def recipe_of(value: Any) -> Fp8Recipe:
  if not isinstance(value, Fp8Recipe):
    raise validation.fail("recipe", " must be an Fp8Recipe (mpscale.make_fp8_recipe); got "
                          f"{type(value).__name__}", validation.ArgumentTypeError)
  return value


# ------------------------------------------------------------------ casts and scales
def _fp8_max(name: str, dtype: Any) -> float:
  try:
    return _FP8_MAX[np.dtype(dtype)]
  except (KeyError, TypeError):
    raise validation.fail(
        name, f" must be jnp.float8_e4m3fn or jnp.float8_e5m2; got {dtype!r}",
        validation.ArgumentTypeError) from None


def quantize(x: jax.Array, scale: Any, dtype: Any) -> jax.Array:
  """``x * scale`` cast to ``dtype``, saturating: ``clip(x * scale, -max, max)`` in
  float32, then the cast (round to nearest even). NaN stays NaN; +-inf becomes +-max.

  Args:
    x: a float array.
    scale: float32, broadcastable to ``x`` (a scalar, or per-block scales expanded).
    dtype: ``jnp.float8_e4m3fn`` (max 448) or ``jnp.float8_e5m2`` (max 57344).

  Returns:
    ``x``'s shape in ``dtype``.
  """
  bound = _fp8_max("dtype", dtype)
  scaled = jnp.asarray(x).astype(jnp.float32) * jnp.asarray(scale, jnp.float32)
  clipped = jnp.clip(scaled, -bound, bound)
  if jnp.dtype(dtype) == jnp.dtype(E5M2):
    clipped = _e5m2_values(clipped)
  return clipped.astype(dtype)


def _e5m2_values(y: jax.Array) -> jax.Array:
  """``y`` (float32, within e5m2's range) rounded to nearest even e5m2 values, still
  float32, so that the cast to e5m2 is exact: older XLA CPU backends (jax 0.7) cast
  float32 to e5m2 through float16, rounding twice (1.12501 became 1.0, not 1.25).
  Normal values keep 2 of float32's 23 mantissa bits; subnormal ones (below
  2^-14) are multiples of 2^-16."""
  bits = lax.bitcast_convert_type(y, jnp.uint32)
  odd = (bits >> 21) & jnp.uint32(1)
  normal = lax.bitcast_convert_type(
      (bits + jnp.uint32(0xFFFFF) + odd) & jnp.uint32(0xFFE00000), jnp.float32)
  subnormal = jnp.round(y * 2.0**16) * 2.0**-16
  return jnp.where(jnp.abs(y) < 2.0**-14, subnormal,
                   jnp.where(jnp.isnan(y), y, normal))


def dequantize(q: jax.Array, scale: Any, dtype: Any = jnp.float32) -> jax.Array:
  """``q / scale`` in ``dtype``: the value `quantize` rounded (division in float32).

  Args:
    q: an FP8 array.
    scale: the float32 scale `quantize` multiplied by, broadcastable to ``q``.
    dtype: the result's dtype.

  Returns:
    ``q``'s shape in ``dtype``.
  """
  return (jnp.asarray(q).astype(jnp.float32)
          / jnp.asarray(scale, jnp.float32)).astype(dtype)


def amax(x: jax.Array, axis: Any = None, keepdims: bool = False) -> jax.Array:
  """float32 ``max |x|`` (over ``axis``, as ``jnp.max``'s), NaNs left out (0 if all
  are NaN), as TE's ``fmaxf`` reductions record it; an inf is recorded."""
  a = jnp.abs(jnp.asarray(x).astype(jnp.float32))
  return jnp.max(jnp.where(jnp.isnan(a), 0.0, a), axis=axis, keepdims=keepdims)


def usable(a: jax.Array) -> jax.Array:
  """Whether an amax gives a scale: finite and > 0."""
  return (a > 0) & jnp.isfinite(a)


def scale_from_amax(amax_value: jax.Array, old_scale: Any, dtype: Any,
                    margin: int = 0) -> jax.Array:
  """The scale that maps ``amax_value`` to ``dtype``'s largest value over ``2**margin``.

  ``fp8_max / amax / 2**margin`` where ``0 < amax < inf``, else ``old_scale`` (TE's
  delayed-scaling update: an amax of 0, inf or NaN keeps the scale); a result past
  float32's range is float32's largest.

  Args:
    amax_value: float32 amax (any shape: one scale per entry).
    old_scale: float32, broadcastable to ``amax_value``.
    dtype: the FP8 format.
    margin: int >= 0.

  Returns:
    float32 scales shaped like ``amax_value``.
  """
  bound = _fp8_max("dtype", dtype)
  a = jnp.asarray(amax_value, jnp.float32)
  scale = (jnp.float32(bound) / a) / jnp.float32(2.0 ** margin)
  scale = jnp.minimum(scale, jnp.finfo(jnp.float32).max)
  return jnp.where(usable(a), scale, jnp.asarray(old_scale, jnp.float32))


def record_amax(history: jax.Array, amax_value: jax.Array) -> jax.Array:
  """``history`` rolled by one with ``amax_value`` as its newest entry ``[0]``
  (TE's and Flax's roll: ``roll(history, -1)``, then ``[0] = amax``; the window
  holds the last ``len(history)`` amaxes)."""
  return jnp.roll(history, -1).at[0].set(amax_value.astype(history.dtype))


def reduce_history(history: jax.Array, amax_compute: str) -> jax.Array:
  if amax_compute == "max":
    return jnp.max(history, axis=-1)
  return history[..., 0]


def _step_scale(x: jax.Array, meta: Fp8Meta, dtype: Any,
                recipe: Fp8Recipe) -> tuple[jax.Array, Fp8Meta]:
  """The scale ``x`` is cast with this step, and its meta for the next step."""
  old = meta.scale.astype(jnp.float32)
  a = amax(x)
  history = record_amax(meta.amax_history.astype(jnp.float32), a)
  if recipe.name == "delayed":
    new = scale_from_amax(reduce_history(history, recipe.amax_compute), old, dtype,
                          recipe.margin)
    return old, Fp8Meta(new, history)
  now = scale_from_amax(a, old, dtype, recipe.margin)
  return now, Fp8Meta(now, history)


# ------------------------------------------------------------------ blockwise casts
def _block_view(shape: Sequence[int], block_shape: Sequence[int]):
  """The padded shape and the interleaved (blocks, within) shape of a blocking."""
  padded = [-(-d // b) * b for d, b in zip(shape, block_shape)]
  split = [n for d, b in zip(padded, block_shape) for n in (d // b, b)]
  return padded, split


def _blocked(x: jax.Array, block_shape: Sequence[int]) -> jax.Array:
  """``x`` zero-padded to whole blocks and viewed as ``(n0, b0, n1, b1, ...)``."""
  padded, split = _block_view(x.shape, block_shape)
  pads = [(0, p - d) for d, p in zip(x.shape, padded)]
  return jnp.pad(x, pads).reshape(split)


def _unblocked(y: jax.Array, shape: Sequence[int]) -> jax.Array:
  padded = [y.shape[2 * i] * y.shape[2 * i + 1] for i in range(len(shape))]
  return y.reshape(padded)[tuple(slice(0, d) for d in shape)]


def _check_blocks(x: jax.Array, block_shape: Sequence[int]) -> tuple[int, ...]:
  block_shape = tuple(block_shape)
  if len(block_shape) != x.ndim or not all(
      isinstance(b, (int, np.integer)) and b >= 1 for b in block_shape):
    raise validation.fail(
        "block_shape", f" must be {x.ndim} ints >= 1 (one per dimension of an array "
        f"of shape {tuple(x.shape)}); got {block_shape}")
  return tuple(int(b) for b in block_shape)


def quantize_blockwise(x: jax.Array, block_shape: Sequence[int], dtype: Any, *,
                       margin: int = 0) -> tuple[jax.Array, jax.Array]:
  """``x`` cast to ``dtype`` with one scale per block of ``block_shape``.

  Each block's scale is ``scale_from_amax`` of its own amax (1 for a block of zeros),
  DeepSeek-V3's fine-grained quantization: ``(1, 128)`` tiles for activations along
  their contraction, ``(128, 128)`` blocks for weights. A dimension that is not a
  multiple of its block ends in a partial block (padded with zeros for the amax).

  Args:
    x: a float array.
    block_shape: the block's size along each dimension of ``x`` (1: no blocking).
    dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
    margin: int >= 0.

  Returns:
    ``(q, scales)``: ``q`` of ``x``'s shape in ``dtype``; float32 ``scales`` of
    shape ``ceil(x.shape / block_shape)``.
  """
  x = jnp.asarray(x)
  block_shape = _check_blocks(x, block_shape)
  blocks = _blocked(x.astype(jnp.float32), block_shape)
  within = tuple(range(1, 2 * x.ndim, 2))
  scales = scale_from_amax(amax(blocks, within, keepdims=True), 1.0, dtype, margin)
  return (_unblocked(quantize(blocks, scales, dtype), x.shape),
          jnp.squeeze(scales, within))


def dequantize_blockwise(q: jax.Array, scales: jax.Array, block_shape: Sequence[int],
                         dtype: Any = jnp.float32) -> jax.Array:
  """`quantize_blockwise`'s values: each block of ``q`` divided by its scale.

  Args:
    q: an FP8 array.
    scales: float32, one per block (``ceil(q.shape / block_shape)``).
    block_shape: the blocks `quantize_blockwise` used.
    dtype: the result's dtype.

  Returns:
    ``q``'s shape in ``dtype``.
  """
  block_shape = _check_blocks(q, block_shape)
  expanded = jnp.expand_dims(scales, tuple(range(1, 2 * q.ndim, 2)))
  return _unblocked(dequantize(_blocked(q, block_shape), expanded, dtype), q.shape)


def _held_blockwise(x: jax.Array, block_shape: Sequence[int], dtype: Any,
                    out_dtype: Any, margin: int) -> jax.Array:
  """``x`` rounded through ``dtype`` block by block, in ``out_dtype``; the FP8 values
  pass an optimization barrier, without which XLA's GPU compiler drops the round
  trip (``xla_allow_excess_precision``)."""
  q, scales = quantize_blockwise(x, block_shape, dtype, margin=margin)
  q, scales = lax.optimization_barrier((q, scales))
  return dequantize_blockwise(q, scales, block_shape, out_dtype)


def _tile(ndim: int, axis: Optional[int], size: int) -> tuple[int, ...]:
  """A ``(1, ..., size at axis, ..., 1)`` block shape (all 1 without an axis)."""
  return tuple(size if i == axis else 1 for i in range(ndim))


def _last(axes: Sequence[int]) -> Optional[int]:
  return max(axes) if len(axes) else None


# ------------------------------------------------------------------ dimension numbers
class _Dims(NamedTuple):
  """A ``dot_general``'s dimension numbers, and their transposes for the backward."""
  lhs_contract: tuple[int, ...]
  rhs_contract: tuple[int, ...]
  lhs_batch: tuple[int, ...]
  rhs_batch: tuple[int, ...]
  lhs_free: tuple[int, ...]
  rhs_free: tuple[int, ...]

  @property
  def numbers(self):
    return ((self.lhs_contract, self.rhs_contract), (self.lhs_batch, self.rhs_batch))

  def out_positions(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Where the batch, lhs-free and rhs-free dimensions sit in the output."""
    nb, nl = len(self.lhs_batch), len(self.lhs_free)
    return (tuple(range(nb)), tuple(range(nb, nb + nl)),
            tuple(range(nb + nl, nb + nl + len(self.rhs_free))))

  def swapped(self) -> "_Dims":
    """The same product with its operands swapped."""
    return _Dims(self.rhs_contract, self.lhs_contract, self.rhs_batch, self.lhs_batch,
                 self.rhs_free, self.lhs_free)

  def lhs_grad(self):
    """``(dimension numbers of dot(g, rhs), permutation to lhs's layout)``."""
    return self._first_operand_grad(self.out_positions()[2])

  def rhs_grad(self):
    """``(dimension numbers of dot(g, lhs), permutation to rhs's layout)``."""
    return self.swapped()._first_operand_grad(self.out_positions()[1])

  def _first_operand_grad(self, other_free_in_g: tuple[int, ...]):
    """The lhs's gradient ``dot(g, rhs)``, the rhs's free dims at ``other_free_in_g``
    in the output gradient ``g``: it holds lhs's batch, free, then contracting dims
    (in rhs's order), permuted back to lhs's layout."""
    batch = tuple(range(len(self.lhs_batch)))
    numbers = ((other_free_in_g, self.rhs_free), (batch, self.rhs_batch))
    order = np.argsort(self.rhs_contract)
    source = (self.lhs_batch + self.lhs_free
              + tuple(self.lhs_contract[i] for i in order))
    return numbers, tuple(int(i) for i in np.argsort(source))


def _dims(dimension_numbers: Any, lhs_ndim: int, rhs_ndim: int) -> _Dims:
  try:
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(i) for i in axes) for axes in (lc, rc, lb, rb))
  except (TypeError, ValueError):
    raise validation.fail(
        "dimension_numbers", " must be ((lhs_contracting, rhs_contracting), "
        f"(lhs_batch, rhs_batch)); got {dimension_numbers!r}",
        validation.ArgumentTypeError) from None
  free = lambda n, *used: tuple(i for i in range(n) if i not in set(sum(used, ())))
  return _Dims(lc, rc, lb, rb, free(lhs_ndim, lc, lb), free(rhs_ndim, rc, rb))


# ------------------------------------------------------------------ the product
@dataclasses.dataclass(frozen=True)
class _Static:
  """What an FP8 product's custom VJP holds fixed."""
  dims: _Dims
  recipe: Fp8Recipe
  precision: Any
  out_dtype: Any
  lhs_dtype: Any
  rhs_dtype: Any
  out_sharding: Any


def _scaled_dot(a: jax.Array, b: jax.Array, numbers: Any,
                inv_scale: Optional[jax.Array], out_dtype: Any, precision: Any,
                out_sharding: Any = None) -> jax.Array:
  """``dot_general(a, b) * inv_scale`` in ``out_dtype``: on f8 operands, the pattern
  XLA's GPU compiler makes one FP8 GEMM of (the scale into its alpha). The f8
  product accumulates and is scaled in float32 before the cast to ``out_dtype``, as
  the FP8 GEMM does: a float16 result of the unscaled product overflows (up to 448^2
  a term, summed over the contraction, past float16's 65504)."""
  kwargs = {} if out_sharding is None else {"out_sharding": out_sharding}
  if inv_scale is None:
    return lax.dot_general(a, b, numbers, precision=precision,
                           preferred_element_type=out_dtype, **kwargs)
  out = lax.dot_general(a, b, numbers, precision=precision,
                        preferred_element_type=jnp.float32, **kwargs)
  return (out * inv_scale.astype(jnp.float32)).astype(out_dtype)


def _forward(lhs, rhs, state, static):
  recipe, dims = static.recipe, static.dims
  lhs_scale, lhs_meta = _step_scale(lhs, state.lhs, E4M3, recipe)
  rhs_scale, rhs_meta = _step_scale(rhs, state.rhs, E4M3, recipe)
  if recipe.name == "blockwise":
    lhs_dq, rhs_dq = _blockwise_operands(lhs, rhs, static)
    out = _scaled_dot(lhs_dq, rhs_dq, dims.numbers, None, static.out_dtype,
                      static.precision, static.out_sharding)
    return out, (lhs, rhs_dq, lhs_meta, rhs_meta, state.grad)
  q_lhs = quantize(lhs, lhs_scale, E4M3)
  q_rhs = quantize(rhs, rhs_scale, E4M3)
  out = _scaled_dot(q_lhs, q_rhs, dims.numbers, 1.0 / (lhs_scale * rhs_scale),
                    static.out_dtype, static.precision, static.out_sharding)
  return out, (q_lhs, q_rhs, lhs_scale, rhs_scale, lhs_meta, rhs_meta, state.grad)


def _blockwise_operands(lhs, rhs, static):
  """DeepSeek-V3's forward operands: lhs in 1 x B tiles along its (last) contracting
  dimension, rhs in B x B blocks over its last contracting and last free dims."""
  dims, r = static.dims, static.recipe
  lhs_tiles = _tile(lhs.ndim, _last(dims.lhs_contract), r.block_size)
  rhs_blocks = tuple(r.block_size if i in (_last(dims.rhs_contract),
                                           _last(dims.rhs_free)) else 1
                     for i in range(rhs.ndim))
  return (_held_blockwise(lhs, lhs_tiles, E4M3, static.lhs_dtype, r.margin),
          _held_blockwise(rhs, rhs_blocks, E4M3, static.rhs_dtype, r.margin))


def _backward(static, residuals, g):
  dims, recipe = static.dims, static.recipe
  if recipe.name == "blockwise":
    return _blockwise_backward(static, residuals, g)
  lhs_numbers, lhs_perm = dims.lhs_grad()
  rhs_numbers, rhs_perm = dims.rhs_grad()
  q_lhs, q_rhs, lhs_scale, rhs_scale, lhs_meta, rhs_meta, grad_meta = residuals
  g_scale, new_grad_meta = _step_scale(g, grad_meta, E5M2, recipe)
  q_g = quantize(g, g_scale, E5M2)
  d_lhs = _scaled_dot(q_g, q_rhs, lhs_numbers, 1.0 / (g_scale * rhs_scale),
                      static.lhs_dtype, static.precision)
  d_rhs = _scaled_dot(q_g, q_lhs, rhs_numbers, 1.0 / (g_scale * lhs_scale),
                      static.rhs_dtype, static.precision)
  return (lax.transpose(d_lhs, lhs_perm), lax.transpose(d_rhs, rhs_perm),
          Fp8State(lhs_meta, rhs_meta, new_grad_meta))


def _blockwise_backward(static, residuals, g):
  """The output gradient in 1 x B tiles along each product's contraction: the rhs-free
  dims for the input gradient (with the forward's rhs blocks), the lhs-free dims for
  the weight gradient (with lhs re-tiled along them, DeepSeek-V3's 128 x 1)."""
  dims, r = static.dims, static.recipe
  lhs, rhs_dq, lhs_meta, rhs_meta, grad_meta = residuals
  _, new_grad_meta = _step_scale(g, grad_meta, E5M2, r)
  _, out_lhs_free, out_rhs_free = dims.out_positions()
  lhs_numbers, lhs_perm = dims.lhs_grad()
  rhs_numbers, rhs_perm = dims.rhs_grad()
  g_for_lhs = _held_blockwise(g, _tile(g.ndim, _last(out_rhs_free), r.block_size),
                              E5M2, static.lhs_dtype, r.margin)
  d_lhs = _scaled_dot(g_for_lhs, rhs_dq.astype(static.lhs_dtype), lhs_numbers, None,
                      static.lhs_dtype, static.precision)
  g_for_rhs = _held_blockwise(g, _tile(g.ndim, _last(out_lhs_free), r.block_size),
                              E5M2, static.rhs_dtype, r.margin)
  lhs_dq = _held_blockwise(lhs, _tile(lhs.ndim, _last(dims.lhs_free), r.block_size),
                           E4M3, static.rhs_dtype, r.margin)
  d_rhs = _scaled_dot(g_for_rhs, lhs_dq, rhs_numbers, None, static.rhs_dtype,
                      static.precision)
  return (lax.transpose(d_lhs, lhs_perm), lax.transpose(d_rhs, rhs_perm),
          Fp8State(lhs_meta, rhs_meta, new_grad_meta))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_product(lhs, rhs, state, static):
  return _forward(lhs, rhs, state, static)[0]


def _fp8_product_fwd(lhs, rhs, state, static):
  return _forward(lhs, rhs, state, static)


_fp8_product.defvjp(_fp8_product_fwd, _backward)


def _check_state(state: Any) -> Fp8State:
  if not isinstance(state, Fp8State):
    raise validation.fail("state", " must be an Fp8State (mpscale.fp8_state); got "
                          f"{type(state).__name__}", validation.ArgumentTypeError)
  for leaf in jax.tree_util.tree_leaves(state):
    if jnp.asarray(leaf).dtype != jnp.float32:
      raise validation.fail(
          "state", " must hold float32 arrays; got "
          f"{jnp.asarray(leaf).dtype} (keep the FP8 state out of a precision "
          "policy's cast: mpscale.split_overwrite)", validation.ArgumentTypeError)
  return state


def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                    state: Fp8State, recipe: Fp8Recipe, precision: Any = None,
                    preferred_element_type: Any = None, *,
                    out_sharding: Any = None) -> jax.Array:
  """``lax.dot_general`` of ``lhs`` and ``rhs`` in FP8, scaled by ``state``.

  The forward casts both operands to e4m3 and multiplies them (one FP8 GEMM on
  Hopper); the backward casts the output gradient to e5m2 and computes both operand
  gradients from the FP8 values (two FP8 GEMMs). The gradient this function gives
  ``state`` is the updated state (see the module docstring): replace the state by it.
  Blockwise scaling rounds through FP8 the same way and multiplies in the compute
  dtype.

  Args:
    lhs: the input (a float array).
    rhs: the kernel; the blockwise recipe gives it 2-D blocks.
    dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch,
      rhs_batch))``, as ``lax.dot_general``'s (any batch and contracting dims).
    state: this product's `Fp8State` (float32; `fp8_state` makes the first).
    recipe: an `Fp8Recipe` (`make_fp8_recipe`).
    precision: passed to the products (``lax.dot_general``'s).
    preferred_element_type: the output dtype; default the operands' result type.
    out_sharding: the forward product's ``out_sharding`` (explicit sharding mode).

  Returns:
    The product, as ``lax.dot_general`` shapes it.

  Raises:
    ArgumentError: a ``recipe`` or ``state`` of the wrong type, a non-float32 state,
      or malformed ``dimension_numbers``.

  Example:
    >>> import jax, jax.numpy as jnp, mpscale
    >>> recipe = mpscale.make_fp8_recipe("delayed", history_len=16)
    >>> state = mpscale.fp8_state(recipe)
    >>> x, w = jnp.ones((4, 32)), jnp.full((32, 8), 0.5)
    >>> dims = (((1,), (0,)), ((), ()))
    >>> loss = lambda x, w, s: mpscale.fp8_dot_general(x, w, dims, s, recipe).sum()
    >>> dx, dw, new_state = jax.grad(loss, argnums=(0, 1, 2))(x, w, state)
    >>> float(new_state.rhs.amax_history[0]), float(new_state.rhs.scale)
    (0.5, 896.0)
  """
  recipe = recipe_of(recipe)
  state = _check_state(state)
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  out_dtype = (jnp.result_type(lhs, rhs) if preferred_element_type is None
               else jnp.dtype(preferred_element_type))
  static = _Static(_dims(dimension_numbers, lhs.ndim, rhs.ndim), recipe, precision,
                   out_dtype, lhs.dtype, rhs.dtype, out_sharding)
  return _fp8_product(lhs, rhs, state, static)


