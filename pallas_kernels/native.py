"""Loading the C++ kernels that ``pip install`` builds (``setup.py``'s optional extensions)."""

from __future__ import annotations

import ctypes
import functools
import importlib.util

import jax
import jax.numpy as jnp

NATIVE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
"""The dtypes the native matmul, attention and layer kernels take."""


@functools.cache
def load_library(library: str) -> ctypes.CDLL | None:
    """The shared library of module ``library`` (found without importing it); None if it was not built."""
    spec = importlib.util.find_spec(library)
    if spec is None or spec.origin is None:
        return None
    return ctypes.cdll.LoadLibrary(spec.origin)


def register_cpu_targets(library: str, targets: dict[str, str]) -> bool:
    """Load ``library`` (``load_library``) and register each XLA FFI target name -> exported handler
    symbol on the CPU platform; False if it was not built."""
    lib = load_library(library)
    if lib is None:
        return False
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return True


def row_count(num_rows, num_tokens: int) -> jax.Array:
    """The int32 scalar operand that tells a native kernel how many leading rows are real (a padded
    batch's tokens): ``num_rows``, or all ``num_tokens`` for None."""
    rows = jnp.asarray(num_tokens if num_rows is None else num_rows, jnp.int32)
    if rows.shape != ():
        raise ValueError(f"num_rows must be a scalar, got shape {rows.shape}")
    return rows


def layer_shape(weight: jax.Array, layer: int | None) -> tuple[int, ...]:
    """The shape of the weight a native kernel applies: ``weight``'s own, or with ``layer`` (a static
    int) that of layer ``layer`` of a weight stacked over the layers (``[L, ...]``), which the kernel
    reads in place; ``ValueError`` if the stack has no such layer."""
    if layer is None:
        return tuple(weight.shape)
    if weight.ndim < 1 or not 0 <= layer < weight.shape[0]:
        raise ValueError(f"layer {layer} is not in the stacked weight of shape {weight.shape}")
    return tuple(weight.shape[1:])
