"""Which input rows one rank of a data-parallel job generates.

The rule: in input order, number the rows that no committed shard holds 0, 1, 2, ...; rank r
of W ranks generates the rows numbered r, r + W, r + 2W, ... Every rank streams the whole
input and is given the same committed set (rank 0 reads it and sends it to every rank before
any rank starts), so every rank numbers the rows alike: no row is generated twice and none is
skipped, whatever world size the earlier runs of the job had. Numbering only the rows still
to do (not every row) keeps the shares equal on a resume, whichever rows were committed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowShare:
    """This process's place among the ranks that share a job's rows (alone: 0 of 1)."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")

    def owns(self, pending: int) -> bool:
        """Whether the row numbered `pending` among the rows still to do is this rank's."""
        return pending % self.world_size == self.rank


ALONE = RowShare()
