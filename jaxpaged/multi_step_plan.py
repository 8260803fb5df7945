"""Multi-step scheduling (``num_scheduler_steps`` = k > 1, vLLM's): when every running request is a
plain decode that may run several steps (``Request.multi_step``) and no waiting request could be
admitted, one schedule hands out a group of up to k decode steps per request, run as one program;
its KV blocks are allocated up front, so the group needs no scheduling between its steps.

This module plans such a group (``plan_steps``); ``Scheduler.schedule`` tries it first.
"""

from __future__ import annotations

from jaxpaged.kv_cache_manager import KVCacheManager
from jaxpaged.request import Request
from jaxpaged.scheduler_output import SchedulerOutput


def plan_steps(
    running: list[Request], kv: KVCacheManager, k: int, max_num_batched_tokens: int
) -> SchedulerOutput | None:
    """A multi-step decode batch (vLLM's multi-step scheduling): each running request decodes
    ``min(k, outputs left)`` tokens in one program, its blocks for all of them allocated now.
    None, changing nothing, unless every running request is a plain decode that may run several
    steps (``Request.multi_step``: no forks to make, no per-step sampling lists, not a beam) and
    the pool holds every block they need. A request whose last output is in flight sits out."""
    if len(running) > max_num_batched_tokens:
        return None
    block_size, shared_tails = kv.block_size, kv.shared_tails
    rows, steps, need = [], [], 0
    for request in running:
        computed = request.num_computed_tokens
        outputs = len(request.output_token_ids) + request.num_output_placeholders
        left = request.max_tokens - outputs
        if left <= 0:
            continue
        if (
            not request.multi_step
            or request.pending_forks
            or request.spec_token_ids
            or request.num_prompt_tokens + outputs - computed != 1
        ):
            return None
        n = k if k < left else left
        # As in Scheduler.schedule(): only a fork shares the block a request writes next.
        if shared_tails and request.request_id in shared_tails:
            need += kv.blocks_to_allocate(request, n)
        else:
            # cdiv inline: no call per row in the step's loop
            need += max(0, -(-(computed + n) // block_size) - len(request.block_ids))
        rows.append(request)
        steps.append(n)
    if not rows or need > kv.num_free_blocks:
        return None
    if min(steps) < k:
        # Rows with the most steps first: each step then computes a prefix of the rows.
        order = sorted(range(len(rows)), key=steps.__getitem__, reverse=True)
        rows, steps = [rows[i] for i in order], [steps[i] for i in order]
    starts, host_tokens, opening = [], [], []
    for request, n in zip(rows, steps):
        computed, in_flight = request.num_computed_tokens, request.num_output_placeholders
        if shared_tails and request.request_id in shared_tails:
            kv.allocate_slots(request, n)  # cannot fail: ``need`` blocks are free
        elif computed + n > len(request.block_ids) * block_size:
            opening.append(request)
        starts.append(computed)
        host_tokens.append(0 if in_flight else 1)
        request.num_computed_tokens = computed + n
        request.num_output_placeholders = in_flight + n
    kv.grow_tables(opening)
    return SchedulerOutput(
        requests=rows,
        num_new_tokens=steps,
        start_positions=starts,
        preempted=[],
        samples=[True] * len(rows),
        num_host_tokens=host_tokens,
        num_steps=k,
    )
