"""How big the KV-cache page pool is when ``kv_cache_memory`` is left to the engine.

vLLM sizes its pool from the memory it finds free (``gpu_memory_utilization``; on CPU a share of the
host's RAM); a fixed default either starves a server of blocks (preemptions, queued requests) or
takes memory no sequence can use. The automatic size is the least of:

- what ``max_num_seqs`` sequences of ``max_model_len`` tokens fill: more blocks than that could
  only keep more cached prefixes;
- ``FREE_FRACTION`` of the memory free on each device once the weights are loaded (a CPU device's
  share of the host's available memory: a process's CPU devices share it), leaving the rest to the
  step's activations and to everything else on the machine;
- on CPU, ``CPU_CAP`` (vLLM's CPU backend reserved 4 GiB by default for most of its history):
  the pool is host memory the engine writes once at start-up (zeroing 8 GiB took 4.3 s on the 2-core CI machine).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np

FREE_FRACTION = 0.5
CPU_CAP = 4 << 30


def free_bytes(device: jax.Device) -> int:
    """Memory free on ``device``: its allocator's limit less what is in use (GPU, TPU), or on CPU the
    host's available memory split evenly over the process's CPU devices."""
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return host_available_bytes() // len(jax.local_devices(backend=device.platform))


def least_free_bytes(devices: Sequence[jax.Device]) -> int:
    """The least memory free on any of ``devices``. A process sees only its own devices' memory, so an
    engine spanning processes takes the least over all of them (in MiB): each sizes the same pool."""
    me = jax.process_index()
    free = min(free_bytes(d) for d in devices if d.process_index == me)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        free = int(np.min(multihost_utils.process_allgather(np.int32(free >> 20)))) << 20
    return free


def host_available_bytes() -> int:
    """The kernel's estimate of memory available to a new process without swapping (``MemAvailable``),
    or the free pages where there is no ``/proc/meminfo``."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_kv_cache_memory(bytes_per_block: int, block_size: int, max_num_seqs: int, max_model_len: int,
                         devices: Sequence[jax.Device]) -> int:
    """Bytes per device for the page pool (see the module's docstring); ``bytes_per_block`` is per device."""
    blocks_per_seq = -(-max_model_len // block_size)
    need = (max_num_seqs * blocks_per_seq + 1) * bytes_per_block      # + the reserved null block
    size = min(need, int(FREE_FRACTION * least_free_bytes(devices)))
    if devices[0].platform == "cpu":
        size = min(size, CPU_CAP)
    return size
