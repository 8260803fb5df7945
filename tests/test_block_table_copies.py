"""The device copy of the block tables, replayed here in numpy from the writes ``BlockTable`` queues,
follows the KV-cache manager's tables through every kind of change it reports (growth, copy-on-write,
fork, swap, free), whatever the order: a stateful random test against the requests' own ``block_ids``,
for every sequence holding a device row, with fewer device rows than sequences so that rows are taken
from idle sequences and given back; and the slots report a change as growth only when it was one."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxpaged.block_table import BlockTable
from jaxpaged.kv_cache_manager import KVCacheManager
from jaxpaged.sequence_slots import SequenceSlots
from jaxpaged.request import Request
from jaxpaged.sampling_params import SamplingParams

MAX_BLOCKS = 12
DEVICE_ROWS = 3


class TableCopiesMachine(RuleBasedStateMachine):
    """Requests grow (by one token, as decodes do, or by many), fork, swap out and in, and are freed
    (keeping their slot, as a preempted request does, or releasing it); after every step the runner
    takes the changes and each table's device row must equal the request's table."""

    @initialize(block_size=st.sampled_from([1, 2, 4]))
    def setup(self, block_size: int) -> None:
        self.kv = KVCacheManager(48, block_size, num_host_blocks=24)
        self.table = BlockTable(MAX_BLOCKS, DEVICE_ROWS)
        self.slots = SequenceSlots(self.table, capacity=2)
        self.device = np.zeros((DEVICE_ROWS, MAX_BLOCKS), np.int32)  # what the device would hold
        self.live: list[Request] = []  # requests with a slot
        self.seen: dict[str, list[int]] = {}  # each live table when the runner last looked
        self.released: list[str] = []
        self.counter = 0
        self.replaced = False  # a table lost or replaced blocks since the runner last looked

    def _new(self) -> Request:
        self.counter += 1
        return Request(str(self.counter), list(range(40)), SamplingParams(), max_tokens=8, seed=0)

    @rule(num_tokens=st.integers(1, 9))
    def new_request(self, num_tokens: int) -> None:
        req = self._new()
        self.slots.slot(req)
        self.live.append(req)
        self._grow(req, num_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), num_new=st.sampled_from([1, 1, 1, 2, 5]))
    def grow(self, data: st.DataObject, num_new: int) -> None:
        req = data.draw(st.sampled_from(self.live))
        if not req.host_block_ids:
            self._grow(req, num_new)

    @precondition(lambda self: self.live)
    @rule()
    def decode(self) -> None:
        """Every sequence grows by one token, as a decode step does: some open a block at once."""
        for req in self.live:
            if not req.host_block_ids:
                self._grow(req, 1)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.live))
        if parent.host_block_ids:
            return
        child = self._new()
        self.kv.fork(parent, child)
        self.replaced = True  # the child's whole table: rewritten if it had a slot already
        if data.draw(st.booleans()):  # a slot before or after the fork's change is reported
            self.slots.slot(child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.live))
        if not req.host_block_ids:
            self.replaced |= self.kv.swap_out(req) is not None

    @precondition(lambda self: self.live)
    @rule(data=st.data(), num_new=st.integers(0, 3))
    def swap_in(self, data: st.DataObject, num_new: int) -> None:
        req = data.draw(st.sampled_from(self.live))
        fits = self.kv.blocks_needed(req.num_computed_tokens + num_new) <= MAX_BLOCKS
        if req.host_block_ids and fits and self.kv.swap_in(req, num_new) is not None:
            req.num_computed_tokens += num_new
            self.replaced = True

    @precondition(lambda self: self.live)
    @rule(data=st.data(), release=st.booleans())
    def free(self, data: st.DataObject, release: bool) -> None:
        req = data.draw(st.sampled_from(self.live))
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.replaced = True
        if release:
            self.live.remove(req)
            self.released.append(req.request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), num_new=st.integers(1, 9))
    def free_and_regrow(self, data: st.DataObject, num_new: int) -> None:
        """Two changes before the runner looks (preempted and resumed within one schedule)."""
        req = data.draw(st.sampled_from(self.live))
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.replaced = True
        self._grow(req, num_new)

    def _grow(self, req: Request, num_new: int) -> None:
        before = list(req.block_ids)
        if self.kv.blocks_needed(req.num_computed_tokens + num_new) <= MAX_BLOCKS and self.kv.allocate_slots(
            req, num_new
        ):
            req.num_computed_tokens += num_new
            self.replaced |= req.block_ids[: len(before)] != before  # copied on write

    @invariant()
    def copies_equal_tables(self) -> None:
        if not hasattr(self, "kv"):
            return
        appended = self.slots.update(self.kv.take_changed_tables(), self.released)
        # Only growth since the last look: reported as such (the runner's steady step relies on it, and
        # on its converse: every table of a sequence with a slot still starts with the blocks it held).
        assert appended or self.replaced
        if appended:
            assert all(
                r.block_ids[: len(self.seen[r.request_id])] == self.seen[r.request_id]
                for r in self.live
                if r.request_id in self.seen
            )
        self.released, self.replaced = [], False
        self.seen = {r.request_id: list(r.block_ids) for r in self.live}
        for req in self.live:
            assert self.table.num_blocks[self.slots.slot(req)] == len(req.block_ids)
        assert len(self.slots) == len(self.live)
        self._check_device_rows(self.live)

    def _check_device_rows(self, reqs: list[Request]) -> None:
        """Apply the queued writes to the test's device copy: every sequence of ``reqs`` holding a
        device row finds its table there."""
        writes = self.table.take_writes()
        if writes is not None:
            keys = writes[0] * MAX_BLOCKS + writes[1]
            assert len(set(keys.tolist())) == len(keys)  # a scatter's order among duplicates is undefined
            self.device[writes[0], writes[1]] = writes[2]
        for req in reqs:
            row = self.table.device_row[self.slots.slot(req)]
            if row >= 0:
                assert self.device[row, : len(req.block_ids)].tolist() == req.block_ids, req.request_id

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """A step runs up to ``DEVICE_ROWS`` live sequences: each reads its table from its device row."""
        self.copies_equal_tables()
        running = data.draw(
            st.lists(st.sampled_from(self.live), min_size=1, max_size=DEVICE_ROWS, unique=True)
        )
        slots = np.array([self.slots.slot(r) for r in running], np.int32)
        rows = self.table.device_rows(slots)
        assert len(set(rows.tolist())) == len(rows) and rows.min() >= 0 and rows.max() < DEVICE_ROWS
        self._check_device_rows(running)

    def teardown(self) -> None:
        for req in getattr(self, "live", []):
            self.kv.free(req)
        if hasattr(self, "kv"):
            assert self.kv.num_free_blocks == self.kv.pool.num_usable_blocks


TestTableCopiesMachine = TableCopiesMachine.TestCase
TestTableCopiesMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
