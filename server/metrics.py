"""Prometheus metrics for ``GET /metrics``: vLLM's, so that dashboards built for vLLM work unchanged.

vLLM's core metrics (its ``PrometheusStatLogger``'s: every one its example Grafana dashboards query,
and more) are exposed as ``vllm:<name>``, with vLLM's type, labels (``model_name``, ``engine``) and
bucket bounds; ``also_jaxpaged_metric_names`` exposes each a second time as ``jaxpaged:<name>``. The
metrics vLLM lacks (free and usable KV blocks, whether the engine runs) are ``jaxpaged:`` only.

Engine state (queues, KV-cache use, prefix-cache and preemption counters, the per-step histograms
of ``jaxpaged.step_stats``) is read from the engine's latest snapshot when scraped. The per-request
counters and histograms are recorded when a request ends, from its output's timestamps, into vLLM's
intervals: queued (arrival to first scheduled), prefill (to the first token), decode (first token
to last), inference (first scheduled to last token). A request with ``n`` samples counts once
(vLLM counts each sample). Each app has its own registry, so several apps can live in one process.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from jaxpaged import step_stats
from jaxpaged.async_engine import AsyncLLMEngine
from jaxpaged.request import RequestOutput
from jaxpaged.spec_decode.metrics import SpecDecodingStats

disable_created_metrics()  # no "*_created" timestamp series next to each counter (as vLLM)

ENGINE = "0"
"""vLLM's ``engine`` label, the engine's index: a server has one (a data-parallel one's replicas count together)."""
_LABELS = ["model_name", "engine"]
_FINISH_REASONS = ("stop", "length", "abort", "error")
"""Finish reasons whose ``request_success`` series exist from the start (vLLM creates them all up front)."""

# vLLM's bucket bounds (vllm/v1/metrics/buckets.py, vLLM 0.33.0); its per-step ones are in jaxpaged.step_stats.
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's bounds for a request's token counts: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    bounds, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return bounds
            bounds.append(mantissa * scale)
        scale *= 10


def _histogram_family(
    name: str, doc: str, labels: list[str], h: step_stats.Histogram
) -> HistogramMetricFamily:
    cumulative = list(itertools.accumulate(h.counts))
    family = HistogramMetricFamily(name, doc, labels=_LABELS)
    family.add_metric(
        labels,
        [(floatToGoString(b), c) for b, c in zip(h.bounds, cumulative)] + [("+Inf", cumulative[-1])],
        h.total,
    )
    return family


def _cache_config_info(engine: AsyncLLMEngine) -> dict[str, str]:
    """vLLM's ``cache_config_info`` labels: the KV cache's configuration, under vLLM's names."""
    cc, info = engine.engine.config.cache, engine.engine.cache_info
    labels = {
        "block_size": cc.block_size,
        "enable_prefix_caching": cc.enable_prefix_caching,
        "gpu_memory_utilization": cc.gpu_memory_utilization,
        "kv_cache_memory_bytes": cc.kv_cache_memory,
        "num_gpu_blocks": info.num_blocks,
        "num_gpu_blocks_override": cc.num_blocks_override,
        "engine": ENGINE,
    }
    return {k: str(v) for k, v in labels.items()}


class _EngineCollector(Collector):
    """vLLM's engine metrics (unprefixed names), from ``AsyncLLMEngine.stats`` when scraped."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self._engine = engine
        self._labels = [model_name, ENGINE]
        self._cache_config = _cache_config_info(engine)

    def collect(self) -> Iterable[Metric]:
        s, labels = self._engine.stats, self._labels
        for family, name, doc, value in [
            (
                GaugeMetricFamily,
                "num_requests_running",
                "Number of requests in model execution batches.",
                s.num_running,
            ),
            (
                GaugeMetricFamily,
                "num_requests_waiting",
                "Number of requests waiting to be processed.",
                s.num_waiting,
            ),
            (
                GaugeMetricFamily,
                "kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                s.kv_cache_usage,
            ),
            (
                CounterMetricFamily,
                "prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                s.prefix_cache_queries,
            ),
            (
                CounterMetricFamily,
                "prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                s.prefix_cache_hits,
            ),
            (
                CounterMetricFamily,
                "num_preemptions",
                "Cumulative number of preemption from the engine.",
                s.num_preemptions,
            ),
        ]:
            metric = family(name, doc, labels=_LABELS)
            metric.add_metric(labels, value)
            yield metric
        yield _histogram_family(
            "iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            labels,
            s.steps.iteration_tokens,
        )
        yield _histogram_family(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            s.steps.inter_token_latency,
        )
        if s.spec_decode is not None:
            yield from _spec_decode_families(s.spec_decode, labels)
        info = GaugeMetricFamily(
            "cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(self._cache_config)
        )
        info.add_metric(list(self._cache_config.values()), 1)
        yield info


def _spec_decode_families(spec: SpecDecodingStats, labels: list[str]) -> Iterable[Metric]:
    """vLLM's speculative-decoding counters."""
    for name, doc, value in [
        ("spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts),
        ("spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens),
    ]:
        metric = CounterMetricFamily(name, doc, labels=_LABELS)
        metric.add_metric(labels, value)
        yield metric
    per_pos = CounterMetricFamily(
        "spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        labels=[*_LABELS, "position"],
    )
    for position, value in enumerate(spec.num_accepted_tokens_per_pos):
        per_pos.add_metric([*labels, str(position)], value)
    yield per_pos


class _JaxpagedEngineCollector(Collector):
    """The engine gauges vLLM lacks (unprefixed names), from ``AsyncLLMEngine.stats`` when scraped."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self._engine = engine
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        s = self._engine.stats
        for name, doc, value in [
            ("kv_cache_free_blocks", "KV-cache blocks in the free pool.", s.num_free_blocks),
            (
                "kv_cache_usable_blocks",
                "KV-cache blocks in the pool (excluding the null block).",
                s.num_usable_blocks,
            ),
            ("engine_alive", "1 while the engine loop runs, 0 once it has died.", int(s.alive)),
        ]:
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self._model_name], value)
            yield gauge


class _Prefixed(Collector):
    """Every metric of ``source`` under each of ``prefixes``."""

    def __init__(self, source: Collector, prefixes: Sequence[str]) -> None:
        self._source = source
        self._prefixes = prefixes

    def collect(self) -> Iterable[Metric]:
        for family in self._source.collect():
            for prefix in self._prefixes:
                renamed = Metric(prefix + family.name, family.documentation, family.type, family.unit)
                renamed.samples = [s._replace(name=prefix + s.name) for s in family.samples]
                yield renamed


class ServerMetrics:
    """The app's registry and the per-request metrics recorded into it."""

    def __init__(
        self, engine: AsyncLLMEngine, model_name: str, also_jaxpaged_metric_names: bool = False
    ) -> None:
        vllm = CollectorRegistry()  # vLLM's metrics, without their prefix
        vllm.register(_EngineCollector(engine, model_name))
        self.registry = CollectorRegistry()
        self.registry.register(
            _Prefixed(vllm, ["vllm:", "jaxpaged:"] if also_jaxpaged_metric_names else ["vllm:"])
        )
        self.registry.register(_Prefixed(_JaxpagedEngineCollector(engine, model_name), ["jaxpaged:"]))
        self._labels = labels = [model_name, ENGINE]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=vllm).labels(*labels)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, _LABELS, buckets=buckets, registry=vllm).labels(*labels)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self._success = Counter(
            "request_success",
            "Count of successfully processed requests.",
            _LABELS + ["finished_reason"],
            registry=vllm,
        )
        for reason in _FINISH_REASONS:
            self._success.labels(*labels, reason)
        tokens = request_tokens_buckets(engine.max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        self.request_params_n = histogram(
            "request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            step_stats.INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.e2e, self.queue_time, self.prefill_time, self.decode_time, self.inference_time = (
            histogram(name, doc, REQUEST_LATENCY_BUCKETS)
            for name, doc in [
                ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
                ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
                ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
                ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
                ("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."),
            ]
        )

    def record(
        self, num_prompt_tokens: int, last: RequestOutput | None, num_output_tokens: dict[int, int]
    ) -> None:
        """Count one ended engine request; ``last`` is its newest output (None if it produced none),
        ``num_output_tokens`` the tokens of each of its samples (outputs may be deltas). Only a finished
        request has its histograms observed (an aborted one counts in the counters, as "abort")."""
        generated = sum(num_output_tokens.values())
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(generated)
        finished = last is not None and last.finished
        reason = last.outputs[0].finish_reason if finished else "abort"
        self._success.labels(*self._labels, reason).inc()
        if not finished:
            return
        longest = max(num_output_tokens.values(), default=0)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(generated)
        self.request_max_num_generation_tokens.observe(longest)
        self.request_params_n.observe(len(last.outputs))
        t = last.metrics
        arrival, scheduled, first, end = (
            t["arrival_time"],
            t["first_scheduled_time"],
            t["first_token_time"],
            t["finished_time"],
        )
        self.e2e.observe(end - arrival)
        self.queue_time.observe(scheduled - arrival)
        self.ttft.observe(first - arrival)
        self.prefill_time.observe(first - scheduled)
        self.decode_time.observe(end - first)
        self.inference_time.observe(end - scheduled)
        self.tpot.observe((end - first) / (longest - 1) if longest > 1 else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
