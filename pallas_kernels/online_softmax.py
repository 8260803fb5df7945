"""The math every ragged paged attention kernel shares: one flash-style online-softmax step over a
chunk of keys, and which keys a row's tokens may see (causality, sliding window)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxpaged.kernels.precision import matmul_precision


def attend_chunk(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    m: jax.Array,
    denom: jax.Array,
    acc: jax.Array,
    mask: jax.Array,
    v_valid: jax.Array,
    *,
    scale: float,
    soft_cap: float | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One online-softmax step of ``q[M, D]`` over ``k, v[K, D]``; ``m, denom[M, 1]``, ``acc[M, D]`` float32.

    Masked scores are -inf; a row that has seen no unmasked key keeps ``m = -inf, denom = 0,
    acc = 0`` (exactly, so other rows' chunks leave it untouched). ``v_valid`` zeroes V rows
    that were not fetched for this chunk.
    """
    dtype = jnp.promote_types(q.dtype, k.dtype)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    precision = matmul_precision(dtype)  # float32: IEEE dots in Triton (its default is TF32)
    s = (
        lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        * scale
    )
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m - m_safe)
    denom_new = alpha * denom + jnp.sum(p, axis=1, keepdims=True)
    v = jnp.where(v_valid, v, jnp.zeros_like(v))
    pv = lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    return m_new, denom_new, alpha * acc + pv


def token_mask(
    t: jax.Array, q_pos: jax.Array, k_pos: jax.Array, tok_lo, tok_hi, sliding_window: int | None
) -> jax.Array:
    """Token ``t`` (at ``q_pos``) sees ``k_pos`` if it belongs to the row being processed and causality/window allow."""
    mask = (t >= tok_lo) & (t < tok_hi) & (k_pos <= q_pos)
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def kv_range(ctx, q_end, tok_lo, tok_hi, sliding_window: int | None):
    """KV positions ``[kv_lo, kv_hi)`` that tokens ``[tok_lo, tok_hi)`` of a row can attend to."""
    kv_hi = jnp.maximum(ctx - (q_end - tok_hi), 0)
    if sliding_window is None:
        kv_lo = jnp.zeros_like(kv_hi)
    else:
        kv_lo = jnp.maximum(ctx - (q_end - tok_lo) - sliding_window + 1, 0)
    return kv_lo, kv_hi
