"""The KV-cache pool's automatic size (``kv_cache_memory`` left unset): enough for ``max_num_seqs``
sequences of ``max_model_len`` tokens, at most half the free memory, on CPU at most 4 GiB."""

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
    assert info.num_usable_blocks == 3 * 6           # ceil(44 / 8) blocks for each of 3 sequences
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
    assert llm.engine.cache_info.num_usable_blocks == 20 - 1    # 20.5 blocks' worth, the null block among them
    assert llm.engine.max_model_len == 19 * 8                  # what the pool holds, below the model's 512
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
    assert abs(kv_cache_size.free_bytes(device) - host) <= 0.05 * host      # one CPU device: all of it
    monkeypatch.setattr(jax, "local_devices", lambda backend=None: [device] * 4)
    assert abs(4 * kv_cache_size.free_bytes(device) - host) <= 0.05 * host  # four share it
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")   # MemFree: at most what is available
    assert 0.9 * free <= host <= total


def test_free_bytes_of_an_accelerator_is_its_allocators_limit_less_its_use():
    def device(platform: str, limit: int, in_use: int):
        return types.SimpleNamespace(platform=platform, process_index=0,
                                     memory_stats=lambda: {"bytes_limit": limit, "bytes_in_use": in_use})

    gpu = device("gpu", 16 << 30, 3 << 30)
    assert kv_cache_size.free_bytes(gpu) == 13 << 30
    need = (4 * 3 + 1) * 1000                        # 4 sequences of 3 blocks, and the null block
    assert kv_cache_size.auto_kv_cache_memory(1000, 16, 4, 48, [gpu]) == need
    small = device("gpu", 9000, 1000)
    assert kv_cache_size.auto_kv_cache_memory(1000, 16, 4, 48, [gpu, small]) == 4000    # the device with least free
    # Not capped off CPU: a pool the size of the need, however large.
    big = device("tpu", 80 << 30, 0)
    assert kv_cache_size.auto_kv_cache_memory(1 << 20, 16, 64, 8192, [big]) == (64 * 512 + 1) << 20


@pytest.mark.parametrize("value", [0, -5, 2.5e9, True, "1GiB"])
def test_kv_cache_memory_must_be_positive_bytes_or_unset(value):
    with pytest.raises(ValueError, match="kv_cache_memory must be a positive whole number of bytes"):
        EngineConfig.from_args(EngineArgs(kv_cache_memory=value))
    assert EngineConfig.from_args(EngineArgs()).cache.kv_cache_memory is None
