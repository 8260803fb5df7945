"""The precision every matmul of a model asks for: float32 in full float32 on every platform.

A float32 ``dot`` at the default precision is not float32 on accelerators: XLA's GPU backend and
Triton round its inputs to TF32 (10 mantissa bits) and the TPU takes one bfloat16 pass, so a
float32 engine would drift from a float32 reference (transformers with TF32 off). ``HIGHEST``
asks for full float32 there; CPUs compute float32 dots exactly either way. 16-bit inputs are
exact on tensor cores and the MXU, so they keep the platform's default (the fast path).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def matmul_precision(dtype) -> lax.Precision | None:
    """``HIGHEST`` for float32 (or wider) inputs, ``None`` (the platform's default) for 16-bit ones."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None
