"""Scheduler: budgets, FCFS order, fair turns between multi-prompt requests, priorities, chunked
prefill, preemption by recomputation, aborts, admission errors; random workloads driven by a fake
engine loop that checks every step."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxpaged.block_pool import NULL_BLOCK_ID
from jaxpaged.config import SchedulerConfig
from jaxpaged.generation_config import GenerationDefaults
from jaxpaged.input_processor import InputProcessor
from jaxpaged.kv_cache_manager import KVCacheManager
from jaxpaged.request import Request, RequestStatus
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.scheduler import Scheduler, SchedulerOutput


def make_request(rid: str, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    return Request(
        rid,
        [7] * prompt_len,
        SamplingParams(max_tokens=max_tokens),
        max_tokens=max_tokens,
        seed=0,
        multi_step=True,
        priority=priority,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 16,
    max_seqs: int = 8,
    chunked: bool = True,
    max_model_len: int = 1024,
    num_scheduler_steps: int = 1,
    policy: str = "fcfs",
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            budget, max_seqs, chunked, num_scheduler_steps=num_scheduler_steps, scheduling_policy=policy
        ),
        KVCacheManager(num_blocks, block_size),
        max_model_len,
    )


def make_input_processor(max_model_len: int, budget: int = 16, chunked: bool = True) -> InputProcessor:
    """The engine's admission check (``InputProcessor.make_request``), which the scheduler leaves to it:
    for token-id prompts it needs no tokenizer (only its EOS id) and no grammar compiler."""
    return InputProcessor(
        SimpleNamespace(eos_token_id=None),
        GenerationDefaults(),
        None,
        SchedulerConfig(budget, 8, chunked),
        vocab_size=100,
        max_model_len=max_model_len,
        seed=0,
    )


class FakeEngine:
    """Drives a scheduler like the engine does (append a token to every request that sampled, one
    per step of a multi-step group, finish it at max_tokens) and checks every step. With ``lag`` the tokens of a step are taken in
    after the next step is scheduled, as the engine's async scheduling does (the scheduler counts
    them as output placeholders meanwhile)."""

    def __init__(self, sched: Scheduler, lag: bool = False) -> None:
        self.sched = sched
        self.kv = sched.kv_cache_manager
        self.lag = lag
        self.in_flight: list[Request] = []
        self.computed = Counter[str]()  # tokens computed per request, recomputation included
        self.lost = Counter[str]()  # tokens thrown away by preemption
        self.num_steps = 0

    def step(self) -> SchedulerOutput:
        sched = self.sched
        running_before, waiting_before = list(sched.running), list(sched.waiting)
        computed_before = {r.request_id: r.num_computed_tokens for r in running_before + waiting_before}
        out = sched.schedule()
        self.num_steps += 1
        self._check_output(out, running_before, waiting_before, computed_before)
        for req in out.preempted:  # (a victim whose last token is in flight loses nothing: it is done)
            if req.num_output_tokens + req.num_output_placeholders < req.max_tokens:
                self.lost[req.request_id] += computed_before[req.request_id]
        for req, n in zip(out.requests, out.num_new_tokens):
            self.computed[req.request_id] += n
        sampled = [
            (req, n if out.num_steps > 1 else 1)
            for req, n, samples in zip(out.requests, out.num_new_tokens, out.samples)
            if samples
        ]
        if self.lag:
            sampled, self.in_flight = self.in_flight, sampled
        for req, count in sampled:
            for _ in range(count):
                req.num_output_placeholders -= 1
                if req.is_finished:  # aborted while its step was in flight
                    continue
                req.output_token_ids.append(len(req.output_token_ids))
                if req.num_output_tokens == req.max_tokens:
                    sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
        check_scheduler_state(sched)
        return out

    def _check_output(
        self,
        out: SchedulerOutput,
        running_before: list[Request],
        waiting_before: list[Request],
        computed_before: dict[str, int],
    ) -> None:
        cfg = self.sched.config
        assert len(out.requests) == len(out.num_new_tokens) == len(out.start_positions)
        assert out.total_num_tokens == sum(out.num_new_tokens)
        # A group of steps computes one token per row in each step.
        assert (
            len(out.requests) if out.num_steps > 1 else out.total_num_tokens
        ) <= cfg.max_num_batched_tokens
        assert len(out.requests) <= cfg.max_num_seqs
        assert out.is_empty == (not out.requests)
        assert out.blocks_to_copy == []
        assert len({id(r) for r in out.requests}) == len(out.requests)
        assert len(out.samples) == len(out.requests)
        for req, n, start, samples in zip(out.requests, out.num_new_tokens, out.start_positions, out.samples):
            assert n >= 1
            assert start == computed_before[req.request_id]
            assert req.num_computed_tokens == start + n
            # A row samples when it reaches its last known token (which then has a placeholder after it).
            assert (
                start + n == req.num_tokens_with_placeholders - 1 if samples else start + n < req.num_tokens
            )
            assert start + n <= self.sched.max_model_len
            assert req.status is RequestStatus.RUNNING
            assert req.num_output_tokens + req.num_output_placeholders <= req.max_tokens
        # Running requests first, as a prefix of admission order; then waiting ones, FCFS.
        # (Passing over running requests that wait for their last token, in flight.)
        k = sum(r in running_before for r in out.requests)
        eligible = [
            r
            for r in running_before
            if r in out.requests
            or (r.num_output_tokens + r.num_output_placeholders < r.max_tokens and r not in out.preempted)
        ]
        if out.num_steps > 1:
            # A group: every running request with outputs left, those with more steps first.
            assert (
                1 < out.num_steps == cfg.num_scheduler_steps and not out.preempted and k == len(out.requests)
            )
            assert sorted(map(id, out.requests)) == sorted(map(id, eligible))
            assert out.num_new_tokens == sorted(out.num_new_tokens, reverse=True)
            assert max(out.num_new_tokens) <= out.num_steps
            return
        assert out.requests[:k] == eligible[:k]
        assert out.requests[k:] == waiting_before[: len(out.requests) - k]
        if out.preempted:
            assert k == len(out.requests), "admitted a waiting request in a step that preempted"
        for victim in out.preempted:
            assert victim in running_before and victim not in out.requests
            assert victim.status is RequestStatus.PREEMPTED
            assert victim.num_computed_tokens == 0 and victim.block_ids == []
        admitted = len(out.requests) - k
        # Waiting order is kept, victims queued among it: at the front (oldest first), by priority, or
        # (making room for a new request) right behind it.
        assert sorted(map(id, self.sched.waiting)) == sorted(
            map(id, out.preempted + waiting_before[admitted:])
        )
        assert [r for r in self.sched.waiting if r not in out.preempted] == waiting_before[admitted:]
        front = list(self.sched.waiting)[: len(out.preempted)]
        if not self.sched.by_priority and all(r in out.preempted for r in front):
            assert front == out.preempted[::-1]
        # A running request not scheduled is out of budget, or waits for its last token, in flight.
        unscheduled = [
            r
            for r in running_before
            if r not in out.requests
            and r not in out.preempted
            and r.num_output_tokens + r.num_output_placeholders < r.max_tokens
        ]
        if unscheduled:
            assert out.total_num_tokens == cfg.max_num_batched_tokens

    def run(self, max_steps: int) -> None:
        while self.sched.has_unfinished_requests() or self.in_flight:
            assert self.num_steps < max_steps, "requests starved or deadlocked"
            self.step()


def check_scheduler_state(sched: Scheduler) -> None:
    """Block tables exact and disjoint, queues consistent, no leaked blocks."""
    kv = sched.kv_cache_manager
    assert len(sched.running) <= sched.config.max_num_seqs
    assert sched.num_running == len(sched.running) and sched.num_waiting == len(sched.waiting)
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
    if sched.by_priority:  # the preemption victim, last, has the lowest priority
        assert [r.priority for r in sched.running] == sorted(r.priority for r in sched.running)
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0
    live = sched.running + list(sched.waiting)
    assert len(live) == len(set(map(id, live)))
    assert sched._num_grouped == sum(r.queue_group > 0 for r in sched._requests.values())
    for r in live:
        assert sched.get_request(r.request_id) is r
        assert len(r.block_ids) == kv.blocks_needed(r.num_computed_tokens)
        assert all(kv.pool.ref_count(b) == 1 for b in r.block_ids)
    blocks = [b for r in live for b in r.block_ids]
    assert len(blocks) == len(set(blocks)) and NULL_BLOCK_ID not in blocks
    assert kv.num_free_blocks + len(blocks) == kv.pool.num_usable_blocks


def assert_all_done(sched: Scheduler, requests: list[Request]) -> None:
    assert not sched.has_unfinished_requests()
    assert sched.num_running == sched.num_waiting == 0
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.pool.num_usable_blocks and kv.usage == 0.0
    for r in requests:
        assert r.block_ids == [] and sched.get_request(r.request_id) is None


def test_modules_do_not_import_jax_or_numpy() -> None:
    code = (
        "import sys, jaxpaged.scheduler, jaxpaged.kv_cache_manager; "
        "bad = [m for m in ('jax', 'jaxlib', 'numpy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_empty_schedule() -> None:
    out = make_scheduler().schedule()
    assert out.is_empty and out.total_num_tokens == 0 and out.preempted == []


def test_chunked_prefill_splits_long_prompt_and_mixes_with_decodes() -> None:
    sched = make_scheduler(budget=8)
    eng = FakeEngine(sched)
    a = make_request("a", 3, 5)
    sched.add_request(a)
    out = eng.step()
    assert (out.requests, out.num_new_tokens) == ([a], [3])
    b = make_request("b", 20, 2)
    sched.add_request(b)
    steps = [eng.step() for _ in range(3)]
    assert [o.requests for o in steps] == [[a, b]] * 3
    assert [o.num_new_tokens for o in steps] == [[1, 7], [1, 7], [1, 6]]
    assert [o.start_positions for o in steps] == [[3, 0], [4, 7], [5, 14]]
    assert b.num_output_tokens == 1 and a.num_output_tokens == 4
    eng.run(max_steps=20)
    assert a.num_output_tokens == 5 and b.num_output_tokens == 2
    assert_all_done(sched, [a, b])


def test_chunked_prefill_off_keeps_prompts_whole_and_fcfs() -> None:
    sched = make_scheduler(budget=8, chunked=False)
    eng = FakeEngine(sched)
    a = make_request("a", 3, 3)
    sched.add_request(a)
    eng.step()
    b, c = make_request("b", 8, 1), make_request("c", 2, 1)
    sched.add_request(b)
    sched.add_request(c)
    out = eng.step()  # a decodes; b (8) does not fit the 7 left; c waits behind b
    assert (out.requests, out.num_new_tokens) == ([a], [1])
    eng.step()  # a's last token
    assert a.is_finished
    out = eng.step()
    assert (out.requests, out.num_new_tokens) == ([b], [8])
    out = eng.step()
    assert (out.requests, out.num_new_tokens) == ([c], [2])
    assert_all_done(sched, [a, b, c])


def test_chunked_prefill_off_splits_only_a_resumed_request_longer_than_the_budget() -> None:
    # 3 usable blocks of 4 tokens; budget 6. `b` gets preempted after producing outputs and
    # must resume with prompt + outputs > budget: it is split, the only way to progress.
    sched = make_scheduler(num_blocks=4, block_size=4, budget=6, chunked=False)
    eng = FakeEngine(sched)
    a, b = make_request("a", 1, 8), make_request("b", 4, 5)
    sched.add_request(a)
    sched.add_request(b)
    resumed_chunks = []
    while sched.has_unfinished_requests():
        assert eng.num_steps < 60
        out = eng.step()
        if b in out.requests and b.num_preemptions:
            i = out.requests.index(b)
            resumed_chunks.append((out.start_positions[i], out.num_new_tokens[i]))
    assert b.num_preemptions == 1
    assert resumed_chunks[:2] == [(0, 6), (6, 2)]  # 8 known tokens > budget 6: split
    assert a.num_output_tokens == 8 and b.num_output_tokens == 5
    assert_all_done(sched, [a, b])


def test_max_num_seqs_limits_admission() -> None:
    sched = make_scheduler(max_seqs=2, budget=64)
    reqs = [make_request(str(i), 2, 2) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    eng = FakeEngine(sched)
    out = eng.step()
    assert out.requests == reqs[:2] and sched.num_waiting == 1
    out = eng.step()
    assert out.requests == reqs[:2]  # both finish now
    out = eng.step()
    assert out.requests == reqs[2:]
    eng.run(max_steps=10)
    assert_all_done(sched, reqs)


def test_a_multi_prompt_request_takes_turns_with_later_requests() -> None:
    """400 prompts of one request do not all run before the request sent after them: that one goes
    first in the queue, and as the big request holds every slot, its newest running prompt makes room
    (queued right behind): the small request starts in the next step. Two multi-prompt requests
    alternate prompt by prompt."""
    sched = make_scheduler(max_seqs=2, budget=64)
    eng = FakeEngine(sched)
    big = [make_request(f"big{i}", 2, 20) for i in range(400)]
    sched.add_requests(big)
    assert eng.step().requests == big[:2]
    small = make_request("small", 2, 2)
    sched.add_request(small)
    assert list(sched.waiting)[:2] == [small, big[2]]
    out = eng.step()
    assert out.preempted == [big[1]] and out.requests == [big[0]]
    assert list(sched.waiting)[:3] == [small, big[1], big[2]]
    assert eng.step().requests == [big[0], small]
    eng.step()
    assert small.status is RequestStatus.FINISHED_LENGTH and small.num_preemptions == 0

    other = [make_request(f"other{i}", 2, 20) for i in range(3)]
    sched.add_requests(other)
    assert list(sched.waiting)[:6] == [big[1], other[0], big[2], other[1], big[3], other[2]]  # resumed first
    eng.run(max_steps=20000)
    assert_all_done(sched, [*big, small, *other])


def test_making_room_for_a_new_request_keeps_each_request_one_running() -> None:
    """A new request asking for more sequences than can be freed (each running request keeps one, a
    higher priority's none are taken) waits, and nothing is preempted for it."""
    sched = make_scheduler(max_seqs=4, budget=64)
    eng = FakeEngine(sched)
    a, b = [make_request(f"a{i}", 2, 20) for i in range(2)], [make_request(f"b{i}", 2, 20) for i in range(2)]
    sched.add_requests(a)
    sched.add_requests(b)
    eng.step()
    wide = make_request("wide", 2, 2)
    wide.reserved_seqs = 2  # n = 3: 3 slots, but only 2 can be freed
    sched.add_request(wide)
    assert not eng.step().preempted and sched.num_running == 4


def test_a_turn_lasts_as_many_tags_as_the_prompt_runs_sequences() -> None:
    """A prompt with n = 4 samples counts as 4 sequences: a later single-sequence request goes ahead
    of the big request's next prompt."""
    sched = make_scheduler(max_seqs=8, budget=64)
    big = [make_request(f"big{i}", 2, 2) for i in range(3)]
    for r in big:
        r.reserved_seqs = 3
    sched.add_requests(big)
    assert [r.queue_tag for r in big] == [0, 4, 8]
    single = make_request("single", 2, 2)
    sched.add_request(single)
    assert list(sched.waiting) == [big[0], single, big[1], big[2]]


def test_add_requests_is_all_or_nothing() -> None:
    sched = make_scheduler(max_model_len=16)
    good = make_request("good", 2, 2)
    with pytest.raises(ValueError, match="needs 75 KV blocks"):  # 63 usable blocks of 4 tokens
        sched.add_requests([good, make_request("too-big", 200, 100)])
    # A prompt too long for max_model_len never reaches the scheduler: the engine's check refuses it.
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        make_input_processor(16).make_request("too-long", [7] * 10, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match=r"\['twin'\] are given twice"):
        sched.add_requests([make_request("twin", 2, 2), make_request("twin", 2, 2)])
    assert not sched.has_unfinished_requests() and not sched.waiting


def test_priority_policy_runs_the_lowest_priority_value_first_and_preempts_the_highest() -> None:
    """vLLM's ``priority`` policy: waiting requests by (priority, arrival); the running request with
    the largest priority value is the preemption victim, even when it is not the newest."""
    sched = make_scheduler(num_blocks=4, block_size=4, budget=16, policy="priority")  # 3 blocks of 4
    eng = FakeEngine(sched)
    low, high, mid = (
        make_request("low", 4, 4, priority=5),
        make_request("high", 1, 3),
        make_request("mid", 1, 3, 1),
    )
    for r in (low, high, mid):
        sched.add_request(r)
    assert list(sched.waiting) == [high, mid, low]
    assert eng.step().requests == [high, mid, low] and sched.running == [high, mid, low]
    out = eng.step()  # low crosses into a second block: it is the victim itself
    assert out.preempted == [low] and sched.running == [high, mid]
    later = make_request("later", 1, 1, priority=9)
    sched.add_request(later)
    assert list(sched.waiting) == [low, later]  # a resumed request goes before new ones of lower priority
    eng.run(max_steps=40)
    assert_all_done(sched, [low, high, mid, later])


def preemption_scenario() -> tuple[Scheduler, FakeEngine, list[Request]]:
    """3 usable blocks of 4 tokens. a, b, c each take one block in step 1; in step 2 `a`
    crosses into a second block and the newest running request, c, is preempted."""
    sched = make_scheduler(num_blocks=4, block_size=4, budget=16)
    eng = FakeEngine(sched)
    reqs = [make_request("a", 4, 4), make_request("b", 1, 3), make_request("c", 1, 3)]
    for r in reqs:
        sched.add_request(r)
    out = eng.step()
    assert out.requests == reqs and sched.kv_cache_manager.num_free_blocks == 0
    return sched, eng, reqs


def test_preempts_newest_running_and_resumes_it_before_later_arrivals() -> None:
    sched, eng, (a, b, c) = preemption_scenario()
    d = make_request("d", 1, 1)
    sched.add_request(d)
    out = eng.step()
    assert out.requests == [a, b] and out.preempted == [c]
    assert c.status is RequestStatus.PREEMPTED and c.num_preemptions == 1
    assert c.num_computed_tokens == 0 and c.block_ids == [] and c.num_output_tokens == 1
    assert list(sched.waiting) == [c, d]
    assert sched.running == [a, b] and a.num_preemptions == b.num_preemptions == 0
    eng.run(max_steps=30)
    assert [r.num_output_tokens for r in (a, b, c, d)] == [4, 3, 3, 1]
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in (a, b, c, d))
    # c recomputed what it had lost; nothing else was computed twice.
    for r in (a, b, c, d):
        assert eng.computed[r.request_id] == r.num_tokens - 1 + eng.lost[r.request_id]
    assert eng.lost["c"] == 1
    assert_all_done(sched, [a, b, c, d])


def test_running_request_preempts_itself_when_it_is_the_newest() -> None:
    # 4 usable blocks of 2 tokens; b (newest) cannot grow and goes back to the waiting queue.
    sched = make_scheduler(num_blocks=5, block_size=2, budget=16)
    eng = FakeEngine(sched)
    a, b, c = make_request("a", 4, 4), make_request("b", 2, 2), make_request("c", 1, 1)
    sched.add_request(a)
    sched.add_request(b)
    eng.step()  # a: 2 blocks, b: 1 block, 1 free
    sched.add_request(c)
    out = eng.step()  # a takes the last block, b cannot get one
    assert out.requests == [a] and out.preempted == [b]
    assert list(sched.waiting) == [b, c]
    out = eng.step()  # b still does not fit, c must not jump the queue
    assert out.requests == [a]
    eng.run(max_steps=20)
    assert [r.num_output_tokens for r in (a, b, c)] == [4, 2, 1]
    assert_all_done(sched, [a, b, c])


def test_lone_request_filling_the_whole_pool_finishes() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, budget=3)  # 16 tokens of KV
    eng = FakeEngine(sched)
    big = make_request("big", 10, 6)
    small = [make_request(f"s{i}", 2, 3) for i in range(3)]
    sched.add_request(small[0])
    sched.add_request(big)
    for r in small[1:]:
        sched.add_request(r)
    eng.run(max_steps=sum(r.num_prompt_tokens + r.max_tokens for r in small + [big]))
    assert big.num_output_tokens == 6 and all(r.num_output_tokens == 3 for r in small)
    assert_all_done(sched, small + [big])


def test_request_up_to_max_model_len_is_accepted_and_finishes() -> None:
    sched = make_scheduler(max_model_len=12, num_blocks=4, block_size=4)
    r = make_request("r", 5, 7)
    sched.add_request(r)
    eng = FakeEngine(sched)
    eng.run(max_steps=20)
    assert r.num_tokens == 12 and r.num_output_tokens == 7
    assert_all_done(sched, [r])


def _abort_waiting(sched: Scheduler, eng: FakeEngine) -> Request:
    victim = make_request("victim", 5, 2)
    sched.add_request(victim)
    return victim


def _abort_mid_prefill(sched: Scheduler, eng: FakeEngine) -> Request:
    victim = make_request("victim", 40, 2)
    sched.add_request(victim)
    eng.step()
    assert 0 < victim.num_computed_tokens < victim.num_prompt_tokens
    return victim


def _abort_running(sched: Scheduler, eng: FakeEngine) -> Request:
    victim = make_request("victim", 5, 4)
    sched.add_request(victim)
    eng.step()
    eng.step()
    assert victim.status is RequestStatus.RUNNING and victim.num_output_tokens == 2
    return victim


def _abort_preempted(sched: Scheduler, eng: FakeEngine) -> Request:
    # An older, long request grows until the pool is dry and preempts the newer victim.
    hog = make_request("hog", 32, 8)
    sched.add_request(hog)
    eng.step()
    eng.step()
    victim = make_request("victim", 4, 4)
    sched.add_request(victim)
    for _ in range(10):
        eng.step()
        if victim.status is RequestStatus.PREEMPTED:
            assert victim.num_output_tokens >= 1
            return victim
    raise AssertionError("victim was never preempted")


@pytest.mark.parametrize(
    "put_in_state", [_abort_waiting, _abort_mid_prefill, _abort_running, _abort_preempted]
)
def test_abort_in_every_state_frees_everything(put_in_state) -> None:
    sched = make_scheduler(num_blocks=12, block_size=4, budget=16)  # 11 usable blocks
    eng = FakeEngine(sched)
    other = make_request("other", 3, 6)
    sched.add_request(other)
    eng.step()
    victim = put_in_state(sched, eng)
    others_blocks = sum(len(r.block_ids) for r in sched.running if r is not victim)
    assert sched.abort_request("victim") is victim
    assert victim.status is RequestStatus.FINISHED_ABORTED and victim.block_ids == []
    assert sched.get_request("victim") is None
    assert victim not in sched.running and victim not in sched.waiting
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.pool.num_usable_blocks - others_blocks
    check_scheduler_state(sched)
    assert sched.abort_request("victim") is None
    sched.finish_request(victim, RequestStatus.FINISHED_LENGTH)  # late finish: a no-op
    assert victim.status is RequestStatus.FINISHED_ABORTED
    eng.run(max_steps=100)
    assert other.status is RequestStatus.FINISHED_LENGTH and other.num_output_tokens == 6
    assert_all_done(sched, [victim, other])


def test_abort_unknown_request_returns_none() -> None:
    sched = make_scheduler()
    assert sched.abort_request("nope") is None


def test_finish_request_needs_a_finished_status() -> None:
    sched = make_scheduler()
    r = make_request("r", 2, 2)
    sched.add_request(r)
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_request(r, RequestStatus.RUNNING)
    sched.schedule()
    sched.finish_request(r, RequestStatus.FINISHED_STOPPED)
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert_all_done(sched, [r])


@pytest.mark.parametrize(
    "prompt_len,max_tokens,chunked,max_model_len,match",
    [
        # The engine's checks (InputProcessor): the scheduler never sees these requests.
        (0, 4, True, 64, "prompt is empty"),
        (60, 5, True, 64, "exceeds max_model_len.*lower max_tokens"),
        # Chunked prefill off: the engine's budget holds max_model_len (plan_kv_cache), here 16.
        (17, 1, False, 16, "max_model_len is 16.*shorten the prompt"),
    ],
)
def test_bad_prompts_rejected_by_the_engines_check(
    prompt_len: int, max_tokens: int, chunked: bool, max_model_len: int, match: str
) -> None:
    processor = make_input_processor(max_model_len, budget=16, chunked=chunked)
    with pytest.raises(ValueError, match=match):
        processor.make_request("bad", [7] * prompt_len, SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize(
    "prompt_len,max_tokens,chunked,match",
    [
        (30, 11, True, "needs 11 KV blocks.*only 10.*more blocks"),
    ],
)
def test_impossible_requests_rejected_without_trace(
    prompt_len: int, max_tokens: int, chunked: bool, match: str
) -> None:
    # 10 usable blocks of 4 tokens (40 tokens), max_model_len 64, budget 16.
    sched = make_scheduler(num_blocks=11, block_size=4, budget=16, chunked=chunked, max_model_len=64)
    eng = FakeEngine(sched)
    ok = make_request("ok", 6, 3)
    sched.add_request(ok)
    eng.step()
    with pytest.raises(ValueError, match=match):
        sched.add_request(make_request("bad", prompt_len, max_tokens))
    assert sched.get_request("bad") is None and sched.num_waiting == 0 and sched.running == [ok]
    eng.run(max_steps=10)
    assert ok.num_output_tokens == 3
    fine = make_request("bad", 4, 2)  # the same id is free to use
    sched.add_request(fine)
    eng.run(max_steps=20)
    assert fine.num_output_tokens == 2
    assert_all_done(sched, [ok, fine])


def test_duplicate_request_id_rejected() -> None:
    sched = make_scheduler()
    first = make_request("x", 3, 2)
    sched.add_request(first)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("x", 5, 2))
    assert sched.get_request("x") is first and list(sched.waiting) == [first]


def test_non_positive_max_tokens_rejected() -> None:
    # The engine's check: the request is never built, so the scheduler never sees it.
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        make_input_processor(1024).make_request("x", [7] * 3, SamplingParams(max_tokens=0))


workload = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "extra_blocks": st.integers(0, 6),
        "extra_budget": st.integers(0, 12),
        "max_seqs": st.integers(1, 6),
        "chunked": st.booleans(),
        "lag": st.booleans(),
        "num_scheduler_steps": st.sampled_from([1, 1, 3, 8]),
        # (prompt_len, max_tokens, arrival_step)
        "requests": st.lists(
            st.tuples(st.integers(1, 24), st.integers(1, 12), st.integers(0, 15)), min_size=1, max_size=10
        ),
        "grouped": st.booleans(),  # the requests arriving in one step are one multi-prompt request
    }
)


@settings(max_examples=120, deadline=None)
@given(workload)
def test_random_workloads_finish_within_budgets(w: dict) -> None:
    bs = w["block_size"]
    max_total = max(p + m for p, m, _ in w["requests"])
    max_prompt = max(p for p, _, _ in w["requests"])
    num_blocks = 1 + -(-max_total // bs) + w["extra_blocks"]
    budget = (max_prompt if not w["chunked"] else 1) + w["extra_budget"]
    sched = make_scheduler(
        num_blocks,
        bs,
        budget,
        w["max_seqs"],
        w["chunked"],
        max_model_len=max_total,
        num_scheduler_steps=w["num_scheduler_steps"],
    )
    eng = FakeEngine(sched, lag=w["lag"])
    reqs = [make_request(str(i), p, m) for i, (p, m, _) in enumerate(w["requests"])]
    arrivals = sorted(range(len(reqs)), key=lambda i: w["requests"][i][2])
    last_arrival = max(a for _, _, a in w["requests"])
    # The oldest running request is never preempted and gains >= 1 token per step (with a lag, but
    # for one step at its end, waiting for its last token).
    max_steps = last_arrival + 1 + sum(r.num_prompt_tokens + r.max_tokens + w["lag"] for r in reqs)
    step = 0
    while arrivals or sched.has_unfinished_requests() or eng.in_flight:
        group = []
        while arrivals and w["requests"][arrivals[0]][2] <= step:
            group.append(reqs[arrivals.pop(0)])
        if w["grouped"]:
            sched.add_requests(group)
        else:
            for r in group:
                sched.add_request(r)
        assert eng.num_steps < max_steps, "requests starved or deadlocked"
        eng.step()
        step += 1
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.max_tokens
        assert eng.computed[r.request_id] == r.num_tokens - 1 + eng.lost[r.request_id]
        assert eng.lost[r.request_id] == 0 or r.num_preemptions > 0  # (a finishing victim loses nothing)
    assert_all_done(sched, reqs)


@pytest.mark.parametrize("lag", [False, True])
def test_tiny_pool_forces_preemption_and_outputs_stay_right(lag: bool) -> None:
    rng = random.Random(1234)
    sched = make_scheduler(num_blocks=9, block_size=2, budget=10, max_seqs=6)  # 16 tokens of KV
    eng = FakeEngine(sched, lag=lag)
    reqs = [make_request(str(i), rng.randint(1, 8), rng.randint(1, 8)) for i in range(20)]
    for r in reqs:
        sched.add_request(r)
    eng.run(max_steps=sum(r.num_prompt_tokens + r.max_tokens + lag for r in reqs))
    assert sum(r.num_preemptions for r in reqs) >= 3
    for r in reqs:
        assert r.num_output_tokens == r.max_tokens
        assert eng.computed[r.request_id] == r.num_tokens - 1 + eng.lost[r.request_id]
    assert_all_done(sched, reqs)


class SchedulerMachine(RuleBasedStateMachine):
    """Random interleavings of add (possibly impossible), step and abort (any state)."""

    @initialize(
        num_blocks=st.integers(2, 12),
        block_size=st.sampled_from([1, 2, 4]),
        budget=st.integers(1, 12),
        max_seqs=st.integers(1, 4),
        chunked=st.booleans(),
        lag=st.booleans(),
        num_scheduler_steps=st.sampled_from([1, 4]),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        budget: int,
        max_seqs: int,
        chunked: bool,
        lag: bool,
        num_scheduler_steps: int,
    ) -> None:
        # As the engine's config: with chunked prefill off the budget holds max_model_len (plan_kv_cache).
        max_model_len = 40 if chunked else budget
        self.sched = make_scheduler(
            num_blocks,
            block_size,
            budget,
            max_seqs,
            chunked,
            max_model_len=max_model_len,
            num_scheduler_steps=num_scheduler_steps,
        )
        self.processor = make_input_processor(max_model_len, budget, chunked)
        self.eng = FakeEngine(self.sched, lag=lag)
        self.next_id = 0
        self.known: dict[str, Request] = {}

    @rule(prompt_len=st.integers(0, 30), max_tokens=st.integers(1, 12))
    def add(self, prompt_len: int, max_tokens: int) -> None:
        req = make_request(str(self.next_id), prompt_len, max_tokens)
        self.next_id += 1
        try:  # the engine's check first: the scheduler is given only the requests that pass it
            self.processor.make_request(
                req.request_id, [7] * prompt_len, SamplingParams(max_tokens=max_tokens)
            )
        except ValueError:
            return
        waiting_before = list(self.sched.waiting)
        try:
            self.sched.add_request(req)
        except ValueError:
            assert self.sched.get_request(req.request_id) is None
            assert list(self.sched.waiting) == waiting_before
            return
        self.known[req.request_id] = req

    @rule()
    def step(self) -> None:
        self.eng.step()

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.known) + ["unknown"]))
        req = self.known.get(rid)
        live = req is not None and not req.is_finished
        assert self.sched.abort_request(rid) is (req if live else None)
        if live:
            assert req.status is RequestStatus.FINISHED_ABORTED and req.block_ids == []

    @invariant()
    def state_consistent(self) -> None:
        if hasattr(self, "sched"):
            check_scheduler_state(self.sched)

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        # Whatever is left finishes within the progress bound.
        live = [r for r in self.known.values() if not r.is_finished]
        self.eng.num_steps = 0
        self.eng.run(max_steps=2 + sum(r.num_prompt_tokens + r.max_tokens + self.eng.lag for r in live))
        for r in live:
            assert r.num_output_tokens == r.max_tokens
        assert_all_done(self.sched, list(self.known.values()))


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
