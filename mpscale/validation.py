"""Argument checks shared by the constructors: each raises naming the argument."""

from __future__ import annotations

import math
from typing import Any


def positive_float(name: str, value: Any, *, finite_only: bool = True) -> float:
  """``value`` as a float; ``TypeError`` if not a number, ``ValueError`` if <= 0 (or
  not finite, with ``finite_only``)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(f"{name} must be a float; got {type(value).__name__}")
  value = float(value)
  if not value > 0 or (finite_only and not math.isfinite(value)):
    raise ValueError(f"{name} must be positive and finite; got {value}")
  return value


def positive_int(name: str, value: Any) -> int:
  """``value``; ``TypeError`` if not an int (bools refused), ``ValueError`` if < 1."""
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{name} must be an int; got {type(value).__name__}")
  if value < 1:
    raise ValueError(f"{name} must be >= 1; got {value}")
  return value


def boolean(name: str, value: Any) -> bool:
  """``value``; ``TypeError`` unless it is a bool."""
  if not isinstance(value, bool):
    raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
  return value
