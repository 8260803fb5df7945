"""The native matmul (pallas_kernels/csrc/matmul_cpu.cc) built in each instruction-set variant this
CPU runs — AVX-512, AVX2 + FMA (column halves of 16, at most 6 rows), portable loops — and called
through XLA's FFI: each variant's products against numpy, its quantized weights bit-identical to
the dense dequantized ones, and float32 sums bit-identical between the AVX-512 and AVX2 kernels
(one fused multiply-add per k, in order, in both). The installed build is tested in
test_cpu_matmul.py; this is where the variants it was not built as are checked."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

from native_variants import CSRC, CXX, needs_x86_compiler, runnable_variants
from jaxpaged.kernels.cpu_matmul import QUANT_BLOCK, pack_quantized, pack_weight

pytestmark = needs_x86_compiler

# (M, K, N): one row; row groups of 5, 6 and 7 rows (AVX2 splits 13 rows 5 + 4 + 4); last panels of
# 13, 4, 26, 17 and 13 columns (AVX2: the second half partly or not at all); odd K (bfloat16's
# unpaired last row).
SHAPES = ((1, 64, 32), (5, 96, 45), (7, 63, 100), (13, 128, 90), (40, 96, 49), (6, 32, 13))


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """{variant: (dense target, quantized target)}, each variant built and registered with XLA."""
    include = Path(jaxlib.__file__).parent / "include"
    out, libraries = {}, []
    for name, target in runnable_variants().items():
        path = tmp_path_factory.mktemp(name) / "matmul_cpu.so"
        subprocess.run(
            [
                CXX,
                "-std=c++17",
                "-O2",
                "-shared",
                "-fPIC",
                "-fopenmp-simd",
                "-ffp-contract=off",
                "-w",
                *target,
                f"-I{include}",
                str(CSRC / "matmul_cpu.cc"),
                "-o",
                str(path),
            ],
            check=True,
        )
        lib = ctypes.CDLL(str(path))
        assert lib.JaxpagedMatmulVectorized() == (name != "portable"), name
        names = (f"jaxpaged_test_matmul_{name}", f"jaxpaged_test_matmul_quant_{name}")
        for target_name, symbol in zip(names, (lib.JaxpagedMatmulCpu, lib.JaxpagedMatmulQuantCpu)):
            jax.ffi.register_ffi_target(target_name, jax.ffi.pycapsule(symbol), platform="cpu")
        libraries.append(lib)
        out[name] = names
    yield out
    del libraries


def _call(target: str, x, packed, n: int, out_dtype, rows: int) -> np.ndarray:
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), out_dtype))
    return np.asarray(
        call(x, jnp.asarray(packed), jnp.asarray(rows, jnp.int32), layer=np.int64(0)).astype(jnp.float32)
    )


def _problem(m: int, k: int, n: int, seed: int):
    """x, a Q4_1-style quantized weight (codes, scale, offset; K rounded up to blocks of 32) and the
    first K rows of its dequantized float32 weight."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32)
    kq = -(-k // QUANT_BLOCK) * QUANT_BLOCK
    codes = rng.integers(0, 16, (kq, n))
    scale = (
        (rng.uniform(0.5, 1.5, (kq // QUANT_BLOCK, n)) / 8 / np.sqrt(k)).astype(np.float16).astype(np.float32)
    )
    offset = (-scale * 7.5).astype(np.float16).astype(np.float32)
    w = codes * np.repeat(scale, QUANT_BLOCK, 0) + np.repeat(
        offset, QUANT_BLOCK, 0
    )  # exact product, one rounding
    return x, (codes, scale, offset), w[:k].astype(np.float32)


@pytest.mark.parametrize(
    "dtype, out_dtype",
    [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32)],
)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_every_variant_matches_numpy_and_its_quantized_weights(targets, m, k, n, dtype, out_dtype):
    """Dense products within float32 rounding of numpy's float64 product (of the bfloat16-rounded
    operands for bfloat16), rows past ``rows`` zero; with K a multiple of 32, the quantized weight
    gives exactly the dense product of its dequantized weight."""
    x, quant, w = _problem(m, k, n, seed=m * 1000 + k + n)
    xd = jnp.asarray(x, dtype)
    real = max(1, m - 2)
    want = np.asarray(xd, np.float64)[:real] @ np.asarray(jnp.asarray(w, dtype), np.float64)
    tolerance = 2e-2 if out_dtype == jnp.bfloat16 else 1e-4
    for name, (dense, quantized) in targets.items():
        got = _call(dense, xd, pack_weight(w, dtype), n, out_dtype, real)
        np.testing.assert_allclose(got[:real], want, rtol=tolerance, atol=tolerance, err_msg=name)
        assert not got[real:].any(), name
        if k % QUANT_BLOCK == 0:
            from_codes = _call(quantized, xd, pack_quantized(*quant), n, out_dtype, real)
            np.testing.assert_array_equal(from_codes, got, err_msg=name)


@pytest.mark.parametrize("m, k, n", SHAPES)
def test_avx512_and_avx2_sum_alike(targets, m, k, n):
    """Float32, and bfloat16 on the vector kernels (at most 12 rows: more may take AMX tiles), round
    exactly alike in the AVX-512 and AVX2 variants; the portable loops (no fused multiply-add)
    differ."""
    if not {"avx512", "avx2"} <= set(targets):
        pytest.skip("needs a CPU that runs both the AVX-512 and the AVX2 variant")
    x, _, w = _problem(m, k, n, seed=7)
    cases = [(jnp.float32, jnp.float32)] + ([(jnp.bfloat16, jnp.float32)] if m <= 12 else [])
    for dtype, out_dtype in cases:
        xd, packed = jnp.asarray(x, dtype), pack_weight(w, dtype)
        avx512, avx2 = (_call(targets[v][0], xd, packed, n, out_dtype, m) for v in ("avx512", "avx2"))
        np.testing.assert_array_equal(avx512, avx2, err_msg=str(dtype))


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_bfloat16_rows_do_not_depend_on_their_batch(targets, out_dtype):
    """A bfloat16 row's product is the same bits alone as in a batch of 40 (which AVX2 runs on
    widened float32 rows and panels, 5 rows on the pair kernels), odd K and a partial panel
    included. (Not the AVX-512 variant, whose batches may take AMX tiles, summing in another order.)"""
    for k, n in ((96, 70), (63, 49)):
        x, _, w = _problem(40, k, n, seed=k)
        xd, packed = jnp.asarray(x, jnp.bfloat16), pack_weight(w, jnp.bfloat16)
        for name in set(targets) - {"avx512"}:
            batch = _call(targets[name][0], xd, packed, n, out_dtype, 40)
            alone = _call(targets[name][0], xd[:5], packed, n, out_dtype, 5)
            np.testing.assert_array_equal(batch[:5], alone, err_msg=f"{name} K={k}")


def test_variants_differ_where_they_should(targets):
    """Guards the comparisons above against comparing one build with itself: the portable loops
    round each product before adding it, the vector kernels fuse them."""
    x, _, w = _problem(8, 512, 64, seed=3)
    packed = pack_weight(w, jnp.float32)
    outs = {
        name: _call(dense, jnp.asarray(x), packed, 64, jnp.float32, 8) for name, (dense, _) in targets.items()
    }
    vectors = [name for name in outs if name != "portable"]
    if not vectors:
        pytest.skip("this CPU runs only the portable variant")
    assert not np.array_equal(outs["portable"], outs[vectors[0]])
