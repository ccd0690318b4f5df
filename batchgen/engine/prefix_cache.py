"""Automatic prefix caching: full KV blocks found again by the tokens they and all before hold.

A block's hash covers its own tokens and, through its parent's hash, every token before it, so
equal hashes mean equal prefixes (a 128-bit BLAKE2b chain: a collision would silently reuse the
wrong KV, so no 64-bit or Python hash). Plain Python, no tensors.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

BlockHash = bytes


def block_hashes(tokens: Sequence[int], block_size: int) -> list[BlockHash]:
    """The hash chain of the full blocks: entry i stands for tokens [0, (i + 1) * block_size)."""
    data = array("q", tokens).tobytes()
    width = block_size * 8
    out: list[BlockHash] = []
    parent = b""
    for i in range(len(tokens) // block_size):
        parent = hashlib.blake2b(
            parent + data[i * width : (i + 1) * width], digest_size=16
        ).digest()
        out.append(parent)
    return out


class CacheStats(NamedTuple):
    """Prompt tokens of admitted requests, and how many of them came from the prefix cache
    (counted at a request's first admission; n > 1 samples count one prompt each)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def __sub__(self, other: CacheStats) -> CacheStats:  # type: ignore[override]
        return CacheStats(
            self.prompt_tokens - other.prompt_tokens, self.cached_tokens - other.cached_tokens
        )


class PrefixCache:
    """hash <-> block for blocks whose KV is written (or being written by a launched step), and
    the LRU pool of those no table references (evictable, oldest first).

    Invariants: _block and _hash are inverse maps; every pooled block is cached. Whether a
    block is referenced is the BlockManager's to know: it parks and claims blocks here.
    """

    def __init__(self) -> None:
        self._block: dict[BlockHash, int] = {}
        self._hash: dict[int, BlockHash] = {}
        self._pool: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0  # blocks evicted so far (a profile counts them per step)

    @property
    def num_pooled(self) -> int:
        return len(self._pool)

    def match(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest cached prefix of the chain."""
        out = []
        for h in hashes:
            block = self._block.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def add(self, block: int, h: BlockHash) -> None:
        """Cache a block whose tokens the chain entry h stands for; a hash already cached for
        another block keeps that block (the newer copy stays uncached and is freed as usual)."""
        if h not in self._block and block not in self._hash:
            self._block[h] = block
            self._hash[block] = h

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash.get(block)

    def is_pooled(self, block: int) -> bool:
        return block in self._pool

    def pooled_blocks(self) -> set[int]:
        return set(self._pool)

    def park(self, block: int) -> bool:
        """The block's last reference went: pool it as the most recently used if it is cached.
        -> False if it is not (then it belongs on the free list)."""
        if block not in self._hash:
            return False
        self._pool[block] = None
        return True

    def claim(self, block: int) -> None:
        """A table takes a reference to a cached block: it leaves the pool if it was there."""
        self._pool.pop(block, None)

    def evict(self) -> int:
        """Take the least recently used pooled block out of the cache; -> the block."""
        block, _ = self._pool.popitem(last=False)
        del self._block[self._hash.pop(block)]
        self.num_evictions += 1
        return block

    def clear(self) -> list[int]:
        """Forget every hash; -> the pooled blocks (now plain free blocks)."""
        pooled = list(self._pool)
        self._pool.clear()
        self._block.clear()
        self._hash.clear()
        return pooled

    def check_invariants(self) -> None:
        assert len(self._block) == len(self._hash), "a hash maps to two blocks"
        assert all(self._hash.get(b) == h for h, b in self._block.items()), "maps disagree"
        assert all(b in self._hash for b in self._pool), "a pooled block is not cached"
