"""The JAX internals mpscale reads, in one place (mpscale/_jaxprs.py): the shim for
``Primitive.get_bind_params``, whose form changed in jax 0.9.2, and `bind`, which
evaluates an equation as ``jax.core.eval_jaxpr`` does."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpscale import _jaxprs

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


def _eqn(get_bind_params):
  primitive = types.SimpleNamespace(get_bind_params=get_bind_params, name="p")
  return types.SimpleNamespace(primitive=primitive, params={"axis": 1})


def test_bind_params_reads_both_forms_of_get_bind_params():
  # jax < 0.9.2: (subfunctions, params); 0.9.2 and later: params.
  assert _jaxprs.bind_params(_eqn(lambda p: ([], dict(p)))) == ([], {"axis": 1})
  assert _jaxprs.bind_params(_eqn(lambda p: dict(p))) == ((), {"axis": 1})
  with pytest.raises(TypeError, match="get_bind_params returned a list"):
    _jaxprs.bind_params(_eqn(lambda p: [p]))


def test_bind_evaluates_each_equation_as_eval_jaxpr_does():
  def f(x, y):
    return jnp.sin(x) @ y, jnp.cumsum(x, axis=1)

  x = jnp.arange(12.0).reshape(3, 4)
  y = jnp.ones((4, 2))
  closed = jax.make_jaxpr(f)(x, y)
  env = dict(zip(closed.jaxpr.invars, (x, y)))
  for eqn in closed.jaxpr.eqns:
    outs = _jaxprs.bind(eqn, [_jaxprs.read(env, v) for v in eqn.invars])
    env.update(zip(eqn.outvars, outs))
  got = [_jaxprs.read(env, v) for v in closed.jaxpr.outvars]
  want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x, y)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
