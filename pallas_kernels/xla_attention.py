"""Paged attention with plain XLA ops: the CPU serving path.

Two passes share one program. Every row's last query token attends to the row's pages
(the decode pass, one gather per row); rows with multi-token queries (prefill chunks)
are cut into fixed-size tiles on the host and each tile attends to its row's pages (the
prefill pass). Work is proportional to the pages the batch uses, never to the pool size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.reference import attention_mask, softmax_attention


def _gather_pages(kv_pages: jax.Array, layer, block_tables: jax.Array):
    """K and V of the given block-table rows: ``[B, W*block_size, Hkv, D]`` each."""
    B = block_tables.shape[0]
    _, _, _, bs, Hkv, D = kv_pages.shape
    k = kv_pages[layer, 0][block_tables].reshape(B, -1, Hkv, D)
    v = kv_pages[layer, 1][block_tables].reshape(B, -1, Hkv, D)
    return k, v


def xla_paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    layer,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    T, Hq, D = q.shape
    Hkv = kv_pages.shape[4]
    G = Hq // Hkv
    qsl, seq_lens = md.query_start_loc, md.seq_lens
    R = seq_lens.shape[0]
    q_lens = qsl[1:] - qsl[:-1]
    out = jnp.zeros((T + 1, Hq, D), jnp.float32)  # one spare row absorbs dropped writes

    # Decode pass: the last query token of every row.
    last = jnp.maximum(qsl[1:] - 1, 0)
    k, v = _gather_pages(kv_pages, layer, md.block_tables)
    k_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    q_pos = seq_lens - 1
    mask = attention_mask(q_pos[:, None], k_pos[None, :], sliding_window) & (
        k_pos[None, :] < seq_lens[:, None]
    )
    dec = softmax_attention(
        q[last].reshape(R, 1, Hkv, G, D), k, v, mask[:, None, :], scale=scale, soft_cap=soft_cap
    ).reshape(R, Hq, D)
    dec_dst = jnp.where(q_lens == 1, last, T)
    out = out.at[dec_dst].set(dec)

    # Prefill pass: tiles of multi-token query spans.
    P, Qt = md.tile_row.shape[0], md.tile_size
    if P:
        rows = md.tile_row
        idx = md.tile_start[:, None] + jnp.arange(Qt, dtype=jnp.int32)[None, :]  # [P, Qt]
        tok_valid = jnp.arange(Qt)[None, :] < md.tile_len[:, None]
        idx_c = jnp.where(tok_valid, idx, 0)
        k, v = _gather_pages(kv_pages, layer, md.block_tables[rows])
        q_pos = seq_lens[rows][:, None] - (qsl[rows + 1][:, None] - idx)  # [P, Qt]
        mask = attention_mask(q_pos[:, :, None], k_pos[None, None, :], sliding_window)
        mask &= (k_pos[None, None, :] < seq_lens[rows][:, None, None]) & tok_valid[:, :, None]
        pre = softmax_attention(
            q[idx_c].reshape(P, Qt, Hkv, G, D), k, v, mask, scale=scale, soft_cap=soft_cap
        ).reshape(P, Qt, Hq, D)
        out = out.at[jnp.where(tok_valid, idx, T)].set(pre)
    return out[:T].astype(q.dtype)
