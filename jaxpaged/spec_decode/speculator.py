"""The engine's side of speculative decoding: which requests get drafts before a step, and what a
verified step taught about each (acceptance, back-off, the counters).

Drafts go on ``Request.spec_token_ids`` for one schedule: the scheduler gives such a decoding request
its last token plus the drafts as query tokens, the batch builder adds a sampled row per draft, the
output processor keeps the accepted prefix (``rejection``) and the scheduler rolls the rest back.
A request gets drafts only when all its tokens are on the host (the step before was taken in) and it is not
a beam (``speculates``). Each verifying row samples with the request's parameters; penalty counts, the
``min_tokens`` mask and the grammar's mask count the drafts before its position as output
(``sampling_inputs``); a constrained request's drafts are cut where its grammar would refuse one.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from jaxpaged.request import Request, RequestStatus
from jaxpaged.spec_decode.metrics import SpecDecodingStats
from jaxpaged.speculative_config import SpeculativeConfig

ACCEPTANCE_WINDOW = 16
"""Drafted tokens over which a request's acceptance rate is judged (``min_acceptance_rate``)."""
PROBE_WINDOW = 32
"""Running requests a probe looks drafts up for per step, a window rotating over them: bounds its host work
in a large batch."""


def speculates(r: Request) -> bool:
    """Whether ``r`` may verify drafts: any sample but a beam (a beam has fixed sampler inputs, so it is not
    ``multi_step`` only for being one)."""
    return r.multi_step or r.sampling_params.needs_step_lists


class Proposer(Protocol):
    def propose_many(self, requests: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        """At most ``ks[i]`` draft tokens to follow each request's tokens."""
        ...

    def has_drafts(self, requests: Sequence[Request]) -> bool:
        """Whether some request would likely get drafts (judged on the tokens the host has)."""
        ...

    def forget(self, request_id: str) -> None: ...


class Speculator:
    """Owns each request's speculation state (its window of drafted/accepted tokens and its back-off)
    and the engine-wide ``SpecDecodingStats``."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int):
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats()
        self.wants_sync = False
        """The next step should run synchronously and verify drafts (some request would get some)."""
        self._window: dict[str, list[int]] = {}
        """Request id -> [drafted, accepted, steps to sit out] of its current window."""
        self._drafted: list[Request] = []
        self._probe_at = 0
        """Where the next probe's window starts in ``running``."""

    def _may_draft(self, r: Request) -> bool:
        """Whether ``r`` is a running sample that may verify drafts, with room for one (an output after the
        one it samples next) and no back-off to sit out (counting the step if it has one)."""
        return (
            r.status is RequestStatus.RUNNING
            and speculates(r)
            and not r.pending_forks
            and len(r.output_token_ids) + r.num_output_placeholders < r.max_tokens - 1
            and not self._sits_out(r)
        )

    def _draft_room(self, r: Request) -> int:
        """Drafts ``r`` may take now: 0 unless all its tokens are on the host, only its last one uncomputed,
        and ``_may_draft``; never past its last output token or ``max_model_len``."""
        if r.num_output_placeholders or r.num_computed_tokens != r.num_tokens - 1 or not self._may_draft(r):
            return 0
        left = r.max_tokens - len(r.output_token_ids) - 1  # the step samples one more token besides
        return max(0, min(self.config.num_speculative_tokens, left, self.max_model_len - r.num_tokens))

    def _sits_out(self, r: Request) -> bool:
        """Whether ``r`` sits this step out (its back-off), counting the step."""
        window = self._window.get(r.request_id)
        if window is None or not window[2]:
            return False
        window[2] -= 1
        return True

    def _by_batch_size(self, running: Sequence[Request]) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or len(running) < limit

    def propose(self, running: Sequence[Request]) -> None:
        """Drafts for the running requests that may take some (``spec_token_ids``), before a schedule."""
        self._drafted = []
        if not self._by_batch_size(running):
            self.wants_sync = False
            return
        reqs, ks = [], []
        for r in running:
            k = self._draft_room(r)
            if k:
                reqs.append(r)
                ks.append(k)
        drafts = self.proposer.propose_many(reqs, ks) if reqs else []
        for r, d in zip(reqs, drafts):
            # A constrained request keeps the drafts its grammar takes: its verifying rows' masks follow them.
            if d and r.grammar is not None:
                d = d[: r.grammar.num_valid(d)]
            if d:
                r.spec_token_ids = d
                self._drafted.append(r)
        self.wants_sync = bool(self._drafted)

    def probe(self, running: Sequence[Request]) -> None:
        """While steps run ahead (async scheduling, the last tokens in flight): whether the next step
        should wait and speculate, judged on the tokens the host has, for ``PROBE_WINDOW`` requests at most."""
        if not self._by_batch_size(running):
            self.wants_sync = False
            return
        if len(running) > PROBE_WINDOW:
            start = self._probe_at % len(running)
            self._probe_at = start + PROBE_WINDOW
            wrapped = max(0, start + PROBE_WINDOW - len(running))
            running = [*running[start : start + PROBE_WINDOW], *running[:wrapped]]
        reqs = [r for r in running if self._may_draft(r)]
        self.wants_sync = bool(reqs) and self.proposer.has_drafts(reqs)

    def clear_drafts(self) -> None:
        """Take the drafts back once the schedule has read them (a preempted request must not keep any)."""
        for r in self._drafted:
            r.spec_token_ids = ()
        self._drafted = []

    def record(self, r: Request, num_draft_tokens: int, num_accepted: int) -> None:
        """A verified row of ``r``: its counters, and a back-off when its window's acceptance was low."""
        self.stats.observe(num_draft_tokens, num_accepted)
        r.num_spec_draft_tokens += num_draft_tokens
        r.num_spec_accepted_tokens += num_accepted
        r.num_spec_verifications += 1
        window = self._window.setdefault(r.request_id, [0, 0, 0])
        window[0] += num_draft_tokens
        window[1] += num_accepted
        if window[0] >= ACCEPTANCE_WINDOW:
            low = window[1] < self.config.min_acceptance_rate * window[0]
            window[:] = [0, 0, ACCEPTANCE_WINDOW if low else 0]

    def forget_many(self, request_ids: Sequence[str]) -> None:
        """Drop the state of requests that left the scheduler."""
        for request_id in request_ids:
            self._window.pop(request_id, None)
            self.proposer.forget(request_id)
