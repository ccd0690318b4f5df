"""Paged KV-cache bookkeeping: which blocks each request owns. Plain Python, no tensors."""

from __future__ import annotations

from collections.abc import Sequence

from batchgen.engine.prefix_cache import PrefixCache, block_hashes
from batchgen.engine.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    """Owns the free list of KV blocks; a request's block_table grows as its tokens do.

    A block may be shared (the prompt blocks of a request's n samples, a cached prefix): it
    carries a reference count. With prefix caching, a full prompt block is cached once the step
    writing its last token is scheduled, and when its last reference goes it waits in the
    cache's LRU pool, found again by later prompts, until an allocation needs it.
    Invariants: a block is free xor pooled xor referenced; free blocks are uncached; a count
    equals the live tables holding the block; a table holds a cached block only at the index
    whose prompt hash it is.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = enable_caching
        self.cache = PrefixCache()
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, ...
        self._refs: dict[int, int] = {}
        self._holders: dict[int, Request] = {}  # id(request) -> request, for the invariant check

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones, then pooled cached ones."""
        return len(self._free) + self.cache.num_pooled

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Blocks to add so that request's table covers positions [0, num_tokens)."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(request.block_table))

    def cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks that request (with an empty table) may start from: its longest cached
        prompt prefix, short of the block holding its newest token (always computed, so that
        the step samples from real logits and no cached block is written again)."""
        if not self.caching or request.block_table:
            return []
        usable = (request.num_tokens - 1) // self.block_size
        return self.cache.match(self._hashes(request)[:usable])

    def can_allocate(self, request: Request, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Would allocate(request, num_tokens, cached) succeed?"""
        needed = self.blocks_needed(request, num_tokens) - len(cached)
        if not cached:
            return needed <= len(self._free) + self.cache.num_pooled
        taken = sum(self.cache.is_pooled(b) for b in cached)  # pooled, but about to be claimed
        return needed <= self.num_free_blocks - taken

    def allocate(self, request: Request, num_tokens: int, cached: Sequence[int] = ()) -> None:
        """Grow request's table to cover num_tokens, starting from `cached` (for an empty table:
        cached_prefix's answer, or prompt blocks another sample of the prompt holds); the
        caller checked can_allocate. Full prompt blocks in [0, num_tokens) are cached: the
        caller schedules the step that writes them."""
        if not self.can_allocate(request, num_tokens, cached):
            raise RuntimeError(f"allocate: {num_tokens} tokens do not fit")
        if cached:
            self._attach(request, cached)
            request.num_hashed_blocks = len(cached)
        for _ in range(self.blocks_needed(request, num_tokens)):
            block = self._free.pop() if self._free else self.cache.evict()
            self._refs[block] = 1
            request.block_table.append(block)
        if request.block_table:
            self._holders[id(request)] = request
        hashes = request.block_hashes
        if self.caching and (hashes is None or request.num_hashed_blocks < len(hashes)):
            self._cache_full_blocks(request, num_tokens)  # a decode skips this: all are seen

    def free(self, request: Request) -> None:
        """Drop request's references; the tail first, so its blocks leave the cache first."""
        for block in reversed(request.block_table):
            self._refs[block] -= 1
            if not self._refs[block]:
                del self._refs[block]
                if not self.cache.park(block):
                    self._free.append(block)
        request.block_table = []
        request.num_hashed_blocks = 0
        self._holders.pop(id(request), None)

    def clear_cache(self) -> None:
        """Forget every cached block (a step that was scheduled failed to launch, so some may
        describe KV that was never written)."""
        self._free.extend(self.cache.clear())

    def _attach(self, request: Request, blocks: Sequence[int]) -> None:
        for block in blocks:
            count = self._refs.get(block, 0)
            if not count:
                self.cache.claim(block)
            self._refs[block] = count + 1
            request.block_table.append(block)
        if request.block_table:
            self._holders[id(request)] = request

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        hashes = self._hashes(request)
        done = min(num_tokens // self.block_size, len(hashes))
        for i in range(request.num_hashed_blocks, done):
            self.cache.add(request.block_table[i], hashes[i])
        request.num_hashed_blocks = max(done, request.num_hashed_blocks)

    def _hashes(self, request: Request) -> list[bytes]:
        if request.block_hashes is None:  # once per request: its prompt never changes
            request.block_hashes = block_hashes(request.prompt_token_ids, self.block_size)
        return request.block_hashes

    def check_released(self) -> None:
        """Raise AssertionError unless every block is free or pooled (no request holds one):
        what must hold when all requests have ended, checked in O(1) (check_invariants walks
        every block: ~0.1 s for 252k blocks, too slow for the end of every generate call)."""
        assert not self._refs and not self._holders, "blocks are held after every request ended"
        assert len(self._free) + self.cache.num_pooled == self.num_blocks, "a block is lost"

    def check_invariants(self) -> None:
        """Raise AssertionError if bookkeeping is inconsistent (tests call this)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert free.isdisjoint(self._refs), "a block is both free and referenced"
        pooled = self.cache.pooled_blocks()
        assert all(0 <= b < self.num_blocks for b in pooled), "a pooled block is out of range"
        assert pooled.isdisjoint(free) and pooled.isdisjoint(self._refs), "pooled and in use"
        assert len(free) + len(pooled) + len(self._refs) == self.num_blocks, "a block is lost"
        assert all(self.cache.hash_of(b) is None for b in free), "a free block is cached"
        self.cache.check_invariants()
        held: dict[int, int] = {}
        for request in self._holders.values():
            table = request.block_table
            assert len(set(table)) == len(table), f"{request.request_id} holds a block twice"
            for i, block in enumerate(table):
                held[block] = held.get(block, 0) + 1
                h = self.cache.hash_of(block)
                assert h is None or (
                    i < request.num_hashed_blocks and h == self._hashes(request)[i]
                ), f"{request.request_id} holds cached block {block} at another prefix"
        assert held == self._refs, "reference counts differ from the tables holding blocks"
