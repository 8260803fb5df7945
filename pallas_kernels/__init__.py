"""Paged attention kernels over one global KV page array, and the backend switch.

Kernels here know nothing about models: they see queries, pages, and ``AttentionMetadata``.
"""

from __future__ import annotations

from jaxpaged.kernels.dispatch import gathers_pages, paged_attention, resolve_backend, resolve_matmul_backend
from jaxpaged.kernels.kv_ops import copy_blocks, write_kv
from jaxpaged.kernels.metadata import PAD_SLOT, AttentionMetadata, build_prefill_tiles

__all__ = [
    "AttentionMetadata",
    "PAD_SLOT",
    "build_prefill_tiles",
    "copy_blocks",
    "gathers_pages",
    "paged_attention",
    "resolve_backend",
    "resolve_matmul_backend",
    "write_kv",
]
