"""Cache writes and block copies on the global page array, done in place under donation.

XLA's CPU backend has no bfloat16/float16 gather: it would convert the whole operand (an
embedding table) to float32 first, so such lookups go through a same-width integer view, which
fuses into the gather (a free bitcast). (A scatter's result is not fused that way: viewing the
page pool as integers costs a copy of the pool, so pool writes are plain scatters.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def as_bits(x: jax.Array) -> jax.Array:
    """``x`` as unsigned integers of its width if it is a 16-bit float, else ``x`` itself."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def from_bits(x: jax.Array, dtype) -> jax.Array:
    """Undo ``as_bits`` for an array meant to be ``dtype``."""
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def take_rows(table: jax.Array, ids: jax.Array, axis: int = 0) -> jax.Array:
    """``jnp.take(table, ids, axis)`` (an embedding lookup, whole blocks) without converting a 16-bit table."""
    return from_bits(jnp.take(as_bits(table), ids, axis=axis), table.dtype)


def write_kv(kv_pages: jax.Array, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Store ``k, v[T, Hkv, D]`` of one layer at their flat slots; padding slots (< 0) write nothing."""
    num_blocks, bs = kv_pages.shape[2], kv_pages.shape[3]
    blk = jnp.where(slot_mapping < 0, num_blocks, slot_mapping // bs)  # out of range -> dropped
    off = slot_mapping % bs
    kv = jnp.stack([k, v], axis=1).astype(kv_pages.dtype)  # [T, 2, Hkv, D]
    return kv_pages.at[layer, :, blk, off].set(kv, mode="drop")


def gather_blocks(kv_pages: jax.Array, idx: jax.Array) -> jax.Array:
    """``kv_pages[:, :, idx]``: whole blocks of every layer."""
    return take_rows(kv_pages, idx, axis=2)


def scatter_blocks(kv_pages: jax.Array, blocks: jax.Array, dst: jax.Array) -> jax.Array:
    """``kv_pages[:, :, dst[i]] = blocks[:, :, i]``; ``dst < 0`` is skipped."""
    dst = jnp.where(dst < 0, kv_pages.shape[2], dst)
    return kv_pages.at[:, :, dst].set(blocks.astype(kv_pages.dtype), mode="drop")


def copy_blocks(kv_pages: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Copy whole blocks ``src[i] -> dst[i]`` in every layer (copy-on-write); ``dst < 0`` is skipped."""
    return scatter_blocks(kv_pages, gather_blocks(kv_pages, jnp.maximum(src, 0)), dst)
