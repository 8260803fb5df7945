"""The runner's persistent batch: per-sequence rows of step inputs, kept across steps.

Every sequence the runner has seen and not yet released holds a slot: a row of numpy arrays
(its sampling parameters, the row it last sampled at) written when the sequence arrives and
gathered by slot each step, so building a step's arrays costs no Python work per sequence and
parameter.

The block tables live on the device, as vLLM keeps them on the GPU: a fixed number of device
rows, one per sequence a step runs, updated by the entries that changed (a decode step opening
its next block changes one entry of its row). The step reads its rows' tables there, so the
host sends a row index per sequence instead of ``max_model_len / block_size`` entries (1024 at
SmolLM2's 8192 positions and block size 8). The host keeps no copy: only each table's length
as last reported (to tell a growth from a replacement); a whole table, written to a newly lent
row, is read from its request. Pure numpy: the runner owns the device array and applies the
writes this module queues (``take_table_writes``).
"""

from __future__ import annotations

import itertools

import numpy as np

from jaxpaged.kv_cache_manager import TableChange
from jaxpaged.request import Request

_SEED_MASK = (1 << 64) - 1


class SequenceSlots:
    """One slot per live sequence (grown by doubling), and ``num_device_rows`` rows of the
    device block tables (the only full copy) lent to the slots that steps run.

    A slot gets a device row when a step first runs it (``device_rows``), queueing a write of its
    whole table there, and keeps it until released; when all rows are lent, a step takes them
    from slots it does not run (a preempted sequence), which get a row again when they run.
    Entries of a device row past its sequence's blocks are stale, never zeroed: a step reads a
    row's table only up to its sequence length, and a stale entry is still a valid block id.
    """

    def __init__(self, max_blocks_per_seq: int, capacity: int = 64, num_device_rows: int = 0,
                 vocab_size: int = 2**31 - 1) -> None:
        """``vocab_size``: a ``top_k`` at least this means all tokens (written as 0, off), as in vLLM;
        by default the largest int32, the most the row holds."""
        self._max_blocks = max_blocks_per_seq
        self._vocab_size = vocab_size
        self._slot: dict[str, int] = {}
        self._owner: list[Request | None] = [None] * capacity
        """The request holding each slot: its ``block_ids`` are the table a newly lent row gets."""
        self.num_blocks = [0] * capacity
        """Each slot's table length as last reported (its device row holds that many entries)."""
        self._last: tuple[list[Request], np.ndarray] = ([], np.zeros(0, np.int32))
        """The last ``slots`` call (a tuple: ``_grow`` resizes only the per-slot arrays)."""
        self._free = list(range(capacity - 1, -1, -1))     # popped from the end: lowest first
        self.device_row = [-1] * capacity
        """Each slot's row of the device block tables (-1: none). A list: ``update`` reads it per
        changed table, and a numpy gather and mask of the grown rows cost ~50 us a step more at 256
        running once the device step has evicted the host's caches (measured)."""
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
        self._row_owner: list[int] = [-1] * num_device_rows
        """The slot holding each device row (-1: free). A list: ``_grow`` must not resize it."""
        self._free_rows = list(range(num_device_rows - 1, -1, -1))
        self._table_writes: list[np.ndarray] = []
        """Queued ``[3, n]`` (device row, column, block id) writes, in order."""
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
        self._owner += [None] * old
        self.num_blocks += [0] * old
        self.device_row += [-1] * old

    def slot(self, r: Request) -> int:
        """The request's slot, filling a new one from the request if it has none."""
        s = self._slot.get(r.request_id)
        if s is not None:
            return s
        if not self._free:
            self._grow()
        s = self._free.pop()
        self._slot[r.request_id] = s
        self._owner[s] = r
        self.num_blocks[s] = len(r.block_ids)
        try:
            self._write_sampling_row(s, r)
        except Exception as e:          # this request's failure, not the step's: see ``take_failed``
            self._write_neutral_row(s)
            self.failed[r.request_id] = e
        self.last_sample_row[s] = -1
        self.device_row[s] = -1
        return s

    def _write_sampling_row(self, s: int, r: Request) -> None:
        """Slot ``s``'s sampling parameters, from the request's."""
        sp = r.sampling_params
        top_k = sp.top_k if 0 < sp.top_k < self._vocab_size else 0
        self.temperature[s], self.top_k[s], self.top_p[s], self.min_p[s] = (
            sp.temperature, top_k, sp.top_p, sp.min_p)
        self.presence[s], self.frequency[s], self.repetition[s] = (
            sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty)
        self.seed[s] = r.seed & _SEED_MASK
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
        """Forget released sequences; queue the device writes of the changed block tables of the ones
        with slots. A table grown by appended blocks (a decode step opening its next block, the common
        change) costs their entries, one array for all of them; another change rewrites the whole
        table if the sequence holds a device row. Returns whether every change of a sequence with a
        slot was such a growth (no block it held replaced)."""
        for rid in released:
            s = self._slot.pop(rid, None)
            if s is not None:
                self._free.append(s)
                self._owner[s] = None
                self._drop_row(s)
        rows, cols, ids, replaced = [], [], [], []
        num_blocks, slot_of, device_row = self.num_blocks, self._slot, self.device_row
        for r, first in changed:
            s = slot_of.get(r.request_id)
            if s is None:
                continue
            block_ids = r.block_ids
            n = len(block_ids)
            grown = n > first == num_blocks[s]
            num_blocks[s] = n
            if not grown:
                replaced.append(s)
                continue
            # Entries appended (a decode step opens one; a multi-step group of more steps than a
            # block holds, several), written if the slot holds a device row.
            d = device_row[s]
            if d < 0:
                continue
            if n == first + 1:
                rows.append(d)
                cols.append(first)
                ids.append(block_ids[first])
            else:
                rows += [d] * (n - first)
                cols += range(first, n)
                ids += block_ids[first:]
        if rows:
            self._table_writes.append(np.array([rows, cols, ids], np.int32))
        held = [s for s in replaced if device_row[s] >= 0]
        if held:
            self._queue_rows(held, [device_row[s] for s in held])
        return not replaced

    def device_rows(self, slots: np.ndarray) -> np.ndarray:
        """The device rows of ``slots`` (one step's sequences, distinct), lending a row to each slot
        without one and queueing its table's write there."""
        device_row, listed = self.device_row, slots.tolist()
        rows = np.fromiter(map(device_row.__getitem__, listed), np.int32, len(listed))
        if rows.min(initial=0) >= 0:
            return rows
        missing = [s for s in listed if device_row[s] < 0]
        short = len(missing) - len(self._free_rows)
        if short > 0:
            running = set(listed)
            idle = [s for s in self._row_owner if s >= 0 and s not in running]
            if len(idle) < short:
                raise RuntimeError(f"a step runs {len(slots)} sequences but the device block tables have "
                                   f"{len(self._row_owner)} rows")
            for s in idle[:short]:
                self._drop_row(s)
        lent = [self._free_rows.pop() for _ in missing]
        for s, d in zip(missing, lent):
            self._row_owner[d] = s
            device_row[s] = d
        self._queue_rows(missing, lent)
        return np.fromiter(map(device_row.__getitem__, listed), np.int32, len(listed))

    def take_table_writes(self) -> np.ndarray | None:
        """The queued device-table writes as one ``[3, n]`` array (None: no write), each entry
        written once (the last queued value of an entry wins, as it would written in order)."""
        writes, self._table_writes = self._table_writes, []
        if len(writes) <= 1:
            return writes[0] if writes else None
        w = np.concatenate(writes, axis=1)
        key = w[0].astype(np.int64) * self._max_blocks + w[1]
        _, last = np.unique(key[::-1], return_index=True)
        return w[:, len(key) - 1 - last]

    def _queue_rows(self, slots: list[int], rows: list[int]) -> None:
        """Queue writes of the slots' whole tables (their requests' ``block_ids``) to their device rows."""
        tables = [self._owner[s].block_ids for s in slots]
        n = np.fromiter(map(len, tables), np.int64, len(tables))
        total = int(n.sum())
        if not total:
            return
        cols = np.arange(total) - np.repeat(np.cumsum(n) - n, n)
        ids = np.fromiter(itertools.chain.from_iterable(tables), np.int32, total)
        self._table_writes.append(np.array([np.repeat(rows, n), cols, ids], np.int32))

    def _drop_row(self, s: int) -> None:
        d = self.device_row[s]
        if d >= 0:
            self._row_owner[d] = -1
            self._free_rows.append(d)
            self.device_row[s] = -1
