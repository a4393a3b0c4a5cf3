"""The JAX internals mpscale reads, in one place: evaluating a jaxpr one equation at a
time, a value's varying axes inside ``shard_map``, and the FLOPs of a jaxpr's products.

The jaxpr rewrites (the skip's select where each state leaf is produced,
``mpscale.scaling``; the ZB-H1 backward split and the activations kept split over the
batch, ``mpscale.parallel``) trace a function with ``jax.make_jaxpr`` and evaluate its
equations again, each as JAX's own ``eval_jaxpr`` does (`bind`), changing a few on the
way; calls to nested ``jit`` functions are evaluated inline, so what they hold is
reached too. Where JAX's internals changed between releases, the shim is here, once.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

try:
  from jax.extend import source_info_util as _source_info
except ImportError:  # pragma: no cover - names are lost, results are not
  _source_info = None

CALLS = ("pjit", "jit", "closed_call", "core_call")
"""Call primitives whose body is evaluated inline."""
REMAT = ("checkpoint", "remat", "remat2")
"""The rematerialization (``jax.checkpoint``) primitive's names."""
CASTS = ("convert_element_type", "copy", "copy_p")
"""Through which a weight is still the weight (a policy's cast to the compute dtype)."""


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


def varying_axes(x: Any) -> frozenset:
  """The mesh axes ``x`` varies over inside ``shard_map`` (its "vma" type)."""
  aval = jax.typeof(x)
  if hasattr(aval, "manual_axis_type"):  # jax >= 0.9
    return frozenset(aval.manual_axis_type.varying)
  return frozenset(getattr(aval, "vma", ()))


def bind_params(eqn: Any) -> tuple[Sequence[Any], dict]:
  """``(subfunctions, params)`` to bind equation ``eqn`` with.

  ``Primitive.get_bind_params`` returns ``(subfunctions, params)`` before jax 0.9.2
  and the params alone from 0.9.2 on (checked against each release's
  ``jax/_src/core.py``).

  Raises:
    TypeError: for any other form (a JAX whose internals moved again).
  """
  bound = eqn.primitive.get_bind_params(eqn.params)
  subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
  if not isinstance(params, dict):
    raise TypeError(f"{eqn.primitive}.get_bind_params returned a "
                    f"{type(params).__name__}")
  return subfuns, params


def _source_context(eqn: Any) -> Any:
  """The equation's source information (``jax.named_scope`` names, so they reach
  the compiled program and the profiler)."""
  if _source_info is None:  # pragma: no cover
    return contextlib.nullcontext()
  name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
  return _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack)


def bind(eqn: Any, values: Sequence[Any]) -> list:
  """Equation ``eqn`` applied to ``values`` as ``jax.core.eval_jaxpr`` applies it (in
  its own context and under its source information): its outputs, as a list. A cast
  to device-varying of values that already vary over its axes passes them on."""
  if eqn.primitive.name in _TO_VARYING and eqn.params.get("to", "varying") == "varying":
    axes = set(eqn.params.get("axes", eqn.params.get("axis_name", ())) or ())
    if all(axes <= varying_axes(x) for x in values):
      return list(values)
  subfuns, params = bind_params(eqn)
  with _source_context(eqn), eqn.ctx.manager:
    out = eqn.primitive.bind(*subfuns, *values, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _sub_jaxprs(value: Any) -> list:
  """The jaxprs held in an equation parameter's ``value`` (a jaxpr, a closed jaxpr,
  or a tuple of them, as ``cond``'s branches)."""
  if isinstance(value, jcore.ClosedJaxpr):
    return [value.jaxpr]
  if isinstance(value, jcore.Jaxpr):
    return [value]
  if isinstance(value, (tuple, list)):
    return [j for v in value for j in _sub_jaxprs(v)]
  return []


def matmul_flops(jaxpr: Any) -> dict[str, float]:
  """The FLOPs of the matrix products (``dot_general``: ``2 * prod(result) *
  prod(contracted)``) and convolutions (``2 * prod(result) * prod(kernel) / output
  features``) of ``jaxpr`` (a jaxpr or closed jaxpr), by the dtype of their
  operands (what decides the hardware's matrix units, whatever
  ``preferred_element_type`` accumulates in). A ``scan`` body counts ``length``
  times, a ``cond`` its costliest branch, any other body (``jit``, ``checkpoint``,
  custom derivatives, ``while``) once."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  totals: dict[str, float] = {}

  def add(found: dict[str, float], times: float = 1.0) -> None:
    for dtype, flops in found.items():
      totals[dtype] = totals.get(dtype, 0.0) + times * flops

  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ("dot_general", "conv_general_dilated"):
      lhs, rhs = (v.aval for v in eqn.invars[:2])
      out = eqn.outvars[0].aval
      if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        work = math.prod(lhs.shape[d] for d in contract)
      else:
        features = eqn.params["dimension_numbers"].rhs_spec[0]  # the output features
        work = math.prod(rhs.shape) / max(rhs.shape[features], 1)
      add({jnp.dtype(lhs.dtype).name: 2.0 * math.prod(out.shape) * work})
      continue
    if name == "cond":
      branches = [matmul_flops(b) for b in eqn.params["branches"]]
      add(max(branches, key=lambda f: sum(f.values()), default={}))
      continue
    times = float(eqn.params["length"]) if name == "scan" else 1.0
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        add(matmul_flops(sub), times)
  return totals
