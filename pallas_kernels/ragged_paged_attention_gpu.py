"""The ``"gpu"`` (Triton) variant of ``ragged_paged_attention``: row tiles of a work list, one program per
(tile, KV head), pages gathered by id; the schedule is in ``ragged_paged_attention``'s module docstring."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.online_softmax import attend_chunk, kv_range, token_mask


def gpu_call(
    q,
    kv_pages,
    layer,
    md: AttentionMetadata,
    *,
    q_tile: int,
    pages_per_step: int,
    interpret: bool,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> jax.Array:
    """Grid over (row tiles, KV heads); see ``ragged_paged_attention``'s module docstring."""
    T, Hq, D = q.shape
    _, _, _, bs, Hkv, _ = kv_pages.shape
    G = Hq // Hkv
    Gp = pl.next_power_of_2(G)
    P = pages_per_step
    for name, n in (("q_tile", q_tile), ("pages_per_step", P), ("head_dim", D), ("block_size", bs)):
        if n & (n - 1):
            raise ValueError(f"the Triton kernel needs a power-of-two {name}, got {n}")
    if q_tile * Gp < 16 or P * bs < 16:
        raise ValueError("Triton dots need q_tile * next_pow2(G) >= 16 and pages_per_step * block_size >= 16")
    tiles = _row_tiles(md, T, q_tile, sliding_window, bs)
    kernel = functools.partial(
        _gpu_kernel,
        q_tile=q_tile,
        block_size=bs,
        pages_per_step=P,
        group=G,
        group_pad=Gp,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    return pl.pallas_call(
        kernel,
        grid=(tiles.shape[0], Hkv),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(layer, tiles, md.block_tables.astype(jnp.int32), q, kv_pages)


def _row_tiles(
    md: AttentionMetadata, T: int, q_tile: int, sliding_window: int | None, block_size: int
) -> jax.Array:
    """Work list ``[num_tiles, 8]``: each row's query span cut into tiles of ``q_tile`` tokens.

    Columns: row, token span ``[tok_lo, tok_hi)``, the row's context length and query end, the
    page range ``[pg_lo, pg_hi)`` the tile needs and ``kv_hi`` (its last visible position + 1).

    Padding tokens form one extra row without context so that every output token is written
    (zeros). ``num_tiles = min(T, T // q_tile + R + 1)`` bounds the tile count for any split
    of ``T`` tokens into ``R + 1`` rows; unused tiles have an empty token span.
    """
    qsl = md.query_start_loc.astype(jnp.int32)
    R = md.seq_lens.shape[0]
    qsl_ext = jnp.concatenate([qsl, jnp.full((1,), T, jnp.int32)])
    ctx_ext = jnp.concatenate([md.seq_lens.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    counts = pl.cdiv(qsl_ext[1:] - qsl_ext[:-1], q_tile)
    ends = jnp.cumsum(counts)
    n_tiles = min(T, T // q_tile + R + 1)
    i = jnp.arange(n_tiles, dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(ends, i, side="right"), R).astype(jnp.int32)
    tok_lo = qsl_ext[row] + (i - (ends[row] - counts[row])) * q_tile
    q_end = qsl_ext[row + 1]
    tok_hi = jnp.where(i < ends[-1], jnp.minimum(tok_lo + q_tile, q_end), tok_lo)
    ctx = ctx_ext[row]
    kv_lo, kv_hi = kv_range(ctx, q_end, tok_lo, tok_hi, sliding_window)
    pg_lo = kv_lo // block_size
    pg_hi = jnp.where(tok_lo < tok_hi, (kv_hi + block_size - 1) // block_size, pg_lo)
    return jnp.stack([jnp.minimum(row, R - 1), tok_lo, tok_hi, ctx, q_end, pg_lo, pg_hi, kv_hi], axis=1)


def _gpu_kernel(
    layer_ref,
    tiles_ref,
    bt_ref,
    q_ref,
    kv_ref,
    o_ref,
    *,
    q_tile: int,
    block_size: int,
    pages_per_step: int,
    group: int,
    group_pad: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    i, h = pl.program_id(0), pl.program_id(1)
    row, tok_lo, tok_hi, ctx, q_end, pg_lo, pg_hi, kv_hi = (tiles_ref[i, f] for f in range(8))
    bs, P, G, Gp = block_size, pages_per_step, group, group_pad
    qt, D, M, K = q_tile, o_ref.shape[2], q_tile * group_pad, pages_per_step * block_size

    @pl.when(tok_lo < tok_hi)
    def _tile():
        t3 = tok_lo + lax.broadcasted_iota(jnp.int32, (qt, Gp, D), 0)
        g3 = lax.broadcasted_iota(jnp.int32, (qt, Gp, D), 1)
        io_mask = (t3 < tok_hi) & (g3 < G)
        view = (pl.ds(tok_lo, qt), pl.ds(h * G, Gp), slice(None))
        q = pltriton.load(q_ref.at[view], mask=io_mask, other=0).reshape(M, D)
        t = tok_lo + lax.div(lax.broadcasted_iota(jnp.int32, (M, K), 0), Gp)
        q_pos = ctx - (q_end - t)
        layer = layer_ref[0]

        def body(c, carry):
            pg = pg_lo + c * P + lax.iota(jnp.int32, P)
            pages = bt_ref[row, jnp.minimum(pg, pg_hi - 1)]
            k = kv_ref[layer, 0, pages, :, h, :].reshape(K, D)
            v = kv_ref[layer, 1, pages, :, h, :].reshape(K, D)
            kv_start = (pg_lo + c * P) * bs
            k_pos = kv_start + lax.broadcasted_iota(jnp.int32, (M, K), 1)
            mask = token_mask(t, q_pos, k_pos, tok_lo, tok_hi, sliding_window)
            v_valid = kv_start + lax.broadcasted_iota(jnp.int32, (K, D), 0) < kv_hi
            return attend_chunk(q, k, v, *carry, mask, v_valid, scale=scale, soft_cap=soft_cap)

        init = (
            jnp.full((M, 1), -jnp.inf, jnp.float32),
            jnp.zeros((M, 1), jnp.float32),
            jnp.zeros((M, D), jnp.float32),
        )
        _, denom, acc = lax.fori_loop(0, lax.div(pg_hi - pg_lo + P - 1, P), body, init)
        out = (acc / jnp.where(denom == 0.0, 1.0, denom)).reshape(qt, Gp, D)
        pltriton.store(o_ref.at[view], out.astype(o_ref.dtype), mask=io_mask)
