"""How updates land on 16-bit parameters: stochastic rounding and Kahan summation.

With 16-bit parameters (``Policy(param_dtype=bfloat16)``, ``"bf16-pure"``, O3)
``optax.apply_updates`` rounds ``p + u`` to the nearest 16-bit value, so an update
smaller than half the spacing around ``p`` is lost, every step (bfloat16 keeps 8
significant bits: at ``|p| = 1`` an update below 2^-8 = 0.004 changes nothing). Two
remedies, each an Optax transform placed last in an ``optax.chain``:

* `stochastic_rounding`: rounds ``p + u`` to one of its two neighbours at random, up
  with probability its distance from the lower one over their spacing, so the result
  is right on average (unbiased) and small updates accumulate. Its state is a step
  count and a key.
* `kahan_summation`: keeps what each round-to-nearest lost in a compensation buffer
  (one more 16-bit number per parameter) and adds it to the next update.

Per step, for a 16-bit leaf ``p`` and its float32 update ``u``::

  stochastic_rounding:
    x = float32(p) + u
    new = stochastic_round(x, p.dtype, fold_in(fold_in(key, count), leaf_index))
    u' = float32(new) - float32(p)              # apply_updates lands on new exactly
    count += 1
  kahan_summation:
    y = u + float32(c)                           # c: the leaf's compensation
    new = round_to_nearest(float32(p) + y)
    u' = float32(new) - float32(p)
    c = round_to_nearest(y - u')                 # what the rounding lost, in p's dtype

and `stochastic_round` itself, elementwise::

  nearest = round_to_nearest(x)                  # a plain cast, clamped to +-max
  other = the neighbour of nearest on x's side   # nextafter(nearest, towards x)
  new = other if uniform() < |x - nearest| / |other - nearest| else nearest

Leaves of any other dtype (float32 master parameters) pass unchanged, and
`kahan_summation` keeps no buffer for them. The returned updates are float32, and
``optax.apply_updates`` (which computes ``(p + u').astype(p.dtype)``) lands on ``new``
exactly. Both states are arrays only, so `mpscale.skip_nonfinite` and the loss-scale
wrappers skip a step by keeping them as they were, bit for bit.

References:
  Gupta et al., "Deep Learning with Limited Numerical Precision", ICML 2015.
  https://arxiv.org/abs/1502.02551
  Zamirai et al., "Revisiting BFloat16 Training", 2020.
  https://arxiv.org/abs/2010.06192
  torchao's ``bf16_stochastic_round`` and optimi's Kahan summation (PyTorch).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax

from mpscale import keys as keys_lib
from mpscale import validation

ROUNDED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""The dtypes whose parameters these transforms round; any other passes unchanged."""


def _target_dtype(name: str, value: Any) -> np.dtype:
  """``value`` as bfloat16 or float16; else an `mpscale.ArgumentError` naming
  ``name``."""
  try:
    dtype = jnp.dtype(value)
  except (TypeError, ValueError):
    raise validation.fail(name, f" must be bfloat16 or float16; got {value!r}",
                          validation.ArgumentTypeError) from None
  if dtype not in ROUNDED_DTYPES:
    raise validation.fail(name, f" must be bfloat16 or float16; got {dtype}")
  return dtype


def stochastic_round(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
  """``x`` rounded to ``dtype`` stochastically: unbiased, ``E[result] == x``.

  Each element becomes one of the two ``dtype`` values around it, the upper one with
  probability its distance from the lower one over their spacing (an exact value stays
  as it is). NaN and +-Inf stay as they are; a value beyond ``dtype``'s largest finite
  one rounds between it and Inf as if Inf were the next value, one spacing on (so it
  overflows to Inf, as a cast does, but at random from max up and surely from one
  spacing past max). Elementwise with one uniform draw per element: XLA fuses it with
  what produces ``x``.

  The draw has 23 random bits, enough for every spacing of ``x`` (float32: 24
  significant bits) inside bfloat16's or float16's normal range. Where the backend
  flushes float32 subnormals to zero (XLA:CPU does), bfloat16 subnormals round to
  nearest.

  Args:
    x: a floating array; computed on in float32.
    dtype: ``jnp.bfloat16`` or ``jnp.float16``.
    key: a PRNG key (typed, or raw ``uint32`` key data).

  Returns:
    An array of ``dtype`` and ``x``'s shape.

  Example:
    >>> import jax, jax.numpy as jnp, mpscale
    >>> x = jnp.full((100_000,), 1.001, jnp.float32)   # between 1 and 1 + 2^-7
    >>> rounded = mpscale.stochastic_round(x, jnp.bfloat16, jax.random.key(0))
    >>> sorted(set(rounded.astype(float).tolist()))
    [1.0, 1.0078125]
    >>> abs(float(rounded.astype(jnp.float32).mean()) - 1.001) < 1e-4
    True
  """
  dtype = _target_dtype("dtype", dtype)
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise validation.fail("x", f" must be a floating array; got "
                          f"{jnp.result_type(x)}", validation.ArgumentTypeError)
  x = jnp.asarray(x).astype(jnp.float32)
  info = jnp.finfo(dtype)
  top_spacing = 2.0 ** (info.maxexp - 1 - info.nmant)  # between max and max + 1 ulp
  nearest = x.astype(dtype)
  finite = jnp.isfinite(x)
  # Past max, round between max and Inf (the next value, one spacing on).
  nearest = jnp.where(finite & jnp.isinf(nearest),
                      jnp.copysign(jnp.asarray(info.max, dtype), nearest), nearest)
  near = nearest.astype(jnp.float32)
  # Exact (Sterbenz: within a factor of 2), but far past max, where chance >= 1 anyway.
  distance = x - near
  towards = jnp.where(distance >= 0, jnp.inf, -jnp.inf).astype(dtype)
  other = lax.nextafter(nearest, towards)
  spacing = jnp.where(jnp.isinf(other), top_spacing,
                      jnp.abs(other.astype(jnp.float32) - near))
  # A spacing flushed to 0 (float32 subnormals on a flushing backend): keep nearest.
  chance = jnp.where(spacing > 0, jnp.abs(distance) / spacing, 0.0)
  draw = jax.random.uniform(keys_lib.typed(key), x.shape, jnp.float32)
  rounded = jnp.where(draw < chance, other, nearest)
  return jnp.where(finite, rounded, x.astype(dtype))


def _rounded(p: Any) -> bool:
  return jnp.result_type(p) in ROUNDED_DTYPES


def _params_or_fail(params: Any, name: str) -> Any:
  if params is None:
    raise ValueError(f"{name}() needs params in update: it rounds params + updates")
  return params


def _landing(p: jax.Array, new: jax.Array) -> jax.Array:
  """The float32 update that ``optax.apply_updates`` turns ``p`` into ``new`` with."""
  return new.astype(jnp.float32) - p.astype(jnp.float32)


class StochasticRoundingState(NamedTuple):
  """State of `stochastic_rounding`."""
  count: jax.Array
  """int32 number of steps applied; the draw of step ``n`` is keyed by
  ``fold_in(key, n)``."""
  key: jax.Array
  """The base key, as raw ``uint32`` key data (a plain array: checkpoints and skips
  treat it as any other)."""


def _key_data(name: str, seed: Any) -> jax.Array:
  """An int seed or a PRNG key (typed or raw ``uint32`` data) as raw key data."""
  if isinstance(seed, (jax.Array, np.ndarray)):
    dtype = jnp.result_type(seed)
    if jnp.issubdtype(dtype, jax.dtypes.prng_key) and np.ndim(seed) == 0:
      return jax.random.key_data(seed)
    if dtype == jnp.uint32:
      try:
        return jax.random.key_data(keys_lib.typed(jnp.asarray(seed)))
      except (TypeError, ValueError):
        pass
    raise validation.fail(
        name, f" must be an int or a PRNG key; got an array of {dtype}"
        f"{list(np.shape(seed))}", validation.ArgumentTypeError)
  return jax.random.key_data(jax.random.key(validation.integer(name, seed, 0)))


def stochastic_rounding(seed: Union[int, jax.Array] = 0
                       ) -> optax.GradientTransformation:
  """Updates that land on 16-bit parameters by stochastic rounding; place it last.

  For each bfloat16 or float16 parameter ``p`` with update ``u`` the returned update is
  ``float32(stochastic_round(p + u)) - float32(p)``, so ``optax.apply_updates`` lands
  exactly on the stochastically rounded sum: the parameter moves by ``u`` on average
  however small ``u`` is next to ``p``'s spacing. Other parameters' updates pass
  unchanged. The key of step ``n``'s leaf ``i`` is ``fold_in(fold_in(key, n), i)``:
  a run is reproducible from ``seed``, and one resumed from a saved state draws what
  an uninterrupted one would.

  Args:
    seed: a non-negative int, or a PRNG key (typed, or raw ``uint32`` key data).

  Returns:
    An ``optax.GradientTransformation`` with state `StochasticRoundingState`; its
    ``update`` needs ``params``.

  References:
    Gupta et al., "Deep Learning with Limited Numerical Precision", ICML 2015.
    https://arxiv.org/abs/1502.02551

  Example:
    >>> import jax.numpy as jnp, optax, mpscale
    >>> params = {"w": jnp.ones(4096, jnp.bfloat16)}
    >>> tx = optax.chain(optax.sgd(1e-3), mpscale.stochastic_rounding(seed=0))
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.ones(4096, jnp.float32)}    # each step: w -= 0.001
    >>> for _ in range(10):
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> round(float(params["w"].astype(jnp.float32).mean()), 2)  # nearest: 1.0
    0.99
  """
  key_data = _key_data("seed", seed)

  def init_fn(params):
    del params
    return StochasticRoundingState(jnp.zeros((), jnp.int32), jnp.array(key_data))

  def update_fn(updates, state, params=None):
    params = _params_or_fail(params, "stochastic_rounding")
    step_key = keys_lib.step_key(state.key, state.count)
    flat, treedef = jax.tree_util.tree_flatten(updates)
    flat_params = treedef.flatten_up_to(params)
    out = []
    for i, (u, p) in enumerate(zip(flat, flat_params)):
      if not _rounded(p):
        out.append(u)
        continue
      x = p.astype(jnp.float32) + jnp.asarray(u).astype(jnp.float32)
      new = stochastic_round(x, p.dtype, jax.random.fold_in(step_key, i))
      out.append(_landing(p, new))
    return (jax.tree_util.tree_unflatten(treedef, out),
            StochasticRoundingState(state.count + 1, state.key))

  return optax.GradientTransformation(init_fn, update_fn)


class KahanSummationState(NamedTuple):
  """State of `kahan_summation`."""
  compensation: Any
  """Shaped like the parameters: for each 16-bit leaf, what rounding its latest sums
  lost, in its dtype; for any other leaf an empty array (no buffer)."""


def kahan_summation() -> optax.GradientTransformation:
  """Updates that land on 16-bit parameters by compensated (Kahan) summation; place
  it last.

  Each bfloat16 or float16 parameter keeps a compensation ``c`` in its own dtype (2
  more bytes a parameter): the update ``u`` plus ``c`` is added to ``p`` with
  round-to-nearest, and what the rounding lost becomes the next ``c``, so the
  parameter tracks the float32 sum of its updates to about its own precision however
  small each update is. The returned update lands ``optax.apply_updates`` on the
  rounded sum exactly. Other parameters' updates pass unchanged, with no buffer.

  Returns:
    An ``optax.GradientTransformation`` with state `KahanSummationState`; its
    ``update`` needs ``params``.

  References:
    Kahan, "Further remarks on reducing truncation errors", CACM 8(1), 1965.
    Zamirai et al., "Revisiting BFloat16 Training", 2020.
    https://arxiv.org/abs/2010.06192

  Example:
    >>> import jax.numpy as jnp, optax, mpscale
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> tx = optax.chain(optax.sgd(1e-3), mpscale.kahan_summation())
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.ones(3, jnp.float32)}       # each step: w -= 0.001
    >>> for _ in range(10):
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params["w"].astype(jnp.float32).tolist()       # nearest: [1.0, 1.0, 1.0]
    [0.98828125, 0.98828125, 0.98828125]
  """

  def init_fn(params):
    return KahanSummationState(jax.tree_util.tree_map(
        lambda p: jnp.zeros_like(p) if _rounded(p) else jnp.zeros((0,), p.dtype),
        params))

  def one(u, c, p):
    if not _rounded(p):
      return u, c
    y = jnp.asarray(u).astype(jnp.float32) + c.astype(jnp.float32)
    new = (p.astype(jnp.float32) + y).astype(p.dtype)
    landing = _landing(p, new)
    return landing, (y - landing).astype(p.dtype)

  def update_fn(updates, state, params=None):
    params = _params_or_fail(params, "kahan_summation")
    flat, treedef = jax.tree_util.tree_flatten(updates)
    pairs = [one(u, c, p) for u, c, p in zip(
        flat, treedef.flatten_up_to(state.compensation), treedef.flatten_up_to(params))]
    return (jax.tree_util.tree_unflatten(treedef, [u for u, _ in pairs]),
            KahanSummationState(jax.tree_util.tree_unflatten(
                treedef, [c for _, c in pairs])))

  return optax.GradientTransformation(init_fn, update_fn)
