"""A user's model for the trainer: Flax NNX, Flax linen, or plain ``(init, loss_fn)``.

The trainer trains a `Model`: ``init(key) -> params`` (float32) and ``loss_fn(params,
batch)``. `as_model` makes one from what a user has:

- a **Flax NNX module** (built, with its parameters): its ``nnx.Param`` state, as a
  plain nested dict, is the parameters (`from_nnx`); each call of the loss merges
  them back into the module (``nnx.split``/``nnx.merge``). Its other state (batch
  statistics, RNG counters) is held fixed: train deterministic modules;
- a **Flax linen module**: initialized by running the loss on the first batch
  (``module.init(key, batch, method=...)``), so any call signature works (`from_linen`);
- a **`Model`** built by hand, whose ``loss_fn`` may be a `mpscale.Pipeline` (then
  ``evaluate`` gives the unpipelined loss for evaluation).

For NNX and linen, the loss is ``loss(model, batch)``: it calls the model (the NNX
module, or the bound linen module) on the batch and returns ``(loss_sum, num_tokens)``
(a per-token loss) or a scalar mean (counted as one token per batch).

A config names them by ``"package.module:attribute"`` or ``"file.py:attribute"``
(`load_object`): ``model.provider`` (called with the `RunConfig`, it returns any of the
above) and ``model.loss``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from mpscale import pipeline as pipeline_lib


class Model(NamedTuple):
  """A model the trainer can train.

  Attributes:
    init: ``init(key) -> params``, float32 parameters (an adapted Flax module's
      ignores the key: the module is initialized already).
    loss_fn: ``loss_fn(params, batch) -> (loss_sum, num_tokens)`` or a scalar mean, or
      a `mpscale.Pipeline` (needs ``mesh.stage`` > 1).
    param_specs: the parameters' layout for ``mesh.tensor`` or ``mesh.stage``: what
      `mpscale.make_train_step` takes as ``param_specs``, or a function ``mesh ->``
      that. ``None``: replicated (FSDP, ``mesh.fsdp``, is added by the trainer).
    evaluate: ``evaluate(params, batch)`` like ``loss_fn``, for evaluation; default
      ``loss_fn`` (required when that is a `mpscale.Pipeline`).
  """
  init: Callable[[jax.Array], Any]
  loss_fn: Any
  param_specs: Any = None
  evaluate: Optional[Callable[[Any, Any], Any]] = None


def per_token(out: Any) -> tuple[jax.Array, jax.Array]:
  """A loss output as ``(loss_sum, num_tokens)``: a pair as it is, a scalar mean as
  ``(mean, 1)``."""
  if isinstance(out, (tuple, list)) and len(out) == 2:
    return out[0], jnp.asarray(out[1], jnp.float32)
  return out, jnp.ones((), jnp.float32)


def _per_token_fn(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
  return lambda params, batch: per_token(fn(params, batch))


def _loss_of(loss: Any, key: str) -> Callable[[Any, Any], Any]:
  if not callable(loss):
    raise TypeError(f"{key}: a Flax module needs a loss, loss(model, batch) -> "
                    f"(loss_sum, num_tokens) or a mean; got {loss!r}")
  return loss


def from_nnx(module: Any, loss: Callable[[Any, Any], Any]) -> Model:
  """A `Model` of a built Flax NNX module: its ``nnx.Param`` values are the params
  (a nested dict); ``loss(module, batch)`` runs on the module with them merged in."""
  from flax import nnx  # noqa: PLC0415
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  values = nnx.to_pure_dict(params)

  def loss_fn(p, batch):
    state = jax.tree_util.tree_map(lambda x: x, params)  # a fresh State to fill
    nnx.replace_by_pure_dict(state, p)
    return per_token(loss(nnx.merge(graphdef, state, rest), batch))

  return Model(init=lambda key: values, loss_fn=loss_fn)


def from_linen(module: Any, loss: Callable[[Any, Any], Any], example_batch: Any,
               seed: int = 0) -> Model:
  """A `Model` of a Flax linen module, initialized here from ``seed`` by running
  ``loss(module, example_batch)`` on it (so any call signature works): its ``params``
  are the parameters; other collections are held fixed."""
  method = lambda m, batch: loss(m, batch)  # noqa: E731
  variables = dict(module.init(jax.random.key(seed), example_batch, method=method))
  params = variables.pop("params", {})

  def loss_fn(p, batch):
    return per_token(module.apply({"params": p, **variables}, batch, method=method))

  return Model(init=lambda key: params, loss_fn=loss_fn)


def as_model(obj: Any, loss: Any = None, example_batch: Any = None,
             key: str = "model", seed: int = 0) -> Model:
  """``obj`` as a `Model`: an NNX module or a linen module (with ``loss``; a linen
  module is initialized on ``example_batch`` from ``seed``), or a `Model` (``loss``
  must then be ``None``).

  Raises:
    TypeError: naming ``key``, for anything else, or a module without a loss.
  """
  if isinstance(obj, Model):
    if loss is not None:
      raise TypeError(f"{key}: gave a Model, which has its own loss_fn, and a loss "
                      "as well; drop one")
    if isinstance(obj.loss_fn, pipeline_lib.Pipeline):
      if obj.evaluate is None:
        raise TypeError(f"{key}: a Model whose loss_fn is an mpscale.Pipeline needs "
                        "evaluate=(params, batch) -> (loss_sum, num_tokens) too")
      return obj._replace(evaluate=_per_token_fn(obj.evaluate))
    if not (callable(obj.init) and callable(obj.loss_fn)):
      raise TypeError(f"{key}: Model(init, loss_fn) needs two functions; got "
                      f"{obj.init!r}, {obj.loss_fn!r}")
    loss_fn = _per_token_fn(obj.loss_fn)
    evaluate = _per_token_fn(obj.evaluate) if obj.evaluate is not None else loss_fn
    return obj._replace(loss_fn=loss_fn, evaluate=evaluate)
  nnx = sys.modules.get("flax.nnx")
  if nnx is not None and isinstance(obj, nnx.Module):
    model = from_nnx(obj, _loss_of(loss, key.replace("provider", "loss")))
    return model._replace(evaluate=model.loss_fn)
  linen = sys.modules.get("flax.linen")
  if linen is not None and isinstance(obj, linen.Module):
    model = from_linen(obj, _loss_of(loss, key.replace("provider", "loss")),
                       example_batch, seed)
    return model._replace(evaluate=model.loss_fn)
  raise TypeError(f"{key}: expected a flax.nnx.Module, a flax.linen.Module or an "
                  f"mpscale.trainer.Model; got {type(obj).__module__}."
                  f"{type(obj).__qualname__}")


def load_object(spec: str, key: str) -> Any:
  """The object ``spec`` names: ``"package.module:attribute"`` (imported with the
  working directory on ``sys.path``, as ``python -m`` would) or
  ``"path/to/file.py:attribute"``; the attribute may be dotted.

  Raises:
    ValueError: naming ``key``, when the spec is malformed, the module cannot be
      imported (with its error), or it has no such attribute.
  """
  module_name, sep, attribute = spec.rpartition(":")
  if not sep or not module_name or not attribute:
    raise ValueError(f"{key}: expected 'package.module:attribute' or "
                     f"'file.py:attribute'; got {spec!r}")
  try:
    if module_name.endswith(".py") or os.sep in module_name:
      path = os.path.abspath(module_name)
      name = "_mpscale_provider_" + os.path.splitext(os.path.basename(path))[0]
      if not os.path.exists(path):
        raise FileNotFoundError(f"no file {path}")
      module_spec = importlib.util.spec_from_file_location(name, path)
      module = importlib.util.module_from_spec(module_spec)
      sys.modules[name] = module
      # The file's folder is importable too, as it is for `python file.py`.
      sys.path.insert(0, os.path.dirname(path))
      try:
        module_spec.loader.exec_module(module)
      finally:
        sys.path.remove(os.path.dirname(path))
    else:
      if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
      module = importlib.import_module(module_name)
  except Exception as e:  # the user's module may raise anything on import
    raise ValueError(f"{key}: cannot import {module_name!r}: {type(e).__name__}: "
                     f"{e}") from None
  obj = module
  for part in attribute.split("."):
    if not hasattr(obj, part):
      raise ValueError(f"{key}: {module_name!r} has no attribute {attribute!r}")
    obj = getattr(obj, part)
  return obj


def call_provider(provider: Any, cfg: Any, key: str) -> Any:
  """``provider(cfg)`` (or ``provider()`` for one that takes no argument), with an
  exception it raises re-raised as a ``ValueError`` naming ``key``."""
  if not callable(provider):
    raise TypeError(f"{key}: expected a function, provider(config) -> ...; got "
                    f"{provider!r}")
  try:
    takes_config = bool(inspect.signature(provider).parameters)
  except (TypeError, ValueError):  # a builtin without a signature
    takes_config = True
  try:
    return provider(cfg) if takes_config else provider()
  except Exception as e:  # the user's code may raise anything
    raise ValueError(f"{key}: {getattr(provider, '__name__', provider)} raised "
                     f"{type(e).__name__}: {e}") from None
