"""Tests for mpscale.scaling: the fast path equals the plain select-at-end bit
for bit, is the one taken, keeps the inner optimizer's names, and falls back safely."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpscale
from tests import helpers
from mpscale import _jaxprs
from mpscale.scaling import _producer_select as producer_select

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)



def _params():
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.normal(size=(6, 8)), jnp.float32),
          "v": {"u": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
                "b": jnp.asarray([0.5, -0.0, 1.5, -2.0], jnp.float32)}}


def _grads(seed, poison=None, leaf=0):
  rng = np.random.default_rng(seed)
  leaves, treedef = jax.tree.flatten(_params())
  out = [jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in leaves]
  if poison is not None:
    out[leaf] = out[leaf].reshape(-1).at[1].set(poison).reshape(out[leaf].shape)
  return jax.tree.unflatten(treedef, out)


# Every inner optimizer the skip tests use, plus schedules, a clip and CAME.
INNERS = {
    "adamw": lambda: optax.adamw(0.1),
    "sgd_nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(0.1),
    "adafactor": lambda: optax.adafactor(0.1),
    "multisteps": lambda: optax.MultiSteps(optax.adam(0.1), 2).gradient_transformation(),
    "adamw_then_clip": lambda: optax.chain(optax.adamw(0.1),
                                           mpscale.global_norm_clip(0.5)),
    "clip_then_scheduled_adamw": lambda: optax.chain(
        mpscale.global_norm_clip(1.0), optax.inject_hyperparams(optax.adamw)(
            learning_rate=optax.linear_schedule(1e-2, 1e-3, 10))),
    "came": lambda: mpscale.came(1e-2),
}
WRAPPERS = {
    "skip": lambda inner: mpscale.skip_nonfinite(inner),
    "dynamic": lambda inner: mpscale.dynamic_loss_scale(inner, init_scale=2.0**4,
                                                        growth_interval=2),
}


_SCHEDULE = [(0, None, 0), (1, np.nan, 0), (2, None, 0), (3, np.inf, 1),
             (4, -np.inf, 2), (5, None, 0), (6, np.nan, 2), (7, None, 0)]


def _jitted_step(tx, forced):
  """One jitted ``(params, state, grads) -> (params, state, metrics)``, traced with
  the fast path or with `select_at_end` forced."""
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, mpscale.step_metrics(state)

  fn = jax.jit(step)

  def run(*args):
    if forced:
      with producer_select.select_at_end_only():
        return fn(*args)
    return fn(*args)
  return run


def _skip_state(state):
  return state.skip_state if hasattr(state, "skip_state") else state


def _assert_same(fast, slow, rtol, what):
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(fast)[0],
                          jax.tree.leaves(slow)):
    a, b = np.asarray(a), np.asarray(b)
    where = f"{what} {jax.tree_util.keystr(path)}"
    if rtol and a.dtype.kind == "f":
      np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol / 10, err_msg=where)
    else:
      assert a.tobytes() == b.tobytes(), where


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_fast_path_equals_select_at_end(inner, wrapper):
  # Each step starts both paths from the same params and state, over clean steps and
  # NaN/+Inf/-Inf in every leaf. Skipped steps leave params and state bit for bit as
  # they were in both, and every integer and boolean (counts, the skip decision, the
  # scale) agrees exactly; floats of kept steps agree to a few units in the last
  # place: the two programs fuse differently, and XLA may contract a multiply-add or
  # order a reduction differently in each (as between any two programs).
  tx = WRAPPERS[wrapper](INNERS[inner]())
  fast, slow = _jitted_step(tx, forced=False), _jitted_step(tx, forced=True)
  params = _params()
  state = tx.init(params)
  for seed, poison, leaf in _SCHEDULE:
    grads = jax.tree.map(lambda g: g * mpscale.loss_scale_of(state),
                         _grads(seed, poison, leaf))
    got, want = fast(params, state, grads), slow(params, state, grads)
    if poison is not None:  # skipped: nothing moved, in either path
      assert bool(got[2]["overflow"]) and bool(want[2]["overflow"])
      for out in (got, want):
        _assert_same((out[0], _skip_state(out[1]).inner_state),
                     (params, _skip_state(state).inner_state), 0, f"skipped step {seed}")
    _assert_same(got, want, 1e-6, f"step {seed}")
    params, state = got[0], got[1]


@pytest.mark.parametrize("inner", sorted(INNERS))
def test_kept_step_under_jit_equals_the_inner_optimizer(inner):
  params = _params()
  grads = [_grads(s) for s in range(3)]

  def run(tx, unwrap):
    @jax.jit
    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
    p, s = params, tx.init(params)
    for g in grads:
      p, s = step(p, s, g)
    return helpers.bits((p, unwrap(s)))

  plain = run(INNERS[inner](), lambda s: s)
  wrapped = run(mpscale.skip_nonfinite(INNERS[inner]()), lambda s: s.inner_state)
  assert plain == wrapped


def _donated_step_hlo(tx, params):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  state = tx.init(params)
  return jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile(
  ).as_text()


def test_fast_path_is_taken_and_removes_the_copies():
  params = {"w": jnp.ones((64, 64)), "v": {"u": jnp.ones((128, 32))}}
  tx = mpscale.dynamic_loss_scale(optax.adamw(1e-3))
  assert not helpers.big_copies(_donated_step_hlo(tx, params))
  with producer_select.select_at_end_only():
    forced = _donated_step_hlo(tx, params)
  if jax.default_backend() == "cpu":
    # XLA:CPU copies the donated moments when they are selected at the end: the
    # check above would catch a fast path that silently stopped being taken.
    assert helpers.big_copies(forced)


def _scope_mentions(hlo: str, name: str) -> int:
  return len(re.findall(re.escape(name), hlo))


def test_named_scopes_of_the_inner_optimizer_survive():
  def update(updates, state, params=None):
    with jax.named_scope("my_inner_moment"):
      new = jax.tree.map(lambda m, g: 0.9 * m + g, state, updates)
    with jax.named_scope("my_inner_update"):
      out = jax.tree.map(lambda m: -0.1 * m, new)
    return out, new

  inner = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)
  params = _params()
  plain = jax.jit(lambda g, s: inner.update(g, s)).lower(params, inner.init(params))
  tx = mpscale.skip_nonfinite(inner)
  wrapped = jax.jit(lambda g, s: tx.update(g, s)).lower(params, tx.init(params))
  for name in ("my_inner_moment", "my_inner_update"):
    assert _scope_mentions(plain.as_text(debug_info=True), name) > 0
    assert _scope_mentions(wrapped.as_text(debug_info=True), name) > 0, name


def test_an_effectful_update_falls_back_silently_with_the_same_results():
  seen = []

  def update(updates, state, params=None):
    jax.debug.callback(lambda x: seen.append(float(x)), state)
    return jax.tree.map(lambda g: -g, updates), state + 1

  inner = optax.GradientTransformation(lambda p: jnp.zeros((), jnp.int32), update)
  tx = mpscale.skip_nonfinite(inner)
  params = _params()
  step = jax.jit(tx.update)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no warning: effects are an expected decline
    state = tx.init(params)
    _, state = step(_grads(0), state, params)
    _, state = step(_grads(1, np.nan), state, params)
    _, state = step(_grads(2), state, params)
  jax.effects_barrier()
  assert seen == [0.0, 1.0, 1.0]  # the callback ran once per step, not twice
  assert int(state.inner_state) == 2 and int(state.skipped) == 1


def test_an_evaluator_failure_warns_and_takes_select_at_end(monkeypatch):
  tx = mpscale.dynamic_loss_scale(optax.adamw(0.1), init_scale=2.0**4)
  params = _params()
  state = tx.init(params)
  grads = _grads(0)
  want = _jitted_step(tx, forced=True)(params, state, grads)

  def moved(eqn):  # a JAX whose internals moved again
    raise TypeError(f"{eqn.primitive}.get_bind_params returned a list")

  monkeypatch.setattr(_jaxprs, "bind_params", moved)
  monkeypatch.setattr(producer_select, "_warned", set())
  with pytest.warns(RuntimeWarning, match="could not run on this JAX"):
    got = _jitted_step(tx, forced=False)(params, state, grads)
  # The same program as the forced one, so bit for bit.
  _assert_same(got, want, 0, "fallback")


def test_a_changed_state_structure_is_an_error():
  inner = optax.GradientTransformation(
      lambda p: {"a": jnp.zeros(())},
      lambda u, s, p=None: (u, {"a": s["a"], "b": s["a"]}))
  tx = mpscale.skip_nonfinite(inner)
  params = _params()
  with pytest.raises(ValueError):
    jax.jit(tx.update)(_grads(0), tx.init(params), params)
