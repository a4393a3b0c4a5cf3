"""Evaluating a jaxpr one equation at a time: what mpscale's jaxpr rewrites share
(`mpscale.backward_split` taps a layer's weight products, `mpscale.batch_split`
pins activations to the batch split).

Both trace a function with ``jax.make_jaxpr`` and evaluate its equations again, each
as JAX's own ``eval_jaxpr`` does, changing a few on the way; calls to nested ``jit``
functions are evaluated inline, so what they hold is reached too.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from jax.extend import core as jcore

from mpscale import sharding as sharding_lib

CALLS = ("pjit", "jit", "closed_call", "core_call")
"""Call primitives whose body is evaluated inline."""


def call_body(eqn: Any) -> Optional[tuple[Any, Sequence[Any]]]:
  """``(jaxpr, consts)`` of a call equation (`CALLS`), ``None`` for any other."""
  if eqn.primitive.name not in CALLS:
    return None
  inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  if inner is None:
    return None
  if isinstance(inner, jcore.ClosedJaxpr):
    return inner.jaxpr, inner.consts
  return inner, ()


def lookup(table: dict, v: Any) -> Any:
  """What ``table`` holds for variable ``v`` (``None`` for a literal or a variable it
  lacks): a rewrite's mark on the values it follows."""
  return None if isinstance(v, jcore.Literal) else table.get(v)


def read(env: dict, v: Any) -> Any:
  """The value of variable or literal ``v`` in ``env``."""
  return v.val if isinstance(v, jcore.Literal) else env[v]


_TO_VARYING = ("pvary", "pcast")
"""Casts to device-varying inside ``shard_map``: a value traced invariant and
evaluated again varying (a parameter shard) is already what they make."""


def bind(eqn: Any, values: Sequence[Any]) -> list:
  """Equation ``eqn`` applied to ``values``: its outputs, as a list. A cast to
  device-varying of values that already vary over its axes passes them on."""
  if eqn.primitive.name in _TO_VARYING and eqn.params.get("to", "varying") == "varying":
    axes = set(eqn.params.get("axes", eqn.params.get("axis_name", ())) or ())
    if all(axes <= sharding_lib.varying_axes(x) for x in values):
      return list(values)
  bound = eqn.primitive.get_bind_params(eqn.params)
  # jax < 0.8 returns (subfunctions, params); later, the params alone.
  subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*subfuns, *values, **params)
  return list(out) if eqn.primitive.multiple_results else [out]

