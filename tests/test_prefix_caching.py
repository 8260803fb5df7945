"""Automatic prefix caching: exact reuse of cached prompt blocks, LRU eviction, salts, and
outputs identical with the cache on and off."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.block_hash import hash_block
from jaxpaged.kv_cache_manager import KVCacheManager
from jaxpaged.request import Request
from tiny_models import hf_greedy

BS = 8


def make(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(), max_tokens=4, seed=0, cache_salt=salt)


def compute(kv: KVCacheManager, req: Request) -> int:
    """Admit like the scheduler does (prefix lookup, then allocate the rest); returns tokens hit."""
    hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
    req.num_computed_tokens = req.num_tokens
    return hit


def test_partial_prefix_hit_reuses_the_same_physical_blocks():
    kv = KVCacheManager(32, BS, enable_caching=True)
    a = make("a", range(100, 140))
    compute(kv, a)
    b = make("b", list(range(100, 120)) + [1, 2, 3, 4, 5])
    assert compute(kv, b) == 16  # two full blocks of the shared 20 tokens
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]
    assert kv.pool.ref_count(a.block_ids[0]) == 2
    assert kv.stats.hits == 16 and kv.stats.queries == 40 + 25


def test_block_aligned_full_hit_still_computes_the_last_block():
    kv = KVCacheManager(32, BS, enable_caching=True)
    a = make("a", range(32))
    compute(kv, a)
    b = make("b", range(32))
    assert compute(kv, b) == 24  # 3 of 4 blocks: the last token is recomputed
    assert b.block_ids[:3] == a.block_ids[:3]


def test_a_preempted_request_resumes_on_its_cached_blocks_without_hashing_again():
    """Recomputation frees a request's blocks (they stay cached) but not its block hashes, which
    depend on its tokens only: resuming, it hits all its full blocks, publishes them again, and
    hashes no block a second time."""
    calls = []

    def counting_hash(parent, tokens):
        calls.append(tuple(tokens))
        return hash_block(parent, tokens)

    kv = KVCacheManager(32, BS, enable_caching=True, hash_fn=counting_hash)
    a = make("a", range(100, 133))  # 4 full blocks and one token
    compute(kv, a)
    blocks, hashed = list(a.block_ids[:4]), len(calls)
    assert hashed == 4
    kv.free(a)
    a.num_computed_tokens = 0
    assert compute(kv, a) == 32
    assert a.block_ids[:4] == blocks and len(calls) == hashed
    assert a.num_published_blocks == 4


@pytest.mark.parametrize("filler_blocks, expected_hit", [(0, 24), (7, 8), (8, 0)])
def test_freed_blocks_stay_cached_until_evicted_lru(filler_blocks, expected_hit):
    """A's 4 blocks are freed last-first, so eviction takes its tail before its first block."""
    kv = KVCacheManager(9, BS, enable_caching=True)  # 8 usable blocks
    a = make("a", range(32))
    compute(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 8 and kv.pool.num_cached_blocks == 4
    if filler_blocks:
        filler = make("f", range(1000, 1000 + BS * filler_blocks))
        compute(kv, filler)
        kv.free(filler)
    assert compute(kv, make("c", range(32))) == expected_hit


@pytest.mark.parametrize(
    "hash_fn", [hash_block, lambda parent, tokens: hash(tuple(tokens))], ids=["chained", "root_blind"]
)
def test_different_salts_never_share(hash_fn):
    # root_blind: the salt never reaches the hash, so only the exact check of a first block's root
    # digest keeps tenants apart.
    kv = KVCacheManager(32, BS, enable_caching=True, hash_fn=hash_fn)
    compute(kv, make("a", range(40), salt="tenant-1"))
    assert compute(kv, make("b", range(40), salt="tenant-2")) == 0
    assert compute(kv, make("c", range(40))) == 0
    assert compute(kv, make("d", range(40), salt="tenant-1")) == 32


@pytest.mark.parametrize(
    "weak_hash",
    [
        lambda parent, tokens: b"same",  # everything collides
        lambda parent, tokens: bytes(str(list(tokens)), "ascii"),  # ignores the parent block
    ],
    ids=["constant", "parent_blind"],
)
def test_hash_collisions_never_reuse_a_different_prefix(weak_hash):
    kv = KVCacheManager(64, BS, enable_caching=True, hash_fn=weak_hash)
    W, Z, Y, Q = ([t] * BS for t in (11, 22, 33, 44))
    compute(kv, make("c", W + Y + [1]))  # caches Y after W
    compute(kv, make("a", Z + Q + [1]))  # caches Z (and Q after Z)
    b = make("b", Z + Y + [1])  # Y after Z was never computed
    hit = compute(kv, b)
    assert hit <= BS
    if hit:
        assert kv.pool.lookup(weak_hash(b"", Z), Z, kv._parent_key(b, [], 0)) == b.block_ids[0]
    assert compute(kv, make("w", W + Q + [1])) <= BS  # Q was cached after Z, not W


def test_random_sharing_keeps_pool_invariants():
    rng = random.Random(0)
    kv = KVCacheManager(40, 4, enable_caching=True)
    prefixes = [list(range(p * 100, p * 100 + 13)) for p in range(3)]
    live: list[Request] = []
    for step in range(400):
        if live and (rng.random() < 0.45 or kv.num_free_blocks < 6):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            toks = rng.choice(prefixes)[: rng.randint(1, 13)] + [
                rng.randint(1, 50) for _ in range(rng.randint(0, 6))
            ]
            r = make(f"r{step}", toks)
            hit = kv.get_computed_blocks(r)
            assert hit % 4 == 0 and hit < r.num_tokens
            if kv.allocate_slots(r, r.num_tokens - hit):
                r.num_computed_tokens = r.num_tokens
                live.append(r)
            else:
                kv.free(r)
        held = sum(len(r.block_ids) for r in live)
        refs = sum(kv.pool.ref_count(b) for b in range(1, 40))
        assert refs == held
        assert kv.num_free_blocks + sum(1 for b in range(1, 40) if kv.pool.ref_count(b) > 0) == 39
        for r in live:  # every shared block holds exactly r's tokens
            for i, b in enumerate(r.block_ids[: r.num_tokens // 4]):
                key = kv.pool._block_key[b]
                if key is not None:
                    assert list(key[1]) == r.token_ids_slice(4 * i, 4 * i + 4)
    for r in live:
        kv.free(r)
    assert kv.num_free_blocks == 39


# ---- engine level -----------------------------------------------------------------------

SP = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def long_model(tiny_model_factory):
    return tiny_model_factory("long_context", max_position_embeddings=2048)


def run(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SP, use_tqdm=False)]


def test_outputs_identical_with_cache_on_and_off(long_model):
    rng = np.random.default_rng(1)
    system = rng.integers(3, 350, 40).tolist()
    prompts = [system + rng.integers(3, 350, n).tolist() for n in (5, 13, 1)] + [system[:32], system[:17]]
    off = LLM(str(long_model[0]), block_size=8, enable_prefix_caching=False)
    on = LLM(str(long_model[0]), block_size=8, num_gpu_blocks_override=24)
    expected = [hf_greedy(long_model[1], p, 8)[0] for p in prompts]
    assert run(off, prompts) == expected
    # First pass fills the cache, second pass hits it (partial, block-aligned), and a third
    # after unrelated traffic that evicts part of it.
    assert run(on, prompts) == expected
    assert run(on, prompts) == expected
    assert on.engine.kv_cache_manager.stats.hits > 0
    run(on, [rng.integers(3, 350, 150).tolist()])
    assert run(on, prompts[::-1]) == expected[::-1]
    assert on.engine.kv_cache_manager.num_free_blocks == on.engine.cache_info.num_usable_blocks


def test_shared_1000_token_prefix_computes_only_the_suffix(long_model):
    llm = LLM(str(long_model[0]), block_size=16, max_num_batched_tokens=256)
    rng = np.random.default_rng(2)
    prefix = rng.integers(3, 350, 1000).tolist()
    first, second = prefix + [5, 6, 7], prefix + [8, 9, 10, 11]
    eng = llm.engine
    computed = []
    schedule = eng.scheduler.schedule

    def counting_schedule():
        out = schedule()
        computed.extend(n for r, n in zip(out.requests, out.num_new_tokens) if r.request_id == "second")
        return out

    eng.scheduler.schedule = counting_schedule
    llm.generate([first], SP, use_tqdm=False)
    eng.add_request("second", second, SP)
    while eng.has_unfinished_requests():
        eng.step()
    # 1000 // 16 = 62 full blocks are shared; the rest of the prompt (8 + 4 tokens) is computed,
    # then one token per decode step.
    assert computed[0] == len(second) - 62 * 16
    assert sum(computed) == len(second) - 62 * 16 + SP.max_tokens - 1


def test_llm_prompt_dicts_carry_a_cache_salt(long_model):
    """vLLM's prompt dicts: the same tokens under another salt hit nothing, under the same salt all their
    full blocks; text and token-id prompts mix; a malformed dict is refused before anything runs."""
    llm = LLM(str(long_model[0]), block_size=8)
    stats = llm.engine.kv_cache_manager.stats
    prompt = np.random.default_rng(3).integers(3, 350, 41).tolist()  # 5 full blocks
    expected = hf_greedy(long_model[1], prompt, 8)[0]

    def hits(prompts):
        before = stats.hits
        outs = llm.generate(prompts, SP, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [expected] * len(prompts)
        return stats.hits - before

    assert hits([{"prompt_token_ids": prompt, "cache_salt": "a"}]) == 0
    assert hits([{"prompt_token_ids": prompt, "cache_salt": "b"}]) == 0
    assert hits([{"prompt_token_ids": prompt, "cache_salt": "a"}, prompt]) == 40  # the unsalted one: a miss
    assert hits({"prompt_token_ids": prompt}) == 40
    text = llm.generate({"prompt": "hello there"}, SP, use_tqdm=False)[0]
    assert text.prompt_token_ids == llm.get_tokenizer().encode("hello there")
    for bad, match in (
        ({"prompt_token_ids": prompt, "salt": "a"}, r"unknown key\(s\) \['salt'\]"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one of"),
        ({"cache_salt": "a"}, "exactly one of"),
        ({"prompt": "x", "cache_salt": ""}, "non-empty string"),
    ):
        with pytest.raises(ValueError, match=match):
            llm.generate([prompt, bad], SP, use_tqdm=False)
    for salt in ("", 7):  # the engine's own check, under every way in
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            llm.engine.add_request("direct", prompt, SP, cache_salt=salt)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.cache_info.num_usable_blocks
