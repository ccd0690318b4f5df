"""Prefix cache bookkeeping: the hash chain, reuse, the LRU pool and eviction, invariants."""

from __future__ import annotations

import random

import pytest

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.prefix_cache import CacheStats, block_hashes
from batchgen.engine.request import Request
from batchgen.engine.sampling_params import SamplingParams

BS = 4


def req(name: str, prompt: list[int]) -> Request:
    return Request(name, list(prompt), SamplingParams(), 0, 10**6, frozenset())


def admit(bm: BlockManager, r: Request, extra: int = 0) -> list[int]:
    """What the scheduler does at admission: start from the cached prefix, compute the rest."""
    cached = bm.cached_prefix(r)
    end = r.num_tokens + extra
    assert bm.can_allocate(r, end, cached)
    bm.allocate(r, end, cached)
    r.num_computed_tokens = end
    bm.check_invariants()
    return cached


def test_hash_chain_covers_every_token_before_a_block() -> None:
    a = block_hashes(list(range(10)), BS)
    assert len(a) == 2  # the partial third block has no hash
    assert block_hashes([*range(8), 99, 98], BS) == a  # the partial block changes nothing
    b = block_hashes([7, *range(1, 10)], BS)  # first token differs
    assert b[0] != a[0] and b[1] != a[1]  # ... and so does every later block's hash
    c = block_hashes([*range(4), 0, 5, 6, 7], BS)
    assert c[0] == a[0] and c[1] != a[1]
    assert block_hashes([1, 2, 3, 4], BS) != block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)[1:]


def test_second_request_reuses_the_prefix_blocks() -> None:
    bm = BlockManager(16, BS, enable_caching=True)
    a = req("a", list(range(14)))  # 3 full blocks + 2 tokens
    assert admit(bm, a) == []
    b = req("b", [*range(12), 50, 51, 52])  # shares 3 blocks, then differs
    cached = admit(bm, b)
    assert cached == a.block_table[:3] and b.block_table[:3] == cached
    assert b.block_table[3] != a.block_table[3]
    c = req("c", list(range(6)) + [77] * 6)  # shares one block only
    assert admit(bm, c) == a.block_table[:1]
    assert bm.num_free_blocks == 16 - 4 - 1 - 2


def test_the_block_of_the_newest_token_is_never_reused() -> None:
    """An exact duplicate recomputes its last token: the block holding it is its own copy."""
    bm = BlockManager(16, BS, enable_caching=True)
    a = req("a", list(range(12)))  # exactly 3 full blocks
    admit(bm, a)
    dup = req("dup", list(range(12)))
    assert admit(bm, dup) == a.block_table[:2]
    assert dup.block_table[2] != a.block_table[2]
    short = req("short", list(range(9)))  # a prefix of a: 2 full blocks + 1 token
    assert admit(bm, short) == a.block_table[:2]
    tiny = req("tiny", list(range(4)))  # one full block, which holds its newest token
    assert admit(bm, tiny) == []


def test_freed_cached_blocks_stay_found_until_evicted_lru_first() -> None:
    bm = BlockManager(5, BS, enable_caching=True)
    a = req("a", [*range(8), 1])  # blocks: 2 cached + 1 partial
    admit(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 5  # pooled blocks count as allocatable
    bm.check_invariants()
    b = req("b", [9] * 9)  # 3 blocks: the 3 uncached free ones go first
    admit(bm, b)
    assert not set(b.block_table) & set(a_blocks[:2])
    assert bm.cached_prefix(req("again", [*range(8), 5])) == a_blocks[:2]
    c = req("c", [8] * 3)  # the free list is empty: evict the least recently used
    admit(bm, c)
    assert c.block_table == [a_blocks[1]]  # a's tail went to the pool first, so it goes first
    assert bm.cached_prefix(req("again", [*range(8), 5])) == a_blocks[:1]
    bm.check_invariants()


def test_claiming_a_pooled_block_takes_it_out_of_the_pool() -> None:
    bm = BlockManager(4, BS, enable_caching=True)
    a = req("a", list(range(9)))
    admit(bm, a)
    first_two = a.block_table[:2]
    bm.free(a)
    b = req("b", list(range(9)))
    # 2 pooled blocks claimed + 1 new one: fits in 4 even though only 2 blocks are unpooled
    assert bm.can_allocate(b, 9, first_two)
    assert not bm.can_allocate(b, 9 + 2 * BS, first_two)
    admit(bm, b)
    assert b.block_table[:2] == first_two and bm.num_free_blocks == 1


def test_duplicate_copies_of_a_block_stay_uncached() -> None:
    """Two requests that computed the same block side by side: the first one is cached."""
    bm = BlockManager(8, BS, enable_caching=True)
    a, b = req("a", list(range(6))), req("b", list(range(6)))
    bm.allocate(a, 6)
    bm.allocate(b, 6)  # neither asked the cache (as if admitted in the same instant)
    bm.check_invariants()
    bm.free(b)
    bm.free(a)
    assert bm.num_free_blocks == 8
    assert bm.cache.num_pooled == 1  # only a's copy of block 0 is cached
    bm.check_invariants()


def test_caching_off_caches_nothing() -> None:
    bm = BlockManager(8, BS, enable_caching=False)
    a = req("a", list(range(9)))
    admit(bm, a)
    bm.free(a)
    assert bm.cached_prefix(req("b", list(range(9)))) == []
    assert bm.cache.num_pooled == 0 and len(bm._free) == 8


def test_clear_cache_returns_pooled_blocks_to_the_free_list() -> None:
    bm = BlockManager(8, BS, enable_caching=True)
    a, b = req("a", list(range(9))), req("b", [3] * 9)
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    bm.clear_cache()
    bm.check_invariants()
    assert bm.cached_prefix(req("c", list(range(9)))) == []
    assert len(bm._free) == 5 and bm.cache.num_pooled == 0


@pytest.mark.parametrize("seed", range(12))
def test_random_shared_prefix_sequences_keep_invariants(seed: int) -> None:
    """Admit (from the cache), grow and free requests drawn from a few shared prefixes."""
    rng = random.Random(seed)
    bm = BlockManager(
        num_blocks=rng.randint(4, 30), block_size=rng.choice([1, 2, 4]), enable_caching=True
    )
    prefixes = [[rng.randrange(20) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    live: list[Request] = []
    reused = 0
    for step in range(300):
        op = rng.random()
        if op < 0.4:
            prompt = rng.choice(prefixes) + [rng.randrange(20) for _ in range(rng.randint(1, 6))]
            r = req(str(step), prompt)
            cached = bm.cached_prefix(r)
            if bm.can_allocate(r, r.num_tokens, cached):
                bm.allocate(r, r.num_tokens, cached)
                r.num_computed_tokens = r.num_tokens
                live.append(r)
                reused += len(cached)
        elif op < 0.8 and live:
            r = rng.choice(live)
            if bm.can_allocate(r, r.num_computed_tokens + 1):
                bm.allocate(r, r.num_computed_tokens + 1)
                r.num_computed_tokens += 1
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        bm.check_invariants()
        in_tables = len({b for r in live for b in r.block_table})
        assert bm.num_free_blocks + in_tables == bm.num_blocks
    assert reused > 0


def test_invariant_check_catches_a_cached_block_on_the_free_list() -> None:
    bm = BlockManager(4, BS, enable_caching=True)
    a = req("a", list(range(9)))
    admit(bm, a)
    bm.free(a)
    pooled = bm.cache.evict()  # taken out of the cache ...
    bm.cache.add(pooled, b"x" * 16)  # ... and cached again, but put on the free list
    bm._free.append(pooled)
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_invariant_check_catches_a_table_holding_a_block_cached_for_another_prefix() -> None:
    bm = BlockManager(8, BS, enable_caching=True)
    a, b = req("a", list(range(9))), req("b", [5] * 9)
    admit(bm, a)
    admit(bm, b)
    bm.cache.add(b.block_table[2], a.block_hashes[0] + b"")  # a hash a's block 0 already has
    bm.check_invariants()  # refused by add: nothing changed
    bm.cache._hash[b.block_table[2]] = b"y" * 16  # corrupt: b's partial block looks cached
    bm.cache._block[b"y" * 16] = b.block_table[2]
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_cache_stats_hit_rate() -> None:
    assert CacheStats().hit_rate == 0.0
    s = CacheStats(100, 25) - CacheStats(20, 5)
    assert s == CacheStats(80, 20) and s.hit_rate == 0.25
