"""The native CPU matmul (pallas_kernels/cpu_matmul.py) against numpy references.

float32 is checked against float64 numpy with the worst-case bound of a K-term float32 dot
product; bfloat16 against float32 numpy on the bfloat16-rounded inputs, allowing float32
accumulation in another order plus the final rounding to bfloat16.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxpaged.kernels.cpu_matmul import matmul, native_matmul_available, pack_quantized, pack_weight, use_amx

pytestmark = pytest.mark.skipif(not native_matmul_available(), reason="native matmul kernel not built")

U32 = 2.0**-24  # float32 unit roundoff
BF16_U = 2.0**-8  # bfloat16 unit roundoff (8 significant bits)

# (M, K, N): M = 1, M around the 12-row micro-kernel tile, N not a multiple of the 32-column panel,
# odd K (bfloat16 pairs), several row blocks, and the model's shapes.
SHAPES = [
    (1, 1, 1),
    (1, 5, 7),
    (3, 1, 33),
    (2, 2, 32),
    (1, 576, 960),
    (7, 577, 100),
    (12, 64, 64),
    (13, 130, 65),
    (25, 31, 95),
    (37, 575, 31),
    (64, 576, 960),
    (300, 1536, 200),
    (129, 577, 161),
]
MODEL_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]


def _data(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)


def _native(x, w, dtype):
    return np.asarray(
        matmul(jnp.asarray(x, dtype), jnp.asarray(pack_weight(w, dtype)), w.shape[1]), np.float64
    )


def _check_f32(got, x, w):
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64
    bound = (x.shape[1] + 2) * U32 * (np.abs(x64) @ np.abs(w64)) + 1e-30
    assert got.shape == ref.shape
    np.testing.assert_array_less(np.abs(got - ref), bound)


def _check_bf16(got, x, w):
    xb = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    wb = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    ref = (xb @ wb).astype(np.float64)  # float32 accumulation of the bfloat16-rounded inputs
    # Two float32 sums in different orders, then the output rounded to bfloat16.
    accumulated = 2 * (x.shape[1] + 2) * U32 * (np.abs(xb.astype(np.float64)) @ np.abs(wb.astype(np.float64)))
    bound = BF16_U * (np.abs(ref) + accumulated) + accumulated + 1e-30
    assert got.shape == ref.shape
    np.testing.assert_array_less(np.abs(got - ref), bound)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_float32(m, k, n):
    x, w = _data(m, k, n)
    _check_f32(_native(x, w, jnp.float32), x, w)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_bfloat16(m, k, n):
    x, w = _data(m, k, n, seed=1)
    _check_bf16(_native(x, w, jnp.bfloat16), x, w)


@pytest.mark.parametrize("k,n", MODEL_SHAPES)
@pytest.mark.parametrize("m", [1, 19, 64])
def test_model_shapes(m, k, n):
    x, w = _data(m, k, n, seed=m)
    _check_f32(_native(x, w, jnp.float32), x, w)
    _check_bf16(_native(x, w, jnp.bfloat16), x, w)


@pytest.mark.parametrize("m,k,n", [(1, 5, 7), (13, 130, 65), (64, 576, 49152 // 8), (37, 575, 31)])
def test_bfloat16_in_float32_out(m, k, n):
    """float32 out skips the final rounding: within the float32 accumulation bound of the
    bfloat16-rounded inputs, far tighter than bfloat16 out, and equal to it once rounded."""
    x, w = _data(m, k, n, seed=2)
    xb, packed = jnp.asarray(x, jnp.bfloat16), jnp.asarray(pack_weight(w, jnp.bfloat16))
    got = matmul(xb, packed, n, jnp.float32)
    assert got.dtype == jnp.float32
    wide = np.asarray(got, np.float64)
    xr = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    wr = w.astype(ml_dtypes.bfloat16).astype(np.float64)
    bound = 2 * (k + 2) * U32 * (np.abs(xr) @ np.abs(wr)) + 1e-30
    np.testing.assert_array_less(np.abs(wide - xr @ wr), bound)
    np.testing.assert_array_equal(
        np.asarray(got.astype(jnp.bfloat16), np.float32), np.asarray(matmul(xb, packed, n), np.float32)
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_under_jit_with_several_m(dtype):
    k, n = 577, 70
    _, w = _data(1, k, n)
    packed = jnp.asarray(pack_weight(w, dtype))
    step = jax.jit(lambda x, p: matmul(x, p, n) * 2)
    check = _check_f32 if dtype == jnp.float32 else _check_bf16
    for m in (1, 2, 5, 12, 13, 24, 31, 100, 1):
        x, _ = _data(m, k, n, seed=m)
        out = step(jnp.asarray(x, dtype), packed)
        assert out.dtype == dtype and out.shape == (m, n)
        check(np.asarray(out, np.float64) / 2, x, w)


@pytest.mark.parametrize(
    "dtype,out_dtype", [(jnp.float32, None), (jnp.bfloat16, None), (jnp.bfloat16, jnp.float32)]
)
def test_num_rows_computes_leading_rows_and_zeros_the_rest(dtype, out_dtype):
    """One program (num_rows traced) serves every count: rows below it are the full product's,
    rows from it on are zeros even where x holds values (padding); counts past M mean all rows."""
    m, k, n = 40, 577, 70
    x, w = _data(m, k, n)
    packed = jnp.asarray(pack_weight(w, dtype))
    full = np.asarray(matmul(jnp.asarray(x, dtype), packed, n, out_dtype), np.float64)
    step = jax.jit(lambda x, p, r: matmul(x, p, n, out_dtype, r))
    for rows in (0, 1, 13, 39, 40, 100, -3):
        got = np.asarray(step(jnp.asarray(x, dtype), packed, jnp.int32(rows)), np.float64)
        live = min(max(rows, 0), m)
        np.testing.assert_array_equal(got[:live], full[:live])
        assert not got[live:].any()
    assert step._cache_size() == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_row_is_the_same_alone_and_anywhere_in_a_batch(dtype):
    """Each output is one sum over k in order whatever the rows around it: a row computed alone
    equals it inside a batch at any place (every row-group size and position, several row blocks,
    the rows as the kernels lay them out), to the last bit; so batching cannot change a token."""
    m, k, n = 300, 1537, 70  # several row blocks whether they hold 448 KiB or 1.5 MiB of x
    x, w = _data(m, k, n, seed=3)
    packed = jnp.asarray(pack_weight(w, dtype))
    xs = jnp.asarray(x, dtype)
    try:
        use_amx(False)  # AMX tiles sum in their own order, for row counts the vector kernels would not take
        full = np.asarray(matmul(xs, packed, n), np.float64)
        for lo, hi in ((0, 1), (5, 6), (299, 300), (7, 12), (40, 53), (100, 300)):
            np.testing.assert_array_equal(np.asarray(matmul(xs[lo:hi], packed, n), np.float64), full[lo:hi])
    finally:
        use_amx(True)


def test_large_values_and_zero_rows():
    """Rows of zeros give zeros; values near float32's range do not overflow in the packing."""
    x, w = _data(20, 33, 45)
    x[3] = 0.0
    x[5] *= 1e30
    got = _native(x, w, jnp.float32)
    assert np.all(got[3] == 0.0)
    _check_f32(got, x, w)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_empty_m_and_k(dtype):
    _, w = _data(1, 9, 40)
    assert matmul(jnp.zeros((0, 9), dtype), jnp.asarray(pack_weight(w, dtype)), 40).shape == (0, 40)
    out = matmul(jnp.ones((3, 0), dtype), jnp.asarray(pack_weight(w[:0], dtype)), 40)
    assert out.shape == (3, 40) and out.dtype == dtype and not np.asarray(out, np.float32).any()


@pytest.mark.parametrize("k", [6, 7])
def test_packed_layout_is_as_documented(k):
    n = 40
    # (2c + 1) * 2**r: distinct for every (r, c) and exact in bfloat16
    w = ((2 * np.arange(n) + 1)[None, :] * 2.0 ** np.arange(k)[:, None]).astype(np.float32)
    f32 = pack_weight(w, jnp.float32)
    bf16 = pack_weight(w, jnp.bfloat16)
    assert f32.shape == bf16.shape == (2, k, 32)
    assert f32.dtype == np.float32 and bf16.dtype == jnp.bfloat16
    for p in range(2):
        for j in range(32):
            col = 32 * p + j
            for r in range(k):
                assert f32[p, r, j] == (w[r, col] if col < n else 0)
            for q in range(k // 2):
                for h in range(2):
                    i = j  # position in the row of 32 values
                    src_col = 32 * p + 16 * h + i // 2
                    expect = w[2 * q + i % 2, src_col] if src_col < n else 0
                    assert float(bf16[p, 2 * q + h, i]) == expect
            if k % 2:
                assert float(bf16[p, k - 1, j]) == (w[k - 1, col] if col < n else 0)


def test_errors():
    x, w = _data(4, 8, 10)
    packed = jnp.asarray(pack_weight(w, jnp.float32))
    with pytest.raises(ValueError, match="bfloat16 but the packed weight is float32"):
        matmul(jnp.asarray(x, jnp.bfloat16), packed, 10)
    with pytest.raises(ValueError, match="K does not match"):
        matmul(jnp.asarray(x[:, :7]), packed, 10)
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        matmul(jnp.asarray(x, jnp.float16), packed.astype(jnp.float16), 10)
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        pack_weight(w, np.float16)
    with pytest.raises(ValueError, match="out_dtype must be x's dtype"):
        matmul(jnp.asarray(x), packed, 10, jnp.bfloat16)
    with pytest.raises(ValueError, match="n=40 does not match"):
        matmul(jnp.asarray(x), packed, 40)
    with pytest.raises(ValueError, match="2-D"):
        pack_weight(w[None], jnp.float32)
    with pytest.raises(ValueError, match=r"expected x\[M, K\]"):
        matmul(jnp.asarray(x)[None], packed, 10)
    with pytest.raises(ValueError, match="num_rows must be a scalar"):
        matmul(jnp.asarray(x), packed, 10, num_rows=jnp.array([2, 3], jnp.int32))


# ---------------------------------------------------------------- quantized weights


def _affine(k, n, bits, seed=0):
    """Random affine blocks (float16 scales and offsets, as GGUF stores them) and the float32 weight
    they stand for, computed in float64 and rounded once (the exact rebuild's value)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1 << bits, (k, n))
    scale = rng.standard_normal((k // 32, n)).astype(np.float16).astype(np.float32)
    offset = rng.standard_normal((k // 32, n)).astype(np.float16).astype(np.float32)
    w = (codes * np.repeat(scale, 32, 0).astype(np.float64) + np.repeat(offset, 32, 0)).astype(np.float32)
    return codes, scale, offset, w


# M = 1, the 8-row groups of the in-register path and its 16-row limit (AVX-512; AVX2: 2-4 rows in registers, 5-16
# block by block), the in-cache rebuild, several row blocks.
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16, 17, 40, 300])
@pytest.mark.parametrize("bits,k,n", [(4, 576, 960), (8, 64, 49), (4, 1536, 200), (8, 576, 33)])
def test_quantized_weight_is_bit_identical_to_its_dense_float32_weight(m, bits, k, n):
    codes, scale, offset, w = _affine(k, n, bits, seed=m)
    quant = pack_quantized(codes, scale, offset)
    assert quant.dtype == np.uint8 and quant.shape == (-(-n // 32), k * (bits * 4 + 8))
    x = np.random.default_rng(1).standard_normal((m + 3, k)).astype(np.float32)
    got = np.asarray(matmul(jnp.asarray(x), jnp.asarray(quant), n, num_rows=m))
    dense = np.asarray(matmul(jnp.asarray(x), jnp.asarray(pack_weight(w, jnp.float32)), n, num_rows=m))
    np.testing.assert_array_equal(got, dense)
    _check_f32(got[:m].astype(np.float64), x[:m], w)
    assert not got[m:].any()


# The in-register path (<= 12 rows in 8-row groups), the dense kernels on a rebuilt panel (vectors, or
# tiles on an AMX CPU, as the dense weight's units take them), several row blocks; bfloat16 or
# float32 out (logits).
@pytest.mark.parametrize("amx", [False, True] if use_amx() else [False])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m", [1, 9, 12, 13, 40, 300])
@pytest.mark.parametrize("bits,k,n", [(4, 576, 960), (8, 64, 49)])
def test_quantized_weight_is_bit_identical_to_its_dense_bfloat16_weight(m, bits, k, n, out_dtype, amx):
    """bfloat16 x: each rebuilt weight is rounded to bfloat16 as pack_weight rounds the dequantized
    one, and the sums are the dense kernel's, so the outputs are equal to the last bit."""
    codes, scale, offset, w = _affine(k, n, bits, seed=m)
    x = np.random.default_rng(2).standard_normal((m + 3, k)).astype(np.float32)
    xb = jnp.asarray(x, jnp.bfloat16)
    try:
        use_amx(amx)
        got = np.asarray(
            matmul(xb, jnp.asarray(pack_quantized(codes, scale, offset)), n, out_dtype, num_rows=m),
            np.float64,
        )
        dense = np.asarray(
            matmul(xb, jnp.asarray(pack_weight(w, jnp.bfloat16)), n, out_dtype, num_rows=m), np.float64
        )
    finally:
        use_amx(True)
    np.testing.assert_array_equal(got, dense)
    _check_bf16(got[:m], x[:m], w)
    assert not got[m:].any()


def test_quantized_layout_is_as_documented():
    k, n = 64, 40
    codes, scale, offset, _ = _affine(k, n, 4)
    quant = pack_quantized(codes, scale, offset)
    for p in range(2):
        panel = quant[p]
        params = panel[k * 16 :].view("<f4").reshape(k // 32, 2, 32)
        for j in range(32):
            col = 32 * p + j
            real = col < n
            for r in range(k):
                byte = panel[r * 16 + j % 16]
                assert (byte >> (4 * (j // 16))) & 0xF == (codes[r, col] if real else 0)
            for b in range(k // 32):
                assert params[b, 0, j] == (scale[b, col] if real else 0)
                assert params[b, 1, j] == (offset[b, col] if real else 0)
    eight = pack_quantized(codes + 16, scale, offset)  # a code above 15: one byte per code
    assert eight.shape == (2, k * 40) and eight[0, 32 + 3] == codes[1, 3] + 16


def test_quantized_errors():
    codes, scale, offset, _ = _affine(64, 10, 4)
    quant = jnp.asarray(pack_quantized(codes, scale, offset))
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        matmul(x.astype(jnp.float16), quant, 10)
    with pytest.raises(ValueError, match="out_dtype must be x's dtype"):
        matmul(x, quant, 10, jnp.bfloat16)
    with pytest.raises(ValueError, match="does not fit"):
        matmul(x[:, :32], quant, 10)
    with pytest.raises(ValueError, match="n=40 does not match"):
        matmul(x, quant, 40)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_quantized(codes[:48], scale, offset)
    with pytest.raises(ValueError, match="scale and offset"):
        pack_quantized(codes, scale[:, :5], offset)
    with pytest.raises(ValueError, match="0..255"):
        pack_quantized(codes + 250, scale, offset)


@pytest.mark.skipif(not use_amx(), reason="no AMX on this CPU (or the kernel was built without it)")
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
    "m,k,n", [(1, 576, 960), (15, 64, 33), (17, 576, 100), (33, 1536, 64), (300, 576, 200)]
)
def test_bfloat16_on_amx_tiles_and_on_vectors(m, k, n, out_dtype):
    """On an AMX CPU bfloat16 with more than 12 rows runs on tiles (K a multiple of 32), within the
    bfloat16 bound of the reference whatever the rows left over after 16 / 32; fewer rows stay on
    the vector kernel."""
    x, w = _data(m, k, n, seed=k + m)
    call = lambda: np.asarray(
        matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(pack_weight(w, jnp.bfloat16)), n, out_dtype),
        np.float64,
    )
    try:
        assert use_amx(False) is False
        vectors = call()
        assert use_amx(True) is True
        tiles = call()
    finally:
        use_amx(True)
    for got in (vectors, tiles):
        _check_bf16(got, x, w)
    if m <= 12:
        np.testing.assert_array_equal(vectors, tiles)
    elif out_dtype == jnp.float32:  # float32 sums in another order differ somewhere: the tiles did run
        assert not np.array_equal(vectors, tiles)


def test_auto_backend_takes_xla_for_float32_dense_weights_without_vectors(monkeypatch):
    """Built without AVX-512 or AVX2 the native matmul is portable loops, slower than XLA's dot in float32:
    ``auto`` then takes XLA for dense float32 weights, and the native matmul for bfloat16 and for
    quantized weights (which only it runs); an explicit choice is kept."""
    from jaxpaged.kernels import cpu_matmul, resolve_matmul_backend

    for vectorized in (True, False):
        monkeypatch.setattr(cpu_matmul, "native_matmul_vectorized", lambda: vectorized)
        assert resolve_matmul_backend("auto", "cpu", jnp.float32) == ("cpu" if vectorized else "xla")
        assert resolve_matmul_backend("auto", "cpu", jnp.float32, quantized=True) == "cpu"
        assert resolve_matmul_backend("auto", "cpu", jnp.bfloat16) == "cpu"
        assert resolve_matmul_backend("cpu", "cpu", jnp.float32) == "cpu"
        assert resolve_matmul_backend("auto", "cpu", jnp.float32, num_devices=2) == "xla"


# ---------------------------------------------------------------- weights stacked over layers


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "q4", "q8"])
def test_stacked_weight_layer_is_bit_identical_to_its_own_weight(kind):
    """``layer`` reads one weight of a stack in place: the product equals the product with that weight
    alone, to the bit, for every layer (a wrong offset would read another layer's weight or run off
    the end of the stack), under jit too."""
    k, n, m = 64, 49, 5
    dtype = jnp.bfloat16 if kind == "bfloat16" else jnp.float32
    if kind in ("q4", "q8"):
        weights = [pack_quantized(*_affine(k, n, int(kind[1:]), seed=i)[:3]) for i in range(3)]
    else:
        weights = [pack_weight(_data(1, k, n, seed=i)[1], dtype) for i in range(3)]
    stacked = jnp.asarray(np.stack(weights))
    x = jnp.asarray(_data(m, k, n, seed=9)[0], dtype)
    for layer, w in enumerate(weights):
        alone = np.asarray(matmul(x, jnp.asarray(w), n, num_rows=4))
        got = np.asarray(matmul(x, stacked, n, num_rows=4, layer=layer))
        jitted = np.asarray(
            jax.jit(matmul, static_argnums=(2,), static_argnames="layer")(x, stacked, n, layer=layer)
        )
        np.testing.assert_array_equal(got, alone)
        np.testing.assert_array_equal(jitted[:4], alone[:4])
    assert not np.array_equal(
        np.asarray(matmul(x, stacked, n, layer=0)), np.asarray(matmul(x, stacked, n, layer=1))
    )


def test_stacked_weight_errors():
    x, w = _data(4, 8, 10)
    stacked = jnp.asarray(np.stack([pack_weight(w, jnp.float32)] * 2))
    for layer in (2, -1):
        with pytest.raises(ValueError, match=f"layer {layer} is not in the stacked weight"):
            matmul(jnp.asarray(x), stacked, 10, layer=layer)
    with pytest.raises(ValueError, match=r"expected a packed weight \[P, K, 32\]"):
        matmul(jnp.asarray(x), stacked, 10)  # a stack without a layer
    with pytest.raises(ValueError, match="K does not match"):
        matmul(jnp.asarray(x[:, :7]), stacked, 10, layer=1)
