"""The block tables as the device reads them: one owner for the device rows, the writes pending to
them, and their application in padded chunks (vLLM's ``v1/worker/block_table.py``).

The device holds a fixed number of rows, one per sequence a step runs, as vLLM keeps its tables on
the GPU: a step reads its rows' tables there, so the host sends a row index per sequence instead of
``max_model_len / block_size`` entries. The rows follow the KV-cache manager's tables through the
changes the scheduler reports (``SchedulerOutput.block_table_updates``, fed to ``update``): a table
grown by appended blocks (a decode step opening its next block, the common change) costs their
entries; another change rewrites the whole table if its sequence holds a device row. The host keeps
no copy: only each table's length as last reported (to tell a growth from a replacement); a whole
table, written to a newly lent row, is read from its request.

Tables are indexed by the persistent batch's slots (``SequenceSlots``, which registers and releases
them). Entries of a device row past its sequence's blocks are stale, never zeroed: a step reads a
row's table only up to its sequence length, and a stale entry is still a valid block id.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged import parallel
from jaxpaged.request import Request
from jaxpaged.scheduler_output import TableChange
from jaxpaged.step_programs import NO_ROW, jit_table_writes

TABLE_WRITE_SIZES = (64, 256, 1024, 4096)
"""Chunk sizes of the writes that do not fit a step program's own (a sequence getting a device row
writes its whole table): each size is compiled at start-up (``compile_writes``)."""


class BlockTable:
    """``num_device_rows`` rows of the device block tables (``tables``), lent to the slots that steps run.

    A slot gets a device row when a step first runs it (``device_rows``), queueing a write of its whole
    table there, and keeps it until released; when all rows are lent, a step takes them from slots it
    does not run (a preempted sequence), which get a row again when they run.
    """

    def __init__(self, max_blocks_per_seq: int, num_device_rows: int, mesh=None) -> None:
        self._max_blocks = max_blocks_per_seq
        self._mesh = mesh
        shape = (num_device_rows, max_blocks_per_seq)
        self.tables: jax.Array = (
            jnp.zeros(shape, jnp.int32)
            if mesh is None
            else parallel.zeros(shape, jnp.int32, parallel.replicated(mesh))
        )
        """The device tables; the step programs take them donated and return them written."""
        self._owner: list[Request | None] = []
        """The request holding each slot: its ``block_ids`` are the table a newly lent row gets."""
        self.num_blocks: list[int] = []
        """Each slot's table length as last reported (its device row holds that many entries)."""
        self.device_row: list[int] = []
        """Each slot's row of the device tables (-1: none). A list: ``update`` reads it per changed
        table, cheaper than a numpy gather and mask of the grown rows."""
        self._row_owner: list[int] = [-1] * num_device_rows
        """The slot holding each device row (-1: free)."""
        self._free_rows = list(range(num_device_rows - 1, -1, -1))  # popped from the end: lowest first
        self._writes: list[np.ndarray] = []
        """Queued ``[3, n]`` (device row, column, block id) writes, in order."""

    def grow(self, num_slots: int) -> None:
        """Room for ``num_slots`` more slots (extended in place)."""
        self._owner += [None] * num_slots
        self.num_blocks += [0] * num_slots
        self.device_row += [-1] * num_slots

    def add(self, s: int, r: Request) -> None:
        """Slot ``s`` now holds ``r``'s table (no device row yet)."""
        self._owner[s] = r
        self.num_blocks[s] = len(r.block_ids)
        self.device_row[s] = -1

    def remove(self, s: int) -> None:
        """Slot ``s`` released: its device row is free again."""
        self._owner[s] = None
        self._drop_row(s)

    def update(self, changed: list[TableChange], slot_of: dict[str, int]) -> bool:
        """Queue the device writes of the changed tables of the sequences with slots (``slot_of``).
        Returns whether every such change was a growth (no block a sequence held replaced)."""
        rows, cols, ids, replaced = [], [], [], []
        num_blocks, device_row = self.num_blocks, self.device_row
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
            self._writes.append(np.array([rows, cols, ids], np.int32))
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
                raise RuntimeError(
                    f"a step runs {len(slots)} sequences but the device block tables have "
                    f"{len(self._row_owner)} rows"
                )
            for s in idle[:short]:
                self._drop_row(s)
        lent = [self._free_rows.pop() for _ in missing]
        for s, d in zip(missing, lent):
            self._row_owner[d] = s
            device_row[s] = d
        self._queue_rows(missing, lent)
        return np.fromiter(map(device_row.__getitem__, listed), np.int32, len(listed))

    def take_writes(self) -> np.ndarray | None:
        """The queued writes as one ``[3, n]`` array (None: no write), each entry written once (the
        last queued value of an entry wins, as it would written in order)."""
        writes, self._writes = self._writes, []
        if len(writes) <= 1:
            return writes[0] if writes else None
        w = np.concatenate(writes, axis=1)
        key = w[0].astype(np.int64) * self._max_blocks + w[1]
        _, last = np.unique(key[::-1], return_index=True)
        return w[:, len(key) - 1 - last]

    def take_step_writes(self, step: np.ndarray) -> list[np.ndarray]:
        """The queued writes: up to ``size`` of them into ``step`` (``[3, size]``, for the step program;
        the rest of it padding), the others in padded chunks, returned (for ``apply``). Each entry is
        written once, so the order the two programs apply them in does not matter."""
        step.fill(NO_ROW)
        writes = self.take_writes()
        if writes is None:
            return []
        size = step.shape[1]
        n = min(size, writes.shape[1])
        step[:, :n] = writes[:, :n]
        writes = writes[:, n:]
        chunks, largest = [], TABLE_WRITE_SIZES[-1]
        for at in range(0, writes.shape[1], largest):
            part = writes[:, at : at + largest]
            chunk = np.full((3, next(u for u in TABLE_WRITE_SIZES if u >= part.shape[1])), NO_ROW, np.int32)
            chunk[:, : part.shape[1]] = part
            chunks.append(chunk)
        return chunks

    def apply(self, chunks: list[np.ndarray]) -> None:
        """Apply padded writes to the device tables (donated: updated in place)."""
        for chunk in chunks:
            self.tables = jit_table_writes(self._mesh)(self.tables, chunk)

    def compile_writes(self) -> None:
        """Compile the write program of every chunk size (all-padding writes: nothing changes)."""
        self.apply([np.full((3, u), NO_ROW, np.int32) for u in TABLE_WRITE_SIZES])

    def _queue_rows(self, slots: list[int], rows: list[int]) -> None:
        """Queue writes of the slots' whole tables (their requests' ``block_ids``) to their device rows."""
        tables = [self._owner[s].block_ids for s in slots]
        n = np.fromiter(map(len, tables), np.int64, len(tables))
        total = int(n.sum())
        if not total:
            return
        cols = np.arange(total) - np.repeat(np.cumsum(n) - n, n)
        ids = np.fromiter(itertools.chain.from_iterable(tables), np.int32, total)
        self._writes.append(np.array([np.repeat(rows, n), cols, ids], np.int32))

    def _drop_row(self, s: int) -> None:
        d = self.device_row[s]
        if d >= 0:
            self._row_owner[d] = -1
            self._free_rows.append(d)
            self.device_row[s] = -1
