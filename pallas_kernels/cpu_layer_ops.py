"""The decoder's elementwise layers on the CPU through C++ kernels called by XLA's FFI
(``csrc/layer_ops_cpu.cc``): the rotary embedding (with the split of the fused q/k/v projection),
RMSNorm, optionally fused with the residual add before it (as vLLM's ``fused_add_rms_norm``), and the
gated MLP's SiLU(gate) * up (as vLLM's ``silu_and_mul``).

XLA's CPU backend runs a norm as a reduction fusion, then a fusion that scales (and one more for the
residual add), each a pass over the activations, and bfloat16 arithmetic as a float32 round trip per
operation; each kernel here is one pass with the same roundings. Built by ``pip install`` with the
other native kernels (optional: without a compiler the model keeps its XLA ops).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxpaged.kernels.native import NATIVE_DTYPES, layer_shape, register_cpu_targets, row_count

_ROPE_TARGET = "jaxpaged_rope_qkv_cpu"
_NORM_TARGET = "jaxpaged_rms_norm_cpu"
_ADD_NORM_TARGET = "jaxpaged_add_rms_norm_cpu"
_SILU_TARGET = "jaxpaged_silu_and_mul_cpu"


@functools.cache
def native_layer_ops_available() -> bool:
    """Load the compiled kernels and register them with XLA (once); False if they were not built."""
    return register_cpu_targets(
        "jaxpaged.kernels._layer_ops_cpu",
        {
            _ROPE_TARGET: "JaxpagedRopeQkvCpu",
            _NORM_TARGET: "JaxpagedRmsNormCpu",
            _ADD_NORM_TARGET: "JaxpagedAddRmsNormCpu",
            _SILU_TARGET: "JaxpagedSiluAndMulCpu",
        },
    )


def _require_kernels() -> None:
    if not native_layer_ops_available():
        raise RuntimeError(
            "the native CPU layer kernels were not built (no C++ compiler at install time?); "
            "reinstall jaxpaged with g++ available"
        )


def cpu_rope_qkv(
    qkv: jax.Array,
    cos_table: jax.Array,
    sin_table: jax.Array,
    num_heads: int,
    num_kv_heads: int,
    num_rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused projection's output ``qkv[T, (Hq + 2 Hkv) * D]`` split into ``q[T, Hq, D]`` and ``k[T, Hkv, D]``,
    rotated, and ``v[T, Hkv, D]``: ``x * C + swap(x) * S`` for each head (``swap`` exchanging its halves;
    ``C``, ``S``: ``T x D`` elements, ``models.decoder.rope_tables``), each product and the sum rounded to
    the dtype as torch rounds them (float32 or bfloat16, no fused multiply-add): HF's rotate-half rotary
    embedding. One pass over ``qkv``, where XLA's CPU backend copies q, k and v out before rotating (and
    runs the bfloat16 rotation 4.6-5.9x slower). Rows from ``num_rows`` (None: all) on come out zero."""
    _require_kernels()
    if not qkv.dtype == cos_table.dtype == sin_table.dtype or qkv.dtype not in NATIVE_DTYPES:
        raise ValueError(
            f"the native rotary kernel takes float32 or bfloat16 qkv and tables of one dtype, got "
            f"{qkv.dtype}, {cos_table.dtype}, {sin_table.dtype}"
        )
    heads = num_heads + 2 * num_kv_heads
    T = qkv.shape[0]
    d = qkv.shape[-1] // heads if qkv.ndim == 2 and heads > 0 else 0
    if (
        qkv.ndim != 2
        or num_heads <= 0
        or num_kv_heads <= 0
        or d * heads != qkv.shape[1]
        or d % 2
        or cos_table.size != T * d
        or sin_table.shape != cos_table.shape
    ):
        raise ValueError(
            f"expected qkv[T, (Hq + 2 Hkv) * D] with D even ({num_heads} + 2 x {num_kv_heads} heads) "
            f"and tables of T x D elements, got {qkv.shape}, {cos_table.shape}, {sin_table.shape}"
        )
    rows = row_count(num_rows, T)
    kv = jax.ShapeDtypeStruct((T, num_kv_heads, d), qkv.dtype)
    out = (jax.ShapeDtypeStruct((T, num_heads, d), qkv.dtype), kv, kv)
    return tuple(jax.ffi.ffi_call(_ROPE_TARGET, out)(qkv, cos_table, sin_table, rows))


def cpu_rms_norm(
    h: jax.Array,
    weight: jax.Array,
    eps: float,
    residual: jax.Array | None = None,
    num_rows: jax.Array | None = None,
    layer: int | None = None,
):
    """RMSNorm of the rows of ``h[T, d]``: ``weight * round(s * rsqrt(mean(s * s) + eps))``, statistics
    in float32, ``round`` to ``h``'s dtype (float32 or bfloat16), as HF's ``LlamaRMSNorm`` rounds.

    With ``residual`` (like ``h``) the norm is of ``s = h + residual`` (rounded), and the result is
    ``(s, normed)``: the residual add and the norm after it in one pass. Rows from ``num_rows`` (an
    int32 scalar; None: all) on are a padded batch's padding and come out zero. With ``layer`` (a
    static int) ``weight`` is ``[L, d]``, every layer's, and row ``layer`` is read in place (as
    ``cpu_matmul.matmul``'s stacked weights)."""
    _require_kernels()
    w_shape = layer_shape(weight, layer)
    if h.ndim != 2 or w_shape != h.shape[1:] or (residual is not None and residual.shape != h.shape):
        raise ValueError(
            f"expected h[T, d], a weight [d] and a residual like h, got {h.shape}, {w_shape}, "
            f"{None if residual is None else residual.shape}"
        )
    if (
        h.dtype not in NATIVE_DTYPES
        or weight.dtype != h.dtype
        or (residual is not None and residual.dtype != h.dtype)
    ):
        raise ValueError(
            f"the native RMSNorm takes float32 or bfloat16 h, weight and residual of one dtype, got "
            f"{h.dtype}, {weight.dtype}, {None if residual is None else residual.dtype}"
        )
    rows = row_count(num_rows, h.shape[0])
    out = jax.ShapeDtypeStruct(h.shape, h.dtype)
    attrs = {"eps": np.float32(eps), "layer": np.int64(layer or 0)}
    if residual is None:
        return jax.ffi.ffi_call(_NORM_TARGET, out)(h, weight, rows, **attrs)
    return tuple(jax.ffi.ffi_call(_ADD_NORM_TARGET, (out, out))(h, residual, weight, rows, **attrs))


def cpu_silu_and_mul(gate_up: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
    """``round(silu(gate)) * up`` for ``gate_up[T, 2n]`` (the gate's ``n`` columns, then up's), float32 or
    bfloat16: SiLU in float32 rounded once to the dtype, as torch's kernels (and ``models.decoder.activate``)
    round it, then the product rounded. Rows from ``num_rows`` (an int32 scalar; None: all) on are
    padding and come out zero."""
    _require_kernels()
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"expected gate_up[T, 2n], got {gate_up.shape}")
    if gate_up.dtype not in NATIVE_DTYPES:
        raise ValueError(f"the native SiLU-and-multiply takes float32 or bfloat16, got {gate_up.dtype}")
    rows = row_count(num_rows, gate_up.shape[0])
    out = jax.ShapeDtypeStruct((gate_up.shape[0], gate_up.shape[1] // 2), gate_up.dtype)
    return jax.ffi.ffi_call(_SILU_TARGET, out)(gate_up, rows)
