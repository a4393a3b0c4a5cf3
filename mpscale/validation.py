"""Argument checks, shared by every constructor and by the config.

Each check takes the argument's name first and returns the value (converted where that
is the point, e.g. an int to a float). A wrong value raises `ArgumentError` (a
``ValueError``) and a wrong type `ArgumentTypeError` (also a ``TypeError``). Both hold
the names of the arguments they speak of (``names``, the one at fault first) apart from
the text, so a caller that knows the arguments by other names renames them without
reading the message (`ArgumentError.renamed`): the trainer turns
``growth_factor must be > 1`` into ``loss_scale.growth_factor must be > 1``.
The checks run when a transform or step is built, never inside a trace.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

_FLOAT_TYPES = (int, float, np.integer, np.floating)


class ArgumentError(ValueError):
  """A bad argument, by name.

  The message is ``template`` with ``{0}``, ``{1}``, ... standing for ``names``, so
  renaming the arguments rewrites the message without parsing it.

  Attributes:
    names: the arguments the message speaks of; the first is the one at fault.
    template: the message, ``str.format`` style, with ``{i}`` for ``names[i]``.
  """

  def __init__(self, names: Union[str, Sequence[str]], template: str):
    self.names = (names,) if isinstance(names, str) else tuple(names)
    self.template = template
    super().__init__(template.format(*self.names))

  @property
  def name(self) -> str:
    """The argument at fault."""
    return self.names[0]

  def renamed(self, rename: Callable[[str], str]) -> "ArgumentError":
    """The same error (same type and template) with each name passed through
    ``rename``."""
    return type(self)(tuple(rename(n) for n in self.names), self.template)

  def __reduce__(self):  # pickles (e.g. across processes) with its names
    return type(self), (self.names, self.template)


class ArgumentTypeError(ArgumentError, TypeError):
  """An argument of the wrong type (`ArgumentError`; also a ``TypeError``)."""


def literal(text: Any) -> str:
  """``text`` escaped for an `ArgumentError` template (braces doubled)."""
  return str(text).replace("{", "{{").replace("}", "}}")


def fail(name: str, rest: str, cls: type = ArgumentError) -> ArgumentError:
  """An error (``cls``) whose message is ``name`` followed by ``rest`` (plain text,
  not a template): ``raise fail("beta1", " must be in [0, 1)")``."""
  return cls(name, "{0}" + literal(rest))


def real(name: str, value: Any) -> float:
  """``value`` as a float; ``TypeError`` unless a number (bools refused), ``ValueError``
  if NaN."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, _FLOAT_TYPES):
    raise fail(name, f" must be a float; got {type(value).__name__}",
               ArgumentTypeError)
  value = float(value)
  if math.isnan(value):
    raise fail(name, " must not be NaN")
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
    raise fail(name, f" must be {finite}{where}; got {value:g}")
  return value


def positive_float(name: str, value: Any, *, allow_inf: bool = False) -> float:
  """``value`` as a float > 0, finite unless ``allow_inf``."""
  value = real(name, value)
  if not value > 0 or (not allow_inf and math.isinf(value)):
    raise fail(name, f" must be positive{'' if allow_inf else ' and finite'}; "
               f"got {value:g}")
  return value


def non_negative_float(name: str, value: Any) -> float:
  """``value`` as a finite float >= 0."""
  return float_in(name, value, 0.0)


def integer(name: str, value: Any, low: int = -(2**63)) -> int:
  """``value`` as an int >= ``low``; ``TypeError`` unless an int (bools refused)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise fail(name, f" must be an int; got {type(value).__name__}",
               ArgumentTypeError)
  if value < low:
    raise fail(name, f" must be >= {low}; got {value}")
  return int(value)


def positive_int(name: str, value: Any) -> int:
  """``value`` as an int >= 1."""
  return integer(name, value, 1)


def boolean(name: str, value: Any) -> bool:
  """``value`` as a bool; ``TypeError`` unless a bool (NumPy's included)."""
  if not isinstance(value, (bool, np.bool_)):
    raise fail(name, f" must be a bool; got {type(value).__name__}",
               ArgumentTypeError)
  return bool(value)


def one_of(name: str, value: Any, choices: Sequence[Any]) -> Any:
  """``value`` if it is one of ``choices``, else ``ValueError`` listing them."""
  if value not in choices:
    raise fail(name, f" must be one of {', '.join(map(repr, choices))}; "
               f"got {value!r}")
  return value


def floats(name: str, value: Any, length: int,
           check: Callable[[str, Any], float] = real) -> tuple[float, ...]:
  """``value`` as a tuple of ``length`` floats, each passed to ``check`` under the name
  ``name[i]``."""
  if not isinstance(value, (tuple, list)):
    raise fail(name, f" must be a tuple of {length} floats; got "
               f"{type(value).__name__}", ArgumentTypeError)
  if len(value) != length:
    raise fail(name, f" must be {length} floats; got {len(value)} values")
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
      raise fail(name, " must be a float, a scalar float array or a schedule; "
                 f"got an array of {value.dtype}{list(value.shape)}", ArgumentTypeError)
    return value
  return check(name, value)


def positive_scalar(name: str, value: Any) -> Union[float, jax.Array]:
  """A positive, finite scalar: a Python or NumPy number, or an array of shape ``()``
  or ``(1,)`` (MindSpore's ``scale_sense`` takes either). A concrete array comes back
  as a float; a traced one (inside ``jit``) as a float32 scalar array, unchecked."""
  if isinstance(value, (jax.Array, np.ndarray)):
    if np.shape(value) not in ((), (1,)) or not jnp.issubdtype(value.dtype,
                                                                 jnp.floating):
      raise fail(name, " must be a float or a float array of shape () or (1,); got "
                 f"an array of {value.dtype}{list(np.shape(value))}", ArgumentTypeError)
    if isinstance(value, jax.core.Tracer):
      return jnp.reshape(value, ()).astype(jnp.float32)
    value = np.asarray(value).reshape(()).item()
  return positive_float(name, value)


def norm_groups(name: str, value: Any) -> Any:
  """A grouping of leaves for their norms (`mpscale.scaling.NormGroups`): ``None``,
  a depth >= 1 or a callable."""
  if value is None or callable(value):
    return value
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise fail(name, " must be None, a positive int depth or a callable "
               f"key_path -> str; got {type(value).__name__}", ArgumentTypeError)
  if value < 1:
    raise fail(name, f" depth must be >= 1; got {value}")
  return int(value)


def axis_name(name: str, value: Any) -> Optional[Any]:
  """A mapped axis name: ``None``, a str or a tuple of str."""
  if value is None or isinstance(value, str) or (
      isinstance(value, tuple) and all(isinstance(a, str) for a in value)):
    return value
  raise fail(name, " must be a str, a tuple of str or None; got "
             f"{type(value).__name__}", ArgumentTypeError)


def transformation(name: str, value: Any) -> optax.GradientTransformationExtraArgs:
  """An ``optax.GradientTransformation``, given extra-args support."""
  if not isinstance(value, optax.GradientTransformation):
    raise fail(name, " must be an optax.GradientTransformation; got "
               f"{type(value).__name__}", ArgumentTypeError)
  return optax.with_extra_args_support(value)


def function(name: str, value: Any) -> Callable[..., Any]:
  """``value`` if it is callable, else ``TypeError``."""
  if not callable(value):
    raise fail(name, f" must be callable; got {type(value).__name__}",
               ArgumentTypeError)
  return value
