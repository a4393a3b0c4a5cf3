"""Parameter groups: one optimizer, with its own learning rate and weight decay per group.

Each group is a `ParamGroup`: the leaves whose key path it matches (a regular
expression searched in the path ``"blocks/attn/wq"``, or a predicate), and what they
get instead of the defaults: a learning-rate multiplier (Megatron's ``lr_mult``) or a
learning rate of their own (a mindformers group's ``lr``), a weight decay (Megatron's
``no_wd_decay_cond`` is ``weight_decay=0``), and any other keyword of the optimizer.
A leaf belongs to the first group that matches it; the rest form the group
``"default"``. `param_groups` builds one optimizer per group from a factory and runs
each on its own leaves (``optax.partition``), so a group is exactly the optimizer the
factory makes with its settings, run on its leaves alone::

  labels = first group matching each leaf's path, else "default"
  for name, group in groups + [default]:
    tx[name] = optimizer(learning_rate=lr * group.lr_mult, weight_decay=group.wd,
                         **group.options)      # optax.set_to_zero() for lr_mult 0
  updates = partition(tx, labels).update(grads, ...)

Only per-leaf optimizers can be split so (AdamW, Adafactor, CAME, SGD: each leaf's
update reads that leaf alone); a global clip belongs outside, around the groups
(``optax.chain(mpscale.global_norm_clip(1.0), param_groups(...))``), where it sees
every leaf.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax

from mpscale import _tree
from mpscale import validation

ScalarOrSchedule = Union[float, Callable[[jax.Array], jax.Array]]
Match = Union[str, Callable[[str, Any], bool]]

DEFAULT = "default"
"""The name of the group of the leaves no `ParamGroup` matches."""


@dataclasses.dataclass(frozen=True)
class ParamGroup:
  """A group of parameters and the optimizer settings it changes.

  Attributes:
    match: a regular expression searched (``re.search``) in each leaf's key path,
      ``/``-joined (`mpscale._tree.path_str`, e.g. ``"blocks/ln1/scale"``), or a
      predicate ``(path, leaf) -> bool``.
    lr_mult: multiplies the default learning rate (or schedule); 0 freezes the group
      (its leaves get zero updates and keep no optimizer state).
    learning_rate: the group's own learning rate or schedule, instead of ``lr_mult``.
    weight_decay: the group's weight decay (a float or schedule); ``None``: the
      default.
    name: the group's name in the state and the metrics; default: ``match`` when it
      is a string, else ``group<i>``.
    options: more keywords for the optimizer factory, for this group only.
  """
  match: Match
  lr_mult: float = 1.0
  learning_rate: Optional[ScalarOrSchedule] = None
  weight_decay: Optional[ScalarOrSchedule] = None
  name: Optional[str] = None
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class ParamGroupsState(NamedTuple):
  """State of `param_groups`."""
  inner_states: dict[str, Any]
  """Each group's optimizer state, by group name (``optax.masked`` states: the
  group's leaves only)."""
  count: jax.Array
  """int32 number of updates."""
  learning_rate: jax.Array
  """float32 default learning rate of the latest step (what a group with ``lr_mult``
  1 gets)."""
  group_learning_rates: dict[str, jax.Array]
  """float32 learning rate of each group in the latest step, by name (0 for a frozen
  group)."""


def _group(index: int, group: Any) -> ParamGroup:
  where = f"groups[{index}]"
  if isinstance(group, Mapping):
    fields = {f.name for f in dataclasses.fields(ParamGroup)}
    unknown = sorted(set(group) - fields)
    if unknown:
      raise validation.fail(f"{where}.{unknown[0]}", ": unknown group setting; a "
                            f"group takes {', '.join(sorted(fields))}")
    if "match" not in group:
      raise validation.fail(f"{where}.match", " is missing: each group needs one")
    group = ParamGroup(**group)
  if not isinstance(group, ParamGroup):
    raise validation.fail(where, " must be an mpscale.ParamGroup or a mapping; got "
                          f"{type(group).__name__}", validation.ArgumentTypeError)
  if isinstance(group.match, str):
    try:
      re.compile(group.match)
    except re.error as e:
      raise validation.fail(f"{where}.match", f": {group.match!r} is not a regular "
                            f"expression ({e})") from None
  elif not callable(group.match):
    raise validation.fail(f"{where}.match", " must be a regular expression or a "
                          f"predicate (path, leaf) -> bool; got "
                          f"{type(group.match).__name__}", validation.ArgumentTypeError)
  validation.non_negative_float(f"{where}.lr_mult", group.lr_mult)
  if group.learning_rate is not None:
    if group.lr_mult != 1.0:
      raise validation.ArgumentError(
          (f"{where}.learning_rate", f"{where}.lr_mult"),
          "{0} and {1} both set the group's learning rate; give one")
    validation.scalar_or_schedule(f"{where}.learning_rate", group.learning_rate,
                                  validation.non_negative_float)
  if group.weight_decay is not None:
    validation.scalar_or_schedule(f"{where}.weight_decay", group.weight_decay,
                                  validation.non_negative_float)
  if not isinstance(group.options, Mapping):
    raise validation.fail(f"{where}.options", " must be a mapping of keywords; got "
                          f"{type(group.options).__name__}",
                          validation.ArgumentTypeError)
  name = group.name
  if name is None:
    name = group.match if isinstance(group.match, str) else f"group{index}"
  if not isinstance(name, str) or not name:
    raise validation.fail(f"{where}.name", f" must be a non-empty string; got {name!r}",
                          validation.ArgumentTypeError)
  return dataclasses.replace(group, name=name)


def _group_argument(where: str, group: ParamGroup, name: str) -> str:
  """The name of the factory's argument ``name`` as a group's setting: ``where.name``
  for what the group set (``learning_rate``, ``weight_decay`` or an option)."""
  base = name.split("[", 1)[0]
  if base in group.options:
    return f"{where}.options.{name}"
  if base in ("learning_rate", "weight_decay"):
    return f"{where}.{name}"
  return name


def _scaled(learning_rate: ScalarOrSchedule, mult: float) -> ScalarOrSchedule:
  """``mult * learning_rate``; ``learning_rate`` itself for ``mult`` 1 (bit for bit)."""
  if mult == 1.0:
    return learning_rate
  if callable(learning_rate):
    return lambda count: mult * learning_rate(count)
  return mult * learning_rate


def _at(value: Optional[ScalarOrSchedule], count: jax.Array) -> Optional[jax.Array]:
  if value is None:
    return None
  value = value(count) if callable(value) else value
  return jnp.asarray(value, jnp.float32)


def _matches(group: ParamGroup, path: str, leaf: Any) -> bool:
  if isinstance(group.match, str):
    return re.search(group.match, path) is not None
  return bool(group.match(path, leaf))


def param_group_labels(params: Any, groups: Sequence[Union[ParamGroup, Mapping]]) -> Any:
  """The group name of each leaf of ``params``: the first of ``groups`` whose
  ``match`` accepts its key path, else ``"default"``.

  Raises:
    ArgumentError: naming ``groups[i].match`` of a group that matches no leaf.
  """
  groups = [_group(i, g) for i, g in enumerate(groups)]
  used = set()

  def label(path, leaf):
    text = _tree.path_str(path)
    for i, group in enumerate(groups):
      if _matches(group, text, leaf):
        used.add(i)
        return group.name
    return DEFAULT

  out = jax.tree_util.tree_map_with_path(label, params)
  for i, group in enumerate(groups):
    if i not in used:
      paths = [_tree.path_str(p) for p, _ in
               jax.tree_util.tree_leaves_with_path(params)]
      shown = ", ".join(paths[:6]) + (", ..." if len(paths) > 6 else "")
      raise validation.ArgumentError(
          f"groups[{i}].match", "{0} "
          + validation.literal(f"{group.match!r} matches no parameter (the paths are "
                               f"{shown}; an earlier group may have taken them)"))
  return out


def param_groups(optimizer: Callable[..., optax.GradientTransformation],
                 groups: Sequence[Union[ParamGroup, Mapping]], *,
                 learning_rate: Optional[ScalarOrSchedule],
                 weight_decay: Optional[ScalarOrSchedule] = None,
                 **options: Any) -> optax.GradientTransformationExtraArgs:
  """One optimizer with per-group learning rates, weight decays and options.

  ``optimizer(learning_rate=..., weight_decay=..., **options)`` builds the optimizer
  of one group (``weight_decay`` is passed only when it is not ``None``); it is
  called once per group with that group's settings, and once for the leaves no group
  matches (``"default"``), with ``learning_rate``, ``weight_decay`` and ``options``
  themselves. Each group's optimizer runs on its own leaves (``optax.partition``), so
  a group equals a separately built optimizer run on those leaves, bit for bit.

  Args:
    optimizer: a factory of an optax transformation, e.g. `mpscale.came`,
      ``optax.adamw`` or ``functools.partial(mpscale.came, beta1=0.9)``.
    groups: `ParamGroup`s (or mappings of their fields, e.g. ``{"match":
      "norm|bias", "weight_decay": 0.0}``), in order: a leaf belongs to the first that
      matches it.
    learning_rate: the default learning rate or schedule; ``None`` for an optimizer
      that finds its own (`mpscale.came` with ``relative_step``), when no group sets
      ``lr_mult`` or ``learning_rate``.
    weight_decay: the default weight decay (float or schedule), or ``None`` to leave
      the factory's default.
    **options: keywords for every group's factory call (a group's ``options``
      override them).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state `ParamGroupsState`; its
    ``learning_rate`` and ``group_learning_rates`` are what `mpscale.step_metrics`
    reports. ``init`` raises ``ArgumentError`` naming ``groups[i].match`` when a group
    matches no parameter.

  References:
    Megatron-LM, ``megatron/core/optimizer/__init__.py`` (``_get_param_groups``:
    ``lr_mult``, ``no_weight_decay_cond``, ``scale_lr_cond``); mindformers' ``Came``
    (parameter groups with their own ``lr`` and ``weight_decay``); optax.partition.
  """
  optimizer = validation.function("optimizer", optimizer)
  groups = _checked_groups(groups)
  settings = _Defaults.checked(learning_rate, weight_decay, options, groups)
  transforms = {DEFAULT if g is None else g.name: _group_transform(optimizer, settings, g, groups)
                for g in [None] + groups}
  partition = optax.partition(transforms, lambda tree: param_group_labels(tree, groups))

  def init_fn(params):
    state = partition.init(params)
    count = jnp.zeros((), jnp.int32)
    lr, per_group = settings.learning_rates(groups, count, state.inner_states)
    return ParamGroupsState(state.inner_states, count, lr, per_group)

  def update_fn(updates, state, params=None, *, leaf_squares=None, **extra_args):
    # The sums of squares describe the whole tree, not a group's leaves.
    del leaf_squares
    updates, inner = partition.update(
        updates, optax.transforms.PartitionState(state.inner_states), params,
        **extra_args)
    lr, per_group = settings.learning_rates(groups, state.count, inner.inner_states)
    count = optax.safe_int32_increment(state.count)
    return updates, ParamGroupsState(inner.inner_states, count, lr, per_group)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _checked_groups(groups: Any) -> list[ParamGroup]:
  """``groups`` as `ParamGroup`s, checked (`_group`), their names unique."""
  if isinstance(groups, (str, bytes, Mapping)) or not isinstance(groups, Sequence):
    raise validation.fail("groups", " must be a sequence of mpscale.ParamGroup or "
                          f"mappings; got {type(groups).__name__}",
                          validation.ArgumentTypeError)
  groups = [_group(i, g) for i, g in enumerate(groups)]
  names = [g.name for g in groups]
  for i, name in enumerate(names):
    if name == DEFAULT or name in names[:i]:
      taken = "the unmatched leaves" if name == DEFAULT else "an earlier group"
      raise validation.fail(f"groups[{i}].name", f": {name!r} is taken (by {taken}); "
                            "give the group a name of its own")
  return groups


@dataclasses.dataclass(frozen=True)
class _Defaults:
  """`param_groups`' own settings, which a group without its own takes."""
  learning_rate: Optional[ScalarOrSchedule]
  weight_decay: Optional[ScalarOrSchedule]
  options: Mapping[str, Any]

  @classmethod
  def checked(cls, learning_rate: Any, weight_decay: Any, options: Mapping[str, Any],
              groups: Sequence[ParamGroup]) -> "_Defaults":
    if learning_rate is not None:
      learning_rate = validation.scalar_or_schedule(
          "learning_rate", learning_rate, validation.non_negative_float)
    else:
      for i, g in enumerate(groups):
        if g.learning_rate is not None or g.lr_mult != 1.0:
          key = "learning_rate" if g.learning_rate is not None else "lr_mult"
          raise validation.ArgumentError(
              (f"groups[{i}].{key}", "learning_rate"),
              "{0} needs a default {1}: the optimizer finds its own rate when it is "
              "None")
    if weight_decay is not None:
      weight_decay = validation.scalar_or_schedule(
          "weight_decay", weight_decay, validation.non_negative_float)
    return cls(learning_rate, weight_decay, dict(options))

  def rate(self, g: Optional[ParamGroup]) -> Optional[ScalarOrSchedule]:
    """The learning rate of group ``g`` (``None``: the unmatched leaves)."""
    if g is None:
      return self.learning_rate
    if g.learning_rate is not None:
      return g.learning_rate
    return None if self.learning_rate is None else _scaled(self.learning_rate, g.lr_mult)

  def frozen(self, g: ParamGroup) -> bool:
    """Whether group ``g``'s learning rate is a constant 0."""
    lr = self.rate(g)
    return not callable(lr) and lr is not None and float(lr) == 0.0

  def kwargs(self, g: Optional[ParamGroup]) -> dict[str, Any]:
    """The keywords of group ``g``'s factory call."""
    kwargs = dict(self.options)
    if g is not None:
      kwargs.update(g.options)
    wd = self.weight_decay if g is None or g.weight_decay is None else g.weight_decay
    if wd is not None:
      kwargs["weight_decay"] = wd
    return {"learning_rate": self.rate(g), **kwargs}

  def learning_rates(self, groups: Sequence[ParamGroup], count: jax.Array,
                     inner_states: Mapping[str, Any]
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The step's default learning rate and each group's (a rate the optimizer
    finds itself, as CAME's relative step, read from its state; NaN where none)."""
    found = lambda name: _tree.learning_rate(inner_states[name])  # noqa: E731
    default = _at(self.learning_rate, count)
    if default is None:  # the optimizer's own rate (CAME's relative step)
      default = found(DEFAULT)
    per_group = {}
    for g in groups:
      lr = jnp.zeros((), jnp.float32) if self.frozen(g) else _at(self.rate(g), count)
      per_group[g.name] = found(g.name) if lr is None else lr
    nan = jnp.full((), jnp.nan, jnp.float32)
    return (nan if default is None else default,
            {k: nan if v is None else v for k, v in per_group.items()})


def _group_transform(optimizer: Callable[..., optax.GradientTransformation],
                     settings: _Defaults, g: Optional[ParamGroup],
                     groups: Sequence[ParamGroup]) -> optax.GradientTransformation:
  """Group ``g``'s optimizer (``None``: the unmatched leaves'); a frozen group's is
  ``optax.set_to_zero``. The factory's errors name the group's setting."""
  if g is not None and settings.frozen(g):
    return optax.set_to_zero()
  where = "optimizer" if g is None else f"groups[{groups.index(g)}]"
  try:
    tx = optimizer(**settings.kwargs(g))
  except validation.ArgumentError as e:
    if g is None:
      raise
    raise e.renamed(functools.partial(_group_argument, where, g)) from None
  except (ValueError, TypeError) as e:
    if g is None:
      raise
    raise validation.fail(where, f": {e}", validation.ArgumentTypeError
                          if isinstance(e, TypeError) else validation.ArgumentError
                         ) from None
  if not isinstance(tx, optax.GradientTransformation):
    raise validation.fail("optimizer", " must return an optax.GradientTransformation;"
                          f" got {type(tx).__name__}", validation.ArgumentTypeError)
  return tx
