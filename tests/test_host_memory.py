"""The CPU backend's host memory policy (``jaxpaged.host_memory``): a big buffer freed and allocated
again is reused, not mapped afresh and faulted in page by page again."""

import ctypes
import pathlib
import resource
import subprocess
import sys

from jaxpaged import EngineArgs, LLMEngine

SIZE = 64 << 20
"""Past glibc's largest mmap threshold (32 MiB): by default such a buffer is a mapping of its own."""

_libc = ctypes.CDLL(None)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]
_libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]


def faults_of_a_cycle() -> int:
    """Minor page faults of allocating a ``SIZE`` buffer with malloc, writing it and freeing it."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = _libc.malloc(SIZE)
    _libc.memset(p, 1, SIZE)
    _libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_keep_freed_memory_reuses_a_freed_buffer():
    """In a fresh process: every cycle faults the whole buffer in (at least one fault per 2 MiB, the
    largest page) until ``keep_freed_memory``; after it, a cycle after the first (which grows the heap)
    faults in less than a tenth of that."""
    script = (
        "from test_host_memory import faults_of_a_cycle\n"
        "from jaxpaged import host_memory\n"
        "faults_of_a_cycle()\n"
        "before = faults_of_a_cycle()\n"
        "applied = host_memory.keep_freed_memory()\n"
        "faults_of_a_cycle()\n"
        "print(before, applied, faults_of_a_cycle(), host_memory.keep_freed_memory())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=pathlib.Path(__file__).parent,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    before, applied, after, again = int(out[0]), out[1], int(out[2]), out[3]
    assert (applied, again) == ("True", "True")
    assert before >= SIZE >> 21
    assert after <= before // 10


def test_keep_freed_memory_still_gives_back_a_freed_pool():
    """A freed block past ``TRIM_THRESHOLD`` at the heap's top (a KV pool of an engine gone) goes back to
    the system, so the process does not keep its peak: resident memory falls back after the free."""
    script = (
        "import ctypes\n"
        "from test_host_memory import _libc\n"
        "from jaxpaged import host_memory\n"
        "def resident():\n"
        "    return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "host_memory.keep_freed_memory()\n"
        "size = host_memory.TRIM_THRESHOLD + (256 << 20)\n"
        "p = _libc.malloc(size)\n"
        "_libc.memset(p, 1, size)\n"
        "held = resident()\n"
        "_libc.free(p)\n"
        "print(size, held, resident())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=pathlib.Path(__file__).parent,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    size, held, after = map(int, out)
    assert held >= size
    assert after <= held - size + (64 << 20)


def test_a_cpu_engine_keeps_freed_memory(tiny):
    """Building an engine on the CPU backend sets the policy: a big buffer's second cycle is reused."""
    LLMEngine.from_engine_args(
        EngineArgs(
            model=str(tiny[0]),
            max_model_len=64,
            num_gpu_blocks_override=32,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            precompile=False,
        )
    )
    faults_of_a_cycle()
    assert faults_of_a_cycle() < (SIZE >> 12) // 10
