"""Paged KV-cache bookkeeping: which blocks each request owns. Plain Python, no tensors."""

from __future__ import annotations

from batchgen.engine.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    """Owns the free list of KV blocks; a request's block_table grows as its tokens do.

    Invariant: every block is either free or in exactly one live request's block table.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, ...
        self._owned: dict[int, Request] = {}

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
            self._owned[block] = request
            request.block_table.append(block)

    def can_append(self, request: Request) -> bool:
        return self.can_allocate(request, request.num_computed_tokens + 1)

    def append_slot(self, request: Request) -> None:
        self.allocate(request, request.num_computed_tokens + 1)

    def free(self, request: Request) -> None:
        for block in reversed(request.block_table):
            del self._owned[block]
            self._free.append(block)
        request.block_table = []

    def check_invariants(self) -> None:
        """Raise AssertionError if bookkeeping is inconsistent (tests call this)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert free.isdisjoint(self._owned), "a block is both free and owned"
        assert len(free) + len(self._owned) == self.num_blocks, "a block is lost"
        for request in {id(r): r for r in self._owned.values()}.values():
            table = request.block_table
            assert len(set(table)) == len(table), f"{request.request_id} holds a block twice"
            assert all(self._owned.get(b) is request for b in table), "block owner mismatch"
        assert sum(
            len(r.block_table) for r in {id(r): r for r in self._owned.values()}.values()
        ) == len(self._owned), "owned blocks missing from a table"
