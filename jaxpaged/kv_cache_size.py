"""How big the KV-cache page pool is when ``kv_cache_memory`` is left to the engine.

vLLM sizes its pool from the memory it finds free (``gpu_memory_utilization``; on CPU a share of the
host's RAM); a fixed default either starves a server of blocks (preemptions, queued requests) or
takes memory no sequence can use. The automatic size is the least of:

- what ``max_num_seqs`` sequences of ``max_model_len`` tokens fill: more blocks than that could
  only keep more cached prefixes;
- the memory budget of each device once the weights are loaded: with ``gpu_memory_utilization`` F,
  vLLM's rule, F x the memory the device's allocator may use less what is in use (the weights), the
  rest left to the step's activations (no profiling run measures them); without it,
  ``FREE_FRACTION`` of the memory free, leaving the rest to the activations and to everything else
  on the machine. On CPU the memory is a CPU device's share of the host's available memory (a
  process's CPU devices share it), which the loaded weights have already left;
- on CPU without F, ``CPU_CAP`` (vLLM's CPU backend reserved 4 GiB by default for most of its history):
  the pool is host memory the engine writes once at start-up (zeroing 8 GiB took 4.3 s on the 2-core CI
  machine). An explicit F is an explicit budget: no cap.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np

from jaxpaged.math_utils import cdiv

FREE_FRACTION = 0.5
CPU_CAP = 4 << 30


def device_memory(device: jax.Device) -> tuple[int, int]:
    """(memory ``device``'s allocator may use in all, what is in use of it) on GPU and TPU; on CPU
    (no allocator limit) the host's available memory split evenly over the process's CPU devices, and 0
    in use: what the process holds is already out of the available memory."""
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    return host_available_bytes() // len(jax.local_devices(backend=device.platform)), 0


def free_bytes(device: jax.Device) -> int:
    """Memory free on ``device``: its limit less what is in use."""
    total, used = device_memory(device)
    return total - used


def budget_bytes(device: jax.Device, gpu_memory_utilization: float | None) -> int:
    """Bytes ``device`` may give the page pool: ``gpu_memory_utilization`` x its memory less what is in
    use (vLLM's rule), or without it ``FREE_FRACTION`` of what is free (see the module's docstring)."""
    if gpu_memory_utilization is None:
        return int(FREE_FRACTION * free_bytes(device))
    total, used = device_memory(device)
    return int(gpu_memory_utilization * total) - used


def least_budget_bytes(devices: Sequence[jax.Device], gpu_memory_utilization: float | None) -> int:
    """The least ``budget_bytes`` of any of ``devices``. A process sees only its own devices' memory, so
    an engine spanning processes takes the least over all of them (in MiB): each sizes the same pool."""
    me = jax.process_index()
    budget = min(budget_bytes(d, gpu_memory_utilization) for d in devices if d.process_index == me)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        budget = int(np.min(multihost_utils.process_allgather(np.int32(budget >> 20)))) << 20
    return budget


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


def auto_kv_cache_memory(
    bytes_per_block: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    devices: Sequence[jax.Device],
    gpu_memory_utilization: float | None = None,
) -> int:
    """Bytes per device for the page pool (see the module's docstring); ``bytes_per_block`` is per device."""
    blocks_per_seq = cdiv(max_model_len, block_size)
    need = (max_num_seqs * blocks_per_seq + 1) * bytes_per_block  # + the reserved null block
    size = min(need, least_budget_bytes(devices, gpu_memory_utilization))
    if devices[0].platform == "cpu" and gpu_memory_utilization is None:
        size = min(size, CPU_CAP)
    return size


def budget_rule(gpu_memory_utilization: float | None) -> str:
    """How the automatic size was bounded, in words, for errors about it."""
    if gpu_memory_utilization is None:
        return "half the memory free on the device"
    return f"gpu_memory_utilization={gpu_memory_utilization} of the device's memory, less what is in use,"
