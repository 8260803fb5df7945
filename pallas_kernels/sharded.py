"""Mesh-aware ops for tensor parallelism (heads split over the ``tp`` axis of a device mesh).

Models call these with an optional ``mesh``; with ``mesh=None`` they are exactly the
single-device ops. Under a mesh:

* ``paged_attention`` runs the chosen backend per shard (``jax.shard_map``): each device sees
  its own query heads and its own kv-head slice of the page array, so it reads only its
  heads' pages, and no attention input or output is communicated.
* ``split_fused`` undoes the per-shard layout of a fused projection's output columns (see
  ``jaxpaged.parallel``): shard ``i`` holds ``[q_i | k_i | v_i]`` (or ``[gate_i | up_i]``), so
  one contiguous column split of the fused kernel gives every device whole heads of each part.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpaged.kernels import dispatch
from jaxpaged.kernels.metadata import AttentionMetadata

TP_AXIS = "tp"
"""The mesh axis that tensor parallelism splits heads (and the vocabulary, the MLP width) over."""

HEADS = P(None, TP_AXIS, None)  # q / attention output [T, H, D]
KV_PAGES = P(None, None, None, None, TP_AXIS, None)  # [L, 2, blocks, block_size, Hkv, D]


def tp_size(mesh: Any) -> int:
    return 1 if mesh is None else mesh.shape[TP_AXIS]


def split_fused(x: jax.Array, sizes: Sequence[int], mesh: Any = None) -> tuple[jax.Array, ...]:
    """Split the last axis of a fused projection output into its parts (``sizes`` wide, in order).

    With ``N`` shards the columns are laid out ``[a_0 | b_0 | ... | a_1 | b_1 | ...]`` where ``a_i``
    is the ``i``-th of ``N`` equal pieces of part ``a``; each part comes back whole, in its
    original column order. ``N = 1`` is the plain layout ``[a | b | ...]``.
    """
    n = tp_size(mesh)
    bounds = np.cumsum(sizes)[:-1].tolist()
    if n == 1:
        return tuple(jnp.split(x, bounds, axis=-1))
    lead = x.shape[:-1]
    per_shard = x.reshape(*lead, n, x.shape[-1] // n)
    spec = P(*([None] * len(lead)), TP_AXIS, None)
    per_shard = jax.lax.with_sharding_constraint(per_shard, NamedSharding(mesh, spec))
    local = jnp.split(per_shard, [b // n for b in bounds], axis=-1)
    flat = P(*([None] * len(lead)), TP_AXIS)
    return tuple(
        jax.lax.with_sharding_constraint(part.reshape(*lead, s), NamedSharding(mesh, flat))
        for part, s in zip(local, sizes)
    )


def write_kv(
    kv_pages: jax.Array,
    layer,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    backend: str,
    mesh: Any = None,
) -> jax.Array:
    """``jaxpaged.kernels.dispatch.write_kv`` (same arguments), per head shard when ``mesh`` is given:
    each device stores its own kv heads into its own slice of the page array."""
    write = functools.partial(dispatch.write_kv, backend=backend)
    if mesh is None:
        return write(kv_pages, layer, k, v, slot_mapping)
    return jax.shard_map(
        write, mesh=mesh, in_specs=(KV_PAGES, P(), HEADS, HEADS, P()), out_specs=KV_PAGES, check_vma=False
    )(kv_pages, layer, k, v, slot_mapping)


def paged_attention(
    q: jax.Array, kv_pages: jax.Array, layer, md: AttentionMetadata, *, mesh: Any = None, **kwargs
) -> jax.Array:
    """``jaxpaged.kernels.paged_attention`` (same arguments), run per head shard when ``mesh`` is given:
    ``q[T, Hq, D]`` and the pages' kv-head axis split over ``tp``, metadata replicated."""
    if mesh is None:
        return dispatch.paged_attention(q, kv_pages, layer, md, **kwargs)

    def local(q, kv_pages, layer, md):
        return dispatch.paged_attention(q, kv_pages, layer, md, **kwargs)

    # check_vma=False: backends may be custom calls (Pallas, FFI) that carry no varying-axis types.
    return jax.shard_map(
        local, mesh=mesh, in_specs=(HEADS, KV_PAGES, P(), P()), out_specs=HEADS, check_vma=False
    )(q, kv_pages, layer, md)
