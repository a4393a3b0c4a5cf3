"""An encoder-decoder model split over the pipeline stages (T5's split).

`SplitPipeline` is a `Pipeline` whose first ``split`` stages run the stacked encoder
layers and the others the stacked decoder layers, which also read the encoder's
output; `gpipe_split` is its GPipe loop (the class docstring).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
import numpy as np

from mpscale import validation
from mpscale.gradients import Gradients
from mpscale.parallel.pipeline import _run as run_lib
from mpscale.parallel.pipeline._pipeline import Pipeline


# --------------------------------------------------------------------------- split
@dataclasses.dataclass(frozen=True)
class SplitPipeline(Pipeline):
  """An encoder-decoder model split over the stages (Megatron-LM's
  ``pipeline_model_parallel_split_rank``, as in T5): the first ``split`` stages run
  the stacked encoder layers, the others the stacked decoder layers, which also read
  the encoder's output::

    x = embed_fn(params, batch)                       # stage 0
    x = stage_fn(encoder_layer, x)                    # each encoder layer (stages < split)
    y = decoder_embed_fn(params, batch)               # stage split
    y = decoder_fn(decoder_layer, y, x)               # each decoder layer (stages >= split)
    loss = head_fn(params, y, batch)                  # last stage

  Each tick a stage sends the pair ``(x, y)`` up (the encoder stages' ``y`` is zeros;
  the decoder stages pass the encoder's ``x`` on unchanged, as Megatron sends the
  encoder's output along the decoder stages), with the GPipe schedule; autodiff
  runs it backward, so the gradient of the encoder's output sums over every decoder
  layer that read it.

  **Storage.** SPMD gives every device arrays of one shape, so both stacks are
  stored padded to one slice a stage (`to_device_order`): ``params[stages_key]``
  holds ``S x n_e`` encoder layers (``n_e = L_e / split``), the slices of stages
  ``>= split`` zeros, and ``params[decoder_key]`` ``S x n_d`` decoder layers
  (``n_d = L_d / (S - split)``), the slices of stages ``< split`` zeros. A device
  thus keeps one unused slice of the other stack (and its optimizer state): up to
  twice the layers' memory of Megatron's MPMD split, the price of one program. The
  padding gets zero gradients and stays zero under any optimizer whose update of a
  zero gradient is zero (SGD, Adam, CAME without weight decay on it...;
  decoupled weight decay keeps zeros at zero too). `to_model_order` drops it.

  Its attributes are `Pipeline`'s (``stage_fn`` is one encoder layer) and these.

  Attributes:
    decoder_embed_fn: ``(params, batch) -> y``, run on stage ``split``.
    decoder_fn: ``(layer_params, y, memory) -> y``, one decoder layer; ``memory`` is
      the encoder's output.
    split: the stages that run the encoder, ``1 <= split < S``.
    decoder_key: the key of ``params`` holding the stacked decoder layers.

  Only the GPipe schedule, without virtual stages or random keys, for now.
  """
  stages_key: str = "encoder"
  decoder_embed_fn: Optional[Callable] = None
  decoder_fn: Optional[Callable] = None
  split: Optional[int] = None
  decoder_key: str = "decoder"

  def __post_init__(self):
    super().__post_init__()
    for name in ("decoder_embed_fn", "decoder_fn"):
      validation.function(name, getattr(self, name))
    validation.positive_int("split", self.split)
    validation.positive_int("num_stages", self.num_stages)
    if self.split >= self.num_stages:
      raise validation.ArgumentError(
          ("split", "num_stages"), f"{{0}}={self.split} leaves the decoder no stage "
          f"of {{1}}={self.num_stages}: it must be below it")
    if self.schedule != "gpipe" or self.virtual_stages != 1:
      raise validation.ArgumentError(
          ("schedule", "virtual_stages"), "a SplitPipeline runs {0}='gpipe' with "
          f"{{1}}=1; got {self.schedule!r}, {self.virtual_stages}")
    if self.stages_key == self.decoder_key:
      raise validation.ArgumentError(("stages_key", "decoder_key"),
                                     "{0} and {1} must differ")

  def _stacks(self) -> tuple[tuple[str, int, int], ...]:
    """``(key, first stage, stages)`` of each stack."""
    S, k = self.num_stages, self.split
    return (self.stages_key, 0, k), (self.decoder_key, k, S - k)

  # ---- storage: each stack padded to a slice a stage
  def to_device_order(self, tree: Any) -> Any:
    """``tree`` (params, or a state holding params-shaped trees) with each stack's
    leaves padded with zeros to ``S`` slices, its own stages' slices in place (the
    class docstring)."""
    return self._stored(tree, pad=True)

  def to_model_order(self, tree: Any) -> Any:
    """The inverse of `to_device_order`: each stack's own slices only."""
    return self._stored(tree, pad=False)

  def _stored(self, tree: Any, pad: bool) -> Any:
    S = self.num_stages
    stacks = {jax.tree_util.DictKey(key): (first, count)
              for key, first, count in self._stacks()}

    def convert(path, x):
      key = next((k for k in path if k in stacks), None)
      if key is None or not np.ndim(x):
        return x
      first, count = stacks[key]
      if pad:
        n = np.shape(x)[0] // count
        widths = [(first * n, (S - first - count) * n)] + [(0, 0)] * (np.ndim(x) - 1)
        return jnp.pad(x, widths)
      n = np.shape(x)[0] // S
      return x[first * n:(first + count) * n]

    return jax.tree_util.tree_map_with_path(convert, tree)

  # ---- the unpipelined model
  def apply(self, params: Any, batch: Any, rng: Optional[jax.Array] = None) -> Any:
    """The whole model on one device, from stored (padded) ``params``."""
    if rng is not None:
      raise ValueError("rng: a SplitPipeline takes no random keys yet")
    params = self.to_model_order(params)
    x = self.embed_fn(params, batch)
    x = self._layers(params[self.stages_key], x)
    y = self.decoder_embed_fn(params, batch)
    y = _decoder_layers(self, params[self.decoder_key], y, x)
    return self.head_fn(params, y, batch)

  # ---- layout
  def _check_layers(self, params: Any, S: int) -> None:
    """`Pipeline.check`'s stacked layers, for two stacks: each stored stack splits
    into a slice a stage."""
    for key, _, _ in self._stacks():
      if not isinstance(params, dict) or key not in params:
        raise ValueError(f"params must be a dict with stacked layers under {key!r}")
      sizes = {np.shape(x)[0] for x in jax.tree_util.tree_leaves(params[key])}
      if len(sizes) != 1 or next(iter(sizes)) % S:
        raise ValueError(f"params[{key!r}]: every leaf needs the same leading (layer) "
                         f"axis, padded to a slice for each of the {S} stages "
                         f"(SplitPipeline.to_device_order); got {sorted(sizes)}")
      run_lib.check_recompute_layers(self.recompute_layers, self.policy(),
                                     next(iter(sizes)) // S)

  def param_specs(self, params: Any, specs: Any = None) -> Any:
    """PartitionSpecs: both stacks' leading axis over the stage axis."""
    if specs is None:
      specs = jax.tree_util.tree_map(lambda _: P(), params)
    out = dict(specs)
    for key, _, _ in self._stacks():
      out[key] = Pipeline.param_specs(dataclasses.replace(
          self, stages_key=key, decoder_key=key + "_"), {key: params[key]},
          {key: specs[key]})[key]
    return out

  # ---- gradients
  def _num_layers(self, params: Any) -> int:
    return 0  # no interleaving, no layer keys

  def _stack_keys(self) -> tuple[str, ...]:
    return (self.stages_key, self.decoder_key)

  def _executor(self) -> Callable[..., tuple[jax.Array, jax.Array, Any, Any]]:
    return _gpipe_split

  def value_and_grad(self, params: Any, batch: Any, **kwargs: Any) -> Gradients:
    """`Pipeline.value_and_grad` of the split model, from stored (padded)
    ``params``; its gradients are stored alike (zero on the padding)."""
    if kwargs.get("rng") is not None:
      raise ValueError("rng: a SplitPipeline takes no random keys yet")
    if kwargs.get("model_state") is not None:
      raise validation.fail("model_state", ": a SplitPipeline's layers take no state "
                            "yet (FP8 scaling state runs on a Pipeline)")
    return super().value_and_grad(params, batch, **kwargs)

  def residual_bytes(self, params: Any, batch: Any, **kwargs: Any) -> dict[str, int]:
    """Not reported for an encoder-decoder split: its GPipe loop is autodiff's."""
    raise TypeError("SplitPipeline.residual_bytes: an encoder-decoder split runs "
                    "GPipe through autodiff, whose residuals are not read back")


def _decoder_layers(pipe: SplitPipeline, layers: Any, y: jax.Array,
                    memory: jax.Array, gather: Optional[Callable] = None
                    ) -> jax.Array:
  """The stacked decoder layers in order, each reading ``memory``; ``gather`` as in
  `Pipeline._layers`. Each runs under `Pipeline.policy`, the stage's first
  ``recompute_layers`` (`scan_layers`), as the encoder's layers do."""
  def layer_of(recomputed):
    policy = pipe.policy() if recomputed else None
    body = run_lib.under(policy, lambda p, h: pipe.decoder_fn(p, h, memory))
    if gather is not None:
      plain = body
      body = jax.checkpoint(lambda p, h: plain(gather(p), h),
                            policy=run_lib.gathers_recomputed(policy))
    return lambda h, p: (body(p, h), None)
  y, _ = run_lib.scan_layers(layer_of, y, layers, pipe.recompute_layers)
  return y


def _gpipe_split(run: run_lib.PipelineRun, params: Any
                 ) -> tuple[jax.Array, jax.Array, Any, None]:
  """GPipe over a `SplitPipeline`: each tick stage ``s`` runs its encoder slice on
  ``x`` (``s < split``) or its decoder slice on ``y`` reading ``x``, and sends ``(x,
  y)`` up. Returns ``(loss sum, count sum, grads)`` of this device."""
  pipe, S, M = run.pipeline, run.S, run.M
  stage = run.stage()
  first = jax.tree_util.tree_map(lambda x: x[0], run.micro)
  cast = lambda p: run.gather_rest(run.params(p))  # noqa: E731
  x_shape = jax.eval_shape(lambda p, b: pipe.embed_fn(cast(p), b), params, first)
  y_shape = jax.eval_shape(lambda p, b: pipe.decoder_embed_fn(cast(p), b), params,
                           first)
  ring = [(i, i + 1) for i in range(S - 1)]
  embed = run.gathered(pipe.embed_fn)
  decoder_embed = run.gathered(pipe.decoder_embed_fn)
  head = run.gathered(run.head_terms)

  def objective(params):
    p = run.params(params)
    encoder, decoder = p[pipe.stages_key], p[pipe.decoder_key]

    def tick(carry, t):
      (x_in, y_in), loss, count = carry
      m = t - stage
      valid = (m >= 0) & (m < M)
      m = jnp.clip(m, 0, M - 1)
      mb = run.micro_batch(m)
      x = lax.cond(stage == 0,
                   lambda: embed(p, mb).astype(x_shape.dtype), lambda: x_in)
      y = lax.cond(stage == pipe.split,
                   lambda: decoder_embed(p, mb).astype(y_shape.dtype),
                   lambda: y_in)
      # A bubble's inputs are garbage: replace them before any arithmetic.
      x, y = jnp.where(valid, x, jnp.zeros_like(x)), jnp.where(valid, y,
                                                               jnp.zeros_like(y))
      x, y = lax.cond(
          stage < pipe.split,
          lambda: (pipe._layers(  # pylint: disable=protected-access
              encoder, x, gather=run.gather_layer(pipe.stages_key)), y),
          lambda: (x, _decoder_layers(pipe, decoder, y, x,
                                      run.gather_layer(pipe.decoder_key))))
      ends = valid & (stage == S - 1)
      with run_lib.runs_a_step(run.M):
        l, c = lax.cond(ends, lambda: head(p, y, mb),
                        lambda: (run.zero(), run.zero()))
      sent = lax.ppermute((x, y), pipe.stage_axis, ring) if S > 1 else (x, y)
      return (sent, loss + l, count + c), None

    init = run.vary((jnp.full(x_shape.shape, run_lib.BUBBLE_FILL, x_shape.dtype),
                     jnp.full(y_shape.shape, run_lib.BUBBLE_FILL, y_shape.dtype)))
    (_, loss, count), _ = lax.scan(tick, (init, run.zero(), run.zero()),
                                   jnp.arange(M + S - 1))
    return run.scale * loss, (loss, count)

  grads, (loss, count) = jax.grad(objective, has_aux=True)(params)
  return loss, count, grads, None
