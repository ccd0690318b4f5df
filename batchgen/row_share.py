"""Which input rows one rank of a data-parallel job generates.

The rule, a pure function of (row index, world size W, committed set, row count N):
- N is the input's row count known up front (Parquet footers, the JSONL line count), the one
  rank 0 saw, sent to every rank with the committed set; 0 when the input has none up front.
- In input order, number the rows below N that no committed shard holds 0 .. P-1; rank r
  generates the rows numbered floor(r P / W) .. floor((r + 1) P / W) - 1: one contiguous block
  of the rows still to do each, in rank order, the blocks' sizes differing by at most one.
- Rows at or past N (none when the count is exact; every row of an input without one) are
  numbered among themselves, still to do only, 0, 1, 2, ...; rank r takes those numbered
  r, r + W, r + 2W, ...
Every rank is given the same committed set and N before any rank starts, so every rank
shares the rows alike: no row is generated twice and none is skipped, whatever world size the
earlier runs of the job had. Numbering only the rows still to do keeps the shares even on a
resume, whichever rows were committed. Contiguous blocks let a rank read only the part of the
input its rows are in (batchgen/io/rank_reads.py).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Set
from dataclasses import dataclass


@dataclass(frozen=True)
class RowShare:
    """This process's place among the ranks that share a job's rows (alone: 0 of 1)."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")

    def rows(self, num_rows: int | None, done: Set[int]) -> RankRows:
        """This rank's rows of an input of `num_rows` rows (None: not known up front)."""
        return RankRows(self, num_rows or 0, done)


ALONE = RowShare()


class RankRows:
    """The rows one rank generates (the rule above), asked row by row in input order."""

    def __init__(self, share: RowShare, num_rows: int, done: Set[int]) -> None:
        self.share = share
        self.num_rows = num_rows  # N: rows below it are shared out in blocks
        # this rank's rows below N: ascending, disjoint, none of them committed
        self.blocks: list[range] = _blocks(share, num_rows, done)
        self._starts = [b.start for b in self.blocks]

    def owns(self, index: int, past: int) -> bool:
        """Whether the row at `index` (not committed) is this rank's; past: rows still to do
        at or past N before it (counts only when index >= N)."""
        if index >= self.num_rows:
            return past % self.share.world_size == self.share.rank
        return self._in_blocks(index)

    def reads(self, index: int) -> bool:
        """Whether a reader must read the row whole: one of this rank's blocks, or past N."""
        return index >= self.num_rows or self._in_blocks(index)

    def overlaps(self, start: int, stop: int) -> bool:
        """Whether any row in [start, stop) must be read whole."""
        if stop <= start:
            return False
        if stop > self.num_rows:
            return True
        k = bisect.bisect_left(self._starts, stop) - 1  # the last block starting before stop
        return k >= 0 and self.blocks[k].stop > start

    def span(self, start: int, stop: int) -> range:
        """The shortest range of [start, stop) holding every row that must be read whole
        (empty when none)."""
        if stop > self.num_rows:
            last = stop
        else:
            k = bisect.bisect_left(self._starts, stop) - 1  # the last block starting before stop
            last = min(stop, self.blocks[k].stop) if k >= 0 else start
        if start >= self.num_rows:
            return range(start, max(start, last))
        k = bisect.bisect_right(self._starts, start) - 1  # the block holding start, if any
        first = start if k >= 0 and start < self.blocks[k].stop else None
        if first is None:
            later = bisect.bisect_right(self._starts, start)
            first = self._starts[later] if later < len(self.blocks) else self.num_rows
        first = min(first, stop)
        return range(first, max(first, last))

    def _in_blocks(self, index: int) -> bool:
        k = bisect.bisect_right(self._starts, index) - 1
        return k >= 0 and index < self.blocks[k].stop


def _blocks(share: RowShare, num_rows: int, done: Set[int]) -> list[range]:
    """Rank `share.rank`'s block of the rows below num_rows not in done, as index ranges."""
    committed = sorted(i for i in done if 0 <= i < num_rows)
    pending = num_rows - len(committed)
    world, rank = share.world_size, share.rank
    lo, hi = rank * pending // world, (rank + 1) * pending // world  # pending positions
    out: list[range] = []
    start, seen = 0, 0  # the gap [start, stop) is still to do; seen: pending rows before it
    for stop in itertools.chain(committed, [num_rows]):
        if seen >= hi:
            break
        first, last = max(lo, seen), min(hi, seen + stop - start)  # positions in this gap
        if first < last:
            out.append(range(start + first - seen, start + last - seen))
        seen += stop - start
        start = stop + 1
    return out
