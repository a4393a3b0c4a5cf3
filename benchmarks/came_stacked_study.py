"""Issue #64 item 4: would CAME with its state stacked by role reach 2x AdamW's
kernels and 1.3x its bytes on the H100 program? A prototype, compiled for one H100
without a GPU (``jax.experimental.topologies``), against ``optax.adamw`` and
`mpscale.came` on the GPT-2 tree of `bench_gpu_program` (12 layers, vocab 8192).

The prototype keeps one array per statistic and per *bucket* of leaves of one shape
(the 12 layers' ``c_fc`` kernels: a ``[12, 768, 3072]`` momentum, ``[12, 768]`` row
and ``[12, 3072]`` column statistics; the vectors alike), stacks each bucket's
gradients in the update (XLA's GPU compiler fuses the stack into the reductions that
read it), computes CAME's factored step once per bucket, and writes each parameter
from its slice of the bucket's direction. The math is `mpscale.came`'s with its
defaults (``decay_rate`` 0.8, ``beta1`` 0.9, ``beta3`` 0.99, clip 1, learning rate
1e-3, no weight decay); ``--check`` first compares one step of both on the CPU.

Columns: ``kernels`` (`mpscale.trainer.planning.hlo.launches`), ``reductions`` (the
entry's ``kInput`` fusions), ``GiB`` (`mpscale.trainer.planning.hlo.kernels`: a fusion
reads each operand whole unless it reads dynamic slices of it) and ``GiB sliced``
(the same, but an operand a fusion reads only through element-wise ops ending in
static ``slice``s counts as those slices, as the fused GPU kernel reads it: each
parameter's last kernel here slices its layer of the bucket's momentum)::

  JAX_PLATFORMS=cpu python benchmarks/came_stacked_study.py [--check]
"""

from __future__ import annotations

import collections
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import mpscale  # noqa: E402
from bench_gpu_program import h100_device, measure, placed  # noqa: E402
from gpt2_tree import gpt2_like_shapes, is_shape  # noqa: E402
from mpscale.trainer.planning import hlo  # noqa: E402

BETA1, BETA3, EPS_SQ, EPS_INSTABILITY, CLIP, LR = 0.9, 0.99, 1e-30, 1e-16, 1.0, 1e-3


def buckets(params):
  """Leaf indices grouped by shape (every leaf here is float32 on one device)."""
  groups = collections.defaultdict(list)
  for i, x in enumerate(jax.tree_util.tree_leaves(params)):
    groups[tuple(x.shape)].append(i)
  return [tuple(v) for v in groups.values()]


def init(params, groups):
  leaves = jax.tree_util.tree_leaves(params)
  stats = []
  for idx in groups:
    k, shape = len(idx), leaves[idx[0]].shape
    zeros = lambda s: jnp.zeros((k,) + tuple(s), jnp.float32)  # noqa: E731
    if len(shape) >= 2:
      stats.append({"mu": zeros(shape), "v_row": zeros(shape[:-1]),
                    "v_col": zeros(shape[:-2] + shape[-1:]),
                    "s_row": zeros(shape[:-1]), "s_col": zeros(shape[:-2] + shape[-1:])})
    else:
      stats.append({"mu": zeros(shape), "v": zeros(shape)})
  return jnp.zeros((), jnp.int32), stats


def _per(x, ndim):  # a [k] vector broadcast against [k, ...] of rank ndim
  return x.reshape((-1,) + (1,) * (ndim - 1))


def _row_factor(row):
  return lax.rsqrt(row / jnp.mean(row, axis=-1, keepdims=True))


def bucket_step(g, st, b2):
  """One bucket's direction and statistics (``g``: ``[k, ...]``)."""
  if "v" in st:  # vectors: full second moment, the RMS clip, the momentum
    v = b2 * st["v"] + (1 - b2) * (jnp.square(g) + EPS_SQ)
    u = g * lax.rsqrt(v)
    ms = jnp.mean(jnp.square(u), axis=tuple(range(1, u.ndim)))
    u = u / _per(jnp.maximum(jnp.sqrt(ms) / CLIP, 1.0), u.ndim)
    mu = BETA1 * st["mu"] + (1 - BETA1) * u
    return mu, {"mu": mu, "v": v}
  rows, cols = g.shape[-2:]
  v_row = b2 * st["v_row"] + (1 - b2) * (jnp.sum(g * g, -1) / cols + EPS_SQ)
  v_col = b2 * st["v_col"] + (1 - b2) * (
      jnp.sum(jnp.abs(g) * jnp.abs(g), -2) / rows + EPS_SQ)
  r, c = _row_factor(v_row), lax.rsqrt(v_col)
  u_sq = jnp.sum(jnp.square(r) * jnp.sum(g * jnp.square(c)[..., None, :] * g, -1),
                 axis=tuple(range(1, r.ndim)))
  rms = jnp.sqrt(u_sq / (rows * cols))
  a = r / _per(jnp.maximum(rms / CLIP, 1.0), r.ndim)
  mu = BETA1 * st["mu"] + (1 - BETA1) * (g * a[..., :, None] * c[..., None, :])
  res_row = jnp.mean(jnp.square(
      g * jnp.abs(c)[..., None, :] * jnp.abs(a)[..., :, None] - mu), -1)
  res_col = jnp.mean(jnp.square(
      mu - jnp.maximum(a, 0)[..., :, None] * (g * jnp.maximum(c, 0)[..., None, :])), -2)
  s_row = BETA3 * st["s_row"] + (1 - BETA3) * (res_row + EPS_INSTABILITY)
  s_col = BETA3 * st["s_col"] + (1 - BETA3) * (res_col + EPS_INSTABILITY)
  d = mu * _row_factor(s_row)[..., :, None] * lax.rsqrt(s_col)[..., None, :]
  return d, {"mu": mu, "v_row": v_row, "v_col": v_col, "s_row": s_row, "s_col": s_col}


def make_step(groups, treedef):
  def step(params, state, grads):
    count, stats = state
    count = count + 1
    b2 = 1.0 - count.astype(jnp.float32) ** -0.8
    g_leaves = jax.tree_util.tree_leaves(grads)
    new = list(jax.tree_util.tree_leaves(params))
    new_stats = []
    for idx, st in zip(groups, stats):
      d, st = bucket_step(jnp.stack([g_leaves[i] for i in idx]), st, b2)
      new_stats.append(st)
      for j, i in enumerate(idx):
        new[i] = new[i] - LR * d[j]
    return treedef.unflatten(new), (count, new_stats)
  return step


def optimizer_step(tx):
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  return step


_ELEMENTWISE = {"multiply", "add", "subtract", "divide", "maximum", "minimum", "abs",
                "negate", "rsqrt", "sqrt", "exponential", "select", "compare",
                "convert", "power", "clamp"}


def _read_share(users, types, name, depth=0):
  """The share of ``name``'s elements its fusion reads: the slices it ends in, through
  element-wise ops of its shape; 1 where anything else reads it."""
  uses = users.get(name, [])
  if not uses or depth > 32:
    return 1.0
  share = 0.0
  for user, _ in uses:
    if user.op == "slice":
      share += math.prod(hlo._dims(user.result)) / max(1, math.prod(hlo._dims(types[name])))
    elif user.op in _ELEMENTWISE and hlo._dims(user.result) == hlo._dims(types[name]):
      share += _read_share(users, types, user.name, depth + 1)
    else:
      return 1.0
  return min(share, 1.0)


def sliced_bytes(text: str) -> float:
  """`hlo.kernels`' bytes, less what fusions do not read of operands they slice."""
  module = hlo.parse(text)
  types = module.types[module.entry]
  unread = 0.0
  for ins in module.computations[module.entry]:
    called = [c for _, c in hlo._callees(ins) if c in module.computations]
    if ins.op != "fusion" or not called:
      continue
    body, body_types = module.computations[called[0]], module.types[called[0]]
    users, params = hlo._users(body), hlo._parameters(body)
    for k, operand in enumerate(hlo._operands(ins)):
      if k in params:
        share = _read_share(users, body_types, params[k].name)
        unread += (1 - share) * hlo._shape_bytes(types.get(operand, ""))
  return hlo.kernels(module).bytes - unread


def check():
  """One step of the prototype against `mpscale.came` on a small tree, on the CPU."""
  keys = jax.random.split(jax.random.key(0), 8)
  params = {f"h{i}": {"w": jax.random.normal(keys[i], (6, 5)),
                      "b": jax.random.normal(keys[i + 4], (5,))} for i in range(3)}
  grads = jax.tree_util.tree_map(lambda x: 0.1 * x + 0.01, params)
  tx = mpscale.came(LR)
  want = optimizer_step(tx)(params, tx.init(params), grads)[0]
  groups = buckets(params)
  treedef = jax.tree_util.tree_structure(params)
  got = make_step(groups, treedef)(params, init(params, groups), grads)[0]
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
  print("check: one step equals mpscale.came's (rtol 2e-6)")


def main():
  if "--check" in sys.argv:
    check()
  dev, why = h100_device()
  if dev is None:
    print(f"skipped: no H100 compiler here ({why})")
    return
  shapes = gpt2_like_shapes(layers=12, vocab=8192, untied_head=True, names="slash")
  params = placed(jax.tree_util.tree_map(
      lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=is_shape), dev)
  groups = buckets(params)
  treedef = jax.tree_util.tree_structure(params)
  rows = {}
  for name, tx in (("adamw", optax.adamw(LR)), ("mpscale.came", mpscale.came(LR))):
    state = placed(jax.eval_shape(tx.init, params), dev)
    rows[name] = measure(jax.jit(optimizer_step(tx), donate_argnums=(0, 1)).lower(
        params, state, params).compile(), params)
  state = placed(jax.eval_shape(lambda: init(params, groups)), dev)
  rows["came, state stacked"] = measure(jax.jit(
      make_step(groups, treedef), donate_argnums=(0, 1)).lower(
          params, state, params).compile(), params)
  base = rows["adamw"]
  print(f"{len(jax.tree_util.tree_leaves(params))} leaves, {len(groups)} buckets")
  print("| step | kernels | /adamw | reductions | GiB | GiB sliced | /adamw |")
  print("|---|---|---|---|---|---|---|")
  base_sliced = sliced_bytes(base["text"])
  for name, r in rows.items():
    s = sliced_bytes(r["text"])
    print(f"| {name} | {r['kernels']} | {r['kernels'] / base['kernels']:.2f} | "
          f"{r['reductions']} | {r['bytes'] / 2**30:.3f} | {s / 2**30:.3f} | "
          f"{s / base_sliced:.2f} |")


if __name__ == "__main__":
  main()
