"""Speculative decoding's counters, engine-wide, under vLLM's ``spec_decode_*`` meanings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Cumulative since the engine started: verifying rows (``num_drafts``: one per request and step that
    checked drafts), drafted and accepted tokens, and accepted tokens by draft position (position 0 is
    the first draft of a row)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verifying row: ``num_draft_tokens`` drafts checked, the first ``num_accepted`` kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying row emits on average: its accepted drafts plus the one it samples (vLLM's
        "mean acceptance length"); 0 before any."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )

    def __add__(self, other: SpecDecodingStats) -> SpecDecodingStats:
        """The sum of two engines' counters (data parallelism)."""
        return self._combined(other, 1)

    def __sub__(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """What was counted since ``earlier``, a copy of these counters taken before."""
        return self._combined(earlier, -1)

    def _combined(self, other: SpecDecodingStats, sign: int) -> SpecDecodingStats:
        a, b = self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos
        return SpecDecodingStats(
            self.num_drafts + sign * other.num_drafts,
            self.num_draft_tokens + sign * other.num_draft_tokens,
            self.num_accepted_tokens + sign * other.num_accepted_tokens,
            [
                (a[i] if i < len(a) else 0) + sign * (b[i] if i < len(b) else 0)
                for i in range(max(len(a), len(b)))
            ],
        )
