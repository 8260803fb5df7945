"""Request state as the scheduler and engine see it, and the outputs users get back.

A request's tokens are ``prompt_token_ids + output_token_ids``. The scheduler moves
``num_computed_tokens`` (tokens whose K/V are in the cache) towards ``num_tokens``;
when a step computes the last known token, the model samples the next one. Preemption
by recomputation simply resets ``num_computed_tokens`` to 0 and frees the blocks:
the prompt and the outputs so far are recomputed as one long prompt. Preemption by swapping
moves the blocks to host pages (``host_block_ids``) and keeps ``num_computed_tokens``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxpaged.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxpaged.structured_outputs import GrammarMatcher


@dataclass
class Logprob:
    """One token's log probability under the raw model distribution (vLLM's ``Logprob``).

    ``rank`` is 1 for the most likely token; ``decoded_token`` is the token on its own, as text.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]
"""The chosen (or prompt) token and the requested top-N alternatives at one position."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"
    """Its own processing failed (vLLM's): it ended with finish reason "error", the others went on."""

    # Members are singletons: hashing by identity (in C) makes the per-token status lookups cheap.
    __hash__ = object.__hash__

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False, slots=True)
class Request:
    """One generation request. Holds no device arrays."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    """Resolved output length limit (``sampling_params.max_tokens`` or what fits)."""
    seed: int
    """Resolved sampling seed (the user's, or one the engine drew)."""
    num_prompt_tokens: int = field(init=False)
    """``len(prompt_token_ids)`` (a prompt never changes once the request is made), kept beside the
    decode step's fields: the scheduler reads it for every running request each step, and the
    prompt list would be one more object to fetch per request."""
    # The fields a decode step reads and writes come first: they share the object's first cache lines.
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    """Output tokens sampled by steps in flight on the device, not yet appended (async scheduling):
    the scheduler counts them as known, the model reads their ids on the device."""
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    eos_token_id: int | None = None
    final_stop_ids: frozenset[int] | None = None
    """For a sample whose text nothing reads before it ends (``FINAL_ONLY``, no stop strings): the
    tokens that may end it before its length limit (EOS, stop ids), so the engine can pass over
    every other token without its sampling parameters. None: see ``stream_stop_ids``."""
    multi_step: bool = False
    """Whether the scheduler may give this sample several decode steps at once: its sampling inputs
    are the same every step (``not sampling_params.needs_step_lists``) and no engine decision sits
    between its steps (not a beam)."""
    pending_forks: Sequence["Request"] = ()
    """Samples the scheduler forks from this request in the step that computes its last prompt
    token: they share its blocks and draw their first token from the same logits. (Empty: the
    shared empty tuple, which the scheduler's test for forks finds in cache, unlike a list of its own.)"""
    block_ids: list[int] = field(default_factory=list)
    """Physical KV blocks, in logical order; filled by the KVCacheManager."""
    block_hashes: list[int] = field(default_factory=list)
    """Prefix-cache hashes of its full blocks so far (KVCacheManager's; may run ahead of
    ``block_ids`` after a prefix lookup), as vLLM keeps them on the request."""
    num_published_blocks: int = 0
    """Leading ``block_ids`` published to the prefix cache (KVCacheManager's)."""
    cache_salt: str | None = None
    """Isolates prefix-cache sharing: only requests with the same salt share blocks."""
    prompt: str | None = None
    arrival_time: float = 0.0
    output_logprobs: list[float] = field(default_factory=list)
    """The chosen tokens' logprobs, when ``sampling_params.needs_logprobs`` (``best_of`` ranks samples by their sum)."""
    logprob_sum: float = 0.0
    """The sum of ``output_logprobs[:num_logprobs_summed]`` (see ``cumulative_logprob``)."""
    num_logprobs_summed: int = 0
    output_top_logprobs: list[TokenLogprobs] | None = None
    """Per generated token, when ``sampling_params.logprobs`` is set."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """``[None, lp(prompt[1]), ...]`` as far as computed, when this request computes prompt logprobs."""
    penalty_counts: dict[int, int] | None = None
    """For penalties: token -> count in the output, over the tokens seen (the prompt's count 0);
    kept up to date by the model runner."""
    num_penalty_counted: int = 0
    """Output tokens already in ``penalty_counts``."""
    sample_index: int = 0
    """Which of the request's ``best_of`` samples this is (``forks`` holds samples 1..best_of-1)."""
    forks: list["Request"] = field(default_factory=list)
    """The other samples of an ``n``/``best_of`` > 1 request (on the first sample only)."""
    reserved_seqs: int = 0
    """Running slots (of ``max_num_seqs``) the scheduler keeps free for this request's future
    forks while it runs: its pending samples, or a beam search's other beams."""
    waiting_for_group: bool = False
    """A beam whose next-token candidates are in, waiting for its other beams: it has nothing to
    compute until the engine appends its token, even if preempted meanwhile."""
    host_block_ids: list[int] = field(default_factory=list)
    """Host pages holding the KV of a request swapped out by preemption (device blocks then empty)."""
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    output_text_end: int | None = None
    """Where the output text is cut when a stop string or stop token ended it."""
    num_text_sent: int = 0
    """Characters of output text already reported (streaming deltas)."""
    num_tokens_sent: int = 0
    """Output tokens already reported (streaming deltas)."""
    first_token_time: float | None = None
    finished_time: float | None = None
    # Last: a field inserted among the first ones moves those after it to other cache lines, and a
    # decode step's take-in of a FINAL_ONLY sample reads up to ``output_top_logprobs``.
    stream_stop_ids: frozenset[int] | None = None
    """``final_stop_ids`` for a sample whose outputs stream (``DELTA``, ``CUMULATIVE``) with no stop
    strings: every other token is detokenized and reported without its stop rules. None in both
    (stop strings): every token is checked in full. Two fields, so that the common ``FINAL_ONLY``
    token costs no test of the output kind."""
    priority: int = 0
    """Lower runs sooner under the ``priority`` scheduling policy (vLLM's); 0 under ``fcfs``."""
    queue_tag: int = 0
    """The scheduler's fair-queueing start tag (``Scheduler.add_requests``)."""
    queue_group: int = 0
    """Which API request it belongs to, for the scheduler (``Scheduler.add_requests``)."""
    grammar: GrammarMatcher | None = None
    """Structured outputs: this sample's grammar matcher, advanced by each token it takes in (never
    by a recomputation after preemption: it follows ``output_token_ids``)."""
    first_scheduled_time: float | None = None
    """When the scheduler first admitted it (resuming after a preemption leaves it): its queueing ends
    and its prefill begins there, as in vLLM's request metrics."""
    spec_token_ids: Sequence[int] = ()
    """Speculative decoding: draft tokens for the next schedule to verify after its last token (the
    engine's ``Speculator`` sets and takes them back around a schedule)."""
    num_spec_draft_tokens: int = 0
    """Draft tokens verified for this sample so far, ..."""
    num_spec_accepted_tokens: int = 0
    """... of which accepted, ..."""
    num_spec_verifications: int = 0
    """... in this many verifying steps."""

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def cumulative_logprob(self) -> float:
        """The sum of ``output_logprobs``, added up in order; each call adds only the new ones, so a
        streamed output's cost stays O(new tokens)."""
        lps, total = self.output_logprobs, self.logprob_sum
        for i in range(self.num_logprobs_summed, len(lps)):
            total += lps[i]
        self.logprob_sum, self.num_logprobs_summed = total, len(lps)
        return total

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def all_outputs_sampled(self) -> bool:
        """Every output token ``max_tokens`` allows is appended or in flight: nothing left to schedule."""
        return len(self.output_token_ids) + self.num_output_placeholders >= self.max_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Token ids in ``[start, stop)`` of the whole sequence, without building it."""
        p = self.num_prompt_tokens
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISH_REASONS


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's ``CompletionOutput``)."""

    index: int
    text: str
    """The output text so far; while unfinished, a tail that may begin a stop string is held back."""
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the output (None for EOS or length)."""
    delta_text: str = ""
    """Text added since this sequence's previous output (what a streaming server sends)."""
    delta_token_ids: list[int] = field(default_factory=list)
    """Token ids added since this sequence's previous output."""

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, later: CompletionOutput) -> None:
        """Append a later ``DELTA`` output of the same sequence (what both say, as one delta)."""
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.delta_text += later.delta_text
        self.delta_token_ids = self.delta_token_ids + later.delta_token_ids
        self.cumulative_logprob = later.cumulative_logprob
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns and the engine streams per step (vLLM's ``RequestOutput``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    """Timestamps (``time.time()``, named as vLLM's v0 ``RequestMetrics``): ``arrival_time``;
    ``first_scheduled_time`` and ``first_token_time`` once there is a token (a beam search's output and a
    failed request's have neither); ``finished_time`` once finished."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """Per prompt token (the first is None), when ``prompt_logprobs`` was asked for; with
    ``RequestOutputKind.DELTA`` only in a request's first output (as vLLM)."""

    def add(self, later: RequestOutput) -> None:
        """Merge a later ``DELTA`` output of the same request into this one, so that a reader that
        fell behind gets one output saying what the skipped ones said (vLLM's ``aggregate``)."""
        mine = {c.index: c for c in self.outputs}
        for c in later.outputs:
            if c.index in mine:
                mine[c.index].add(c)
            else:
                self.outputs.append(c)
        self.finished = later.finished
        self.metrics = {**self.metrics, **later.metrics}
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
