"""Paged KV-cache bookkeeping: which blocks each request owns. Plain Python, no tensors."""

from __future__ import annotations

from batchgen.engine.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    """Owns the free list of KV blocks; a request's block_table grows as its tokens do.

    A block may be shared (the prompt blocks of a request's n samples): it carries a reference
    count and returns to the free list when the last table holding it lets go.
    Invariant: a block is free xor referenced, and its count equals the live tables holding it.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, ...
        self._refs: dict[int, int] = {}
        self._holders: dict[int, Request] = {}  # id(request) -> request, for the invariant check

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Blocks to add so that request's table covers positions [0, num_tokens)."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(request.block_table))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        return self.blocks_needed(request, num_tokens) <= len(self._free)

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Grow request's table to cover num_tokens; the caller checked can_allocate."""
        needed = self.blocks_needed(request, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"allocate: {needed} blocks needed, {len(self._free)} free")
        for _ in range(needed):
            block = self._free.pop()
            self._refs[block] = 1
            request.block_table.append(block)
        if request.block_table:
            self._holders[id(request)] = request

    def share(self, source: Request, target: Request, num_blocks: int) -> None:
        """target (with an empty table) starts with source's first num_blocks blocks."""
        if target.block_table:
            raise RuntimeError("share: the target already holds blocks")
        for block in source.block_table[:num_blocks]:
            self._refs[block] += 1
            target.block_table.append(block)
        if target.block_table:
            self._holders[id(target)] = target

    def free(self, request: Request) -> None:
        for block in reversed(request.block_table):
            self._refs[block] -= 1
            if not self._refs[block]:
                del self._refs[block]
                self._free.append(block)
        request.block_table = []
        self._holders.pop(id(request), None)

    def check_invariants(self) -> None:
        """Raise AssertionError if bookkeeping is inconsistent (tests call this)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert free.isdisjoint(self._refs), "a block is both free and referenced"
        assert len(free) + len(self._refs) == self.num_blocks, "a block is lost"
        held: dict[int, int] = {}
        for request in self._holders.values():
            table = request.block_table
            assert len(set(table)) == len(table), f"{request.request_id} holds a block twice"
            for block in table:
                held[block] = held.get(block, 0) + 1
        assert held == self._refs, "reference counts differ from the tables holding blocks"
