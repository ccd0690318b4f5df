"""The row share of data-parallel jobs: every rank streams the input, the ranks together
prepare each row still to do exactly once, and duplicate ids are flagged alike at any size."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.io import RawRow
from batchgen.pipeline import Producer
from batchgen.prompts import RowPrompt
from batchgen.row_share import RowShare


class EchoBuilder:
    def build_many(self, rows: list[tuple[int, dict]]) -> list[RowPrompt]:
        return [RowPrompt(i, str(v["uid"]), [1], {}, {}, None) for i, v in rows]


def prepared(ids: list[int], done: set[int], share: RowShare) -> list[RowPrompt]:
    """Every row one rank prepares, with the input read in batches of 3 rows."""
    rows = [RawRow(i, {"uid": uid}, None) for i, uid in enumerate(ids)]
    batches = iter([rows[i : i + 3] for i in range(0, len(rows), 3)])
    producer = Producer(batches, EchoBuilder(), done, "uid", 1, 8, threading.Event(), share=share)
    producer.start()
    out = []
    while (row := producer.next_row(5.0)) is not None:
        out.append(row)
    producer.join()
    assert producer.finished and producer.rows_read == len(ids)
    return out


@settings(max_examples=25, deadline=None)
@given(
    ids=st.lists(st.integers(0, 12), max_size=30),
    done_bits=st.lists(st.booleans(), max_size=30),
    world=st.integers(1, 4),
)
def test_ranks_prepare_every_pending_row_once_and_flag_duplicates_alike(ids, done_bits, world):
    done = {i for i, bit in enumerate(done_bits[: len(ids)]) if bit}
    alone = {row.index: row for row in prepared(ids, done, RowShare())}
    assert set(alone) == set(range(len(ids))) - done
    shares = [prepared(ids, done, RowShare(rank, world)) for rank in range(world)]
    together = [row for share in shares for row in share]
    assert sorted(row.index for row in together) == sorted(alone), "each pending row once"
    for row in together:  # a duplicate id (of an earlier row, committed or not) is an error
        assert row.error == alone[row.index].error
    sizes = [len(share) for share in shares]
    assert max(sizes) - min(sizes) <= 1, "the rows still to do are shared out evenly"


def test_the_share_is_by_position_among_the_rows_still_to_do():
    ids = list(range(10))
    done = {0, 1, 2, 5}  # pending rows: 3, 4, 6, 7, 8, 9
    assert [r.index for r in prepared(ids, done, RowShare(0, 2))] == [3, 6, 8]
    assert [r.index for r in prepared(ids, done, RowShare(1, 2))] == [4, 7, 9]
