"""A tiny decoder-only transformer language model, in pipeline form.

The model is three Flax linen modules, applied by three pure functions whose shapes are
the ones `mpscale.Pipeline` expects::

  params = {"embed": ..., "stages": <every block's params stacked on axis 0>,
            "head": ...}
  x = embed_fn(params, batch)                   # token + position embeddings
  for layer_params in params["stages"]:         # lax.scan in loss_fn
    x = stage_fn(layer_params, x)               # one pre-LN block, causal attention
  loss_sum, num_tokens = head_fn(params, x, batch)   # masked byte-level cross-entropy

Precision: activations follow the dtype of the parameters the train step hands in (the
policy's compute dtype): each module computes in the dtype of its main weight matrix, so
float32-kept norms and biases (`mpscale.precision.default_keep_fp32`) do not promote it.
Layer-norm statistics, the attention softmax, the GELU and the loss are computed in
float32.

Attention is XLA's (`causal_attention`: `jax.nn.dot_product_attention`'s XLA
implementation, the scores materialized in float32 a block of queries at a time)
or, on NVIDIA GPUs with 16-bit
activations, cuDNN's fused (flash) attention through `jax.nn.dot_product_attention`,
which keeps no ``[T, T]`` scores in memory (``attention``; `attention_for` chooses
for a config's ``model.attention: auto``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
import numpy as np
from mpscale import experts as experts_lib
from mpscale import parallel as parallel_lib
from mpscale.experts import moe_flax
from mpscale import validation
from mpscale import precision as precision_lib
from mpscale import _tree
from mpscale.trainer.models import families

Params = dict[str, Any]


class Embed(nn.Module):
  """Token embeddings, and learned position embeddings (GPT-2's; the other
  families rotate their queries and keys instead)."""
  vocab_size: int
  d_model: int
  seq_len: int
  init_std: float
  positions: bool = True

  @nn.compact
  def __call__(self, tokens: jax.Array,
               positions: Optional[np.ndarray] = None) -> jax.Array:
    """The embeddings of ``tokens``, at ``positions`` (``None``: in order)."""
    init = nn.initializers.normal(self.init_std)
    token = self.param("token", init, (self.vocab_size, self.d_model))
    if tokens.shape[-1] > self.seq_len:
      raise ValueError(f"sequence of {tokens.shape[-1]} tokens is longer than the "
                       f"model's seq_len {self.seq_len}")
    x = jnp.take(token, tokens, axis=0)
    if not self.positions:
      return x
    position = self.param("position", init, (self.seq_len, self.d_model))
    position = (position[:tokens.shape[-1]] if positions is None
                else jnp.take(position, positions, axis=0))
    return x + position.astype(token.dtype)


def _heads_major(init: Callable, num_heads: int) -> Callable:
  """``init`` for a ``[d, 3 d]`` qkv kernel, with its columns reordered from
  ``(q|k|v, head, dim)`` to ``(head, q|k|v, dim)``.

  The values are the ones ``init`` draws, so the model computes exactly what the
  ``(q|k|v, head, dim)`` layout did; in this order a contiguous slice of columns is a
  set of whole heads, which is what a tensor-parallel split of the kernel needs.
  """
  def heads_major(key, shape, dtype=jnp.float32):
    w = init(key, shape, dtype)
    d_in, n = shape
    return (w.reshape(d_in, 3, num_heads, n // (3 * num_heads))
            .transpose(0, 2, 1, 3).reshape(d_in, n))
  return heads_major


ATTENTION = ("auto", "xla", "cudnn")
"""``model.attention``'s choices: ``xla`` (`causal_attention`, any backend),
``cudnn`` (cuDNN's fused attention: NVIDIA GPUs, 16-bit activations, a head size a
multiple of 8 up to 128), ``auto`` (``cudnn`` where it runs, else ``xla``)."""

_CUDNN_DTYPES = ("float16", "bfloat16")


def _cudnn_unsupported(device: Any, compute_dtype: Any, head_dim: int) -> Optional[str]:
  """Why cuDNN's fused attention cannot run there, or ``None``."""
  if device is None:
    return "no device is known"
  kind = getattr(device, "device_kind", "")
  if device.platform not in ("gpu", "cuda") or not kind.startswith("NVIDIA"):
    return f"it runs on NVIDIA GPUs, and the devices are {kind or device.platform}"
  if jnp.dtype(compute_dtype).name not in _CUDNN_DTYPES:
    return (f"it computes in float16 or bfloat16, and the compute dtype is "
            f"{jnp.dtype(compute_dtype).name}")
  if head_dim % 8 or head_dim > 128:
    return f"it takes a head size that is a multiple of 8 up to 128, not {head_dim}"
  return None


def attention_for(choice: str, device: Any, compute_dtype: Any, head_dim: int
                  ) -> str:
  """The attention implementation (``"xla"`` or ``"cudnn"``) of a config's
  ``model.attention`` (`ATTENTION`) for a model computing in ``compute_dtype`` with
  heads of ``head_dim`` on devices like ``device`` (a `jax.Device`; ``None`` when
  none is known, as on an abstract mesh).

  Raises:
    ArgumentError: naming ``attention`` for an unknown choice, or for ``cudnn``
      where cuDNN's attention cannot run (``device`` known).
  """
  validation.one_of("attention", choice, ATTENTION)
  if choice == "xla":
    return "xla"
  why = _cudnn_unsupported(device, compute_dtype, head_dim)
  if why is None:
    return "cudnn"
  if choice == "cudnn" and device is not None:
    raise validation.fail("attention", f": cuDNN's fused attention cannot run here: "
                          f"{why}; use auto or xla")
  return "xla"


QUERY_BLOCK = 512
"""Rows of queries `causal_attention` attends at a time (at most 16 blocks)."""


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     window: Optional[int] = None,
                     block: Optional[int] = None) -> jax.Array:
  """Causal softmax attention as `jax.nn.dot_product_attention`'s XLA implementation
  computes it (``[batch, length, heads, head_dim]`` in and out): the scores in
  float32, scaled by ``1/sqrt(head_dim)``, the softmax in float32, the weights cast to
  ``v``'s dtype. Written here because that implementation asks float16 products for
  a float32 result with a dot algorithm (``F16_F16_F32``) that XLA's CPU and TPU
  compilers refuse; this one asks for a float32 result alone, which every backend
  compiles. With ``window``, a query attends the ``window`` latest keys only, its own
  included (Mistral's sliding window). ``k`` and ``v`` may hold fewer heads than
  ``q`` (grouped-query attention), a divisor of its: query head ``i`` reads K/V head
  ``i // (q heads / k heads)``, with no copy of K and V per query head.

  The queries are attended ``block`` rows at a time (`QUERY_BLOCK`, or
  ``length / 16`` when larger; ``None``), each block against the keys it can see
  only (those up to its last row, and from its first row's window on), under
  ``jax.checkpoint``: its scores are recomputed in the backward rather than kept.
  Each row's softmax is whole, so the values are one block's; the scores held at a
  time are a block's, and the keys above the diagonal's blocks are never multiplied
  (about half the FLOPs of causal attention at 8 blocks).

  References:
    Rabe & Staats, "Self-attention Does Not Need O(n^2) Memory", 2021.
    https://arxiv.org/abs/2112.05682
  """
  length = q.shape[1]
  if block is None:
    block = max(QUERY_BLOCK, -(-length // 16))
  if block >= length:
    return _attention_rows(q, k, v, 0, 0, window)
  outs = []
  for start in range(0, length, block):
    stop = min(start + block, length)
    first = 0 if window is None else max(0, start - window + 1)
    rows = jax.checkpoint(functools.partial(_sliced_rows, start=start, stop=stop,
                                            first=first, window=window))
    outs.append(rows(q, k, v))
  return jnp.concatenate(outs, axis=1)


def _sliced_rows(q: jax.Array, k: jax.Array, v: jax.Array, start: int, stop: int,
                 first: int, window: Optional[int]) -> jax.Array:
  """`_attention_rows` of the query rows ``start:stop``, sliced here, under the
  caller's ``jax.checkpoint``: the backward keeps the whole ``q, k, v`` once, not
  each block's slices (the keys' of every block, ``blocks / 2`` times them)."""
  return _attention_rows(q[:, start:stop], k[:, first:stop], v[:, first:stop], start,
                         first, window)


def _attention_rows(q: jax.Array, k: jax.Array, v: jax.Array, start: int,
                    first: int, window: Optional[int]) -> jax.Array:
  """`causal_attention` of the query rows from position ``start`` on, against the
  keys from position ``first`` on."""
  batch, rows, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  grouped = kv_heads != heads
  if grouped:  # query head i reads K/V head i // (heads / kv_heads)
    q = q.reshape(batch, rows, kv_heads, heads // kv_heads, head_dim)
  spec = ("bqkgd,bskd->bkgqs", "bkgqs,bskd->bqkgd") if grouped else (
      "bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd")
  scores = jnp.einsum(spec[0], q, k, preferred_element_type=jnp.float32)
  scores = scores * jnp.float32(1 / math.sqrt(head_dim))
  # traced (iota), not numpy constants: a long sequence's masks stay out of the
  # program's constants and fuse into the softmax
  query = start + lax.broadcasted_iota(jnp.int32, (rows, k.shape[1]), 0)
  key = first + lax.broadcasted_iota(jnp.int32, (rows, k.shape[1]), 1)
  seen = key <= query
  if window is not None:
    seen &= query - key < window
  scores = jnp.where(seen, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum(spec[1], weights, v).reshape(batch, rows, heads, head_dim)


def _fused_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     spec: jax.sharding.PartitionSpec,
                     window: Optional[int] = None) -> jax.Array:
  """cuDNN's causal attention of ``q, k, v`` laid out as ``spec``.

  Inside a ``shard_map`` that is manual over some mesh axes and automatic over others
  (a pipeline's stages, with tensor or FSDP axes left to GSPMD), JAX's partitioning
  rule for cuDNN attention fails to compile (jax 0.10: "'GSPMDSharding' object has no
  attribute 'spec'"). There it runs in a nested ``shard_map`` over the automatic
  axes instead, each device attending its own rows and heads: attention mixes
  neither rows nor heads, so nothing moves but what ``spec`` lays out.
  """
  local = None if window is None or window >= q.shape[1] else (window - 1, 0)
  attend = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                             implementation="cudnn", local_window_size=local)
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(getattr(mesh, "manual_axes", ()))
  automatic = [a for a in getattr(mesh, "axis_names", ()) if a not in manual]
  if not manual or not automatic:
    return attend(q, k, v)
  spec = parallel_lib.only_axes(spec, automatic)
  return jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec),
                       out_specs=spec, axis_names=set(automatic),
                       check_vma=False)(q, k, v)


def _unconstrained(x: jax.Array, kind: str) -> jax.Array:
  del kind
  return x


def _tensor_divides(shard: Callable, n: int) -> bool:
  """Whether ``shard``'s tensor axis splits ``n`` heads evenly (no split: yes)."""
  if not isinstance(shard, ActivationSharding):
    return True
  axis = shard.tensor_axis
  return axis not in shard.mesh.axis_names or n % shard.mesh.shape[axis] == 0


def _attend(attention: str, shard: Callable, dtype: Any, q: jax.Array, k: jax.Array,
            v: jax.Array, window: Optional[int] = None) -> jax.Array:
  """Causal attention of ``[batch, length, heads, head_dim]`` heads: cuDNN's fused
  for ``attention == "cudnn"`` and 16-bit activations, else XLA's
  (`causal_attention`), laid out as ``shard`` lays out ``"heads"``; across a
  ``context`` split, `mpscale.parallel.context_attention` with blocks of either."""
  cudnn = attention == "cudnn" and jnp.dtype(dtype).name in _CUDNN_DTYPES
  split = isinstance(shard, ActivationSharding) and shard.context > 1
  if ((cudnn or split) and k.shape[2] != q.shape[2]
      and not _tensor_divides(shard, k.shape[2])):
    # K/V heads the tensor axis does not split: one per query head, so that
    # each device's heads are whole groups (cuDNN's, and the context split's, run
    # on each device's own heads)
    k, v = (jnp.repeat(t, q.shape[2] // t.shape[2], axis=2) for t in (k, v))
  if split:
    out = parallel_lib.context_attention(
        q, k, v, mesh=shard.mesh, spec=shard.spec("heads"), axis=shard.context_axis,
        mode=shard.context_parallel,
        # cuDNN's blocks take no window: a sliding window's blocks are XLA's
        implementation="cudnn" if cudnn and window is None else "xla", window=window)
  elif cudnn:
    spec = (shard.spec("heads") if isinstance(shard, ActivationSharding)
            else jax.sharding.PartitionSpec())
    out = _fused_attention(q, k, v, spec, window)
  else:
    out = causal_attention(q, k, v, window)
  return shard(out.astype(dtype), "heads")


_LayerNorm = nn.remat(nn.LayerNorm)
"""`flax.linen.LayerNorm` under ``jax.checkpoint``: the backward keeps its input
alone (in the compute dtype) and recomputes the float32 statistics and normalized
input, which it kept otherwise (about ``12 * d_model`` bytes a token)."""


@jax.checkpoint
def _gelu(h: jax.Array) -> jax.Array:
  """Tanh-GELU of ``h`` in float32, cast back to ``h``'s dtype: its ``x**3``
  overflows float16 for ``|x| > 40``, and its gradient is then ``inf * 0 = NaN``.
  Under ``jax.checkpoint``, the backward keeps ``h`` alone and recomputes the
  float32 intermediates (five ``[tokens, d_ff]`` float32 arrays otherwise)."""
  return nn.gelu(h.astype(jnp.float32)).astype(h.dtype)


class Block(nn.Module):
  """One pre-LN transformer block: causal self-attention, then a GELU MLP."""
  num_heads: int
  d_ff: int
  init_std: float
  num_layers: int
  dtype: Optional[Any] = None
  """Activation dtype; ``None``: the input's."""
  shard: Callable[[jax.Array, str], jax.Array] = _unconstrained
  """Lays out an activation of a kind (``"residual"``, ``"heads"``, ``"mlp"``); see
  `ActivationSharding`."""
  attention: str = "xla"
  """``"xla"`` or ``"cudnn"`` (for 16-bit activations; float32 ones, as at
  initialization, take XLA's)."""
  fp8: Optional[precision_lib.Fp8Recipe] = None
  """The FP8 products' recipe, for the products ``fp8_states`` names."""

  @nn.compact
  def __call__(self, x: jax.Array,
               fp8_states: Optional[dict[str, precision_lib.Fp8State]] = None) -> jax.Array:
    """``x`` through the block; the products (``qkv``, ``out``, ``fc``, ``proj``)
    that ``fp8_states`` holds a state for multiply in FP8 (`mpscale.fp8_dot_general`
    with ``fp8``), the others in the activation dtype."""
    dense = functools.partial(_dense, self.fp8, fp8_states or {})
    dtype = self.dtype or x.dtype
    x = self.shard(x.astype(dtype), "residual")
    batch, length, d_model = x.shape
    head_dim = d_model // self.num_heads
    init = nn.initializers.normal(self.init_std)
    # GPT-2: residual projections scaled down with depth.
    out_init = nn.initializers.normal(self.init_std / math.sqrt(2 * self.num_layers))

    h = _LayerNorm(dtype=dtype, name="ln_attn")(x)
    qkv = checkpoint_name(dense(3 * d_model, dtype=dtype, name="qkv",
                                kernel_init=_heads_major(init, self.num_heads))(h),
                          "qkv_proj")
    qkv = qkv.reshape(batch, length, self.num_heads, 3, head_dim)
    q, k, v = (self.shard(qkv[:, :, :, i], "heads") for i in range(3))
    attn = _attend(self.attention, self.shard, dtype, q, k, v)
    attn = attn.reshape(batch, length, d_model)
    x = x + checkpoint_name(
        dense(d_model, dtype=dtype, kernel_init=out_init, name="out")(attn), "out_proj")
    x = self.shard(x, "residual")

    h = _LayerNorm(dtype=dtype, name="ln_mlp")(x)
    h = self.shard(checkpoint_name(
        dense(self.d_ff, dtype=dtype, kernel_init=init, name="fc")(h), "mlpwi"), "mlp")
    h = _gelu(h)
    x = x + checkpoint_name(
        dense(d_model, dtype=dtype, kernel_init=out_init, name="proj")(h), "mlpwo")
    return self.shard(x, "residual")


class LlamaBlock(nn.Module):
  """One Llama block, or Mistral's or Qwen's (`families.Traits`): RMSNorm,
  grouped-query attention with the rotary embedding, RMSNorm, SwiGLU MLP
  (`mpscale.trainer.models.families`). Its matrices: ``q``, ``k``, ``v``, ``o``,
  ``gate``, ``up``, ``down``; its norms ``attn_norm``, ``mlp_norm`` (and Qwen3's
  ``q_norm``, ``k_norm``)."""
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_ff: int
  init_std: float
  family: str = "llama"
  rope_theta: float = 10000.0
  rope_scaling: Optional[families.RopeScaling] = None
  norm_eps: float = 1e-5
  sliding_window: Optional[int] = None
  dtype: Optional[Any] = None
  shard: Callable[[jax.Array, str], jax.Array] = _unconstrained
  attention: str = "xla"
  fp8: Optional[precision_lib.Fp8Recipe] = None
  routing: Optional[experts_lib.Routing] = None
  """A mixture of experts for the MLP (`mpscale.experts.moe_flax.MoeMLP`, named
  ``moe``), each ``expert_d_ff`` wide, beside a shared MLP ``shared_d_ff`` wide."""
  expert_d_ff: int = 0
  shared_d_ff: int = 0

  @nn.compact
  def __call__(self, x: jax.Array,
               fp8_states: Optional[dict[str, precision_lib.Fp8State]] = None) -> Any:
    """``x`` through the block; the matrices ``fp8_states`` holds a state for
    multiply in FP8, the others in the activation dtype. With ``routing``, ``(x,
    stats)``: the experts' `mpscale.experts.MoeStats`."""
    traits = families.TRAITS[self.family]
    dtype = self.dtype or x.dtype
    x = self.shard(x.astype(dtype), "residual")
    batch, length, d_model = x.shape
    dense = functools.partial(_dense, self.fp8, fp8_states or {}, dtype=dtype,
                              kernel_init=nn.initializers.normal(self.init_std))
    norm = functools.partial(families.RMSNorm, self.norm_eps, dtype)

    h = norm(name="attn_norm")(x)
    heads = {"q": self.num_heads, "k": self.num_kv_heads, "v": self.num_kv_heads}
    q, k, v = (checkpoint_name(
        dense(n * self.head_dim, use_bias=traits.qkv_bias, name=name)(h),
        SAVED_AS[name]).reshape(batch, length, n, self.head_dim)
               for name, n in heads.items())
    if traits.qk_norm:
      q, k = norm(name="q_norm")(q), norm(name="k_norm")(k)
    inv_freq = families.rope_frequencies(self.head_dim, self.rope_theta,
                                         self.rope_scaling)
    positions = (self.shard.order(length)
                 if isinstance(self.shard, ActivationSharding) else None)
    q, k = (families.apply_rope(t, inv_freq, positions) for t in (q, k))
    # K/V heads stay as many as they are (grouped-query attention), split over the
    # tensor axis as their kernels are when it divides them
    q = self.shard(q, "heads")
    if _tensor_divides(self.shard, self.num_kv_heads):
      k, v = self.shard(k, "heads"), self.shard(v, "heads")
    attn = _attend(self.attention, self.shard, dtype, q, k, v, self.sliding_window)
    attn = attn.reshape(batch, length, self.num_heads * self.head_dim)
    x = self.shard(x + checkpoint_name(dense(d_model, use_bias=False, name="o")(attn),
                                       "out_proj"), "residual")

    h = norm(name="mlp_norm")(x)
    if self.routing is not None:
      y, stats = self._experts(h, dtype)
      return self.shard(x + y, "residual"), stats
    gate, up = (self.shard(checkpoint_name(
        dense(self.d_ff, use_bias=False, name=name)(h), SAVED_AS[name]), "mlp")
                for name in ("gate", "up"))
    h = experts_lib.swiglu(gate, up)
    x = x + checkpoint_name(dense(d_model, use_bias=False, name="down")(h), "mlpwo")
    return self.shard(x, "residual")

  def _experts(self, h: jax.Array, dtype: Any) -> tuple[jax.Array, Any]:
    """The mixture of experts of ``h``, on the mesh of ``shard`` (each device
    routing its own tokens, its experts those of its ``expert`` index)."""
    laid_out = isinstance(self.shard, ActivationSharding)
    tensor = (self.shard.tensor_axis if laid_out
              and self.shard.tensor_axis in self.shard.mesh.axis_names else None)
    return moe_flax.MoeMLP(
        self.routing, self.expert_d_ff, shared_d_ff=self.shared_d_ff, dtype=dtype,
        kernel_init=nn.initializers.normal(self.init_std),
        mesh=self.shard.mesh if laid_out else None,
        spec=self.shard.spec("tokens") if laid_out else None, tensor_axis=tensor,
        name="moe")(h)


SAVED_AS = {"q": "query_proj", "k": "key_proj", "v": "value_proj", "gate": "mlpwi_0",
            "up": "mlpwi_1"}
"""The names (``jax.ad_checkpoint.checkpoint_name``, MaxText's) the Llama block's
products' outputs carry, for the recompute policies that save them by name
(`mpscale.parallel.SAVED_NAMES`); its ``o`` and ``down`` are ``out_proj`` and
``mlpwo``, as the GPT block's ``out`` and ``proj`` (its ``qkv`` is ``qkv_proj``,
its ``fc`` ``mlpwi``)."""


FP8_PRODUCTS = ("qkv", "out", "fc", "proj")
"""The block's four matrix products, in `Block`'s names (``precision.fp8.products``)."""


def fp8_block(states: dict[str, precision_lib.Fp8State]) -> jax.Array:
  """Whether a block with these FP8 states (one block's, from
  `TinyLM.init_model_state`) multiplies in FP8: its states are not the zeros that
  mark a block kept in the compute dtype (an update's scale is never 0)."""
  first = states[min(states)]
  return first.rhs.scale > 0


def _dense(recipe: Optional[precision_lib.Fp8Recipe], states: dict[str, precision_lib.Fp8State],
           *args: Any, name: str, **kwargs: Any) -> nn.Dense:
  """``nn.Dense(*args, name=name, **kwargs)``, its product in FP8 where ``states``
  holds one for ``name``."""
  state = states.get(name)
  if state is None:
    return nn.Dense(*args, name=name, **kwargs)

  def dot_general(lhs, rhs, dimension_numbers, precision=None,
                  preferred_element_type=None):
    return precision_lib.fp8_dot_general(lhs, rhs, dimension_numbers, state, recipe,
                                         precision, preferred_element_type)
  return nn.Dense(*args, name=name, dot_general=dot_general, **kwargs)


class Head(nn.Module):
  """The final norm (GPT-2's LayerNorm, the other families' RMSNorm) and the output
  projection to logits: its own matrix, or the token embedding's transpose
  (``tied``, passed in as ``token``)."""
  vocab_size: int
  init_std: float
  dtype: Optional[Any] = None
  rms_eps: Optional[float] = None
  """An RMSNorm with this epsilon; ``None``: GPT-2's LayerNorm."""
  tied: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, token: Optional[jax.Array] = None) -> jax.Array:
    dtype = self.dtype or x.dtype
    x = x.astype(dtype)
    if self.rms_eps is None:
      x = nn.LayerNorm(dtype=dtype, name="ln_final")(x)
    else:
      x = families.RMSNorm(self.rms_eps, dtype, name="norm")(x)
    if self.tied:
      return jnp.einsum("btd,vd->btv", x, token.astype(dtype))
    return nn.Dense(self.vocab_size, dtype=dtype, use_bias=False,
                    kernel_init=nn.initializers.normal(self.init_std), name="out")(x)


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, mask: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
  """Masked cross-entropy in float32: ``(sum over tokens, number of tokens)``."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  mask = mask.astype(jnp.float32)
  return jnp.sum(nll * mask), jnp.sum(mask)


LOGICAL_RULES = (("layers", "stage"), ("vocab", "tensor"), ("heads", "tensor"),
                 ("kv_heads", "tensor"), ("mlp", "tensor"), ("experts", "expert"),
                 ("expert_mlp", "tensor"))
"""The default rules from `TinyLM.logical_axes` names to mesh axes: stacked layers
over ``stage``; attention heads, grouped K/V heads, MLP hidden units and the
vocabulary over ``tensor`` (Megatron's column- and row-parallel split; K/V heads
fewer than, or not divisible by, the tensor axis are replicated over it, as
Megatron does); a mixture's experts over ``expert`` and each expert's hidden units
over ``tensor``. FSDP is added on top by `TinyLM.param_specs`."""


@dataclasses.dataclass(frozen=True)
class ActivationSharding:
  """How `TinyLM` lays out its activations on a mesh (tensor and sequence parallelism).

  ``kind`` is ``"residual"`` (``[batch, seq, d_model]``, between and around attention
  and MLP), ``"heads"`` (``[batch, seq, heads, head_dim]``) or ``"mlp"``
  (``[batch, seq, d_ff]``). Heads and MLP units are split over ``tensor_axis``; the
  residual stream is replicated over it, or, with ``sequence_parallel``, split along
  the sequence (Megatron's sequence parallelism: layer norms and residual adds on a
  slice of the sequence, an all-gather before attention and MLP and a reduce-scatter
  after). The batch dimension is split over ``batch_axes`` (the data axes: with
  FSDP, GSPMD then gathers parameters rather than activations). With a
  ``context_axis`` on the mesh (context parallelism), every activation's sequence
  dimension is split over it, in the balanced order of
  `mpscale.parallel.context_order` (`order`), and attention crosses the split as
  ``context_parallel`` says (`mpscale.parallel.context_attention`).
  """
  mesh: Any
  batch_axes: tuple[str, ...] = ("data", "fsdp")
  tensor_axis: str = "tensor"
  sequence_parallel: bool = False
  context_axis: str = parallel_lib.CONTEXT_AXIS
  context_parallel: str = "ring"
  """``ring`` or ``all_gather`` (`mpscale.parallel.CONTEXT_PARALLEL`)."""

  def __post_init__(self):
    validation.one_of("context_parallel", self.context_parallel,
                      parallel_lib.CONTEXT_PARALLEL)

  @property
  def context(self) -> int:
    """The size of the context axis (1: none)."""
    return parallel_lib.context_size(self.mesh, self.context_axis)

  def order(self, length: int) -> Optional[np.ndarray]:
    """The positions of a sequence of ``length`` in the order the activations hold
    them (`mpscale.parallel.context_order`); ``None`` without a context split."""
    if self.context == 1:
      return None
    return parallel_lib.context_order(length, self.context)

  def __call__(self, x: jax.Array, kind: str) -> jax.Array:
    return parallel_lib.constrain(x, self.spec(kind), self.mesh)

  def spec(self, kind: str) -> jax.sharding.PartitionSpec:
    """The layout of an activation of ``kind``."""
    batch = tuple(a for a in self.batch_axes if a in self.mesh.axis_names) or None
    free = batch
    tensor = self.tensor_axis if self.tensor_axis in self.mesh.axis_names else None
    seq = (self.context_axis,) if self.context > 1 else ()
    seq_entry = parallel_lib.spec_entry(seq)
    if kind == "residual":
      spec = (free, parallel_lib.spec_entry(
          seq + ((tensor,) if self.sequence_parallel and tensor else ())), None)
    elif kind == "heads":
      spec = (free, seq_entry, tensor, None)
    elif kind == "mlp":
      spec = (free, seq_entry, tensor)
    elif kind == "tokens":  # the residual as a mixture of experts routes it
      spec = (free, seq_entry, None)
    else:
      raise ValueError(f"unknown activation kind {kind!r}")
    return jax.sharding.PartitionSpec(*spec)


_ROUTING_NAMES = {"top_k": "experts_per_token", "score": "router",
                  "normalize": "router_normalize", "bias_rate": "router_bias_rate"}
"""`mpscale.experts.Routing`'s arguments by `TinyLM`'s names."""


@dataclasses.dataclass(frozen=True)
class TinyLM:
  """The tiny decoder-only LM: ``init`` and the pipeline-form functions.

  Attributes:
    vocab_size, d_model, num_heads, num_layers, d_ff, seq_len, init_std: the sizes
      (`SIZES`; the config's ``model`` section holds the same names, with defaults,
      and `from_sizes` reads them from it). ``init_std`` defaults to GPT-2's 0.02.
    family: ``gpt`` (GPT-2's block, `Block`) or ``llama``, ``mistral``, ``qwen2``,
      ``qwen3`` (`LlamaBlock`; `mpscale.trainer.models.families`).
    num_kv_heads: K/V heads of grouped-query attention (``None``: ``num_heads``);
      must divide ``num_heads``. Llama block only.
    head_dim: each head's width (``None``: ``d_model / num_heads``). Llama block
      only.
    rope_theta, rope_scaling: the rotary embedding's base and its scaling
      (`families.RopeScaling`, or its ``config.json`` mapping). Llama block only.
    norm_eps: the RMSNorms' epsilon (Llama block).
    tie_embeddings: logits from the token embedding's transpose, no head matrix.
    sliding_window: each query attends this many latest keys (Mistral; ``None``:
      all earlier ones).
    remat: recompute each block in the backward pass (``loss_fn`` only; a pipeline
      takes its own ``remat``): ``recompute="full"``.
    recompute: what the backward of ``loss_fn`` recomputes, as a pipeline's
      (`mpscale.parallel.RECOMPUTE`: ``"none"``, ``"selective"``: keep the blocks'
      matrix products and recompute the rest, Megatron-LM's selective recomputation,
      ``"full"``: keep each block's input; the `mpscale.parallel.SAVED_NAMES`, such
      as ``"save_qkv_proj"``: keep the outputs the blocks name, `SAVED_AS`), or a
      ``jax.checkpoint_policies`` policy; ``remat=True`` is ``"full"``.
    recompute_layers: how many blocks of ``loss_fn``, the first ones, run under
      ``recompute``; the others keep every residual (Megatron-LM's
      ``recompute_num_layers``); ``None``: every block.
    shard: activation layout for tensor and sequence parallelism; ``None``: GSPMD's
      choice.
    attention: ``"xla"`` or ``"cudnn"`` (`Block.attention`; `attention_for` chooses
      one for a config).
    fp8: an `mpscale.Fp8Recipe` to multiply the blocks' ``fp8_products`` in FP8
      (`mpscale.fp8_dot_general`); ``None``: off. The first and last ``bf16_layers``
      blocks and the head stay in the compute dtype (Megatron's
      ``--first-last-layers-bf16``). The FP8 scaling state is a model state,
      `init_model_state`: ``{"_overwrite_with_gradient": {"stages": {product:
      Fp8State stacked over every block}}}``, as ``params["stages"]`` is (so a
      pipeline splits it over its stages with the blocks), the bf16 blocks' states
      all zeros (`fp8_block`); ``loss_fn(params, batch, model_state=state)``
      multiplies in FP8 with it and returns ``(out, state)`` (the state as given:
      its gradient is its update, which `mpscale.make_train_step` puts in the new
      state), and so does a pipeline's ``stage_fn(layer_params, x, state=...)``.
      Without a state the model runs in the compute dtype (sampling).
    fp8_products: which of `FP8_PRODUCTS` multiply in FP8.
    bf16_layers: blocks at each end kept out of FP8; ``2 * bf16_layers <
      num_layers``.
    num_experts, experts_per_token, expert_d_ff, router, router_normalize,
      router_bias_rate, shared_d_ff, capacity_factor: the mixture of experts of
      ``mixtral`` and ``qwen3_moe`` (`routing`; the config's keys of the same
      names). Its balancing bias and each step's routing statistics are the model
      state (`init_model_state`: ``{"moe": {"bias", "counts", "dropped",
      "aux_loss", "z_loss"}}``, one row a block); ``loss_fn`` with it returns the
      new state: the bias moved by ``router_bias_rate`` towards even loads, the
      statistics of the micro-batch.
    aux_loss_coef, z_loss_coef: the load-balancing and z-losses' weights in
      ``loss_fn``'s loss (their mean over the blocks, per token).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from mpscale.trainer.models.lm import TinyLM
    >>> model = TinyLM(vocab_size=256, d_model=64, num_heads=4, num_layers=2,
    ...                d_ff=256, seq_len=64)
    >>> params = model.init(jax.random.key(0))
    >>> tokens = jnp.zeros((2, 64), jnp.int32)
    >>> batch = {"inputs": tokens, "targets": tokens}
    >>> loss_sum, num_tokens = model.loss_fn(params, batch)
    >>> float(num_tokens)
    128.0
  """
  vocab_size: int
  d_model: int
  num_heads: int
  num_layers: int
  d_ff: int
  seq_len: int
  init_std: float = 0.02
  family: str = "gpt"
  num_kv_heads: Optional[int] = None
  head_dim: Optional[int] = None
  rope_theta: float = 10000.0
  rope_scaling: Optional[families.RopeScaling] = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  sliding_window: Optional[int] = None
  remat: bool = False
  shard: Optional[ActivationSharding] = None
  attention: str = "xla"
  fp8: Optional[precision_lib.Fp8Recipe] = None
  fp8_products: tuple[str, ...] = FP8_PRODUCTS
  bf16_layers: int = 1
  num_experts: int = 0
  experts_per_token: int = 2
  expert_d_ff: Optional[int] = None
  router: str = "softmax"
  router_normalize: bool = True
  router_bias_rate: float = 0.0
  shared_d_ff: int = 0
  aux_loss_coef: float = 0.0
  z_loss_coef: float = 0.0
  capacity_factor: Optional[float] = None
  recompute: Any = "none"
  recompute_layers: Optional[int] = None

  SIZES: ClassVar[tuple[str, ...]] = (
      "vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "seq_len",
      "init_std", "family", "num_kv_heads", "head_dim", "rope_theta", "rope_scaling",
      "norm_eps", "tie_embeddings", "sliding_window") + (
          "num_experts", "experts_per_token", "expert_d_ff", "router",
          "router_normalize", "router_bias_rate", "shared_d_ff", "aux_loss_coef",
          "z_loss_coef", "capacity_factor")
  """The fields that shape the model (and name the family)."""

  @classmethod
  def from_sizes(cls, sizes: Any, **kwargs: Any) -> "TinyLM":
    """A model with the `SIZES` read off ``sizes`` (any object with those
    attributes, e.g. the config's ``model`` section); ``kwargs``: ``remat``,
    ``recompute``, ``recompute_layers``, ``shard``, ``attention``, ``fp8``,
    ``fp8_products``, ``bf16_layers``."""
    fields = {name: getattr(sizes, name) for name in cls.SIZES}
    fields["rope_scaling"] = families.RopeScaling.from_dict(fields["rope_scaling"])
    return cls(**fields, **kwargs)

  @property
  def kv_heads(self) -> int:
    """K/V heads (``num_kv_heads``, or ``num_heads``)."""
    return self.num_kv_heads or self.num_heads

  @property
  def dims_per_head(self) -> int:
    """Each head's width (``head_dim``, or ``d_model / num_heads``)."""
    return self.head_dim or self.d_model // self.num_heads

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "seq_len"):
      validation.positive_int(name, getattr(self, name))
    validation.positive_float("init_std", self.init_std)
    self._check_family()
    self._check_experts()
    validation.boolean("remat", self.remat)
    parallel_lib.check_recompute_layers(
        self.recompute_layers, parallel_lib.recompute_policy(self.recompute, self.remat),
        self.num_layers)
    validation.one_of("attention", self.attention, ATTENTION[1:])
    if self.fp8 is not None:
      self._check_fp8()

  def _check_family(self) -> None:
    validation.one_of("family", self.family, families.FAMILIES)
    gpt = self.family == "gpt"
    if self.head_dim is None and self.d_model % self.num_heads:
      raise validation.ArgumentError(
          ("d_model", "num_heads"),
          f"{{0}} ({self.d_model}) must be divisible by {{1}} ({self.num_heads})")
    for name in ("num_kv_heads", "head_dim", "sliding_window"):
      if getattr(self, name) is not None:
        validation.positive_int(name, getattr(self, name))
    validation.positive_float("rope_theta", self.rope_theta)
    validation.positive_float("norm_eps", self.norm_eps)
    validation.boolean("tie_embeddings", self.tie_embeddings)
    if self.num_heads % self.kv_heads:
      raise validation.ArgumentError(
          ("num_heads", "num_kv_heads"),
          f"{{0}} ({self.num_heads}) must be a multiple of {{1}} ({self.kv_heads})")
    if gpt:
      for name, ok in (("num_kv_heads", self.kv_heads == self.num_heads),
                       ("head_dim", self.dims_per_head * self.num_heads == self.d_model),
                       ("rope_scaling", self.rope_scaling is None)):
        if not ok:
          raise validation.fail(name, " is not a setting of the gpt family (GPT-2's "
                                "block); choose a family that has it, e.g. llama")
    if self.sliding_window is not None and (
        gpt or not families.TRAITS[self.family].sliding_window):
      raise validation.fail("sliding_window", f" is not a setting of the "
                            f"{self.family} family; only mistral's")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling,
                                                        families.RopeScaling):
      raise validation.fail("rope_scaling", " must be a families.RopeScaling; "
                            "TinyLM.from_sizes reads a mapping",
                            validation.ArgumentTypeError)

  @property
  def routing(self) -> Optional[experts_lib.Routing]:
    """The blocks' routing (`mpscale.experts.Routing`); ``None`` for a dense
    family."""
    if not self.num_experts:
      return None
    try:
      return experts_lib.Routing(
          self.num_experts, self.experts_per_token, score=self.router,
          normalize=self.router_normalize, bias_rate=self.router_bias_rate,
          capacity_factor=self.capacity_factor)
    except validation.ArgumentError as e:  # in the model's (and config's) names
      raise e.renamed(lambda name: _ROUTING_NAMES.get(name, name)) from None

  @property
  def expert_width(self) -> int:
    """Each expert's hidden width (``expert_d_ff``, or ``d_ff``)."""
    return self.expert_d_ff or self.d_ff

  def _check_experts(self) -> None:
    experts = self.family != "gpt" and families.TRAITS[self.family].experts
    validation.integer("num_experts", self.num_experts, 0)
    if experts and not self.num_experts:
      raise validation.fail("num_experts", f" must be > 0 for the {self.family} "
                            "family (a mixture of experts)")
    if not experts:
      if self.num_experts:
        raise validation.fail("num_experts", f" is not a setting of the {self.family} "
                              "family; choose mixtral or qwen3_moe")
      return
    self.routing  # checks num_experts, experts_per_token, router, the rates
    if self.expert_d_ff is not None:
      validation.positive_int("expert_d_ff", self.expert_d_ff)
    validation.integer("shared_d_ff", self.shared_d_ff, 0)
    validation.non_negative_float("aux_loss_coef", self.aux_loss_coef)
    validation.non_negative_float("z_loss_coef", self.z_loss_coef)
    if self.fp8 is not None:
      raise validation.fail("fp8", ": the experts' products do not multiply in FP8 "
                            "yet; turn precision.fp8 off for a mixture of experts")

  @property
  def products(self) -> tuple[str, ...]:
    """The block's matrices that multiply in FP8 (``fp8_products`` in this
    family's names, `families.products`); ``()`` without ``fp8``."""
    if self.fp8 is None:
      return ()
    return families.products(self.family, tuple(self.fp8_products))

  def _check_fp8(self) -> None:
    if not isinstance(self.fp8, precision_lib.Fp8Recipe):
      raise validation.fail("fp8", " must be an mpscale.Fp8Recipe (mpscale.make_fp8_recipe) "
                            f"or None; got {type(self.fp8).__name__}",
                            validation.ArgumentTypeError)
    products = self.fp8_products
    if isinstance(products, str) or not isinstance(products, (tuple, list)):
      raise validation.fail("fp8_products", f" must be a list of {FP8_PRODUCTS}; got "
                            f"{products!r}", validation.ArgumentTypeError)
    for product in products:
      if product not in FP8_PRODUCTS:
        raise validation.fail("fp8_products", f": {product!r} names no product of the "
                              f"block; choose from {', '.join(FP8_PRODUCTS)}")
    if not products:
      raise validation.fail("fp8_products", " is empty: name a product, or turn FP8 "
                            "off")
    validation.integer("bf16_layers", self.bf16_layers, 0)
    if 2 * self.bf16_layers >= self.num_layers:
      raise validation.ArgumentError(
          ("bf16_layers", "num_layers"),
          f"{{0}} ({self.bf16_layers}) keeps the first and last {self.bf16_layers} "
          f"of the {{1}} ({self.num_layers}) blocks out of FP8, leaving none in it: "
          f"lower {{0}} below {self.num_layers / 2:g}")

  def _embed(self) -> Embed:
    return Embed(self.vocab_size, self.d_model, self.seq_len, self.init_std,
                 positions=self.family == "gpt")

  def _block(self, dtype: Any = None, laid_out: bool = True) -> nn.Module:
    """A block; ``laid_out=False``: without the activation layout (to make its
    parameters, which do not depend on it, from a one-row dummy input)."""
    shard = (self.shard if laid_out else None) or _unconstrained
    if self.family == "gpt":
      return Block(self.num_heads, self.d_ff, self.init_std, self.num_layers,
                   dtype=dtype, shard=shard, attention=self.attention, fp8=self.fp8)
    return LlamaBlock(self.num_heads, self.kv_heads, self.dims_per_head, self.d_ff,
                      self.init_std, family=self.family, rope_theta=self.rope_theta,
                      rope_scaling=self.rope_scaling, norm_eps=self.norm_eps,
                      sliding_window=self.sliding_window, dtype=dtype, shard=shard,
                      attention=self.attention, fp8=self.fp8, routing=self.routing,
                      expert_d_ff=self.expert_width, shared_d_ff=self.shared_d_ff)

  def _head(self, dtype: Any = None) -> Head:
    return Head(self.vocab_size, self.init_std, dtype=dtype,
                rms_eps=None if self.family == "gpt" else self.norm_eps,
                tied=self.tie_embeddings)

  def init(self, rng: jax.Array) -> Params:
    """Float32 parameters ``{"embed", "stages", "head"}``; ``stages`` leaves have a
    leading axis of ``num_layers`` (one independently initialized block each)."""
    return jax.jit(self._init)(rng)

  def _init(self, rng: jax.Array) -> Params:
    k_embed, k_stages, k_head = jax.random.split(rng, 3)
    # A short dummy sequence: no parameter's shape depends on its length (GPT-2's
    # position table is seq_len long whatever it embeds), and a long one would be
    # attended for nothing.
    length = min(self.seq_len, 8)
    tokens = jnp.zeros((1, length), jnp.int32)
    x = jnp.zeros((1, length, self.d_model), jnp.float32)
    block = self._block(laid_out=False)
    return {
        "embed": self._embed().init(k_embed, tokens)["params"],
        "stages": jax.vmap(lambda k: block.init(k, x)["params"])(
            jax.random.split(k_stages, self.num_layers)),
        "head": self._head().init(k_head, x, self._dummy_token())["params"],
    }

  def _dummy_token(self) -> Optional[jax.Array]:
    """What a tied head's initialization multiplies by (it makes no parameter of
    it)."""
    if not self.tie_embeddings:
      return None
    return jnp.zeros((self.vocab_size, self.d_model), jnp.float32)

  def logical_axes(self) -> Any:
    """A logical name per dimension of every parameter, in the structure of
    `init`'s params: ``layers`` (the stacked blocks), ``embed`` (model width),
    ``heads`` (the qkv and out-projection columns and rows, head by head),
    ``kv_heads`` (grouped K/V heads), ``mlp``, ``vocab``, and ``None`` for
    dimensions never split (positions, a head's width)."""
    names = {
        "embed/token": ("vocab", "embed"), "embed/position": (None, "embed"),
        "qkv/kernel": ("embed", "heads"), "qkv/bias": ("heads",),
        "out/kernel": ("heads", "embed"), "out/bias": ("embed",),
        "fc/kernel": ("embed", "mlp"), "fc/bias": ("mlp",),
        "proj/kernel": ("mlp", "embed"), "proj/bias": ("embed",),
        "head/out/kernel": ("embed", "vocab"),
        "q/kernel": ("embed", "heads"), "q/bias": ("heads",),
        "k/kernel": ("embed", "kv_heads"), "k/bias": ("kv_heads",),
        "v/kernel": ("embed", "kv_heads"), "v/bias": ("kv_heads",),
        "o/kernel": ("heads", "embed"), "q_norm/scale": (None,),
        "k_norm/scale": (None,), "gate/kernel": ("embed", "mlp"),
        "up/kernel": ("embed", "mlp"), "down/kernel": ("mlp", "embed"),
        "moe/router": ("embed", None), "moe/gate": ("experts", "embed", "expert_mlp"),
        "moe/up": ("experts", "embed", "expert_mlp"),
        "moe/down": ("experts", "expert_mlp", "embed"),
        "moe/shared_gate/kernel": ("embed", "mlp"),
        "moe/shared_up/kernel": ("embed", "mlp"),
        "moe/shared_down/kernel": ("mlp", "embed"),
    }

    def name(path, _):
      key = _tree.path_str(path)
      top, rest = key.split("/", 1)
      axes = names.get(key, names.get(rest, ("embed",)))  # layer norms: (embed,)
      return ("layers",) + axes if top == "stages" else axes

    shapes = jax.eval_shape(self._init, jax.random.key(0))
    return jax.tree_util.tree_map_with_path(name, shapes)

  def param_specs(self, mesh: Any, rules: Any = LOGICAL_RULES,
                  fsdp_axis: parallel_lib.AxisNames = "fsdp", pad: bool = False,
                  transpose_axis: Optional[str] = None) -> Any:
    """PartitionSpecs of the params on ``mesh``: `logical_axes` through ``rules``
    (rules naming an axis ``mesh`` lacks, or one of size 1, are dropped), then FSDP
    over ``fsdp_axis`` (an axis, or several: those ``mesh`` has at sizes above 1)
    on each leaf's largest free dimension it divides
    (`mpscale.parallel.fsdp_specs`; with ``pad``, a leaf none divides on the one
    whose padding costs least, stored padded by the step; with ``transpose_axis``
    on ``mesh``, a second FSDP axis on another dimension,
    `mpscale.parallel.split_across`), the token table's on its width. FSDP never
    splits the stacked blocks' layer dimension, which the layers' ``lax.scan``
    slices a block at a time.

    Raises:
      ValueError: when ``tensor`` does not divide the heads, the MLP width or the
        vocabulary, naming both.
    """
    rules = tuple((name, axis) for name, axis in rules
                  if axis is not None and all(
                      a in mesh.axis_names and mesh.shape[a] > 1
                      for a in ((axis,) if isinstance(axis, str) else axis)))
    rules = tuple((name, axis) for name, axis in rules if name != "kv_heads"
                  or self.kv_heads % parallel_lib.axis_size(mesh, axis) == 0)
    sizes = {"heads": "num_heads", "mlp": "d_ff", "vocab": "vocab_size",
             "experts": "num_experts", "expert_mlp": "expert_width"}
    for name, axis in rules:
      if name in sizes:
        n, size = getattr(self, sizes[name]), parallel_lib.axis_size(mesh, axis)
        if n % size:
          raise validation.fail(sizes[name], f" ({n}) is not divisible by mesh axis "
                                f"{axis!r} (size {size})")
    specs = parallel_lib.logical_specs(self.logical_axes(), rules)
    fsdp_axis = parallel_lib.spec_entry([
        a for a in parallel_lib.entry_axes(fsdp_axis)
        if a in mesh.axis_names and mesh.shape[a] > 1])
    if fsdp_axis is not None:
      # The token table over its width: its lookup then exchanges the looked-up rows
      # (all-to-all) rather than gathering the table (`keep_batch_split`).
      table = parallel_lib.pad(specs["embed"]["token"], 2)
      size = parallel_lib.axis_size(mesh, fsdp_axis)
      if table[1] is None and size > 1 and self.d_model % size == 0:
        specs["embed"]["token"] = jax.sharding.PartitionSpec(table[0], fsdp_axis)
      if transpose_axis not in mesh.axis_names or mesh.shape[transpose_axis] == 1:
        transpose_axis = None
      shapes = jax.eval_shape(self._init, jax.random.key(0))
      blocks = specs["stages"]
      shapes["stages"] = jax.tree_util.tree_map(  # one block's
          lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), shapes["stages"])
      specs["stages"] = jax.tree_util.tree_map(
          lambda spec: jax.sharding.PartitionSpec(*spec[1:]), blocks,
          is_leaf=parallel_lib.is_spec)
      specs = parallel_lib.fsdp_specs(shapes, mesh, fsdp_axis, specs, pad,
                                      transpose_axis)
      specs["stages"] = jax.tree_util.tree_map(
          lambda spec, stacked: jax.sharding.PartitionSpec(
              parallel_lib.pad(stacked, 1)[0], *spec),
          specs["stages"], blocks, is_leaf=parallel_lib.is_spec)
    return specs

  def embed_fn(self, params: Params, batch: dict[str, jax.Array]) -> jax.Array:
    """Embeddings ``[B, T, d_model]`` of ``batch["inputs"]``, in the embedding's
    dtype; under context parallelism, in the order `ActivationSharding.order` lays
    the sequence out (the head reorders the targets alike)."""
    tokens = batch["inputs"]
    order = self._order(tokens.shape[-1])
    if order is not None:
      tokens = jnp.take(tokens, order, axis=-1)
    return self._embed().apply({"params": params["embed"]}, tokens, order)

  def _order(self, length: int) -> Optional[np.ndarray]:
    """The sequence's order under context parallelism (``None``: in order)."""
    return None if self.shard is None else self.shard.order(length)

  def stage_fn(self, layer_params: Params, x: jax.Array, state: Any = None
              ) -> jax.Array:
    """One block, computing in the dtype of its ``qkv`` kernel; with ``state`` (its
    ``{product: Fp8State}`` from `init_model_state`, as a `mpscale.Pipeline` passes
    it) the block's FP8 products multiply in FP8 where `fp8_block` says the block
    is an FP8 one (a ``lax.cond``: a pipeline's stage scans over its blocks; with
    ``bf16_layers`` 0 every block is, and there is no cond)."""
    if self.routing is not None:
      raise validation.fail("num_experts", ": a mixture of experts does not run in "
                            "a pipeline's stages yet (its losses and routing state "
                            "would not reach the step)")
    dtype = _compute_dtype(layer_params)
    block = lambda states: self._block(dtype).apply(  # noqa: E731
        {"params": layer_params}, x, states)
    if state is None:
      return block(None)
    if self.fp8 is not None and self.bf16_layers == 0:
      return block(state)
    return lax.cond(fp8_block(state), lambda: block(state), lambda: block(None))

  def logits_fn(self, params: Params, x: jax.Array) -> jax.Array:
    """Float32 logits ``[B, T, vocab]`` of the last hidden states ``x``."""
    token = params["embed"]["token"] if self.tie_embeddings else None
    dtype = (token if self.tie_embeddings else params["head"]["out"]["kernel"]).dtype
    return self._head(dtype).apply({"params": params["head"]}, x, token).astype(
        jnp.float32)

  def logits(self, params: Params, tokens: jax.Array) -> jax.Array:
    """Float32 logits ``[batch, length, vocab]`` of integer ``tokens`` ``[batch,
    length]``: the whole model, in the dtype of ``params``."""
    logits = self.logits_fn(params, self.hidden_fn(params, {"inputs": tokens}))
    order = self._order(tokens.shape[-1])
    if order is not None:  # back in order
      logits = jnp.take(logits, np.argsort(order), axis=1)
    return logits

  def head_fn(self, params: Params, x: jax.Array, batch: dict[str, jax.Array]
             ) -> tuple[jax.Array, jax.Array]:
    """``(loss_sum, num_tokens)``: float32 cross-entropy of ``batch["targets"]``
    summed over the tokens where ``batch["mask"]`` is 1, and their count (float32)."""
    logits = self.logits_fn(params, x)
    targets, mask = batch["targets"], batch.get("mask")
    if mask is None:
      mask = jnp.ones(targets.shape, jnp.float32)
    order = self._order(targets.shape[-1])
    if order is not None:  # as embed_fn laid the inputs out
      targets, mask = (jnp.take(t, order, axis=-1) for t in (targets, mask))
    return cross_entropy_sum(logits, targets, mask)

  def init_model_state(self) -> Optional[dict[str, Any]]:
    """The FP8 products' first scaling state (`mpscale.fp8_state` of the recipe, one
    per block, stacked on axis 0 as ``params["stages"]`` is), in the
    ``_overwrite_with_gradient`` collection; the first and last ``bf16_layers``
    blocks' states are zeros (no scale is 0: `fp8_block` reads them as compute-dtype
    blocks, and a product that never runs keeps its state). ``None`` without
    ``fp8``."""
    if self.routing is not None:
      return self._routing_state()
    if self.fp8 is None:
      return None
    one = precision_lib.fp8_state(self.fp8)
    ends, n = self.bf16_layers, self.num_layers
    on = jnp.arange(n)
    on = (on >= ends) & (on < n - ends)
    stacked = {product: jax.tree_util.tree_map(
        lambda x: jnp.where(on.reshape((n,) + (1,) * x.ndim), x[None], 0.0).astype(
            x.dtype), one)
               for product in self.products}
    return {precision_lib.OVERWRITE_WITH_GRADIENT: {"stages": stacked}}

  def _routing_state(self, stats: Optional[experts_lib.MoeStats] = None,
                     bias: Optional[jax.Array] = None) -> dict[str, Any]:
    """The mixture's model state: the balancing bias and the routing statistics
    (zeros before any step), one row a block."""
    n, e = self.num_layers, self.num_experts
    if stats is None:
      zeros = jnp.zeros((n,), jnp.float32)
      stats = experts_lib.MoeStats(zeros, zeros, jnp.zeros((n, e), jnp.float32),
                                   zeros, zeros)
    if bias is None:
      bias = jnp.zeros((n, e), jnp.float32)
    return {"moe": {"bias": bias, "counts": stats.counts, "dropped": stats.dropped,
                    "aux_loss": stats.aux_loss, "z_loss": stats.z_loss}}

  def routing_metrics(self, model_state: Any) -> dict[str, jax.Array]:
    """What a step logs of a mixture's routing state (``model_state["moe"]``, the
    last micro-batch's): ``load_max`` and ``load_min``, the most and the least
    loaded expert's share of a block's assignments over every block (``1 /
    num_experts`` when even); ``dropped``, the share of assignments dropped for
    capacity; ``aux_loss`` and ``z_loss``, the blocks' means."""
    moe = model_state["moe"]
    counts = moe["counts"]
    total = jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)
    share = counts / total
    return {"load_max": jnp.max(share), "load_min": jnp.min(share),
            "dropped": jnp.sum(moe["dropped"]) / jnp.sum(total),
            "aux_loss": jnp.mean(moe["aux_loss"]), "z_loss": jnp.mean(moe["z_loss"])}

  def _fp8_states(self, model_state: Any) -> Optional[dict[str, Any]]:
    """The stacked per-product states of ``model_state`` (``None``: no FP8)."""
    if model_state is None or self.routing is not None:
      return None
    if self.fp8 is None:
      raise validation.fail("model_state", ": the model has no FP8 products (fp8 is "
                            "None), so it keeps no state; pass none")
    return model_state[precision_lib.OVERWRITE_WITH_GRADIENT]["stages"]

  def _layers(self, params: Params, x: jax.Array, fp8_states: Any = None,
              biases: Any = None, first: int = 0) -> Any:
    """``x`` through the blocks of ``params["stages"]`` (a ``lax.scan``), the
    products of ``fp8_states`` (stacked alike) in FP8; a mixture's experts chosen
    with ``biases`` (``[layers, E]``); ``first``: the model's index of the first
    block, which `recompute_layers` counts from (two scans where it ends inside
    them). Returns ``x``, and with experts ``(x, stats)``, the
    `mpscale.experts.MoeStats` of every block stacked."""
    def block(layer_params, x, states, bias):
      dtype = _compute_dtype(layer_params)
      variables = {"params": layer_params}
      if bias is not None:
        variables["routing"] = {"moe": {"bias": bias}}
      out = self._block(dtype).apply(variables, x, states)
      return out if self.routing is not None else (out, None)
    policy = parallel_lib.recompute_policy(self.recompute, self.remat)

    def layer_of(recomputed):
      stage = block if policy is None or not recomputed else jax.checkpoint(
          block, policy=policy)
      return lambda x, xs: stage(xs[0], x, *xs[1:])

    layers = jax.tree_util.tree_leaves(params)[0].shape[0]
    recomputed = (None if self.recompute_layers is None
                  else max(self.recompute_layers - first, 0))
    # Unrolled for up to 8 layers: XLA compiles it about twice as fast as a loop.
    x, stats = parallel_lib.scan_layers(layer_of, x, (params, fp8_states, biases),
                                        recomputed, unroll=layers <= 8)
    return x if self.routing is None else (x, stats)

  def _routed(self, params: Params, batch: dict[str, jax.Array],
              model_state: Any) -> tuple[jax.Array, experts_lib.MoeStats]:
    """The last hidden states of a mixture of experts, and its blocks' stats."""
    bias = None
    if self.router_bias_rate:
      state = model_state or self._routing_state()
      bias = state["moe"]["bias"]
    return self._layers(params["stages"], self.embed_fn(params, batch), biases=bias)

  def hidden_fn(self, params: Params, batch: dict[str, jax.Array],
                model_state: Any = None) -> jax.Array:
    """The last hidden states: ``embed_fn`` then every block (a ``lax.scan``); with
    an FP8 ``model_state`` (`init_model_state`), three scans: the first
    ``bf16_layers`` blocks, the FP8 ones, the last ``bf16_layers``."""
    if self.routing is not None:
      return self._routed(params, batch, model_state)[0]
    x = self.embed_fn(params, batch)
    states = self._fp8_states(model_state)
    if states is None:
      return self._layers(params["stages"], x)
    ends, n = self.bf16_layers, self.num_layers
    part = lambda tree, a, b: jax.tree_util.tree_map(  # noqa: E731
        lambda p: p[a:b], tree)
    if ends:
      x = self._layers(part(params["stages"], 0, ends), x)
    x = self._layers(part(params["stages"], ends, n - ends), x,
                     part(states, ends, n - ends), first=ends)
    if ends:
      x = self._layers(part(params["stages"], n - ends, n), x, first=n - ends)
    return x

  def loss_fn(self, params: Params, batch: dict[str, jax.Array],
              model_state: Any = None) -> Any:
    """The unpipelined model: ``(loss_sum, num_tokens)`` for a per-token loss; with
    an FP8 ``model_state``, ``((loss_sum, num_tokens), model_state)`` (the state as
    given: its gradient is its update)."""
    if self.routing is not None:
      return self._routed_loss(params, batch, model_state)
    out = self.head_fn(params, self.hidden_fn(params, batch, model_state), batch)
    return out if model_state is None else (out, model_state)

  def _routed_loss(self, params: Params, batch: dict[str, jax.Array],
                   model_state: Any) -> Any:
    """`loss_fn` of a mixture of experts: the cross-entropy plus the router's
    losses per token, and the new routing state."""
    x, stats = self._routed(params, batch, model_state)
    loss_sum, num_tokens = self.head_fn(params, x, batch)
    extra = 0.0
    if self.aux_loss_coef:
      extra += self.aux_loss_coef * jnp.mean(stats.aux_loss)
    if self.z_loss_coef:
      extra += self.z_loss_coef * jnp.mean(stats.z_loss)
    if self.aux_loss_coef or self.z_loss_coef:
      loss_sum = loss_sum + extra * num_tokens
    if model_state is None:
      return loss_sum, num_tokens
    bias = experts_lib.update_bias(model_state["moe"]["bias"],
                                   lax.stop_gradient(stats.counts),
                                   self.router_bias_rate)
    return (loss_sum, num_tokens), self._routing_state(
        jax.tree_util.tree_map(lax.stop_gradient, stats), bias)

  def evaluate(self, params: Params, batch: dict[str, jax.Array],
               model_state: Any = None) -> tuple[jax.Array, jax.Array]:
    """``(loss_sum, num_tokens)`` of the cross-entropy as ``loss_fn`` computes it
    (in FP8 with a state; a mixture's router losses left out), without the
    state."""
    if self.routing is not None:
      return self.head_fn(params, self.hidden_fn(params, batch, model_state), batch)
    out = self.loss_fn(params, batch, model_state)
    return out if model_state is None else out[0]

  def generate(self, params: Params, prompt: np.ndarray, num_tokens: int, *,
               rng: jax.Array, temperature: float = 1.0,
               start: Optional[int] = None) -> np.ndarray:
    """``prompt`` followed by ``num_tokens`` sampled tokens.

    One compiled forward pass over a window of ``seq_len`` tokens (right-padded; the
    attention is causal, so padding never reaches the position read), slid along as
    the text grows past it.

    Args:
      params: the model's parameters (in the dtype to compute in).
      prompt: 1-D integer tokens; may be empty.
      num_tokens: how many tokens to write, >= 1.
      rng: a JAX random key.
      temperature: softmax temperature; 0 picks the likeliest token every time.
      start: the token an empty prompt is conditioned on (not returned); default a
        newline byte (10). A token corpus's end-of-document id starts a document.

    Returns:
      A 1-D ``int32`` array: the prompt, then the written tokens.
    """
    validation.positive_int("num_tokens", num_tokens)
    validation.non_negative_float("temperature", temperature)
    window = self.seq_len
    # one sequence, in order: the training layout (its batch and context splits)
    # left to GSPMD
    model = dataclasses.replace(self, shard=None)

    @jax.jit
    def next_token(params, tokens, length, key):
      x = model.hidden_fn(params, {"inputs": tokens[None]})
      logits = model.logits_fn(params, x)[0, length - 1]
      if temperature == 0:
        return jnp.argmax(logits)
      return jax.random.categorical(key, logits / temperature)

    text = [int(t) for t in np.asarray(prompt).reshape(-1)]
    begin = len(text)
    if not text:
      text = [ord("\n") if start is None else int(start)]  # to condition on
    for key in jax.random.split(rng, num_tokens):
      context = text[-window:]
      tokens = np.zeros(window, np.int32)
      tokens[:len(context)] = context
      text.append(int(next_token(params, jnp.asarray(tokens), len(context), key)))
    return np.asarray(text[-(begin + num_tokens):] if begin else text[1:], np.int32)

  def mean_loss_fn(self, params: Params, batch: dict[str, jax.Array],
                   model_state: Any = None) -> Any:
    """The mean per token of ``loss_fn``'s loss of ``batch`` (for
    ``per_token_loss=False``); with a ``model_state``, ``(mean, new_state)``."""
    out = self.loss_fn(params, batch, model_state)
    (loss_sum, num_tokens), model_state = (
        (out, None) if model_state is None else out)
    mean = loss_sum / jnp.maximum(num_tokens, 1.0)
    return mean if model_state is None else (mean, model_state)


def _compute_dtype(layer_params: Params) -> Any:
  """The dtype a block computes in: its attention input projection's."""
  return layer_params["qkv" if "qkv" in layer_params else "q"]["kernel"].dtype


def num_params(params: Any) -> int:
  """Number of parameter elements."""
  return int(sum(np.size(x) for x in jax.tree_util.tree_leaves(params)))
