"""The physical KV blocks: ``BlockPool`` (reference-counted device blocks with an LRU-ordered free queue
and the prefix cache's entries) and ``HostBlockPool`` (host pages for swapped-out requests).

Pure Python (no jax, no numpy), never touching the device. Block 0 is reserved as the null block
that padding rows point at, so it is never handed out. Freed blocks keep their contents and their
hash: a block reaching ref count 0 goes to the *tail* of the free queue while allocation takes from
the *head*, so the least recently freed block is evicted first (LRU). A block table grows in runs of
consecutive ids (``BlockPool.append_runs``): consecutive pages are faster for the CPU attention to
read. A run takes a cached free block out of LRU order only where it was kept for the table: the rest
of the run of blocks it started in, freed together, the next LRU victims.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from jaxpaged.block_hash import BlockHash, ParentKey

NULL_BLOCK_ID = 0
"""Reserved block that padding rows of a batch point at; never handed out."""
LATER_RUN_ROOM = 16
"""Free blocks a table's later run (its earlier one could not grow) keeps after it for the table's growth (see
``BlockPool.append_runs``)."""


def _kept_for(table: list[int]) -> int:
    """``BlockPool``'s mark, in place of a free block's free time (a clock reading, never negative),
    of a block kept for ``table`` to grow into. (A table gone may leave its id to a new one, which
    may then take its kept blocks: they are free either way.)"""
    return -1 - id(table)


def _run_step(table: list[int]) -> int:
    """The direction of ``table``'s last run: 1 up, -1 down, 0 if it is one block long."""
    step = table[-1] - table[-2] if len(table) > 1 else 0
    return step if step in (1, -1) else 0


class BlockPool:
    """Reference-counted KV blocks ``1 .. num_blocks - 1`` with an LRU-ordered free queue.

    The free queue is an ``OrderedDict`` used as an ordered set: pop from the head, push
    to the tail, and O(1) removal from the middle (a prefix-cache hit on a free cached block,
    a block table growing into the free block after its last one).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is the reserved null block), "
                f"got {num_blocks}; give the KV cache more memory."
            )
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(NULL_BLOCK_ID + 1, num_blocks))
        self._freed_at = list(range(num_blocks))  # a clock reading when each block last joined the free queue
        self._clock = num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._block_key: list[tuple[BlockHash, tuple[int, ...], ParentKey] | None] = [None] * num_blocks
        self._generation = [0] * num_blocks  # bumped whenever a block's contents are replaced
        self._num_refs = 0  # sum of ref counts: block-table entries over all owners

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by at least one owner."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_block_refs(self) -> int:
        """Sum of all ref counts: the blocks the owners would hold if nothing were shared."""
        return self._num_refs

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def is_shared(self, block_id: int) -> bool:
        """More than one owner (unchecked id: for the scheduler's hot path, on ids it handed out)."""
        return self._ref_counts[block_id] > 1

    def parent_key(self, block_id: int) -> ParentKey:
        return (block_id, self._generation[block_id])

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int], parent: ParentKey) -> int | None:
        """The cached block holding exactly these tokens after exactly this parent, if any."""
        b = self._cached.get(block_hash)
        if b is None or self._block_key[b] != (block_hash, tuple(token_ids), parent):
            return None
        return b

    def cache(
        self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int], parent: ParentKey
    ) -> None:
        """Publish a full block under its hash; an existing entry for the hash is kept."""
        if self._block_key[block_id] is None and block_hash not in self._cached:
            self._cached[block_hash] = block_id
            self._block_key[block_id] = (block_hash, tuple(token_ids), parent)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one owner to each (cached) block, taking free ones out of the free queue."""
        for b in block_ids:
            self._check_id(b)
            if self._ref_counts[b] == 0:
                del self._free_queue[b]
            self._ref_counts[b] += 1
            self._num_refs += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for a new table: one run from the head of the free queue (``append_runs``)."""
        block_ids: list[int] = []
        self.append_runs([block_ids], [n])
        return block_ids

    def append_runs(self, tables: list[list[int]], counts: list[int], room: int = 0) -> None:
        """Append ``counts[i]`` blocks, each with ref count 1, to block table ``tables[i]``, in runs of
        consecutive ids where the free blocks allow. A table's run goes on into the next id in its
        direction (either, after a run of one block) while that block is free and taking it keeps LRU
        order: it caches nothing, was kept for the table (below), or is the head of the free queue;
        otherwise the table starts a new run at the head (the least recently freed block, evicted if
        cached). A new run keeps free blocks after it, in its direction, for the table to grow into:
        ``room`` of them for the first run of an empty table (a request's first blocks),
        ``LATER_RUN_ROOM`` for a later one. Kept are uncached blocks and, with prefix caching, the
        blocks freed right after the run's last one (a table is freed last block first, so its blocks
        come back in a run counting down from the queue's head): the next ones LRU would evict, whose
        eviction waits for this table. They move to the queue's tail (the next table placed at the
        head leaves them), marked as kept for this table: no other table takes them (until one
        reaches the queue's head). Why: the CPU decode attention reads a sequence's pages in
        table order, and consecutive pages (one stream a layer) read faster than pages
        scattered over the pool (``docs/architecture.md``). All or nothing."""
        total = sum(counts)
        if min(counts, default=0) < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({counts}).")
        free = self._free_queue
        if total > len(free):
            raise ValueError(f"cannot allocate {total} blocks: only {len(free)} free.")
        block_key, ref_counts, generation = self._block_key, self._ref_counts, self._generation
        freed_at = self._freed_at

        def takes(b: int, mine: int) -> bool:  # free; keeps LRU order; not kept for another table
            return b in free and (
                (block_key[b] is None and freed_at[b] >= 0) or freed_at[b] == mine or b == next(iter(free))
            )

        for table, n in zip(tables, counts):
            mine = _kept_for(table)
            first = new_run = not table
            for _ in range(n):
                b = -1
                if table:
                    last, step = table[-1], _run_step(table)
                    if takes(last + (step or 1), mine):
                        b = last + (step or 1)
                    elif not step and takes(last - 1, mine):
                        b = last - 1
                if b < 0:
                    b, new_run = next(iter(free)), True
                del free[b]
                key = block_key[b]
                if key is not None:  # evict: its contents are about to be overwritten
                    del self._cached[key[0]]
                    block_key[b] = None
                ref_counts[b] = 1
                generation[b] += 1
                table.append(b)
            if new_run and table:
                self._keep_after(table, room if first else LATER_RUN_ROOM)
        self._num_refs += total

    def _keep_after(self, table: list[int], room: int) -> None:
        """Keep up to ``room`` free blocks after ``table``'s last run, in its direction (after a run of
        one block, up if the block above can be kept, else down): uncached ones, or each freed right
        after the one before it, none kept for another table. See ``append_runs``."""
        free, block_key, freed_at = self._free_queue, self._block_key, self._freed_at
        last, mine = table[-1], _kept_for(table)

        def keeps(b: int, before: int) -> bool:
            return b in free and freed_at[b] >= 0 and (block_key[b] is None or freed_at[b] == before + 1)

        step = _run_step(table) or (1 if keeps(last + 1, freed_at[last]) else -1)
        before = freed_at[last]
        for b in range(last + step, last + step * (room + 1), step):
            if not keeps(b, before):
                break
            before = freed_at[b]
            free.move_to_end(b)
            freed_at[b] = mine

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one owner to each block; every block must already be in use."""
        block_ids = list(block_ids)
        for b in block_ids:
            self._check_id(b)
            if self._ref_counts[b] == 0:
                raise ValueError(f"cannot incref block {b}: it is free.")
        for b in block_ids:
            self._ref_counts[b] += 1
        self._num_refs += len(block_ids)

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one owner from each block (in the given order); blocks reaching 0 join the
        tail of the free queue. Checked before any change, so a double free raises and
        leaves the pool untouched."""
        block_ids = list(block_ids)
        for b, times in Counter(block_ids).items():
            self._check_id(b)
            if self._ref_counts[b] < times:
                raise ValueError(
                    f"double free of block {b} (ref count {self._ref_counts[b]}, freed {times} time(s))."
                )
        for b in block_ids:
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free_queue[b] = None
                self._freed_at[b] = self._clock
                self._clock += 1
        self._num_refs -= len(block_ids)

    def _check_id(self, block_id: int) -> None:
        if not NULL_BLOCK_ID < block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is not a usable block (1 .. {self.num_blocks - 1}).")


class HostBlockPool:
    """Host-memory pages for swapped-out requests: ids ``0 .. num_blocks - 1``, each with one owner."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"the host pool needs a non-negative number of blocks, got {num_blocks}.")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._used = [False] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} host blocks: only {len(self._free)} free.")
        ids = [self._free.pop() for _ in range(n)]
        for h in ids:
            self._used[h] = True
        return ids

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        if len(set(ids)) != len(ids) or not all(0 <= h < self.num_blocks and self._used[h] for h in ids):
            raise ValueError(f"double free or bad id among host blocks {ids}.")
        for h in ids:
            self._used[h] = False
            self._free.append(h)
