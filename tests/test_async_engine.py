"""AsyncLLMEngine: outputs match the synchronous engine, aborts free blocks at once, the event
loop never waits for a step, the waiting queue is bounded, and a failing engine fails loudly."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jaxpaged import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from jaxpaged.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError
from tiny_models import hf_greedy

# The same engine shape as tests/test_server.py, so both reuse the same compiled programs.
ENGINE_ARGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=129)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_engine(tiny) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(tiny[0]), **ENGINE_ARGS))


@pytest.fixture
def engine(llm_engine):
    eng = AsyncLLMEngine(llm_engine)
    yield eng
    eng.shutdown()
    assert not llm_engine.has_unfinished_requests()
    assert llm_engine.kv_cache_manager.num_free_blocks == llm_engine.cache_info.num_usable_blocks


class GatedEngine:
    """An ``LLMEngine`` whose ``step`` sets ``stepping``, waits for ``gate`` to be open, and then
    raises ``fail`` if set."""

    def __init__(self, engine: LLMEngine, open: bool = False) -> None:
        self._engine = engine
        self.gate = threading.Event()
        if open:
            self.gate.set()
        self.stepping = threading.Event()
        self.fail: Exception | None = None

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        self.stepping.set()
        self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return self._engine.step()


async def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def final_output(engine: AsyncLLMEngine, request_id: str, prompt, sp: SamplingParams):
    stream = await engine.add_request(engine.make_request(request_id, prompt, sp))
    async with stream:
        async for out in stream:
            pass
    return out


def test_concurrent_requests_match_hf(engine, tiny):
    prompts = [[5, 6, 7, 8], [40, 41], list(range(10, 40)), [300, 3, 200, 100, 7]]

    async def main():
        return await asyncio.gather(
            *(final_output(engine, f"r{i}", p, GREEDY) for i, p in enumerate(prompts))
        )

    outs = asyncio.run(main())
    for p, out in zip(prompts, outs):
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(tiny[1], p, 8)[0]


def test_outputs_are_streamed_and_cumulative(engine):
    async def main():
        stream = await engine.add_request(engine.make_request("s", [5, 6, 7], GREEDY))
        seen = []
        async with stream:
            async for out in stream:
                seen.append(list(out.outputs[0].token_ids))
        return seen

    seen = asyncio.run(main())
    assert seen[-1] and len(seen[-1]) == 8
    assert all(a == seen[-1][: len(a)] for a in seen)  # each output extends the previous one


def test_delta_outputs_merge_for_a_reader_that_falls_behind(engine):
    """DELTA outputs a reader has not taken yet are merged into one: whether it reads every step,
    or reads once and then only after the request finished, what it gets adds up to the
    CUMULATIVE request's final output (text, tokens, logprobs, prompt logprobs once, finish)."""

    def params(kind: RequestOutputKind) -> SamplingParams:
        return SamplingParams(
            n=2,
            temperature=1.0,
            seed=5,
            max_tokens=40,
            ignore_eos=True,
            logprobs=1,
            prompt_logprobs=1,
            stop=[" the"],
            output_kind=kind,
        )

    async def read(request_id: str, kind: RequestOutputKind, lag: bool):
        stream = await engine.add_request(engine.make_request(request_id, [5, 6, 7, 8], params(kind)))
        outs = []
        async with stream:
            async for out in stream:
                outs.append(out)
                if lag and len(outs) == 1:
                    await wait_for(lambda: engine.stats.num_running == 0)
        return outs, stream.num_output_tokens

    async def main():
        return await asyncio.gather(
            read("cumulative", RequestOutputKind.CUMULATIVE, False),
            read("delta", RequestOutputKind.DELTA, False),
            read("delta-lagging", RequestOutputKind.DELTA, True),
        )

    (cumulative, _), (delta, delta_counts), (lagging, lagging_counts) = asyncio.run(main())
    final = cumulative[-1]
    assert len(lagging) == 2 < len(delta)  # all but the first merged into one
    for outs, counts in ((delta, delta_counts), (lagging, lagging_counts)):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[0].prompt_logprobs == final.prompt_logprobs
        assert all(o.prompt_logprobs is None for o in outs[1:])
        for c in final.outputs:
            mine = [d for o in outs for d in o.outputs if d.index == c.index]
            assert "".join(d.text for d in mine) == c.text
            assert sum((d.token_ids for d in mine), []) == c.token_ids
            assert sum((d.logprobs for d in mine), []) == c.logprobs
            assert (mine[-1].finish_reason, mine[-1].stop_reason) == (c.finish_reason, c.stop_reason)
            assert mine[-1].cumulative_logprob == c.cumulative_logprob
            assert counts[c.index] == len(c.token_ids)


def test_leaving_the_stream_aborts_and_frees_blocks(engine, llm_engine):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = await engine.add_request(engine.make_request("long", list(range(3, 50)), long))
        async with stream:
            async for out in stream:
                if len(out.outputs[0].token_ids) >= 3:
                    break
        await wait_for(
            lambda: (
                engine.stats.num_running == 0
                and engine.stats.num_free_blocks == engine.stats.num_usable_blocks
            )
        )
        return out

    out = asyncio.run(main())
    assert not out.finished


def test_multi_step_streams_in_bursts_and_aborts_mid_group(tiny):
    """With num_scheduler_steps = 4 a stream gets several tokens per output, HF's greedy tokens in
    the end; a stream left mid-group aborts its request and frees its blocks (group's lookahead
    ones included) while the others run on."""
    llm_engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(tiny[0]), num_scheduler_steps=4, **ENGINE_ARGS)
    )
    engine = AsyncLLMEngine(llm_engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    # The stream left mid-group asks for many tokens, so that its request cannot end before its
    # reader first looks, however slow the machine.
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def streamed(rid: str, prompt: list[int], leave_after: int | None = None) -> list[list[int]]:
        seen = []
        sp = greedy if leave_after is None else long
        stream = await engine.add_request(engine.make_request(rid, prompt, sp))
        async with stream:
            async for out in stream:
                seen.append(list(out.outputs[0].token_ids))
                if leave_after is not None and len(seen[-1]) >= leave_after:
                    break
        return seen

    async def main():
        outs = await asyncio.gather(
            streamed("a", [5, 6, 7]),
            streamed("b", list(range(10, 30))),
            streamed("c", [40, 41, 42, 43], leave_after=2),
        )
        await wait_for(
            lambda: (
                engine.stats.num_running == 0
                and engine.stats.num_free_blocks == engine.stats.num_usable_blocks
            )
        )
        return outs

    try:
        a, b, c = asyncio.run(main())
        for seen, prompt in ((a, [5, 6, 7]), (b, list(range(10, 30)))):
            assert seen[-1] == hf_greedy(tiny[1], prompt, 14)[0]
            assert all(x == seen[-1][: len(x)] for x in seen)
            assert max(len(y) - len(x) for x, y in zip([[]] + seen, seen)) > 1  # bursts: groups ran
        assert len(c[-1]) < long.max_tokens
        assert not llm_engine.has_unfinished_requests()
        assert llm_engine.kv_cache_manager.num_free_blocks == llm_engine.cache_info.num_usable_blocks
    finally:
        engine.shutdown()


def test_event_loop_runs_while_engine_steps(llm_engine):
    gated = GatedEngine(llm_engine)
    engine = AsyncLLMEngine(gated)

    async def main():
        stream = await engine.add_request(engine.make_request("g", [5, 6, 7], GREEDY))
        await wait_for(gated.stepping.is_set)
        t0 = time.monotonic()
        for _ in range(10):  # the step is stuck, yet the loop ticks freely
            await asyncio.sleep(0.005)
        ticked = time.monotonic() - t0
        gated.gate.set()
        async with stream:
            async for out in stream:
                pass
        return ticked, out

    try:
        ticked, out = asyncio.run(main())
    finally:
        gated.gate.set()
        engine.shutdown()
    assert ticked < 1.0
    assert out.finished


def test_waiting_queue_is_bounded(llm_engine):
    gated = GatedEngine(llm_engine, open=True)
    engine = AsyncLLMEngine(gated, max_waiting_requests=3)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        running = await engine.add_request(engine.make_request("q0", [5, 6], long))
        await anext(running)  # q0 runs and the queue is empty...
        gated.gate.clear()
        gated.stepping.clear()
        await wait_for(gated.stepping.is_set)  # ...and from now on the loop thread is stuck in a step
        queued = [
            asyncio.ensure_future(engine.add_request(engine.make_request(f"q{i}", [5, 6], GREEDY)))
            for i in range(1, 4)
        ]
        await asyncio.sleep(0)  # each queued add has passed the admission check
        with pytest.raises(EngineOverloadedError, match="3 requests are already waiting"):
            await engine.add_request(engine.make_request("q4", [5, 6], GREEDY))
        gated.gate.set()
        async with running:
            pass  # aborts q0
        for stream in await asyncio.gather(*queued):
            async with stream:
                async for out in stream:
                    pass
            assert out.finished
        return await final_output(engine, "q5", [5, 6], GREEDY)  # room again once the queue drained

    try:
        assert asyncio.run(main()).finished
    finally:
        gated.gate.set()
        engine.shutdown()


def test_inadmissible_request_raises_and_leaves_nothing(engine):
    huge = SamplingParams(max_tokens=250)

    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request(engine.make_request("bad", list(range(3, 20)), huge))
        return await final_output(engine, "good", [5, 6, 7], GREEDY)

    assert asyncio.run(main()).finished


def test_engine_error_kills_engine_and_fails_streams(llm_engine):
    gated = GatedEngine(llm_engine)
    gated.fail = RuntimeError("device on fire")
    engine = AsyncLLMEngine(gated)

    async def main():
        stream = await engine.add_request(engine.make_request("doomed", [5, 6, 7], GREEDY))
        gated.gate.set()
        with pytest.raises(EngineDeadError, match="RuntimeError"):
            async for _ in stream:
                pass
        assert not engine.is_running and engine.errored and not engine.stats.alive
        with pytest.raises(EngineDeadError):
            await engine.add_request(engine.make_request("after", [5, 6, 7], GREEDY))

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
        llm_engine.abort_request("doomed")  # the step never ran; leave the shared engine clean


def test_shutdown_ends_open_streams(llm_engine):
    engine = AsyncLLMEngine(llm_engine)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = await engine.add_request(engine.make_request("open", [5, 6, 7], long))
        await anext(stream)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass

    asyncio.run(main())
    assert not llm_engine.has_unfinished_requests()
    assert llm_engine.kv_cache_manager.num_free_blocks == llm_engine.cache_info.num_usable_blocks


def test_add_requests_queues_all_prompts_in_one_command_or_none(llm_engine):
    """One API request's prompts are added in one command, applied between two steps (not one per
    step); one inadmissible prompt leaves none queued; ``abort`` with their ids drops them all at once."""
    gated = GatedEngine(llm_engine, open=True)
    engine = AsyncLLMEngine(gated)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        running = await engine.add_request(engine.make_request("first", [5, 6], long))
        await anext(running)
        gated.gate.clear()
        gated.stepping.clear()
        await wait_for(gated.stepping.is_set)  # the loop thread is stuck in a step
        group = [engine.make_request(f"g{i}", [5, 6, i + 7], long) for i in range(20)]
        added = asyncio.ensure_future(engine.add_requests(group))
        await asyncio.sleep(0.05)
        assert len(engine._commands) == 1
        gated.gate.set()
        streams = await added  # all admitted at once
        await wait_for(lambda: engine.stats.num_running + engine.stats.num_waiting == 21, timeout=1)
        bad = [engine.make_request("ok", [5, 6], GREEDY), engine.make_request("first", [5, 6], GREEDY)]
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_requests(bad)
        assert llm_engine.scheduler.get_request("ok") is None
        await engine.abort(["first", *(s.request_id for s in streams)])
        await wait_for(lambda: engine.stats.num_running == engine.stats.num_waiting == 0)
        for stream in [running, *streams]:
            async for _ in stream:  # closed without a finished output
                pass
            assert not stream.finished

    try:
        asyncio.run(main())
    finally:
        gated.gate.set()
        engine.shutdown()
    assert llm_engine.kv_cache_manager.num_free_blocks == llm_engine.cache_info.num_usable_blocks


# ---- vLLM's async API: generate / abort / is_running, as vLLM users write them ---------------------------------


def test_vllm_generate_api_matches_hf(tiny):
    """``from jaxpaged import AsyncLLMEngine, AsyncEngineArgs`` and ``async for out in engine.generate(...)``
    over concurrent requests: text, token-id and prompt-dict prompts give transformers' greedy tokens."""
    from jaxpaged import AsyncEngineArgs, AsyncLLMEngine as PublicAsyncLLMEngine

    engine = PublicAsyncLLMEngine.from_engine_args(
        AsyncEngineArgs(model=str(tiny[0]), max_waiting_requests=7, max_queue_time=30.0, **ENGINE_ARGS)
    )
    prompts = {"ids": [5, 6, 7, 8], "dict": {"prompt_token_ids": [40, 41]}, "text": "hello there"}

    async def run(request_id, prompt):
        outs = [out async for out in engine.generate(prompt, GREEDY, request_id)]
        return outs

    async def main():
        return await asyncio.gather(*(run(rid, p) for rid, p in prompts.items()))

    try:
        assert engine.is_running and not engine.errored and engine.dead_error is None
        assert (engine.max_waiting_requests, engine.max_queue_time) == (7, 30.0)
        results = asyncio.run(main())
        assert asyncio.run(engine.get_tokenizer()) is engine.tokenizer
    finally:
        engine.shutdown()
    text_ids = engine.tokenizer.encode(prompts["text"])
    for (rid, outs), ids in zip(zip(prompts, results), [[5, 6, 7, 8], [40, 41], text_ids]):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1]), rid
        assert outs[-1].prompt_token_ids == ids
        assert outs[-1].outputs[0].token_ids == hf_greedy(tiny[1], ids, 8)[0], rid
    assert not engine.is_running and engine.errored
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(engine.check_health())


def test_generate_aborts_when_left_cancelled_or_aborted(engine, llm_engine):
    """Breaking out of ``generate``, cancelling the task that iterates it, and ``await engine.abort(id)``
    each end the request and free its blocks; ``abort`` ends the iteration without a finished output."""
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    all_free = lambda: (
        engine.stats.num_running == engine.stats.num_waiting == 0  # noqa: E731
        and engine.stats.num_free_blocks == engine.stats.num_usable_blocks
    )

    async def consume(request_id, seen: list):
        async for out in engine.generate([5, 6, 7], long, request_id):
            seen.append(out)

    async def main():
        async for out in engine.generate([3, 4, 5], long, "left"):
            if len(out.outputs[0].token_ids) >= 3:
                break
        await wait_for(all_free)

        seen: list = []
        task = asyncio.ensure_future(consume("cancelled", seen))
        await wait_for(lambda: len(seen) >= 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(all_free)

        aborted: list = []
        task = asyncio.ensure_future(consume("aborted", aborted))
        await wait_for(lambda: len(aborted) >= 2)
        await engine.abort("aborted")
        await asyncio.wait_for(task, timeout=30)
        await wait_for(all_free)
        return out, seen, aborted

    left, cancelled, aborted = asyncio.run(main())
    assert not left.finished and len(left.outputs[0].token_ids) >= 3
    assert cancelled and not cancelled[-1].finished
    assert aborted and not aborted[-1].finished and len(aborted[-1].outputs[0].token_ids) < 200


def test_generate_refuses_a_bad_prompt_at_once(engine):
    async def main():
        with pytest.raises(ValueError, match="exactly one of"):
            async for _ in engine.generate({"prompt": "a", "prompt_token_ids": [1]}, GREEDY, "bad"):
                pass
        with pytest.raises(ValueError, match="unknown key"):
            async for _ in engine.generate({"text": "a"}, GREEDY, "bad"):
                pass

    asyncio.run(main())
    assert engine.stats.num_waiting == 0
