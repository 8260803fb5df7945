"""BlockPool / KVCacheManager: ref counting, free-queue order, all-or-nothing allocation,
and the pool invariants under random operation sequences (hypothesis stateful testing)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxpaged.block_pool import NULL_BLOCK_ID, BlockPool
from jaxpaged.kv_cache_manager import KVCacheManager
from jaxpaged.request import Request
from jaxpaged.sampling_params import SamplingParams


def make_request(rid: str, num_prompt_tokens: int) -> Request:
    return Request(rid, list(range(num_prompt_tokens)), SamplingParams(), max_tokens=16, seed=0)


def test_block_zero_is_reserved_and_counts_add_up() -> None:
    pool = BlockPool(5)
    assert (pool.num_blocks, pool.num_usable_blocks, pool.num_free_blocks) == (5, 4, 4)
    assert pool.usage == 0.0
    blocks = pool.allocate(4)
    assert sorted(blocks) == [1, 2, 3, 4] and NULL_BLOCK_ID not in blocks
    assert all(pool.ref_count(b) == 1 for b in blocks)
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.allocate(1)
    assert pool.allocate(0) == []


@pytest.mark.parametrize("num_blocks", [0, 1])
def test_pool_needs_a_usable_block(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(num_blocks)


def test_allocation_pops_head_and_free_appends_tail() -> None:
    pool = BlockPool(6)
    assert pool.allocate(3) == [1, 2, 3]
    pool.free([2])
    pool.free([1])
    assert pool.allocate(4) == [4, 5, 2, 1]


@pytest.mark.parametrize("caching, freed_order", [(True, [3, 2, 1]), (False, [1, 2, 3])])
def test_manager_frees_a_request_last_block_first_when_caching(caching: bool, freed_order: list[int]) -> None:
    """With prefix caching a request's tail is evicted before its (shareable) prefix; without it the
    blocks go back in table order, so that the free queue keeps their run ascending."""
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=caching)
    req = make_request("a", 5)
    assert kv.allocate_slots(req, 5)
    assert req.block_ids == [1, 2, 3]
    kv.free(req)
    assert req.block_ids == []
    assert kv.pool.allocate(7) == [4, 5, 6, 7] + freed_order


def test_tables_grow_into_the_next_ids_while_free_and_uncached() -> None:
    pool = BlockPool(12)
    table: list[int] = []
    pool.append_runs([table], [2])  # an empty table: a new run at the head
    pool.append_runs([table], [2])  # grows in place
    assert table == [1, 2, 3, 4]
    assert pool.allocate(1) == [5]  # the head; filled, published, freed
    pool.cache(5, block_hash=123, token_ids=(1,), parent=b"root")
    pool.free([5])
    # 5 is free but caches a block: taking it out of LRU order would evict it early, so the table
    # continues in a new run from the head (6) instead.
    pool.append_runs([table], [2])
    assert table == [1, 2, 3, 4, 6, 7] and pool.num_cached_blocks == 1
    with pytest.raises(ValueError, match="only 5 free"):  # all or nothing
        pool.append_runs([table, []], [2, 4])
    assert len(table) == 6 and pool.num_free_blocks == 5


def test_a_new_run_keeps_room_to_grow_after_it() -> None:
    pool = BlockPool(40)
    a: list[int] = []
    b: list[int] = []
    pool.append_runs([a, b], [2, 2], room=4)  # a: 1, 2 (room 3 .. 6); b: 7, 8 (room 9 .. 12)
    assert (a, b) == ([1, 2], [7, 8])
    for _ in range(4):  # interleaved growth stays consecutive
        pool.append_runs([a, b], [1, 1])
    assert (a, b) == ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
    pool.append_runs([a], [1], room=4)  # past its room (7 is b's): a new run at
    assert a[-1] == 13  # the head, which keeps LATER_RUN_ROOM
    assert pool.allocate(2) == [30, 31]  # blocks (14 .. 29) at the tail: a table
    pool.append_runs([a], [2])  # placed at the head leaves them for a
    assert a[-3:] == [13, 14, 15]


def test_with_prefix_caching_freed_tables_are_reused_in_runs_in_lru_order() -> None:
    """Prefix caching frees a table last block first, so once the pool has cycled every free block
    caches something and the free queue holds runs counting down. A new table takes its blocks in
    LRU order, which is such a run, and keeps the next ones of that run (the next LRU victims) to
    grow into; another table placed at the head meanwhile starts past them, and when it outgrows its
    run its next run keeps room as well. Both tables stay in runs, interleaved decodes included, and
    nothing is evicted but the blocks taken."""
    kv = KVCacheManager(num_blocks=40, block_size=2, enable_caching=True)
    fillers = [
        Request(f"f{i}", list(range(100 * i, 100 * i + 25)), SamplingParams(), max_tokens=1, seed=0)
        for i in range(3)
    ]
    for f in fillers:  # 13 blocks each, 12 full: the whole pool
        assert kv.allocate_slots(f, 25)
    assert [f.block_ids[0] for f in fillers] == [1, 14, 27] and kv.pool.num_cached_blocks == 36
    for f in fillers:
        kv.free(f)  # the queue: 13 .. 1, 26 .. 14, 39 .. 27
    reqs = [make_request("a", 3), make_request("b", 5)]  # room: 16 output tokens, 8 blocks more
    for r in reqs:
        assert kv.allocate_slots(r, r.num_prompt_tokens)
        r.num_computed_tokens = r.num_prompt_tokens
    assert [r.block_ids for r in reqs] == [[13, 12], [3, 2, 1]]  # a keeps 11 .. 4; b nothing (0 is null)
    for _ in range(12):
        for r in reqs:
            assert kv.allocate_slots(r, 1)
            r.num_computed_tokens += 1
    assert reqs[0].block_ids == list(range(13, 5, -1))
    assert reqs[1].block_ids == [3, 2, 1, 26, 25, 24, 23, 22, 21]  # its second run started at the head
    # Evicted: the 15 cached blocks taken (13 and 26 cached nothing); published: a's and b's full
    # prompt blocks ([0, 1], the same for both, and [2, 3]).
    assert kv.pool.num_cached_blocks == 36 - 15 + 2


def test_interleaved_decodes_keep_each_block_table_consecutive() -> None:
    """Two requests admitted one after the other, then decoding in turns (each opening a block every
    two tokens): each table is one run of ids, not ids alternating between them."""
    kv = KVCacheManager(num_blocks=64, block_size=2)
    reqs = [make_request("a", 3), make_request("b", 5)]
    for r in reqs:
        assert kv.allocate_slots(r, r.num_prompt_tokens)
        r.num_computed_tokens = r.num_prompt_tokens
    for _ in range(12):
        for r in reqs:
            assert kv.allocate_slots(r, 1)
            r.num_computed_tokens += 1
    for r in reqs:
        assert r.block_ids == list(range(r.block_ids[0], r.block_ids[0] + len(r.block_ids)))
    assert len(set(reqs[0].block_ids) | set(reqs[1].block_ids)) == 8 + 9


def test_double_free_raises_and_leaves_pool_untouched() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        pool.free([a, b, b])
    assert (pool.ref_count(a), pool.ref_count(b), pool.num_free_blocks) == (1, 1, 1)
    pool.free([a])
    with pytest.raises(ValueError, match="double free"):
        pool.free([a])
    assert pool.num_free_blocks == 2


def test_shared_block_is_freed_by_its_last_owner() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.incref([b])
    assert pool.ref_count(b) == 3
    pool.free([b, b])
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 1
    pool.free([b])
    assert pool.ref_count(b) == 0 and pool.num_free_blocks == 2


@pytest.mark.parametrize("block_id", [NULL_BLOCK_ID, -1, 4, 100])
def test_invalid_block_ids_raise(block_id: int) -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    for op in (pool.free, pool.incref):
        with pytest.raises(ValueError, match="not a usable block"):
            op([block_id])
    with pytest.raises(ValueError):
        pool.ref_count(block_id)


def test_incref_of_free_block_raises() -> None:
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="free"):
        pool.incref([1])
    assert pool.ref_count(1) == 0


@pytest.mark.parametrize(
    "block_size,num_tokens,expected", [(1, 0, 0), (1, 7, 7), (4, 1, 1), (4, 4, 1), (4, 5, 2), (16, 33, 3)]
)
def test_blocks_needed(block_size: int, num_tokens: int, expected: int) -> None:
    assert KVCacheManager(4, block_size).blocks_needed(num_tokens) == expected


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)


def test_allocate_slots_grows_block_table_only_when_needed() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("a", 10)
    assert kv.allocate_slots(req, 10) and len(req.block_ids) == 3
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 1) and len(req.block_ids) == 3  # token 11 fits block 3
    req.num_computed_tokens = 11
    assert kv.allocate_slots(req, 2) and len(req.block_ids) == 4  # token 13 needs block 4
    assert kv.num_free_blocks == 5 and kv.usage == pytest.approx(4 / 9)


def test_allocate_slots_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)  # 3 usable blocks
    other = make_request("other", 2)
    assert kv.allocate_slots(other, 2)
    req = make_request("a", 6)
    assert not kv.allocate_slots(req, 6)  # needs 3, only 2 free
    assert req.block_ids == [] and kv.num_free_blocks == 2
    assert kv.allocate_slots(req, 4) and len(req.block_ids) == 2 and kv.num_free_blocks == 0


def _decoding(kv: KVCacheManager, tokens: list[list[int]]) -> list[Request]:
    """Requests whose prompts ``tokens[i]`` are computed, each with one more output token known."""
    reqs = []
    for i, t in enumerate(tokens):
        r = Request(f"r{i}", t, SamplingParams(), max_tokens=16, seed=0)
        assert kv.allocate_slots(r, len(t))
        r.num_computed_tokens = len(t)
        r.output_token_ids.append(100 + i)
        reqs.append(r)
    kv.take_changed_tables()
    return reqs


@pytest.mark.parametrize("num_new", [2, 3, 9])
def test_grow_tables_matches_allocate_slots_one_by_one(num_new: int) -> None:
    """The decode step's one allocation for many requests hands out the same blocks in the same
    order, records the same table changes and publishes the same cached blocks as allocate_slots."""
    prompts = [list(range(10 * i, 10 * i + n)) for i, n in enumerate([4, 8, 5, 12, 11])]
    one, batch = (KVCacheManager(num_blocks=40, block_size=4, enable_caching=True) for _ in range(2))
    a, b = _decoding(one, prompts), _decoding(batch, prompts)
    for r in a:
        assert one.allocate_slots(r, num_new)
        r.num_computed_tokens += num_new
    for r in b:
        r.num_computed_tokens += num_new
    batch.grow_tables(b)
    assert [r.block_ids for r in a] == [r.block_ids for r in b]
    assert [len(r.block_ids) for r in b] == [-(-r.num_computed_tokens // 4) for r in b]
    assert [(c.request.request_id, c.first) for c in one.take_changed_tables()] == [
        (c.request.request_id, c.first) for c in batch.take_changed_tables()
    ]
    assert one.pool.num_cached_blocks == batch.pool.num_cached_blocks
    assert one.num_free_blocks == batch.num_free_blocks
    # The last request's third block, full with its output token, is published as its fourth opens:
    # a later request with that sequence as its prompt hits it.
    for kv, r in ((one, a[4]), (batch, b[4])):
        probe = Request("probe", r.all_token_ids + [7], SamplingParams(), max_tokens=1, seed=0)
        assert kv.get_computed_blocks(probe) == 12 and probe.block_ids == r.block_ids[:3]


@pytest.mark.parametrize("tokens_per_grow", [1, 5])
def test_decoded_blocks_of_output_tokens_are_hit_by_a_later_prompt(tokens_per_grow: int) -> None:
    """Blocks holding only output tokens (what decode steps fill, published by grow_tables' inline
    path) are cached under the tokens and parent a prefix lookup checks: a request whose prompt is
    the whole decoded sequence reuses every full block, and one whose prompt differs in a single
    output token reuses only the blocks before it."""
    kv = KVCacheManager(num_blocks=40, block_size=4, enable_caching=True)
    (r,) = _decoding(kv, [[1, 2, 3, 4]])
    outputs = iter(range(200, 230))
    while r.num_output_tokens < 13:
        r.num_computed_tokens += tokens_per_grow
        kv.grow_tables([r])
        r.output_token_ids += [next(outputs) for _ in range(tokens_per_grow)]
    r.num_computed_tokens += tokens_per_grow  # the next step opens a block: 0-3 are full, known
    kv.grow_tables([r])
    assert r.num_tokens >= 17 and len(r.block_ids) >= 5
    full = Request("full", r.all_token_ids[:16] + [7], SamplingParams(), max_tokens=1, seed=0)
    assert kv.get_computed_blocks(full) == 16 and full.block_ids == r.block_ids[:4]
    changed = r.all_token_ids[:16]
    changed[10] += 1
    probe = Request("probe", changed + [7], SamplingParams(), max_tokens=1, seed=0)
    assert kv.get_computed_blocks(probe) == 8 and probe.block_ids == r.block_ids[:2]


def test_grow_tables_short_pool_raises_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_caching=True)  # 4 usable blocks
    reqs = _decoding(kv, [[1, 2, 3, 4], [5, 6, 7, 8]])
    for r in reqs:
        r.num_computed_tokens += 5  # 9 tokens: two more blocks each, 2 free
    before = [list(r.block_ids) for r in reqs]
    with pytest.raises(ValueError, match="only 2 free"):
        kv.grow_tables(reqs)
    assert [r.block_ids for r in reqs] == before and kv.num_free_blocks == 2
    assert kv.take_changed_tables() == []


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / incref / free / double-free sequences against a reference model
    (a multiset of the references the test holds)."""

    @initialize(num_blocks=st.integers(2, 12))
    def setup(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.refs: Counter[int] = Counter()

    @rule(n=st.integers(0, 13))
    def allocate(self, n: int) -> None:
        free_before = self.pool.num_free_blocks
        if n > free_before:
            with pytest.raises(ValueError):
                self.pool.allocate(n)
            return
        blocks = self.pool.allocate(n)
        assert len(set(blocks)) == n
        for b in blocks:
            assert b != NULL_BLOCK_ID and self.refs[b] == 0, "handed out a block in use"
            self.refs[b] = 1

    @precondition(lambda self: +self.refs)
    @rule(data=st.data())
    def incref(self, data: st.DataObject) -> None:
        blocks = data.draw(st.lists(st.sampled_from(sorted(+self.refs)), min_size=1, max_size=4))
        self.pool.incref(blocks)
        self.refs.update(blocks)

    @precondition(lambda self: +self.refs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        held = sorted(self.refs.elements())
        idx = data.draw(st.lists(st.integers(0, len(held) - 1), min_size=1, max_size=len(held), unique=True))
        blocks = [held[i] for i in idx]
        self.pool.free(blocks)
        self.refs.subtract(blocks)

    @rule(data=st.data())
    def double_free_raises(self, data: st.DataObject) -> None:
        b = data.draw(st.integers(1, self.pool.num_blocks - 1))
        extra = data.draw(st.integers(1, 2))
        before = [self.pool.ref_count(x) for x in range(1, self.pool.num_blocks)]
        with pytest.raises(ValueError, match="double free"):
            self.pool.free([b] * (self.refs[b] + extra))
        assert before == [self.pool.ref_count(x) for x in range(1, self.pool.num_blocks)]

    @invariant()
    def accounting_holds(self) -> None:
        pool = self.pool
        counts = [pool.ref_count(b) for b in range(1, pool.num_blocks)]
        assert all(c >= 0 for c in counts)
        assert counts == [self.refs[b] for b in range(1, pool.num_blocks)]
        used = sum(c >= 1 for c in counts)
        assert pool.num_free_blocks + used == pool.num_usable_blocks
        # Every block is free xor referenced: the free queue holds exactly the ref-0 blocks.
        assert sorted(pool._free_queue) == [b for b, c in enumerate(counts, 1) if c == 0]
        assert pool.usage == pytest.approx(used / pool.num_usable_blocks)

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.free(list(self.refs.elements()))
        assert self.pool.num_free_blocks == self.pool.num_usable_blocks
        everything = self.pool.allocate(self.pool.num_usable_blocks)
        assert sorted(everything) == list(range(1, self.pool.num_blocks))


class KVCacheManagerMachine(RuleBasedStateMachine):
    """Requests grow and are freed in random order; block tables stay exact and disjoint."""

    @initialize(num_blocks=st.integers(2, 16), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.kv = KVCacheManager(num_blocks, block_size)
        self.live: list[Request] = []
        self.counter = 0

    @rule(num_tokens=st.integers(1, 20))
    def new_request(self, num_tokens: int) -> None:
        self.counter += 1
        req = make_request(str(self.counter), num_tokens)
        self._grow(req, num_tokens)
        if req.num_computed_tokens:
            self.live.append(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), num_new=st.integers(1, 9))
    def grow(self, data: st.DataObject, num_new: int) -> None:
        self._grow(data.draw(st.sampled_from(self.live)), num_new)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        req = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.kv.free(req)
        assert req.block_ids == []

    def _grow(self, req: Request, num_new: int) -> None:
        free_before, blocks_before = self.kv.num_free_blocks, list(req.block_ids)
        missing = self.kv.blocks_needed(req.num_computed_tokens + num_new) - len(req.block_ids)
        ok = self.kv.allocate_slots(req, num_new)
        assert ok == (missing <= free_before)
        if ok:
            req.num_computed_tokens += num_new
            assert req.block_ids[: len(blocks_before)] == blocks_before
        else:
            assert req.block_ids == blocks_before and self.kv.num_free_blocks == free_before

    @invariant()
    def block_tables_exact_and_disjoint(self) -> None:
        all_blocks = [b for r in self.live for b in r.block_ids]
        assert len(all_blocks) == len(set(all_blocks)) and NULL_BLOCK_ID not in all_blocks
        for r in self.live:
            assert len(r.block_ids) == self.kv.blocks_needed(r.num_computed_tokens)
            assert all(self.kv.pool.ref_count(b) == 1 for b in r.block_ids)
        assert self.kv.num_free_blocks + len(all_blocks) == self.kv.pool.num_usable_blocks

    def teardown(self) -> None:
        for r in getattr(self, "live", []):
            self.kv.free(r)
        if hasattr(self, "kv"):
            assert self.kv.num_free_blocks == self.kv.pool.num_usable_blocks


_machine_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = _machine_settings
TestKVCacheManagerMachine = KVCacheManagerMachine.TestCase
TestKVCacheManagerMachine.settings = _machine_settings
