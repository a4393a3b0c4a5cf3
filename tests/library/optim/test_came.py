"""Tests for mpscale.came: parity with came-pytorch 0.1.3, options, memory, wrappers."""

import functools
import json
import math
import os
import re

import chex
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import mpscale
from tests import helpers
from mpscale.optim._came import compression_dtype
from mpscale import _versions
from tests.helpers import load_script

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)

_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "data")


def _load_recipe():
  """tests/data/make_came_reference.py, the one source of params and gradients."""
  return load_script("tests", "data", "make_came_reference.py")


recipe = _load_recipe()


@functools.lru_cache(maxsize=None)
def _reference():
  with np.load(os.path.join(_DATA, "came_reference.npz")) as f:
    return {k: f[k] for k in f.files}


@functools.lru_cache(maxsize=None)
def _gradients():
  return tuple(recipe.gradient(step) for step in range(1, recipe.STEPS + 1))


def _enable_x64(on: bool):
  """``jax.enable_x64`` (jax >= 0.8), or its older home in jax.experimental."""
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(on)
  from jax.experimental import enable_x64, disable_x64  # noqa: PLC0415
  return enable_x64() if on else disable_x64()


def _step_fn(tx, donate=False):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def _tree(rng, shapes, dtype=jnp.float32, scale=1.0):
  return {k: jnp.asarray(scale * rng.standard_normal(s), dtype)
          for k, s in shapes.items()}


_SHAPES = {"w": (12, 20), "b": (20,), "c": (3, 5, 7), "s": ()}


def _grad_list(n, shapes=_SHAPES, seed=1, scale=1.0):
  rng = np.random.default_rng(seed)
  return [_tree(rng, shapes, scale=scale) for _ in range(n)]


def _run(tx, params, grads):
  """A few eager steps (cheaper than compiling for each small test)."""
  state = tx.init(params)
  for g in grads:
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


# ---------------------------------------------------------------------------------------
# Parity with came-pytorch 0.1.3 (tests/data/make_came_reference.py).

def test_reference_gradients_are_reproduced():
  ref = _reference()
  first = _gradients()[0]
  for name, g in first.items():
    want = ref[f"grad1/{name}"]
    got = recipe.big_sample(g) if name == recipe.BIG else g
    # Not bit for bit: np.exp's SIMD kernel differs by CPU in the last float64 bit.
    np.testing.assert_allclose(
        got, want, rtol=1e-14, atol=0,
        err_msg="NumPy's generator no longer reproduces the gradients the "
        "reference was made with; rerun tests/data/make_came_reference.py")
  meta = json.loads(str(ref["meta"]))
  assert meta["steps"] == recipe.STEPS and meta["seed"] == recipe.SEED


@pytest.mark.parametrize("variant", sorted(recipe.VARIANTS))
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float64", 1e-12)])
def test_matches_came_pytorch(variant, dtype, tol):
  ref = _reference()
  config = recipe.VARIANTS[variant]
  with _enable_x64(dtype == "float64"):
    np_dtype = np.dtype(dtype)
    tx = mpscale.came(**config)
    params = {k: jnp.asarray(v.astype(np_dtype))
              for k, v in recipe.initial_params().items()}
    state = tx.init(params)
    step = _step_fn(tx)
    checked = 0
    for t, g in enumerate(_gradients(), start=1):
      grads = {k: jnp.asarray(v.astype(np_dtype)) for k, v in g.items()}
      params, state = step(params, state, grads)
      if t not in recipe.CHECKPOINTS:
        continue
      for name, p in params.items():
        assert p.dtype == np_dtype
        got = np.asarray(p)
        got = recipe.big_sample(got) if name == recipe.BIG else got
        np.testing.assert_allclose(
            got, ref[f"{variant}/{dtype}/step{t}/{name}"], rtol=tol, atol=tol,
            err_msg=f"{variant} {dtype} step {t} leaf {name}")
        checked += 1
    full = f"{variant}/{dtype}/step{recipe.STEPS}/{recipe.BIG}_full"
    if full in ref:
      np.testing.assert_allclose(np.asarray(params[recipe.BIG]), ref[full],
                                 rtol=tol, atol=tol)
  assert checked == len(recipe.CHECKPOINTS) * len(recipe.SHAPES)
  assert not jax.config.jax_enable_x64


# ---------------------------------------------------------------------------------------
# Options.

def test_relative_step_is_adafactor_step_size_and_is_recorded():
  params = _tree(np.random.default_rng(0), _SHAPES)
  grads = _grad_list(3)
  for warmup_init in (False, True):
    def closed_form(count, warmup_init=warmup_init):
      t = count + 1.0
      return jnp.minimum(1e-6 * t if warmup_init else 1e-2, 1.0 / jnp.sqrt(t))
    got, got_state = _run(mpscale.came(relative_step=True, warmup_init=warmup_init,
                                       scale_parameter=True), params, grads)
    want, _ = _run(mpscale.came(closed_form, scale_parameter=True), params, grads)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
    lr = got_state[-1].learning_rate
    assert lr.dtype == jnp.float32
    np.testing.assert_allclose(lr, closed_form(len(grads) - 1), rtol=1e-6)


def test_scale_parameter_scales_the_step_by_parameter_rms():
  rng = np.random.default_rng(0)
  params = {"big": jnp.asarray(5.0 * rng.standard_normal((8, 6)), jnp.float32),
            "tiny": jnp.full((6,), 1e-5, jnp.float32)}
  grads = {k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
           for k, v in params.items()}
  plain = mpscale.came(0.1, beta2=0.999)
  scaled = mpscale.came(0.1, beta2=0.999, eps=(1e-30, 1e-3, 1e-16),
                        scale_parameter=True)
  u_plain, _ = plain.update(grads, plain.init(params), params)
  u_scaled, _ = scaled.update(grads, scaled.init(params), params)
  rms = float(jnp.sqrt(jnp.mean(jnp.square(params["big"]))))
  np.testing.assert_allclose(u_scaled["big"], rms * u_plain["big"], rtol=1e-6)
  # The floor eps[1] = 1e-3 applies to the tiny parameter.
  np.testing.assert_allclose(u_scaled["tiny"], 1e-3 * u_plain["tiny"], rtol=1e-6)


def test_loss_scale_divides_gradients():
  params = _tree(np.random.default_rng(0), _SHAPES)
  grads = _grad_list(3)
  scaled_grads = [jax.tree.map(lambda g: 1024.0 * g, g) for g in grads]
  got, _ = _run(mpscale.came(1e-3, loss_scale=1024.0), params, scaled_grads)
  want, _ = _run(mpscale.came(1e-3), params, grads)
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mask_kind", ["tree", "callable"])
def test_weight_decay_is_decoupled_and_masked(mask_kind):
  params = _tree(np.random.default_rng(0), _SHAPES)
  grads = _grad_list(1)[0]
  mask = {"w": True, "b": False, "c": True, "s": False}
  if mask_kind == "callable":
    mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
  lr, wd = 0.05, 0.2
  decayed = mpscale.came(lr, weight_decay=wd, mask=mask)
  plain = mpscale.came(lr)
  u_decayed, _ = decayed.update(grads, decayed.init(params), params)
  u_plain, _ = plain.update(grads, plain.init(params), params)
  for k in params:
    want = u_plain[k] - (lr * wd * params[k] if k in ("w", "c") else 0.0)
    np.testing.assert_allclose(u_decayed[k], want, rtol=1e-6, atol=1e-7, err_msg=k)


def test_weight_decay_schedule_is_followed():
  params = _tree(np.random.default_rng(0), _SHAPES)
  grads = _grad_list(4)
  lr = 0.01
  wd = mpscale.weight_decay_schedule(0.0, 0.3, 3, style="linear")
  tx, plain = mpscale.came(lr, weight_decay=wd), mpscale.came(lr)
  s, s_plain = tx.init(params), plain.init(params)
  for count, g in enumerate(grads):
    u, s = tx.update(g, s, params)
    u_plain, s_plain = plain.update(g, s_plain, params)
    want = jax.tree.map(lambda a, p: a - lr * float(wd(count)) * p, u_plain, params)
    chex.assert_trees_all_close(u, want, rtol=1e-6, atol=1e-7)


def test_learning_rate_schedule_is_followed_and_recorded():
  params = _tree(np.random.default_rng(0), _SHAPES)
  grads = _grad_list(4)
  schedule = mpscale.lr_schedule(0.1, warmup_steps=2, decay_steps=4, style="cosine")
  tx, unit = mpscale.came(schedule), mpscale.came(1.0)
  s, s_unit = tx.init(params), unit.init(params)
  np.testing.assert_allclose(s[-1].learning_rate, schedule(0))
  for count, g in enumerate(grads):
    u, s = tx.update(g, s, params)
    u_unit, s_unit = unit.update(g, s_unit, params)
    lr = float(schedule(count))
    chex.assert_trees_all_close(u, jax.tree.map(lambda a: lr * a, u_unit),
                                rtol=1e-6, atol=1e-9)
    assert s[-1].learning_rate.dtype == jnp.float32
    np.testing.assert_allclose(s[-1].learning_rate, lr, rtol=1e-6)


def test_scale_by_came_is_the_direction():
  params = _tree(np.random.default_rng(0), _SHAPES)
  grads = _grad_list(3)
  kwargs = dict(beta2=0.999, beta3=0.999, clip_threshold=0.5)
  got, _ = _run(optax.chain(mpscale.scale_by_came(**kwargs),
                            optax.scale_by_learning_rate(0.01)), params, grads)
  want, _ = _run(mpscale.came(0.01, **kwargs), params, grads)
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)


def test_time_dependent_beta2_first_step_uses_the_gradient_alone():
  # beta2 = 1 - 1**-0.8 = 0: the first second moment is exactly g^2 + eps[0].
  g = {"b": jnp.asarray([3.0, -4.0, 0.5], jnp.float32)}
  tx = mpscale.scale_by_came(clip_threshold=math.inf)
  state = tx.init(g)
  _, state = tx.update(g, state)
  np.testing.assert_allclose(state.v["b"], np.square(g["b"]) + 1e-30, rtol=1e-7)


def test_bf16_params_get_float32_statistics_and_bf16_updates():
  params = {"w": jnp.ones((4, 6), jnp.bfloat16), "b": jnp.ones((6,), jnp.bfloat16)}
  tx = mpscale.came(1e-3)
  state = tx.init(params)
  assert state[0].mu["w"].dtype == jnp.float32
  assert state[0].v_row["w"].dtype == jnp.float32
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, jnp.bfloat16), params)
  updates, _ = jax.jit(tx.update)(grads, state, params)
  assert updates["w"].dtype == jnp.bfloat16


# ---------------------------------------------------------------------------------------
# Validation.

@pytest.mark.parametrize("kwargs,error,name", [
    (dict(learning_rate=None), ValueError, "learning_rate"),
    (dict(learning_rate=1e-3, relative_step=True), ValueError, "learning_rate"),
    (dict(warmup_init=True), ValueError, "warmup_init"),
    (dict(learning_rate="1e-3"), TypeError, "learning_rate"),
    (dict(learning_rate=-1.0), ValueError, "learning_rate"),
    (dict(decay_rate=1.5), ValueError, "decay_rate"),
    (dict(decay_rate=-0.1), ValueError, "decay_rate"),
    (dict(decay_rate=None), ValueError, "decay_rate"),
    (dict(beta1=1.1), ValueError, "beta1"),
    (dict(beta3=-0.5), ValueError, "beta3"),
    (dict(beta2=1.0), ValueError, "beta2"),
    (dict(beta2=1 - 1e-12), ValueError, "beta2"),
    (dict(weight_decay=2.0), ValueError, "weight_decay"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(eps=(1e-30, 1e-3)), ValueError, "eps"),
    (dict(eps=(1e-30, 0.0, 1e-16)), ValueError, r"eps\[1\]"),
    (dict(eps=(1e-30, -1e-3, 1e-16)), ValueError, r"eps\[1\]"),
    (dict(eps=(1e-30, "a", 1e-16)), TypeError, r"eps\[1\]"),
    (dict(eps=1e-30), TypeError, "eps"),
    (dict(loss_scale=0.0), ValueError, "loss_scale"),
    (dict(loss_scale=-2.0), ValueError, "loss_scale"),
    (dict(clip_threshold=0.0), ValueError, "clip_threshold"),
    (dict(clip_threshold=-1.0), ValueError, "clip_threshold"),
    (dict(compression="int8"), ValueError, "compression"),
    (dict(compression=object()), TypeError, "compression"),
    (dict(compression=jnp.float32), ValueError, "compression"),
    (dict(scale_parameter=1), TypeError, "scale_parameter"),
    (dict(beta1=True), TypeError, "beta1"),
])
def test_validation_names_the_argument(kwargs, error, name):
  kwargs = {"learning_rate": 1e-3, **kwargs}
  with pytest.raises(error, match=name):
    mpscale.came(**kwargs)


def test_valid_edge_values_build():
  mpscale.came(1e-3, decay_rate=0.0, beta1=0.0, beta3=1.0, weight_decay=1.0)
  mpscale.came(relative_step=True, warmup_init=True)
  mpscale.came(1e-3, clip_threshold=math.inf, beta2=0.0, decay_rate=None)
  mpscale.came(optax.constant_schedule(1e-3), weight_decay=lambda count: 0.1)
  for c in (False, True, "float16", "bfloat16", jnp.float16, jnp.bfloat16):
    mpscale.came(1e-3, compression=c)


# ---------------------------------------------------------------------------------------
# Memory.

def _state_numbers(state):
  """Numbers per params leaf in a ScaleByCameState, and bytes of its momentum."""
  fields = ("mu", "v_row", "v_col", "v", "instability_row", "instability_col")
  sizes = [jax.tree.leaves(getattr(state, f)) for f in fields]
  return [sum(x.size for x in per_leaf) for per_leaf in zip(*sizes)]


@pytest.mark.parametrize("compression", [False, "float16", "bfloat16"])
def test_state_memory(compression):
  shapes = {"a": (64, 48), "b": (48,), "c": (3, 16, 8), "d": (1, 64), "e": ()}
  params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
  tx = mpscale.came(1e-3, compression=compression)
  state = tx.init(params)
  scale_state = state[0]
  counts = dict(zip(sorted(shapes), _state_numbers(scale_state)))
  # Plus one element per unused statistic (a placeholder: 1 on a matrix, 4 on a
  # vector or scalar).
  assert counts["a"] == 64 * 48 + 2 * (64 + 48) + 1
  assert counts["b"] == 2 * 48 + 4
  assert counts["c"] == 3 * 16 * 8 + 2 * 3 * (16 + 8) + 1
  assert counts["d"] == 64 + 2 * (1 + 64) + 1
  assert counts["e"] == 2 + 4
  itemsize = 2 if compression else 4
  for k, s in shapes.items():
    assert scale_state.mu[k].nbytes == math.prod(s) * itemsize
  if compression:
    assert scale_state.v["b"].dtype == jnp.dtype(compression)
    assert scale_state.v_row["a"].dtype == jnp.float32  # factored stats stay float32
  # The whole state: CAME's statistics plus a few scalars (counts, learning rate).
  total = sum(x.size for x in jax.tree.leaves(state))
  assert total - sum(counts.values()) <= 3


# ---------------------------------------------------------------------------------------
# Compression.

def _badly_scaled_problem():
  """A small regression whose loss is weighted 1e3 (bias gradients ~1e3) plus a
  1e-4-weighted fit of a ``scale`` vector (gradients ~4e-5): float16 holds neither
  squared gradient (past 65504; below its smallest subnormal, 6e-8)."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
  w_true = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
  y = x @ w_true + 3.0
  target = jnp.asarray(rng.uniform(-2, 2, (8,)), jnp.float32)

  def loss(p):
    fit = jnp.mean(jnp.square(x @ p["w"] + p["bias"] - y))
    return 1e3 * fit + 1e-4 * jnp.mean(jnp.square(p["scale"] - target))

  params = {"w": jnp.zeros((16, 8)), "bias": jnp.zeros((8,)), "scale": jnp.zeros((8,))}
  return loss, params


def _train(tx, loss, params, steps):
  @jax.jit
  def step(p, s):
    value, grads = jax.value_and_grad(loss)(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, value

  state, losses = tx.init(params), []
  for _ in range(steps):
    params, state, value = step(params, state)
    losses.append(float(value))
  return params, state, losses


@pytest.mark.parametrize("compression", ["float16", "bfloat16"])
def test_compression_keeps_state_finite_where_naive_float16_fails(compression):
  loss, params = _badly_scaled_problem()
  tx_full = mpscale.came(0.1)  # beta2 = 1 - t**-0.8: v = g^2 after the first step
  _, first_state, _ = _train(tx_full, loss, params, steps=1)
  full_params, _, full_losses = _train(tx_full, loss, params, steps=150)

  # Naive float16 storage of the float32 second moments: overflow and underflow.
  v = first_state[0].v
  with np.errstate(over="ignore"):
    assert np.isinf(np.float16(v["bias"])).all()
  assert (np.float16(v["scale"]) == 0).all()

  p, state, losses = _train(mpscale.came(0.1, compression=compression), loss, params,
                            steps=150)
  # Every stored number finite, second moments positive, momentum compressed.
  for leaf in jax.tree.leaves(state):
    assert np.isfinite(np.asarray(leaf, np.float32)).all()
  assert state[0].mu["w"].dtype == jnp.dtype(compression)
  assert state[0].v["scale"].dtype == jnp.dtype(compression)
  assert (np.asarray(state[0].v["scale"], np.float32) > 0).all()
  # It trains, and like the float32-state run.
  assert all(np.isfinite(losses))
  assert losses[-1] < 1e-4 * losses[0]
  assert full_losses[-1] < 1e-4 * full_losses[0]
  chex.assert_trees_all_close(p, full_params, atol=0.05)


def test_compressed_second_moment_round_trips_as_its_square_root():
  g = {"b": jnp.asarray([1e3, 1e-6, 1.0], jnp.float32)}
  tx = mpscale.scale_by_came(compression=True, clip_threshold=math.inf)
  _, state = tx.update(g, tx.init(g))
  # decay_rate's beta2 is 0 at step 1, so v = g^2: stored as |g| in float16.
  np.testing.assert_allclose(np.asarray(state.v["b"], np.float32),
                             [1e3, 1e-6, 1.0], rtol=2e-2)


# ---------------------------------------------------------------------------------------
# jit, loss-scale wrappers, metrics, sharding.

def test_jit_matches_eager():
  params = _tree(np.random.default_rng(0), _SHAPES)
  grads = _grad_list(3)
  tx = mpscale.came(1e-2, weight_decay=0.1, scale_parameter=True)
  state = tx.init(params)
  eager, jitted = params, params
  s_eager, s_jit = state, state
  update = jax.jit(tx.update)
  for g in grads:
    u, s_eager = tx.update(g, s_eager, eager)
    eager = optax.apply_updates(eager, u)
    u, s_jit = update(g, s_jit, jitted)
    jitted = optax.apply_updates(jitted, u)
  chex.assert_trees_all_close(eager, jitted, rtol=1e-6, atol=1e-7)


def test_state_can_be_donated():
  params = _tree(np.random.default_rng(0), _SHAPES)
  grads = _grad_list(2)
  for compression in (False, True):
    tx = mpscale.came(1e-2, weight_decay=0.1, compression=compression)
    want, _ = _run(tx, params, grads)
    step = _step_fn(tx, donate=True)
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    for g in grads:
      p, s = step(p, s, g)
    chex.assert_trees_all_close(p, want, rtol=1e-6, atol=1e-7)


def _entry_ops(compiled_text: str) -> list[tuple[str, str, str, list[str]]]:
  """(name, shape, op, operand names) of each instruction of a compiled module's
  ENTRY computation."""
  entry = compiled_text[compiled_text.index("ENTRY"):].split("\n}\n")[0]
  ops = []
  for line in entry.splitlines()[1:]:
    m = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\S+)\s+([\w\-]+)\((.*?)\)",
                 line)
    if m:
      name, shape, op, operands = m.groups()
      ops.append((name, shape, op, re.findall(r"%([\w.\-]+)", operands)))
  return ops


def test_cpu_step_leaves_placeholders_alone_and_makes_seven_passes_per_matrix():
  # Issue 64 item 8 suspected the one-element placeholders of a CAME/AdamW
  # regression on the CPU. The compiled step shows they cost nothing: each is its
  # donated input passed through (no kernel reads or writes it, no copy), where the
  # zero-size placeholders before them were written anew (a copy each). The matrix
  # work is the seven passes of the module docstring (11 reads, 2 writes).
  shapes = {"w": (256, 384), "u": (384, 256), "b": (384,), "s": (256,)}
  params = {k: jnp.full(v, 0.02, jnp.float32) for k, v in shapes.items()}
  tx = mpscale.came(1e-3)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  state = tx.init(params)
  text = jax.jit(step, donate_argnums=(0, 1)).lower(
      params, state, params).compile().as_text()
  ops = _entry_ops(text)
  assert [op for _, shape, op, _ in ops if op == "copy" and shape != "f32[]"] == []
  root = next(line for line in text[text.index("ENTRY"):].splitlines()
              if line.lstrip().startswith("ROOT"))
  root_operands = re.findall(r"%([\w.\-]+)", root.split(" tuple(", 1)[1])
  out_leaves = jax.tree_util.tree_leaves((params, state))
  placeholders = [name for name, leaf in zip(root_operands, out_leaves)
                  if leaf.shape == (1,)]
  assert len(placeholders) == 4 * 2 + 2  # 4 per vector, v of each matrix
  params_in = {name for name, _, op, _ in ops if op == "parameter"}
  assert set(placeholders) <= params_in
  read = {o for _, _, op, operands in ops if op != "tuple" for o in operands}
  assert not read & set(placeholders)
  big = {name for name, shape, _, _ in ops if "256,384" in shape or "384,256" in shape}
  reads = sum(o in big for _, _, op, operands in ops if op != "tuple"
              for o in operands)
  writes = sum(name in big for name, _, op, _ in ops if op != "parameter")
  if _versions._release(jax.__version__) >= (0, 10):
    # XLA's CPU fusions of jax 0.7 (the floors) split the passes otherwise (32
    # reads, 14 writes): the count is today's compiler's, the benchmarks'
    assert (reads, writes) == (2 * 11, 2 * 2)


def test_inside_dynamic_loss_scale_and_step_metrics():
  params = _tree(np.random.default_rng(0), _SHAPES)
  grads = _grad_list(3)
  schedule = mpscale.lr_schedule(1e-2, warmup_steps=2, decay_steps=10)
  tx = mpscale.dynamic_loss_scale(mpscale.came(schedule, weight_decay=0.01),
                                  init_scale=2.0**10)
  plain = mpscale.came(schedule, weight_decay=0.01)
  state, s_plain = tx.init(params), plain.init(params)
  p, p_plain = params, params
  update = jax.jit(tx.update)
  for count, g in enumerate(grads):
    scale = mpscale.loss_scale_of(state)
    u, state = update(jax.tree.map(lambda x: scale * x, g), state, p)
    p = optax.apply_updates(p, u)
    u_plain, s_plain = plain.update(g, s_plain, p_plain)
    p_plain = optax.apply_updates(p_plain, u_plain)
    metrics = mpscale.step_metrics(state)
    np.testing.assert_allclose(metrics["learning_rate"], schedule(count), rtol=1e-6)
  chex.assert_trees_all_close(p, p_plain, rtol=1e-6, atol=1e-7)

  # A non-finite step is skipped: params and CAME's state (count, lr) unchanged.
  bad = jax.tree.map(lambda x: x.at[()].set(jnp.inf) if x.ndim == 0 else x, grads[0])
  u, new_state = update(bad, state, p)
  metrics = mpscale.step_metrics(new_state)
  assert bool(metrics["overflow"]) and int(metrics["skipped"]) == 1
  chex.assert_trees_all_equal(optax.apply_updates(p, u), p)
  chex.assert_trees_all_equal(new_state.skip_state.inner_state, state.skip_state.inner_state)
  np.testing.assert_allclose(metrics["learning_rate"], schedule(len(grads) - 1))


@pytest.mark.parametrize("spec,compression,tol", [
    (P("x", None), False, 1e-6),
    (P(None, "x"), False, 1e-6),
    # Another summation order can move a float16 momentum by one unit in the last place.
    (P("x", "y"), True, 1e-4),
])
def test_sharded_params_match_unsharded(spec, compression, tol):
  devices = np.asarray(jax.devices()[:8])
  mesh = Mesh(devices.reshape(4, 2) if spec == P("x", "y") else devices.reshape(8, 1),
              ("x", "y"))
  rng = np.random.default_rng(0)
  shapes = {"w": (64, 32), "b": (32,)}
  params = _tree(rng, shapes)
  grads = _grad_list(3, shapes)
  tx = mpscale.came(1e-2, weight_decay=0.1, compression=compression)
  want, _ = _run(tx, params, grads)

  def put(tree):
    return {"w": jax.device_put(tree["w"], NamedSharding(mesh, spec)),
            "b": jax.device_put(tree["b"], NamedSharding(mesh, P()))}

  step = _step_fn(tx)
  got, state = put(params), tx.init(put(params))
  for g in grads:
    got, state = step(got, state, put(g))
  assert got["w"].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
  chex.assert_trees_all_close(got, want, rtol=tol, atol=tol)
  assert np.isfinite(np.asarray(state[0].mu["w"], np.float32)).all()


def test_empty_params():
  tx = mpscale.came(1e-3)
  state = tx.init({})
  updates, _ = tx.update({}, state, {})
  assert updates == {}


def test_compression_dtype_resolution():
  assert compression_dtype(False) is None
  assert compression_dtype(True) == jnp.float16
  assert compression_dtype("bfloat16") == jnp.bfloat16
  assert compression_dtype(jnp.float16) == jnp.float16


# ---------------------------------------------------------------------------------------
# The GPU branch: rank 0 and 1 leaves bucketed (issue 64 item 4).

def _layered_tree(rng, layers=4):
  """Blocks of a matrix, two same-shaped vectors and a scalar, plus a lone vector of
  another shape: the GPU branch's buckets are one of 9 vectors [8], one of the 4
  scalars, and each matrix and the [3] vector alone."""
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return {"h": [{"w": normal(5, 7), "b": normal(8), "scale": normal(8),
                 "s": normal()} for _ in range(layers)],
          "ln_f": normal(8), "pos": normal(3)}


def _cuda_branch(monkeypatch):
  monkeypatch.setattr(jax.lax, "platform_dependent",
                      lambda *args, cuda, default: cuda(*args))


@pytest.mark.parametrize("compression", [False, "bfloat16"])
def test_gpu_buckets_update_as_leaf_by_leaf(monkeypatch, compression):
  """The CUDA branch (vectors stacked for the clip's means) gives every leaf the
  update and statistics the per-leaf branch gives, step after step."""
  rng = np.random.default_rng(3)
  params = _layered_tree(rng)
  grads = [jax.tree.map(lambda p: p * s, params) for s in (1.0, -3.0, 1e-3)]
  tx = mpscale.came(1e-2, weight_decay=0.1, compression=compression)

  def run():
    state, outs = tx.init(params), []
    for g in grads:
      updates, state = jax.jit(tx.update)(g, state, params)
      outs.append((updates, state))
    return outs

  default = run()
  _cuda_branch(monkeypatch)
  bucketed = run()
  for want, got in zip(default, bucketed):
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=0)


def _reductions_of(jaxpr, shapes):
  """The ``reduce_sum`` equations of ``jaxpr`` (nested ones too) whose operand has
  one of ``shapes``."""
  found = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "reduce_sum" and eqn.invars[0].aval.shape in shapes:
      found += 1
    for sub in helpers.sub_jaxprs(eqn.params):
      found += _reductions_of(sub, shapes)
  return found


def test_gpu_branch_reduces_each_vector_bucket_once(monkeypatch):
  """In the CUDA branch the RMS clip of the 9 [8] vectors is one reduction of their
  stack, and of the 4 scalars one (the per-leaf branch makes one per leaf); each
  matrix keeps its own five matrix-sized reductions."""
  params = _layered_tree(np.random.default_rng(0))
  tx = mpscale.scale_by_came()
  state = tx.init(params)
  _cuda_branch(monkeypatch)
  jaxpr = jax.make_jaxpr(tx.update)(params, state).jaxpr
  assert _reductions_of(jaxpr, {(9, 8)}) == 1
  assert _reductions_of(jaxpr, {(8,)}) == 0
  assert _reductions_of(jaxpr, {(4,)}) == 1
  assert _reductions_of(jaxpr, {()}) == 0
  assert _reductions_of(jaxpr, {(5, 7)}) == 4 * 5


@pytest.mark.parametrize("compression", [False, "bfloat16"])
def test_every_state_leaf_is_produced_outside_the_platform_cond(compression):
  """``lax.platform_dependent`` is a ``cond`` in the jaxpr, holding both branches.
  Only the vectors' clip means may sit in it: a state leaf output by it is one
  `mpscale.skip_nonfinite` cannot select where it is produced
  (`mpscale.scaling._producer_select`), so the update reads its unselected state and
  XLA fuses, and rounds, the step differently from the same leaves in another
  transform (with the whole update in the ``cond``, CAME's weight-decay mask and the
  equal parameter group differed in the last bits)."""
  params = _layered_tree(np.random.default_rng(0))
  tx = mpscale.scale_by_came(compression=compression)
  state = tx.init(params)
  closed = jax.make_jaxpr(tx.update)(params, state)
  jaxpr = closed.jaxpr
  conds = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "cond"]
  assert len(conds) == 1  # the GPU branch is traced
  n_updates = len(jax.tree_util.tree_leaves(params))
  state_vars = {v for v in jaxpr.outvars[n_updates:]
                if not isinstance(v, jax.extend.core.Literal)}
  assert not state_vars & set(conds[0].outvars)
  branch_outputs = {v.aval.shape for v in conds[0].outvars}
  assert branch_outputs == {()}  # the means alone


# ---------------------------------------------------------------------------------------
# stack_layers: the state stacked by role, the same step.

def _named_layers(rng, names, layers=3):
  """A model of ``layers`` blocks (a matrix, a rank-3 weight, a vector, a scalar) in
  one of three spellings of layer numbers, beside unstacked leaves: linen's
  ``h_0``, a digit key ``h/0`` or a list ``h[0]``."""
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  blocks = [{"w": normal(6, 5), "t": normal(2, 3, 4), "b": normal(5), "s": normal()}
            for _ in range(layers)]
  tree = {"wte": normal(7, 5), "ln_f": normal(5)}
  if names == "linen":
    tree.update({f"h_{i}": block for i, block in enumerate(blocks)})
  elif names == "slash":
    tree["h"] = {str(i): block for i, block in enumerate(blocks)}
  else:
    tree["h"] = blocks
  return tree


@pytest.mark.parametrize("names", ["linen", "slash", "list"])
def test_stack_layers_keeps_each_role_as_one_array(names):
  params = _named_layers(np.random.default_rng(0), names)
  state = mpscale.scale_by_came(stack_layers=True).init(params)
  assert isinstance(state.mu, mpscale.Stacks)
  layers = {"linen": "h_{}", "slash": "h/{}", "list": "h/{}"}[names]
  by_role = {m[0]: (m, x.shape) for m, x in zip(state.mu.members, state.mu.arrays)}
  for role, shape in (("w", (6, 5)), ("t", (2, 3, 4)), ("b", (5,)), ("s", ())):
    members, stacked = by_role[layers.format(0) + "/" + role]
    assert members == tuple(layers.format(i) + "/" + role for i in range(3))
    assert stacked == (3,) + shape
  assert by_role["wte"][1] == (1, 7, 5) and by_role["ln_f"][1] == (1, 5)
  assert len(state.mu.arrays) == 6
  row = dict(zip([m[0] for m in state.v_row.members], state.v_row.arrays))
  col = dict(zip([m[0] for m in state.v_col.members], state.v_col.arrays))
  assert row[layers.format(0) + "/w"].shape == (3, 6)
  assert col[layers.format(0) + "/t"].shape == (3, 2, 4)
  # State fields other than the momentum have the same stacks.
  assert all(field.members == state.mu.members for field in state[1:])


def test_stack_layers_stacks_at_most_32_layers():
  params = {f"h_{i}": {"w": jnp.zeros((3, 2))} for i in range(40)}
  state = mpscale.scale_by_came(stack_layers=True).init(params)
  assert [x.shape[0] for x in state.mu.arrays] == [32, 8]


@pytest.mark.parametrize("names", ["linen", "list"])
@pytest.mark.parametrize("kwargs", [
    {},
    {"compression": "float16"},
    {"compression": "bfloat16", "beta2": 0.999},
    {"weight_decay": 0.1, "mask": lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
     "scale_parameter": True},
    {"learning_rate": None, "relative_step": True, "clip_threshold": 0.5},
])
def test_stack_layers_steps_as_leaf_by_leaf(names, kwargs):
  """Every leaf gets the update (and, unstacked, the statistics) of the per-leaf
  state, step after step: its own RMS clip and factors, not its stack's. The gradients
  differ in scale by layer (10x a layer) so that a clip or a factor over the whole
  stack would differ."""
  rng = np.random.default_rng(1)
  params = _named_layers(rng, names)
  kwargs = {"learning_rate": 1e-2, **kwargs}
  leafwise = mpscale.came(**kwargs)
  stacked = mpscale.came(stack_layers=True, **kwargs)
  layer = lambda path: sum(int(c) for c in re.findall(r"[0-9]+", jax.tree_util.keystr(
      path)))  # 0, 1, 2 by layer (0 outside the blocks)
  grads = [jax.tree_util.tree_map_with_path(
      lambda path, p: (p * s + 0.01 * rng.normal(size=p.shape)) * 10.0 ** layer(path),
      params) for s in (1.0, -30.0, 1e-3, 2.0)]
  a, b = _step_fn(leafwise), _step_fn(stacked)
  pa, sa, pb, sb = params, leafwise.init(params), params, stacked.init(params)
  for g in grads:
    g = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g)
    pa, sa = a(pa, sa, g)
    pb, sb = b(pb, sb, g)
    chex.assert_trees_all_close(pb, pa, rtol=2e-6, atol=1e-7)
  # The stacked statistics are the per-leaf ones, row by row.
  for field in ("mu", "v_row", "v_col", "instability_row", "instability_col"):
    leaves = dict(zip(
        [jax.tree_util.keystr(p, simple=True, separator="/")
         for p, _ in jax.tree_util.tree_flatten_with_path(getattr(sa[0], field))[0]],
        jax.tree_util.tree_leaves(getattr(sa[0], field))))
    stacks = getattr(sb[0], field)
    for members, x in zip(stacks.members, stacks.arrays):
      for j, m in enumerate(members):
        np.testing.assert_allclose(np.asarray(x[j], np.float32),
                                   np.asarray(leaves[m], np.float32),
                                   rtol=2e-5, atol=1e-7, err_msg=f"{field} {m}")


def test_stack_layers_bf16_params_keep_their_dtype():
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                        _named_layers(np.random.default_rng(2), "linen"))
  tx = mpscale.came(1e-2, stack_layers=True)
  state = tx.init(params)
  assert {x.dtype for x in state[0].mu.arrays} == {jnp.dtype(jnp.float32)}
  updates, _ = jax.jit(tx.update)(params, state, params)
  assert {x.dtype for x in jax.tree.leaves(updates)} == {jnp.dtype(jnp.bfloat16)}


def test_stack_layers_skips_an_overflow_with_the_state_untouched():
  params = _named_layers(np.random.default_rng(4), "linen")
  tx = mpscale.dynamic_loss_scale(mpscale.came(1e-2, stack_layers=True))
  state = tx.init(params)
  step = jax.jit(tx.update)
  good = jax.tree.map(lambda x: 0.5 * x, params)
  updates, state = step(good, state, params)
  params = optax.apply_updates(params, updates)
  bad = dict(good, h_1=dict(good["h_1"], w=good["h_1"]["w"].at[2, 3].set(jnp.inf)))
  updates, after = step(bad, state, params)
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  chex.assert_trees_all_equal(after.skip_state.inner_state,
                              state.skip_state.inner_state)


def test_stack_layers_refuses_updates_of_another_tree():
  params = _named_layers(np.random.default_rng(0), "linen")
  tx = mpscale.scale_by_came(stack_layers=True)
  state = tx.init(params)
  other = dict(params, h_3=params["h_0"])
  with pytest.raises(ValueError, match="stack_layers"):
    tx.update(other, state)


def test_stack_layers_argument_is_checked():
  with pytest.raises(TypeError, match="stack_layers"):
    mpscale.came(1e-3, stack_layers="yes")


def _branch(monkeypatch, which):
  """``lax.platform_dependent`` takes ``which`` branch ("cpu" or "default")."""
  def pick(*args, default, **branches):
    return (branches[which] if which in branches else default)(*args)
  monkeypatch.setattr(jax.lax, "platform_dependent", pick)


def test_stack_layers_gpu_branch_steps_as_leaf_by_leaf(monkeypatch):
  """Off the CPU each stack's reductions run over the whole stack (on the CPU, leaf
  by leaf): the same step as the per-leaf state."""
  rng = np.random.default_rng(5)
  params = _named_layers(rng, "linen")
  grads = [jax.tree.map(lambda p: p * s, params) for s in (1.0, -3.0, 1e-3)]
  leafwise = mpscale.came(1e-2, weight_decay=0.1)
  stacked = mpscale.came(1e-2, weight_decay=0.1, stack_layers=True)
  want, _ = _run(leafwise, params, grads)
  _branch(monkeypatch, "default")
  got, _ = _run(stacked, params, grads)
  chex.assert_trees_all_close(got, want, rtol=2e-6, atol=1e-7)


def test_stack_layers_reduces_each_matrix_of_a_stack_on_the_cpu(monkeypatch):
  """XLA:CPU's reductions are fast on a matrix and slow on a stack of them, so its
  branch reduces each leaf of a stack as a matrix; the other branch reduces the
  stack. The state is produced outside the branches (`mpscale.skip_nonfinite`
  selects it where it is produced)."""
  params = _named_layers(np.random.default_rng(0), "linen")
  tx = mpscale.scale_by_came(stack_layers=True)
  state = tx.init(params)
  stacks = {(3, 6, 5), (3, 2, 3, 4)}
  for which, per_stack in (("cpu", 0), ("default", 1)):
    _branch(monkeypatch, which)
    # a new function each time: make_jaxpr caches a function's trace
    jaxpr = jax.make_jaxpr(lambda p, s: tx.update(p, s))(params, state).jaxpr
    assert (_reductions_of(jaxpr, stacks) > 0) == bool(per_stack), which
    assert _reductions_of(jaxpr, {(6, 5), (2, 3, 4)}) > 0 or per_stack, which
  monkeypatch.undo()
  jaxpr = jax.make_jaxpr(lambda p, s: tx.update(p, s))(params, state).jaxpr
  conds = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "cond"]
  assert conds  # the branches are traced
  n_updates = len(jax.tree_util.tree_leaves(params))
  state_vars = {v for v in jaxpr.outvars[n_updates:]
                if not isinstance(v, jax.extend.core.Literal)}
  assert not state_vars & {v for eqn in conds for v in eqn.outvars}
