"""Context parallelism: attention over a sequence split along a ``context`` mesh axis.

Every activation's sequence dimension is split over the ``context`` axis; only
attention mixes positions, and it is the one piece that needs the other devices'
keys and values. `context_attention` computes causal attention of such a split
sequence inside a ``shard_map`` over the mesh (each device its own rows, heads and
batch), in one of two ways (`CONTEXT_PARALLEL`):

``ring``
  The keys and values go around the ``context`` axis (``ppermute``): at step ``s``
  a device attends its queries against the block of the device ``s`` places before
  it, while the next block is already in flight; the partial results are merged
  with their log-sum-exp. Grouped K/V travel as the K/V heads alone. The backward
  passes the blocks around again, with their gradients travelling beside them.
``all_gather``
  The keys and values are gathered once a layer (the Llama 3 paper's choice), and
  their gradients reduce-scattered; each device then attends the same blocks the
  ring would hand it.

**Load balance.** Causal attention's work grows with position, so a device holding
the sequence's end would do most of it. In the balanced order (`context_order`) the
sequence is cut into ``2 N`` chunks and device ``c`` holds chunks ``c`` and ``2N - 1
- c``: every device then attends the same number of blocks. Against another device's
block, a device attends half of its queries against all of the block or all of its
queries against half of it; blocks wholly above the diagonal are never multiplied.
A model whose positions follow this order (`mpscale.trainer.models.lm.TinyLM` does)
takes ``balanced=True``; a user's model, whose positions count up its sequence,
keeps the sequence in order (``balanced=False``: device ``c`` holds chunk ``c``,
and the blocks above the diagonal are computed and dropped).

Each block is one of two kinds, computed by `jax.nn.dot_product_attention`'s cuDNN
kernel (``implementation="cudnn"``: forward with its log-sum-exp, backward given the
merged output and log-sum-exp, as FlashAttention-2's backward takes them) or by XLA
(``"xla"``: the scores in float32, masked by position): a causal square (a chunk
against itself) or a full one.

References:
  Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for
  Near-Infinite Context", 2023. https://arxiv.org/abs/2310.01889
  Dao, "FlashAttention-2", 2023, section 3.1 (the log-sum-exp and the backward).
  https://arxiv.org/abs/2307.08691
  Grattafiori et al., "The Llama 3 Herd of Models", 2024, section 3.3.2 (all-gather
  context parallelism, the 2N-chunk balanced order). https://arxiv.org/abs/2407.21783
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec
import numpy as np

from mpscale import validation
from mpscale.parallel._layouts import entry_axes, only_axes, pad, spec_entry
from mpscale.parallel._mesh import manual_axes, cast_varying, varying_axes

CONTEXT_AXIS = "context"
"""The mesh axis the sequence is split over."""

CONTEXT_PARALLEL = ("ring", "all_gather")
"""How attention crosses the split: K/V blocks around a ring, or gathered once."""

_NEG = float(jnp.finfo(jnp.float32).min)


def context_size(mesh: Any, axis: str = CONTEXT_AXIS) -> int:
  """The size of ``mesh``'s ``axis`` (1 without a mesh or the axis)."""
  if mesh is None or axis not in getattr(mesh, "axis_names", ()):
    return 1
  return int(mesh.shape[axis])


def check_context_length(length: int, size: int, balanced: bool = True,
                         name: str = "seq_len") -> None:
  """The sequence rule: ``2 x size`` (balanced) or ``size`` chunks of equal length.

  Raises:
    ArgumentError: naming ``name`` and ``mesh.context``.
  """
  chunks = 2 * size if balanced else size
  if size > 1 and length % chunks:
    raise validation.ArgumentError(
        (name, "mesh.context"),
        f"{{0}} ({length}) must be divisible by {'2 x ' if balanced else ''}{{1}} "
        f"({chunks}): the sequence is cut into {chunks} equal chunks over the "
        "context axis")


def context_order(length: int, size: int, balanced: bool = True) -> np.ndarray:
  """The positions of a sequence of ``length`` laid out over ``size`` devices, in
  the order the devices hold them (device ``c``'s slice is the ``c``-th
  ``length / size``): balanced, chunks ``c`` and ``2 size - 1 - c`` of ``2 size``;
  else in order (``arange``)."""
  if size == 1 or not balanced:
    return np.arange(length, dtype=np.int32)
  check_context_length(length, size)
  chunk = length // (2 * size)
  pieces = []
  for c in range(size):
    for i in (c, 2 * size - 1 - c):
      pieces.append(np.arange(i * chunk, (i + 1) * chunk))
  return np.concatenate(pieces).astype(np.int32)


# ------------------------------------------------------------------- one block
def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
  """``[b, r, heads, d]`` as ``[b, r, kv_heads, heads / kv_heads, d]``."""
  b, r, h, d = q.shape
  return q.reshape(b, r, kv_heads, h // kv_heads, d)


def _mask(qpos: jax.Array, kpos: jax.Array, window: Optional[int]) -> jax.Array:
  seen = kpos[None, :] <= qpos[:, None]
  if window is not None:
    seen &= qpos[:, None] - kpos[None, :] < window
  return seen


def _xla_scores(q, k, qpos, kpos, window, scale):
  s = jnp.einsum("bqkgd,bskd->bkgqs", _grouped(q, k.shape[2]), k,
                 preferred_element_type=jnp.float32) * jnp.float32(scale)
  return jnp.where(_mask(qpos, kpos, window), s, _NEG)


def _xla_forward(q, k, v, qpos, kpos, causal, window, scale):
  """A block's float32 output ``[b, r, h, d]`` and log-sum-exp ``[b, h, r]``."""
  del causal  # the positions mask
  s = _xla_scores(q, k, qpos, kpos, window, scale)
  lse = jax.nn.logsumexp(s, axis=-1)
  p = jnp.exp(s - lse[..., None]).astype(v.dtype)
  o = jnp.einsum("bkgqs,bskd->bqkgd", p, v, preferred_element_type=jnp.float32)
  b, r, kh, g, d = o.shape
  return o.reshape(b, r, kh * g, d), lse.reshape(b, kh * g, r)


def _xla_backward(q, k, v, qpos, kpos, out, lse, g, causal, window, scale):
  """A block's ``dq, dk, dv`` (float32) given the merged ``out``, ``lse`` and the
  output's cotangent ``g`` of these query rows."""
  del causal
  kh = k.shape[2]
  s = _xla_scores(q, k, qpos, kpos, window, scale)
  b, _, _, r, _ = s.shape
  p = jnp.exp(s - lse.reshape(b, kh, -1, r)[..., None])
  g32 = _grouped(g.astype(jnp.float32), kh)
  dv = jnp.einsum("bkgqs,bqkgd->bskd", p, g32)
  dp = jnp.einsum("bqkgd,bskd->bkgqs", g32, v.astype(jnp.float32))
  delta = jnp.sum(g32 * _grouped(out.astype(jnp.float32), kh), axis=-1)
  ds = p * (dp - jnp.moveaxis(delta, 1, -1)[..., None]) * jnp.float32(scale)
  dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, k.astype(jnp.float32))
  dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, _grouped(q.astype(jnp.float32), kh))
  return dq.reshape(q.shape), dk, dv


def _cudnn():
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top
  return fa


def _cudnn_forward(q, k, v, qpos, kpos, causal, window, scale):
  del qpos, kpos, window
  fa = _cudnn()
  mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
  out, lse = fa.dot_product_attention(q, k, v, scale=scale, mask_type=mask,
                                      return_residual=True)
  return out.astype(jnp.float32), lse


def _cudnn_backward(q, k, v, qpos, kpos, out, lse, g, causal, window, scale):
  del qpos, kpos, window
  fa = _cudnn()
  mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
  unused = jnp.zeros(0, q.dtype)
  dq, dk, dv = fa._dot_product_attention_bwd_p_wrapper.bind(  # pylint: disable=protected-access
      q, k, v, unused, unused, unused, unused, unused, unused, unused,
      lse, out.astype(q.dtype), g.astype(q.dtype), scale=scale, seed=42,
      dropout_rate=0.0, variadic_args=(False, False), mask_type=mask,
      layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None)
  return (dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32))


_BLOCKS = {"xla": (_xla_forward, _xla_backward),
           "cudnn": (_cudnn_forward, _cudnn_backward)}


# ------------------------------------------------------------------- the blocks a step attends
def _merge(acc, part):
  """Two partial results ``(out [b, r, h, d], lse [b, h, r])`` as one."""
  if acc is None:
    return part
  (o1, l1), (o2, l2) = acc, part
  lse = jnp.logaddexp(l1, l2)
  w1 = jnp.moveaxis(jnp.exp(l1 - lse), 1, -1)[..., None]
  w2 = jnp.moveaxis(jnp.exp(l2 - lse), 1, -1)[..., None]
  return o1 * w1 + o2 * w2, lse


class _Layout:
  """Which of a device's query chunks attend which chunks of a source device's
  block at a ring step, and their positions."""

  def __init__(self, rows: int, size: int, balanced: bool, axis: str):
    self.size, self.balanced = size, balanced
    self.chunk = rows // 2 if balanced else rows
    self.c = lax.axis_index(axis)

  def positions(self, device):
    n, s = self.size, self.chunk
    base = jnp.arange(s, dtype=jnp.int32)
    if not self.balanced:
      return (device * s + base,)
    return (device * s + base, (2 * n - 1 - device) * s + base)

  def pieces(self, step: int, source):
    """``(query chunk, key chunk, causal, keep)`` for this step: chunk indices (0 or
    1, or a traced choice between them), and whether the piece counts (a traced
    bool where it depends on the device)."""
    if step == 0:
      if not self.balanced:
        return [(0, 0, True, True)]
      return [(0, 0, True, True), (1, 1, True, True), (1, 0, False, True)]
    before = source < self.c
    if not self.balanced:  # above the diagonal when the source comes after
      return [(0, 0, False, before)]
    # source before: both query chunks see its first chunk; after: the second query
    # chunk sees both of its chunks
    first_q = jnp.where(before, 0, 1)
    second_k = jnp.where(before, 0, 1)
    return [(first_q, 0, False, True), (1, second_k, False, True)]


def _chunk(x, i, size, axis=1):
  """Chunk ``i`` (static or traced) of ``size`` rows of ``x`` along ``axis`` (the
  rows; a log-sum-exp's are on axis 2)."""
  if isinstance(i, int):
    return lax.slice_in_dim(x, i * size, (i + 1) * size, axis=axis)
  return lax.dynamic_slice_in_dim(x, i * size, size, axis=axis)


def _ring_forward(q, k, v, *, axis, size, mode, impl, balanced, window, scale):
  forward, _ = _BLOCKS[impl]
  layout = _Layout(q.shape[1], size, balanced, axis)
  s = layout.chunk
  qpos = layout.positions(layout.c)
  chunks = len(qpos)
  acc = [None] * chunks
  shift = [(i, (i + 1) % size) for i in range(size)]
  gathered = None
  if mode == "all_gather":
    gathered = tuple(lax.all_gather(t, axis, axis=1, tiled=True) for t in (k, v))
  kv = (k, v)
  for step in range(size):
    source = (layout.c - step) % size
    if mode == "ring" and step + 1 < size:
      if step:
        # The next transfer starts once the previous step's blocks are merged, so
        # that it runs while this step's are attended: without the barrier XLA's
        # GPU scheduler issues the ring's transfers together, ahead of the
        # attention (about half of them then overlap nothing).
        kv, acc = lax.optimization_barrier((kv, acc))
      incoming = lax.ppermute(kv, axis, shift)  # in flight while this step attends
    elif mode == "all_gather" and step:
      kv = tuple(_chunk(t, source, k.shape[1]) for t in gathered)
    kpos = layout.positions(source)
    for qi, ki, causal, keep in layout.pieces(step, source):
      piece = forward(_chunk(q, qi, s), _chunk(kv[0], ki, s), _chunk(kv[1], ki, s),
                      _select(qpos, qi), _select(kpos, ki), causal, window, scale)
      if keep is not True:
        piece = (piece[0], jnp.where(keep, piece[1], _NEG))
      for target in range(chunks):
        if isinstance(qi, int):
          if qi == target:
            acc[target] = _merge(acc[target], piece)
        else:
          mine = (piece[0], jnp.where(qi == target, piece[1], _NEG))
          acc[target] = _merge(acc[target], mine)
    if mode == "ring" and step + 1 < size:
      kv = incoming
  out = jnp.concatenate([a[0] for a in acc], axis=1)
  lse = jnp.concatenate([a[1] for a in acc], axis=2)
  return out, lse


def _select(positions, i):
  if isinstance(i, int):
    return positions[i]
  return jnp.where(i == 0, positions[0], positions[-1])


def _ring_backward(q, k, v, out, lse, g, *, axis, size, mode, impl, balanced, window,
                   scale):
  _, backward = _BLOCKS[impl]
  layout = _Layout(q.shape[1], size, balanced, axis)
  s = layout.chunk
  qpos = layout.positions(layout.c)
  shift = [(i, (i + 1) % size) for i in range(size)]
  dq = jnp.zeros(q.shape, jnp.float32)
  if mode == "all_gather":
    gathered = tuple(lax.all_gather(t, axis, axis=1, tiled=True) for t in (k, v))
    dgathered = [jnp.zeros(t.shape, jnp.float32) for t in gathered]
  kv = (k, v)
  dkv = [jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)]
  for step in range(size):
    source = (layout.c - step) % size
    if mode == "all_gather" and step:
      kv = tuple(_chunk(t, source, k.shape[1]) for t in gathered)
      dkv = [jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)]
    if mode == "ring" and step + 1 < size:
      incoming = lax.ppermute(kv, axis, shift)
    kpos = layout.positions(source)
    for qi, ki, causal, keep in layout.pieces(step, source):
      rows = lambda x, i=qi: _chunk(x, i, s)  # noqa: E731
      dqi, dki, dvi = backward(rows(q), _chunk(kv[0], ki, s), _chunk(kv[1], ki, s),
                               _select(qpos, qi), _select(kpos, ki), rows(out),
                               _chunk(lse, qi, s, axis=2), rows(g), causal, window,
                               scale)
      if keep is not True:
        dqi, dki, dvi = (jnp.where(keep, t, 0.0) for t in (dqi, dki, dvi))
      dq = _add_chunk(dq, dqi, qi, s)
      dkv = [_add_chunk(dkv[0], dki, ki, s), _add_chunk(dkv[1], dvi, ki, s)]
    if mode == "all_gather":
      dgathered = [_add_chunk(d, t, source, k.shape[1])
                   for d, t in zip(dgathered, dkv)]
    elif step + 1 < size:
      kv, dkv = incoming, list(lax.ppermute(tuple(dkv), axis, shift))
  if mode == "all_gather":
    dk, dv = (lax.psum_scatter(d, axis, scatter_dimension=1, tiled=True)
              for d in dgathered)
  else:  # the gradients of the block next door's K/V: home, one step on
    dk, dv = lax.ppermute(tuple(dkv), axis, shift)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _add_chunk(total, part, i, size):
  """``total`` with ``part`` added to its chunk ``i`` (`_chunk`)."""
  if isinstance(i, int):
    return total.at[:, i * size:(i + 1) * size].add(part)
  return lax.dynamic_update_slice_in_dim(total, _chunk(total, i, size) + part,
                                         i * size, axis=1)


def _attention_fn(mesh, specs, automatic, options):
  """Attention over the split, with its own backward: each a ``shard_map`` of the
  local computation (`_ring_forward`, `_ring_backward`), so autodiff never
  transposes one."""
  q_spec, lse_spec = specs
  local = lambda fn, ins, outs: jax.shard_map(  # noqa: E731
      functools.partial(fn, **options), mesh=mesh, in_specs=ins, out_specs=outs,
      axis_names=set(automatic), check_vma=False)

  def forward_local(q, k, v, **kw):
    out, lse = _ring_forward(q, k, v, **kw)
    return out.astype(q.dtype), lse

  forward_map = local(forward_local, (q_spec,) * 3, (q_spec, lse_spec))
  backward_map = local(_ring_backward, (q_spec,) * 4 + (lse_spec, q_spec),
                       (q_spec,) * 3)

  def outputs(q, k, v):
    # varying over an enclosing shard_map's manual axes as the inputs are
    axes = varying_axes(q) | varying_axes(k) | varying_axes(v)
    return cast_varying(forward_map(q, k, v), tuple(axes))

  @jax.custom_vjp
  def attend(q, k, v):
    return outputs(q, k, v)[0]

  def forward(q, k, v):
    out, lse = outputs(q, k, v)
    return out, (q, k, v, out, lse)

  def backward(res, g):
    grads = backward_map(*res, g)
    return tuple(cast_varying(d, varying_axes(x)) for d, x in zip(grads, res))

  attend.defvjp(forward, backward)
  return attend


def context_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh: Any,
                      spec: PartitionSpec, axis: str = CONTEXT_AXIS,
                      mode: str = "ring", implementation: str = "xla",
                      balanced: bool = True, window: Optional[int] = None,
                      scale: Optional[float] = None) -> jax.Array:
  """Causal attention of a sequence split over ``mesh``'s ``axis``.

  Args:
    q, k, v: ``[batch, length, heads, head_dim]`` (global view; ``k`` and ``v`` may
      hold fewer heads, a divisor of ``q``'s: grouped-query attention, query head
      ``i`` reading K/V head ``i // (heads / kv_heads)``), their rows in
      `context_order` (``balanced``) or in order.
    mesh: the mesh (a ``Mesh``, or inside a ``shard_map`` its abstract mesh).
    spec: how ``q`` lies on the mesh, its sequence dimension over ``axis``; ``k``
      and ``v`` lie alike (their heads split only where ``spec`` splits ``q``'s and
      the split divides them: else pass them repeated to ``q``'s heads).
    axis: the context axis.
    mode: ``"ring"`` or ``"all_gather"`` (`CONTEXT_PARALLEL`).
    implementation: each block's attention: ``"xla"`` or ``"cudnn"`` (NVIDIA GPUs,
      16-bit activations; no ``window``).
    balanced: the rows are in the balanced order (`context_order`).
    window: each query attends its ``window`` latest keys only (``xla``).
    scale: the scores' scale (default ``1 / sqrt(head_dim)``).

  Returns:
    The attention output, shaped and laid out as ``q``.

  Raises:
    ArgumentError: naming ``context_parallel`` for an unknown mode, or the sequence
      length (``seq_len``) when the chunks do not divide it.
  """
  validation.one_of("context_parallel", mode, CONTEXT_PARALLEL)
  validation.one_of("implementation", implementation, tuple(_BLOCKS))
  if implementation == "cudnn" and window is not None:
    raise validation.fail("implementation", ": cuDNN's blocks take no sliding "
                          "window; use xla")
  manual, abstract = manual_axes()
  if manual:  # inside a shard_map (a pipeline's): nest in its abstract mesh
    mesh = abstract
  size = context_size(mesh, axis)
  check_context_length(q.shape[1], size, balanced)
  scale = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  automatic = tuple(a for a in mesh.axis_names if a not in manual)
  entries = pad(spec, 4)
  entries[1] = spec_entry(tuple(a for a in entry_axes(entries[1]) if a != axis)
                          + (axis,))
  q_spec = PartitionSpec(*pad(only_axes(PartitionSpec(*entries), automatic), 4))
  heads = entry_axes(entries[2])
  if heads and k.shape[2] % math.prod(mesh.shape[a] for a in heads):
    raise validation.fail("k", f": its {k.shape[2]} heads are not split as the "
                          f"queries' are (over {heads}); repeat them to the queries' "
                          "heads")
  for count in _SEEN:
    count[0] += 1
  lse_spec = PartitionSpec(q_spec[0], q_spec[2], q_spec[1])
  options = dict(axis=axis, size=size, mode=mode, impl=implementation,
                 balanced=balanced, window=window, scale=scale)
  return _attention_fn(mesh, (q_spec, lse_spec), automatic, options)(q, k, v)


# ------------------------------------------------------------------- a user's model
_SEEN: list = []  # one counter per active `attention_over`, trace-time only


def split_sequence(batch: Any, mesh: Any, data_axes: tuple[str, ...],
                   axis: str = CONTEXT_AXIS) -> Any:
  """``batch`` laid out for context parallelism: each leaf of two or more
  dimensions whose second (the sequence) divides over ``axis`` split along it, its
  rows over ``data_axes``; other leaves as they are."""
  size = context_size(mesh, axis)

  def split(x):
    if size == 1 or np.ndim(x) < 2 or x.shape[1] % size:
      return x
    spec = PartitionSpec(spec_entry(data_axes), axis)
    return lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))
  return jax.tree_util.tree_map(split, batch)


class attention_over:  # noqa: N801 (a context manager, used as a function)
  """While tracing a user's model: its ``jax.nn.dot_product_attention`` calls become
  `context_attention` over ``mesh``'s ``axis`` (the sequence in order, as the model
  counts its positions; causal attention only), and `seen` counts the attentions
  that crossed the split (these, and the built-in model's own).

  A call the split cannot follow (not causal, a ``bias`` or ``mask``, sequence
  lengths, inputs not ``[batch, length, heads, head_dim]``) raises a ``ValueError``
  naming ``mesh.context`` and what to call instead.
  """

  def __init__(self, mesh: Any, data_axes: tuple[str, ...], mode: str = "ring",
               axis: str = CONTEXT_AXIS):
    validation.one_of("context_parallel", mode, CONTEXT_PARALLEL)
    self.mesh, self.data_axes, self.mode, self.axis = mesh, data_axes, mode, axis
    self.count = [0]

  def seen(self) -> int:
    """The attentions across the split traced so far (under this context)."""
    return self.count[0]

  def __enter__(self) -> "attention_over":
    self._original = jax.nn.dot_product_attention
    jax.nn.dot_product_attention = self._attention
    _SEEN.append(self.count)
    return self

  def __exit__(self, *exc) -> None:
    jax.nn.dot_product_attention = self._original
    _SEEN.remove(self.count)

  def _attention(self, query, key, value, bias=None, mask=None, *, scale=None,
                 is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                 local_window_size=None, implementation=None, **unknown):
    refused = [name for name, value in (
        ("bias", bias), ("mask", mask), ("query_seq_lengths", query_seq_lengths),
        ("key_value_seq_lengths", key_value_seq_lengths)) if value is not None]
    refused += list(unknown)
    if not is_causal:
      refused.append("is_causal=False")
    if query.ndim != 4:
      refused.append(f"{query.ndim}-D inputs")
    if refused:
      raise ValueError(
          f"mesh.context ({context_size(self.mesh, self.axis)}): the model's "
          f"jax.nn.dot_product_attention call has {', '.join(refused)}, which "
          "attention across a split sequence cannot follow; call it with "
          "[batch, length, heads, head_dim] inputs and is_causal=True (and at most "
          "local_window_size=(left, 0)), or set mesh.context: 1")
    window = None
    if local_window_size is not None:
      left, right = ((local_window_size, 0) if isinstance(local_window_size, int)
                     else local_window_size)
      if right:
        raise ValueError(f"mesh.context: local_window_size {local_window_size} "
                         "looks ahead, which causal attention never does; pass "
                         "(left, 0)")
      window = left + 1
    impl = "cudnn" if implementation == "cudnn" and window is None else "xla"
    spec = PartitionSpec(spec_entry(self.data_axes), None, None, None)
    return context_attention(query, key, value, mesh=self.mesh, spec=spec,
                             axis=self.axis, mode=self.mode, implementation=impl,
                             balanced=False, window=window, scale=scale)
