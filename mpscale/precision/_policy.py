"""Precision policy: the dtypes of master parameters, computation and outputs.

A `Policy` names three dtypes, as in jmp: ``param_dtype`` for the master parameters the
optimizer updates, ``compute_dtype`` for the forward and backward pass, and
``output_dtype`` for what the model hands to the loss. The train step keeps the master
parameters in ``param_dtype``, casts them to ``compute_dtype`` for the forward/backward
(`Policy.cast_to_compute`) and returns float32 gradients to the optimizer.

A ``keep_fp32`` predicate exempts chosen leaves from the cast to ``compute_dtype``: they
are cast to float32 instead. `default_keep_fp32` keeps the parameters of normalization
layers and biases (any path component containing ``norm``, ``scale`` or ``bias``): they
are small, so keeping them in float32 costs little.

Presets, after MindSpore's ``amp_level`` (`make_policy`); the last column is
``needs_loss_scaling``; ``mpscale.policy_loss_scale(policy, optax.adamw(1e-3))`` wraps an
optimizer in `mpscale.dynamic_loss_scale` when it is true, else in `no_loss_scale`::

               params    compute   output   keep_fp32           needs_loss_scaling
  "O0"         float32   float32   float32  -                   False
  "O1"         float32   float16   float32  default_keep_fp32   True
  "O2"         float32   float16   float32  default_keep_fp32   True
  "O3"         float16   float16   float16  -                   True
  "bf16"       float32   bfloat16  float32  -                   False
  "bf16-pure"  bfloat16  bfloat16  float32  -                   False

MindSpore's O1 and O2 differ in which *ops* run in float16 (a white list of MatMul/Conv
versus the whole network but BatchNorm); a JAX policy casts parameters, not ops, so both
give the same policy here. A Flax module computes in the dtype of its inputs and
parameters together, so one float32 leaf promotes its module to float32: give modules
``dtype=policy.compute_dtype`` (they then cast their own float32-kept leaves) or use
``keep_fp32=None``. MindSpore's O3 runs without loss scaling; float16 gradients need it,
so ``needs_loss_scaling`` is true for O3 and the train step warns without it.

``"bf16-pure"`` keeps the parameters themselves in bfloat16, with no float32 master
copy (an optimizer's state is made in its parameters' dtype; optax's ``adamw`` keeps
its first moment there with ``mu_dtype=jnp.bfloat16``), so round-to-nearest loses every
update smaller than half a parameter's spacing: end the optimizer chain with
`mpscale.stochastic_rounding` or `mpscale.kahan_summation` (`mpscale.optim`). The
loss is still taken in float32.

References:
  jmp (google-deepmind/jmp), ``jmp.Policy`` and ``jmp.get_policy``.
  MindSpore ``mindspore.amp.build_train_network`` amp levels O0-O3.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from mpscale import _tree
from mpscale import validation

KeepFp32 = Callable[[_tree.KeyPath, Any], bool]
"""Predicate ``(key_path, leaf) -> bool``: cast this leaf to float32, not to compute."""

_DTYPES = {
    "float32": jnp.float32, "f32": jnp.float32, "fp32": jnp.float32,
    "single": jnp.float32,
    "float16": jnp.float16, "f16": jnp.float16, "fp16": jnp.float16,
    "half": jnp.float16,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
}
_ROLES = {
    "params": "param_dtype", "param": "param_dtype", "p": "param_dtype",
    "compute": "compute_dtype", "c": "compute_dtype",
    "output": "output_dtype", "out": "output_dtype", "o": "output_dtype",
}


def _dtype(value: Any, argname: str) -> np.dtype:
  if isinstance(value, str):
    if value.lower() not in _DTYPES:
      raise validation.fail(argname, f": unknown dtype {value!r}; expected one of "
                            f"{sorted(_DTYPES)}")
    value = _DTYPES[value.lower()]
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise validation.fail(argname, f" must be a floating dtype; got {value!r}",
                          validation.ArgumentTypeError) from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise validation.fail(argname, f" must be a floating dtype; got {dtype}",
                          validation.ArgumentTypeError)
  return dtype


def _is_float_array(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _cast(tree: Any, dtype: np.dtype) -> Any:
  return jax.tree_util.tree_map(
      lambda x: x.astype(dtype) if _is_float_array(x) else x, tree)


def keep_fp32_by_name(*substrings: str) -> KeepFp32:
  """A ``keep_fp32`` predicate: leaves with a path component containing a substring.

  Matching is case-insensitive on each key's plain name (dict key, attribute or index),
  so ``keep_fp32_by_name("norm")`` keeps ``LayerNorm_0/scale`` and ``ln_norm/bias``.

  Args:
    *substrings: lower-case substrings to look for.

  Returns:
    A predicate ``(key_path, leaf) -> bool``.
  """
  if not substrings or not all(isinstance(s, str) and s for s in substrings):
    raise ValueError("keep_fp32_by_name needs one or more non-empty strings")
  wanted = tuple(s.lower() for s in substrings)

  def keep(path: _tree.KeyPath, leaf: Any) -> bool:
    del leaf
    names = [_tree.path_str((k,)).lower() for k in path]
    return any(s in name for name in names for s in wanted)

  return keep


default_keep_fp32: KeepFp32 = keep_fp32_by_name("norm", "scale", "bias")
"""Keeps normalization parameters and biases: any path component containing ``norm``,
``scale`` or ``bias`` (e.g. ``LayerNorm_0/scale``, ``Dense_0/bias``, ``rms_norm``)."""


@dataclasses.dataclass(frozen=True)
class Policy:
  """Which dtype the master parameters, the computation and the outputs use.

  Usage inside a loss function (the train step already casts the parameters)::

    def loss_fn(params, batch):
      x = policy.cast_to_compute(batch["x"])
      logits = policy.cast_to_output(model.apply({"params": params}, x))
      return cross_entropy(logits, batch["y"])

  Only floating-point arrays are cast; integer arrays and Python scalars pass through.

  Attributes:
    param_dtype: dtype of the master parameters that the optimizer updates.
    compute_dtype: dtype of the forward and backward pass.
    output_dtype: dtype of the model outputs handed to the loss.
    keep_fp32: optional predicate ``(key_path, leaf) -> bool``; the leaves it selects
      are cast to float32, not ``compute_dtype``, by `cast_to_compute` (e.g.
      `default_keep_fp32`). ``None`` casts every floating leaf.
  """
  param_dtype: Any = jnp.float32
  compute_dtype: Any = jnp.float32
  output_dtype: Any = jnp.float32
  keep_fp32: Optional[KeepFp32] = None

  def __post_init__(self):
    for name in ("param_dtype", "compute_dtype", "output_dtype"):
      object.__setattr__(self, name, _dtype(getattr(self, name), name))
    if self.keep_fp32 is not None:
      validation.function("keep_fp32", self.keep_fp32)

  @property
  def needs_loss_scaling(self) -> bool:
    """True when any of the dtypes is float16, whose narrow exponent range flushes small
    gradients to zero without loss scaling (bfloat16 and float32 do not need it)."""
    return any(d == jnp.float16 for d in
               (self.param_dtype, self.compute_dtype, self.output_dtype))

  def cast_to_param(self, tree: Any) -> Any:
    """``tree`` with every floating leaf cast to ``param_dtype``."""
    return _cast(tree, self.param_dtype)

  def cast_to_compute(self, tree: Any) -> Any:
    """``tree`` with floating leaves cast to ``compute_dtype``, or float32 where
    ``keep_fp32(key_path, leaf)`` is true."""
    if self.keep_fp32 is None:
      return _cast(tree, self.compute_dtype)
    keep = self.keep_fp32

    def cast(path, x):
      if not _is_float_array(x):
        return x
      return x.astype(jnp.float32 if keep(path, x) else self.compute_dtype)

    return jax.tree_util.tree_map_with_path(cast, tree)

  def cast_to_output(self, tree: Any) -> Any:
    """``tree`` with every floating leaf cast to ``output_dtype``."""
    return _cast(tree, self.output_dtype)

  def wide_share(self, flops: dict[str, float]) -> Optional[float]:
    """The share of matrix FLOPs (`mpscale._jaxprs.matmul_flops`, by operand dtype)
    that run in float32 or wider under a 16-bit ``compute_dtype``; ``None`` when
    the compute dtype is not 16-bit or there are no such FLOPs."""
    if jnp.dtype(self.compute_dtype).itemsize != 2:
      return None
    total = sum(flops.values())
    if not total:
      return None
    return sum(f for name, f in flops.items()
               if jnp.dtype(name).itemsize >= 4) / total

  def check_compute(self, flops: dict[str, float], stacklevel: int = 2) -> None:
    """Warns when most of a model's matrix FLOPs (``flops``, by operand dtype) stay
    in float32 under a 16-bit policy: the model fixes its layers' dtype (Flax's
    ``dtype=jnp.float32``, as many published models do), so the policy speeds up
    nothing (issue #42's Flax ResNet under O2 computed entirely in float32)."""
    share = self.wide_share(flops)
    if share is not None and share > 0.5:
      warnings.warn(
          f"policy {self} computes in {self.compute_dtype.name}, but {share:.0%} of "
          "the loss's matrix FLOPs run in float32: the model casts its inputs or "
          "weights back (e.g. Flax layers built with dtype=jnp.float32). Leave the "
          "layers' dtype unset (or set it to the compute dtype) for the policy to "
          "take effect.", stacklevel=stacklevel + 1)

  def __str__(self) -> str:
    return (f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"output={self.output_dtype.name}")


def _presets() -> dict[str, Policy]:
  f32, f16, bf16 = jnp.float32, jnp.float16, jnp.bfloat16
  mixed_fp16 = Policy(f32, f16, f32, keep_fp32=default_keep_fp32)
  return {
      "o0": Policy(f32, f32, f32),
      "o1": mixed_fp16,
      "o2": mixed_fp16,
      "o3": Policy(f16, f16, f16),
      "bf16": Policy(f32, bf16, f32),
      "bf16-pure": Policy(bf16, bf16, f32),
  }


def make_policy(spec: Union[str, Policy]) -> Policy:
  """A `Policy` from a preset name or a ``role=dtype`` string.

  Args:
    spec: a `Policy` (returned as is); a preset, case-insensitive: ``"O0"``, ``"O1"``,
      ``"O2"``, ``"O3"``, ``"bf16"``, ``"bf16-pure"`` (see the module docstring); one
      dtype name for all three roles (``"float32"``, ``"bfloat16"``); or
      comma-separated ``role=dtype`` pairs with roles ``params``/``p``,
      ``compute``/``c``, ``output``/``o`` and dtypes ``float32``/``f32``/``fp32``,
      ``float16``/``f16``/``fp16``/``half``, ``bfloat16``/``bf16``. A role left out
      is float32.

  Returns:
    The `Policy`.

  Example:
    >>> import mpscale
    >>> policy = mpscale.make_policy("params=float32,compute=float16,output=float32")
    >>> policy.needs_loss_scaling
    True
  """
  if isinstance(spec, Policy):
    return spec
  if not isinstance(spec, str):
    raise TypeError(f"policy must be a Policy or a str; got {type(spec).__name__}")
  text = spec.strip().lower()
  presets = _presets()
  if text in presets:
    return presets[text]
  if "=" not in text:
    if text in _DTYPES:
      return Policy(text, text, text)
    raise ValueError(f"unknown policy {spec!r}; expected a preset "
                     f"({', '.join(p.upper() if p[0] == 'o' else p for p in presets)}),"
                     " a dtype, or 'params=...,compute=...,output=...'")
  fields: dict[str, str] = {}
  for part in text.split(","):
    role, sep, dtype = (s.strip() for s in part.partition("="))
    if not sep or role not in _ROLES:
      raise ValueError(f"bad policy entry {part.strip()!r} in {spec!r}; expected "
                       "role=dtype with role one of params, compute, output")
    if _ROLES[role] in fields:
      raise ValueError(f"policy {spec!r} sets {_ROLES[role]} twice")
    fields[_ROLES[role]] = dtype
  return Policy(**fields)
