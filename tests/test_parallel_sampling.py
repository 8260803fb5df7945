"""Parallel sampling (n, best_of) with block sharing: the prompt is computed once, the samples fork
from it sharing its blocks (the partly filled last one copied on first write), and each sample
equals a separate request with the sample's seed. Block-manager fork / copy-on-write invariants."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import SchedulerConfig
from jaxpaged.input_processor import _sample_seed
from jaxpaged.kv_cache_manager import KVCacheManager
from jaxpaged.request import Request, RequestStatus
from jaxpaged.scheduler import Scheduler
from tiny_models import random_prompts

BASE = dict(temperature=1.0, top_p=0.95, seed=11, max_tokens=10, ignore_eos=True)
PROMPT = random_prompts(np.random.default_rng(20), [23])[0]  # 23 tokens: last block of 8 holds 7


def signed(seed: int) -> int:
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny[0]), block_size=8, max_num_batched_tokens=32)


def separate(llm, prompt, n: int, **overrides) -> list:
    """The samples of ``n`` separate requests seeded like the samples of one request."""
    params = [
        SamplingParams(**{**BASE, **overrides, "seed": signed(_sample_seed(BASE["seed"], i))})
        for i in range(n)
    ]
    return [o.outputs[0] for o in llm.generate([prompt] * n, params, use_tqdm=False)]


def assert_pool_empty(eng) -> None:
    kv = eng.kv_cache_manager
    assert kv.num_free_blocks == eng.cache_info.num_usable_blocks
    assert kv.pool.num_block_refs == 0
    assert all(kv.pool.ref_count(b) == 0 for b in range(1, kv.pool.num_blocks))


def test_n4_shares_the_prompt_and_equals_separate_seeded_requests(llm):
    eng = llm.engine
    computed, copies, saved = [], [], []
    schedule = eng.scheduler.schedule

    def spy():
        out = schedule()
        computed.append(sum(out.num_new_tokens))
        copies.append(list(out.blocks_to_copy))
        return out

    eng.scheduler.schedule = spy
    try:
        eng.add_request("p", PROMPT, SamplingParams(n=4, logprobs=0, **BASE))
        outs = {}
        while eng.has_unfinished_requests():
            outs.update({o.request_id: o for o in eng.step() if o.finished})
            saved.append(eng.sharing_stats().saved_fraction)
    finally:
        eng.scheduler.schedule = schedule
    many = outs["p"].outputs
    # The prompt is computed once (32-token budget: one chunk), then 4 samples decode 9 more tokens.
    assert computed[0] == len(PROMPT)
    assert sum(computed) == len(PROMPT) + 4 * (BASE["max_tokens"] - 1)
    # The shared, partly filled last block is copied by three of the four samples on first write.
    assert len(copies[1]) == 3 and len({src for src, _ in copies[1]}) == 1
    assert sum(map(len, copies)) == 3
    # Right after the fork: 3 blocks in use, 4 x 3 table entries; later the 2 full prompt blocks stay shared.
    assert saved[0] == pytest.approx((4 * 3 - 3) / (4 * 3))
    assert max(saved[1:]) > 0.3
    assert_pool_empty(eng)
    ref = separate(llm, PROMPT, 4, logprobs=0)
    assert [c.token_ids for c in many] == [c.token_ids for c in ref]
    np.testing.assert_allclose(
        [c.cumulative_logprob for c in many], [c.cumulative_logprob for c in ref], atol=1e-4
    )
    assert len({tuple(c.token_ids) for c in many}) > 1


def test_best_of_returns_the_n_best_by_cumulative_logprob(llm):
    best = llm.generate([PROMPT], SamplingParams(n=2, best_of=5, **BASE), use_tqdm=False)[0]
    ref = sorted(
        enumerate(separate(llm, PROMPT, 5, logprobs=0)), key=lambda ic: ic[1].cumulative_logprob, reverse=True
    )[:2]
    assert [(c.index, c.token_ids) for c in best.outputs] == [(i, c.token_ids) for i, c in ref]
    assert_pool_empty(llm.engine)


def test_block_aligned_prompt_and_chunked_prefill(tiny):
    """A 16-token prompt (two full blocks, nothing to copy) computed in 8-token chunks; the forks
    happen only in the step of the last chunk."""
    llm = LLM(str(tiny[0]), block_size=8, max_num_batched_tokens=8)
    prompt = PROMPT[:16]
    many = llm.generate([prompt], SamplingParams(n=3, logprobs=2, **BASE), use_tqdm=False)[0].outputs
    ref = separate(llm, prompt, 3, logprobs=2)
    assert [c.token_ids for c in many] == [c.token_ids for c in ref]
    for a, b in zip(many, ref):
        assert [list(d) for d in a.logprobs] == [list(d) for d in b.logprobs]
    assert_pool_empty(llm.engine)


def test_abort_parent_with_live_children_and_before_the_fork(llm):
    eng = llm.engine
    eng.add_request("a", PROMPT, SamplingParams(n=4, **BASE))
    eng.step()
    eng.step()
    group = [eng.scheduler.get_request(f"{i}_a") for i in range(1, 4)]
    assert all(r is not None and r.status is RequestStatus.RUNNING for r in group)
    eng.abort_request("a")
    assert not eng.has_unfinished_requests()
    assert_pool_empty(eng)
    # Aborted while its prompt is still being computed (a 40-token prompt, 32-token budget).
    long_prompt = random_prompts(np.random.default_rng(21), [40])[0]
    req = eng.add_request("b", long_prompt, SamplingParams(n=3, **BASE))
    eng.step()
    assert req.pending_forks and eng.scheduler.get_request("1_b") is None
    eng.abort_request("b")
    assert not eng.has_unfinished_requests() and all(r.is_finished for r in [req, *req.forks])
    assert_pool_empty(eng)


def test_preemption_keeps_samples_equal(tiny):
    """A 12-block pool cannot hold 4 samples of 23 + 10 tokens (5 blocks each): samples are
    preempted and recomputed on their own, and still equal the separate requests."""
    llm = LLM(str(tiny[0]), block_size=8, num_gpu_blocks_override=13, max_num_batched_tokens=64)
    eng = llm.engine
    eng.add_request("p", PROMPT, SamplingParams(n=4, **{**BASE, "max_tokens": 17}))
    outs, samples = {}, []
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
        samples = samples or [r for r in (eng.scheduler.get_request(f"{i}_p") for i in range(1, 4)) if r]
    assert sum(r.num_preemptions for r in samples) > 0
    ref = separate(llm, PROMPT, 4, max_tokens=17)
    assert [c.token_ids for c in outs["p"].outputs] == [c.token_ids for c in ref]
    assert_pool_empty(eng)


def test_too_many_samples_for_max_num_seqs_is_rejected(tiny):
    llm = LLM(str(tiny[0]), block_size=8, max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate([PROMPT], SamplingParams(n=2, best_of=5, **BASE), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# ---- block manager and scheduler, no model ---------------------------------------------


def make(rid: str, n_tokens: int) -> Request:
    return Request(rid, list(range(1, n_tokens + 1)), SamplingParams(max_tokens=16), max_tokens=16, seed=0)


def test_fork_shares_every_block_and_copies_the_last_on_first_write():
    kv = KVCacheManager(16, 4)
    parent = make("p", 10)
    assert kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    child = make("c", 10)
    kv.fork(parent, child)
    assert child.block_ids == parent.block_ids and child.num_computed_tokens == 10
    assert kv.shared_tails == {"p", "c"}
    assert [kv.pool.ref_count(b) for b in parent.block_ids] == [2, 2, 2]
    assert kv.sharing_stats().saved_fraction == pytest.approx(0.5)
    shared_last = parent.block_ids[2]
    assert kv.allocate_slots(child, 1)  # writes token 11 into the shared, partly filled block
    assert child.block_ids[:2] == parent.block_ids[:2] and child.block_ids[2] != shared_last
    assert kv.take_blocks_to_copy() == [(shared_last, child.block_ids[2])]
    assert kv.pool.ref_count(shared_last) == 1
    assert kv.shared_tails == {"p"}  # the child's tail is its own copy; the parent's may be shared
    assert kv.allocate_slots(parent, 1) and parent.block_ids[2] == shared_last  # now its own: no copy
    assert kv.take_blocks_to_copy() == [] and kv.shared_tails == set()
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 15 and kv.pool.num_block_refs == 0


def test_copy_on_write_is_all_or_nothing():
    kv = KVCacheManager(4, 4)  # 3 usable blocks
    parent = make("p", 6)
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = make("c", 6)
    kv.fork(parent, child)
    assert kv.num_free_blocks == 1
    assert not kv.allocate_slots(child, 3)  # needs a copy and a new block: only one free
    assert child.block_ids == parent.block_ids and kv.take_blocks_to_copy() == []
    assert kv.allocate_slots(child, 2)  # just the copy


@pytest.mark.parametrize("mode, host_blocks", [("recompute", 0), ("swap", 12)])
def test_random_fork_workload_keeps_ref_counts_exact(mode, host_blocks):
    """Requests with pending samples, random finishes and aborts through the real scheduler, in a
    pool small enough to preempt: ref counts always equal the table entries, free + used = total,
    host pages are held exactly by swapped-out requests, nothing leaks."""
    rng = random.Random(0)
    kv = KVCacheManager(20, 4, enable_caching=True, num_host_blocks=host_blocks)
    sched = Scheduler(SchedulerConfig(24, 10, True, mode), kv, 256)
    stats = dict(forks=0, copies=0, preempted=0, swapped_in=0)
    counter = 0
    for _ in range(300):
        if rng.random() < 0.5 and sched.num_waiting < 6:
            counter += 1
            r = make(f"r{counter}", rng.randint(1, 20))
            r.max_tokens = rng.randint(1, 16)
            r.pending_forks = [
                make(f"{i}_r{counter}", r.num_prompt_tokens) for i in range(1, rng.randint(1, 4))
            ]
            for c in r.pending_forks:
                c.prompt_token_ids = r.prompt_token_ids
                c.max_tokens = r.max_tokens
            r.reserved_seqs = len(r.pending_forks)
            sched.add_request(r)
        out = sched.schedule()
        for key, n in (
            ("forks", out.forks),
            ("copies", out.blocks_to_copy),
            ("preempted", out.preempted),
            ("swapped_in", out.blocks_to_swap_in),
        ):
            stats[key] += len(n)
        rows = list(zip(out.requests, out.samples)) + [(c, True) for _, c in out.forks]
        for req, samples in rows:
            req.num_output_placeholders -= samples
            if samples and not req.is_finished:
                req.output_token_ids.append(rng.randint(1, 50))
                if req.num_output_tokens >= req.max_tokens:
                    sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
        if sched.running and rng.random() < 0.05:
            sched.abort_request(rng.choice(sched.running).request_id)
        live = sched.running + list(sched.waiting)
        assert len(sched.running) <= 10
        assert kv.pool.num_block_refs == sum(len(r.block_ids) for r in live)
        used = sum(1 for b in range(1, 20) if kv.pool.ref_count(b) > 0)
        assert kv.num_free_blocks + used == 19
        host = [h for r in live for h in r.host_block_ids]
        assert len(host) == len(set(host)) == host_blocks - kv.host_pool.num_free_blocks
        for r in sched.running:
            assert len(r.block_ids) == kv.blocks_needed(r.num_computed_tokens) and not r.host_block_ids
            # What the scheduler's decode step relies on: a request whose next token would land in a
            # shared block is among the shared tails (or at a block's start, where it allocates).
            i = r.num_computed_tokens // kv.block_size
            if r.num_computed_tokens % kv.block_size and kv.pool.ref_count(r.block_ids[i]) > 1:
                assert r.request_id in kv.shared_tails
        for r in sched.waiting:
            assert not r.block_ids
            assert len(r.host_block_ids) == kv.blocks_needed(r.num_computed_tokens)
    for r in sched.running + list(sched.waiting):
        sched.abort_request(r.request_id)
    assert kv.num_free_blocks == 19 and kv.pool.num_block_refs == 0
    assert kv.host_pool.num_free_blocks == host_blocks
    assert stats["forks"] > 20 and stats["copies"] > 10 and stats["preempted"] > 5
    assert (stats["swapped_in"] > 0) == (mode == "swap")
