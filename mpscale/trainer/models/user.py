"""A user's model for the trainer: Flax NNX, Flax linen, or plain ``(init, loss_fn)``.

The trainer trains a `Model`: ``init(key) -> params`` (float32) and ``loss_fn(params,
batch)``. `as_model` makes one from what a user has:

- a **Flax NNX module** (built, with its parameters): its ``nnx.Param`` state, as a
  plain nested dict, is the parameters (`from_nnx`); every other variable except its
  RNG streams (``nnx.BatchStat``, any variable the forward pass updates) is the model
  state, and the module's RNG streams are re-keyed from the run's key each step (so
  ``nnx.Dropout`` draws fresh masks). Each call of the loss merges them into the
  module (``nnx.split``/``nnx.merge``) in training mode (``model.train()``);
  evaluation runs it in ``model.eval()`` mode (no dropout, running averages);
- a **Flax linen module**: initialized by running the loss on the first batch
  (``module.init(key, batch, method=...)``), so any call signature works
  (`from_linen`); ``params`` are the parameters, every other collection
  (``batch_stats``) the model state, updated with ``mutable=``, and the ``dropout``
  stream is keyed from the run's key. A loss that takes ``train`` is called with
  ``train=True`` in training and ``train=False`` in evaluation (for
  ``nn.Dropout(deterministic=not train)``, ``nn.BatchNorm(use_running_average=not
  train)``);
- a **`Model`** built by hand, whose ``loss_fn`` may be a `mpscale.Pipeline` (then
  ``evaluate`` gives the unpipelined loss for evaluation), with ``init_state`` for
  a model state and ``stochastic`` for a key.

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
import re
import sys
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from mpscale import validation
from mpscale import parallel as parallel_lib
from mpscale import precision as precision_lib


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
    evaluate: ``evaluate(params, batch)`` like ``loss_fn``, for evaluation (with a
      model state ``evaluate(params, batch, model_state=...)``, returning no new
      state: inference mode); default ``loss_fn`` (required when that is a
      `mpscale.Pipeline`, or when the model has a state or a key).
    init_state: ``init_state(key) -> model_state``, a pytree of arrays the forward
      pass updates (BatchNorm statistics); ``loss_fn`` is then called as
      ``loss_fn(params, batch, model_state=...)`` and returns ``(loss, new_state)``.
      ``None``: no model state.
    stochastic: ``loss_fn`` draws random numbers (dropout) and takes ``rng=``, a key
      that differs by step, micro-batch and data replica (`mpscale.make_train_step`).
    metrics: ``metrics(params, batch[, model_state=...]) -> {name: (sum, count)}``,
      evaluated beside the loss on the evaluation batches (inference mode); each is
      logged as ``eval_<name>`` = total sum / total count. ``None``: the loss only.
    export: ``export(params, model_state) -> `` the trained model as the user passed
      it (an NNX module, linen variables); what `mpscale.trainer.load` returns.
      ``None``: ``params``, or ``(params, model_state)`` with a model state.
  """
  init: Callable[[jax.Array], Any]
  loss_fn: Any
  param_specs: Any = None
  evaluate: Optional[Callable[..., Any]] = None
  init_state: Optional[Callable[[jax.Array], Any]] = None
  stochastic: bool = False
  metrics: Optional[Callable[..., Any]] = None
  export: Optional[Callable[[Any, Any], Any]] = None


def per_token(out: Any) -> tuple[jax.Array, jax.Array]:
  """A loss output as ``(loss_sum, num_tokens)``: a pair as it is, a scalar mean as
  ``(mean, 1)``."""
  if isinstance(out, (tuple, list)) and len(out) == 2:
    return out[0], jnp.asarray(out[1], jnp.float32)
  return out, jnp.ones((), jnp.float32)


def _per_token_fn(fn: Callable[..., Any], stateful: bool = False
                 ) -> Callable[..., Any]:
  """``fn`` with its loss output as ``(loss_sum, num_tokens)`` (and, when
  ``stateful``, the new model state beside it)."""
  if not stateful:
    return lambda params, batch, **kw: per_token(fn(params, batch, **kw))

  def wrapped(params, batch, **kw):
    out, new_state = fn(params, batch, **kw)
    return per_token(out), new_state
  return wrapped


def _loss_of(loss: Any, key: str) -> Callable[[Any, Any], Any]:
  if not callable(loss):
    raise validation.fail(key, ": a Flax module needs a loss, loss(model, batch) -> "
                          f"(loss_sum, num_tokens) or a mean; got {loss!r}",
                          validation.ArgumentTypeError)
  _check_takes_model_and_batch(loss, key, "loss")
  return loss


def _check_takes_model_and_batch(fn: Callable[..., Any], key: str, what: str) -> None:
  """Refuses a ``fn`` that cannot be called as ``what(model, batch)`` (another
  function named by mistake), naming ``key``: called in the step, it would fail
  there, as if the batches did not fit the model."""
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # a builtin without a signature
    return
  try:  # a linen loss taking train is called with it (`_mode_call`)
    signature.bind(None, None, **({"train": True} if "train" in signature.parameters
                                   else {}))
  except TypeError as e:
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    raise validation.fail(key, f": {name}{signature} cannot be called as "
                          f"{what}(model, batch): {e}",
                          validation.ArgumentTypeError) from None


def _takes_train(fn: Callable[..., Any]) -> bool:
  """Whether ``fn`` has a ``train`` parameter."""
  try:
    return "train" in inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False


def _mode_call(fn: Callable[..., Any], train: bool) -> Callable[[Any, Any], Any]:
  """``fn(model, batch)``, with ``train=`` when ``fn`` takes it."""
  if _takes_train(fn):
    return lambda model, batch: fn(model, batch, train=train)
  return fn


def _metrics_values(out: Any, key: str) -> dict[str, tuple[jax.Array, jax.Array]]:
  """A metric function's output as ``{name: (sum, count)}`` (a value alone counts
  once)."""
  if not isinstance(out, dict):
    raise validation.fail(key, ": metrics(model, batch) must return a dict of name -> "
                          f"(sum, count); got {type(out).__name__}",
                          validation.ArgumentTypeError)
  return {name: per_token(value) for name, value in out.items()}


def from_nnx(module: Any, loss: Callable[[Any, Any], Any],
             metrics: Optional[Callable[[Any, Any], Any]] = None) -> Model:
  """A `Model` of a built Flax NNX module.

  Its ``nnx.Param`` values are the params (a nested dict); its other variables but
  the RNG streams (``nnx.BatchStat`` and any variable its forward pass updates) are
  the model state, float32 in the `TrainState`. Training runs ``loss(module, batch)``
  on the module merged from them in ``module.train()`` mode, with every RNG stream's
  key replaced by ``fold_in(rng, i)`` of the step's key (stream ``i`` in the state's
  order; counts from 0), and returns the variables it updated as the new state.
  Evaluation and ``metrics`` run in ``module.eval()`` mode. ``export`` puts trained
  params and state into ``module`` and returns it in eval mode. FP8 products'
  scaling state (`mpscale.precision.fp8_flax.OverwriteWithGradient` variables) goes in the
  state's ``_overwrite_with_gradient`` collection, which the step overwrites with
  its gradient (`mpscale.make_train_step`); the loss returns it as given.
  """
  from flax import nnx  # noqa: PLC0415
  from mpscale.precision import fp8_flax as fp8_flax  # noqa: PLC0415
  graphdef, params, rngs, fp8_vars, rest = nnx.split(
      module, nnx.Param, nnx.RngState, fp8_flax.OverwriteWithGradient, ...)
  values = nnx.to_pure_dict(params)
  fp8_values = nnx.to_pure_dict(fp8_vars)
  has_fp8 = bool(jax.tree_util.tree_leaves(fp8_values))
  state_values = nnx.to_pure_dict(rest)
  if has_fp8:
    state_values = {**state_values, precision_lib.OVERWRITE_WITH_GRADIENT: fp8_values}
  stateful = bool(jax.tree_util.tree_leaves(state_values))

  def split_state(model_state):
    """``(the other variables' pure dict, the FP8 state's)``."""
    rest_values = dict(model_state)
    return rest_values, rest_values.pop(precision_lib.OVERWRITE_WITH_GRADIENT, None)
  stochastic = bool(jax.tree_util.tree_leaves(rngs))

  def fill(like, pure):
    state = jax.tree_util.tree_map(lambda x: x, like)  # a fresh State to fill
    nnx.replace_by_pure_dict(state, pure)
    return state

  def keyed(rng):
    """The RNG streams with keys from ``rng`` and counts from 0."""
    leaves, treedef = jax.tree_util.tree_flatten(rngs)
    new = []
    for i, leaf in enumerate(leaves):
      if rng is not None and jnp.issubdtype(jnp.result_type(leaf), jax.dtypes.prng_key):
        leaf = jax.random.fold_in(rng, i)
      elif rng is not None:
        leaf = jnp.zeros_like(leaf)
      new.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, new)

  def merged(p, model_state, rng, train):
    state, fp8_state = rest, fp8_vars
    if stateful:
      rest_values, fp8_pure = split_state(model_state)
      state = fill(rest, rest_values)
      if has_fp8:
        fp8_state = fill(fp8_vars, fp8_pure)
    m = nnx.merge(graphdef, fill(params, p), keyed(rng), fp8_state, state)
    if train:
      m.train()
    else:
      m.eval()
    return m

  def loss_fn(p, batch, rng=None, model_state=None):
    m = merged(p, model_state, rng, train=True)
    out = per_token(loss(m, batch))
    if not stateful:
      return out
    new = nnx.to_pure_dict(nnx.split(m, nnx.Param, nnx.RngState,
                                     fp8_flax.OverwriteWithGradient, ...)[4])
    if has_fp8:  # as given: its gradient is its update
      new[precision_lib.OVERWRITE_WITH_GRADIENT] = split_state(model_state)[1]
    return out, new

  def evaluate(p, batch, model_state=None):
    return per_token(loss(merged(p, model_state, None, train=False), batch))

  def metrics_fn(p, batch, model_state=None):
    return _metrics_values(metrics(merged(p, model_state, None, train=False), batch),
                           "model.metrics")

  def export(p, model_state):
    states = []
    if stateful:
      rest_values, fp8_pure = split_state(model_state)
      states = [fill(rest, rest_values)] + ([fill(fp8_vars, fp8_pure)] if has_fp8
                                            else [])
    nnx.update(module, fill(params, p), *states)
    module.eval()
    return module

  return Model(init=lambda key: values, loss_fn=loss_fn, evaluate=evaluate,
               init_state=(lambda key: state_values) if stateful else None,
               stochastic=stochastic,
               metrics=metrics_fn if metrics is not None else None, export=export)


_UNBOUND = re.compile(r"unbound axis name: ([^\s.,'\"]+)")
_MAX_AXIS_NAMES = 8


def unbound_axis_name(error: BaseException) -> Optional[str]:
  """The axis name of a ``NameError`` JAX raises for a collective over an axis no
  transformation binds (``Found an unbound axis name: batch``), else ``None``."""
  m = _UNBOUND.search(str(error)) if isinstance(error, NameError) else None
  return m.group(1) if m else None


def with_axis_names(fn: Callable[..., Any], names: tuple[str, ...]
                   ) -> Callable[..., Any]:
  """``fn`` with each of ``names`` bound as a mapped axis of size 1.

  A model written for ``pmap`` names its batch axis in its collectives (Flax's
  ``nn.BatchNorm(axis_name="batch")`` averages its statistics with ``lax.pmean``
  over it). Under ``jit`` the batch is already the global one, so that axis has one
  member: binding it (a ``jax.vmap`` of size 1, nothing mapped) makes each such
  collective the identity and leaves the numbers those of the whole batch, as
  ``pmap`` with the axis over every device computes them.
  """
  if not names:
    return fn

  def bound(*args: Any, **kwargs: Any) -> Any:
    call = lambda: fn(*args, **kwargs)  # noqa: E731
    for name in names:
      call = _one_member(call, name)
    return call()
  return bound


def _one_member(call: Callable[[], Any], name: str) -> Callable[[], Any]:
  def mapped():
    out = jax.vmap(call, axis_size=1, axis_name=name)()
    return jax.tree_util.tree_map(lambda x: x[0], out)
  return mapped


def _binding_axis_names(run: Callable[[tuple[str, ...]], Any], key: str
                       ) -> tuple[Any, tuple[str, ...]]:
  """``(run(names), names)``: ``run`` with the axis names its model's collectives
  need (`with_axis_names`), found by running it until none is unbound.

  Raises:
    TypeError: naming ``key``, for a model that still fails on an axis name.
  """
  names: tuple[str, ...] = ()
  while True:
    try:
      return run(names), names
    except NameError as e:
      name = unbound_axis_name(e)
      if name is None or name in names or len(names) >= _MAX_AXIS_NAMES:
        raise validation.fail(
            key, f": the model's collectives name axes no transformation binds "
            f"({e}); a model written for pmap is supported where each named axis "
            "is its batch axis (its statistics then cover the global batch)",
            validation.ArgumentTypeError) from None
      names += (name,)


def from_linen(module: Any, loss: Callable[..., Any], example_batch: Any,
               seed: int = 0, metrics: Optional[Callable[..., Any]] = None,
               rng_streams: tuple[str, ...] = ("dropout",)) -> Model:
  """A `Model` of a Flax linen module, initialized here from ``seed`` by running
  ``loss(module, example_batch)`` on it (so any call signature works).

  ``params`` are the parameters; every other collection (``batch_stats``) is the
  model state, updated in training (``mutable=``). Each of ``rng_streams`` gets a key
  of the step's (``fold_in(rng, i)``). A loss (and ``metrics``) taking ``train`` is
  called with ``train=True`` in training and ``train=False`` in evaluation. ``export``
  gives the variables, ``{"params": ..., **model_state}``.
  """
  train_loss, eval_loss = _mode_call(loss, True), _mode_call(loss, False)
  method = lambda m, batch: train_loss(m, batch)  # noqa: E731
  key = jax.random.key(seed)
  init_rngs = {"params": key, **{name: jax.random.fold_in(key, i + 1)
                                 for i, name in enumerate(rng_streams)}}
  # A pmap-era module (BatchNorm(axis_name="batch")) gets its axes bound.
  variables, names = _binding_axis_names(lambda names: dict(with_axis_names(
      module.init, names)(init_rngs, example_batch, method=method)), "model.provider")
  params = variables.pop("params", {})
  state_values = variables
  stateful = bool(jax.tree_util.tree_leaves(state_values))

  def rngs_of(rng):
    return {name: jax.random.fold_in(rng, i) for i, name in enumerate(rng_streams)}

  def loss_fn(p, batch, rng=None, model_state=None):
    rngs = rngs_of(rng) if rng is not None else None
    if not stateful:
      return per_token(module.apply({"params": p}, batch, method=method, rngs=rngs))
    out, updated = module.apply({"params": p, **model_state}, batch, method=method,
                                rngs=rngs, mutable=list(model_state))
    return per_token(out), {**model_state, **updated}

  def apply_eval(fn, p, batch, model_state):
    return module.apply({"params": p, **(model_state or {})}, batch,
                        method=lambda m, b: fn(m, b))

  def evaluate(p, batch, model_state=None):
    return per_token(apply_eval(eval_loss, p, batch, model_state))

  def metrics_fn(p, batch, model_state=None):
    return _metrics_values(apply_eval(_mode_call(metrics, False), p, batch,
                                      model_state), "model.metrics")

  return Model(init=lambda key: params, loss_fn=with_axis_names(loss_fn, names),
               evaluate=with_axis_names(evaluate, names),
               init_state=(lambda key: state_values) if stateful else None,
               stochastic=bool(rng_streams),
               metrics=with_axis_names(metrics_fn, names) if metrics is not None else None,
               export=lambda p, model_state: {"params": p, **(model_state or {})})


def as_model(obj: Any, loss: Any = None, example_batch: Any = None,
             key: str = "model", seed: int = 0, metrics: Any = None) -> Model:
  """``obj`` as a `Model`: an NNX module or a linen module (with ``loss``; a linen
  module is initialized on ``example_batch`` from ``seed``), or a `Model` (``loss``
  must then be ``None``). ``metrics``: a Flax module's metric function,
  ``metrics(model, batch) -> {name: (sum, count)}``.

  Raises:
    TypeError: naming ``key``, for anything else, or a module without a loss.
  """
  if metrics is not None and not callable(metrics):
    raise validation.fail(
        key.replace("provider", "metrics"), ": expected a function, metrics(model, "
        f"batch) -> {{name: (sum, count)}}; got {metrics!r}",
        validation.ArgumentTypeError)
  if metrics is not None:
    _check_takes_model_and_batch(metrics, key.replace("provider", "metrics"),
                                 "metrics")
  if isinstance(obj, Model):
    if loss is not None:
      raise validation.fail(key, ": gave a Model, which has its own loss_fn, and a "
                            "loss as well; drop one", validation.ArgumentTypeError)
    stateful = obj.init_state is not None
    if isinstance(obj.loss_fn, parallel_lib.Pipeline):
      if obj.evaluate is None:
        raise validation.fail(
            key, ": a Model whose loss_fn is an mpscale.Pipeline needs evaluate="
            "(params, batch) -> (loss_sum, num_tokens) too",
            validation.ArgumentTypeError)
      if stateful:
        raise validation.fail(
            key, ": a Model whose loss_fn is an mpscale.Pipeline has no model state "
            "(init_state must be None)", validation.ArgumentTypeError)
      return obj._replace(evaluate=_per_token_fn(obj.evaluate))
    if not (callable(obj.init) and callable(obj.loss_fn)):
      raise validation.fail(key, ": Model(init, loss_fn) needs two functions; got "
                            f"{obj.init!r}, {obj.loss_fn!r}",
                            validation.ArgumentTypeError)
    if obj.evaluate is None and (stateful or obj.stochastic):
      raise validation.fail(
          key, ": a Model with init_state or stochastic=True needs evaluate=(params, "
          "batch[, model_state=...]) -> (loss_sum, num_tokens) too: evaluation runs in "
          "inference mode", validation.ArgumentTypeError)
    loss_fn = _per_token_fn(obj.loss_fn, stateful)
    evaluate = _per_token_fn(obj.evaluate) if obj.evaluate is not None else loss_fn
    user_metrics = obj.metrics
    if user_metrics is not None:
      obj = obj._replace(metrics=lambda p, batch, **kw: _metrics_values(
          user_metrics(p, batch, **kw), f"{key}: Model.metrics"))
    return obj._replace(loss_fn=loss_fn, evaluate=evaluate)
  nnx = sys.modules.get("flax.nnx")
  if nnx is not None and isinstance(obj, nnx.Module):
    model = from_nnx(obj, _loss_of(loss, key.replace("provider", "loss")), metrics)
    if example_batch is None or not _names_axes(nnx, obj):
      return model
    # A pmap-era module gets the axes its collectives name bound (with_axis_names).
    return _binding_axis_names(lambda names: _probed(model, names, example_batch),
                               key)[0]
  linen = sys.modules.get("flax.linen")
  if linen is not None and isinstance(obj, linen.Module):
    model = from_linen(obj, _loss_of(loss, key.replace("provider", "loss")),
                       example_batch, seed, metrics)
    # Linen skips its collectives while initializing: the training loss tells.
    return _binding_axis_names(lambda names: _probed(model, names, example_batch),
                               key)[0]
  raise validation.fail(key, ": expected a flax.nnx.Module, a flax.linen.Module or an "
                        f"mpscale.trainer.Model; got {type(obj).__module__}."
                        f"{type(obj).__qualname__}", validation.ArgumentTypeError)


def _names_axes(nnx: Any, module: Any) -> bool:
  """Whether some submodule of an NNX ``module`` names a mapped axis (an
  ``axis_name`` such as ``nnx.BatchNorm``'s)."""
  return any(getattr(node, "axis_name", None) is not None
             for _, node in nnx.iter_graph(module) if isinstance(node, nnx.Module))


def _probed(model: Model, names: tuple[str, ...], batch: Any) -> Model:
  """``model`` with ``names`` bound (`with_axis_names`), once its training loss
  traces on ``batch`` (shapes only)."""
  if names:
    model = model._replace(
        loss_fn=with_axis_names(model.loss_fn, names),
        evaluate=with_axis_names(model.evaluate, names),
        metrics=None if model.metrics is None else with_axis_names(model.metrics, names))
  kwargs: dict[str, Any] = {}
  if model.init_state is not None:
    kwargs["model_state"] = model.init_state(None)
  if model.stochastic:
    kwargs["rng"] = jax.random.key(0)
  jax.eval_shape(lambda p, b, kw: model.loss_fn(p, b, **kw), model.init(None), batch,
                 kwargs)
  return model


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
    raise validation.fail(key, ": expected 'package.module:attribute' or "
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
    raise validation.fail(key, f": cannot import {module_name!r}: "
                          f"{type(e).__name__}: {e}") from None
  obj = module
  for part in attribute.split("."):
    if not hasattr(obj, part):
      raise validation.fail(key, f": {module_name!r} has no attribute {attribute!r}")
    obj = getattr(obj, part)
  return obj


def call_provider(provider: Any, cfg: Any, key: str) -> Any:
  """``provider(cfg)`` (or ``provider()`` for one that takes no argument), with an
  exception it raises re-raised as a ``ValueError`` naming ``key``."""
  if not callable(provider):
    raise validation.fail(key, ": expected a function, provider(config) -> ...; got "
                          f"{provider!r}", validation.ArgumentTypeError)
  try:
    takes_config = bool(inspect.signature(provider).parameters)
  except (TypeError, ValueError):  # a builtin without a signature
    takes_config = True
  try:
    return provider(cfg) if takes_config else provider()
  except Exception as e:  # the user's code may raise anything
    raise validation.fail(key, f": {getattr(provider, '__name__', provider)} raised "
                          f"{type(e).__name__}: {e}") from None
