"""``/metrics`` as vLLM exposes it, so that vLLM's dashboards work unchanged: every series vLLM's
example Grafana dashboards query is there from the start, with vLLM's type and labels, and moves
under load (a tiny KV cache, so that requests also wait and get preempted), by what the responses
report wherever that is arithmetic; ``also_jaxpaged_metric_names`` adds a ``jaxpaged:`` twin of each. The
engine's per-step histograms (``jaxpaged.step_stats``) count a gap before every output token but a sample's first."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxpaged import EngineArgs, LLMEngine, SamplingParams
from jaxpaged.async_engine import AsyncLLMEngine
from jaxpaged.server import build_app
from test_server import (
    ENGINE_ARGS,
    MODEL,
    SlowEngine,
    client,  # noqa: F401 (a fixture)
    engine,  # noqa: F401 (a fixture)
    metric,
    serve,
    sse_events,
    url,  # noqa: F401 (a fixture)
    wait_until_idle,
)

# Every series that vLLM's example Grafana dashboards query, with its metric's type: vLLM 0.33.0's sdist,
# examples/observability/prometheus_grafana/grafana.json and examples/observability/dashboards/grafana/
# performance_statistics.json (which adds iteration_tokens_total_count) and query_statistics.json.
DASHBOARD_SERIES = {
    "vllm:e2e_request_latency_seconds_bucket": "histogram",
    "vllm:e2e_request_latency_seconds_sum": "histogram",
    "vllm:e2e_request_latency_seconds_count": "histogram",
    "vllm:time_to_first_token_seconds_bucket": "histogram",
    "vllm:time_to_first_token_seconds_sum": "histogram",
    "vllm:time_to_first_token_seconds_count": "histogram",
    "vllm:inter_token_latency_seconds_bucket": "histogram",
    "vllm:inter_token_latency_seconds_sum": "histogram",
    "vllm:inter_token_latency_seconds_count": "histogram",
    "vllm:request_time_per_output_token_seconds_bucket": "histogram",
    "vllm:request_time_per_output_token_seconds_sum": "histogram",
    "vllm:request_time_per_output_token_seconds_count": "histogram",
    "vllm:request_prompt_tokens_bucket": "histogram",
    "vllm:request_generation_tokens_bucket": "histogram",
    "vllm:request_queue_time_seconds_sum": "histogram",
    "vllm:request_prefill_time_seconds_sum": "histogram",
    "vllm:request_decode_time_seconds_sum": "histogram",
    "vllm:request_max_num_generation_tokens_sum": "histogram",
    "vllm:iteration_tokens_total_count": "histogram",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
}
GAUGES = [name for name, kind in DASHBOARD_SERIES.items() if kind == "gauge"]


def scrape(url: str) -> tuple[dict[str, str], dict[str, list[tuple[dict[str, str], float]]]]:
    """``/metrics`` parsed: {series name: its metric's type}, {series name: [(labels, value)]}."""
    types, series = {}, defaultdict(list)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            types[s.name] = family.type
            series[s.name].append((s.labels, s.value))
    return types, series


def totals(url: str) -> dict[str, float]:
    """Each series' values summed over its label sets (a histogram's buckets too: one observation adds)."""
    return {name: sum(v for _, v in rows) for name, rows in scrape(url)[1].items()}


def labelled(url: str, name: str, **labels: str) -> float:
    return sum(v for ls, v in scrape(url)[1][name] if labels.items() <= ls.items())


@pytest.fixture(scope="module")
def tiny_kv_url(tiny) -> Iterator[str]:
    """A server whose KV pool (24 blocks of 8 tokens) holds about three of the load's requests at full length,
    and whose steps take at least 10 ms, so that a scrape sees requests run and wait."""
    args = EngineArgs(model=str(tiny[0]), **{**ENGINE_ARGS, "num_gpu_blocks_override": 25})
    engine = AsyncLLMEngine(SlowEngine(LLMEngine.from_engine_args(args), open=True))
    try:
        with serve(build_app(engine, MODEL)) as base:
            yield base
    finally:
        engine.shutdown()


def test_dashboard_series_are_exposed_from_the_start(tiny_kv_url):
    types, series = scrape(tiny_kv_url)
    for name, kind in DASHBOARD_SERIES.items():
        assert types.get(name) == kind, name
        assert all(labels["model_name"] == MODEL and labels["engine"] == "0" for labels, _ in series[name]), (
            name
        )
    assert {labels["finished_reason"] for labels, _ in series["vllm:request_success_total"]} >= {
        "stop",
        "length",
    }
    # Without the flag, jaxpaged: names only for jaxpaged's own metrics.
    assert {name for name in types if name.startswith("jaxpaged:")} == {
        "jaxpaged:kv_cache_free_blocks",
        "jaxpaged:kv_cache_usable_blocks",
        "jaxpaged:engine_alive",
    }


def test_dashboard_series_move_under_load(tiny_kv_url):
    """Twelve requests at once on eight sequences and a KV pool too small for them: some wait, some are
    preempted. Nine run to their length, three stop on a stop token id after three tokens; half stream."""
    url = tiny_kv_url
    before = totals(url)
    reasons_before = {
        reason: labelled(url, "vllm:request_success_total", finished_reason=reason)
        for reason in ("length", "stop")
    }
    peaks = dict.fromkeys(GAUGES, 0.0)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            now = totals(url)
            for name in GAUGES:
                peaks[name] = max(peaks[name], now[name])
            time.sleep(0.01)

    def body(i: int) -> dict:
        prompt = [20 + i, *range(100, 100 + 4 * i)]  # distinct first blocks: no prefix-cache hits
        stop = {"min_tokens": 3, "stop_token_ids": list(range(384))} if i % 4 == 3 else {}
        return {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 40,
            "ignore_eos": True,
            "stream": i % 2 == 0,
            **({"stream_options": {"include_usage": True}} if i % 2 == 0 else {}),
            **stop,
        }

    async def send(client: httpx.AsyncClient, i: int) -> tuple[str, dict]:
        resp = await client.post("/v1/completions", json=body(i))
        assert resp.status_code == 200, resp.text
        if not body(i)["stream"]:
            out = resp.json()
            return out["choices"][0]["finish_reason"], out["usage"]
        chunks = [json.loads(e) for e in sse_events(resp)[:-1]]  # the last event is [DONE]
        [reason] = [
            choice["finish_reason"] for c in chunks for choice in c["choices"] if choice["finish_reason"]
        ]
        return reason, chunks[-1]["usage"]

    async def main() -> list[tuple[str, dict]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(send(client, i) for i in range(12)))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        results = asyncio.run(main())
    finally:
        done.set()
        watcher.join()
    # A streamed request is counted once its stream has ended, a moment after its last chunk.
    deadline = time.monotonic() + 30
    while (
        totals(url)["vllm:e2e_request_latency_seconds_count"]
        - before["vllm:e2e_request_latency_seconds_count"]
        < 12
    ):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    wait_until_idle(url)
    after = totals(url)
    moved = {name: after[name] - before[name] for name in after}

    reasons = [reason for reason, _ in results]
    assert sorted(reasons) == ["length"] * 9 + ["stop"] * 3
    prompt_tokens = sum(usage["prompt_tokens"] for _, usage in results)
    completion_tokens = [usage["completion_tokens"] for _, usage in results]
    assert sorted(completion_tokens) == [3] * 3 + [40] * 9

    for name in DASHBOARD_SERIES:
        if name in GAUGES:
            assert peaks[name] > 0, name
        else:
            assert moved[name] > 0, name
    assert moved["vllm:num_preemptions_total"] > 0
    assert moved["vllm:prompt_tokens_total"] == prompt_tokens
    assert moved["vllm:generation_tokens_total"] == sum(completion_tokens)
    for reason, count in [("length", 9), ("stop", 3)]:
        assert (
            labelled(url, "vllm:request_success_total", finished_reason=reason) - reasons_before[reason]
            == count
        )
    per_request = [
        "e2e_request_latency_seconds",
        "time_to_first_token_seconds",
        "request_time_per_output_token_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_max_num_generation_tokens",
        "request_params_n",
    ]
    for name in per_request:
        assert moved[f"vllm:{name}_count"] == 12, name
    assert moved["vllm:request_prompt_tokens_sum"] == prompt_tokens
    assert moved["vllm:request_generation_tokens_sum"] == sum(completion_tokens)
    assert moved["vllm:request_max_num_generation_tokens_sum"] == sum(completion_tokens)
    assert moved["vllm:request_params_n_sum"] == 12
    # Every output token but each request's first follows a gap; each step computed every token once at least.
    assert moved["vllm:inter_token_latency_seconds_count"] == sum(n - 1 for n in completion_tokens)
    assert moved["vllm:iteration_tokens_total_sum"] >= prompt_tokens + sum(n - 1 for n in completion_tokens)
    # vLLM's intervals add up: e2e = queued + inference, inference = prefill + decode, TTFT = queued + prefill.
    s = {
        name: moved[f"vllm:{name}_seconds_sum"]
        for name in [
            "e2e_request_latency",
            "request_queue_time",
            "request_inference_time",
            "request_prefill_time",
            "request_decode_time",
            "time_to_first_token",
        ]
    }
    assert s["e2e_request_latency"] == pytest.approx(s["request_queue_time"] + s["request_inference_time"])
    assert s["request_inference_time"] == pytest.approx(s["request_prefill_time"] + s["request_decode_time"])
    assert s["time_to_first_token"] == pytest.approx(s["request_queue_time"] + s["request_prefill_time"])
    assert s["request_queue_time"] > 0  # four of them waited for a sequence slot


def test_token_metrics_count_streamed_and_non_streamed_requests(client, url):
    """Generated tokens, request, per-token latency and sample counts in ``/metrics``: a streamed n = 2
    request (delta outputs) counts every token of both samples, as the non-streamed one does, and the
    gaps before all but each sample's first token."""
    kw = dict(
        model=MODEL,
        prompt="Paged attention",
        max_tokens=7,
        n=2,
        temperature=1.0,
        seed=2,
        extra_body={"ignore_eos": True},
    )
    names = [
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:request_time_per_output_token_seconds_count",
        "vllm:request_params_n_sum",
        "vllm:request_max_num_generation_tokens_sum",
        "vllm:inter_token_latency_seconds_count",
    ]
    for stream in (False, True):
        wait_until_idle(url)
        before = [metric(url, name) for name in names]
        if stream:
            chunks = list(
                client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
            )
            usage = chunks[-1].usage
        else:
            usage = client.completions.create(**kw).usage
        wait_until_idle(url)
        assert usage.completion_tokens == 14
        assert [metric(url, name) - b for name, b in zip(names, before)] == [14, 1, 1, 2, 7, 12]


def test_prefix_cache_metrics(client, url):
    prompt = list(range(100, 140))  # 40 tokens: two full 16-token blocks
    kw = dict(model=MODEL, prompt=prompt, max_tokens=2)
    client.completions.create(**kw, extra_body={"cache_salt": "first"})
    hits = metric(url, "vllm:prefix_cache_hits_total")
    client.completions.create(**kw, extra_body={"cache_salt": "other"})  # another salt: no sharing
    assert metric(url, "vllm:prefix_cache_hits_total") == hits
    queries = metric(url, "vllm:prefix_cache_queries_total")
    client.completions.create(**kw, extra_body={"cache_salt": "first"})
    assert metric(url, "vllm:prefix_cache_hits_total") == hits + 32
    assert metric(url, "vllm:prefix_cache_queries_total") == queries + 40


def test_jaxpaged_names_and_cache_config(engine):
    """With the flag every ``vllm:`` series has a ``jaxpaged:`` twin of the same type and value; ``cache_config_info``
    tells the KV cache's shape under vLLM's label names."""
    with serve(build_app(engine, MODEL, also_jaxpaged_metric_names=True)) as base:
        types, series = scrape(base)
    vllm_names = [name for name in types if name.startswith("vllm:")]
    assert set(DASHBOARD_SERIES) <= set(vllm_names)
    for name in vllm_names:
        twin = "jaxpaged:" + name.removeprefix("vllm:")
        assert types[twin] == types[name] and series[twin] == series[name], name
    [(labels, value)] = series["vllm:cache_config_info"]
    assert value == 1 and labels["block_size"] == "8" and labels["engine"] == "0"
    assert (
        labels["num_gpu_blocks"]
        == labels["num_gpu_blocks_override"]
        == str(ENGINE_ARGS["num_gpu_blocks_override"])
    )


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_step_stats_count_a_gap_before_every_token_but_the_first(tiny, num_scheduler_steps):
    """``vllm:inter_token_latency_seconds`` counts one gap per output token but each sample's first, whatever
    the step's shape: samples that run to their length, forked samples (n = 2), and samples ending on a stop
    token while their next token was in flight (dropped); with multi-step batches too."""
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(tiny[0]), num_scheduler_steps=num_scheduler_steps, **ENGINE_ARGS)
    )
    stop_early = SamplingParams(max_tokens=20, min_tokens=5, stop_token_ids=list(range(384)), n=2, seed=3)
    for i, sp in enumerate(
        [SamplingParams(max_tokens=9, ignore_eos=True, seed=i) for i in range(3)] + [stop_early]
    ):
        engine.add_request(f"r{i}", [30 + i, 7, 8, 9], sp)
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    lengths = [len(c.token_ids) for out in finished for c in out.outputs]
    assert sorted(lengths) == [5, 5, 9, 9, 9]
    gaps = engine.step_stats.inter_token_latency
    assert sum(gaps.counts) == sum(n - 1 for n in lengths) and gaps.total > 0
    assert sum(engine.step_stats.iteration_tokens.counts) > 0
