"""Tree helpers the rooms share: key paths as strings, shapes, and optimizer states.

* `path_str`: a key path as the ``/``-joined string every grouping of leaves reads
  (norm groups, parameter groups, the precision policy's float32 names, layouts).
* `shapes`: a tree of arrays as ``jax.ShapeDtypeStruct`` leaves.
* Reading an optimizer state: the loss scale, the metrics and the train step read
  mpscale's wrapper states from wherever they sit in an
  ``optax.chain``/``inject_hyperparams`` state tree; `find` and `find_all` find them
  (with ``optax.tree_utils``), `plain` accepts a Flax NNX optimizer too, and
  `learning_rate` reads the outermost learning rate.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

KeyPath = tuple[Any, ...]
"""A key path, as ``jax.tree_util.tree_flatten_with_path`` gives it."""


def path_str(path: KeyPath) -> str:
  """A key path as a ``/``-joined string, e.g. ``"encoder/layer_0/kernel"``
  (``jax.tree_util.keystr`` in its simple form)."""
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def shapes(tree: Any) -> Any:
  """``tree`` with every leaf a ``jax.ShapeDtypeStruct`` of its shape and dtype."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def nnx_module():
  """flax.nnx if the program has imported it, else None (then no NNX object exists)."""
  return sys.modules.get("flax.nnx")


def plain(opt_state: Any) -> Any:
  """``opt_state`` as plain arrays: a Flax NNX ``nnx.Optimizer`` gives its state, and
  NNX ``Variable`` wrappers (``nnx.OptArray``, ``nnx.OptState``) give their values;
  anything else is returned as it is."""
  nnx = nnx_module()
  if nnx is None:
    return opt_state
  if isinstance(opt_state, nnx.Optimizer):
    opt_state = opt_state.opt_state
  is_var = lambda x: isinstance(x, nnx.Variable)

  def unwrap(x):
    if not is_var(x):
      return x
    return x.get_value() if hasattr(x, "get_value") else x.value
  return jax.tree_util.tree_map(unwrap, opt_state, is_leaf=is_var)


def find_all(opt_state: Any, kind: type) -> list[tuple[Any, Any]]:
  """``(key_path, state)`` of every ``kind`` NamedTuple in ``opt_state`` (itself
  included), outermost first."""
  if isinstance(opt_state, kind):
    return [((), opt_state)] + find_all(tuple(opt_state), kind)
  found = optax.tree_utils.tree_get_all_with_path(
      opt_state, kind.__name__, lambda _, x: isinstance(x, kind))
  return sorted(found, key=lambda path_state: len(path_state[0]))


def find(opt_state: Any, kind: type) -> list[Any]:
  """Every ``kind`` NamedTuple in ``opt_state``, outermost first."""
  return [state for _, state in find_all(opt_state, kind)]


def learning_rate(opt_state: Any) -> Any:
  """The outermost learning rate in ``opt_state``, as float32: an
  ``optax.inject_hyperparams`` hyperparameter or a state field named
  ``learning_rate`` (`mpscale.came`'s, `mpscale.param_groups`'); ``None`` if none."""
  found = optax.tree_utils.tree_get_all_with_path(
      opt_state, "learning_rate", lambda _, x: not isinstance(x, tuple))
  if not found:
    return None
  _, lr = min(found, key=lambda path_value: len(path_value[0]))
  return jnp.asarray(lr, jnp.float32)
