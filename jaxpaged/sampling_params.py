"""Per-request sampling parameters, validated once when the request is made.

Names, defaults and ranges follow vLLM's ``SamplingParams`` so that code written
for vLLM works unchanged. Every invalid value raises ``ValueError`` naming the
parameter (``ParamError.param``) and its allowed range. The ranges are also what the device
can hold: counts and token ids are int32, floats float32 (finite, and a value that must be positive
at least the smallest normal float32, as the device may read a smaller one as 0). Nothing here knows
about JAX; checks that need the model (token ids within the vocabulary) happen in
``LLMEngine.make_request``, and a ``top_k`` at least the vocabulary size means all tokens (vLLM's
rule), applied where the device row is written.
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
import struct
from dataclasses import dataclass, field

from jaxpaged.param_errors import ParamError, excerpt
from jaxpaged.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20
"""Most top logprobs a request may ask for, per generated or prompt token (vLLM's default ``max_logprobs``)."""
MIN_TEMPERATURE = 0.01
"""Positive temperatures below this are raised to it, as vLLM does: ``1/T`` would overflow the logits."""
MAX_LOGIT_BIAS = 100.0
INT32_MAX = 2**31 - 1
"""Largest count or token id: the device holds them as int32."""
FLOAT32_TINY = 1.1754943508222875e-38
"""Smallest normal float32: XLA may read smaller (subnormal) values as 0 (on CPU, ``1e-45 > 0`` is false)."""


def is_unicode(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogate): tokenizers and JSON bodies need it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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


def _float32(v: object) -> float | None:
    """``v`` as the device's float32 holds it; None if ``v`` is not a real number or not a finite float32."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    try:
        f = struct.unpack("f", struct.pack("f", float(v)))[0]
    except OverflowError:  # beyond float64, or rounding past float32's largest
        return None
    return f if math.isfinite(f) else None


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible and
    independent of the batch the request lands in; without one the engine draws a
    seed for the request when it is added. ``n`` completions are returned, chosen as
    the ``n`` of ``best_of`` samples (default ``n``) with the highest cumulative logprob.
    The order of logit processing is vLLM's: ``logit_bias`` and the ``min_tokens`` mask,
    then the repetition, frequency and presence penalties (greedy picks the argmax here),
    then temperature, ``min_p``, ``top_k`` and ``top_p``; ``structured_outputs`` masks the tokens
    its grammar does not allow before all of these. Returned logprobs are those of the raw model
    distribution.
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
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        if self.best_of is None:
            self.best_of = self.n
        if _is_int(self.top_k) and self.top_k == 0:
            self.top_k = -1  # vLLM reads 0, as -1, as no top-k
        self._validate()
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s and would overflow the scaled logits; using %s.",
                self.temperature,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
            self.temperature = MIN_TEMPERATURE

    @staticmethod
    def _normalize_logit_bias(bias: object) -> dict[int, float]:
        """Keys may be ints or decimal strings (JSON objects, as in the OpenAI API)."""
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise ParamError(
                "logit_bias",
                f"logit_bias must be a dict of token id -> bias in [-100, 100], got {excerpt(bias)}.",
            )
        out = {}
        for k, v in bias.items():
            if isinstance(k, str) and k.strip().isdigit():
                k = int(k)
            if not _is_int(k) or not 0 <= k <= INT32_MAX:
                raise ParamError(
                    "logit_bias", f"logit_bias keys must be non-negative token ids (int32), got {excerpt(k)}."
                )
            f = _float32(v)
            if f is None or not -MAX_LOGIT_BIAS <= f <= MAX_LOGIT_BIAS:
                raise ParamError(
                    "logit_bias", f"logit_bias values must be in [-100, 100], got {excerpt(v)} for token {k}."
                )
            out[int(k)] = float(v)
        return out

    def _validate(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ParamError(name, f"{name} must be {rule}, got {excerpt(getattr(self, name))}.")

        def count(name: str, lo: int) -> None:
            v = getattr(self, name)
            need(
                _is_int(v) and lo <= v <= INT32_MAX, name, f"at least {lo} and at most {INT32_MAX} (an int32)"
            )

        def real(name: str, ok, rule: str, positive: bool = False) -> None:
            f = _float32(getattr(self, name))
            tiny = (
                f" of at least {FLOAT32_TINY:.2g} (the device may read a smaller one as 0)"
                if positive
                else ""
            )
            need(
                f is not None and ok(f) and (not positive or f >= FLOAT32_TINY),
                name,
                f"{rule} and a finite float32{tiny}",
            )

        count("n", 1)
        need(
            _is_int(self.best_of) and self.n <= self.best_of <= INT32_MAX,
            "best_of",
            f"an integer >= n (n={self.n!r}) and an int32",
        )
        real("presence_penalty", lambda v: -2.0 <= v <= 2.0, "in [-2, 2]")
        real("frequency_penalty", lambda v: -2.0 <= v <= 2.0, "in [-2, 2]")
        real("repetition_penalty", lambda v: v > 0.0, "in (0, inf)", positive=True)
        real("temperature", lambda v: v >= 0.0, ">= 0 (0 = greedy)")
        real("top_p", lambda v: 0.0 < v <= 1.0, "in (0, 1]", positive=True)
        need(
            _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
            "top_k",
            "0 or -1 (disable) or at least 1 (at least the vocabulary size: all tokens)",
        )
        real("min_p", lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
        need(
            self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**63),
            "seed",
            "None or an integer in [-2**63, 2**63)",
        )
        need(
            all(isinstance(s, str) and s and is_unicode(s) for s in self.stop),
            "stop",
            "a list of non-empty strings of valid Unicode",
        )
        need(
            all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids),
            "stop_token_ids",
            "non-negative integers (int32)",
        )
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            need(isinstance(getattr(self, name), bool), name, "a bool")
        if self.max_tokens is not None:
            count("max_tokens", 1)
        count("min_tokens", 0)
        need(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"in [0, max_tokens={self.max_tokens}]",
        )
        need(isinstance(self.output_kind, RequestOutputKind), "output_kind", "a RequestOutputKind")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            need(
                v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
                name,
                f"None or an integer in [0, {MAX_LOGPROBS}]",
            )
        need(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "None or a StructuredOutputsParams",
        )

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
        """Penalties, logit bias, min_tokens or structured outputs: the sampler's inputs for this
        request are rebuilt each step from its tokens so far."""
        return (
            self.needs_penalties
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.structured_outputs is not None
        )

    @property
    def needs_host_tokens(self) -> bool:
        """Penalties or structured outputs: a step's sampler inputs for this request depend on the
        previous step's token, so the step needs it on the host (steps run synchronously)."""
        return self.needs_penalties or self.structured_outputs is not None
