"""Paged KV-cache bookkeeping: which physical blocks are free, who holds the rest.

Pure Python (no jax, no numpy): the scheduler calls this once or more per request per
step, so it must be cheap and must never touch the device. The device-side page array
is indexed by the block ids handed out here; block 0 is reserved as the null block that
padding rows point at, so it is never given to a request.

Automatic prefix caching: every full block is identified by a hash chained over (parent
block's hash, the block's token ids), rooted in a SHA-256 digest of the request's salt. A
new request reuses the physical blocks of its longest cached prefix (ref count + 1) and
computes only the rest. Freed blocks keep their contents and their hash: a block reaching
ref count 0 goes to the *tail* of an ordered free queue while allocation takes from the
*head*, so the least recently freed block is evicted first (LRU), and a request's blocks
are freed last-block-first so its shared prefix outlives its tail. A block table grows in
runs of consecutive ids (``BlockPool.append_runs``): consecutive pages are faster for the CPU
attention to read. A run takes a cached free block out of LRU order only where it was kept for
the table: the rest of the run of blocks it started in, freed together, the next LRU victims.
A hit is verified exactly: the cached block's token ids must equal the request's, and its
parent must be the very block (same physical id, not overwritten since) that the request
matched one step earlier, or for a first block the request's own root digest; so a hash
collision cannot hand a request another prefix's KV, and the chain's hash need not resist
collisions: it is Python's 64-bit tuple hash (cheaper per block than a SHA-256 digest, and a decode
step publishes many full blocks). A collision only costs a hit:
the first block published under a hash keeps it.

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
import hashlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from jaxpaged.math_utils import cdiv
from jaxpaged.request import Request
from jaxpaged.scheduler_output import TableChange

NULL_BLOCK_ID = 0
"""Reserved block that padding rows of a batch point at; never handed out."""
MAX_GROWTH_ROOM = 64
"""Most free blocks a request's first run of blocks keeps free after it for the table's growth (see
``BlockPool.append_runs``): a table growing past them continues in a new run."""
LATER_RUN_ROOM = 16
"""Free blocks a table's later run (its earlier one could not grow) keeps after it, for the same reason."""

BlockHash = int
RootDigest = bytes
ParentKey = RootDigest | tuple[int, int]
"""What a cached block was computed after: the chain root's digest for a first block, else
(parent block id, parent generation)."""


def hash_block(parent: BlockHash | RootDigest, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block, after its parent's hash (the root digest for a first block).
    Not collision-resistant: a hit is verified token by token (see the module docstring)."""
    return hash((parent, *token_ids))


def root_hash(cache_salt: str | None) -> RootDigest:
    """The chain's root, compared in full on every first-block hit: requests with different salts
    never share a block."""
    return hashlib.sha256(b"jaxpaged-prefix-root" + (cache_salt or "").encode()).digest()


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
