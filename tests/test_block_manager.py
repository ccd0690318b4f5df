"""Block manager: invariants under random allocate / append / free sequences."""

from __future__ import annotations

import random

import pytest

from batchgen.engine.block_manager import BlockManager, blocks_for
from batchgen.engine.request import Request
from batchgen.engine.sampling_params import SamplingParams


def make_request(i: int, prompt_len: int = 5) -> Request:
    return Request(str(i), list(range(prompt_len)), SamplingParams(), 0, 10**6, frozenset())


def test_allocate_covers_tokens_and_free_returns_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    r = make_request(0)
    assert bm.can_allocate(r, 9)
    bm.allocate(r, 9)
    assert len(r.block_table) == 3 and bm.num_free_blocks == 5
    bm.allocate(r, 12)  # still 3 blocks
    assert len(r.block_table) == 3
    bm.check_invariants()
    bm.free(r)
    assert r.block_table == [] and bm.num_free_blocks == 8
    bm.check_invariants()


def test_cannot_allocate_past_capacity() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    r = make_request(0)
    assert not bm.can_allocate(r, 9)
    with pytest.raises(RuntimeError):
        bm.allocate(r, 9)
    bm.check_invariants()  # a refused allocation changes nothing
    assert bm.num_free_blocks == 2


def test_one_more_token_grows_at_block_boundary() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    r = make_request(0)
    bm.allocate(r, 4)
    r.num_computed_tokens = 4
    assert bm.can_allocate(r, 5)
    bm.allocate(r, 5)
    assert len(r.block_table) == 2


@pytest.mark.parametrize("seed", range(20))
def test_random_sequences_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=rng.randint(1, 40), block_size=rng.choice([1, 4, 16]))
    live: list[Request] = []
    for step in range(300):
        op = rng.random()
        if op < 0.4:
            r = make_request(step)
            n = rng.randint(1, 60)
            if bm.can_allocate(r, n):
                bm.allocate(r, n)
                r.num_computed_tokens = n
                live.append(r)
                assert len(r.block_table) == blocks_for(n, bm.block_size)
        elif op < 0.8 and live:
            r = rng.choice(live)
            if bm.can_allocate(r, r.num_computed_tokens + 1):
                before = bm.num_free_blocks
                bm.allocate(r, r.num_computed_tokens + 1)
                r.num_computed_tokens += 1
                grew = r.num_computed_tokens % bm.block_size == 1 or bm.block_size == 1
                assert bm.num_free_blocks == before - int(grew)
            else:
                assert bm.num_free_blocks == 0
        elif live:
            r = live.pop(rng.randrange(len(live)))
            bm.free(r)
        bm.check_invariants()
        assert bm.num_free_blocks + sum(len(r.block_table) for r in live) == bm.num_blocks


def test_invariant_check_catches_corruption() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    r = make_request(0)
    bm.allocate(r, 8)
    bm._free.append(r.block_table[0])  # a block both free and owned
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_released_check_catches_a_held_or_lost_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    r = make_request(0, prompt_len=9)
    bm.allocate(r, 9)
    with pytest.raises(AssertionError, match="held"):
        bm.check_released()  # a request still holds blocks
    bm.free(r)
    bm.check_released()
    bm._free.pop()  # a block neither free, pooled nor held
    with pytest.raises(AssertionError, match="lost"):
        bm.check_released()
