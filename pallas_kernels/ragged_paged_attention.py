"""Ragged paged attention as Pallas kernels: one launch for a mixed batch of prefill chunks and decodes.

All variants read the layout described in ``metadata.py`` (one page pool
``kv_pages[L, 2, num_blocks, block_size, Hkv, D]``, flat ragged queries) and only
``block_tables``, ``seq_lens`` and ``query_start_loc``. They share the math: a flash-style
online softmax in float32 over chunks of ``pages_per_step`` pages, with the G = Hq / Hkv
query heads of one KV head folded into the rows of one matmul (GQA without repeating K/V).
The shared math is in ``online_softmax.py``, the GPU kernel in ``ragged_paged_attention_gpu.py``.

Variants (``variant=``):

* ``"tpu"`` (Mosaic): grid ``(cdiv(T, q_tile), Hkv / kv_heads)``. Each program owns a
  disjoint block of ``q_tile`` flat tokens, so q/out are plain ``BlockSpec`` blocks. Block
  tables, lengths and the rows each token block intersects are scalar-prefetched to SMEM;
  the pool stays in HBM (``pl.ANY``) and the program walks (row, chunk) pairs of the rows in
  its block, DMA-ing only the pages a chunk needs into a double buffer (the next chunk's
  copies are in flight while the current one is computed).
* ``"gpu"`` (Triton): Triton has no scalar prefetch, so block tables arrive as ordinary
  inputs and the kernel loops over pages itself. The wrapper cuts every row's query span
  into tiles of ``q_tile`` tokens (a work list), grid ``(num_tiles, Hkv)``; each program loads
  its tile with masked loads, gathers pages by id and writes its tokens with masked stores,
  so a decode row is one program and the launch has enough programs to fill the GPU.
* ``"interpret"`` (CPU): the TPU schedule with the DMAs replaced by direct indexing of the
  pool. Interpret mode slices every block-indexed input on every grid step (a page-indexed
  pool costs time in proportion to its size), so here only q/out are blocked and the pool is
  one whole-array operand that the kernel gathers pages from: a step's cost does not grow
  with the pool.

A chunk never fetches a page beyond a row's last needed page (nor, with a sliding window,
before its first); slots past the end of a chunk are skipped (TPU) or re-read the row's last
page (GPU, interpret), so nothing outside a row's block table is touched. V rows past the
fetched range are zeroed before ``p @ V`` so stale or NaN memory cannot leak through
zero probabilities.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.online_softmax import attend_chunk, kv_range, token_mask
from jaxpaged.kernels.ragged_paged_attention_gpu import gpu_call

Variant = Literal["tpu", "gpu", "interpret"]


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Default tiling of one variant."""

    q_tile: int  # query tokens per program
    kv_tokens: int  # KV tokens per inner step: pages_per_step = max(1, kv_tokens // block_size)
    kv_heads: int | None  # KV heads per program (None: all); the GPU variant always uses 1


# TPU: all KV heads of a page in one DMA (Mosaic only DMAs whole (head, dim) tiles), 32-token
# query blocks and 256-token KV chunks: double buffer = 2 x K/V x 256 x Hkv x D x 2 B (2 MiB for
# Hkv=8, D=128, bf16). GPU: 16 query rows x next_pow2(G) heads is the smallest tile Triton's dot
# accepts, keeping decode programs cheap; 64-token chunks. Interpret: one KV head per program keeps
# the unrolled kernel (and its compile time) small; 16 x 256 tiles amortize the per-step cost.
DEFAULT_TILES: dict[str, TileConfig] = {
    "tpu": TileConfig(q_tile=32, kv_tokens=256, kv_heads=None),
    "gpu": TileConfig(q_tile=16, kv_tokens=64, kv_heads=1),
    "interpret": TileConfig(q_tile=16, kv_tokens=256, kv_heads=1),
}


def ragged_paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    layer: jax.Array | int,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    variant: Variant | None = None,
    q_tile: int | None = None,
    pages_per_step: int | None = None,
    kv_heads_per_program: int | None = None,
) -> jax.Array:
    """``q[T, Hq, D]`` attends to its row's paged context; returns ``[T, Hq, D]`` in q's dtype.

    ``variant=None`` picks ``"interpret"`` when ``interpret`` is set and otherwise the TPU or
    GPU kernel by lowering platform (``lax.platform_dependent``, so ``jit(...).lower`` and
    ``jax.export`` for one platform work from any host). An explicit variant with
    ``interpret`` runs that kernel in an interpreter (``pltpu.InterpretParams()`` for
    ``"tpu"``, ``True`` for ``"gpu"``). Tile sizes default per variant (``DEFAULT_TILES``).
    """
    T, Hq, D = q.shape
    _, two, _, bs, Hkv, Dk = kv_pages.shape
    if two != 2 or Dk != D or Hq % Hkv:
        raise ValueError(f"incompatible q {q.shape} and kv_pages {kv_pages.shape}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be positive, got {soft_cap}")
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    common = dict(scale=float(scale), sliding_window=sliding_window, soft_cap=soft_cap)

    def run(v: Variant, interp: bool | pltpu.InterpretParams) -> jax.Array:
        cfg = DEFAULT_TILES[v]
        qt = q_tile or cfg.q_tile
        pps = pages_per_step or max(1, cfg.kv_tokens // bs)
        if v == "gpu":
            return gpu_call(q, kv_pages, layer, md, q_tile=qt, pages_per_step=pps, interpret=interp, **common)
        hb = kv_heads_per_program or cfg.kv_heads or Hkv
        return _blocked_call(
            q,
            kv_pages,
            layer,
            md,
            q_tile=qt,
            pages_per_step=pps,
            kv_heads=hb,
            use_dma=v == "tpu",
            interpret=interp,
            **common,
        )

    if variant is not None:
        return run(variant, interpret)
    if interpret:
        return run("interpret", interpret)
    gpu = lambda: run("gpu", False)  # noqa: E731
    return lax.platform_dependent(tpu=lambda: run("tpu", False), cuda=gpu, rocm=gpu)


# ------------------------------------------------------------- TPU / interpret: token blocks


def _blocked_call(
    q,
    kv_pages,
    layer,
    md: AttentionMetadata,
    *,
    q_tile: int,
    pages_per_step: int,
    kv_heads: int,
    use_dma: bool,
    interpret: bool | pltpu.InterpretParams,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> jax.Array:
    """Grid over (KV-head blocks, token blocks); see the module docstring."""
    T, Hq, D = q.shape
    _, _, _, bs, Hkv, _ = kv_pages.shape
    G = Hq // Hkv
    R, W = md.block_tables.shape
    if Hkv % kv_heads:
        raise ValueError(f"kv_heads_per_program={kv_heads} must divide num_kv_heads={Hkv}")
    q_tile = min(q_tile, T)
    nqb = pl.cdiv(T, q_tile)
    qsl = md.query_start_loc.astype(jnp.int32)
    # Rows intersecting each token block (first > last: the block holds only padding tokens).
    blk_lo = jnp.arange(nqb, dtype=jnp.int32) * q_tile
    total = qsl[-1]
    blk_last = jnp.minimum(blk_lo + q_tile, total) - 1
    first = jnp.searchsorted(qsl, blk_lo, side="right").astype(jnp.int32) - 1
    last = jnp.searchsorted(qsl, blk_last, side="right").astype(jnp.int32) - 1
    has_rows = blk_lo < total
    first = jnp.where(has_rows, jnp.clip(first, 0, R - 1), 0)
    last = jnp.where(has_rows, jnp.clip(last, 0, R - 1), -1)

    P = pages_per_step
    M = q_tile * G
    scratch = [
        pltpu.VMEM((kv_heads, M, 128), jnp.float32),  # m, broadcast over lanes
        pltpu.VMEM((kv_heads, M, 128), jnp.float32),  # softmax denominator
        pltpu.VMEM((kv_heads, M, D), jnp.float32),
    ]  # acc
    if use_dma:
        if kv_heads != Hkv and kv_heads % 16:
            raise ValueError(
                "the TPU kernel DMAs whole (head, dim) tiles of a page: kv_heads_per_program "
                f"must be num_kv_heads or a multiple of 16, got {kv_heads}"
            )
        scratch += [
            pltpu.VMEM((2, 2, P, bs, kv_heads, D), kv_pages.dtype),  # [slot, K/V, page, ...]
            pltpu.SemaphoreType.DMA((2, 2)),
        ]
    block = pl.BlockSpec((q_tile, kv_heads, G, D), lambda b, h, *_: (b, h, 0, 0))
    kernel = functools.partial(
        _blocked_kernel,
        block_size=bs,
        pages_per_step=P,
        max_pages=W,
        group=G,
        use_dma=use_dma,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(nqb, Hkv // kv_heads),  # token blocks first: megacore splits the leading axis
            in_specs=[block, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=block,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct((T, Hkv, G, D), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="ragged_paged_attention_tpu" if use_dma else "ragged_paged_attention_interpret",
    )(
        layer,
        md.block_tables.astype(jnp.int32).reshape(-1),
        md.seq_lens.astype(jnp.int32),
        qsl,
        first,
        last,
        q.reshape(T, Hkv, G, D),
        kv_pages,
    )
    return out.reshape(T, Hq, D)


def _blocked_kernel(
    layer_ref,
    bt_ref,
    lens_ref,
    qsl_ref,
    first_ref,
    last_ref,  # scalar prefetch
    q_ref,
    kv_ref,
    o_ref,
    m_ref,
    denom_ref,
    acc_ref,
    *dma_scratch,
    block_size: int,
    pages_per_step: int,
    max_pages: int,
    group: int,
    use_dma: bool,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    q_tile, kv_heads, _, D = q_ref.shape
    bs, P, G = block_size, pages_per_step, group
    M, K = q_tile * G, pages_per_step * block_size
    b = pl.program_id(0)
    h0 = pl.program_id(1) * kv_heads
    blk_lo = b * q_tile
    layer = layer_ref[0]
    first, last = first_ref[b], last_ref[b]

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    denom_ref[...] = jnp.zeros(denom_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def plan(r):
        """What row ``r`` needs inside this token block: token span, KV pages, chunk count."""
        r = jnp.minimum(r, lens_ref.shape[0] - 1)  # loop conditions also evaluate r = last + 1
        q_end, ctx = qsl_ref[r + 1], lens_ref[r]
        tok_lo = jnp.maximum(qsl_ref[r], blk_lo)
        tok_hi = jnp.minimum(q_end, blk_lo + q_tile)
        kv_lo, kv_hi = kv_range(ctx, q_end, tok_lo, tok_hi, sliding_window)
        pg_lo = lax.div(kv_lo, bs)
        pg_hi = lax.div(kv_hi + bs - 1, bs)
        n = jnp.where((tok_lo < tok_hi) & (kv_hi > 0), lax.div(pg_hi - pg_lo + P - 1, P), 0)
        return dict(
            ctx=ctx, q_end=q_end, tok_lo=tok_lo, tok_hi=tok_hi, kv_hi=kv_hi, pg_lo=pg_lo, pg_hi=pg_hi, n=n
        )

    def skip_empty(r):
        return lax.while_loop(lambda r: (r <= last) & (plan(r)["n"] == 0), lambda r: r + 1, r)

    def advance(r, c):
        return lax.cond(c + 1 < plan(r)["n"], lambda: (r, c + 1), lambda: (skip_empty(r + 1), jnp.int32(0)))

    def page_slots(r, c):
        """(page id, valid) of each of the chunk's P slots; invalid slots point at the last needed page."""
        p = plan(r)
        out = []
        for i in range(P):
            pg = p["pg_lo"] + c * P + i
            out.append((bt_ref[r * max_pages + jnp.minimum(pg, p["pg_hi"] - 1)], pg < p["pg_hi"]))
        return out

    if use_dma:
        kv_buf, sems = dma_scratch

        # Whole (head, dim) tiles only: Mosaic rejects DMA windows that cut a tile of the page.
        heads = slice(None) if kv_heads == kv_ref.shape[4] else pl.ds(pl.multiple_of(h0, kv_heads), kv_heads)

        def copies(r, c, slot):
            for i, (page, valid) in enumerate(page_slots(r, c)):
                for kv in range(2):
                    yield (
                        valid,
                        pltpu.make_async_copy(
                            kv_ref.at[layer, kv, page, :, heads, :], kv_buf.at[slot, kv, i], sems.at[slot, kv]
                        ),
                    )

        def start(r, c, slot):
            for valid, cp in copies(r, c, slot):
                pl.when(valid)(cp.start)

        def fetch(r, c, slot):
            for valid, cp in copies(r, c, slot):
                pl.when(valid)(cp.wait)
            return lambda j, kv: kv_buf[slot, kv, :, :, j, :].reshape(K, D)
    else:

        def start(r, c, slot):
            del r, c, slot

        def fetch(r, c, slot):
            del slot
            p = plan(r)
            pg = p["pg_lo"] + c * P + lax.iota(jnp.int32, P)
            pages = bt_ref[r * max_pages + jnp.minimum(pg, p["pg_hi"] - 1)]
            return lambda j, kv: kv_ref[layer, kv, pages, :, h0 + j, :].reshape(K, D)

    def compute(r, c, slot):
        p = plan(r)
        get = fetch(r, c, slot)
        kv_start = (p["pg_lo"] + c * P) * bs
        t = blk_lo + lax.div(lax.broadcasted_iota(jnp.int32, (M, K), 0), G)
        k_pos = kv_start + lax.broadcasted_iota(jnp.int32, (M, K), 1)
        mask = token_mask(t, p["ctx"] - (p["q_end"] - t), k_pos, p["tok_lo"], p["tok_hi"], sliding_window)
        v_valid = kv_start + lax.broadcasted_iota(jnp.int32, (K, D), 0) < p["kv_hi"]
        for j in range(kv_heads):
            k, v = get(j, 0), get(j, 1)
            qj = _fold_heads(q_ref[:, j])
            m, denom, acc = attend_chunk(
                qj,
                k,
                v,
                m_ref[j][:, :1],
                denom_ref[j][:, :1],
                acc_ref[j],
                mask,
                v_valid,
                scale=scale,
                soft_cap=soft_cap,
            )
            m_ref[j] = jnp.broadcast_to(m, (M, 128))
            denom_ref[j] = jnp.broadcast_to(denom, (M, 128))
            acc_ref[j] = acc

    def body(state):
        r, c, slot = state
        nr, nc = advance(r, c)

        @pl.when(nr <= last)
        def _prefetch():
            start(nr, nc, 1 - slot)

        compute(r, c, slot)
        return nr, nc, 1 - slot

    r0 = skip_empty(first)

    @pl.when(r0 <= last)
    def _run():
        start(r0, 0, 0)
        lax.while_loop(lambda s: s[0] <= last, body, (r0, jnp.int32(0), jnp.int32(0)))

    for j in range(kv_heads):
        denom = denom_ref[j][:, :1]
        out = acc_ref[j] / jnp.where(denom == 0.0, 1.0, denom)
        o_ref[:, j] = out.reshape(q_tile, G, D).astype(o_ref.dtype)


def _fold_heads(x: jax.Array) -> jax.Array:
    """``[Qt, G, D] -> [Qt * G, D]`` (row = token * G + head); via float32 when 16-bit rows do not pack evenly."""
    q_tile, G, D = x.shape
    if x.dtype.itemsize < 4 and G % (4 // x.dtype.itemsize):
        return x.astype(jnp.float32).reshape(q_tile * G, D).astype(x.dtype)
    return x.reshape(q_tile * G, D)
