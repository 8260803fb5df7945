"""Prometheus metrics for ``GET /metrics``, named like vLLM's (``jaxpaged:`` for ``vllm:``).

Engine state (running / waiting requests, KV-cache use) is read from the engine's latest
snapshot at scrape time; per-request counters and latency histograms are recorded when a
request ends. Each app has its own registry, so several apps can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jaxpaged.async_engine import AsyncLLMEngine
from jaxpaged.request import RequestOutput

disable_created_metrics()           # no "*_created" timestamp series next to each counter (as vLLM)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class _EngineCollector(Collector):
    """Gauges and the prefix-cache counters from ``AsyncLLMEngine.stats``, read when scraped."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self._engine = engine
        self._model_name = model_name

    def collect(self):
        s = self._engine.stats
        for name, doc, value in [
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = 100%).", s.kv_cache_usage),
            ("kv_cache_free_blocks", "KV-cache blocks in the free pool.", s.num_free_blocks),
            ("kv_cache_usable_blocks", "KV-cache blocks in the pool (excluding the null block).",
             s.num_usable_blocks),
            ("engine_alive", "1 while the engine loop runs, 0 once it has died.", int(s.alive)),
        ]:
            gauge = GaugeMetricFamily(f"jaxpaged:{name}", doc, labels=["model_name"])
            gauge.add_metric([self._model_name], value)
            yield gauge
        for name, doc, value in [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache (hit rate = hits / queries).",
             s.prefix_cache_hits),
        ]:
            counter = CounterMetricFamily(f"jaxpaged:{name}", doc, labels=["model_name"])
            counter.add_metric([self._model_name], value)
            yield counter


class ServerMetrics:
    """The app's registry and the per-request metrics recorded into it."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self._model_name = model_name
        r, label = self.registry, ["model_name"]
        self.prompt_tokens = Counter("jaxpaged:prompt_tokens", "Prefill tokens processed.", label, registry=r)
        self.generation_tokens = Counter("jaxpaged:generation_tokens", "Tokens generated.", label, registry=r)
        self.requests = Counter("jaxpaged:request_success", "Requests ended, by finish reason.",
                                label + ["finished_reason"], registry=r)
        self.ttft = Histogram("jaxpaged:time_to_first_token_seconds", "Arrival to first output token.",
                              label, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("jaxpaged:time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request.",
                              label, buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jaxpaged:e2e_request_latency_seconds", "Arrival to last output token.",
                             label, buckets=_LATENCY_BUCKETS, registry=r)

    def record(self, num_prompt_tokens: int, last: RequestOutput | None, num_output_tokens: dict[int, int]) -> None:
        """Count one ended engine request; ``last`` is its newest output (None if it produced none),
        ``num_output_tokens`` the tokens of each of its samples (outputs may be deltas)."""
        m = self._model_name
        self.prompt_tokens.labels(m).inc(num_prompt_tokens)
        self.generation_tokens.labels(m).inc(sum(num_output_tokens.values()))
        finished = last is not None and last.finished
        reason = last.outputs[0].finish_reason if finished else "abort"
        self.requests.labels(m, reason).inc()
        if not finished:
            return
        t = last.metrics
        if "first_token_time" in t:
            self.ttft.labels(m).observe(t["first_token_time"] - t["arrival_time"])
        if "finished_time" in t:
            self.e2e.labels(m).observe(t["finished_time"] - t["arrival_time"])
            num_decoded = num_output_tokens[last.outputs[0].index] - 1
            if num_decoded > 0 and "first_token_time" in t:
                self.tpot.labels(m).observe((t["finished_time"] - t["first_token_time"]) / num_decoded)

    def render(self) -> bytes:
        return generate_latest(self.registry)
