"""Paged KV-cache bookkeeping: which physical blocks are free, who holds the rest.

Pure Python (no jax, no numpy): the scheduler calls this once or more per request per
step, so it must be cheap and must never touch the device. The device-side page array
is indexed by the block ids handed out here; block 0 is reserved as the null block that
padding rows point at, so it is never given to a request.

The pool is shaped for prefix caching, added later without rewriting it: a block is
freed by dropping its reference count, and a block reaching 0 goes to the *tail* of
an ordered free queue while allocation pops from the *head*. Freed blocks therefore
stay intact for as long as possible (least recently freed is reused first, i.e. LRU
eviction), and a request's blocks are freed last-block-first so that its shared prefix
outlives its private tail. Ref counts already allow several holders of one block (forks,
copy-on-write).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from jaxpaged.request import Request

NULL_BLOCK_ID = 0
"""Reserved block that padding rows of a batch point at; never handed out."""


class BlockPool:
    """Reference-counted KV blocks ``1 .. num_blocks - 1`` with an LRU-ordered free queue.

    The free queue is an ``OrderedDict`` used as an ordered set: pop from the head, push
    to the tail, and (for a future prefix-cache hit on a free cached block) O(1)
    removal from the middle.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is the reserved null block), "
                             f"got {num_blocks}; give the KV cache more memory.")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(NULL_BLOCK_ID + 1, num_blocks))

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

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue, each with ref count 1."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n}).")
        if n > len(self._free_queue):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free_queue)} free.")
        block_ids = [self._free_queue.popitem(last=False)[0] for _ in range(n)]
        for b in block_ids:
            self._ref_counts[b] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one owner to each block; every block must already be in use."""
        block_ids = list(block_ids)
        for b in block_ids:
            self._check_id(b)
            if self._ref_counts[b] == 0:
                raise ValueError(f"cannot incref block {b}: it is free.")
        for b in block_ids:
            self._ref_counts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one owner from each block (in the given order); blocks reaching 0 join the
        tail of the free queue. Checked before any change, so a double free raises and
        leaves the pool untouched."""
        block_ids = list(block_ids)
        for b, times in Counter(block_ids).items():
            self._check_id(b)
            if self._ref_counts[b] < times:
                raise ValueError(f"double free of block {b} (ref count {self._ref_counts[b]}, "
                                 f"freed {times} time(s)).")
        for b in block_ids:
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free_queue[b] = None

    def _check_id(self, block_id: int) -> None:
        if not NULL_BLOCK_ID < block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is not a usable block (1 .. {self.num_blocks - 1}).")


class KVCacheManager:
    """Per-request block tables on top of a ``BlockPool``.

    ``request.block_ids`` is the request's block table: logical block ``i`` holds tokens
    ``[i * block_size, (i + 1) * block_size)``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow ``request.block_ids`` to hold ``num_computed_tokens + num_new_tokens`` tokens.

        All or nothing: returns False, allocating nothing, if the pool is short.
        """
        total = request.num_computed_tokens + num_new_tokens
        missing = self.blocks_needed(total) - len(request.block_ids)
        if missing <= 0:
            return True
        if missing > self.pool.num_free_blocks:
            return False
        request.block_ids.extend(self.pool.allocate(missing))
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first, and clear its block table."""
        self.pool.free(reversed(request.block_ids))
        request.block_ids.clear()
