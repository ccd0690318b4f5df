"""The row share of data-parallel jobs: contiguous blocks of the rows still to do, one per
rank; the ranks together prepare each row still to do exactly once, and duplicate ids are
flagged alike at any size."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.engine import NOT_READY
from batchgen.io import RawRow
from batchgen.pipeline import Producer
from batchgen.prompts import RowPrompt
from batchgen.row_share import RowShare
from batchgen.tokenizer_pool import TokenizerPool


class EchoBuilder:
    def build_many(self, rows: list[tuple[int, dict]]) -> list[RowPrompt]:
        return [RowPrompt(i, str(v["uid"]), [1], {}, {}, None) for i, v in rows]


def run_producer(batches, done: set[int], share) -> list[RowPrompt]:
    """Every row a producer prepares from `batches`."""
    pool = TokenizerPool(EchoBuilder(), None, "uid", threads=1, processes=0)
    producer = Producer(batches, pool, done, "uid", 8, threading.Event(), share=share)
    producer.start()
    out = []
    while (row := producer.next_row(5.0)) is not None:
        if row is not NOT_READY:  # none ready within the wait (a busy machine): wait again
            out.append(row)
    producer.join()
    assert producer.error is None and producer.finished
    return out


def prepared(
    ids: list[int], done: set[int], share: RowShare, num_rows: int | None
) -> list[RowPrompt]:
    """Every row one rank prepares, with the input read in batches of 3 rows."""
    rows = [RawRow(i, {"uid": uid}, None) for i, uid in enumerate(ids)]
    batches = iter([rows[i : i + 3] for i in range(0, len(rows), 3)])
    return run_producer(batches, done, share.rows(num_rows, done))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    num_rows=st.integers(0, 60),
    done=st.sets(st.integers(0, 70), max_size=40),  # some past the input: ignored
    world=st.integers(1, 9),
)
def test_each_row_still_to_do_is_in_one_ranks_block(num_rows, done, world):
    pending = [i for i in range(num_rows) if i not in done]
    shares = [RowShare(rank, world).rows(num_rows, done) for rank in range(world)]
    owned = [[i for b in s.blocks for i in b] for s in shares]
    assert [i for rows in owned for i in rows] == pending, "once each, in rank order"
    sizes = [len(rows) for rows in owned]
    assert max(sizes) - min(sizes) <= 1, "as equal as possible"
    for share, rows in zip(shares, owned, strict=True):
        assert rows == sorted(rows) and all(i not in done for i in rows)
        if rows:  # contiguous: every row still to do between its first and last is its own
            first, last = pending.index(rows[0]), pending.index(rows[-1])
            assert rows == pending[first : last + 1]
        mine = set(rows)
        for i in range(num_rows + 3):
            assert share.reads(i) == (i in mine or i >= num_rows)
            assert share.owns(i, 0) == (i in mine) or i >= num_rows
        for start in range(0, num_rows + 2, 4):
            for stop in (start, start + 1, start + 5):
                expected = any(share.reads(i) for i in range(start, stop))
                assert share.overlaps(start, stop) == expected, (start, stop)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    ids=st.lists(st.integers(0, 12), max_size=30),
    done_bits=st.lists(st.booleans(), max_size=30),
    world=st.integers(1, 4),
    counted=st.sampled_from(["exact", "unknown", "short"]),
)
def test_ranks_prepare_every_pending_row_once_and_flag_duplicates_alike(
    ids, done_bits, world, counted
):
    """Whether the row count is known (blocks), unknown (round robin) or short of the rows
    read (blocks, then round robin past it)."""
    done = {i for i, bit in enumerate(done_bits[: len(ids)]) if bit}
    num_rows = {"exact": len(ids), "unknown": None, "short": len(ids) // 2}[counted]
    alone = {row.index: row for row in prepared(ids, done, RowShare(), num_rows)}
    assert set(alone) == set(range(len(ids))) - done
    shares = [prepared(ids, done, RowShare(rank, world), num_rows) for rank in range(world)]
    together = [row for share in shares for row in share]
    assert sorted(row.index for row in together) == sorted(alone), "each pending row once"
    for row in together:  # a duplicate id (of an earlier row, committed or not) is an error
        assert row.error == alone[row.index].error
    sizes = [len(share) for share in shares]
    if counted != "short":
        assert max(sizes) - min(sizes) <= 1, "the rows still to do are shared out evenly"


def test_the_share_is_a_block_of_the_rows_still_to_do():
    ids = list(range(10))
    done = {0, 1, 2, 5}  # rows still to do: 3, 4, 6, 7, 8, 9
    assert [r.index for r in prepared(ids, done, RowShare(0, 2), 10)] == [3, 4, 6]
    assert [r.index for r in prepared(ids, done, RowShare(1, 2), 10)] == [7, 8, 9]
    assert RowShare(0, 2).rows(10, done).blocks == [range(3, 5), range(6, 7)]
    # a count not known up front: by position among the rows still to do, round robin
    assert [r.index for r in prepared(ids, done, RowShare(0, 2), None)] == [3, 6, 8]
    assert [r.index for r in prepared(ids, done, RowShare(1, 2), None)] == [4, 7, 9]


def test_a_checkpoint_resumes_at_any_world_size_exactly():
    """8 -> 3 -> 1 and 1 -> 4: each run generates its share of the rows left; together the
    runs generate every row once."""
    for sizes in ((8, 3, 1), (1, 4), (4, 1), (3, 8, 2)):
        done: set[int] = set()
        for run, world in enumerate(sizes, start=1):
            shares = [RowShare(rank, world).rows(97, done).blocks for rank in range(world)]
            owned = [[i for b in blocks for i in b] for blocks in shares]
            together = [i for rows in owned for i in rows]
            assert sorted(together) == sorted(set(range(97)) - done) == together
            last = run == len(sizes)  # the earlier runs stop with half of each block done
            done |= {i for rows in owned for i in (rows if last else rows[: len(rows) // 2])}
        assert done == set(range(97)), sizes


def test_span_covers_exactly_the_rows_read_whole() -> None:
    """RankRows.span(a, b): the shortest range of [a, b) holding every row read whole."""
    for world in (1, 2, 3, 5):
        for done in (set(), {0, 3, 4, 11}, set(range(0, 20, 2))):
            for rank in range(world):
                rows = RowShare(rank, world).rows(20, done)
                for a in range(0, 24, 3):
                    for b in range(a, 26, 4):
                        read = [i for i in range(a, b) if rows.reads(i)]
                        span = rows.span(a, b)
                        assert (list(span[:1]) + list(span[-1:])) == (read[:1] + read[-1:])
                        assert not read or (span.start == read[0] and span.stop == read[-1] + 1)
