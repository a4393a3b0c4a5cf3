"""FP8 products as Flax layers' matrix products, their state in Flax's FP8 collection.

`Fp8DotGeneral` is a linen module for ``nn.Dense(..., dot_general_cls=...)`` and
``nn.DenseGeneral`` (and, through its ``einsum`` method, an einsum with a kernel);
`NnxFp8DotGeneral` is its NNX counterpart for ``nnx.Linear(..., dot_general=...)`` and
``nnx.LinearGeneral``, and `NnxFp8Einsum` for ``nnx.Einsum(..., einsum_op=...)``. Each
holds one `mpscale.Fp8State` and calls `mpscale.fp8_dot_general` with its recipe::

  recipe = mpscale.make_fp8_recipe("delayed")
  dense = nn.Dense(1024, dot_general_cls=functools.partial(Fp8DotGeneral,
                                                           recipe=recipe))
  variables = dense.init(key, x)     # {"params": ..., "_overwrite_with_gradient": ...}
  grads = jax.grad(loss)(variables)  # the state's gradient is its next value
  params_grads, fp8_state = mpscale.split_overwrite(grads)

linen keeps the state in the ``_overwrite_with_gradient`` collection (Flax's
``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``, which ``flax.training.train_state.
TrainState.apply_gradients`` already routes); NNX in `OverwriteWithGradient`
variables: differentiate with respect to them too (``nnx.DiffState(0, (nnx.Param,
OverwriteWithGradient))``) and ``nnx.update`` the model with their gradients.

This module needs Flax (``pip install "mpscale[flax]"``; the extra ``trainer`` has
it too); ``import mpscale`` does not import it, and importing it without Flax says
which extra to install.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
from jax import lax

try:
  from flax import linen as nn
  from flax import nnx
  from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
except ImportError as e:  # the library's install has no Flax
  raise ImportError(
      f"mpscale.precision.fp8_flax needs Flax ({e}): pip install \"mpscale[flax]\" "
      "(in a clone: pip install -e \".[flax]\")") from e

from mpscale import validation
from mpscale.precision import _fp8 as fp8_lib

_DEFAULT = fp8_lib.make_fp8_recipe()


def _einsum_dims(subscripts: str, lhs_ndim: int, rhs_ndim: int):
  """A two-operand einsum as ``(lhs axes to sum, rhs axes to sum, dimension numbers,
  permutation of the product to the output)``; ``rhs`` stays the second operand
  (``jnp.einsum`` may swap them, and the kernel's state must stay the rhs's)."""
  spec = subscripts.replace(" ", "")
  inputs, arrow, out = spec.partition("->")
  a, comma, b = inputs.partition(",")
  if (not arrow or not comma or "," in b or "." in spec or len(a) != lhs_ndim
      or len(b) != rhs_ndim or any(len(set(t)) != len(t) for t in (a, b, out))
      or set(out) - set(a + b)):
    raise validation.fail(
        "subscripts", f" must be an explicit two-operand einsum (\"ab,bc->ac\": "
        f"one letter per dimension, {lhs_ndim} and {rhs_ndim} of them, none "
        f"repeated, no ellipsis); got {subscripts!r}")
  summed_a = tuple(i for i, c in enumerate(a) if c not in b and c not in out)
  summed_b = tuple(i for i, c in enumerate(b) if c not in a and c not in out)
  a = "".join(c for c in a if c in b or c in out)
  b = "".join(c for c in b if c in a or c in out)
  batch = [c for c in a if c in b and c in out]
  contract = [c for c in a if c in b and c not in out]
  numbers = ((tuple(map(a.index, contract)), tuple(map(b.index, contract))),
             (tuple(map(a.index, batch)), tuple(map(b.index, batch))))
  product = batch + [c for c in a if c not in b] + [c for c in b if c not in a]
  return summed_a, summed_b, numbers, tuple(map(product.index, out))


def _einsum(product: Callable[..., Any], subscripts: str, lhs: Any, rhs: Any,
            precision: Any, preferred_element_type: Any) -> Any:
  """``jnp.einsum(subscripts, lhs, rhs)`` as one ``product(lhs, rhs, ...)``."""
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  summed_lhs, summed_rhs, numbers, perm = _einsum_dims(subscripts, lhs.ndim, rhs.ndim)
  if summed_lhs:
    lhs = jnp.sum(lhs, summed_lhs)
  if summed_rhs:
    rhs = jnp.sum(rhs, summed_rhs)
  out = product(lhs, rhs, numbers, precision, preferred_element_type)
  return lax.transpose(out, perm)


class Fp8DotGeneral(nn.Module):
  """A linen FP8 matrix product with its state in ``_overwrite_with_gradient``.

  ``nn.Dense(features, dot_general_cls=functools.partial(Fp8DotGeneral,
  recipe=recipe))``: Dense makes one inside itself, named ``Fp8DotGeneral_0``,
  whose variable ``fp8_state`` holds the `mpscale.Fp8State`.

  Attributes:
    recipe: the `mpscale.Fp8Recipe` (default ``mpscale.make_fp8_recipe()``, delayed).
  """
  recipe: fp8_lib.Fp8Recipe = _DEFAULT

  def setup(self):
    self.fp8_state = self.variable(OVERWRITE_WITH_GRADIENT, "fp8_state",
                                   fp8_lib.fp8_state, self.recipe)

  def __call__(self, lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
               preferred_element_type: Any = None, out_sharding: Any = None) -> Any:
    """`mpscale.fp8_dot_general` with this module's state and recipe (the
    ``lax.dot_general`` signature)."""
    return fp8_lib.fp8_dot_general(lhs, rhs, dimension_numbers, self.fp8_state.value,
                                   self.recipe, precision, preferred_element_type,
                                   out_sharding=out_sharding)

  def einsum(self, subscripts: str, lhs: Any, rhs: Any, precision: Any = None,
             preferred_element_type: Any = None) -> Any:
    """``jnp.einsum(subscripts, lhs, rhs)`` (two operands, ``rhs`` the kernel) as
    this FP8 product."""
    return _einsum(self.__call__, subscripts, lhs, rhs, precision,
                   preferred_element_type)


class OverwriteWithGradient(nnx.Variable):
  """An NNX variable whose gradient is its next value: FP8 scaling state (the NNX
  counterpart of Flax's ``_overwrite_with_gradient`` collection)."""


def _value(variable: nnx.Variable) -> Any:
  get = getattr(variable, "get_value", None)  # flax >= 0.12; .value before
  return get() if get is not None else variable.value


class NnxFp8DotGeneral(nnx.Module):
  """An NNX FP8 matrix product, for
  ``nnx.Linear(..., dot_general=NnxFp8DotGeneral(recipe))``.

  Its `OverwriteWithGradient` variable ``fp8_state`` holds the `mpscale.Fp8State`.

  Args:
    recipe: the `mpscale.Fp8Recipe` (default ``mpscale.make_fp8_recipe()``, delayed).
  """

  def __init__(self, recipe: fp8_lib.Fp8Recipe = _DEFAULT):
    self.recipe = recipe
    self.fp8_state = OverwriteWithGradient(fp8_lib.fp8_state(recipe))

  def __call__(self, lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
               preferred_element_type: Any = None, out_sharding: Any = None) -> Any:
    """`mpscale.fp8_dot_general` with this module's state and recipe."""
    return fp8_lib.fp8_dot_general(lhs, rhs, dimension_numbers, _value(self.fp8_state),
                                   self.recipe, precision, preferred_element_type,
                                   out_sharding=out_sharding)


class NnxFp8Einsum(NnxFp8DotGeneral):
  """`NnxFp8DotGeneral` as an einsum, for
  ``nnx.Einsum(..., einsum_op=NnxFp8Einsum(recipe))`` (two operands, the second the
  kernel; ``out_sharding`` is not passed on)."""

  def __call__(self, subscripts: str, lhs: Any, rhs: Any, precision: Any = None,
               preferred_element_type: Any = None, out_sharding: Any = None) -> Any:
    product = super().__call__
    return _einsum(product, subscripts, lhs, rhs, precision, preferred_element_type)
