"""The n-gram (prompt lookup) proposer: drafts copied from where a request's latest tokens occurred before.

Model-free and host-side. A request's tokens live in a numpy buffer of its own that grows by its new
tokens (``NgramProposer.propose`` is given the whole list, and copies only what it has not seen), so a
lookup is a few vectorized passes over the buffer, never a Python loop over the context.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxpaged.request import Request


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest suffix of ``tokens``
    (``min_n`` to ``max_n`` tokens long) that occurred before; empty if none did. The occurrence is the
    latest one followed by ``k`` tokens, else the earliest (a repeat whose period is under ``k`` then
    still proposes ``k`` tokens).

    Candidates are the positions ``e`` (before the last) holding the last token; each pass keeps
    those whose ``j``-th token back matches the suffix's, so the survivors of pass ``n - 1`` end an
    occurrence of the ``n``-token suffix.
    """
    L = len(tokens)
    if L < min_n + 1:
        return tokens[:0]
    ends = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])
    best = ends if min_n == 1 else ends[:0]
    for j in range(1, min(max_n, L - 1)):
        ends = ends[ends >= j]
        ends = ends[tokens[ends - j] == tokens[L - 1 - j]]
        if not len(ends):
            break
        if j + 1 >= min_n:
            best = ends
    if not len(best):
        return tokens[:0]
    full = best[best <= L - 1 - k]
    start = int(full[-1] if len(full) else best[0]) + 1
    return tokens[start : start + k]


class NgramProposer:
    """Drafts for many requests, each with its token buffer (``forget`` drops one)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._buffers: dict[str, tuple[np.ndarray, int]] = {}
        """Request id -> (buffer, tokens in it): the request's tokens so far, grown by doubling."""

    def propose_many(self, requests: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        """At most ``ks[i]`` draft tokens to follow each request's tokens."""
        return [
            self.propose(r.request_id, r.prompt_token_ids, r.output_token_ids, k)
            for r, k in zip(requests, ks)
        ]

    def has_drafts(self, requests: Sequence[Request]) -> bool:
        """Whether some request's tokens so far would give a draft."""
        return any(self.propose(r.request_id, r.prompt_token_ids, r.output_token_ids, 1) for r in requests)

    def propose(self, request_id: str, prompt: list[int], output: list[int], k: int) -> list[int]:
        """At most ``k`` (<= ``num_speculative_tokens``) draft tokens to follow ``prompt + output``."""
        buf, n = self._buffers.get(request_id, (None, 0))
        total = len(prompt) + len(output)
        if buf is None or n > total:  # new, or its output shrank (a recomputed beam): start over
            buf, n = np.empty(max(64, 2 * total), np.int32), 0
        if total > len(buf):
            grown = np.empty(2 * total, np.int32)
            grown[:n] = buf[:n]
            buf = grown
        if n < len(prompt):
            buf[n : len(prompt)] = prompt[n:]
            n = len(prompt)
        if n < total:
            buf[n:total] = output[n - len(prompt) :]
        self._buffers[request_id] = (buf, total)
        return find_ngram_draft(buf[:total], self.min_n, self.max_n, min(k, self.k)).tolist()

    def forget(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)
