"""Cache writes and block copies on the global page array, done in place under donation."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv(kv_pages: jax.Array, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Store ``k, v[T, Hkv, D]`` of one layer at their flat slots; padding slots (< 0) write nothing."""
    num_blocks, bs = kv_pages.shape[2], kv_pages.shape[3]
    blk = jnp.where(slot_mapping < 0, num_blocks, slot_mapping // bs)   # out of range -> dropped
    off = slot_mapping % bs
    kv = jnp.stack([k, v], axis=1).astype(kv_pages.dtype)              # [T, 2, Hkv, D]
    return kv_pages.at[layer, :, blk, off].set(kv, mode="drop")


def copy_blocks(kv_pages: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Copy whole blocks ``src[i] -> dst[i]`` in every layer (copy-on-write); ``dst < 0`` is skipped."""
    num_blocks = kv_pages.shape[2]
    dst = jnp.where(dst < 0, num_blocks, dst)
    return kv_pages.at[:, :, dst].set(kv_pages[:, :, jnp.maximum(src, 0)], mode="drop")
