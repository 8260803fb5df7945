"""Paged KV-cache bookkeeping: ``KVCacheManager``, the per-request block tables over a ``BlockPool``
(``jaxpaged/block_pool.py``), and its sharing and prefix-cache stats.

Pure Python (no jax, no numpy): the scheduler calls this once or more per request per
step, so it must be cheap and must never touch the device. The device-side page array
is indexed by the block ids handed out here.

Automatic prefix caching: every full block is identified by a hash chained over its parent's
(``jaxpaged/block_hash.py``). A new request reuses the physical blocks of its longest cached prefix
(ref count + 1) and computes only the rest. A request's blocks are freed last-block-first so its
shared prefix outlives its tail in the pool's LRU free queue.

Sharing between sequences (parallel samples, beams): ``fork`` gives a child the parent's
block table with every block's ref count + 1, including a partly filled last block. The
first write into a block that others still hold copies it first (copy-on-write): the writer
gets a fresh block, the (src, dst) pair is queued for the runner's batched device copy
before the step, and the shared block loses one owner. ``num_block_refs`` (table entries over
all sequences) against the blocks in use measures what sharing saves.

Swap: ``swap_out`` moves a preempted request's blocks to a host page pool (``HostBlockPool``,
plain ids; the runner holds the numpy pages) and ``swap_in`` brings them back into fresh
device blocks; both return the (src, dst) pairs the runner copies before the step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jaxpaged.block_hash import BlockHash, ParentKey, hash_block, root_hash
from jaxpaged.block_pool import BlockPool, HostBlockPool
from jaxpaged.math_utils import cdiv
from jaxpaged.request import Request
from jaxpaged.scheduler_output import TableChange

MAX_GROWTH_ROOM = 64
"""Most free blocks a request's first run of blocks keeps free after it for the table's growth (see
``BlockPool.append_runs``): a table growing past them continues in a new run."""
_new_table_change = functools.partial(tuple.__new__, TableChange)
"""``TableChange(request, first)`` from a ``(request, first)`` pair without the NamedTuple's own constructor
(a Python function call): a decode step makes one per table that grew."""


@dataclass(frozen=True)
class SharingStats:
    """Blocks saved by sharing: ``(without - used) / without``, where ``without`` counts every
    sequence's block-table entries (what the sequences would hold with private copies) and
    ``used`` the distinct blocks they hold."""

    blocks_used: int
    blocks_without_sharing: int

    @property
    def saved_fraction(self) -> float:
        w = self.blocks_without_sharing
        return (w - self.blocks_used) / w if w else 0.0


@dataclass
class PrefixCacheStats:
    """Token counts for the prefix-cache hit rate (hits / queries)."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Per-request block tables on top of a ``BlockPool``.

    ``request.block_ids`` is the request's block table: logical block ``i`` holds tokens
    ``[i * block_size, (i + 1) * block_size)``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        hash_fn: Callable[[BlockHash, Sequence[int]], BlockHash] = hash_block,
        num_host_blocks: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.host_pool = HostBlockPool(num_host_blocks)
        self._pending_copies: list[tuple[int, int]] = []
        self._changed: dict[str, TableChange] = {}
        """Requests whose block tables changed since ``take_changed_tables``, in order of first change."""
        self.shared_tails: set[str] = set()
        """Requests whose partly filled last block may be shared (they were forked, or forked from),
        until their next ``allocate_slots`` copies it or finds it private. No other request's next
        write can hit a shared block: prefix caching shares only full blocks, which are never written
        again. The scheduler's decode step skips the block lookup for every request not in here."""
        self.enable_caching = enable_caching
        self.stats = PrefixCacheStats()
        self._hash_fn = hash_fn

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def sharing_stats(self) -> SharingStats:
        return SharingStats(self.pool.num_used_blocks, self.pool.num_block_refs)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow ``request.block_ids`` to hold ``num_computed_tokens + num_new_tokens`` tokens,
        first copying (on write) a partly filled block that other sequences still share.

        All or nothing: returns False, allocating nothing, if the pool is short.
        """
        block_ids = request.block_ids
        total = request.num_computed_tokens + num_new_tokens
        cow = self._copy_on_write_index(request, num_new_tokens)
        if cow is None and total <= len(block_ids) * self.block_size:
            if num_new_tokens > 0:  # the block it writes next is its own
                self.shared_tails.discard(request.request_id)
            return True  # the common decode step: room left in a private last block
        missing = max(0, self.blocks_needed(total) - len(block_ids))
        needed = missing + (cow is not None)
        if needed > self.pool.num_free_blocks:
            return False
        if cow is not None:
            src = request.block_ids[cow]
            dst = self.pool.allocate(1)[0]
            request.block_ids[cow] = dst
            self.pool.free([src])  # still held by its other owners
            self._pending_copies.append((src, dst))
        first = len(block_ids) if cow is None else cow
        self.pool.append_runs([block_ids], [missing], 0 if block_ids else self._growth_room(request, missing))
        self.shared_tails.discard(request.request_id)
        self._mark_changed(request, first)
        if self.enable_caching:
            self._publish_full_blocks([(request, total)])
        return True

    def grow_tables(self, requests: list[Request]) -> None:
        """``allocate_slots`` for a batch of requests in one pool allocation: each table grows to cover
        the request's ``num_computed_tokens``, which the scheduler has already advanced over this
        step's tokens (decode steps opening their next blocks, the common allocation). None of them
        may be in ``shared_tails`` (no copy on write to make); ``ValueError``, changing nothing, if
        the pool is short."""
        bs = self.block_size
        grown, tables, counts, firsts = [], [], [], []
        for r in requests:
            table = r.block_ids
            c = -(-r.num_computed_tokens // bs) - len(
                table
            )  # cdiv inline: no call per row in the step's loop
            if c > 0:
                grown.append(r)
                tables.append(table)
                counts.append(c)
                firsts.append(len(table))
        self.pool.append_runs(tables, counts)  # all or nothing: raises before changing anything
        mark = self._mark_changed
        for r, first in zip(grown, firsts):
            mark(r, first)
        if self.enable_caching:
            self._publish_full_blocks([(r, r.num_computed_tokens) for r in grown])

    def _growth_room(self, request: Request, num_blocks: int) -> int:
        """Free blocks to keep after the first ``num_blocks`` of ``request``'s table (``BlockPool.append_runs``):
        what its longest possible length (prompt + ``max_tokens``) needs more, at most ``MAX_GROWTH_ROOM``."""
        room = self.blocks_needed(request.num_prompt_tokens + request.max_tokens) - num_blocks
        return min(room, MAX_GROWTH_ROOM)

    def blocks_to_allocate(self, request: Request, num_new_tokens: int) -> int:
        """How many free blocks ``allocate_slots(request, num_new_tokens)`` would take now."""
        missing = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        return max(0, missing) + (self._copy_on_write_index(request, num_new_tokens) is not None)

    def _copy_on_write_index(self, request: Request, num_new_tokens: int) -> int | None:
        """The index of the block that writing ``num_new_tokens`` more tokens must first copy:
        only a partly filled last block can be both shared and written."""
        block_ids = request.block_ids
        i = request.num_computed_tokens // self.block_size
        return i if num_new_tokens > 0 and i < len(block_ids) and self.pool.is_shared(block_ids[i]) else None

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """The copy-on-write (src, dst) pairs queued since the last call."""
        pairs, self._pending_copies = self._pending_copies, []
        return pairs

    def take_changed_tables(self) -> list[TableChange]:
        """The block tables changed since the last call (grown, copied on write, forked, swapped,
        freed), so that a copy of the tables needs updating only for them, from where they changed."""
        changed, self._changed = list(self._changed.values()), {}
        return changed

    def _mark_changed(self, request: Request, first: int = 0) -> None:
        """Record that ``request.block_ids[first:]`` changed (an earlier mark may lower ``first``)."""
        prev = self._changed.get(request.request_id)
        if prev is None or first < prev.first:
            self._changed[request.request_id] = _new_table_change((request, first))

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` (no blocks yet) the parent's block table and computed tokens, sharing
        every block by ref count; the partly filled last block is copied on its first write."""
        if child.block_ids or child.host_block_ids:
            raise ValueError(f"cannot fork into request {child.request_id!r}: it already holds blocks.")
        self.pool.incref(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        self.shared_tails.update((parent.request_id, child.request_id))
        self._mark_changed(child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_published_blocks = parent.num_published_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to host pages: returns (device, host) pairs to copy before
        the step, or None (changing nothing) if the host pool is short."""
        n = len(request.block_ids)
        if n == 0 or n > self.host_pool.num_free_blocks:
            return None
        host = self.host_pool.allocate(n)
        pairs = list(zip(request.block_ids, host))
        self.pool.free(reversed(request.block_ids))
        request.block_ids.clear()
        self._mark_changed(request)
        self.shared_tails.discard(request.request_id)
        request.host_block_ids = host
        request.num_published_blocks = 0
        return pairs

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back into fresh device blocks, plus room for
        ``num_new_tokens``: (host, device) pairs to copy before the step, or None if short."""
        n = len(request.host_block_ids)
        total = max(n, self.blocks_needed(request.num_computed_tokens + num_new_tokens))
        if total > self.pool.num_free_blocks:
            return None
        dev: list[int] = []
        self.pool.append_runs([dev], [total], self._growth_room(request, total))
        pairs = list(zip(request.host_block_ids, dev[:n]))
        self.host_pool.free(request.host_block_ids)
        request.host_block_ids = []
        request.block_ids = dev
        self._mark_changed(request)
        if self.enable_caching:
            self._publish_full_blocks([(request, request.num_computed_tokens + num_new_tokens)])
        return pairs

    def get_computed_blocks(self, request: Request) -> int:
        """Give a request with no blocks yet the cached blocks of its longest cached prefix.

        Sets ``request.block_ids`` and ``request.num_computed_tokens``; returns the tokens hit.
        At least the last known token is always left to compute (its logits are needed). A request that
        scores its prompt (``prompt_logprobs``) takes no hits: a cached position's logits are not kept (vLLM's rule).
        """
        if (
            not self.enable_caching
            or request.block_ids
            or request.host_block_ids
            or request.sampling_params.prompt_logprobs is not None
        ):
            return 0
        num_full = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, num_full)[:num_full]
        hits = []
        for i, h in enumerate(hashes):
            b = self.pool.lookup(h, self._block_tokens(request, i), self._parent_key(request, hits, i))
            if b is None:
                break
            hits.append(b)
        self.pool.touch(hits)
        request.block_ids.extend(hits)
        if hits:
            self._mark_changed(request)
        request.num_computed_tokens = len(hits) * self.block_size
        request.num_published_blocks = len(hits)
        self.stats.queries += request.num_tokens
        self.stats.hits += request.num_computed_tokens
        return request.num_computed_tokens

    def free(self, request: Request) -> None:
        """Release the request's blocks (and any swapped-out host ones) and clear its block table.
        With prefix caching the device blocks go last block first, so that its shareable prefix is
        evicted last; without it, first block first, so that their run stays ascending in the free
        queue for the next tables to grow in (``BlockPool.append_runs``). Its block hashes are kept:
        a preempted request that resumes looks its prefix up without hashing its tokens again."""
        self.pool.free(reversed(request.block_ids) if self.enable_caching else request.block_ids)
        request.block_ids.clear()
        self._mark_changed(request)
        self.shared_tails.discard(request.request_id)
        if request.host_block_ids:
            self.host_pool.free(request.host_block_ids)
            request.host_block_ids = []
        request.num_published_blocks = 0  # its block hashes stay: they depend on its tokens only

    def _parent_key(self, request: Request, block_ids: list[int], i: int) -> ParentKey:
        return root_hash(request.cache_salt) if i == 0 else self.pool.parent_key(block_ids[i - 1])

    def _block_tokens(self, request: Request, i: int) -> list[int]:
        return request.token_ids_slice(i * self.block_size, (i + 1) * self.block_size)

    def _block_hashes(self, request: Request, num_full: int) -> list[BlockHash]:
        """The request's chained block hashes, extended (never recomputed) to at least ``num_full``;
        the request's own list (it may hold more), not a copy."""
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else root_hash(request.cache_salt)
        for i in range(len(hashes), num_full):
            parent = self._hash_fn(parent, self._block_tokens(request, i))
            hashes.append(parent)
        return hashes

    def _publish_full_blocks(self, grown: list[tuple[Request, int]]) -> None:
        """Cache every block of each ``(request, num_tokens)`` that is full once its first ``num_tokens``
        tokens are written, as far as their token ids are known (an output token still in flight is
        published with a later step). All requests in one pass, everything bound once: a decode step
        at 256 running requests and block size 8 publishes ~32 blocks, a multi-step group of 8 ~256.
        A block after the first, all of it output tokens (what a decode step fills), reads its tokens
        from the outputs once (one tuple, for its hash and its entry) and its parent's key from the pool."""
        bs, hash_fn = self.block_size, self._hash_fn
        pool = self.pool
        cache, parent_key = pool.cache, pool.parent_key
        for request, num_tokens in grown:
            outputs = request.output_token_ids
            p = request.num_prompt_tokens
            known = p + len(outputs)
            num_full = (num_tokens if num_tokens < known else known) // bs
            done = request.num_published_blocks
            if num_full <= done:
                continue
            hashes = request.block_hashes
            block_ids = request.block_ids
            # One pass: each block's tokens read once, for its hash (if not yet computed: the hashes
            # may run ahead, from a prefix lookup) and its entry.
            for i in range(done, num_full):
                lo = i * bs - p
                if i and lo >= 0:
                    tokens = tuple(outputs[lo : lo + bs])
                    parent = parent_key(block_ids[i - 1])
                else:
                    tokens = self._block_tokens(request, i)
                    parent = self._parent_key(request, block_ids, i)
                h = hashes[i] if i < len(hashes) else hash_fn(hashes[-1] if i else parent, tokens)
                cache(block_ids[i], h, tokens, parent)
                if i == len(hashes):
                    hashes.append(h)
            request.num_published_blocks = num_full
