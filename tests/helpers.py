"""Plain helpers shared by several test modules (fixtures live in conftest.py)."""

import importlib.util
import os
import re
import socket

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax


def bits(tree):
  """Every leaf of ``tree`` as its bytes: equal trees of bits are equal bit for bit."""
  return jax.tree.map(lambda x: np.asarray(x).tobytes(), tree)


def assert_close(a, b, tol):
  """``a`` and ``b`` agree leaf by leaf to ``tol`` (relative and absolute)."""
  chex.assert_trees_all_close(a, b, rtol=tol, atol=tol)


def big_copies(hlo: str, min_size: int = 1024) -> list[str]:
  """The copy instructions in compiled HLO text that copy an array of >= min_size."""
  found = []
  for m in re.finditer(r"= \w+\[([\d,]*)\][^=\n]*? copy\(", hlo):
    dims = [int(d) for d in m.group(1).split(",") if d]
    if dims and np.prod(dims) >= min_size:
      found.append(m.group(0))
  return found


def free_port() -> int:
  """A TCP port on localhost that nothing listens on now (for a coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def steps_saved(run_dir) -> list[int]:
  """The steps of the finished checkpoints in a run folder (orbax's step folders)."""
  ckpt = os.path.join(run_dir, "checkpoints")
  return sorted(int(d) for d in os.listdir(ckpt) if d.isdigit()) if os.path.isdir(
      ckpt) else []


def recording_inner():
  """An inner transformation that records the extra arguments its ``update`` gets:
  ``(transformation, seen)``."""
  seen = {}

  def update(updates, state, params=None, **extra):
    seen.update(extra)
    return updates, state

  return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(),
                                               update), seen


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(*path: str):
  """A script that is not a package module (``docs/plan_table.py``,
  ``tests/data/make_came_reference.py``), imported from its path under the
  repository's root."""
  full = os.path.join(ROOT, *path)
  name = os.path.splitext(os.path.basename(full))[0]
  spec = importlib.util.spec_from_file_location(name, full)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def sub_jaxprs(params):
  """The jaxprs in an equation's params (``jax.extend.core.jaxprs_in_params`` is
  newer than jax 0.7)."""
  for value in params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if hasattr(v, "eqns"):
        yield v
      elif hasattr(getattr(v, "jaxpr", None), "eqns"):
        yield v.jaxpr


def kept_bytes(loss, params) -> int:
  """The bytes ``jax.vjp`` of ``loss(params)`` keeps for its backward, beyond its
  arguments (traced only)."""
  residuals = jax._src.ad_checkpoint.saved_residuals(loss, params)  # pylint: disable=protected-access
  return sum(aval.size * aval.dtype.itemsize for aval, source in residuals
             if "argument" not in source)


def residuals_are_named() -> bool:
  """Whether this JAX names a ``checkpoint_name``d residual in ``saved_residuals``
  (jax 0.7 reads it as the ``reduce_precision`` it binds)."""
  def f(x):
    return jax.numpy.sum(jax.ad_checkpoint.checkpoint_name(jax.numpy.sin(x), "probe"))
  return saved_names(jax.checkpoint(
      f, policy=jax.checkpoint_policies.save_only_these_names("probe")),
      jax.numpy.ones(2)) == {"probe"}


def saved_names(loss, *args) -> set:
  """The ``checkpoint_name`` names of what ``jax.vjp`` of ``loss(*args)`` keeps."""
  residuals = jax._src.ad_checkpoint.saved_residuals(loss, *args)  # pylint: disable=protected-access
  return {m.group(1) for _, source in residuals
          for m in [re.search(r"named '([^']+)'", source)] if m}


def tiny_mlp(hidden: int):
  """``(loss, params, batch)``: a two-layer MLP from 5 features through ``hidden``
  units to 2 outputs, and a batch of 12 rows (a problem whose dimensions a mesh
  axis may or may not divide)."""
  def loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)
  k = jax.random.split(jax.random.key(0), 4)
  params = {"w1": jax.random.normal(k[0], (5, hidden)), "b1": jnp.full((hidden,), 0.1),
            "w2": jax.random.normal(k[1], (hidden, 2))}
  batch = {"x": jax.random.normal(k[2], (12, 5)), "y": jax.random.normal(k[3], (12, 2))}
  return loss, params, batch
