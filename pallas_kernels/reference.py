"""Pure-jnp paged attention: the obviously-correct definition every backend is tested against.

Each query token gathers its row's whole block table and applies the mask; simple and
slow (memory ``T x W x block_size``), so it is used only in tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.precision import matmul_precision


def token_rows_and_positions(
    md: AttentionMetadata, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Row, position and validity of every flat query token."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    qsl = md.query_start_loc
    row = jnp.clip(jnp.searchsorted(qsl, t, side="right") - 1, 0, qsl.shape[0] - 2).astype(jnp.int32)
    valid = t < qsl[-1]
    pos = md.seq_lens[row] - (qsl[row + 1] - t)
    return row, pos, valid


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """Causal (and optional sliding-window) mask, broadcasting query over key positions."""
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def softmax_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float, soft_cap: float | None
) -> jax.Array:
    """GQA attention of ``q[B, Q, Hkv, G, D]`` over ``k, v[B, K, Hkv, D]`` with ``mask[B, Q, K]``.

    Scores and softmax run in float32; fully masked queries give zeros. The dots take float32
    inputs at full float32 precision when ``q`` (scores) and ``v`` (output) came as float32
    (``matmul_precision``: a GPU's default would round them to TF32), else the platform's default.
    """
    s = (
        jnp.einsum(
            "bqhgd,bkhd->bhgqk",
            q.astype(jnp.float32),
            k.astype(jnp.float32),
            precision=matmul_precision(q.dtype),
        )
        * scale
    )
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32), precision=matmul_precision(v.dtype))
    return out


def ragged_paged_attention_reference(
    q: jax.Array,
    kv_pages: jax.Array,
    layer: jax.Array | int,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """``q[T, Hq, D]`` attends to its row's cached context; returns ``[T, Hq, D]`` in q's dtype."""
    T, Hq, D = q.shape
    _, _, _, bs, Hkv, _ = kv_pages.shape
    row, pos, valid = token_rows_and_positions(md, T)
    pages = md.block_tables[row]  # [T, W]
    k = kv_pages[layer, 0][pages].reshape(T, -1, Hkv, D)  # [T, W*bs, Hkv, D]
    v = kv_pages[layer, 1][pages].reshape(T, -1, Hkv, D)
    k_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    mask = attention_mask(pos[:, None], k_pos[None, :], sliding_window)
    mask &= (k_pos[None, :] < md.seq_lens[row][:, None]) & valid[:, None]
    out = softmax_attention(
        q.reshape(T, 1, Hkv, Hq // Hkv, D), k, v, mask[:, None, :], scale=scale, soft_cap=soft_cap
    )
    return out.reshape(T, Hq, D).astype(q.dtype)
