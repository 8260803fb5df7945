"""Paged attention on the CPU through a C++ kernel called by XLA's FFI (``csrc/paged_attention_cpu.cc``).

XLA's CPU backend runs the gather-then-attend formulation of ``xla_attention`` at a few GFLOP/s
(small batched dots, unvectorized reductions, a copy of every gathered page). The native kernel
reads the pages in place, each row only up to its own length, with AVX-512 when the build machine
has it: prefill chunks as register-tiled query tiles per kv head, decode rows streaming each page
once for all kv heads (long rows split by key ranges when rows are few), spread over XLA's
intra-op thread pool; see ``docs/roofline.md``. It is built by ``pip install`` (an optional
extension: without a compiler the install still succeeds and ``auto`` falls back to ``xla``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.native import NATIVE_DTYPES, register_cpu_targets

_TARGET = "jaxpaged_paged_attention_cpu"
_WRITE_TARGET = "jaxpaged_write_kv_cpu"


@functools.cache
def native_kernel_available() -> bool:
    """Load the compiled kernel and register it with XLA (once); False if it was not built."""
    return register_cpu_targets(
        "jaxpaged.kernels._paged_attention_cpu",
        {_TARGET: "JaxpagedPagedAttentionCpu", _WRITE_TARGET: "JaxpagedWriteKvCpu"},
    )


def cpu_write_kv(
    kv_pages: jax.Array, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> jax.Array:
    """``jaxpaged.kernels.write_kv`` in place (the page array is the call's aliased output): XLA's CPU
    scatter converts a bfloat16 pool to float32 and back for every write."""
    if not native_kernel_available():
        raise RuntimeError(
            "the native CPU attention kernel was not built (no C++ compiler at install time?); "
            "reinstall jaxpaged with g++ available, or use attention_backend='xla'"
        )
    call = jax.ffi.ffi_call(
        _WRITE_TARGET, jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype), input_output_aliases={0: 0}
    )
    return call(
        kv_pages,
        k.astype(kv_pages.dtype),
        v.astype(kv_pages.dtype),
        slot_mapping,
        jnp.asarray(layer, jnp.int32).reshape(()),
    )


def cpu_paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    layer,
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """``q[T, Hq, D]`` attends to its row's pages of layer ``layer``; returns ``[T, Hq, D]`` in q's dtype."""
    if not native_kernel_available():
        raise RuntimeError(
            "the native CPU attention kernel was not built (no C++ compiler at install time?); "
            "reinstall jaxpaged with g++ available, or use attention_backend='xla'"
        )
    if q.dtype != kv_pages.dtype or q.dtype not in NATIVE_DTYPES:
        # Casting here would copy the whole page pool in every layer of every step.
        raise ValueError(
            f"the native CPU attention kernel takes float32 or bfloat16 queries and pages of one dtype, "
            f"got {q.dtype} and {kv_pages.dtype}; use attention_backend='xla'"
        )
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q,
        kv_pages,
        jnp.asarray(layer, jnp.int32).reshape(()),
        md.block_tables,
        md.seq_lens,
        md.query_start_loc,
        scale=np.float32(scale),
        sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )
