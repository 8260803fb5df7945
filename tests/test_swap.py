"""Swap preemption: a preempted request's blocks go to a host page pool and come back; outputs
equal those without memory pressure; the host pool ends empty; a full host pool falls back to
recomputation."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, BeamSearchParams, SamplingParams
from tiny_models import random_prompts

PROMPTS = random_prompts(np.random.default_rng(0), [1, 5, 17, 40, 9, 23])
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
SAMPLED = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # layers x (K, V) x block_size 4 x kv heads x head_dim x float32
BLOCK_GIB = BLOCK_BYTES / 2**30  # swap_space is in GiB, as vLLM's
TIGHT = dict(block_size=4, num_gpu_blocks_override=14, max_num_batched_tokens=64)  # 13 blocks: 52 tokens


@pytest.fixture(scope="module")
def unpressured(tiny):
    """Reference outputs from an engine with room for everything."""
    llm = LLM(str(tiny[0]), block_size=4, max_num_batched_tokens=64)
    greedy = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    sampled = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[2:5], SAMPLED, use_tqdm=False)]
    beams = [
        [s.tokens for s in o.sequences]
        for o in llm.beam_search(
            [PROMPTS[2], PROMPTS[5]], BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
        )
    ]
    return greedy, sampled, beams


def run(llm, prompts, params):
    eng = llm.engine
    reqs = [eng.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    return reqs, [outs[f"r{i}"] for i in range(len(prompts))]


def assert_pools_empty(eng):
    kv = eng.kv_cache_manager
    assert kv.num_free_blocks == eng.cache_info.num_usable_blocks and kv.pool.num_block_refs == 0
    assert kv.host_pool.num_free_blocks == kv.host_pool.num_blocks


def test_swap_outputs_equal_outputs_without_pressure(tiny, unpressured):
    greedy, sampled, _ = unpressured
    llm = LLM(str(tiny[0]), preemption_mode="swap", swap_space=64 * BLOCK_GIB, **TIGHT)
    eng = llm.engine
    assert eng.kv_cache_manager.host_pool.num_blocks == 64
    swaps_in, swaps_out = [], []
    schedule = eng.scheduler.schedule

    def spy():
        out = schedule()
        swaps_out.extend(out.blocks_to_swap_out)
        swaps_in.extend(out.blocks_to_swap_in)
        return out

    eng.scheduler.schedule = spy
    reqs, outs = run(llm, PROMPTS, GREEDY)
    assert sum(r.num_preemptions for r in reqs) > 0 and eng.scheduler.num_swapped_out > 0
    assert len(swaps_out) == len(swaps_in) > 0  # every swapped block came back
    assert [o.outputs[0].token_ids for o in outs] == [c.token_ids for c in greedy]
    for o, ref in zip(outs, greedy):
        ours = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        refs = [d[t].logprob for d, t in zip(ref.logprobs, ref.token_ids)]
        np.testing.assert_allclose(ours, refs, atol=1e-4)
    assert_pools_empty(eng)
    # Parallel samples sharing blocks under the same pressure.
    swapped_before = eng.scheduler.num_swapped_out
    reqs, outs = run(llm, PROMPTS[2:5], SAMPLED)
    assert eng.scheduler.num_swapped_out > swapped_before
    assert [[c.token_ids for c in o.outputs] for o in outs] == sampled
    assert_pools_empty(eng)


def test_full_host_pool_falls_back_to_recompute(tiny, unpressured):
    greedy = unpressured[0]
    llm = LLM(str(tiny[0]), preemption_mode="swap", swap_space=5 * BLOCK_GIB, **TIGHT)
    eng = llm.engine
    reqs, outs = run(llm, PROMPTS, GREEDY)
    preemptions = sum(r.num_preemptions for r in reqs)
    assert 0 < eng.scheduler.num_swapped_out < preemptions  # some swapped, the rest recomputed
    assert [o.outputs[0].token_ids for o in outs] == [c.token_ids for c in greedy]
    assert_pools_empty(eng)


def test_beam_search_under_swap_pressure(tiny, unpressured):
    """Beams wait for each other every step; idle beams get swapped out and forked from while
    swapped (the fork then recomputes). The beams are those found without pressure."""
    beams = unpressured[2]
    llm = LLM(
        str(tiny[0]),
        preemption_mode="swap",
        swap_space=64 * BLOCK_GIB,
        block_size=4,
        num_gpu_blocks_override=12,
        max_num_batched_tokens=64,
    )
    outs = llm.beam_search(
        [PROMPTS[2], PROMPTS[5]], BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    )
    assert llm.engine.scheduler.num_swapped_out > 0
    assert [[s.tokens for s in o.sequences] for o in outs] == beams
    assert_pools_empty(llm.engine)


def test_bad_preemption_mode(tiny):
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(str(tiny[0]), preemption_mode="drop")
    with pytest.raises(ValueError, match="swap_space"):
        LLM(str(tiny[0]), preemption_mode="swap", swap_space=-1)
