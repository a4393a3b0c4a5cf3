"""The mixture-of-experts MLP as Flax modules: `MoeMLP` (linen) and `NnxMoeMLP`
(NNX), holding the router's and the experts' weights and calling
`mpscale.experts.moe_mlp`.

The balancing bias (`mpscale.experts.Routing.bias_rate`) is state, not a parameter:
linen keeps it in the ``routing`` collection, NNX in a `RoutingBias` variable. A
step writes back `mpscale.experts.update_bias` of it and the layer's
`mpscale.experts.MoeStats` counts; `mpscale.make_train_step` leaves it untouched
on a skipped step, as it leaves any model state.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

try:
  from flax import linen as nn
  from flax import nnx
except ImportError as e:  # the library's install has no Flax
  raise ImportError(
      f"mpscale.experts.moe_flax needs Flax ({e}): pip install \"mpscale[flax]\" "
      "(in a clone: pip install -e \".[flax]\")") from e

from mpscale import validation
from mpscale.experts._dispatch import ExpertWeights, swiglu
from mpscale.experts._layer import EXPERT_AXIS, MoeStats, moe_mlp
from mpscale.experts._routing import Routing


def _check_routing(routing: Any) -> None:
  if not isinstance(routing, Routing):
    raise validation.fail("routing", " must be an mpscale.experts.Routing; got "
                          f"{type(routing).__name__}", validation.ArgumentTypeError)


class MoeMLP(nn.Module):
  """A linen mixture-of-experts SwiGLU MLP: ``x -> (y, MoeStats)``.

  Parameters: ``router`` ``[d, E]``, ``gate``/``up`` ``[E, d, d_ff]``, ``down``
  ``[E, d_ff, d]``, and with ``shared_d_ff`` a dense SwiGLU MLP every token goes
  through (``shared_gate``, ``shared_up``, ``shared_down``; DeepSeek's shared
  experts, their widths summed). With ``routing.bias_rate`` the balancing bias is
  the variable ``bias`` (``[E]``, zeros) of the ``routing`` collection: pass it
  in, and after the step write back `update_bias` of it and the stats' counts.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from mpscale import experts
    >>> from mpscale.experts.moe_flax import MoeMLP
    >>> layer = MoeMLP(experts.Routing(num_experts=4, top_k=2), d_ff=32)
    >>> x = jnp.ones((2, 8, 16))
    >>> variables = layer.init(jax.random.key(0), x)
    >>> y, stats = layer.apply(variables, x)
    >>> y.shape, float(stats.counts.sum())
    ((2, 8, 16), 32.0)
  """
  routing: Routing
  d_ff: int
  shared_d_ff: int = 0
  dtype: Optional[Any] = None
  kernel_init: Callable = nn.initializers.normal(0.02)
  mesh: Any = None
  spec: Optional[PartitionSpec] = None
  expert_axis: str = EXPERT_AXIS
  tensor_axis: Optional[str] = None
  implementation: str = "auto"
  tile: Optional[int] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, MoeStats]:
    _check_routing(self.routing)
    dtype = self.dtype or x.dtype
    d, num, f = x.shape[-1], self.routing.num_experts, self.d_ff
    router = self.param("router", self.kernel_init, (d, num))
    weights = ExpertWeights(*(
        self.param(name, self.kernel_init, shape).astype(dtype)
        for name, shape in (("gate", (num, d, f)), ("up", (num, d, f)),
                            ("down", (num, f, d)))))
    bias = None
    if self.routing.bias_rate:
      bias = self.variable("routing", "bias", jnp.zeros, (num,), jnp.float32).value
    y, stats = moe_mlp(x.astype(dtype), router, weights, self.routing, bias=bias,
                       mesh=self.mesh, spec=self.spec, expert_axis=self.expert_axis,
                       tensor_axis=self.tensor_axis,
                       implementation=self.implementation, tile=self.tile)
    if self.shared_d_ff:
      dense = functools.partial(nn.Dense, use_bias=False, dtype=dtype,
                                kernel_init=self.kernel_init)
      h = x.astype(dtype)
      gate = dense(self.shared_d_ff, name="shared_gate")(h)
      up = dense(self.shared_d_ff, name="shared_up")(h)
      y = y + dense(d, name="shared_down")(swiglu(gate, up))
    return y, stats


class RoutingBias(nnx.Variable):
  """The balancing bias (`Routing.bias_rate`): state, not a parameter."""


class NnxMoeMLP(nnx.Module):
  """`MoeMLP` for NNX: ``NnxMoeMLP(routing, d_model, d_ff, rngs=...)``; its
  ``bias`` a ``RoutingBias`` variable (not an ``nnx.Param``) with
  ``routing.bias_rate``."""

  def __init__(self, routing: Routing, d_model: int, d_ff: int, *,
               rngs: Any, mesh: Any = None, spec: Optional[PartitionSpec] = None,
               expert_axis: str = EXPERT_AXIS, tensor_axis: Optional[str] = None,
               implementation: str = "auto", tile: Optional[int] = None,
               init: Callable = nn.initializers.normal(0.02)):
    _check_routing(routing)
    num = routing.num_experts
    self.routing = routing
    self.router = nnx.Param(init(rngs.params(), (d_model, num)))
    self.gate = nnx.Param(init(rngs.params(), (num, d_model, d_ff)))
    self.up = nnx.Param(init(rngs.params(), (num, d_model, d_ff)))
    self.down = nnx.Param(init(rngs.params(), (num, d_ff, d_model)))
    self.bias = (RoutingBias(jnp.zeros((num,), jnp.float32))
                 if routing.bias_rate else None)
    self.options = dict(mesh=mesh, spec=spec, expert_axis=expert_axis,
                        tensor_axis=tensor_axis, implementation=implementation,
                        tile=tile)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, MoeStats]:
    weights = ExpertWeights(*(w[...].astype(x.dtype)
                              for w in (self.gate, self.up, self.down)))
    bias = None if self.bias is None else self.bias[...]
    return moe_mlp(x, self.router[...], weights, self.routing, bias=bias,
                   **self.options)
