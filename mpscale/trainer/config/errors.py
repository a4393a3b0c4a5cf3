"""Config errors: `ConfigError`, and the one place other errors become config keys.

A config's values are checked by the constructors they feed (`mpscale.validation`
names the argument at fault). `keyed` runs a constructor and renames its arguments to
the config keys that gave them; `checked` and `as_config_error` turn the result into a
`ConfigError` holding those keys. Every room of the trainer may import this module; it
imports nothing of the trainer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

from mpscale import validation


class ConfigError(ValueError):
  """A configuration mistake.

  Attributes:
    keys: the dotted config keys the message speaks of, the one at fault first (e.g.
      ``("train.steps", "schedule.warmup_steps")``); empty for a file that cannot be
      read or parsed. Whether a key was set by ``--set`` is decided from them.
  """

  def __init__(self, message: str, keys: Sequence[str] = ()):
    super().__init__(message)
    self.keys = tuple(keys)

  def __reduce__(self):  # pickles (e.g. across processes) with its keys
    return type(self), (str(self), self.keys)

  def located(self, source: str, overridden: Sequence[str] = ()) -> "ConfigError":
    """The same error (same type and keys) with ``source`` (the file) first, and
    ``(set by --set)`` last when one of its keys is in, under or above one of the
    ``overridden`` keys."""
    by_set = any(_related(_base_key(k), t) for k in self.keys for t in overridden)
    return type(self)(f"{source}: {self}" + (" (set by --set)" if by_set else ""),
                      self.keys)


class ConfigTypeError(ConfigError, TypeError):
  """A configuration value of the wrong type."""


def _base_key(key: str) -> str:
  """``key`` without an item index: ``optimizer.came.eps[1]`` -> ``...eps``."""
  return key.split("[", 1)[0]


def _related(key: str, other: str) -> bool:
  """Whether ``key`` is ``other``, inside its section, or the section holding it."""
  return key == other or key.startswith(other + ".") or other.startswith(key + ".")


def keyed(where: str, fn: Callable[[], Any],
           keys: Optional[Mapping[str, str]] = None) -> Any:
  """``fn()``, its ``ValueError``/``TypeError`` re-raised naming config keys.

  An `mpscale.validation.ArgumentError` whose culprit is in ``keys`` (a mapping from
  the argument names ``fn``'s constructors use to config keys; an item index such as
  ``eps[1]`` is kept) is renamed through it. Any other error is re-raised as an
  ``ArgumentError`` of the key ``where`` (a section, or the key at fault), which its
  message then starts with.
  """
  keys = {} if keys is None else keys
  try:
    return fn()
  except validation.ArgumentError as e:
    if _base(e.name) in keys:
      raise e.renamed(lambda n: keys.get(_base(n), _base(n)) + n[len(_base(n)):]
                      ) from None
    raise _at(where, e) from None
  except (ValueError, TypeError) as e:
    raise _at(where, e) from None


def _base(name: str) -> str:
  """An argument's name without an item index: ``eps[1]`` -> ``eps``."""
  return name.split("[", 1)[0]


def _at(key: str, error: Exception) -> validation.ArgumentError:
  """``error`` as an `ArgumentError` of ``key``: ``key: <its message>``."""
  cls = (validation.ArgumentTypeError if isinstance(error, TypeError)
         else validation.ArgumentError)
  return cls(key, "{0}: " + validation.literal(error))


def fields(section: str, config: Any, **renamed: str) -> dict[str, str]:
  """Each field of a config section as its dotted key, plus ``renamed`` arguments."""
  keys = {f.name: f"{section}.{f.name}" for f in dataclasses.fields(config)}
  keys.update(renamed)
  return keys


def as_config_error(error: Exception) -> ConfigError:
  """``error`` as a `ConfigError` (`ConfigTypeError` for a ``TypeError``): itself if it
  is one, else with the keys of an `mpscale.validation.ArgumentError` whose names are
  config keys (the builders'), else with none."""
  if isinstance(error, ConfigError):
    return error
  cls = ConfigTypeError if isinstance(error, TypeError) else ConfigError
  return cls(str(error), getattr(error, "names", ()))


def checked(fn, *args) -> Any:
  """``fn(*args)``, a ``ValueError``/``TypeError`` re-raised as a `ConfigError`."""
  try:
    return fn(*args)
  except (ValueError, TypeError) as e:
    raise as_config_error(e) from None
