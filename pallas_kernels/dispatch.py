"""Choose a paged-attention implementation by name; models call ``paged_attention`` only."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.kernels import kv_ops
from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.native import NATIVE_DTYPES
from jaxpaged.kernels.xla_attention import xla_paged_attention


def resolve_backend(name: str, platform: str | None = None, dtype=None) -> str:
    """``auto`` becomes ``pallas`` on GPU/TPU, and on CPU the native kernel (``cpu``) when it was
    built and supports ``dtype`` (float32, bfloat16), else ``xla``; other names pass through."""
    if name != "auto":
        return name
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return "pallas"
    from jaxpaged.kernels.cpu_attention import native_kernel_available

    supported = dtype is None or jnp.dtype(dtype) in NATIVE_DTYPES
    return "cpu" if supported and native_kernel_available() else "xla"


def resolve_matmul_backend(
    name: str, platform: str | None = None, dtype=None, num_devices: int = 1, quantized: bool = False
) -> str:
    """``auto`` becomes ``cpu`` (the native CPU matmul) on one CPU device when it was built and
    supports ``dtype`` (float32, bfloat16), else ``xla``; an explicit ``cpu`` that cannot run is a
    ``ValueError``. Built without AVX-512 or AVX2 + FMA (portable loops), the native matmul is
    slower than XLA's dot in float32 (not in bfloat16, which XLA's CPU backend converts around every
    op), so ``auto`` takes ``xla`` there, unless ``quantized`` weights are asked for (only the
    native matmul runs them)."""
    from jaxpaged.kernels.cpu_matmul import native_matmul_available, native_matmul_vectorized

    platform = platform or jax.default_backend()
    problem = (
        f"the platform is {platform}"
        if platform != "cpu"
        else f"the model is split over {num_devices} devices"
        if num_devices > 1
        else f"it does not take {jnp.dtype(dtype)}"
        if dtype is not None and jnp.dtype(dtype) not in NATIVE_DTYPES
        else "it was not built (no C++ compiler at install time?)"
        if not native_matmul_available()
        else None
    )
    if name == "auto":
        float32 = dtype is None or jnp.dtype(dtype) == jnp.float32
        slower = float32 and not quantized and not native_matmul_vectorized()
        return "xla" if problem or slower else "cpu"
    if name == "cpu" and problem:
        raise ValueError(
            f"matmul_backend='cpu' (the native CPU matmul) cannot run here: {problem}; use 'xla' or 'auto'."
        )
    return name


def gathers_pages(backend: str) -> bool:
    """The XLA backend gathers whole block-table rows (its cost grows with the table's width) and
    attends prefill chunks in host-built tiles; the kernels read pages in place, each row only up
    to its own length, so their callers can pass full-width tables and no tiles."""
    return backend == "xla"


def write_kv(
    kv_pages: jax.Array, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array, *, backend: str
) -> jax.Array:
    """Store one layer's new ``k, v[T, Hkv, D]`` at their flat slots: in place through the native
    kernel with the ``cpu`` backend, else as an XLA scatter (in place under donation)."""
    if backend == "cpu":
        from jaxpaged.kernels.cpu_attention import cpu_write_kv

        return cpu_write_kv(kv_pages, layer, k, v, slot_mapping)
    return kv_ops.write_kv(kv_pages, layer, k, v, slot_mapping)


def paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    layer,
    md: AttentionMetadata,
    *,
    backend: str,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Attention of flat ragged queries ``q[T, Hq, D]`` over layer ``layer`` of ``kv_pages``."""
    if backend == "xla":
        return xla_paged_attention(
            q, kv_pages, layer, md, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap
        )
    if backend == "cpu":
        from jaxpaged.kernels.cpu_attention import cpu_paged_attention

        return cpu_paged_attention(
            q, kv_pages, layer, md, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap
        )
    if backend in ("pallas", "pallas_interpret"):
        from jaxpaged.kernels.ragged_paged_attention import ragged_paged_attention

        return ragged_paged_attention(
            q,
            kv_pages,
            layer,
            md,
            scale=scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            interpret=backend == "pallas_interpret",
        )
    raise ValueError(f"unknown attention backend {backend!r}")
