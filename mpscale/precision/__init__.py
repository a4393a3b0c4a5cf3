"""Which dtype each value has: precision policies and FP8 products.

- `Policy`, `make_policy` (the presets O0-O3, bf16, or ``"params=...,compute=..."``),
  `keep_fp32_by_name`, `default_keep_fp32` (``_policy``);
- FP8 matrix products with their scaling state, `fp8_dot_general`, for the delayed,
  current and blockwise recipes (`make_fp8_recipe`), and the quantizers they use
  (``_fp8``);
- the products' state after them: updates merged across micro-batches and
  replicas (`merge`, `merge_stacked`, `merge_across`) and the
  ``_overwrite_with_gradient`` collection a step replaces by its gradient
  (`split_overwrite`, `join_overwrite`) (``_fp8_state``);
- ``mpscale.precision.fp8_flax``: the same products as Flax linen and NNX layers.
  It needs Flax (``pip install "mpscale[flax]"``), so this package does not import
  it: ``from mpscale.precision.fp8_flax import Fp8DotGeneral``.

May import: the core (`mpscale.validation`, ``_tree``).
"""

from mpscale.precision._fp8 import (
    E4M3,
    E5M2,
    OVERWRITE_WITH_GRADIENT,
    Fp8Meta,
    Fp8Recipe,
    Fp8State,
    amax,
    dequantize,
    dequantize_blockwise,
    fp8_dot_general,
    fp8_state,
    make_fp8_recipe,
    quantize,
    quantize_blockwise,
    record_amax,
    scale_from_amax,
)
from mpscale.precision._fp8_state import (
    join_overwrite,
    merge,
    merge_across,
    merge_stacked,
    split_overwrite,
)
from mpscale.precision._policy import (
    KeepFp32,
    Policy,
    default_keep_fp32,
    keep_fp32_by_name,
    make_policy,
)

__all__ = [
    "E4M3",
    "E5M2",
    "Fp8Meta",
    "Fp8Recipe",
    "Fp8State",
    "KeepFp32",
    "OVERWRITE_WITH_GRADIENT",
    "Policy",
    "amax",
    "default_keep_fp32",
    "dequantize",
    "dequantize_blockwise",
    "fp8_dot_general",
    "fp8_state",
    "join_overwrite",
    "keep_fp32_by_name",
    "make_fp8_recipe",
    "make_policy",
    "merge",
    "merge_across",
    "merge_stacked",
    "quantize",
    "quantize_blockwise",
    "record_amax",
    "scale_from_amax",
    "split_overwrite",
]
