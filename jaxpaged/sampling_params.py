"""Per-request sampling parameters, validated once when the request is made.

Names, defaults and ranges follow vLLM's ``SamplingParams`` so that code written
for vLLM works unchanged. Every invalid value raises ``ValueError`` naming the
parameter and its allowed range. Nothing here knows about JAX; checks that need
the model (token ids within the vocabulary) happen in ``LLMEngine.make_request``.
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20
"""Most top logprobs a request may ask for, per generated or prompt token (vLLM's default ``max_logprobs``)."""
MIN_TEMPERATURE = 0.01
"""Positive temperatures below this are raised to it, as vLLM does: ``1/T`` would overflow the logits."""
MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a running request carries (vLLM's ``RequestOutputKind``)."""

    CUMULATIVE = 0
    """Every step: the whole output so far (and the delta since the previous output)."""
    DELTA = 1
    """Every step: only what is new (``text`` and ``token_ids`` hold the delta)."""
    FINAL_ONLY = 2
    """Nothing until the request finishes, then the whole output: the engine skips per-step
    output building, and detokenizes once at the end unless stop strings need the text earlier."""


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible and
    independent of the batch the request lands in; without one the engine draws a
    seed for the request when it is added. ``n`` completions are returned, chosen as
    the ``n`` of ``best_of`` samples (default ``n``) with the highest cumulative logprob.
    The order of logit processing is vLLM's: ``logit_bias`` and the ``min_tokens`` mask,
    then the repetition, frequency and presence penalties (greedy picks the argmax here),
    then temperature, ``min_p``, ``top_k`` and ``top_p``. Returned logprobs are those of the
    raw model distribution.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        if self.best_of is None:
            self.best_of = self.n
        self._validate()
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s and would overflow the scaled logits; using %s.",
                           self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE

    @staticmethod
    def _normalize_logit_bias(bias: object) -> dict[int, float]:
        """Keys may be ints or decimal strings (JSON objects, as in the OpenAI API)."""
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias in [-100, 100], got {bias!r}.")
        out = {}
        for k, v in bias.items():
            if isinstance(k, str) and k.strip().isdigit():
                k = int(k)
            if not _is_int(k) or k < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {k!r}.")
            if not _is_real(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {v!r} for token {k}.")
            out[int(k)] = float(v)
        return out

    def _validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        def int_at_least(name: str, lo: int) -> None:
            v = getattr(self, name)
            need(_is_int(v) and v >= lo, f"{name} must be at least {lo} (an integer), got {v!r}.")

        def real_in(name: str, ok, range_text: str) -> None:
            v = getattr(self, name)
            need(_is_real(v) and ok(v), f"{name} must be in {range_text}, got {v!r}.")

        int_at_least("n", 1)
        need(_is_int(self.best_of) and self.best_of >= self.n,
             f"best_of must be an integer >= n (n={self.n!r}), got {self.best_of!r}.")
        real_in("presence_penalty", lambda v: -2.0 <= v <= 2.0, "[-2, 2]")
        real_in("frequency_penalty", lambda v: -2.0 <= v <= 2.0, "[-2, 2]")
        real_in("repetition_penalty", lambda v: v > 0.0, "(0, inf)")
        need(_is_real(self.temperature) and self.temperature >= 0.0,
             f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}.")
        real_in("top_p", lambda v: 0.0 < v <= 1.0, "(0, 1]")
        need(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
             f"top_k must be -1 (disable) or at least 1, got {self.top_k!r}.")
        real_in("min_p", lambda v: 0.0 <= v <= 1.0, "[0, 1]")
        need(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**63),
             f"seed must be None or an integer in [-2**63, 2**63), got {self.seed!r}.")
        need(all(isinstance(s, str) and s for s in self.stop),
             f"stop must be a list of non-empty strings, got {self.stop!r}.")
        need(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}.")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            need(isinstance(getattr(self, name), bool), f"{name} must be a bool, got {getattr(self, name)!r}.")
        if self.max_tokens is not None:
            int_at_least("max_tokens", 1)
        int_at_least("min_tokens", 0)
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}.")
        need(isinstance(self.output_kind, RequestOutputKind),
             f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            need(v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
                 f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {v!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_logprobs(self) -> bool:
        """Whether each sampled token's logprob is computed (and ``cumulative_logprob`` reported, as
        vLLM does): asked for, or needed to rank ``best_of`` samples."""
        return self.logprobs is not None or self.best_of > self.n

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_step_lists(self) -> bool:
        """Penalties, logit bias or min_tokens: the sampler's inputs for this request are lists
        rebuilt each step from its tokens so far."""
        return self.needs_penalties or bool(self.logit_bias) or self.min_tokens > 0
