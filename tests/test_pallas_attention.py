"""Pallas ragged paged attention (interpret mode on CPU) against the jnp reference, plus KV ops.

Every batch is built on the host with numpy: shuffled physical block ids, lengths that are
not multiples of the block size, padding rows and padding tokens, block-table padding with
out-of-range ids. Each reference case also reruns the kernel on a pool where every slot that
holds no live context (unused pages, the tail of each row's last page) is NaN, and requires
the same output.

Tolerances: float32 1e-5 (observed ~1e-6). bfloat16 2e-2 absolute + 1e-2 relative, i.e. about
two bf16 ulps at magnitude 1: the kernel feeds probabilities to the P @ V matmul in bf16, as the
MXU / tensor cores do, while the reference keeps them in float32; both round the output to bf16.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxpaged.kernels import dispatch
from jaxpaged.kernels.cpu_attention import native_kernel_available
from jaxpaged.kernels.dispatch import paged_attention
from jaxpaged.kernels.kv_ops import copy_blocks
from jaxpaged.kernels.metadata import PAD_SLOT, AttentionMetadata, build_prefill_tiles, num_prefill_tiles
from jaxpaged.kernels.ragged_paged_attention import ragged_paged_attention
from jaxpaged.kernels.reference import ragged_paged_attention_reference

LAYERS = 2
LAYER = 1  # attend through the last layer so a wrong layer index cannot pass
TPU_INTERPRET = pltpu.InterpretParams(out_of_bounds_reads="raise", detect_races=True)


@dataclasses.dataclass(frozen=True)
class Case:
    rows: tuple[tuple[int, int], ...]  # (query tokens, context after the step) per live row
    block_size: int
    head_dim: int
    q_heads: int
    kv_heads: int
    dtype: str = "float32"
    sliding_window: int | None = None
    soft_cap: float | None = None
    scale: float | None = None  # default 1/sqrt(head_dim)
    pad_rows: int = 1
    pad_tokens: int = 3


@dataclasses.dataclass
class Batch:
    q: jax.Array
    kv: jax.Array
    kv_poisoned: jax.Array  # every slot without live context is NaN
    md: AttentionMetadata


def build_batch(case: Case, seed: int = 0) -> Batch:
    """Numpy-built ragged batch with shuffled block ids from a pool with spare blocks."""
    rng = np.random.default_rng(seed)
    bs = case.block_size
    q_lens = np.array([r[0] for r in case.rows] + [0] * case.pad_rows, np.int32)
    ctx = np.array([r[1] for r in case.rows] + [0] * case.pad_rows, np.int32)
    assert np.all(q_lens <= ctx)
    R = len(q_lens)
    pages = -(-ctx // bs)
    W = int(pages.max(initial=0)) + 1  # one spare padding column
    num_blocks = int(pages.sum()) + 5
    ids = rng.permutation(num_blocks).astype(np.int32)
    # Padding entries are out-of-range ids: using one reads outside the pool (the TPU interpreter raises).
    block_tables = np.full((R, W), num_blocks + 1000, np.int32)
    live = np.zeros((num_blocks, bs), bool)  # slots holding context
    start = 0
    for r in range(R):
        own = ids[start : start + pages[r]]
        start += pages[r]
        block_tables[r, : pages[r]] = own
        pos = np.arange(ctx[r])
        live[own[pos // bs], pos % bs] = True
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = int(qsl[-1]) + case.pad_tokens
    dtype = jnp.dtype(case.dtype)
    kv = rng.standard_normal((LAYERS, 2, num_blocks, bs, case.kv_heads, case.head_dim)).astype(np.float32)
    poisoned = np.where(live[None, None, :, :, None, None], kv, np.nan)
    q = rng.standard_normal((T, case.q_heads, case.head_dim)).astype(np.float32)
    slot = np.full(T, PAD_SLOT, np.int32)
    tile_size = 16
    tiles = build_prefill_tiles(qsl, tile_size, max(1, num_prefill_tiles(qsl, tile_size)))
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slot),
        block_tables=jnp.asarray(block_tables),
        seq_lens=jnp.asarray(ctx),
        query_start_loc=jnp.asarray(qsl),
        tile_row=jnp.asarray(tiles[0]),
        tile_start=jnp.asarray(tiles[1]),
        tile_len=jnp.asarray(tiles[2]),
        tile_size=tile_size,
    )
    return Batch(jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.asarray(poisoned, dtype), md)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "soft_cap",
        "variant",
        "interpret",
        "q_tile",
        "pages_per_step",
        "kv_heads_per_program",
    ),
)
def run_kernel(q, kv, layer, md, **kw):
    return ragged_paged_attention(q, kv, layer, md, **kw)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap"))
def run_reference(q, kv, layer, md, **kw):
    return ragged_paged_attention_reference(q, kv, layer, md, **kw)


def attn_kwargs(case: Case) -> dict:
    scale = case.scale if case.scale is not None else case.head_dim**-0.5
    return dict(scale=scale, sliding_window=case.sliding_window, soft_cap=case.soft_cap)


run_dispatch = jax.jit(paged_attention, static_argnames=("backend", "scale", "sliding_window", "soft_cap"))


def check_against_reference(
    case: Case, *, variant: str = "interpret", interpret=True, backend: str | None = None, **tiles
) -> None:
    """The Pallas kernel (``variant``), or the dispatched ``backend`` when given, against the reference."""
    b = build_batch(case)
    kw = attn_kwargs(case)
    layer = jnp.int32(LAYER)

    def kernel(kv):
        if backend is not None:
            return run_dispatch(b.q, kv, layer, b.md, backend=backend, **kw)
        return run_kernel(b.q, kv, layer, b.md, variant=variant, interpret=interpret, **kw, **tiles)

    out = kernel(b.kv)
    ref = run_reference(b.q, b.kv, layer, b.md, **kw)
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    tol = dict(atol=1e-5, rtol=1e-5) if case.dtype == "float32" else dict(atol=2e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tol)
    # Padding tokens come out as exact zeros.
    n_live = int(b.md.query_start_loc[-1])
    np.testing.assert_array_equal(np.asarray(out[n_live:], np.float32), 0.0)
    # Nothing outside a row's live context is read: NaN there changes nothing.
    dirty = kernel(b.kv_poisoned)
    assert np.all(np.isfinite(np.asarray(dirty, np.float32)))
    np.testing.assert_array_equal(np.asarray(dirty, np.float32), np.asarray(out, np.float32))


CASES = {
    "mixed-bs8-d64-gqa1": Case(
        rows=((1, 1), (1, 9), (7, 40), (13, 13), (1, 100)),
        block_size=8,
        head_dim=64,
        q_heads=2,
        kv_heads=2,
        pad_rows=2,
        pad_tokens=5,
    ),
    "decode-bs16-d128-gqa3": Case(
        rows=((1, 1), (1, 17), (1, 250), (1, 1000), (1, 33)),
        block_size=16,
        head_dim=128,
        q_heads=6,
        kv_heads=2,
    ),
    "prefill-bs32-d64-gqa4": Case(
        rows=((33, 33), (50, 300), (20, 20)), block_size=32, head_dim=64, q_heads=4, kv_heads=1, pad_tokens=0
    ),
    "long-bs16-d64-gqa8": Case(
        rows=((1, 2047), (40, 1999), (1, 1)), block_size=16, head_dim=64, q_heads=8, kv_heads=1
    ),
    "window-bs16-d64-gqa3": Case(
        rows=((1, 300), (45, 117), (1, 5), (20, 20)),
        block_size=16,
        head_dim=64,
        q_heads=3,
        kv_heads=1,
        sliding_window=37,
    ),
    "softcap-bs8-d128-gqa4": Case(
        rows=((1, 77), (30, 60)), block_size=8, head_dim=128, q_heads=8, kv_heads=2, soft_cap=2.0, scale=1.0
    ),
    "window-softcap-bs32-d128-gqa1": Case(
        rows=((1, 1500), (64, 700)),
        block_size=32,
        head_dim=128,
        q_heads=2,
        kv_heads=2,
        sliding_window=200,
        soft_cap=10.0,
    ),
    "bf16-mixed-bs16-d128-gqa4": Case(
        rows=((1, 600), (25, 25), (1, 3), (9, 130)),
        block_size=16,
        head_dim=128,
        q_heads=8,
        kv_heads=2,
        dtype="bfloat16",
    ),
    "bf16-window-bs8-d64-gqa8": Case(
        rows=((1, 401), (16, 90)),
        block_size=8,
        head_dim=64,
        q_heads=8,
        kv_heads=1,
        dtype="bfloat16",
        sliding_window=64,
        soft_cap=30.0,
    ),
    "all-padding": Case(rows=(), block_size=16, head_dim=64, q_heads=4, kv_heads=2, pad_rows=3, pad_tokens=8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_interpret_matches_reference(name: str) -> None:
    check_against_reference(CASES[name])


@pytest.mark.parametrize("name", list(CASES))
def test_native_cpu_kernel_matches_reference(name: str) -> None:
    """The C++ kernel behind ``backend="cpu"`` (XLA FFI), built by pip install."""
    check_against_reference(CASES[name], backend="cpu")


# The native kernel's own paths: prefill tiles of 48 // G tokens (a 1-token remainder goes to the
# decode path), 32-key chunks in tiles and 16-key chunks in decode that straddle pages when the
# block size or the window start is not aligned, the head dimension in 16-lane vectors (72: a
# masked tail; 80 and 256: more than one register tile), and, with few rows on a multi-threaded
# pool, decode rows split by key ranges and merged.
NATIVE_CASES = {
    "tiles-gqa1-d64-bs16": Case(
        rows=((100, 130), (49, 49), (1, 33), (2, 2)), block_size=16, head_dim=64, q_heads=2, kv_heads=2
    ),
    "tiles-gqa3-d72-bs8": Case(
        rows=((37, 75), (16, 16), (17, 40)), block_size=8, head_dim=72, q_heads=6, kv_heads=2
    ),
    "tiles-gqa4-d80-bs32": Case(
        rows=((30, 95), (1, 70), (13, 13)), block_size=32, head_dim=80, q_heads=8, kv_heads=2
    ),
    "tiles-gqa8-d128-bs16": Case(
        rows=((20, 300), (1, 129), (7, 7)), block_size=16, head_dim=128, q_heads=16, kv_heads=2
    ),
    "d256-gqa2": Case(rows=((9, 40), (1, 77)), block_size=16, head_dim=256, q_heads=4, kv_heads=2),
    "window-softcap-tiles-gqa3": Case(
        rows=((70, 180), (1, 250), (5, 21)),
        block_size=16,
        head_dim=64,
        q_heads=3,
        kv_heads=1,
        sliding_window=37,
        soft_cap=5.0,
    ),
    "window-shorter-than-tile": Case(
        rows=((40, 60), (1, 90)), block_size=8, head_dim=64, q_heads=2, kv_heads=1, sliding_window=5
    ),
    "split-decode": Case(rows=((1, 3000), (1, 45)), block_size=16, head_dim=64, q_heads=6, kv_heads=3),
    "split-decode-window-softcap": Case(
        rows=((1, 2500),),
        block_size=16,
        head_dim=64,
        q_heads=4,
        kv_heads=1,
        sliding_window=1000,
        soft_cap=20.0,
    ),
    "decode-rows-and-prefill-smollm2": Case(
        rows=tuple((1, 17 + 23 * i) for i in range(30)) + ((60, 100),),
        block_size=16,
        head_dim=64,
        q_heads=9,
        kv_heads=3,
    ),
    "bf16-tiles-d72-window": Case(
        rows=((33, 50), (1, 300)),
        block_size=16,
        head_dim=72,
        q_heads=6,
        kv_heads=2,
        dtype="bfloat16",
        sliding_window=40,
    ),
    "bf16-split-decode-d128": Case(
        rows=((1, 2000),), block_size=16, head_dim=128, q_heads=8, kv_heads=2, dtype="bfloat16"
    ),
}


@pytest.mark.parametrize("name", list(NATIVE_CASES))
def test_native_cpu_kernel_paths(name: str) -> None:
    check_against_reference(NATIVE_CASES[name], backend="cpu")


@pytest.mark.parametrize(
    "tiles",
    [dict(q_tile=8, pages_per_step=1, kv_heads_per_program=2), dict(q_tile=3, pages_per_step=3)],
    ids=["page-chunks-2-heads", "odd-tiles"],
)
def test_interpret_tile_parameters(tiles: dict) -> None:
    case = dataclasses.replace(CASES["window-bs16-d64-gqa3"], q_heads=6, kv_heads=2)
    check_against_reference(case, **tiles)


@pytest.mark.parametrize(
    "name",
    ["mixed-bs8-d64-gqa1", "decode-bs16-d128-gqa3", "window-bs16-d64-gqa3", "bf16-mixed-bs16-d128-gqa4"],
)
def test_gpu_kernel_interpreted(name: str) -> None:
    """The Triton variant's logic (row tiles, masked loads/stores, page gathers) in interpret mode."""
    check_against_reference(CASES[name], variant="gpu", interpret=True)


@pytest.mark.parametrize(
    "case",
    [
        Case(
            rows=((1, 37), (9, 50), (1, 1), (17, 17)),
            block_size=16,
            head_dim=64,
            q_heads=6,
            kv_heads=2,
            sliding_window=20,
            soft_cap=5.0,
        ),
        Case(rows=((1, 70), (12, 12)), block_size=16, head_dim=128, q_heads=3, kv_heads=1, dtype="bfloat16"),
    ],
    ids=["f32-window-softcap", "bf16-gqa3"],
)
def test_tpu_kernel_interpreted(case: Case) -> None:
    """The Mosaic variant (DMAs, semaphores, double buffer) under the TPU interpreter.

    The interpreter raises on out-of-bounds reads, starts VMEM as NaN and checks for races
    between DMAs and compute.
    """
    check_against_reference(case, variant="tpu", interpret=TPU_INTERPRET, q_tile=8, pages_per_step=2)
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # private: race detector state

    races = getattr(interpret_pallas_call, "races", None)
    assert races is None or not races.races_found


def test_layer_scan_with_traced_layer() -> None:
    """Inside ``lax.scan`` the layer is a traced scalar and the whole pool is passed each step."""
    case = CASES["mixed-bs8-d64-gqa1"]
    b = build_batch(case)
    kw = attn_kwargs(case)

    @jax.jit
    def all_layers(q, kv, md):
        step = lambda carry, layer: (carry, ragged_paged_attention(q, kv, layer, md, interpret=True, **kw))  # noqa: E731
        return jax.lax.scan(step, None, jnp.arange(LAYERS, dtype=jnp.int32))[1]

    outs = all_layers(b.q, b.kv, b.md)
    for layer in range(LAYERS):
        ref = run_reference(b.q, b.kv, jnp.int32(layer), b.md, **kw)
        np.testing.assert_allclose(np.asarray(outs[layer]), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_dispatch_pallas_interpret_matches_xla() -> None:
    case = CASES["bf16-mixed-bs16-d128-gqa4"]
    b = build_batch(case)
    kw = attn_kwargs(case)
    pallas = run_dispatch(b.q, b.kv, jnp.int32(LAYER), b.md, backend="pallas_interpret", **kw)
    xla = run_dispatch(b.q, b.kv, jnp.int32(LAYER), b.md, backend="xla", **kw)
    np.testing.assert_allclose(
        np.asarray(pallas, np.float32), np.asarray(xla, np.float32), atol=2e-2, rtol=1e-2
    )


def lower_for(platform: str, case: Case):
    """The kernel (``variant=None``: chosen by platform) for ``case``, lowered for ``platform`` on this host.

    A Triton lowering asks for the GPU's compute capability: from jax 0.11 on, a host without a GPU
    must name one (an abstract H100), where jax 0.10 assumed sm_90 itself.
    """
    b = build_batch(case)
    fn = functools.partial(ragged_paged_attention, **attn_kwargs(case))
    layer = jnp.int32(LAYER)
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh) if platform == "cuda" else contextlib.nullcontext():
        return jax.jit(fn).trace(b.q, b.kv, layer, b.md).lower(lowering_platforms=(platform,))


@pytest.mark.parametrize("platform,call", [("tpu", "tpu_custom_call"), ("cuda", "__gpu$xla.gpu.triton")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lowers_for_accelerators(platform: str, call: str, dtype: str) -> None:
    """``variant=None`` picks the kernel by lowering platform; lowering runs on a CPU-only host.

    This checks Pallas -> Mosaic / Triton IR. Mosaic's layout passes and the Triton -> PTX
    compile run later, on the device's compiler (see ``python -m benchmarks.kernels --compile-check``).
    """
    case = dataclasses.replace(CASES["window-softcap-bs32-d128-gqa1"], q_heads=12, kv_heads=3, dtype=dtype)
    assert call in lower_for(platform, case).as_text()


def triton_dots(lowered) -> list[tuple[str, int]]:
    """``(input type, inputPrecision)`` of every ``tt.dot`` in the Triton modules of a lowered program."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt  # private: the Triton dialect jaxlib bundles

    dots = []

    def walk(op) -> None:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.operation.name == "stablehlo.custom_call" and "triton" in str(
                        inner.attributes["call_target_name"]
                    ):
                        config = ir.DictAttr(inner.attributes["mhlo.backend_config"])
                        with ir.Context() as ctx:
                            tt.register_dialect(ctx)
                            module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
                            text = module.operation.get_asm(print_generic_op_form=True)
                        dots.extend(
                            (m.group(2), int(m.group(1)))
                            for m in re.finditer(
                                r'"tt\.dot"\(.*?inputPrecision = (\d+) : i32.*?: \(tensor<\d+x\d+x(\w+)>',
                                text,
                            )
                        )
                    walk(inner.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    return dots


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_kernel_dots_are_full_float32_for_float32_inputs(dtype: str) -> None:
    """Triton's default for a float32 ``dot`` is TF32 (inputs rounded to 10 mantissa bits: errors of
    ~1e-3 against the reference); the kernel asks for IEEE float32 when its inputs are float32 and
    leaves 16-bit dots as they are (exact on tensor cores)."""
    from jax._src.lib.triton import dialect as tt

    case = dataclasses.replace(CASES["window-bs16-d64-gqa3"], dtype=dtype)
    dots = triton_dots(lower_for("cuda", case))
    assert len(dots) == 2  # q @ k^T and p @ v
    ieee = int(tt.InputPrecision.IEEE)
    if dtype == "float32":
        assert dots == [("f32", ieee)] * 2
    else:
        assert all(t == "bf16" and p != ieee for t, p in dots)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_dots_are_highest_for_float32_inputs(dtype: str) -> None:
    """The reference the kernels are checked against on a GPU must itself be float32 there: its dots
    (and so the ``xla`` backend's) carry ``HIGHEST`` precision for float32 inputs, none for 16-bit ones."""
    case = dataclasses.replace(CASES["window-bs16-d64-gqa3"], dtype=dtype)
    b = build_batch(case)
    fn = functools.partial(ragged_paged_attention_reference, **attn_kwargs(case))
    text = jax.jit(fn).trace(b.q, b.kv, jnp.int32(LAYER), b.md).lower(lowering_platforms=("cuda",)).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 2
    assert all(("HIGHEST" in line) == (dtype == "float32") for line in dots)


def test_rejects_bad_shapes() -> None:
    b = build_batch(CASES["mixed-bs8-d64-gqa1"])
    with pytest.raises(ValueError, match="incompatible"):
        ragged_paged_attention(b.q[:, :1], b.kv[:, :, :, :, :, :32], LAYER, b.md, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="power-of-two"):
        ragged_paged_attention(b.q, b.kv, LAYER, b.md, scale=1.0, variant="gpu", interpret=True, q_tile=12)


# ------------------------------------------------------------------------------ KV ops


KV_WRITE_BACKENDS = [
    "xla",
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not native_kernel_available(), reason="native CPU kernel not built")
    ),
]


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("backend", KV_WRITE_BACKENDS)
def test_write_kv_lands_at_slots_in_place_and_skips_padding(backend: str, dtype) -> None:
    """Every backend writes exactly the rows of valid slots (padding: -1 or past the pool), into the
    donated page array itself (no copy of the pool)."""
    L, NB, bs, Hkv, D = 3, 6, 4, 2, 8
    rng = np.random.default_rng(1)
    pages = rng.standard_normal((L, 2, NB, bs, Hkv, D)).astype(dtype)
    k = rng.standard_normal((6, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((6, Hkv, D)).astype(np.float32)
    slots = np.array([4 * 3 + 1, PAD_SLOT, 0, 4 * 5 + 3, PAD_SLOT, NB * bs], np.int32)
    write = jax.jit(functools.partial(dispatch.write_kv, backend=backend), donate_argnums=(0,))
    device_pages = jnp.asarray(pages)
    before = device_pages.unsafe_buffer_pointer()
    out = write(device_pages, jnp.int32(2), k, v, slots)
    assert out.unsafe_buffer_pointer() == before and out.dtype == jnp.dtype(dtype)
    expected = pages.copy()
    for t, s in enumerate(slots):
        if 0 <= s < NB * bs:
            expected[2, 0, s // bs, s % bs] = k[t].astype(dtype)
            expected[2, 1, s // bs, s % bs] = v[t].astype(dtype)
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_copy_blocks_copies_every_layer_and_skips_negative_dst() -> None:
    L, NB, bs, Hkv, D = 2, 7, 4, 1, 4
    pages = np.random.default_rng(2).standard_normal((L, 2, NB, bs, Hkv, D)).astype(np.float32)
    src = np.array([1, 3, 2], np.int32)
    dst = np.array([5, -1, 0], np.int32)
    out = np.asarray(jax.jit(copy_blocks)(jnp.asarray(pages), src, dst))
    expected = pages.copy()
    expected[:, :, 5] = pages[:, :, 1]
    expected[:, :, 0] = pages[:, :, 2]
    np.testing.assert_array_equal(out, expected)


def test_auto_backend_on_cpu_falls_back_to_xla_for_float16() -> None:
    """The native kernel takes float32/bfloat16 only: float16 models get the XLA backend, and a
    direct call with float16 is refused rather than casting (copying) the page pool."""
    from jaxpaged.kernels.dispatch import resolve_backend

    assert resolve_backend("auto", "cpu", jnp.float32) == "cpu"
    assert resolve_backend("auto", "cpu", jnp.float16) == "xla"
    b = build_batch(CASES["mixed-bs8-d64-gqa1"])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        paged_attention(
            b.q.astype(jnp.float16), b.kv.astype(jnp.float16), LAYER, b.md, backend="cpu", scale=0.1
        )
