"""What the engine's steps have done so far: vLLM's per-iteration distributions, accumulated.

vLLM observes two histograms per engine iteration, the tokens the step computed and the gap
before each output token. ``/metrics`` reads them whenever it is scraped, long after the steps
ran, so the engine keeps them as cumulative histograms (a count per bucket and a sum) with
vLLM's bucket bounds: O(1) per step, and any number of readers.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

ITERATION_TOKENS_BUCKETS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""vLLM's bounds for ``vllm:iteration_tokens_total``."""
INTER_TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
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
)
"""vLLM's bounds for ``vllm:inter_token_latency_seconds`` and ``vllm:request_time_per_output_token_seconds``."""


@dataclass
class Histogram:
    """Observations counted per bucket: ``counts[i]`` those in ``(bounds[i - 1], bounds[i]]``
    (Prometheus's ``le``), ``counts[-1]`` those above every bound; ``total`` is their sum."""

    bounds: tuple[float, ...]
    counts: list[int]
    total: float = 0.0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> Histogram:
        return cls(bounds, [0] * (len(bounds) + 1))

    def observe(self, value: float, n: int = 1) -> None:
        """Count ``n`` observations of ``value``."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.total += value * n

    def __add__(self, other: Histogram) -> Histogram:
        return Histogram(
            self.bounds, [a + b for a, b in zip(self.counts, other.counts)], self.total + other.total
        )

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total)


@dataclass
class StepStats:
    """The engine's steps so far (``LLMEngine.step_stats``; a data-parallel engine sums its replicas')."""

    iteration_tokens: Histogram = field(default_factory=lambda: Histogram.empty(ITERATION_TOKENS_BUCKETS))
    """Tokens each step computed (a multi-step batch is one step)."""
    inter_token_latency: Histogram = field(
        default_factory=lambda: Histogram.empty(INTER_TOKEN_LATENCY_BUCKETS)
    )
    """Seconds before each output token but a sample's first (``LLMEngine._record_step``)."""

    def __add__(self, other: StepStats) -> StepStats:
        return StepStats(
            self.iteration_tokens + other.iteration_tokens,
            self.inter_token_latency + other.inter_token_latency,
        )

    def copy(self) -> StepStats:
        """A snapshot: later steps leave it as it is."""
        return StepStats(self.iteration_tokens.copy(), self.inter_token_latency.copy())
