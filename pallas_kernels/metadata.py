"""The arrays every paged-attention backend reads, built on the host once per step.

Layout conventions shared by all kernels in this package:

* KV pages: one array ``kv_pages[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
  (axis 1: 0 = K, 1 = V). One array keeps donation and sharding simple, and a layer
  index lets a scanned model address its layer's pages without slicing the pool.
* Queries are flat and ragged: row ``r`` owns tokens ``query_start_loc[r]:query_start_loc[r+1]``.
  Its context after this step is ``seq_lens[r]`` tokens, so token ``t`` of row ``r`` sits at
  position ``seq_lens[r] - (query_start_loc[r+1] - t)`` and attends to positions ``<=`` that.
* Padding rows have ``seq_lens == 0`` and an empty query span at the end; padding tokens
  (``t >= query_start_loc[-1]``) have ``slot_mapping == -1`` and write nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np

from jaxpaged.math_utils import cdiv

PAD_SLOT = -1


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    """Per-step attention inputs (device arrays inside jit, numpy on the host)."""

    slot_mapping: jax.Array  # [T] int32: block_id * block_size + offset, PAD_SLOT for padding
    block_tables: jax.Array  # [R, W] int32: physical block ids per row (0-padded)
    seq_lens: jax.Array  # [R] int32: context length after this step (0 = padding row)
    query_start_loc: jax.Array  # [R + 1] int32: prefix sums of query lengths
    # Prefill tiles for the XLA backend: rows whose query has more than one token are cut
    # into tiles of ``tile_size`` tokens. Built on the host by ``build_prefill_tiles``.
    tile_row: jax.Array  # [P] int32: row of each tile (padding tiles: 0)
    tile_start: jax.Array  # [P] int32: flat index of the tile's first token
    tile_len: jax.Array  # [P] int32: valid tokens in the tile (0 = padding tile)
    tile_size: int = field(default=1, metadata=dict(static=True))

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_real_tokens(self) -> jax.Array:
        """The tokens before the bucket's padding (a traced scalar inside jit)."""
        return self.query_start_loc[-1]


def build_prefill_tiles(
    query_start_loc: np.ndarray, tile_size: int, num_tiles: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every multi-token query span into tiles; pad to ``num_tiles`` (vectorized numpy)."""
    q_lens = np.diff(query_start_loc)
    rows = np.flatnonzero(q_lens > 1)
    counts = cdiv(q_lens[rows], tile_size)
    n = int(counts.sum())
    if n > num_tiles:
        raise ValueError(f"{n} prefill tiles do not fit the bucket of {num_tiles}")
    tile_row = np.zeros(num_tiles, np.int32)
    tile_start = np.zeros(num_tiles, np.int32)
    tile_len = np.zeros(num_tiles, np.int32)
    if n:
        row_of_tile = np.repeat(rows, counts)
        first_tile = np.repeat(np.cumsum(counts) - counts, counts)
        k = np.arange(n) - first_tile
        start = query_start_loc[row_of_tile] + k * tile_size
        tile_row[:n] = row_of_tile
        tile_start[:n] = start
        tile_len[:n] = np.minimum(tile_size, query_start_loc[row_of_tile + 1] - start)
    return tile_row, tile_start, tile_len


def num_prefill_tiles(query_start_loc: np.ndarray, tile_size: int) -> int:
    q_lens = np.diff(query_start_loc)
    multi = q_lens[q_lens > 1]
    return int(cdiv(multi, tile_size).sum())
