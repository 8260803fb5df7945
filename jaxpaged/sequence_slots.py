"""The runner's persistent batch: per-sequence rows of step inputs, kept across steps.

Every sequence the runner has seen and not yet released holds a slot: a row of numpy arrays
(its sampling parameters, the row it last sampled at) written when the sequence arrives and
gathered by slot each step, so building a step's arrays costs no Python work per sequence and
parameter.

The block tables' device rows belong to a ``BlockTable`` kept alongside (``block_table``): the
slots register their requests' tables with it and release them.
"""

from __future__ import annotations

import numpy as np

from jaxpaged.block_table import BlockTable
from jaxpaged.math_utils import SEED_MASK
from jaxpaged.request import Request
from jaxpaged.scheduler_output import TableChange


class SequenceSlots:
    """One slot per live sequence (grown by doubling), and the ``BlockTable`` of their tables."""

    def __init__(self, block_table: BlockTable, capacity: int = 64, vocab_size: int = 2**31 - 1) -> None:
        """``vocab_size``: a ``top_k`` at least this means all tokens (written as 0, off), as in vLLM;
        by default the largest int32, the most the row holds."""
        self.block_table = block_table
        block_table.grow(capacity)
        self._vocab_size = vocab_size
        self._slot: dict[str, int] = {}
        self._last: tuple[list[Request], np.ndarray] = ([], np.zeros(0, np.int32))
        """The last ``slots`` call (a tuple: ``_grow`` resizes only the per-slot arrays)."""
        self._free = list(range(capacity - 1, -1, -1))  # popped from the end: lowest first
        self.temperature = np.zeros(capacity, np.float32)
        self.top_k = np.zeros(capacity, np.int32)
        self.top_p = np.ones(capacity, np.float32)
        self.min_p = np.zeros(capacity, np.float32)
        self.presence = np.zeros(capacity, np.float32)
        self.frequency = np.zeros(capacity, np.float32)
        self.repetition = np.ones(capacity, np.float32)
        self.seed = np.zeros(capacity, np.uint64)
        self.logprobs = np.full(capacity, -1, np.int32)
        """Top logprobs the sequence asks for per token (-1: none)."""
        self.chosen_logprobs = np.zeros(capacity, bool)
        """Its sampled tokens' logprobs are computed (``SamplingParams.needs_logprobs``)."""
        self.needs_host_lists = np.zeros(capacity, bool)
        """Penalties, logit bias or min_tokens: per-step lists built from the request itself."""
        self.prompt_logprobs = np.zeros(capacity, bool)
        """The sequence scores its prompt positions (``SamplingParams.prompt_logprobs``)."""
        self.last_sample_row = np.full(capacity, -1, np.int32)
        """The sampled row of the sequence in the last launched step that sampled it."""
        self.failed: dict[str, Exception] = {}
        """Requests whose step inputs could not be built, and why (``take_failed``)."""

    def __len__(self) -> int:
        return len(self._slot)

    def _grow(self) -> None:
        old = self.temperature.shape[0]
        for name, a in vars(self).items():
            if isinstance(a, np.ndarray):
                grown = np.zeros((2 * old,) + a.shape[1:], a.dtype)
                grown[:old] = a
                setattr(self, name, grown)
        self._free.extend(range(2 * old - 1, old - 1, -1))
        self.block_table.grow(old)

    def slot(self, r: Request) -> int:
        """The request's slot, filling a new one from the request if it has none."""
        s = self._slot.get(r.request_id)
        if s is not None:
            return s
        if not self._free:
            self._grow()
        s = self._free.pop()
        self._slot[r.request_id] = s
        self.block_table.add(s, r)
        try:
            self._write_sampling_row(s, r)
        except Exception as e:  # this request's failure, not the step's: see ``take_failed``
            self._write_neutral_row(s)
            self.failed[r.request_id] = e
        self.last_sample_row[s] = -1
        return s

    def _write_sampling_row(self, s: int, r: Request) -> None:
        """Slot ``s``'s sampling parameters, from the request's."""
        sp = r.sampling_params
        top_k = sp.top_k if 0 < sp.top_k < self._vocab_size else 0
        self.temperature[s], self.top_k[s], self.top_p[s], self.min_p[s] = (
            sp.temperature,
            top_k,
            sp.top_p,
            sp.min_p,
        )
        self.presence[s], self.frequency[s], self.repetition[s] = (
            sp.presence_penalty,
            sp.frequency_penalty,
            sp.repetition_penalty,
        )
        self.seed[s] = r.seed & SEED_MASK
        self.logprobs[s] = -1 if sp.logprobs is None else sp.logprobs
        self.chosen_logprobs[s] = sp.needs_logprobs
        self.needs_host_lists[s] = sp.needs_step_lists
        self.prompt_logprobs[s] = r.prompt_logprobs is not None

    def _write_neutral_row(self, s: int) -> None:
        """Greedy, no penalties, no logprobs: the row of a failed request, which still runs its step."""
        self.temperature[s], self.top_k[s], self.top_p[s], self.min_p[s] = 0.0, 0, 1.0, 0.0
        self.presence[s], self.frequency[s], self.repetition[s], self.seed[s] = 0.0, 0.0, 1.0, 0
        self.logprobs[s] = -1
        self.chosen_logprobs[s] = self.needs_host_lists[s] = self.prompt_logprobs[s] = False

    def take_failed(self) -> dict[str, Exception]:
        """The requests whose step inputs failed to build since the last call, and why. Their rows
        still run (neutral: ``_write_neutral_row``), as the scheduler gave them this step and its prefix
        cache expects their KV; the engine finishes them with an error and drops what they sample."""
        failed, self.failed = self.failed, {}
        return failed

    def slots(self, reqs: list[Request]) -> np.ndarray:
        """The requests' slots. A steady decode batch repeats the previous step's requests: that
        list compares equal by identity in C and its slots are reused (a slot lives as long as its
        request, so an equal list has the same slots). The list is copied: a caller may reuse it."""
        if reqs != self._last[0]:
            self._last = list(reqs), np.fromiter(map(self.slot, reqs), np.int32, len(reqs))
        return self._last[1]

    def update(self, changed: list[TableChange], released: list[str]) -> bool:
        """Forget released sequences, then feed the changed tables to the ``BlockTable`` (``BlockTable.update``):
        returns whether every change of a sequence with a slot was a growth."""
        for rid in released:
            s = self._slot.pop(rid, None)
            if s is not None:
                self._free.append(s)
                self.block_table.remove(s)
        return self.block_table.update(changed, self._slot)
