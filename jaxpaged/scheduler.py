"""Continuous-batching scheduler: which requests run this step, and how many tokens each.

Pure Python (no jax, no numpy), vLLM V1 style. There is no prefill/decode phase: each
request has ``num_tokens`` known tokens of which ``num_computed_tokens`` are in the KV
cache, and a step computes the next ``num_new_tokens`` of them for every scheduled
request. A long prompt is therefore split across steps (chunked prefill) and mixed with
decodes in one step. ``num_computed_tokens`` advances at schedule time; the engine
appends a sampled token to each request whose step reached its last known token.

When the KV pool runs dry the newest running request is preempted by recomputation
(blocks freed, ``num_computed_tokens`` reset to 0) and resumes before later arrivals.
The oldest running request is never the victim, so it always progresses: no deadlock,
no starvation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from jaxpaged.config import SchedulerConfig
from jaxpaged.kv_cache_manager import KVCacheManager
from jaxpaged.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step's work: ``requests[i]`` computes tokens
    ``[start_positions[i], start_positions[i] + num_new_tokens[i])``."""

    requests: list[Request]
    num_new_tokens: list[int]
    start_positions: list[int]
    preempted: list[Request]
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) copy-on-write block pairs, copied on device before the step."""

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    """Owns the waiting and running queues and every live request's KV blocks.

    ``running`` is in admission order (the last one is the preemption victim); ``waiting``
    is FCFS with preempted requests pushed to its front. Others read them, never mutate.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: int) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self._requests: dict[str, Request] = {}

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ``ValueError`` (leaving no trace) if it can never run."""
        self._check_admissible(request)
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def _check_admissible(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use; give each request a unique id.")
        n_prompt = request.num_prompt_tokens
        if n_prompt == 0:
            raise ValueError(f"request {rid!r} has an empty prompt; give it at least one token.")
        if request.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be at least 1, got {request.max_tokens}.")
        total = n_prompt + request.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt ({n_prompt} tokens) + max_tokens ({request.max_tokens}) = "
                f"{total} exceeds max_model_len ({self.max_model_len}); shorten the prompt or "
                f"lower max_tokens.")
        kv = self.kv_cache_manager
        needed = kv.blocks_needed(total)
        if needed > kv.pool.num_usable_blocks:
            raise ValueError(
                f"request {rid!r}: prompt + max_tokens = {total} tokens needs {needed} KV blocks of "
                f"{kv.block_size} tokens but the pool has only {kv.pool.num_usable_blocks}; shorten "
                f"the prompt, lower max_tokens, or give the KV cache more blocks (kv_cache_memory "
                f"or num_gpu_blocks_override).")
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and n_prompt > budget:
            raise ValueError(
                f"request {rid!r}: prompt ({n_prompt} tokens) is longer than max_num_batched_tokens "
                f"({budget}) and chunked prefill is off; enable chunked prefill or raise "
                f"max_num_batched_tokens.")

    def abort_request(self, request_id: str) -> Request | None:
        """Drop a request in any state, freeing its blocks at once; None if the id is unknown."""
        request = self._requests.get(request_id)
        if request is not None:
            self._remove(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Retire a request the engine found finished. A request that is no longer tracked
        (e.g. aborted while its step was running) is left as it is."""
        if not status.finished:
            raise ValueError(f"finish_request needs a finished status, got {status}.")
        if self._requests.get(request.request_id) is request:
            self._remove(request, status)

    def _remove(self, request: Request, status: RequestStatus) -> None:
        del self._requests[request.request_id]
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        request.status = status

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV blocks."""
        out = SchedulerOutput(requests=[], num_new_tokens=[], start_positions=[], preempted=[])
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager

        # Running requests first, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget,
                          self.max_model_len - request.num_computed_tokens)
            if num_new <= 0:  # nothing known to compute until the engine appends a token
                i += 1
                continue
            if not self._allocate_or_preempt(request, num_new, out.preempted):
                break  # `request` preempted itself: it was the last running one.
            self._add_to_output(out, request, num_new)
            budget -= num_new
            i += 1

        # Then waiting requests, FCFS, unless this step had to preempt.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - request.num_computed_tokens,
                          self.max_model_len - request.num_computed_tokens)
            # Without chunked prefill a prompt runs whole; only a resumed request longer
            # than the entire budget (prompt + outputs) is split, the one way it can progress.
            if ((not self.config.enable_chunked_prefill and budget < num_new <= self.config.max_num_batched_tokens)
                    or not kv.allocate_slots(request, min(num_new, budget))):
                self._release_prefix_hit(request)
                break
            num_new = min(num_new, budget)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_to_output(out, request, num_new)
            budget -= num_new
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             preempted: list[Request]) -> bool:
        """Allocate ``request``'s blocks, preempting the newest running requests until it
        fits; False if ``request`` itself had to go. Victims come from the end of
        ``running``, so none was already scheduled in this step."""
        while not self.kv_cache_manager.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _release_prefix_hit(self, request: Request) -> None:
        """Undo ``get_computed_blocks`` for a request that stays waiting this step."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    @staticmethod
    def _add_to_output(out: SchedulerOutput, request: Request, num_new: int) -> None:
        out.requests.append(request)
        out.num_new_tokens.append(num_new)
        out.start_positions.append(request.num_computed_tokens)
        request.num_computed_tokens += num_new
