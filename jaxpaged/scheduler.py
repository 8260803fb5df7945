"""Continuous-batching scheduler: which requests run this step, and how many tokens each.

Pure Python (no jax, no numpy), vLLM V1 style. There is no prefill/decode phase: each
request has ``num_tokens`` known tokens of which ``num_computed_tokens`` are in the KV
cache, and a step computes the next ``num_new_tokens`` of them for every scheduled
request. A long prompt is therefore split across steps (chunked prefill) and mixed with
decodes in one step. ``num_computed_tokens`` advances at schedule time; a request whose
step reaches its last known token samples one, which counts as known at once (an output
placeholder): with async scheduling the next step is scheduled before the engine has
appended it, and the model reads its id on the device.

When the KV pool runs dry the newest running request is preempted and resumes before
later arrivals: by recomputation (blocks freed, ``num_computed_tokens`` reset to 0), or with
``preemption_mode="swap"`` by moving its blocks to a host page pool, to be copied back when
there is room (recomputation if the host pool is full). The oldest running request is never
the victim, so it always progresses: no deadlock, no starvation.

Sequences share blocks: a request with ``pending_forks`` (the other samples of an ``n > 1``
request) forks them in the step that computes its last prompt token; they join the running
queue sharing its blocks, and the runner samples each one's first token from the parent's
logits row (``SchedulerOutput.forks``). The engine forks beams with ``fork_request``. A
request that shares a partly filled block copies it on its first write (``blocks_to_copy``).
A running request can also be *idle*: all its tokens computed while the engine waits for the
rest of its beam group; idle requests are preempted first when nothing else can run.

Fair share: the prompts of one API request take turns with other requests' (start-time fair queueing),
and a new API request may preempt running requests of one running many to start at once
(``jaxpaged/fair_share.py``).

Multi-step scheduling (``num_scheduler_steps`` > 1): ``schedule`` first tries a group of several decode
steps per running request (``jaxpaged/multi_step_plan.py``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from jaxpaged.config import SchedulerConfig
from jaxpaged.engine_base import request_id_in_use
from jaxpaged.fair_share import newcomer_victims
from jaxpaged.kv_cache_manager import KVCacheManager
from jaxpaged.multi_step_plan import plan_steps
from jaxpaged.request import Request, RequestStatus
from jaxpaged.scheduler_output import SchedulerOutput


class Scheduler:
    """Owns the waiting and running queues and every live request's KV blocks.

    ``running`` is in admission order (under the ``priority`` policy, in priority order, then
    admission order): the last one is the preemption victim. ``waiting`` is in the order requests
    run (``_queue_key``). Others read them, never mutate.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self._requests: dict[str, Request] = {}
        self.swap = config.preemption_mode == "swap"
        self.by_priority = config.scheduling_policy == "priority"
        self._virtual_time = 0
        """The largest queue tag admitted so far (``add_requests``)."""
        self._num_groups = 0
        """Multi-sequence API requests queued so far (``queue_group`` numbers them)."""
        self._num_grouped = 0
        """Live requests of such API requests: only they can run several for one API request."""
        self.num_preemptions = 0
        self.num_swapped_out = 0
        """Preemptions that swapped (the rest recomputed)."""
        self._finished_ids: list[str] = []

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
        self.add_requests([request])

    def add_requests(self, requests: Sequence[Request]) -> None:
        """Queue the prompts of one API request, taking turns with other requests' (see the module's
        docstring); or none of them, raising ``ValueError`` (leaving no trace), if one can never run."""
        self._check_unused_ids(requests)
        for request in requests:
            self._check_admissible(request)
        group = 0  # one sequence: a group of its own
        if len(requests) > 1 or any(r.pending_forks for r in requests):
            group = self._num_groups = self._num_groups + 1
        tag = self._virtual_time
        for request in requests:
            request.status = RequestStatus.WAITING
            request.queue_tag = tag
            tag += 1 + request.reserved_seqs  # a turn lasts as many tags as it runs sequences
            for r in (request, *request.pending_forks):
                r.queue_group = group
            self._track(request)
            self._enqueue(request)

    def _track(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._num_grouped += request.queue_group > 0

    @staticmethod
    def _queue_key(request: Request) -> tuple[int, bool, int]:
        """Waiting requests run in this key's order: priority (0 unless the ``priority`` policy),
        resumed (preempted) requests before new ones, then the fair-queueing tag."""
        return request.priority, request.status is not RequestStatus.PREEMPTED, request.queue_tag

    def _enqueue(self, request: Request) -> None:
        """Insert ``request`` into ``waiting`` behind every request whose key is not larger (a new
        one usually goes last: the scan from the back is short)."""
        key, waiting = self._queue_key(request), self.waiting
        i = len(waiting)
        while i and self._queue_key(waiting[i - 1]) > key:
            i -= 1
        waiting.insert(i, request)

    def fork_request(self, parent: Request, child: Request) -> None:
        """Track ``child``, a copy of ``parent``'s sequence plus tokens of its own (the engine's
        beams). If the parent runs and a running slot is free the child shares its blocks and
        runs; otherwise it waits to compute its sequence from scratch, ahead of new arrivals."""
        self._check_unused_ids([child])
        child.queue_group = parent.queue_group
        self._track(child)
        room = len(self.running) + self._num_reserved() < self.config.max_num_seqs
        if (
            parent.status is RequestStatus.RUNNING
            and self._requests.get(parent.request_id) is parent
            and room
        ):
            self.kv_cache_manager.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            self._sort_running()
        else:
            child.num_computed_tokens = 0
            child.status = RequestStatus.PREEMPTED
            if self.by_priority:
                self._enqueue(child)
            else:
                self.waiting.appendleft(child)

    def _sort_running(self) -> None:
        """Under the ``priority`` policy, ``running`` in priority order (a stable sort keeps admission order
        within a priority), so the lowest-priority request, last, is the preemption victim."""
        if self.by_priority:
            self.running.sort(key=_priority)

    def _num_reserved(self) -> int:
        return sum(r.reserved_seqs for r in self.running)

    def _check_unused_ids(self, requests: Sequence[Request]) -> None:
        """The scheduler's request-id rule, for every caller (``add_requests``, ``fork_request``): the ids of
        ``requests`` and of their pending forks are all different, and none is a tracked request's."""
        ids = [i for r in requests for i in (r.request_id, *(c.request_id for c in r.pending_forks))]
        if len(set(ids)) != len(ids):
            raise ValueError(
                f"request ids {sorted({i for i in ids if ids.count(i) > 1})[:5]} are given twice; "
                f"give each request a unique id."
            )
        for r in requests:
            if r.request_id in self._requests or any(c.request_id in self._requests for c in r.pending_forks):
                raise request_id_in_use(r.request_id)

    def _check_admissible(self, request: Request) -> None:
        """What only the scheduler knows: the request's sequences fit ``max_num_seqs`` (a beam search's
        width is checked nowhere else) and its longest sequence fits the KV pool. The prompt's own checks
        (not empty, within ``max_model_len`` with ``max_tokens``) are the engine's ``InputProcessor``'s;
        with chunked prefill off the engine's budget holds ``max_model_len`` (``plan_kv_cache``)."""
        rid = request.request_id
        if 1 + request.reserved_seqs > self.config.max_num_seqs:
            raise ValueError(
                f"request {rid!r} runs {1 + request.reserved_seqs} sequences at once (n, best_of "
                f"or beam width) but max_num_seqs is {self.config.max_num_seqs}; raise "
                f"max_num_seqs or ask for fewer sequences."
            )
        total = request.num_prompt_tokens + request.max_tokens
        kv = self.kv_cache_manager
        needed = kv.blocks_needed(total)
        if needed > kv.pool.num_usable_blocks:
            raise ValueError(
                f"request {rid!r}: prompt + max_tokens = {total} tokens needs {needed} KV blocks of "
                f"{kv.block_size} tokens but the pool has only {kv.pool.num_usable_blocks}; shorten "
                f"the prompt, lower max_tokens, or give the KV cache more blocks (kv_cache_memory "
                f"or num_gpu_blocks_override)."
            )

    def reject_draft_tokens(self, request: Request, num_rejected: int) -> None:
        """Roll back the KV positions of a verifying row's rejected drafts: they are computed again, as the
        tokens sampled there, by later steps (their blocks stay with the request, which reuses them)."""
        request.num_computed_tokens -= num_rejected

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
        self._num_grouped -= request.queue_group > 0
        self._finished_ids.append(request.request_id)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        request.status = status

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV blocks."""
        num_steps = self.config.num_scheduler_steps
        victims = self._victims_for_newcomer()
        if (
            num_steps > 1
            and not victims
            and (not self.waiting or len(self.running) + self._num_reserved() >= self.config.max_num_seqs)
        ):
            out = plan_steps(
                self.running, self.kv_cache_manager, num_steps, self.config.max_num_batched_tokens
            )
            if out is not None:
                return self._close(out)
        out = SchedulerOutput(requests=[], num_new_tokens=[], start_positions=[], preempted=[])
        for victim in victims:  # queued right behind the new request, which starts next step
            self.running.remove(victim)
            self._preempt(victim, out, at=1)
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager
        forked: list[Request] = []

        # Running requests first, in admission order. The hot path of a decode step, so the common
        # case is inlined: one token to compute in a block of its own, nothing to fork. A position
        # inside a block (not at a block's start) is in the block of the token before it, allocated
        # already, and only a fork (``shared_tails``) could have shared that block since. Rows that open
        # a new block take it in one allocation for all of them (``opening``), before any other.
        # A fast row appends to three of the output's lists; the entries it would add to
        # ``num_new_tokens`` (1) and ``samples`` (True) are added in bulk (``_fill_fast_rows``) before
        # the next other row and at the end. Preemption pops rows from the end of ``running``, after
        # the one being scheduled, which the loop then never reaches.
        running, max_len, block_size = self.running, self.max_model_len, kv.block_size
        allocate, add, shared_tails = kv.allocate_slots, self._add_to_output, kv.shared_tails
        add_row, add_start, add_host = (
            out.requests.append,
            out.start_positions.append,
            out.num_host_tokens.append,
        )
        opening: list[Request] = []
        room = kv.num_free_blocks
        for request in running:
            if budget <= 0:
                break
            computed = request.num_computed_tokens
            in_flight = request.num_output_placeholders
            num_outputs = len(request.output_token_ids) + in_flight
            known = request.num_prompt_tokens + num_outputs
            fast = (
                known - computed == 1
                and num_outputs < request.max_tokens
                and not request.pending_forks
                and not (shared_tails and request.request_id in shared_tails)
                and not request.spec_token_ids
            )
            if fast and not computed % block_size and len(request.block_ids) * block_size <= computed:
                fast = room > 0
                if fast:
                    room -= 1
                    opening.append(request)
            if fast:
                # _add_to_output for one token that samples, with no forks. Within max_model_len:
                # known < prompt + max_tokens.
                request.num_computed_tokens = computed + 1
                request.num_output_placeholders = in_flight + 1
                add_row(request)
                add_start(computed)
                add_host(0 if in_flight else 1)  # the one token is the last known one
                budget -= 1
                continue
            num_new = min(known - computed, budget, max_len - computed)
            # Nothing known to compute until the engine appends a token, or its last token is in flight.
            if num_new <= 0 or request.all_outputs_sampled:
                continue
            if opening:
                kv.grow_tables(opening)
                opening.clear()
            drafts = request.spec_token_ids
            if drafts:
                # Its last token and as many drafts as fit, if their blocks are free: drafts never preempt.
                with_drafts = min(num_new + len(drafts), budget, max_len - computed)
                if with_drafts > num_new and allocate(request, with_drafts):
                    room = kv.num_free_blocks
                    self._fill_fast_rows(out)
                    add(out, request, with_drafts, forked, known)
                    out.spec_token_ids[len(out.requests) - 1] = list(drafts[: with_drafts - num_new])
                    out.num_host_tokens[-1] = with_drafts
                    budget -= with_drafts
                    continue
            if not allocate(request, num_new) and not self._preempt_for(request, num_new, out):
                break  # `request` preempted itself: it was the last running one.
            room = kv.num_free_blocks
            self._fill_fast_rows(out)
            add(out, request, num_new, forked, known)
            budget -= num_new
        kv.grow_tables(opening)
        self._fill_fast_rows(out)

        # Then waiting requests, in queue order, unless this step had to preempt. A preempted beam waiting
        # for the rest of its group has nothing to compute yet and is passed over.
        j, admitted = 0, False
        had_to_preempt = bool(out.preempted)
        reserved = self._num_reserved() if self.waiting and not had_to_preempt else 0
        while not had_to_preempt and j < len(self.waiting) and budget > 0:
            request = self.waiting[j]
            if request.waiting_for_group or request.num_output_placeholders:
                j += 1
                continue
            if (
                len(self.running) + len(forked) + reserved + 1 + request.reserved_seqs
                > self.config.max_num_seqs
            ):
                break
            swapped = bool(request.host_block_ids)
            if not swapped:
                kv.get_computed_blocks(request)
            num_new = min(
                request.num_tokens_with_placeholders - request.num_computed_tokens,
                self.max_model_len - request.num_computed_tokens,
            )
            if num_new <= 0:
                j += 1
                continue
            # Without chunked prefill a prompt runs whole; only a resumed request longer
            # than the entire budget (prompt + outputs) is split, the one way it can progress.
            fits = not (
                not self.config.enable_chunked_prefill
                and budget < num_new <= self.config.max_num_batched_tokens
            )
            if fits and swapped:
                pairs = kv.swap_in(request, min(num_new, budget))
                fits = pairs is not None
                if fits:
                    out.blocks_to_swap_in.extend(pairs)
            elif fits:
                fits = kv.allocate_slots(request, min(num_new, budget))
            if not fits:
                if not swapped:
                    self._release_prefix_hit(request)
                # Nothing can run at all: idle running requests hold the blocks, so they make room.
                if not out.requests and self._preempt_idle(out, behind=j):
                    continue
                break
            num_new = min(num_new, budget)
            del self.waiting[j]
            self._virtual_time = max(self._virtual_time, request.queue_tag)
            admitted = True
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            self.running.append(request)
            self._add_to_output(out, request, num_new, forked, request.num_tokens_with_placeholders)
            reserved += request.reserved_seqs  # what is left after forking this step
            budget -= num_new
        self.running.extend(forked)
        if admitted or forked:
            self._sort_running()
        return self._close(out)

    @staticmethod
    def _fill_fast_rows(out: SchedulerOutput) -> None:
        """The ``num_new_tokens`` and ``samples`` entries of the fast rows ``schedule`` added last."""
        missing = len(out.requests) - len(out.samples)
        if missing:
            out.num_new_tokens += [1] * missing
            out.samples += [True] * missing

    def _close(self, out: SchedulerOutput) -> SchedulerOutput:
        """Hand the block manager's queued copies and table changes, and the requests that left, to ``out``."""
        kv = self.kv_cache_manager
        out.blocks_to_copy = kv.take_blocks_to_copy()
        out.block_table_updates = kv.take_changed_tables()
        out.finished_request_ids, self._finished_ids = self._finished_ids, []
        return out

    def _victims_for_newcomer(self) -> list[Request]:
        """``newcomer_victims`` of the queues, when some API request runs several sequences (else none)."""
        if not self._num_grouped or not self.waiting:
            return []
        return newcomer_victims(self.running, self.waiting[0], self.config.max_num_seqs, self._num_reserved())

    def _preempt_for(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running requests until ``request``'s blocks can be allocated (and
        allocate them); False if ``request`` itself had to go. Victims come from the end of
        ``running``, so none was already scheduled in this step."""
        while not self.kv_cache_manager.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt_idle(self, out: SchedulerOutput, behind: int) -> bool:
        """Preempt the newest idle running request (all its tokens computed, waiting for the
        engine: its beam group), queueing it right behind ``waiting[behind]``, the request it makes
        room for; False if there is none. A request with a token in flight is not idle."""
        for i in range(len(self.running) - 1, -1, -1):
            r = self.running[i]
            if r.num_computed_tokens >= r.num_tokens_with_placeholders and r.block_ids:
                del self.running[i]
                self._preempt(r, out, at=behind + 1)
                return True
        return False

    def _release_prefix_hit(self, request: Request) -> None:
        """Undo ``get_computed_blocks`` for a request that stays waiting this step."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0

    def _preempt(self, request: Request, out: SchedulerOutput, at: int | None = None) -> None:
        """Free (or swap out) ``request``'s blocks and queue it at ``at``, by default first (under the
        ``priority`` policy: first of its priority)."""
        # A request whose last token is in flight will finish when it arrives: its blocks are freed, never swapped.
        pairs = (
            self.kv_cache_manager.swap_out(request) if self.swap and not request.all_outputs_sampled else None
        )
        if pairs is not None:
            out.blocks_to_swap_out.extend(pairs)
            self.num_swapped_out += 1
        else:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        if at is not None:
            self.waiting.insert(at, request)
        elif self.by_priority:
            self._enqueue(request)
        else:
            self.waiting.appendleft(request)
        out.preempted.append(request)

    def _add_to_output(
        self, out: SchedulerOutput, request: Request, num_new: int, forked: list[Request], known: int
    ) -> None:
        """Schedule ``num_new`` tokens of ``request``, which has ``known`` tokens (placeholders included)."""
        row = len(out.requests)
        out.requests.append(request)
        out.num_new_tokens.append(num_new)
        start = request.num_computed_tokens
        out.start_positions.append(start)
        out.num_host_tokens.append(min(max(request.num_tokens - start, 0), num_new))
        request.num_computed_tokens = start + num_new
        samples = start + num_new >= known
        out.samples.append(samples)
        if not samples:
            return
        request.num_output_placeholders += 1
        if request.pending_forks:
            # The prompt is computed: its other samples share its blocks from now on, and
            # draw their first tokens from this row's logits.
            for child in request.pending_forks:
                self.kv_cache_manager.fork(request, child)
                child.status = RequestStatus.RUNNING
                child.num_output_placeholders += 1
                self._track(child)
                out.forks.append((row, child))
                forked.append(child)
            request.reserved_seqs = max(0, request.reserved_seqs - len(request.pending_forks))
            request.pending_forks = ()


def _priority(request: Request) -> int:
    return request.priority
