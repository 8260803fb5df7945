"""Data parallelism on 4 virtual CPU devices (run by ``test_data_parallel.py`` in a subprocess):
2 replicas of 1 or 2 devices give the single engine's outputs, spread the requests, and route
prompts sharing a first block to the replica that has it cached."""

from __future__ import annotations

import asyncio
import time

import jax
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.async_engine import AsyncLLMEngine
from jaxpaged.data_parallel import DataParallelEngine
from jaxpaged.server.metrics import ServerMetrics
from tiny_models import random_prompts

if jax.device_count() < 4:
    pytest.skip("needs 4 devices: run through test_data_parallel.py", allow_module_level=True)

ENGINE = dict(block_size=4, max_num_batched_tokens=64, num_gpu_blocks_override=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


def _run(llm, prompts):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return (
        [o.outputs[0].token_ids for o in outs],
        np.asarray(
            [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
        ),
    )


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(np.random.default_rng(5), [3, 17, 40, 9, 25, 1])


@pytest.fixture(scope="module")
def reference(tiny, prompts):
    return _run(LLM(str(tiny[0]), **ENGINE), prompts)


@pytest.mark.parametrize("tp", [1, 2])
def test_two_replicas_match_one_engine_and_share_the_load(tiny, prompts, reference, tp):
    llm = LLM(str(tiny[0]), data_parallel_size=2, tensor_parallel_size=tp, **ENGINE)
    engine = llm.engine
    assert isinstance(engine, DataParallelEngine)
    tokens, logprobs = _run(llm, prompts)
    assert tokens == reference[0]
    np.testing.assert_allclose(logprobs, reference[1], atol=1e-4)
    assert engine.router.num_routed == [3, 3]  # least loaded: alternating
    assert all(e.kv_cache_manager.stats.queries > 0 for e in engine.replicas)
    devices = [set(e.runner.memory_per_device()) for e in engine.replicas]
    assert [len(d) for d in devices] == [tp, tp] and not devices[0] & devices[1]
    assert len(engine.memory_per_device()) == 2 * tp
    assert engine.kv_cache_manager.num_free_blocks == engine.cache_info.num_usable_blocks
    engine.add_request("x", prompts[2], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", prompts[3], GREEDY)
    engine.add_request("y", prompts[3], GREEDY)
    engine.step()
    engine.abort_request("x")
    engine.abort_request("y")
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.cache_info.num_usable_blocks


def test_replicas_of_an_automatic_pool_all_take_the_first_ones_size(tiny, monkeypatch):
    """Each replica would size its pool from the memory free when it starts, which the replicas before it
    (on CPU devices, all in the host's memory) have taken; every replica gets the first one's pool."""
    from jaxpaged import kv_cache_size

    block = 4 * 2 * 2 * 2 * 16 * 4  # block size 4 of the tiny model's float32 K/V
    free = iter([81 * block, 21 * block, 21 * block])  # less for every later replica
    monkeypatch.setattr(kv_cache_size, "free_bytes", lambda device: next(free))
    engine = LLM(str(tiny[0]), data_parallel_size=2, block_size=4, max_num_batched_tokens=64).engine
    assert [e.cache_info.num_usable_blocks for e in engine.replicas] == [
        39,
        39,
    ]  # half of 81 blocks, less the null
    assert [e.max_model_len for e in engine.replicas] == [39 * 4] * 2 == [engine.max_model_len] * 2


def test_prompts_sharing_a_first_block_go_to_the_replica_that_has_it(tiny):
    llm = LLM(str(tiny[0]), data_parallel_size=2, **ENGINE)
    engine = llm.engine
    rng = np.random.default_rng(1)
    system = rng.integers(3, 350, 12).tolist()  # three full blocks of 4
    first = [system + rng.integers(3, 350, 5).tolist(), rng.integers(3, 350, 9).tolist()]
    llm.generate(first, GREEDY, use_tqdm=False)  # system prompt -> replica 0, the other -> 1
    assert engine.router.num_routed == [1, 1]
    later = [system + rng.integers(3, 350, n).tolist() for n in (3, 6, 2)]
    llm.generate(later, GREEDY, use_tqdm=False)
    assert engine.router.num_routed == [4, 1] and engine.router.num_prefix_routed == 3
    hits = [e.kv_cache_manager.stats.hits for e in engine.replicas]
    assert hits[0] >= 3 * 12 and hits[1] == 0


def test_async_engine_serves_through_replicas(tiny, reference, prompts):
    llm = LLM(str(tiny[0]), data_parallel_size=2, **ENGINE)
    engine = AsyncLLMEngine(llm.engine)

    async def one(i):
        req = engine.make_request(f"r{i}", prompts[i], GREEDY)
        async with await engine.add_request(req) as stream:
            async for out in stream:
                pass
        return out.outputs[0].token_ids

    async def main():
        return await asyncio.gather(*(one(i) for i in range(4)))

    try:
        assert asyncio.run(main()) == reference[0][:4]
        assert engine.stats.num_usable_blocks == 2 * 63
        # /metrics counts the replicas together: both took steps, and the pool is theirs.
        while engine.stats.num_running:  # until the snapshot after the last step
            time.sleep(0.01)
        num_steps = [sum(e.step_stats.iteration_tokens.counts) for e in llm.engine.replicas]
        assert all(num_steps)
        text = ServerMetrics(engine, "tiny").render().decode()
        assert f'vllm:iteration_tokens_total_count{{engine="0",model_name="tiny"}} {sum(num_steps)}.0' in text
        assert 'num_gpu_blocks="128"' in text
    finally:
        engine.shutdown()


def test_speculation_across_replicas_sums_their_counters(tiny):
    """n-gram speculation in each replica: the plain single engine's tokens, and the replicas' counters summed."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 350, 5).tolist() * 4 for _ in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    want = [
        o.outputs[0].token_ids for o in LLM(str(tiny[0]), **ENGINE).generate(prompts, greedy, use_tqdm=False)
    ]
    llm = LLM(str(tiny[0]), data_parallel_size=2, speculative_config=spec, **ENGINE)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    per_replica = [e.spec_decode_stats for e in llm.engine.replicas]
    total = llm.engine.spec_decode_stats
    assert all(s.num_drafts > 0 for s in per_replica)
    assert total.num_accepted_tokens == sum(s.num_accepted_tokens for s in per_replica) > 0
    assert total.num_drafts == sum(s.num_drafts for s in per_replica)
