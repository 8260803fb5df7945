"""Choose a paged-attention implementation by name; models call ``paged_attention`` only."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.xla_attention import xla_paged_attention


def resolve_backend(name: str, platform: str | None = None, dtype=None) -> str:
    """``auto`` becomes ``pallas`` on GPU/TPU, and on CPU the native kernel (``cpu``) when it was
    built and supports ``dtype`` (float32, bfloat16), else ``xla``; other names pass through."""
    if name != "auto":
        return name
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return "pallas"
    from pallas_kernels.cpu_attention import NATIVE_DTYPES, native_kernel_available
    supported = dtype is None or jnp.dtype(dtype) in NATIVE_DTYPES
    return "cpu" if supported and native_kernel_available() else "xla"


def gathers_pages(backend: str) -> bool:
    """The XLA backend gathers whole block-table rows (its cost grows with the table's width) and
    attends prefill chunks in host-built tiles; the kernels read pages in place, each row only up
    to its own length, so their callers can pass full-width tables and no tiles."""
    return backend == "xla"


def paged_attention(q: jax.Array, kv_pages: jax.Array, layer, md: AttentionMetadata, *, backend: str,
                    scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None) -> jax.Array:
    """Attention of flat ragged queries ``q[T, Hq, D]`` over layer ``layer`` of ``kv_pages``."""
    if backend == "xla":
        return xla_paged_attention(q, kv_pages, layer, md, scale=scale,
                                   sliding_window=sliding_window, soft_cap=soft_cap)
    if backend == "cpu":
        from pallas_kernels.cpu_attention import cpu_paged_attention
        return cpu_paged_attention(q, kv_pages, layer, md, scale=scale, sliding_window=sliding_window,
                                   soft_cap=soft_cap)
    if backend in ("pallas", "pallas_interpret"):
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention
        return ragged_paged_attention(q, kv_pages, layer, md, scale=scale, sliding_window=sliding_window,
                                      soft_cap=soft_cap, interpret=backend == "pallas_interpret")
    raise ValueError(f"unknown attention backend {backend!r}")
