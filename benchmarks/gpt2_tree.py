"""The GPT-2-small-like parameter tree the optimizer benchmarks time updates on."""


def gpt2_like_shapes(*, vocab: int = 8192, ctx: int = 1024, d: int = 768,
                     layers: int = 3, untied_head: bool = True,
                     names: str = "slash") -> dict:
  """Nested dict of leaf shapes shaped like GPT-2 small (fewer blocks, smaller vocab).

  Defaults: embeddings, 3 blocks of 12 leaves, final layer norm and an untied head:
  41 leaves, 34.6M parameters, in four top-level modules (embed, h, ln_f, lm_head).
  ``vocab=50257, layers=12, untied_head=False`` is GPT-2 small's 124M.

  ``names`` spells the blocks: ``"slash"`` ``h/0``, ``h/1``, ... (a dict keyed by
  digit strings, Hugging Face's Flax GPT-2), ``"list"`` ``h[0]``, ``h[1]``, ... (a list),
  ``"linen"`` top-level ``h_0``, ``h_1``, ... (a Flax linen module's submodules
  ``h = [Block(name=f"h_{i}") ...]``).
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
  shapes = {"embed": {"wte": (vocab, d), "wpe": (ctx, d)}}
  if names == "slash":
    shapes["h"] = {str(i): block() for i in range(layers)}
  elif names == "list":
    shapes["h"] = [block() for _ in range(layers)]
  elif names == "linen":
    shapes.update({f"h_{i}": block() for i in range(layers)})
  else:
    raise ValueError(f"names must be 'slash', 'list' or 'linen', not {names!r}")
  shapes["ln_f"] = {"scale": (d,), "bias": (d,)}
  if untied_head:
    shapes["lm_head"] = {"kernel": (d, vocab)}
  return shapes


def is_shape(x) -> bool:
  """A leaf of the shapes tree: a tuple of ints."""
  return isinstance(x, tuple) and all(isinstance(i, int) for i in x)
