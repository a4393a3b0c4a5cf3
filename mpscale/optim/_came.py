"""CAME: Adam-level quality at Adafactor-level memory, with every option working.

CAME keeps Adafactor's factored second moment (a row and a column vector per matrix)
and adds a "confidence" step: the momentum is divided by the square root of a factored
moving average of the instability ``(u - m)^2`` between the current (clipped) update and
the momentum. Per leaf and step ``t = 1, 2, ...``::

  g   = grad / loss_scale
  b2  = beta2 if beta2 is not None else 1 - t ** -decay_rate
  if rank(g) >= 2:                      # factored over the last two dims
    r = b2 r + (1 - b2) mean(g^2 + eps[0], axis=-1)
    c = b2 c + (1 - b2) mean(g^2 + eps[0], axis=-2)
    u = g * rsqrt(r / mean(r))[:, None] * rsqrt(c)[None, :]
  else:
    v = b2 v + (1 - b2) (g^2 + eps[0]);  u = g * rsqrt(v)
  u = u / max(1, rms(u) / clip_threshold)
  m = beta1 m + (1 - beta1) u           # no bias correction
  if rank(g) >= 2:
    U = (u - m)^2 + eps[2]
    R = beta3 R + (1 - beta3) mean(U, axis=-1);  C = beta3 C + (1 - beta3) mean(U, axis=-2)
    d = m * rsqrt(R / mean(R))[:, None] * rsqrt(C)[None, :]
  else:
    d = m
  lr = learning_rate(count)             # relative_step: min(1e-6 t if warmup_init
                                        #                    else 1e-2, 1 / sqrt(t))
  if scale_parameter: lr = lr * max(eps[1], rms(p))
  p = p - lr * (d + weight_decay(count) * p)   # decay only where mask is True

`scale_by_came` is the part that produces ``d``; `came` chains it with the decoupled
weight decay (``optax.add_decayed_weights``) and the learning rate.

The code reads the same way (the pseudocode's ``r, c, R, C, m`` are ``v_row, v_col,
s_row, s_col, mu``; the state keeps ``s_row, s_col`` as ``instability_row,
instability_col``)::

  scale_by_came: init _init_state, update _update  # hp: its checked arguments
  _update: _leaf_update on each leaf           # vectors' clip means first, batched
  _leaf_update(hp, g, stats, count, full):     # g in the compute dtype
    b2 = _beta2_at(hp, count, dtype)
    _factored_update(...) if rank >= 2 else _full_update(...)
  _factored_update(hp, g, mu, v_row, v_col, s_row, s_col, b2):
    v_row, v_col = _factored_second_moment(hp, g, v_row, v_col, b2)  # g^2 + eps_sq
    a, c = _clipped_factors(hp, g, v_row, v_col)   # c = rsqrt(v_col), a =
        # _rms_factor(v_row) * inv_scale / max(rms / clip_threshold, 1)
    u = g * a (x) c                              # g still scaled: 1 / scale is in a
    mu, mu_f = _store(hp, beta1 * mu + (1 - beta1) * u)  # mu_f: as read back
    s_row, s_col = _factored_instability(hp, g, a, c, mu_f, s_row, s_col)
    d = mu_f * _rms_factor(s_row) (x) rsqrt(s_col)
  _full_moments(hp, g, v, count) -> v, u = g * rsqrt(v)           # rank 0 and 1
  _mean_squares(us)        # mean(u^2) of each: on a GPU one reduction per bucket
  _full_update(hp, mu, v, u, mean_sq)     # u / max(sqrt(mean_sq) / clip, 1), mu
  stack_layers: the same, once per stack of one role's leaves (_stacks), batch 1:
                each leaf's clip sums over its own dims; d[j] is leaf j's;
                on XLA:CPU the reductions leaf by leaf (_layerwise)
  came = chain(scale_by_came, optax.add_decayed_weights,
               _scale_by_came_learning_rate)                   # lr = lr_at(count)

Memory: an ``(n, m)`` matrix costs ``n*m + 2*(n + m)`` numbers (the momentum and four
vectors), a vector of ``n`` costs ``2*n``. With ``compression`` the momentum (and the
unfactored second moments) are stored in float16 or bfloat16 and computed in float32.

Speed: the step allocates no gradient-sized temporary, and each matrix costs seven
fused passes: row and column sums of ``g^2``; the sum of ``u^2`` for the clip; the
momentum (written once); row and column sums of the instability; and the final update,
which XLA fuses into ``optax.apply_updates``. With ``compression`` the instability and
the update read the momentum as stored (rounded), as mindformers' ``Came`` does; on
XLA:CPU its float16-to-float32 conversion is not fused into the reductions, so there
compression saves memory but costs time. On an NVIDIA GPU the RMS clip's means of the
rank 0 and 1 leaves (biases, norm scales) are one reduction per bucket of stacked
leaves (`mpscale._tree.stack_buckets`), not one per leaf; the matrices stay leaf by
leaf (benchmarks/README.md says what stacking them in the update cost). With
``stack_layers`` the state itself is stacked by role (`mpscale.Stacks`: one array per
statistic of the same weight of every layer), so every reduction runs once per stack
and each parameter's update reads its layer of its stack's direction: on the H100
program of a 12-layer GPT-2 tree 1.6x AdamW's kernels instead of 4.5x, the bytes
unchanged (1.43x: XLA reduces rows and columns of one expression in two kernels).

References:
  Luo et al., "CAME: Confidence-guided Adaptive Memory Efficient Optimization",
  ACL 2023. https://arxiv.org/abs/2307.02047
  Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
  ICML 2018. https://arxiv.org/abs/1804.04235
  came-pytorch 0.1.3 (the authors' reference implementation), which this matches.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax

from mpscale import validation
from mpscale._tree import Stacks, layer_stacks, path_str, stack_buckets

ScalarOrSchedule = Union[float, Callable[[jax.Array], jax.Array]]
Compression = Union[bool, str, Any]
"""``False`` (no compression), ``True`` (float16), ``"float16"``, ``"bfloat16"`` or
one of those dtypes."""


class ScaleByCameState(NamedTuple):
  """State of `scale_by_came`.

  Every tree has the structure of the params; a leaf that does not use a statistic
  holds a one-element placeholder there (as optax's factored state does), so the
  state is what CAME needs plus one element per unused statistic. With
  ``stack_layers`` every field but ``count`` is a `mpscale.Stacks`: the same
  statistics, those of one role's leaves stacked on a leading axis (placeholders
  too, one per leaf).
  """
  count: jax.Array
  """int32 number of steps taken."""
  mu: Any
  """Momentum of the clipped update (compute dtype, or the compression dtype)."""
  v_row: Any
  """Factored second moment of the gradient, mean over the last dim (rank >= 2)."""
  v_col: Any
  """Factored second moment of the gradient, mean over the second-to-last dim."""
  v: Any
  """Full second moment of the gradient (rank 0 and 1). With ``compression`` it is
  stored as its square root (the gradient's RMS), whose range float16 covers for
  gradients from about 6e-8 to 6e4, where ``v`` itself would cover only 2e-4 to 256."""
  instability_row: Any
  """Factored moving average of ``(u - m)^2 + eps[2]``, mean over the last dim."""
  instability_col: Any
  """Factored moving average of the instability, mean over the second-to-last dim."""

  averaged_dims = {"v_row": -1, "v_col": -2, "instability_row": -1,
                   "instability_col": -2}
  """Not a field: each factored statistic -> the parameter dimension it averages
  over, which `mpscale.parallel.state_specs` reads to lay it out (on a square matrix
  its shape alone cannot tell)."""


class CameLearningRateState(NamedTuple):
  """State of the learning-rate stage of `came`."""
  count: jax.Array
  """int32 number of steps taken."""
  learning_rate: jax.Array
  """float32 learning rate used at the latest step (before the update, the one the
  first step will use); for ``relative_step`` the relative step size, before the
  per-parameter scale of ``scale_parameter``. Read by `mpscale.step_metrics`."""


# ---------------------------------------------------------------------------------------
# Argument conversion (at build time, naming the argument).

def _unit(name: str, value: Any) -> float:
  return validation.float_in(name, value, 0.0, 1.0)


def compression_dtype(compression: Compression) -> Optional[jnp.dtype]:
  """The storage dtype a ``compression`` argument asks for, or ``None`` for none.

  Raises:
    TypeError/ValueError: naming ``compression`` for anything else than ``False``,
    ``True`` (float16), ``"float16"``, ``"bfloat16"`` or those dtypes.
  """
  if compression is None or compression is False:
    return None
  if compression is True:
    return jnp.dtype(jnp.float16)
  try:
    dtype = jnp.dtype(compression)
  except TypeError:
    raise validation.fail(
        "compression", " must be a bool, 'float16', 'bfloat16' or a dtype; got "
        f"{type(compression).__name__}", validation.ArgumentTypeError) from None
  if dtype not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
    raise validation.fail("compression",
                          f" must store float16 or bfloat16; got {dtype}")
  return dtype


# ---------------------------------------------------------------------------------------
# scale_by_came.

def _compute_dtype(dtype) -> jnp.dtype:
  """float32 for half and single precision, float64 stays float64."""
  return jnp.promote_types(dtype, jnp.float32)


def _unused(dtype) -> jax.Array:
  """The placeholder of a statistic a leaf does not use: one element, as optax's
  factored state keeps. A zero-size array would cost a copy every step: XLA writes
  each zero-size output anew instead of aliasing it to its (donated) input."""
  return jnp.zeros((1,), dtype)


def _pack(x: jax.Array, dtype, low: float) -> jax.Array:
  """Casts ``x`` to a compressed ``dtype``, clamped so it stays finite (and, with
  ``low > 0``, nonzero)."""
  high = float(jnp.finfo(dtype).max)
  return jnp.clip(x, low if low > 0 else -high, high).astype(dtype)


def _positive_floor(dtype) -> float:
  """Smallest positive value that survives storage in ``dtype`` and float32 math
  (float16 subnormals do; bfloat16 ones would be flushed in float32)."""
  return max(float(jnp.finfo(dtype).smallest_subnormal),
             float(jnp.finfo(jnp.float32).smallest_normal))


def _rms_factor(row: jax.Array) -> jax.Array:
  """``rsqrt(row / mean(row))``: Adafactor's normalized row factor."""
  return lax.rsqrt(row / jnp.mean(row, axis=-1, keepdims=True))


class _Hyperparameters(NamedTuple):
  """`scale_by_came`'s arguments, checked, as its step uses them."""
  eps_sq: float
  """``eps[0]``, added to ``g^2``."""
  eps_instability: float
  """``eps[2]``, added to the instability ``(u - m)^2``."""
  clip_threshold: float
  beta1: float
  beta2: Optional[float]
  """The constant second-moment coefficient, or ``None`` for ``decay_rate``'s."""
  decay_rate: Optional[float]
  beta3: float
  store_dtype: Optional[jnp.dtype]
  """The compression dtype the momentum (and ``v``) are stored in, or ``None``."""
  inv_scale: float
  """``1 / loss_scale``."""


def _init_leaf(p: Any, store_dtype: Optional[jnp.dtype]) -> tuple[jax.Array, ...]:
  """One leaf's ``(mu, v_row, v_col, v, instability_row, instability_col)``, zeros:
  the factored statistics for rank >= 2, ``v`` for rank 0 and 1, a placeholder
  (`_unused`) for the others."""
  p = jnp.asarray(p)
  cdt = _compute_dtype(p.dtype)
  mdt = store_dtype or cdt
  # zeros_like keeps the parameter's sharding (under an explicit-sharding mesh, its
  # type); the factored statistics take that of the reduction the update makes, so
  # the state's types do not change after a step.
  mu = jnp.zeros_like(p, dtype=mdt)
  if p.ndim >= 2:
    # Separate arrays for every field, so that the state can be donated.
    row = lambda: jnp.zeros_like(jnp.sum(p, axis=-1), dtype=cdt)  # noqa: E731
    col = lambda: jnp.zeros_like(jnp.sum(p, axis=-2), dtype=cdt)  # noqa: E731
    return mu, row(), col(), _unused(mdt), row(), col()
  return (mu, _unused(cdt), _unused(cdt), jnp.zeros_like(p, dtype=mdt), _unused(cdt),
          _unused(cdt))


def _stacks(with_path: Sequence[tuple[Any, Any]]
            ) -> tuple[list[list[int]], list[list[str]]]:
  """The leaves that share a stack of state (`mpscale._tree.layer_stacks`), as
  indices and as key paths (the `Stacks`' members)."""
  runs = layer_stacks([p for p, _ in with_path], [np.shape(x) for _, x in with_path])
  return runs, [[path_str(with_path[i][0]) for i in run] for run in runs]


def _init_state(params: Any, store_dtype: Optional[jnp.dtype], stacked: bool
               ) -> ScaleByCameState:
  """`scale_by_came`'s initial state: step 0 and `_init_leaf`'s zeros, each field a
  tree like ``params``, or with ``stacked`` the `Stacks` of `_stacks`."""
  with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
  per_leaf = [_init_leaf(p, store_dtype) for _, p in with_path]
  if stacked:
    runs, members = _stacks(with_path)
    fields = [Stacks([jnp.stack([per_leaf[i][f] for i in run]) for run in runs],
                     members) for f in range(6)]
  elif per_leaf:
    fields = [treedef.unflatten(t) for t in zip(*per_leaf)]
  else:
    fields = [params] * 6
  return ScaleByCameState(jnp.zeros((), jnp.int32), *fields)


def _beta2_at(hp: _Hyperparameters, t: jax.Array, dtype) -> jax.Array:
  """The second-moment coefficient of step ``t``: ``beta2``, or Adafactor's
  ``1 - t ** -decay_rate``."""
  if hp.beta2 is not None:
    return jnp.asarray(hp.beta2, dtype)
  return 1.0 - t.astype(dtype) ** (-hp.decay_rate)


def _store(hp: _Hyperparameters, mu: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The momentum as stored (compressed when asked), and as read back for the rest of
  the step."""
  if hp.store_dtype is None:
    return mu, mu
  stored = _pack(mu, hp.store_dtype, 0.0)
  return stored, stored.astype(mu.dtype)


# Every gradient-sized expression in the factored update has a single consumer, so XLA
# fuses it into that consumer and the step allocates no gradient-sized temporary (on
# CPU a fresh temporary costs more than the arithmetic: its pages are faulted in at
# every step). Hence the sums of squares are written in forms XLA cannot merge into
# one shared array (|g|*|g| is g*g; |a| and max(a, 0) are a, for a > 0), and each
# reduction broadcasts its own copy of the factors.

def _layerwise(fn: Callable[..., Any], batch: int, *xs: jax.Array) -> Any:
  """``fn(*xs)``: reductions over the last dims of a leaf, or (``batch`` 1) of each
  leaf of a stack. On XLA:CPU a stack's are reduced one leaf at a time: its
  YNNPACK reductions are fast on a matrix and not on a stack of them (the stacked
  step took 2.1x the per-leaf one's time, 1.1x without YNNPACK). Only the
  reductions sit in the ``lax.platform_dependent`` (see `_mean_squares`)."""
  if batch == 0:
    return fn(*xs)

  def per_leaf(*xs):
    outs = [fn(*(x[j] for x in xs)) for j in range(xs[0].shape[0])]
    return jax.tree_util.tree_map(lambda *o: jnp.stack(o), *outs)
  return lax.platform_dependent(*xs, cpu=per_leaf, default=fn)


def _factored_second_moment(hp: _Hyperparameters, g: jax.Array, v_row: jax.Array,
                            v_col: jax.Array, b2: jax.Array, batch: int
                           ) -> tuple[jax.Array, jax.Array]:
  """The moving averages ``v_row, v_col`` of the row and column means of ``g^2 +
  eps[0]``, ``g`` still multiplied by the loss scale."""
  rows, cols = g.shape[-2], g.shape[-1]
  sq = hp.inv_scale * hp.inv_scale
  row_sum, col_sum = _layerwise(
      lambda g: (jnp.sum(g * g, axis=-1), jnp.sum(jnp.abs(g) * jnp.abs(g), axis=-2)),
      batch, g)
  row_sq = row_sum * (sq / cols)
  col_sq = col_sum * (sq / rows)
  v_row = b2 * v_row + (1.0 - b2) * (row_sq + hp.eps_sq)
  v_col = b2 * v_col + (1.0 - b2) * (col_sq + hp.eps_sq)
  return v_row, v_col


def _clipped_factors(hp: _Hyperparameters, g: jax.Array, v_row: jax.Array,
                     v_col: jax.Array, batch: int) -> tuple[jax.Array, jax.Array]:
  """``(a, c)`` with the clipped update ``u = g * a (x) c``: the row factor ``a``
  holds the normalized ``rsqrt(v_row)``, ``1 / loss_scale`` and the RMS clip, ``c``
  is ``rsqrt(v_col)``. The first ``batch`` dims of ``g`` index leaves (a stack), each
  clipped by its own RMS."""
  r, c = _rms_factor(v_row), lax.rsqrt(v_col)
  # sum(u^2) for u = g * r (x) c without forming u: sum_i r_i^2 sum_j g_ij^2 c_j^2.
  row_u_sq = _layerwise(lambda g, c: jnp.sum(g * jnp.square(c)[..., None, :] * g, -1),
                        batch, g, c)
  u_sq = jnp.sum(jnp.square(r) * row_u_sq, axis=tuple(range(batch, r.ndim)),
                 keepdims=True)
  sq = hp.inv_scale * hp.inv_scale
  rms = jnp.sqrt(u_sq * sq / float(np.prod(g.shape[batch:])))
  return r * (hp.inv_scale / jnp.maximum(rms / hp.clip_threshold, 1.0)), c


def _factored_instability(hp: _Hyperparameters, g: jax.Array, a: jax.Array,
                          c: jax.Array, mu_f: jax.Array, s_row: jax.Array,
                          s_col: jax.Array, batch: int) -> tuple[jax.Array, jax.Array]:
  """The moving averages ``s_row, s_col`` of the row and column means of the
  instability ``(u - mu)^2 + eps[2]``, ``u = g * a (x) c``."""
  def means(g, a, c, mu_f):
    res_row = jnp.mean(jnp.square(
        g * jnp.abs(c)[..., None, :] * jnp.abs(a)[..., :, None] - mu_f), axis=-1)
    res_col = jnp.mean(jnp.square(
        mu_f - jnp.maximum(a, 0)[..., :, None] * (g * jnp.maximum(c, 0)[..., None, :])),
        axis=-2)
    return res_row, res_col
  res_row, res_col = _layerwise(means, batch, g, a, c, mu_f)
  s_row = hp.beta3 * s_row + (1.0 - hp.beta3) * (res_row + hp.eps_instability)
  s_col = hp.beta3 * s_col + (1.0 - hp.beta3) * (res_col + hp.eps_instability)
  return s_row, s_col


def _factored_update(hp: _Hyperparameters, g: jax.Array, mu: jax.Array,
                     v_row: jax.Array, v_col: jax.Array, s_row: jax.Array,
                     s_col: jax.Array, b2: jax.Array, batch: int
                    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """A rank >= 2 leaf's ``d`` and new ``(mu, v_row, v_col, s_row, s_col)``, from its
  gradient ``g`` (in the compute dtype, still scaled); with ``batch`` 1, a stack of
  leaves' (`_clipped_factors`)."""
  v_row, v_col = _factored_second_moment(hp, g, v_row, v_col, b2, batch)
  a, c = _clipped_factors(hp, g, v_row, v_col, batch)
  mu, mu_f = _store(hp, hp.beta1 * mu.astype(g.dtype) + (1.0 - hp.beta1) * (
      g * a[..., :, None] * c[..., None, :]))
  s_row, s_col = _factored_instability(hp, g, a, c, mu_f, s_row, s_col, batch)
  d = mu_f * _rms_factor(s_row)[..., :, None] * lax.rsqrt(s_col)[..., None, :]
  return d, (mu, v_row, v_col, s_row, s_col)


def _full_moments(hp: _Hyperparameters, g: jax.Array, v: jax.Array, t: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
  """A rank 0 or 1 leaf's new second moment ``v`` and its update before the RMS clip,
  ``u = g * rsqrt(v)``, both in the compute dtype, from its gradient ``g`` (still
  scaled) at step ``t``. A compressed ``v`` is read as its square root."""
  g = g.astype(_compute_dtype(g.dtype)) * hp.inv_scale
  b2 = _beta2_at(hp, t, g.dtype)
  v_prev = v.astype(g.dtype)
  if hp.store_dtype is not None:
    v_prev = jnp.square(v_prev)
  v = b2 * v_prev + (1.0 - b2) * (jnp.square(g) + hp.eps_sq)
  return v, g * lax.rsqrt(v)


def _mean_squares(us: Sequence[jax.Array], paths: Sequence[Any]) -> list[jax.Array]:
  """``mean(u^2)`` of each of ``us`` (the rank 0 and 1 leaves' updates, for the RMS
  clip): one reduction per leaf, and on an NVIDIA GPU one per bucket of leaves that
  stack without moving (`mpscale._tree.stack_buckets`), which XLA's GPU compiler
  fuses without writing the stack (the CPU backend would write it out).

  Only these means sit inside ``lax.platform_dependent`` (a ``cond`` in the jaxpr):
  every state leaf stays the output of a top-level equation of the update, where
  `mpscale.skip_nonfinite` selects it (`mpscale.scaling._producer_select`). With the
  whole update inside the ``cond``, the skip selected the state after it, so the
  update read its unselected state and XLA fused, and rounded, every leaf's step
  differently from a transform holding no vector (a parameter group of matrices)."""
  leafwise = lambda us: [jnp.mean(jnp.square(u)) for u in us]
  buckets = stack_buckets(us, (1,) * len(us), paths)
  if len(buckets) == len(us):
    return leafwise(us)

  def stacked(us):
    means: list[Any] = [None] * len(us)
    for run in buckets:
      if len(run) == 1:
        means[run[0]] = jnp.mean(jnp.square(us[run[0]]))
        continue
      x = jnp.stack([us[i] for i in run])
      bucket_means = jnp.mean(jnp.square(x), axis=tuple(range(1, x.ndim)))
      for j, i in enumerate(run):
        means[i] = bucket_means[j]
    return means

  return lax.platform_dependent(us, cuda=stacked, default=leafwise)


def _full_update(hp: _Hyperparameters, mu: jax.Array, v: jax.Array, u: jax.Array,
                 mean_sq: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """A rank 0 or 1 leaf's ``d`` (the momentum) and new ``(mu, v)``, from its new
  second moment ``v``, update ``u`` and ``mean(u^2)`` (`_full_moments`,
  `_mean_squares`). A compressed ``v`` is stored as its square root."""
  u = u / jnp.maximum(jnp.sqrt(mean_sq) / hp.clip_threshold, 1.0)
  mu, mu_f = _store(hp, hp.beta1 * mu.astype(u.dtype) + (1.0 - hp.beta1) * u)
  if hp.store_dtype is not None:
    v = _pack(jnp.sqrt(v), hp.store_dtype, _positive_floor(hp.store_dtype))
  return mu_f, (mu, v)


def _leaf_update(hp: _Hyperparameters, g: jax.Array, stats: Sequence[jax.Array],
                 t: jax.Array, full: Optional[tuple[jax.Array, ...]], batch: int
                ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """One leaf's ``d``, in the gradient's dtype, and its six new statistics (those it
  does not use as they were) at step ``t``; ``full``: a rank 0 or 1 leaf's ``(v, u,
  mean(u^2))``, else None. With ``batch`` 1, ``g`` and ``stats`` are a stack of
  leaves' (``mean(u^2)`` one per leaf, shaped to broadcast)."""
  mu, v_row, v_col, v, s_row, s_col = stats
  if full is None:
    g_c = g.astype(_compute_dtype(g.dtype))
    d, (mu, v_row, v_col, s_row, s_col) = _factored_update(
        hp, g_c, mu, v_row, v_col, s_row, s_col, _beta2_at(hp, t, g_c.dtype), batch)
  else:
    d, (mu, v) = _full_update(hp, mu, *full)
  return d.astype(g.dtype), (mu, v_row, v_col, v, s_row, s_col)


def _update(hp: _Hyperparameters, updates: Any, state: ScaleByCameState,
            stacked: bool) -> tuple[Any, ScaleByCameState]:
  """`scale_by_came`'s step: `_leaf_update` on every leaf (with ``stacked``, on each
  stack of leaves' gradients, and each leaf's ``d`` its row of its stack's), the
  count incremented. The rank 0 and 1 leaves' updates come first, so that their RMS
  clips' means are one call (`_mean_squares`: on an NVIDIA GPU one reduction per
  bucket of them; stacked, one per stack)."""
  count = optax.safe_increment(state.count)
  with_path, treedef = jax.tree_util.tree_flatten_with_path(updates)
  if not with_path:
    return updates, state._replace(count=count)
  leaves = [jnp.asarray(g) for _, g in with_path]
  if stacked:
    runs, members = _stacks(with_path)
    initialized = [list(m) for m in state.mu.members]
    if initialized != members:
      differ = next((k for k, (a, b) in enumerate(zip(members, initialized)) if a != b),
                    min(len(members), len(initialized)))
      raise ValueError(
          "scale_by_came(stack_layers=True): the updates' leaves are not those the "
          f"state was initialized for: {len(members)} stacks against "
          f"{len(initialized)}, the first that differs "
          f"{members[differ] if differ < len(members) else None} against "
          f"{initialized[differ] if differ < len(initialized) else None}")
    batch, grads = 1, [jnp.stack([leaves[i] for i in run]) for run in runs]
    stats = list(zip(*[field.arrays for field in state[1:]]))
  else:
    runs, batch, grads = [[i] for i in range(len(leaves))], 0, leaves
    stats = list(zip(*[treedef.flatten_up_to(tree) for tree in state[1:]]))
  vectors = [k for k, g in enumerate(grads) if g.ndim - batch < 2]
  moments = [_full_moments(hp, grads[k], stats[k][3], count) for k in vectors]
  if stacked:
    means = [jnp.mean(jnp.square(u), axis=tuple(range(1, u.ndim)), keepdims=True)
             for _, u in moments]
  else:
    means = _mean_squares([u for _, u in moments], [with_path[k][0] for k in vectors])
  full = {k: (v, u, m) for k, (v, u), m in zip(vectors, moments, means)}
  results = [_leaf_update(hp, g, group_stats, count, full.get(k), batch)
             for k, (g, group_stats) in enumerate(zip(grads, stats))]
  new_stats = [list(t) for t in zip(*[s for _, s in results])]
  if not stacked:
    return (treedef.unflatten([d for d, _ in results]),
            ScaleByCameState(count, *[treedef.unflatten(t) for t in new_stats]))
  directions: list[Any] = [None] * len(leaves)
  for run, (d, _) in zip(runs, results):
    for j, i in enumerate(run):
      directions[i] = d[j].astype(leaves[i].dtype)
  return (treedef.unflatten(directions),
          ScaleByCameState(count, *[Stacks(t, members) for t in new_stats]))


def scale_by_came(eps: Sequence[float] = (1e-30, 1e-3, 1e-16),
                  clip_threshold: float = 1.0,
                  decay_rate: Optional[float] = 0.8,
                  beta1: float = 0.9,
                  beta2: Optional[float] = None,
                  beta3: float = 0.99,
                  compression: Compression = False,
                  loss_scale: float = 1.0,
                  stack_layers: bool = False) -> optax.GradientTransformation:
  """CAME's update direction, before weight decay and the learning rate.

  Computes ``d`` of the algorithm in the module docstring: Adafactor's factored (rank
  >= 2, over the last two dims) or full (rank 0/1) second moment, the RMS clip, the
  momentum, and for factored leaves CAME's confidence scaling by the factored
  instability. `came` is this followed by decoupled weight decay and the learning rate;
  use this one to put something else after it.

  Args:
    eps: ``(eps[0], eps[1], eps[2])``: added to ``g^2`` before averaging; the floor of
      the parameter RMS (used only by `came`'s ``scale_parameter``/``relative_step``,
      accepted here so both take the same triple); added to the instability.
    clip_threshold: the largest RMS of the update ``u``; positive (``inf`` disables).
    decay_rate: gives Adafactor's time-dependent ``beta2 = 1 - t ** -decay_rate``;
      in [0, 1]. Ignored when ``beta2`` is given.
    beta1: momentum coefficient, in [0, 1]; no bias correction.
    beta2: a constant second-moment coefficient in [0, 1) (the paper and came-pytorch
      use 0.999); takes precedence over ``decay_rate``.
    beta3: instability coefficient, in [0, 1].
    compression: store the momentum and full second moments in float16 (``True`` or
      ``"float16"``) or ``"bfloat16"``; they are computed in float32 and clamped to the
      dtype's finite range when stored. The factored vectors stay in float32. Note
      that bfloat16's 8-bit mantissa rounds away moving-average increments below
      about 0.4%, so a full second moment with ``beta2`` near 1 barely moves there.
    loss_scale: a fixed loss scale applied outside; gradients are divided by it.
    stack_layers: keep the state stacked by role: each statistic of the same weight
      of every layer (one key path up to layer numbers, ``h_0``, ``h/0`` or
      ``h[0]``, and one shape; up to 32 layers a stack) is one array, each field of
      the state a `mpscale.Stacks`, and the update runs once per stack, not once per
      leaf. The step is the same (each leaf keeps its own RMS clip and factors); on
      an NVIDIA GPU a model whose layers are separate leaves (a linen model's
      ``h_0 ... h_11``) launches about a third of the kernels. A model that already
      stacks its layers (``nn.scan``, mpscale's own) gains nothing. On XLA:CPU the
      step takes about 1.2x the per-leaf one's time (benchmarks/README.md).

  Returns:
    An ``optax.GradientTransformation`` with state `ScaleByCameState`; its updates have
    the gradients' dtype.

  References:
    Luo et al., "CAME: Confidence-guided Adaptive Memory Efficient Optimization",
    ACL 2023. https://arxiv.org/abs/2307.02047

  Example:
    >>> import optax, mpscale
    >>> tx = optax.chain(mpscale.scale_by_came(beta2=0.999, decay_rate=None),
    ...                  optax.scale_by_learning_rate(1e-3))
  """
  eps = validation.floats("eps", eps, 3, validation.positive_float)
  clip_threshold = validation.positive_float("clip_threshold", clip_threshold,
                                             allow_inf=True)
  beta1 = _unit("beta1", beta1)
  beta3 = _unit("beta3", beta3)
  if beta2 is not None:
    beta2 = validation.float_in("beta2", beta2, 0.0, 1.0, high_open=True)
    if np.float32(beta2) >= 1.0:  # the second moment would stay 0
      raise validation.fail("beta2", f" must be < 1 in float32 too; got {beta2!r}")
  elif decay_rate is None:
    raise validation.ArgumentError(
        ("decay_rate", "beta2"), "{0} and {1} cannot both be None: give a {0} for "
        "Adafactor's 1 - t**-decay_rate, or a constant {1}")
  else:
    decay_rate = _unit("decay_rate", decay_rate)
  store_dtype = compression_dtype(compression)
  loss_scale = validation.positive_float("loss_scale", loss_scale)
  stack_layers = validation.boolean("stack_layers", stack_layers)
  hp = _Hyperparameters(eps_sq=eps[0], eps_instability=eps[2],
                        clip_threshold=clip_threshold, beta1=beta1, beta2=beta2,
                        decay_rate=decay_rate, beta3=beta3, store_dtype=store_dtype,
                        inv_scale=1.0 / loss_scale)

  def init_fn(params):
    return _init_state(params, store_dtype, stack_layers)

  def update_fn(updates, state, params=None):
    del params
    return _update(hp, updates, state, stack_layers)

  return optax.GradientTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------------------------
# came: scale_by_came, then decoupled weight decay, then the learning rate.

def _leaf_rms(p: jax.Array) -> jax.Array:
  p = jnp.asarray(p)
  p = p.astype(_compute_dtype(p.dtype))
  return jnp.sqrt(jnp.mean(jnp.square(p)))


def relative_step_size(count: jax.Array, warmup_init: bool = False) -> jax.Array:
  """Adafactor's relative step size at step ``count + 1``, as float32.

  ``min(1e-6 * t if warmup_init else 1e-2, 1 / sqrt(t))`` with ``t = count + 1``.
  """
  t = jnp.asarray(count).astype(jnp.float32) + 1.0
  floor = 1e-6 * t if warmup_init else jnp.float32(1e-2)
  return jnp.minimum(floor, lax.rsqrt(t))


def _scale_by_came_learning_rate(learning_rate: Optional[ScalarOrSchedule],
                                 relative_step: bool, warmup_init: bool,
                                 scale_parameter: bool, param_rms_floor: float
                                ) -> optax.GradientTransformation:
  """Multiplies by ``-lr`` (times ``max(eps[1], rms(p))`` with ``scale_parameter``)
  and records ``lr``."""

  def lr_at(count):
    if relative_step:
      return relative_step_size(count, warmup_init)
    if callable(learning_rate):
      return learning_rate(count)
    return learning_rate

  def init_fn(params):
    del params
    count = jnp.zeros((), jnp.int32)
    return CameLearningRateState(
        count, jnp.asarray(lr_at(count), jnp.float32))

  def update_fn(updates, state, params=None):
    if scale_parameter and params is None:
      raise ValueError("came(scale_parameter=True) needs params in update")
    lr = lr_at(state.count)

    def scale(u, p=None):
      step = lr
      if scale_parameter:
        step = step * jnp.maximum(param_rms_floor, _leaf_rms(p)).astype(u.dtype)
      return (-step * u).astype(u.dtype)

    if scale_parameter:
      updates = jax.tree_util.tree_map(scale, updates, params)
    else:
      updates = jax.tree_util.tree_map(scale, updates)
    return updates, CameLearningRateState(optax.safe_increment(state.count),
                                          jnp.asarray(lr, jnp.float32))

  return optax.GradientTransformation(init_fn, update_fn)


def came(learning_rate: Optional[ScalarOrSchedule] = None,
         eps: Sequence[float] = (1e-30, 1e-3, 1e-16),
         clip_threshold: float = 1.0,
         decay_rate: Optional[float] = 0.8,
         beta1: float = 0.9,
         beta2: Optional[float] = None,
         beta3: float = 0.99,
         weight_decay: ScalarOrSchedule = 0.0,
         scale_parameter: bool = False,
         relative_step: bool = False,
         warmup_init: bool = False,
         compression: Compression = False,
         loss_scale: float = 1.0,
         mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
         stack_layers: bool = False) -> optax.GradientTransformation:
  """The CAME optimizer (confidence-guided, factored, memory-efficient).

  The full algorithm is in the module docstring. This is `scale_by_came`, then
  decoupled weight decay (``p -= lr * weight_decay * p``, scaled by the same
  learning rate as the update, parameter scale included), then the learning rate. Its
  state records the learning rate of the latest step in a float32 ``learning_rate``
  field, which `mpscale.step_metrics` reports.

  With the defaults the second-moment coefficient is Adafactor's time-dependent
  ``1 - t ** -0.8`` (as in mindformers' ``Came``); ``beta2=0.999`` gives the paper's
  and came-pytorch's constant one (came-pytorch's ``betas=(0.9, 0.999, 0.9999)`` are
  ``beta1=0.9, beta2=0.999, beta3=0.9999``, its ``eps=(1e-30, 1e-16)`` is
  ``eps=(1e-30, <any>, 1e-16)``).

  Args:
    learning_rate: a float or an Optax schedule of the step count (e.g.
      `mpscale.lr_schedule`). ``None`` only with ``relative_step=True``. A scalar
      array is taken as it is, so ``optax.inject_hyperparams(came, static_args=(...))``
      can inject ``learning_rate`` and ``weight_decay`` (name the other numeric
      arguments in ``static_args``: they are checked when built).
    eps: ``(eps[0], eps[1], eps[2])``, all positive: added to ``g^2`` before
      averaging; the floor of the parameter RMS used by ``scale_parameter``; added to
      the instability ``(u - m)^2``.
    clip_threshold: the largest RMS of the update before momentum; positive.
    decay_rate: time-dependent ``beta2 = 1 - t ** -decay_rate``, in [0, 1]; ignored
      when ``beta2`` is given.
    beta1: momentum coefficient, in [0, 1].
    beta2: constant second-moment coefficient in [0, 1), or ``None`` for
      ``decay_rate``'s schedule.
    beta3: instability coefficient, in [0, 1].
    weight_decay: decoupled weight decay, a float in [0, 1] or an Optax schedule
      (e.g. `mpscale.weight_decay_schedule`).
    scale_parameter: multiply the learning rate of each leaf by
      ``max(eps[1], rms(p))`` (Adafactor's parameter scale).
    relative_step: use Adafactor's relative step size
      ``min(1e-6 t if warmup_init else 1e-2, 1/sqrt(t))`` as the learning rate; then
      ``learning_rate`` must be ``None``.
    warmup_init: the warm-up variant of the relative step; needs ``relative_step``.
    compression: store the momentum and full second moments in ``"float16"``
      (or ``True``) or ``"bfloat16"``; see `scale_by_came`.
    loss_scale: a fixed loss scale applied to the loss outside; gradients are divided
      by it. Leave it at 1 inside `mpscale.dynamic_loss_scale`, which unscales itself.
    mask: which leaves get weight decay, as in ``optax.add_decayed_weights``: a
      pytree of bools (or a prefix of the params tree) or a callable
      ``params -> pytree of bools``.
    stack_layers: keep the state stacked by role, one array per weight across
      layers; see `scale_by_came`.

  Returns:
    An ``optax.GradientTransformation`` whose state is the tuple
    ``(ScaleByCameState, <weight-decay state>, CameLearningRateState)``.

  References:
    Luo et al., "CAME: Confidence-guided Adaptive Memory Efficient Optimization",
    ACL 2023. https://arxiv.org/abs/2307.02047

  Example:
    >>> import jax.numpy as jnp, mpscale
    >>> params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    >>> tx = mpscale.dynamic_loss_scale(mpscale.came(
    ...     mpscale.lr_schedule(2e-4, warmup_steps=100, decay_steps=10_000,
    ...                         style="cosine"),
    ...     beta2=0.999, weight_decay=0.01))
    >>> opt_state = tx.init(params)
  """
  if learning_rate is None and not relative_step:
    raise validation.ArgumentError(
        ("learning_rate", "relative_step"),
        "{0} is None: give a learning rate or {1}=True")
  relative_step = validation.boolean("relative_step", relative_step)
  warmup_init = validation.boolean("warmup_init", warmup_init)
  scale_parameter = validation.boolean("scale_parameter", scale_parameter)
  if relative_step and learning_rate is not None:
    raise validation.ArgumentError(
        ("learning_rate", "relative_step"), "{0} must be None with {1}=True (the "
        "relative step size is the learning rate)")
  if warmup_init and not relative_step:
    raise validation.ArgumentError(("warmup_init", "relative_step"),
                                   "{0}=True needs {1}=True")
  if learning_rate is not None:
    learning_rate = validation.scalar_or_schedule(
        "learning_rate", learning_rate, validation.non_negative_float)
  weight_decay = validation.scalar_or_schedule("weight_decay", weight_decay, _unit)
  eps = validation.floats("eps", eps, 3, validation.positive_float)
  direction = scale_by_came(eps=eps, clip_threshold=clip_threshold,
                            decay_rate=decay_rate, beta1=beta1, beta2=beta2,
                            beta3=beta3, compression=compression,
                            loss_scale=loss_scale, stack_layers=stack_layers)
  return optax.chain(
      direction,
      optax.add_decayed_weights(weight_decay, mask),
      _scale_by_came_learning_rate(learning_rate, relative_step, warmup_init,
                                   scale_parameter, eps[1]))
