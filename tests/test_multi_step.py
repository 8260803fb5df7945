"""Multi-step scheduling (``num_scheduler_steps`` > 1): when every running request decodes, one
program runs several decode steps. What a request produces must not change: the same tokens, text,
logprobs and finish as one step at a time, with stops inside a group of steps, requests that cannot
take part (penalties, min_tokens), arrivals, aborts and preemption; and no block may leak."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from jaxpaged.config import MAX_SCHEDULER_STEPS, SchedulerConfig
from jaxpaged.kv_cache_manager import KVCacheManager
from jaxpaged.request import Request
from jaxpaged.scheduler import Scheduler
from test_async_scheduling import _workload as mixed_workload
from tiny_models import hf_greedy, random_prompts


def _engine(path, **kw) -> LLMEngine:
    args = dict(
        model=str(path), block_size=4, max_num_batched_tokens=32, max_num_seqs=6, num_gpu_blocks_override=80
    )
    return LLMEngine.from_engine_args(EngineArgs(**{**args, **kw}))


def _record_steps(engine: LLMEngine) -> list[int]:
    """The ``num_steps`` of every batch the engine's scheduler hands out, from now on."""
    seen = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        if out.requests:
            seen.append(out.num_steps)
        return out

    engine.scheduler.schedule = recorded
    return seen


def _workload(vocab: int) -> list[tuple[str, list[int], SamplingParams]]:
    """The async scheduling tests' mix (greedy and seeded rows, logprobs, stop ids and strings that
    end requests inside a group of steps, n = 2 with forked blocks copied on write, prefix hits, and
    min_tokens, which keeps its request out of groups), plus a streamed (DELTA) request and one with
    a presence penalty (also kept out)."""
    rng = np.random.default_rng(11)
    extra = random_prompts(rng, [6, 13])
    return [
        *mixed_workload(vocab),
        (
            "r8",
            extra[0],
            SamplingParams(
                temperature=1.0,
                seed=2,
                max_tokens=26,
                ignore_eos=True,
                top_k=5,
                output_kind=RequestOutputKind.DELTA,
            ),
        ),
        (
            "r9",
            extra[1],
            SamplingParams(temperature=0.0, max_tokens=12, presence_penalty=0.5, ignore_eos=True),
        ),
    ]


def _run(engine: LLMEngine, workload, arrive_every: int = 3, abort: tuple[str, int] | None = None) -> dict:
    """Every request's samples as (token ids, text, finish reason, stop reason, cumulative logprob);
    DELTA outputs are joined. A request arrives every ``arrive_every`` steps; ``abort`` = (id, step)."""
    delta = {rid for rid, _, sp in workload if sp.output_kind is RequestOutputKind.DELTA}
    got: dict[str, dict] = {}
    pending, step = list(workload), 0
    while pending or engine.has_unfinished_requests():
        if pending and step % arrive_every == 0:
            rid, prompt, sp = pending.pop(0)
            engine.add_request(rid, prompt, sp)
        if abort is not None and step == abort[1]:
            engine.abort_request(abort[0])
        for out in engine.step():
            samples = got.setdefault(out.request_id, {})
            for c in out.outputs:
                ids, text = samples.get(c.index, ([], ""))[:2]
                ids, text = (
                    (ids + c.token_ids, text + c.text) if out.request_id in delta else (c.token_ids, c.text)
                )
                samples[c.index] = (list(ids), text, c.finish_reason, c.stop_reason, c.cumulative_logprob)
        step += 1
    assert engine.kv_cache_manager.num_free_blocks == engine.cache_info.num_usable_blocks
    return {rid: [samples[i] for i in sorted(samples)] for rid, samples in got.items()}


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for rid in want:
        assert len(got[rid]) == len(want[rid]), rid
        for g, w in zip(got[rid], want[rid]):
            assert g[:4] == w[:4], rid
            assert g[4] == pytest.approx(w[4], abs=1e-4), rid


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("k", [3, 8])
def test_grouped_steps_give_the_outputs_of_single_steps(tiny, k, async_scheduling):
    path, hf = tiny
    workload = _workload(hf.config.vocab_size)
    want = _run(_engine(path, async_scheduling=async_scheduling), workload)
    engine = _engine(path, async_scheduling=async_scheduling, num_scheduler_steps=k)
    steps = _record_steps(engine)
    got = _run(engine, workload)
    _assert_same(got, want)
    # Groups of k steps ran, and single steps (prompts; the penalized request's decodes).
    assert steps.count(k) >= 3 and 1 in steps
    assert set(steps) <= {1, k}
    # Some requests stopped on a stop id or string before their length limit.
    assert any(s[2] == "stop" for samples in got.values() for s in samples)


def test_generate_outputs_match_single_steps_and_hf(tiny):
    """``LLM.generate``'s final-only samples without logprobs: a row no stop ends takes its group's
    tokens at once, one a stop id (or its length) ends inside the group goes token by token."""
    path, hf = tiny
    vocab = hf.config.vocab_size
    prompts = random_prompts(np.random.default_rng(4), [5, 18, 9, 26, 3, 12])
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (17, 6, 1, 23)]
    params += [
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=list(range(3, vocab, 9))),
        SamplingParams(temperature=0.8, seed=9, max_tokens=19, ignore_eos=True),
    ]
    args = dict(block_size=4, max_num_seqs=4, num_gpu_blocks_override=80)
    want = LLM(str(path), **args).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(path), num_scheduler_steps=5, **args)
    steps = _record_steps(llm.engine)
    step, calls = llm.engine.step, []
    llm.engine.step = lambda: (
        step() if len(calls) < 200 and not calls.append(1) else pytest.fail("unfinished")
    )
    got = llm.generate(prompts, params, use_tqdm=False)
    assert steps.count(5) >= 3
    for g, w in zip(got, want, strict=True):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in g.outputs] == [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in w.outputs
        ]
    assert got[4].outputs[0].finish_reason == "stop" and len(got[4].outputs[0].token_ids) < 20
    for i in range(4):
        assert got[i].outputs[0].token_ids == hf_greedy(hf, prompts[i], params[i].max_tokens)[0]
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.cache_info.num_usable_blocks


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_grouped_steps_under_preemption_and_abort(tiny, preemption_mode):
    """A pool too small for everyone: groups need their blocks up front, so steps alternate
    between groups and single steps that preempt. An abort lands mid-run. Nothing leaks (``_run``)."""
    path, hf = tiny
    workload = _workload(hf.config.vocab_size)
    kw = dict(num_gpu_blocks_override=26, preemption_mode=preemption_mode, swap_space=2**-10)
    single = _engine(path, **kw)
    want = _run(single, workload, arrive_every=1, abort=("r2", 9))
    engine = _engine(path, num_scheduler_steps=4, **kw)
    steps = _record_steps(engine)
    got = _run(engine, workload, arrive_every=1, abort=("r2", 9))
    want.pop("r2", None), got.pop("r2", None)
    _assert_same(got, want)
    assert engine.scheduler.num_preemptions > 0 and steps.count(4) > 0


def _scheduler(num_blocks: int = 64, k: int = 4, max_seqs: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(32, max_seqs, True, "recompute", k), KVCacheManager(num_blocks, 4), 1024)


def _decoding(sched: Scheduler, max_tokens: list[int], prompt_len: int = 6) -> list[Request]:
    """Requests whose prompts ran in one step and whose first tokens are taken in."""
    reqs = [
        Request(
            f"d{i}", [7] * prompt_len, SamplingParams(max_tokens=m), max_tokens=m, seed=0, multi_step=True
        )
        for i, m in enumerate(max_tokens)
    ]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert out.num_steps == 1 and out.requests == reqs and all(out.samples)
    for r in reqs:
        r.num_output_placeholders -= 1
        r.output_token_ids.append(1)
    return reqs


def test_a_group_gives_each_row_its_steps_and_blocks():
    sched = _scheduler(k=4)
    kv = sched.kv_cache_manager
    b, a, c = _decoding(sched, [3, 30, 2])
    out = sched.schedule()
    # Outputs left: 29, 2 and 1, so 4, 2 and 1 steps, rows with more steps first (each step computes
    # a prefix of the rows); every step's KV slot is allocated now.
    assert (out.num_steps, out.requests, out.num_new_tokens) == (4, [a, b, c], [4, 2, 1])
    assert out.start_positions == [6, 6, 6] and out.num_host_tokens == [1, 1, 1] and all(out.samples)
    assert [r.num_computed_tokens for r in (a, b, c)] == [10, 8, 7]
    assert [r.num_output_placeholders for r in (a, b, c)] == [4, 2, 1]
    assert [len(r.block_ids) for r in (a, b, c)] == [
        kv.blocks_needed(10),
        kv.blocks_needed(8),
        kv.blocks_needed(7),
    ]
    # Before those tokens are taken in (async scheduling): b and c have every output in flight and sit
    # out; a's next group starts at the token in flight.
    out = sched.schedule()
    assert (out.num_steps, out.requests, out.num_new_tokens, out.num_host_tokens) == (4, [a], [4], [0])
    assert out.start_positions == [10] and a.num_computed_tokens == 14


def test_groups_wait_for_every_running_request_and_for_admissions():
    sched = _scheduler(k=4, max_seqs=3)
    a, b, c = _decoding(sched, [30, 30, 30])
    c.multi_step = False  # penalties, min_tokens or a beam: one step at a time
    out = sched.schedule()
    assert out.num_steps == 1 and out.num_new_tokens == [1, 1, 1]
    for r in (a, b, c):
        r.num_output_placeholders -= 1
        r.output_token_ids.append(1)
    sched.abort_request(c.request_id)
    # A waiting request that fits is admitted by a single step (its prompt) ...
    d = Request("d", [7] * 5, SamplingParams(max_tokens=30), max_tokens=30, seed=0, multi_step=True)
    sched.add_request(d)
    out = sched.schedule()
    assert out.num_steps == 1 and out.requests == [a, b, d]
    for r in (a, b, d):
        r.num_output_placeholders -= 1
        r.output_token_ids.append(1)
    # ... but one that cannot run (max_num_seqs reached) does not hold the group back.
    e = Request("e", [7] * 5, SamplingParams(max_tokens=30), max_tokens=30, seed=0, multi_step=True)
    sched.add_request(e)
    out = sched.schedule()
    assert out.num_steps == 4 and out.requests == [a, b, d] and list(sched.waiting) == [e]


def test_a_group_the_pool_cannot_hold_falls_back_to_one_step_allocating_nothing_more():
    sched = _scheduler(num_blocks=6, k=4)  # 5 usable blocks
    kv = sched.kv_cache_manager
    a, b = _decoding(sched, [14, 14])  # 6-token prompts: 2 blocks each, room for 2 more tokens
    assert kv.num_free_blocks == 1
    out = sched.schedule()  # a group would need 2 more blocks
    assert out.num_steps == 1 and out.num_new_tokens == [1, 1] and out.preempted == []
    assert kv.num_free_blocks == 1 and [len(r.block_ids) for r in (a, b)] == [2, 2]


@pytest.mark.parametrize("bad", [0, -2, MAX_SCHEDULER_STEPS + 1, True, 2.5, "4"])
def test_num_scheduler_steps_is_validated(bad):
    with pytest.raises(
        ValueError, match=f"num_scheduler_steps must be an integer from 1 to {MAX_SCHEDULER_STEPS}"
    ):
        EngineArgs(num_scheduler_steps=bad).create_engine_config()
