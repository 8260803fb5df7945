"""Dense matmul on the CPU through a C++ kernel called by XLA's FFI (``csrc/matmul_cpu.cc``).

XLA's CPU dot uses the two cores of the development machines unevenly, is no faster in bfloat16
than in float32 (it does not use ``vdpbf16ps``), and streams weights slowly at small batch. The
native kernel takes a weight packed once on the host (:func:`pack_weight`) into panels its
register-blocked micro-kernels (12 rows x 32 columns) read front to back, streams each panel once
for all rows when there are few rows, and spreads (row block, panel) units over XLA's intra-op
thread pool. float32 computes in float32; bfloat16 multiplies bfloat16 pairs and accumulates in
float32 (AVX512-BF16 where the CPU has it; AMX tiles where it has those and K is a multiple of 32,
see ``use_amx``), then rounds the output to bfloat16 (nearest even), or
returns the float32 sums as they are when asked (``out_dtype``).

Packed layout (``pack_weight(w, dtype)`` for ``w[K, N]``): an array ``[P, K, 32]`` of ``dtype``
with ``P = ceil(N / 32)`` panels of 32 columns, columns past ``N`` zero. Panel ``p`` covers
columns ``32p .. 32p + 31``; its ``K * 32`` elements are contiguous:

* float32: ``packed[p, k, j] = w[k, 32p + j]`` (row-major ``K x 32`` panels).
* bfloat16: the rows in pairs, each pair interleaved column by column (the operand layout of
  ``vdpbf16ps``): ``packed[p, 2q + h, i] = w[2q + i % 2, 32p + 16h + i // 2]``, i.e. memory order
  ``w[2q, c], w[2q+1, c]`` for ``c = 32p .. 32p + 31``. For odd ``K`` the last row
  ``packed[p, K - 1, j] = w[K - 1, 32p + j]`` is stored plain.

Quantized weights (``pack_quantized``): a weight that came as GGUF-style affine blocks
(``w[k, c] = codes[k, c] * scale[k // 32, c] + offset[k // 32, c]``, codes in 0..15 or 0..255, as
llama.cpp's Q4_0 / Q4_1 / Q8_0 store them) can be kept that way: 5 or 9 bits per weight instead of
32 (or 16). The kernel rebuilds each weight exactly (``codes * scale`` is exact in float32 for such
codes and float16 scales, so the one rounding is the addition's), for bfloat16 ``x`` rounds it to
bfloat16 as ``pack_weight`` would, and sums in the dense kernel's order, so the result is
bit-identical to the dense matmul of the dequantized weight in either dtype. Few rows rebuild the
weights in registers as they stream them (a decode step reads a sixth, in bfloat16 a third, of the
bytes); many rows rebuild each panel once into cache and run the dense micro-kernels (or tiles).
Layout: a uint8 array ``[P, K * (c + 8)]``, panel ``p`` (columns ``32p .. 32p + 31``) holding its
codes, ``K`` rows of ``c`` bytes (``c = 16``: byte ``j`` holds column ``j`` in its low nibble and
column ``j + 16`` in its high one; ``c = 32``: one byte per column), then per block of 32 rows the
32 columns' scales and the 32 offsets (float32, little-endian).

This module knows nothing about models; it only checks shapes and dtypes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels.native import NATIVE_DTYPES, layer_shape, load_library, register_cpu_targets, row_count
from jaxpaged.math_utils import cdiv

_LIBRARY = "jaxpaged.kernels._matmul_cpu"
_TARGET, _QUANT_TARGET = "jaxpaged_matmul_cpu", "jaxpaged_matmul_quant_cpu"
PANEL = 32  # columns per packed panel
QUANT_BLOCK = 32  # k rows sharing a column's scale and offset


@functools.cache
def native_matmul_available() -> bool:
    """Load the compiled kernel and register it with XLA (once); False if it was not built."""
    return register_cpu_targets(
        _LIBRARY, {_TARGET: "JaxpagedMatmulCpu", _QUANT_TARGET: "JaxpagedMatmulQuantCpu"}
    )


@functools.cache
def native_matmul_vectorized() -> bool:
    """Whether the native matmul was built for AVX-512 or AVX2 + FMA vectors (``setup.py`` targets
    the building machine's CPU); False for the portable loops of a CPU with neither, or without the
    kernel."""
    return native_matmul_available() and bool(load_library(_LIBRARY).JaxpagedMatmulVectorized())


def use_amx(enable: bool | None = None) -> bool:
    """Whether bfloat16 products run on AMX tiles (Intel Sapphire Rapids and later: the CPU has
    AMX-BF16 and Linux grants this process the tile state). ``enable`` switches it for the process
    (default on where usable; benchmarks and tests compare the paths). False without the kernel."""
    if not native_matmul_available():
        return False
    return bool(load_library(_LIBRARY).JaxpagedMatmulAmx(-1 if enable is None else int(enable)))


def _checked_dtype(dtype) -> np.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in NATIVE_DTYPES:
        raise ValueError(f"the native CPU matmul supports float32 and bfloat16, got {dtype}")
    return dtype


def pack_weight(w: np.ndarray, dtype) -> np.ndarray:
    """``w[K, N]`` (host array) -> the packed ``[ceil(N/32), K, 32]`` weight in ``dtype`` (see the module doc).
    One pass over the weight (cast and reorder together); it runs once per weight at load."""
    dtype = _checked_dtype(dtype)
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"pack_weight expects a 2-D weight [K, N], got shape {w.shape}")
    k, n = w.shape
    panels = cdiv(n, PANEL)
    if n % PANEL:
        w = np.pad(w, ((0, 0), (0, panels * PANEL - n)))
    by_panel = w.reshape(k, panels, PANEL).transpose(1, 0, 2)  # [P, K, 32], a view
    out = np.empty((panels, k, PANEL), dtype)
    pairs = k // 2 if dtype == jnp.dtype(jnp.bfloat16) else 0
    # bfloat16: [P, pairs, 2 (row in pair), 32 (column)] -> [P, pairs, 32, 2]: each column's two rows adjacent.
    out[:, : 2 * pairs].reshape(panels, pairs, PANEL, 2)[...] = (
        by_panel[:, : 2 * pairs].reshape(panels, pairs, 2, PANEL).transpose(0, 1, 3, 2)
    )
    out[:, 2 * pairs :] = by_panel[:, 2 * pairs :]  # float32 whole; bfloat16's odd last row as it is
    return out


def pack_quantized(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """Affine blocks of ``w[K, N]`` (``codes [K, N]`` integers in 0..255, ``scale`` and ``offset``
    ``[K/32, N]``) -> the quantized weight, uint8 ``[ceil(N/32), K * (c + 8)]`` (see the module doc;
    4-bit codes when every code is below 16). Columns past N get zero codes, scales and offsets."""
    codes, scale, offset = np.asarray(codes), np.asarray(scale, np.float32), np.asarray(offset, np.float32)
    if codes.ndim != 2 or codes.shape[0] % QUANT_BLOCK or codes.shape[0] == 0:
        raise ValueError(
            f"codes must be [K, N] with K a positive multiple of {QUANT_BLOCK}, got shape {codes.shape}"
        )
    k, n = codes.shape
    if scale.shape != (k // QUANT_BLOCK, n) or offset.shape != scale.shape:
        raise ValueError(
            f"scale and offset must be [{k // QUANT_BLOCK}, {n}] for codes {codes.shape}, got "
            f"{scale.shape} and {offset.shape}"
        )
    if codes.size and (codes.min() < 0 or codes.max() > 255):
        raise ValueError("codes must lie in 0..255")
    panels = cdiv(n, PANEL)
    pad = ((0, 0), (0, panels * PANEL - n))
    rows = np.pad(codes.astype(np.uint8), pad).reshape(k, panels, PANEL).transpose(1, 0, 2)  # [P, K, 32]
    if codes.size == 0 or codes.max() < 16:
        rows = rows[..., : PANEL // 2] | (rows[..., PANEL // 2 :] << 4)
    qparams = np.stack([np.pad(scale, pad), np.pad(offset, pad)], axis=1)  # [K/32, 2, P * 32]
    qparams = qparams.reshape(k // QUANT_BLOCK, 2, panels, PANEL).transpose(2, 0, 1, 3).astype("<f4")
    return np.concatenate([rows.reshape(panels, -1), qparams.reshape(panels, -1).view(np.uint8)], axis=1)


def matmul(
    x: jax.Array,
    packed: jax.Array,
    n: int,
    out_dtype=None,
    num_rows: jax.Array | int | None = None,
    layer: int | None = None,
) -> jax.Array:
    """``x[M, K] @ w[K, n]`` for ``packed = pack_weight(w, x.dtype)``; returns ``[M, n]`` in
    ``out_dtype``: x's dtype (default), or float32 for bfloat16 x (the float32 accumulators as they
    are, unrounded: a model's logits, without a separate conversion pass).

    ``num_rows`` (an int32 scalar, traced or not; default ``M``): only the first ``num_rows`` rows of
    ``x`` are multiplied, the output's other rows are zeros. A batch padded to a bucket of ``M``
    tokens pays for its real tokens only, with one compiled program per bucket.

    ``packed`` may also be a quantized weight (``pack_quantized``, uint8), for either dtype of ``x``:
    the result is the same as with ``pack_weight`` of the dequantized weight (cast to x's dtype).

    ``layer`` (a static int): ``packed`` stacks one such weight per layer along a leading axis
    (``np.stack`` of them) and the product is with weight ``layer``, read in place (a slice
    ``packed[layer]`` would be copied before the call). A model passes one stacked array per kind of
    weight: each array argument of a jitted call costs host time at every call.

    Jittable with ``n`` and ``layer`` static. Raises ``ValueError`` on a dtype other than float32/bfloat16, on
    ``x`` and ``packed`` of different dtypes, on another ``out_dtype``, or on shapes that do not match.
    """
    if not native_matmul_available():
        raise RuntimeError(
            "the native CPU matmul kernel was not built (no C++ compiler at install time?); "
            "rebuild with `python setup.py build_ext --inplace`, or use jnp.dot"
        )
    dtype = _checked_dtype(x.dtype)
    out_dtype = dtype if out_dtype is None else jnp.dtype(out_dtype)
    if out_dtype not in (dtype, jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype must be x's dtype ({dtype}) or float32, got {out_dtype}")
    if x.ndim != 2:
        raise ValueError(f"expected x[M, K], got shape {x.shape}")
    n, k = int(n), x.shape[1]
    weight = layer_shape(packed, layer)
    quantized = jnp.dtype(packed.dtype) == jnp.dtype(jnp.uint8)
    if quantized:
        if len(weight) != 2 or k == 0 or k % QUANT_BLOCK or weight[1] not in (k * 24, k * 40):
            raise ValueError(
                f"the quantized weight of shape {weight} does not fit x[M, {k}]: expected "
                f"[P, {k} * 24 or {k} * 40] with K a positive multiple of {QUANT_BLOCK}"
            )
    else:
        if jnp.dtype(packed.dtype) != dtype:
            raise ValueError(
                f"x is {dtype} but the packed weight is {jnp.dtype(packed.dtype)}; pack the weight "
                f"with pack_weight(w, {dtype}) (casting here would copy the weight on every call)"
            )
        if len(weight) != 3 or weight[2] != PANEL:
            raise ValueError(f"expected a packed weight [P, K, {PANEL}], got shape {weight}")
        if weight[1] != k:
            raise ValueError(f"K does not match: x has {k} columns, the packed weight {weight[1]} rows")
    if n < 0 or cdiv(n, PANEL) != weight[0]:
        raise ValueError(f"n={n} does not match the weight's {weight[0]} panels of {PANEL} columns")
    rows = row_count(num_rows, x.shape[0])
    call = jax.ffi.ffi_call(
        _QUANT_TARGET if quantized else _TARGET, jax.ShapeDtypeStruct((x.shape[0], n), out_dtype)
    )
    return call(x, packed, rows, layer=np.int64(layer or 0))
