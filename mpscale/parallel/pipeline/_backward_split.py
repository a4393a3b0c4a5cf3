"""A layer's backward in two: its input gradient now, its weight gradients later.

Zero-bubble pipeline schedules (Qi et al. 2024) split a layer's backward into ``B``,
the gradient of its input, which the stage below waits for, and ``W``, the gradients
of its weights, which nothing waits for and so fills ticks that would idle. ``W``'s
work is the weight side of each matrix product: for ``y = a @ w`` it is
``dw = a^T dy``, from the product's input ``a`` (kept by the forward) and the
cotangent ``dy`` of its output (kept by ``B``). Splitting at the layer (``W`` = the
layer's whole pullback, less its input gradient) would redo the input-side products
inside the layer, which ``W`` needs to reach the earlier products' ``dy``.

`split_products` finds the layer's weight products in its jaxpr: each
``dot_general`` one of whose operands is a parameter leaf (through reshapes,
transposes, casts and the like), including those inside nested ``jit`` calls. It
returns the layer as a function whose tapped products:

- take their weight without differentiating through it, so a ``jax.vjp`` of it (``B``)
  does none of their weight-side work;
- add a zero ``delta`` to their output, so that ``B``'s cotangent of ``delta`` is
  the product's ``dy``;
- return their other operand ``a``, for ``W``.

Every other use of a parameter (biases, norms' scales, products inside loops or custom
derivatives) is differentiated by ``B`` as usual: ``B``'s parameter gradients plus
``W``'s are the layer's.

References:
  Qi, Wan, Huang and Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024
  (https://arxiv.org/abs/2401.10241), section 2.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from mpscale import _jaxprs as jaxprs

_SHAPING = ("reshape", "transpose", "convert_element_type", "squeeze", "expand_dims",
            "broadcast_in_dim", "copy", "copy_p")
"""One-operand primitives through which an operand is still a parameter leaf."""


@dataclasses.dataclass(frozen=True)
class Tap:
  """One weight product ``dot_general(lhs, rhs)``: the weight is operand ``side``,
  parameter leaf ``leaf`` after the ``shaping`` equations."""
  leaf: int
  shaping: tuple[Any, ...]
  product: Any
  side: int

  def weight(self, leaf: jax.Array) -> jax.Array:
    for eqn in self.shaping:
      (leaf,) = jaxprs.bind(eqn, [leaf if not isinstance(v, jcore.Literal) else v.val
                            for v in eqn.invars])
    return leaf

  def apply(self, weight: jax.Array, other: jax.Array) -> jax.Array:
    ops = [other, weight] if self.side == 1 else [weight, other]
    return jaxprs.bind(self.product, ops)[0]

  def weight_gradient(self, leaf: jax.Array, other: jax.Array, dy: jax.Array
                     ) -> jax.Array:
    """``W`` for this product: the gradient of ``leaf`` through it alone."""
    transpose = jax.linear_transpose(lambda w: self.apply(self.weight(w), other), leaf)
    return transpose(dy.astype(self.product.outvars[0].aval.dtype))[0]


class Split:
  """A layer ``fn(params, x) -> y`` with its weight products tapped (module
  docstring). Trace it where it is used: the jaxpr closes over what ``fn`` closes
  over."""

  def __init__(self, fn: Callable, params: Any, x: Any):
    self.closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(params, x)
    self.treedef = jax.tree_util.tree_structure(params)
    self.num_leaves = self.treedef.num_leaves
    self.out_tree = jax.tree_util.tree_structure(out_shape)
    others: set = set()
    self.taps: tuple[Tap, ...] = tuple(_find(self.closed.jaxpr, self._origins(), others))
    self.weight_only = frozenset(t.leaf for t in self.taps) - others
    """The leaves used only by tapped products: ``B``'s gradients of them are zero."""

  def _origins(self) -> dict:
    return {v: (i, ()) for i, v in enumerate(self.closed.jaxpr.invars[:self.num_leaves])}

  def delta_shapes(self) -> list[jax.ShapeDtypeStruct]:
    """The output shape of each tapped product (the zeros ``apply`` adds)."""
    return [jax.ShapeDtypeStruct(t.product.outvars[0].aval.shape,
                                 t.product.outvars[0].aval.dtype) for t in self.taps]

  def apply(self, params: Any, weights: Any, x: Any, deltas: Sequence[jax.Array]
           ) -> tuple[Any, list[jax.Array]]:
    """``(y, inputs)``: the layer on ``x``, each tapped product's weight from
    ``weights`` (not ``params``, so a derivative in ``params`` skips it), plus its
    ``delta``; ``inputs`` are their other operands."""
    leaves = jax.tree_util.tree_leaves(params)
    fixed = jax.tree_util.tree_leaves(weights)
    args = leaves + jax.tree_util.tree_leaves(x)
    state = _State(self.taps, list(deltas), fixed, [])
    outs = _eval(self.closed.jaxpr, self.closed.consts, args, self._origins(), state)
    return jax.tree_util.tree_unflatten(self.out_tree, outs), state.inputs

  def weight_gradients(self, params: Any, inputs: Sequence[jax.Array],
                       dys: Sequence[jax.Array]) -> Any:
    """``W``: the gradients (float32, shaped like ``params``) through the tapped
    products, from their kept ``inputs`` and output cotangents ``dys``."""
    leaves = jax.tree_util.tree_leaves(params)
    grads = [jnp.zeros(x.shape, jnp.float32) for x in leaves]
    for tap, a, dy in zip(self.taps, inputs, dys):
      grads[tap.leaf] = grads[tap.leaf] + tap.weight_gradient(
          leaves[tap.leaf], a, dy).astype(jnp.float32)
    return jax.tree_util.tree_unflatten(self.treedef, grads)


@dataclasses.dataclass
class _State:
  """`_eval`'s progress: the products it taps (`_find`'s, in the order it meets
  them), their deltas and weights, the inputs it has seen so far."""
  taps: Sequence[Tap]
  deltas: list
  weights: list
  inputs: list
  count: int = 0


def _weight_side(eqn: Any, origins: list) -> Optional[int]:
  """Which operand of a ``dot_general`` is a parameter leaf, if exactly one is."""
  if eqn.primitive.name != "dot_general":
    return None
  sides = [i for i in (0, 1) if origins[i] is not None]
  return sides[0] if len(sides) == 1 else None


def _shaped(eqn: Any, origins: list) -> Optional[tuple[int, tuple]]:
  """The origin of a shaping equation's output: its one operand's, one step on."""
  if eqn.primitive.name not in _SHAPING:
    return None
  variables = [o for v, o in zip(eqn.invars, origins)
               if not isinstance(v, jcore.Literal)]
  if len(variables) != 1 or variables[0] is None:
    return None
  leaf, shaping = variables[0]
  return leaf, shaping + (eqn,)


def _find(jaxpr: Any, origins: dict, others: Optional[set] = None) -> list[Tap]:
  """The tapped products of ``jaxpr``, in evaluation order (as `_eval` meets them);
  ``others`` collects the leaves used in any other way."""
  others = set() if others is None else others
  taps = []
  for eqn in jaxpr.eqns:
    ins = [jaxprs.lookup(origins, v) for v in eqn.invars]
    side = _weight_side(eqn, ins)
    if side is not None:
      leaf, shaping = ins[side]
      taps.append(Tap(leaf, shaping, eqn, side))
      continue
    sub = jaxprs.call_body(eqn)
    if sub is not None:
      inner, consts = sub
      inner_origins = {v: o for v, o in zip(inner.invars, ins) if o is not None}
      taps.extend(_find(inner, inner_origins, others))
      continue
    shaped = _shaped(eqn, ins)
    if shaped is not None:
      origins[eqn.outvars[0]] = shaped
    else:
      others.update(o[0] for o in ins if o is not None)
  others.update(o[0] for o in (jaxprs.lookup(origins, v) for v in jaxpr.outvars)
                if o is not None)
  return taps


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], origins: dict,
          state: _State) -> list:
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: jaxprs.read(env, v)  # noqa: E731
  for eqn in jaxpr.eqns:
    ins = [jaxprs.lookup(origins, v) for v in eqn.invars]
    values = [read(v) for v in eqn.invars]
    side = _weight_side(eqn, ins)
    sub = jaxprs.call_body(eqn)
    if side is not None:
      tap = state.taps[state.count]
      y = tap.apply(tap.weight(state.weights[tap.leaf]), values[1 - side])
      state.inputs.append(values[1 - side])
      outs = [y + state.deltas[state.count].astype(y.dtype)]
      state.count += 1
    elif sub is not None:
      inner, inner_consts = sub
      inner_origins = {v: o for v, o in zip(inner.invars, ins) if o is not None}
      outs = _eval(inner, inner_consts, values, inner_origins, state)
    else:
      outs = jaxprs.bind(eqn, values)
      shaped = _shaped(eqn, ins)
      if shaped is not None:
        origins[eqn.outvars[0]] = shaped
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]
