"""Argument checks, shared by every constructor and by the config.

Each check takes the argument's name first and returns the value (converted where that
is the point, e.g. an int to a float). A wrong type raises ``TypeError`` and a wrong
value ``ValueError``; the message starts with the name it was given, so a builder can
translate it (the config passes its dotted key, e.g. ``loss_scale.growth_factor``).
The checks run when a transform or step is built, never inside a trace.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

_FLOAT_TYPES = (int, float, np.integer, np.floating)


def real(name: str, value: Any) -> float:
  """``value`` as a float; ``TypeError`` unless a number (bools refused), ``ValueError``
  if NaN."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, _FLOAT_TYPES):
    raise TypeError(f"{name} must be a float; got {type(value).__name__}")
  value = float(value)
  if math.isnan(value):
    raise ValueError(f"{name} must not be NaN")
  return value


def float_in(name: str, value: Any, low: float = -math.inf, high: float = math.inf,
             *, low_open: bool = False, high_open: bool = False,
             allow_inf: bool = False) -> float:
  """``value`` as a float in ``[low, high]`` (an open end with ``low_open`` /
  ``high_open``), finite unless ``allow_inf``."""
  value = real(name, value)
  above = value > low if low_open else value >= low
  below = value < high if high_open else value <= high
  if not (above and below) or (not allow_inf and math.isinf(value)):
    if math.isinf(high) and math.isfinite(low):
      where = f"{'>' if low_open else '>='} {low:g}"
    else:
      where = (f"in {'(' if low_open else '['}{low:g}, {high:g}"
               f"{')' if high_open else ']'}")
    finite = "" if allow_inf else "finite and "
    raise ValueError(f"{name} must be {finite}{where}; got {value:g}")
  return value


def positive_float(name: str, value: Any, *, allow_inf: bool = False) -> float:
  """``value`` as a float > 0, finite unless ``allow_inf``."""
  value = real(name, value)
  if not value > 0 or (not allow_inf and math.isinf(value)):
    raise ValueError(f"{name} must be positive{'' if allow_inf else ' and finite'}; "
                     f"got {value:g}")
  return value


def non_negative_float(name: str, value: Any) -> float:
  """``value`` as a finite float >= 0."""
  return float_in(name, value, 0.0)


def integer(name: str, value: Any, low: int = -(2**63)) -> int:
  """``value`` as an int >= ``low``; ``TypeError`` unless an int (bools refused)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int; got {type(value).__name__}")
  if value < low:
    raise ValueError(f"{name} must be >= {low}; got {value}")
  return int(value)


def positive_int(name: str, value: Any) -> int:
  """``value`` as an int >= 1."""
  return integer(name, value, 1)


def boolean(name: str, value: Any) -> bool:
  """``value`` as a bool; ``TypeError`` unless a bool (NumPy's included)."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
  return bool(value)


def one_of(name: str, value: Any, choices: Sequence[Any]) -> Any:
  """``value`` if it is one of ``choices``, else ``ValueError`` listing them."""
  if value not in choices:
    raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; "
                     f"got {value!r}")
  return value


def floats(name: str, value: Any, length: int,
           check: Callable[[str, Any], float] = real) -> tuple[float, ...]:
  """``value`` as a tuple of ``length`` floats, each passed to ``check`` under the name
  ``name[i]``."""
  if not isinstance(value, (tuple, list)):
    raise TypeError(f"{name} must be a tuple of {length} floats; got "
                    f"{type(value).__name__}")
  if len(value) != length:
    raise ValueError(f"{name} must be {length} floats; got {len(value)} values")
  return tuple(check(f"{name}[{i}]", v) for i, v in enumerate(value))


def scalar_or_schedule(name: str, value: Any,
                       check: Callable[[str, Any], float]) -> Any:
  """A callable (an Optax schedule) as it is, a scalar JAX array too (what
  ``optax.inject_hyperparams`` passes; its value may be traced, so it is not
  checked); anything else through ``check``."""
  if callable(value):
    return value
  if isinstance(value, jax.Array):
    if value.ndim != 0 or not jnp.issubdtype(value.dtype, jnp.floating):
      raise TypeError(f"{name} must be a float, a scalar float array or a schedule; "
                      f"got an array of {value.dtype}{list(value.shape)}")
    return value
  return check(name, value)


def groups(name: str, value: Any) -> Any:
  """A grouping of leaves (`mpscale.norms.Groups`): ``None``, a depth >= 1 or a
  callable."""
  if value is None or callable(value):
    return value
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be None, a positive int depth or a callable "
                    f"key_path -> str; got {type(value).__name__}")
  if value < 1:
    raise ValueError(f"{name} depth must be >= 1; got {value}")
  return int(value)


def axis_name(name: str, value: Any) -> Optional[Any]:
  """A mapped axis name: ``None``, a str or a tuple of str."""
  if value is None or isinstance(value, str) or (
      isinstance(value, tuple) and all(isinstance(a, str) for a in value)):
    return value
  raise TypeError(f"{name} must be a str, a tuple of str or None; got "
                  f"{type(value).__name__}")


def transformation(name: str, value: Any) -> optax.GradientTransformationExtraArgs:
  """An ``optax.GradientTransformation``, given extra-args support."""
  if not isinstance(value, optax.GradientTransformation):
    raise TypeError(f"{name} must be an optax.GradientTransformation; got "
                    f"{type(value).__name__}")
  return optax.with_extra_args_support(value)


def function(name: str, value: Any) -> Callable[..., Any]:
  """``value`` if it is callable, else ``TypeError``."""
  if not callable(value):
    raise TypeError(f"{name} must be callable; got {type(value).__name__}")
  return value
