"""How the CPU backend's process allocates host memory: freed memory is kept for reuse.

XLA's CPU runtime allocates each step's outputs and temporaries afresh on every call (the logits
alone are rows x vocabulary floats: 50 MB at 256 rows of SmolLM2), and glibc's malloc serves an
allocation above its mmap threshold (at most 32 MiB) with a fresh mapping that it unmaps when it is
freed, so every step faulted those pages in again and zeroed them. Told to serve every allocation
from its heaps and to return a heap's free top to the system only past ``TRIM_THRESHOLD``, glibc
reuses the freed memory instead, as tcmalloc or jemalloc would (vLLM's CPU backend asks for tcmalloc through
``LD_PRELOAD``). The setting is the process's: it holds for every allocation made after it.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1
"""``mallopt`` parameters (glibc's malloc.h)."""
M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30
"""A heap's free top is given back to the system past this (a freed KV pool is, a step's buffers are not)."""

_applied = False


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse (see the module's docstring), once per process;
    False, changing nothing, where the C library is not glibc (musl's ``mallopt`` ignores its arguments)."""
    global _applied
    if not _applied and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None)
        if hasattr(libc, "gnu_get_libc_version"):
            _applied = (
                libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
            )
    return _applied
