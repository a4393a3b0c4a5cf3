"""Old names and module paths, kept for one release with a ``DeprecationWarning``.

mpscale 0.1 had 28 flat modules (``mpscale.loss_scale``, ``mpscale.sharding``, ...)
and a few names that said two things at once. The library now lives in rooms by
concern (``mpscale.scaling``, ``mpscale.optim``, ``mpscale.precision``,
``mpscale.parallel``, ``mpscale.step``), and those names have one meaning each. What
a user's code wrote still works, for one release, and warns once per name:

* an old module path (`MODULES`): ``import mpscale.loss_scale``, ``from
  mpscale.sharding import fsdp_specs`` and ``from mpscale import fp8`` import the
  module that holds that code now, through an alias module that also answers the
  module's renamed names (`RENAMED`);
* an old name (`NAMES`): ``mpscale.clip_by_global_norm`` is
  `mpscale.global_norm_clip`;
* an old keyword (`renamed_keyword`): ``dynamic_loss_scale(inner, groups=2)`` is
  ``norm_groups=2``;
* an old config key (`config_key`): the trainer's ``train.remat: true`` is
  ``train.recompute: full``.

The library's own code never uses an old spelling; it imports this module only to
decorate the functions whose keyword was renamed, and the trainer's config reader to
warn of an old key.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any, Callable

REMOVAL = "mpscale 0.3"
"""The release that drops these aliases."""

MODULES = {
    "mpscale.backward_split": "mpscale.parallel.pipeline._backward_split",
    "mpscale.batch_split": "mpscale.parallel._batch_split",
    "mpscale.came": "mpscale.optim._came",
    "mpscale.fp8": ("mpscale.precision._fp8", "mpscale.precision._fp8_state"),
    "mpscale.fp8_flax": "mpscale.precision.fp8_flax",
    "mpscale.hlo": "mpscale.trainer.planning.hlo",
    "mpscale.jaxprs": "mpscale._jaxprs",
    "mpscale.loss_scale": "mpscale.scaling._loss_scale",
    "mpscale.metrics": "mpscale.step._metrics",
    "mpscale.norms": "mpscale.scaling._norms",
    "mpscale.opt_state": "mpscale._tree",
    "mpscale.parameter_groups": "mpscale.optim._param_groups",
    "mpscale.pipeline": ("mpscale.parallel", "mpscale.parallel.pipeline"),
    "mpscale.pipeline_schedules": "mpscale.parallel.pipeline._schedules",
    "mpscale.policy": "mpscale.precision._policy",
    "mpscale.producer_select": "mpscale.scaling._producer_select",
    "mpscale.rounding": "mpscale.optim._rounding",
    "mpscale.schedules": "mpscale.optim._lr_schedules",
    "mpscale.sharding": "mpscale.parallel",
    "mpscale.skip": "mpscale.scaling._skip",
    "mpscale.spikes": "mpscale.scaling._spikes",
    "mpscale.train_step": "mpscale.step",
}
"""Old module path -> the module that holds its code now, or the modules, asked in
order (``mpscale.sharding``, ``mpscale.pipeline`` and ``mpscale.train_step``, each
split by concern, answer through their room, which exports every public name they
had; ``mpscale.fp8`` through the two modules it became)."""

RENAMED = {
    "bubble_fraction": "pipeline_bubble_fraction",
    "ClipByGlobalNormState": "GlobalNormClipState",
    "clip_by_global_norm": "global_norm_clip",
    "fp8_recipe": "make_fp8_recipe",
    "get_policy": "make_policy",
    "Groups": "NormGroups",
    "labels": "param_group_labels",
    "loss_scale_for": "policy_loss_scale",
    "schedule_chunks": "pipeline_schedule_chunks",
    "schedule_table": "pipeline_schedule_table",
    "stage_groups": "stage_norm_groups",
}
"""Old name -> new name, wherever the old one was defined."""

_MODULE_ONLY = ("Groups", "labels")
"""Old names that were attributes of their modules only (``mpscale.norms.Groups``,
``mpscale.parameter_groups.labels``), never of ``mpscale``."""

NAMES = {old: ("mpscale", new) for old, new in RENAMED.items()
         if old not in _MODULE_ONLY}
"""Old top-level name -> ``(module, new name)``: what ``mpscale.<old>`` answers."""


def _warn(old: str, new: str, stacklevel: int = 3) -> None:
  warnings.warn(f"{old} is deprecated and will be removed in {REMOVAL}; use {new}",
                DeprecationWarning, stacklevel=stacklevel)


def _public(dotted: str) -> str:
  """The public home of a module: ``mpscale.scaling._norms`` -> ``mpscale.scaling``."""
  parts = dotted.split(".")
  cut = next((i for i, p in enumerate(parts) if p.startswith("_")), len(parts))
  if cut < 2:  # a core helper (mpscale._tree): no public home
    return f"{dotted} (internal: mpscale's own helpers)"
  return ".".join(parts[:cut])


def name(old: str) -> Any:
  """The object a deprecated top-level ``mpscale.<old>`` names (warning), or raises
  ``AttributeError``."""
  if f"mpscale.{old}" in MODULES:
    return module(f"mpscale.{old}", stacklevel=5)
  if old not in NAMES:
    raise AttributeError(f"module 'mpscale' has no attribute {old!r}")
  where, new = NAMES[old]
  _warn(f"mpscale.{old}", f"{where}.{new}", stacklevel=4)
  return getattr(importlib.import_module(where), new)


class _Alias(types.ModuleType):
  """An old module path: every attribute of the modules now holding its code (the
  first that has it), and the renamed ones under their old names too (each warns)."""

  def __init__(self, old: str, targets: tuple[types.ModuleType, ...]):
    super().__init__(old, targets[0].__doc__)
    self.__dict__["_targets"] = targets

  def __getattr__(self, attr: str) -> Any:
    for name in filter(None, (attr, RENAMED.get(attr))):
      for target in self.__dict__["_targets"]:
        if hasattr(target, name):
          if name != attr:
            _warn(f"{self.__name__}.{attr}", f"{_public(target.__name__)}.{name}")
          return getattr(target, name)
    raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")

  def __dir__(self) -> list[str]:
    names = {n for target in self.__dict__["_targets"] for n in dir(target)}
    return sorted(names | set(RENAMED))


def homes(old: str) -> tuple[str, ...]:
  """The modules an old path (`MODULES`) answers from, in the order asked."""
  new = MODULES[old]
  return (new,) if isinstance(new, str) else new


def module(old: str, stacklevel: int = 4) -> types.ModuleType:
  """The alias module of an old path (`MODULES`), made once; warns."""
  if old in sys.modules:
    return sys.modules[old]
  new = homes(old)
  _warn(f"the module {old}", _public(new[0]), stacklevel=stacklevel)
  alias = _Alias(old, tuple(importlib.import_module(n) for n in new))
  sys.modules[old] = alias
  return alias


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Answers ``import mpscale.<old>`` with its alias module."""

  def find_spec(self, fullname, path=None, target=None):
    if fullname in MODULES:
      return importlib.machinery.ModuleSpec(fullname, self)
    return None

  def create_module(self, spec):
    return module(spec.name)

  def exec_module(self, alias):
    pass


def install_finder() -> None:
  """Puts the finder of old module paths on ``sys.meta_path`` (once)."""
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())


def config_key(old: str, new: str, stacklevel: int = 3) -> None:
  """Warns that the trainer's config key ``old`` (with its value, e.g.
  ``"train.remat: true"``) is deprecated, and says to write ``new`` instead."""
  _warn(f"the config key {old}", new, stacklevel=stacklevel + 1)


def renamed_keyword(old: str, new: str) -> Callable[[Callable], Callable]:
  """A decorator: the function also takes its keyword ``new`` as ``old`` (warning)."""
  def decorate(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
      if old in kwargs:
        if new in kwargs:
          raise TypeError(f"{fn.__name__}() got both {old}= and {new}=; pass {new}=")
        _warn(f"{fn.__name__}({old}=...)", f"{new}=")
        kwargs[new] = kwargs.pop(old)
      return fn(*args, **kwargs)
    return wrapper
  return decorate
