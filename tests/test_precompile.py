"""Start-up precompilation: every step program of the bucket set is compiled before the first
request, so a served workload of varied lengths (greedy and sampled) compiles nothing more."""

from __future__ import annotations

import asyncio
import contextlib

import jax
import numpy as np

from jax._src import monitoring  # public registration, private removal (no public API for it)

from jaxpaged import EngineArgs, LLMEngine, SamplingParams
from jaxpaged.async_engine import AsyncLLMEngine
from tiny_models import random_prompts

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
ENGINE_ARGS = dict(max_num_batched_tokens=64, max_num_seqs=16, block_size=8, cache_dir="")


@contextlib.contextmanager
def count_compiles():
    """Counts XLA backend compilations (jit cache misses) inside the block."""
    seen = []

    def listener(event: str, duration: float, **kw) -> None:
        if event == BACKEND_COMPILE_EVENT:
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        monitoring.unregister_event_duration_listener(listener)


def test_precompile_covers_the_bucket_set(tiny):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny[0]), **ENGINE_ARGS))
    runner = engine.runner
    # Token buckets 8..64, rows min(tokens, 16): 4 forward programs (which sample plain greedy rows
    # themselves), and the random sampler for each of the 2 row buckets (8, 16).
    assert runner.token_buckets == [8, 16, 32, 64]
    assert sorted({runner.row_bucket(t) for t in runner.token_buckets}) == [8, 16]
    assert runner.num_compiled_programs == 4 + 2
    # All-padding warm-up writes nothing: the pool is still zeros.
    assert not np.asarray(runner.kv_pages).any()


def test_served_workload_compiles_nothing_after_start_up(tiny):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny[0]), **ENGINE_ARGS))
    rng = np.random.default_rng(3)
    prompts = random_prompts(rng, [1, 3, 9, 30, 61, 100, 7, 44, 2, 15, 80, 5])
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=int(rng.integers(1, 20)), ignore_eos=True
        )
        for i in range(len(prompts))
    ]

    async def one(i: int) -> int:
        await asyncio.sleep(0.01 * i)  # staggered arrivals: mixed prefill/decode steps
        final = None
        stream = await engine.add_request(engine.make_request(f"r{i}", prompts[i], params[i]))
        async for out in stream:
            final = out
        return len(final.outputs[0].token_ids)

    async def workload() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    try:
        programs = engine.engine.runner.num_compiled_programs
        with count_compiles() as compiles:
            lengths = asyncio.run(workload())
        assert lengths == [p.max_tokens for p in params]
        assert compiles == [], f"{len(compiles)} XLA compilations during the served workload"
        assert engine.engine.runner.num_compiled_programs == programs
    finally:
        engine.shutdown()


def test_plain_greedy_steps_sample_in_the_forward_program(tiny, monkeypatch):
    """A one-step batch of plain greedy rows takes its tokens from the forward program: exactly the
    tokens (and the next step's in-flight token array) that the sampler program computes from the
    same logits, and no sampler program is launched; a batch with a sampled row, or logprobs, still
    runs the sampler."""
    from jaxpaged import model_runner

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny[0]), **ENGINE_ARGS))
    runner, forward, sample_fn = engine.runner, engine.runner.forward, model_runner.sample_fn
    fused, unfused, launched = [], [], []

    def checked(b):
        logits, tokens, prev = forward(b)
        (fused if b.greedy_in_forward else unfused).append(b)
        if b.greedy_in_forward:
            want, _, want_prev = sample_fn(
                logits, b.sampling, b.prompt_targets, flags=b.flags, num_token_slots=runner.max_rows
            )
            np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want.tokens))
            np.testing.assert_array_equal(np.asarray(prev), np.asarray(want_prev))
        return logits, tokens, prev

    monkeypatch.setattr(runner, "forward", checked)
    monkeypatch.setattr(
        model_runner, "sample_fn", lambda *a, **k: launched.append(k["flags"]) or sample_fn(*a, **k)
    )
    rng = np.random.default_rng(7)
    prompts = random_prompts(rng, [3, 20, 9, 41, 5])
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert fused and not launched and not unfused
    engine.add_request(
        "s", prompts[0], SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True)
    )
    engine.add_request(
        "l", prompts[1], SamplingParams(temperature=0.0, logprobs=2, max_tokens=4, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        engine.step()
    assert len(launched) == len(unfused) > 0


def test_precompile_can_be_turned_off(tiny):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny[0]), precompile=False, **ENGINE_ARGS))
    assert engine.runner.num_compiled_programs == 0


def test_engines_of_one_model_share_their_programs(tiny):
    """The step program's static part (module and param structure) is interned: a second engine of
    the same model reuses the first one's compiled programs, so its start-up compiles nothing."""
    LLMEngine.from_engine_args(EngineArgs(model=str(tiny[0]), **ENGINE_ARGS))
    with count_compiles() as compiles:
        engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny[0]), **ENGINE_ARGS))
    assert engine.runner.num_compiled_programs == 4 + 2
    assert compiles == [], f"{len(compiles)} XLA compilations for the second engine"


def test_multi_step_programs_are_precompiled_too(tiny):
    """With num_scheduler_steps > 1 start-up also compiles the grouped program (greedy and random)
    of each token bucket a decode batch can use (up to max_num_seqs = 16 rows: buckets 8 and 16);
    a workload that runs groups compiles nothing after that."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny[0]), num_scheduler_steps=4, **ENGINE_ARGS))
    assert engine.runner.num_compiled_programs == 4 + 2 + 2 * 2
    rng = np.random.default_rng(5)
    prompts = random_prompts(rng, [2, 9, 30, 61, 5, 17, 40, 3, 12, 8, 22, 6, 1, 14, 33, 7, 19])
    grouped = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: grouped.append(out := schedule()) or out
    with count_compiles() as compiles:
        for i, p in enumerate(prompts):
            engine.add_request(
                f"r{i}",
                p,
                SamplingParams(
                    temperature=0.0 if i % 2 else 0.9,
                    seed=i,
                    ignore_eos=True,
                    max_tokens=int(rng.integers(1, 24)),
                ),
            )
        while engine.has_unfinished_requests():
            engine.step()
    sizes = {len(o.requests) for o in grouped if o.num_steps == 4}
    assert min(sizes) <= 8 < max(sizes), sizes  # groups in both row buckets
    assert compiles == [], f"{len(compiles)} XLA compilations after start-up"
