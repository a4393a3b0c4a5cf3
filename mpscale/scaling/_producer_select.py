"""Skip an optimizer step by selecting each state leaf where the update produces it.

A skipped step must leave the optimizer state as it was. The plain way, and the
reference for this module's results, is `select_at_end`::

  updates, new_state = inner.update(...)
  state = where(skip, old_state, new_state)        # leaf by leaf

Under ``jit`` with the state donated this is slow: the parameter updates are computed
from the *new* moments, XLA recomputes those from the *old* moments inside the update's
fusion, and the final select then overwrites the old moments in place while that
fusion still reads them, so XLA copies every donated state leaf first (on XLA:CPU two
extra state-sized passes and scratch per step; see benchmarks/README.md).

`update_or_skip` instead traces ``inner.update`` to a jaxpr and evaluates it equation by
equation, inserting ``where(skip, old, new)`` right where each state leaf is produced,
so everything computed from it afterwards (the updates) reads the selected value, as
the unwrapped optimizer reads its own outputs. The arithmetic is `select_at_end`'s: on
an applied step the selected value *is* the new one, and on a skipped step the caller
discards the updates.

What is guaranteed:

* Results: those of `select_at_end`: on a skipped step bit for bit (the old state,
  and updates of ``-0.0`` from the caller); on an applied step the same arithmetic, which
  XLA may fuse, and so round, differently from `select_at_end`'s program (a few units
  in the last place, as between any two differently fused programs).
* Speed (no copies of a donated state): where a state leaf is the output of a
  *top-level* equation of the update's jaxpr. A leaf produced inside a nested ``jit``,
  a ``lax.cond`` / ``scan`` / ``custom_vjp`` body (``optax.MultiSteps`` builds its
  state in a ``cond``), or passed through unchanged is selected at the end instead:
  still right, but XLA may copy it.
* Fallback: the whole update goes the `select_at_end` way when the trace is eager
  (nothing is donated, nothing to order), when the update's jaxpr has effects (a
  debug callback, I/O), when the JAX internals the evaluator needs are missing, or
  when evaluating raises (a primitive whose parameters take a form this module does
  not know: a JAX whose internals moved). The last two warn once, naming the cause.

Each equation is bound the way ``jax.core.eval_jaxpr`` binds it: in its own context
(``eqn.ctx``) and under its source information, so ``jax.named_scope`` names of the
inner optimizer reach the compiled HLO and the profiler.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from mpscale import _jaxprs

try:  # the public home of the jaxpr types
  from jax.extend.core import Literal as _Literal
except ImportError as e:  # pragma: no cover - a JAX that moved it
  _Literal = None
  _UNAVAILABLE = f"jax.extend.core has no Literal ({e})"
else:
  _UNAVAILABLE = None

Updates = Any
State = Any

_local = threading.local()
_warned: set[str] = set()


@contextlib.contextmanager
def select_at_end_only() -> Iterator[None]:
  """Within this context (while tracing), `update_or_skip` always takes the
  `select_at_end` path: for tests, and to rule the evaluator out when debugging."""
  before = getattr(_local, "forced", False)
  _local.forced = True
  try:
    yield
  finally:
    _local.forced = before


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
  """Elementwise ``pred ? on_true : on_false`` over two trees of the same structure."""
  return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def updates_or_skip(updates: Updates, skip: jax.Array) -> Updates:
  """``updates`` where ``skip`` is false, else ``-0.0`` in every element: ``p + (-0.0)
  == p`` bit for bit for every ``p`` (``-0.0`` included, which ``+ 0.0`` would turn
  into ``0.0``), so a skipped step leaves every parameter as it was."""
  applied = ~skip  # where(applied, new, old), as the state is selected
  return jax.tree_util.tree_map(
      lambda u: jnp.where(applied, u, jnp.asarray(-0.0, u.dtype)), updates)


def select_at_end(run_inner: Callable[[], tuple[Updates, State]], skip: jax.Array,
                  old_state: State) -> tuple[Updates, State, State]:
  """``run_inner()``, then the state selected leaf by leaf: the reference path.

  Returns:
    ``(updates, state, new_state)``: the inner updates, the state (``old_state``
    where ``skip`` is true) and the inner update's own new state.
  """
  updates, new_state = run_inner()
  return updates, select_tree(~skip, new_state, old_state), new_state


def update_or_skip(run_inner: Callable[[], tuple[Updates, State]], skip: jax.Array,
                   old_state: State) -> tuple[Updates, State, State]:
  """`select_at_end`'s results, with each state leaf selected where it is produced.

  Args:
    run_inner: ``() -> (updates, new_state)``, the inner optimizer's update.
    skip: a bool scalar: keep ``old_state`` (true) or take the new state (false).
    old_state: the state before the update; the same tree structure as the new one.

  Returns:
    ``(updates, state, new_state)`` as `select_at_end`.
  """
  reason = _decline_reason(skip)
  if reason is not None:
    return select_at_end(run_inner, skip, old_state)
  closed, out_shape = jax.make_jaxpr(run_inner, return_shape=True)()
  if closed.effects or (jax.tree_util.tree_structure(out_shape[1])
                        != jax.tree_util.tree_structure(old_state)):
    return select_at_end(run_inner, skip, old_state)  # the latter raises
  try:
    return _evaluate(closed, out_shape, skip, old_state)
  except Exception as e:  # noqa: BLE001 - any failure of the evaluator falls back
    _warn_once(f"{type(e).__name__}: {e}")
    return select_at_end(run_inner, skip, old_state)


def _decline_reason(skip: Any) -> str | None:
  if getattr(_local, "forced", False):
    return "forced"
  if not isinstance(skip, jax.core.Tracer):
    # Eager (op by op): nothing is donated, so there is nothing to order; run the
    # inner update as written (re-evaluating its jaxpr eagerly can differ in the last
    # bit from running it).
    return "eager"
  if _UNAVAILABLE is not None:
    _warn_once(_UNAVAILABLE)
    return "unavailable"
  return None


def _warn_once(cause: str) -> None:
  if cause in _warned:
    return
  _warned.add(cause)
  warnings.warn(
      "mpscale: the skip's select-at-the-producer evaluator could not run on this "
      f"JAX ({jax.__version__}): {cause}. Falling back to selecting the state at the "
      "end of the update: the same results (skipped steps bit for bit), but a donated "
      "optimizer state may be copied on every step.", RuntimeWarning, stacklevel=3)


def _evaluate(closed: Any, out_shape: Any, skip: jax.Array, old_state: State
             ) -> tuple[Updates, State, State]:
  # Selected as where(applied, new, old): XLA fuses (and rounds) an applied step's
  # arithmetic as it does the inner optimizer's own, bit for bit on every version
  # tested; the mirrored where(skip, old, new) is not (on jax 0.7 it rounds the last
  # bit differently).
  applied = ~skip
  jaxpr = closed.jaxpr
  n_updates = len(jax.tree_util.tree_leaves(out_shape[0]))
  old_leaves = jax.tree_util.tree_leaves(old_state)
  new_def = jax.tree_util.tree_structure(out_shape[1])
  state_vars = jaxpr.outvars[n_updates:]
  is_var = lambda v: not isinstance(v, _Literal)

  # Which equation outputs to select, and the old leaf each falls back to. A var
  # that is also an input of the jaxpr (a state leaf passed through) or appears
  # twice among the outputs is left to the final select.
  produced = {v for eqn in jaxpr.eqns for v in eqn.outvars}
  fallback: dict = {}
  for v, old, new in zip(state_vars, old_leaves,
                         jax.tree_util.tree_leaves(out_shape[1])):
    if (is_var(v) and v in produced and v not in fallback
        and jnp.shape(old) == new.shape and jnp.result_type(old) == new.dtype):
      fallback[v] = old

  # The unselected new state is reported for a skipped step (the norms a clip after
  # the optimizer measured). Where an equation feeding it reads a selected value, it
  # is evaluated a second time from the unselected values; only those equations.
  feeds_state = set()
  wanted = {v for v in state_vars if is_var(v)}
  for i in reversed(range(len(jaxpr.eqns))):
    eqn = jaxpr.eqns[i]
    if any(v in wanted for v in eqn.outvars):
      feeds_state.add(i)
      wanted.update(v for v in eqn.invars if is_var(v))

  env: dict = dict(zip(jaxpr.constvars, closed.consts))
  unselected: dict = {}  # var -> its value without any select upstream
  read = lambda v: env[v] if is_var(v) else v.val
  read_unselected = lambda v: unselected[v] if is_var(v) and v in unselected else read(v)
  for i, eqn in enumerate(jaxpr.eqns):
    outs = _jaxprs.bind(eqn, [read(v) for v in eqn.invars])
    if i in feeds_state and any(is_var(v) and v in unselected for v in eqn.invars):
      for v, out in zip(eqn.outvars, _jaxprs.bind(eqn, [read_unselected(v)
                                                 for v in eqn.invars])):
        unselected[v] = out
    for v, out in zip(eqn.outvars, outs):  # a dropped output is written, never read
      if v in fallback:
        unselected.setdefault(v, out)
        out = jnp.where(applied, out, fallback[v])
      env[v] = out

  updates = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(out_shape[0]),
      [read(v) for v in jaxpr.outvars[:n_updates]])
  state, new_state = [], []
  for v, old in zip(state_vars, old_leaves):
    selected = is_var(v) and fallback.get(v) is old
    state.append(read(v) if selected else jnp.where(applied, read_unselected(v), old))
    new_state.append(read_unselected(v))
  return (updates, jax.tree_util.tree_unflatten(new_def, state),
          jax.tree_util.tree_unflatten(new_def, new_state))
