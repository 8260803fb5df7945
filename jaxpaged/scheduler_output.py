"""The data objects the scheduler hands the runner: one step's work and the block tables that changed.

A module of its own so the arrows run one way: the KV-cache manager, the scheduler, the block table and
the runner import these; none of them imports another to read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from jaxpaged.request import Request


class TableChange(NamedTuple):
    """A request whose block table changed: entries from ``first`` on are new (or gone)."""

    request: Request
    first: int


@dataclass
class SchedulerOutput:
    """One step's work: ``requests[i]`` computes tokens
    ``[start_positions[i], start_positions[i] + num_new_tokens[i])``."""

    requests: list[Request]
    num_new_tokens: list[int]
    start_positions: list[int]
    preempted: list[Request]
    samples: list[bool] = field(default_factory=list)
    """Whether ``requests[i]`` samples a token this step (its step reaches its last known token)."""
    num_host_tokens: list[int] = field(default_factory=list)
    """How many of ``requests[i]``'s new tokens have their ids on the host; the rest (at most the
    last one) is a token sampled by the step in flight, read on the device."""
    block_table_updates: list[TableChange] = field(default_factory=list)
    """Block tables changed since the previous schedule, and from where (the runner's ``BlockTable`` follows them)."""
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that left the scheduler (finished, aborted) since the previous schedule."""
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) copy-on-write block pairs, copied on device before the step."""
    forks: list[tuple[int, Request]] = field(default_factory=list)
    """(row, child): each child samples its first token from row ``row``'s logits, after the
    ``requests`` rows (the runner returns ``len(requests) + len(forks)`` samples)."""
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device block, host block) pairs copied to host before this step (before any other copy)."""
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(host block, device block) pairs copied to the device before this step."""
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    """Speculative decoding: row -> the draft tokens that row ``i`` verifies. Its new tokens are its last
    token and these; it samples after each of them (``verify_rows``) and after the last."""
    num_steps: int = 1
    """More than 1: a multi-step decode batch. Every row decodes one token per step for
    ``num_new_tokens[i]`` (at most ``num_steps``, never increasing along the rows) consecutive steps
    of one program, sampling each step; its first token is the one at ``start_positions[i]``."""

    def verify_rows(self) -> list[int]:
        """For each row of ``spec_token_ids``, in row order, the sampled row of its first draft: a verifying
        row's draft positions are sampled rows of their own, after the rows and the forks, in row order
        (its last position is its own row)."""
        first, firsts = len(self.requests) + len(self.forks), []
        for i in sorted(self.spec_token_ids):
            firsts.append(first)
            first += len(self.spec_token_ids[i])
        return firsts

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests
