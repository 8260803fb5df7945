"""Fair share between API requests: the scheduler's queueing order and its preemption for a newcomer.

Fair share: the prompts of one API request are queued together (``add_requests``) and take turns
with other requests' (start-time fair queueing): each gets a start tag, the virtual time (the largest
tag admitted so far) plus the sequences of the group's prompts before it, and waiting requests run in
tag order, resumed (preempted) ones first. A request of 400 prompts then runs one prompt (of ``n``
sequences) per turn, and the request sent after it runs on the next free slot instead of after all
400. Single-prompt requests all get the current virtual time: first come, first served. And when
every running slot is taken and the next waiting request is a new one whose API request has nothing
running, the newest running requests of the API request running the most (keeping it one) are
preempted to make room, queued right behind it: it starts in the next step, not once one of them
finishes (round-robin alone leaves it waiting for a slot). With the ``priority`` scheduling policy (vLLM's) the priority
comes first (lower sooner; such preemption only takes requests of a priority no higher), and
``running`` is kept in priority order, so the lowest-priority request is the one preempted for KV blocks.
"""

from __future__ import annotations

from collections import Counter

from jaxpaged.request import Request, RequestStatus


def newcomer_victims(
    running: list[Request], head: Request, max_num_seqs: int, num_reserved: int
) -> list[Request]:
    """The running requests to preempt so that ``head``, the next waiting request, starts, when it is new,
    every running slot is taken and its API request has nothing running (else none; a scan of
    ``running`` only then): the newest of the API requests running the most, keeping each one
    running and taking none of a higher priority; none if that cannot free enough slots. ``num_reserved``:
    the slots running requests keep for their future forks."""
    if len(running) + num_reserved < max_num_seqs:
        return []
    if head.status is not RequestStatus.WAITING or (
        head.queue_group and any(r.queue_group == head.queue_group for r in running)
    ):
        return []
    need = 1 + head.reserved_seqs - (max_num_seqs - len(running) - num_reserved)
    candidates = [r for r in running if r.queue_group and r.priority >= head.priority and not r.reserved_seqs]
    counts = Counter(r.queue_group for r in candidates)
    if need > sum(n - 1 for n in counts.values()):
        return []
    victims = []
    for _ in range(need):
        group = max(counts, key=counts.__getitem__)
        counts[group] -= 1
        victims.append(next(r for r in reversed(candidates) if r.queue_group == group and r not in victims))
    return victims
