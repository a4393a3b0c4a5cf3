"""The grouped matrix product of a mixture of experts: rows sorted by expert, each
group multiplied by its expert's matrix.

``jax.lax.ragged_dot`` is the reference (``implementation="ragged"``). On TPUs XLA
multiplies each group by its own matrix; XLA's GPU and CPU compilers (jax 0.10)
rewrite it as one dense product of every row by every expert's matrix, ``E`` times
the routed FLOPs. ``implementation="tiled"`` multiplies tiles of ``tile`` rows of one
expert each, in a loop over the tiles that hold rows, so the FLOPs are the routed
rows' plus at most one partial tile an expert::

  tiles_e = ceil(group_sizes[e] / tile)
  for i in range(sum(tiles_e)):          # a while loop: as many tiles as rows need
    e, j = the expert and rank of tile i
    rows = start_e + j * tile + arange(tile)           # masked past the group's end
    out[rows] += x[rows] @ w[e]

Its gradient (a ``custom_vjp``) is two more such loops, as Megablox's is: ``dx`` the
same product with each expert's matrix transposed, ``dw[e]`` the sum over the
expert's tiles of ``x[rows]^T @ dy[rows]``.

A loop's trip count is the data's, which a compiled program's reader cannot know:
each loop runs under the name scope ``mpscale_tiles=N`` (`TILES_SCOPE`), ``N`` the
tiles an even load of ``expected_rows`` rows runs, which
`mpscale.trainer.planning.hlo` takes as its trip count.

References:
  Gale et al., "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts"
  (2022), https://arxiv.org/abs/2211.15841 (grouped GEMMs for dropless experts);
  jax's ``jax.lax.ragged_dot``; MaxText's Megablox ``gmm``/``tgmm``.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from mpscale import validation

TILES_SCOPE = "mpscale_tiles="
"""The name scope of a tiled loop, followed by the tiles an even load runs."""

IMPLEMENTATIONS = ("auto", "tiled", "ragged")
"""`grouped_matmul`'s choices: ``tiled`` (a loop over the rows' tiles, any backend),
``ragged`` (``jax.lax.ragged_dot``), ``auto`` (``ragged`` on TPUs, else ``tiled``)."""


def default_tile(rows: int, num_groups: int) -> int:
  """A tile of a power of two rows, 16 to 512, with ``num_groups`` partial tiles
  at most a tenth of ``rows`` where that allows (the tiles' FLOPs then within 1.1x
  of the rows' own)."""
  tile = 512
  while tile > 16 and num_groups * tile * 10 > rows:
    tile //= 2
  return tile


def exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
  """Each element's sum of those before it along ``axis`` (a group's first row)."""
  return jnp.cumsum(x, axis=axis) - x


def _ceil_div(a, b):
  return -(-a // b)


def _schedule(group_sizes: jax.Array, tile: int):
  """Each tile's expert and first row, and how many tiles hold rows."""
  sizes = group_sizes.astype(jnp.int32)
  tiles = _ceil_div(sizes, tile)
  ends = jnp.cumsum(tiles)
  starts = exclusive_cumsum(sizes)

  def tile_of(i):
    e = jnp.minimum(jnp.searchsorted(ends, i, side="right"), sizes.shape[0] - 1)
    j = i - (ends[e] - tiles[e])
    first = starts[e] + j * tile
    valid = jnp.clip(sizes[e] - j * tile, 0, tile)
    return e, first, valid
  return tile_of, ends[-1]


def _rows(x: jax.Array, first: jax.Array, tile: int) -> jax.Array:
  return lax.dynamic_slice_in_dim(x, first, tile, axis=0)


def _pad(x: jax.Array, tile: int) -> jax.Array:
  return jnp.pad(x, ((0, tile), (0, 0)))


def _loop(count, body, init, expected: int):
  """``fori_loop(0, count, body, init)`` named for the tiles an even load runs."""
  with jax.named_scope(f"{TILES_SCOPE}{expected}"):
    return lax.fori_loop(0, count, body, init)


def _even_tiles(rows: int, groups: int, tile: int) -> int:
  """The tiles ``rows`` rows spread evenly over ``groups`` groups take."""
  return groups * _ceil_div(_ceil_div(rows, groups), tile)


def _tiled_gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tile: int,
               transpose: bool, expected: int) -> jax.Array:
  """``out[rows of group e] = x[rows] @ w[e]`` (``w[e].T`` with ``transpose``) for
  ``x`` ``[m, k]``, ``w`` ``[E, k, n]``, by tiles; rows past the groups get 0."""
  m = x.shape[0]
  n = w.shape[1] if transpose else w.shape[2]
  tile_of, count = _schedule(group_sizes, tile)
  xp = _pad(x, tile)
  spec = "tk,nk->tn" if transpose else "tk,kn->tn"

  def body(i, out):
    e, first, valid = tile_of(i)
    rows = _rows(xp, first, tile)
    part = jnp.einsum(spec, rows, w[e], preferred_element_type=jnp.float32)
    keep = (jnp.arange(tile) < valid)[:, None]
    part = jnp.where(keep, part, 0).astype(out.dtype)
    return lax.dynamic_update_slice_in_dim(out, _rows(out, first, tile) + part,
                                           first, axis=0)

  out = _loop(count, body, jnp.zeros((m + tile, n), x.dtype), expected)
  return out[:m]


def _tiled_tgmm(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, tile: int,
                num_groups: int, expected: int) -> jax.Array:
  """``dw[e] = x[rows of e]^T @ dy[rows of e]`` (``[E, k, n]``), by tiles."""
  tile_of, count = _schedule(group_sizes, tile)
  xp, dyp = _pad(x, tile), _pad(dy, tile)

  def body(i, dw):
    e, first, valid = tile_of(i)
    keep = (jnp.arange(tile) < valid)[:, None]
    rows = jnp.where(keep, _rows(xp, first, tile), 0)
    part = jnp.einsum("tk,tn->kn", rows, _rows(dyp, first, tile),
                      preferred_element_type=jnp.float32)
    return dw.at[e].add(part)

  dw = jnp.zeros((num_groups, x.shape[1], dy.shape[1]), jnp.float32)
  return _loop(count, body, dw, expected)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tiled(x, w, group_sizes, tile, expected):
  return _tiled_gmm(x, w, group_sizes, tile, False, expected)


def _tiled_forward(x, w, group_sizes, tile, expected):
  return _tiled(x, w, group_sizes, tile, expected), (x, w, group_sizes)


def _tiled_backward(tile, expected, res, dy):
  x, w, group_sizes = res
  dy = dy.astype(x.dtype)
  dx = _tiled_gmm(dy, w, group_sizes, tile, True, expected)
  dw = _tiled_tgmm(x, dy, group_sizes, tile, w.shape[0], expected).astype(w.dtype)
  return dx, dw, None


_tiled.defvjp(_tiled_forward, _tiled_backward)


def choose(implementation: str, platform: str) -> str:
  """``implementation`` (`IMPLEMENTATIONS`) for devices of ``platform``: ``auto`` is
  ``ragged`` on TPUs, else ``tiled``."""
  validation.one_of("implementation", implementation, IMPLEMENTATIONS)
  if implementation != "auto":
    return implementation
  return "ragged" if platform == "tpu" else "tiled"


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   implementation: str = "auto", tile: Optional[int] = None,
                   expected_rows: Optional[int] = None) -> jax.Array:
  """Rows of ``x`` (``[m, k]``, sorted by group) times their group's matrix of ``w``
  (``[E, k, n]``): group ``e`` is the ``group_sizes[e]`` rows after the groups
  before it; rows past ``sum(group_sizes)`` give zeros.

  Args:
    x: the rows, sorted by group.
    w: one matrix a group.
    group_sizes: ``[E]`` integers summing to at most ``m``.
    implementation: `IMPLEMENTATIONS` (``auto`` for the default backend,
      `choose`).
    tile: rows a tile (``tiled``; ``None``: `default_tile` of ``expected_rows``).
    expected_rows: the rows the groups hold when the load is even (``None``:
      ``m``; fewer where ``x`` is a buffer for the worst case), for the tile and
      the loops' `TILES_SCOPE`.

  Returns:
    ``[m, n]`` in ``x``'s dtype (float32 accumulation).
  """
  implementation = choose(implementation, jax.default_backend())
  if implementation == "ragged":
    return lax.ragged_dot(x, w.astype(x.dtype), group_sizes.astype(jnp.int32),
                          preferred_element_type=jnp.float32).astype(x.dtype)
  rows = x.shape[0] if expected_rows is None else expected_rows
  tile = default_tile(rows, w.shape[0]) if tile is None else tile
  validation.positive_int("tile", tile)
  return _tiled(x, w.astype(x.dtype), group_sizes.astype(jnp.int32), tile,
                _even_tiles(rows, w.shape[0], tile))
