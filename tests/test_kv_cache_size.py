"""The KV-cache pool's automatic size (``kv_cache_memory`` left unset): enough for ``max_num_seqs``
sequences of ``max_model_len`` tokens, at most half the free memory, on CPU at most 4 GiB; or, with
``gpu_memory_utilization``, at most that share of the device's memory less what is in use. And the
sizes ``kv_cache_memory`` takes (``4GiB``...)."""

from __future__ import annotations

import os
import types

import jax
import pytest

from jaxpaged import LLM, SamplingParams, kv_cache_size
from jaxpaged.config import EngineArgs, EngineConfig

# The tiny model: 2 layers, K and V, 2 kv heads of 16 float32 values, 512 positions.
TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def _llm(tiny, **kwargs) -> LLM:
    return LLM(str(tiny[0]), precompile=False, **kwargs)


def test_default_pool_holds_max_num_seqs_sequences_of_max_model_len(tiny):
    llm = _llm(tiny, max_num_seqs=3, max_model_len=44, block_size=8)
    info = llm.engine.cache_info
    assert info.bytes_per_block == 8 * TINY_BYTES_PER_TOKEN
    assert info.num_usable_blocks == 3 * 6  # ceil(44 / 8) blocks for each of 3 sequences
    # Three sequences of the full length run together, none preempted.
    params = SamplingParams(temperature=0.0, max_tokens=44 - 10, ignore_eos=True)
    outs = llm.generate([[5 + i] * 10 for i in range(3)], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [34] * 3
    assert llm.engine.scheduler.num_preemptions == 0
    assert llm.engine.kv_cache_manager.num_free_blocks == 18

    # Without max_model_len, the model's positions (512) bound a sequence.
    assert _llm(tiny, max_num_seqs=2, block_size=16).engine.cache_info.num_usable_blocks == 2 * 512 // 16


def test_default_pool_takes_at_most_half_the_free_memory(tiny, monkeypatch):
    block = 8 * TINY_BYTES_PER_TOKEN
    monkeypatch.setattr(kv_cache_size, "free_bytes", lambda device: 41 * block)
    llm = _llm(tiny, max_num_seqs=64, block_size=8)
    assert llm.engine.cache_info.num_usable_blocks == 20 - 1  # 20.5 blocks' worth, the null block among them
    assert llm.engine.max_model_len == 19 * 8  # what the pool holds, below the model's 512
    # An explicit size is taken as given.
    assert _llm(tiny, block_size=8, kv_cache_memory=100 * block).engine.cache_info.num_usable_blocks == 99
    monkeypatch.setattr(kv_cache_size, "free_bytes", lambda device: block)
    with pytest.raises(ValueError, match=r"half the memory free on the device \(2048 bytes\) holds 0 blocks"):
        _llm(tiny, block_size=8)
    # A block count given outright asks the devices nothing (in a multi-host engine, no collective).
    monkeypatch.setattr(kv_cache_size, "free_bytes", lambda device: pytest.fail("free memory queried"))
    assert _llm(tiny, block_size=8, num_gpu_blocks_override=7).engine.cache_info.num_usable_blocks == 6


def test_default_pool_on_cpu_is_at_most_the_cap(tiny, monkeypatch):
    block = 8 * TINY_BYTES_PER_TOKEN
    monkeypatch.setattr(kv_cache_size, "CPU_CAP", 30 * block + 5)
    assert _llm(tiny, max_num_seqs=64, block_size=8).engine.cache_info.num_usable_blocks == 29


def test_free_bytes_of_a_cpu_device_is_its_share_of_the_hosts_available_memory(monkeypatch):
    device = jax.devices("cpu")[0]
    host = kv_cache_size.host_available_bytes()
    assert abs(kv_cache_size.free_bytes(device) - host) <= 0.05 * host  # one CPU device: all of it
    monkeypatch.setattr(jax, "local_devices", lambda backend=None: [device] * 4)
    assert abs(4 * kv_cache_size.free_bytes(device) - host) <= 0.05 * host  # four share it
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # MemFree: at most what is available
    assert 0.9 * free <= host <= total


def test_free_bytes_of_an_accelerator_is_its_allocators_limit_less_its_use():
    def device(platform: str, limit: int, in_use: int):
        return types.SimpleNamespace(
            platform=platform,
            process_index=0,
            memory_stats=lambda: {"bytes_limit": limit, "bytes_in_use": in_use},
        )

    gpu = device("gpu", 16 << 30, 3 << 30)
    assert kv_cache_size.free_bytes(gpu) == 13 << 30
    need = (4 * 3 + 1) * 1000  # 4 sequences of 3 blocks, and the null block
    assert kv_cache_size.auto_kv_cache_memory(1000, 16, 4, 48, [gpu]) == need
    small = device("gpu", 9000, 1000)
    assert (
        kv_cache_size.auto_kv_cache_memory(1000, 16, 4, 48, [gpu, small]) == 4000
    )  # the device with least free
    # Not capped off CPU: a pool the size of the need, however large.
    big = device("tpu", 80 << 30, 0)
    assert kv_cache_size.auto_kv_cache_memory(1 << 20, 16, 64, 8192, [big]) == (64 * 512 + 1) << 20


@pytest.mark.parametrize("value", [0, -5, 2.5e9, True, "0GiB", "-1GiB", "1GX", "GiB", "4 GiB 2", ""])
def test_kv_cache_memory_must_be_a_positive_size_or_unset(value):
    with pytest.raises(
        ValueError, match="kv_cache_memory must be a (positive size|whole number of bytes or a size)"
    ):
        EngineConfig.from_args(EngineArgs(kv_cache_memory=value))
    assert EngineConfig.from_args(EngineArgs()).cache.kv_cache_memory is None


@pytest.mark.parametrize(
    "value, size",
    [
        ("4GiB", 4 * 2**30),
        ("4G", 4 * 2**30),
        ("4gib", 4 * 2**30),
        ("512MiB", 512 * 2**20),
        ("512M", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("64KiB", 2**16),
        ("2TiB", 2**41),
        ("1GB", 10**9),
        ("3MB", 3 * 10**6),
        ("1000", 1000),
        (" 7 B ", 7),
        (12345, 12345),
    ],
)
def test_kv_cache_memory_takes_sizes_with_units(value, size):
    assert EngineConfig.from_args(EngineArgs(kv_cache_memory=value)).cache.kv_cache_memory == size


def _accelerator(limit: int, in_use: int, platform: str = "gpu"):
    return types.SimpleNamespace(
        platform=platform,
        process_index=0,
        memory_stats=lambda: {"bytes_limit": limit, "bytes_in_use": in_use},
    )


def test_gpu_memory_utilization_budget_is_that_share_of_the_device_less_its_use():
    """vLLM's rule: the pool gets F x the device's memory less what the weights already use, up to the
    need of max_num_seqs full sequences; without F half the free memory."""
    gpu = _accelerator(16 << 30, 3 << 30)
    assert kv_cache_size.budget_bytes(gpu, 0.9) == int(0.9 * (16 << 30)) - (3 << 30)
    assert kv_cache_size.budget_bytes(gpu, None) == (13 << 30) // 2
    block = 1 << 20
    need = (64 * 512 + 1) * block  # 64 sequences of 8192 tokens in blocks of 16: 32 GiB
    assert kv_cache_size.auto_kv_cache_memory(block, 16, 64, 8192, [gpu], 0.9) == int(0.9 * (16 << 30)) - (
        3 << 30
    )
    assert kv_cache_size.auto_kv_cache_memory(block, 16, 64, 8192, [gpu], 0.5) == (5 << 30)
    assert kv_cache_size.auto_kv_cache_memory(block, 16, 64, 8192, [_accelerator(80 << 30, 0)], 0.9) == need
    # Weights already over the budget: nothing left (the engine then says which budget was too small).
    assert kv_cache_size.auto_kv_cache_memory(block, 16, 64, 8192, [gpu], 0.1) < 0
    assert "gpu_memory_utilization=0.1" in kv_cache_size.budget_rule(0.1)


def test_gpu_memory_utilization_on_cpu_is_a_share_of_available_memory_without_the_cap(monkeypatch):
    cpu = jax.devices("cpu")[0]
    monkeypatch.setattr(kv_cache_size, "host_available_bytes", lambda: 64 << 30)
    monkeypatch.setattr(jax, "local_devices", lambda backend=None: [cpu] * 2)  # two devices share the host
    block = 1 << 20
    assert kv_cache_size.budget_bytes(cpu, 0.25) == 8 << 30
    assert kv_cache_size.auto_kv_cache_memory(block, 16, 64, 8192, [cpu], 0.25) == 8 << 30  # above CPU_CAP
    assert kv_cache_size.auto_kv_cache_memory(block, 16, 64, 8192, [cpu]) == kv_cache_size.CPU_CAP


def test_engine_sizes_its_pool_from_gpu_memory_utilization(tiny, monkeypatch):
    block = 8 * TINY_BYTES_PER_TOKEN
    monkeypatch.setattr(kv_cache_size, "device_memory", lambda device: (100 * block, 20 * block))
    llm = _llm(tiny, max_num_seqs=64, block_size=8, gpu_memory_utilization=0.5)
    assert llm.engine.cache_info.num_usable_blocks == 50 - 20 - 1
    # An explicit size wins over the fraction.
    explicit = _llm(tiny, block_size=8, kv_cache_memory="32KiB", gpu_memory_utilization=0.5)
    assert explicit.engine.cache_info.num_blocks == 32 * 1024 // block
    with pytest.raises(
        ValueError,
        match=r"gpu_memory_utilization=0.2 of the device's memory, less what is in use, "
        r"\(0 bytes\) holds 0 blocks",
    ):
        _llm(tiny, block_size=8, gpu_memory_utilization=0.2)


@pytest.mark.parametrize("value", [0, -0.1, 1.01, True, "0.9"])
def test_gpu_memory_utilization_must_be_a_fraction(value):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a fraction in \(0, 1\]"):
        EngineConfig.from_args(EngineArgs(gpu_memory_utilization=value))
