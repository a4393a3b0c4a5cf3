"""The GPT-2-small-like parameter tree the optimizer benchmarks time updates on."""


def gpt2_like_shapes(*, vocab: int = 8192, ctx: int = 1024, d: int = 768,
                     layers: int = 3, untied_head: bool = True) -> dict:
  """Nested dict of leaf shapes shaped like GPT-2 small (fewer blocks, smaller vocab).

  Defaults: embeddings, 3 blocks of 12 leaves, final layer norm and an untied head:
  41 leaves, 34.6M parameters, in four top-level modules (embed, h, ln_f, lm_head).
  """
  def block():
    return {
        "ln_1": {"scale": (d,), "bias": (d,)},
        "attn": {"c_attn": {"kernel": (d, 3 * d), "bias": (3 * d,)},
                 "c_proj": {"kernel": (d, d), "bias": (d,)}},
        "ln_2": {"scale": (d,), "bias": (d,)},
        "mlp": {"c_fc": {"kernel": (d, 4 * d), "bias": (4 * d,)},
                "c_proj": {"kernel": (4 * d, d), "bias": (d,)}},
    }
  shapes = {
      "embed": {"wte": (vocab, d), "wpe": (ctx, d)},
      "h": {str(i): block() for i in range(layers)},
      "ln_f": {"scale": (d,), "bias": (d,)},
  }
  if untied_head:
    shapes["lm_head"] = {"kernel": (d, vocab)}
  return shapes


def is_shape(x) -> bool:
  """A leaf of the shapes tree: a tuple of ints."""
  return isinstance(x, tuple) and all(isinstance(i, int) for i in x)
