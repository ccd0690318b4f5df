"""A rank of a data-parallel job reads the job's columns only where its rows are: the other
Parquet row groups' prompt column chunks, and the other JSONL lines, are made unreadable here,
and the rank still reads its rows, and every row's id."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from threading import Event

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen import BatchgenError, Engine
from batchgen.io import InputConfig, OutputLayout, open_input, readers
from batchgen.io.checkpoint import scan_committed
from batchgen.job import run_job
from batchgen.row_share import RankRows, RowShare
from batchgen.spec import load_spec
from tests.helpers import stop_after
from tests.test_row_share import run_producer

ROWS, GROUP_ROWS, WORLD = 23, 4, 3
DONE = {0, 1, 9, 22}  # committed by an earlier run


def table(ids: list[str]) -> pa.Table:
    return pa.table({"uid": ids, "prompt": [f"prompt {i} " * 4 for i in range(len(ids))]})


def write_parquet(path: Path, ids: list[str]) -> Path:
    # no compression nor dictionary: a column chunk is its pages, which are overwritten below
    pq.write_table(table(ids), path, row_group_size=GROUP_ROWS, compression="none")
    return path


def garble_groups(path: Path, groups: list[int], columns: list[str]) -> None:
    """Overwrite those row groups' chunks of those columns with bytes no reader can decode."""
    meta = pq.read_metadata(path)
    data = bytearray(path.read_bytes())
    names = meta.schema.to_arrow_schema().names
    for g in groups:
        for c in columns:
            chunk = meta.row_group(g).column(names.index(c))
            start = chunk.dictionary_page_offset or chunk.data_page_offset
            data[start : start + chunk.total_compressed_size] = (
                b"\xff" * chunk.total_compressed_size
            )
    path.write_bytes(bytes(data))


def rank_rows(path: Path, columns: list[str], id_column: str | None, rows: RankRows) -> list:
    source = open_input(InputConfig(str(path), batch_rows=3))
    return [row for batch in source.rank_batches(columns, id_column, rows) for row in batch]


@pytest.mark.parametrize("id_column", ["uid", None])
def test_a_rank_reads_only_the_row_groups_its_rows_are_in(tmp_path, id_column):
    ids = [f"row-{i}" for i in range(ROWS)]
    clean = write_parquet(tmp_path / "clean.parquet", ids)
    expected = table(ids).to_pylist()
    # without an id column nothing of another rank's row group is read: garble it all
    garbled = ["prompt"] if id_column else ["uid", "prompt"]
    for rank in range(WORLD):
        rows = RowShare(rank, WORLD).rows(ROWS, DONE)
        others = [
            g
            for g in range(pq.read_metadata(clean).num_row_groups)
            if not rows.overlaps(g * GROUP_ROWS, (g + 1) * GROUP_ROWS)
        ]
        assert others, "the rank has row groups to skip"
        path = tmp_path / f"rank{rank}.parquet"
        shutil.copy(clean, path)
        garble_groups(path, others, garbled)
        with pytest.raises(BatchgenError, match="is damaged"):  # a reader of every group fails
            list(open_input(InputConfig(str(path))).batches(["uid", "prompt"]))
        got = rank_rows(path, ["uid", "prompt"], id_column, rows)
        assert [r.index for r in got] == list(range(ROWS)) and not any(r.error for r in got)
        for row in got:
            if rows.reads(row.index):
                assert row.values == expected[row.index]
            else:  # another rank's (or a committed) row: its id alone
                assert row.values == ({"uid": ids[row.index]} if id_column else {})


def jsonl_lines(ids: list[str]) -> list[bytes]:
    return [json.dumps({"uid": u, "prompt": f"p{i}"}).encode() + b"\n" for i, u in enumerate(ids)]


def test_a_rank_decodes_only_its_own_jsonl_lines(tmp_path):
    """Without an id column, another rank's lines are never decoded: they are garbage here
    (not UTF-8, not JSON), which any reader of them reports as a row error."""
    ids = [f"row-{i}" for i in range(ROWS)]
    lines = jsonl_lines(ids)
    for rank in range(WORLD):
        rows = RowShare(rank, WORLD).rows(ROWS, DONE)
        path = tmp_path / f"rank{rank}.jsonl"
        mine = [rows.reads(i) for i in range(ROWS)]
        garbled = [ln if m else b"\xff{garbage\n" for ln, m in zip(lines, mine, strict=True)]
        path.write_bytes(b"".join(garbled))
        every = [r for b in open_input(InputConfig(str(path))).batches(["prompt"]) for r in b]
        assert sum(r.error is not None for r in every) == mine.count(False) > 0
        got = rank_rows(path, ["prompt"], None, rows)
        assert [r.index for r in got] == list(range(ROWS)) and not any(r.error for r in got)
        for row, own in zip(got, mine, strict=True):
            assert row.values == ({"prompt": f"p{row.index}"} if own else {})


def test_without_an_id_column_a_rank_reads_only_its_jsonl_byte_range(tmp_path, monkeypatch):
    """The scan's line marks let a rank seek to the mark before its first row and stop at the
    mark after its last (the bytes between two marks are checked against the scan's digest of
    them): every byte more than two scan chunks before its first line (the mark is the last
    line start in a chunk before it), and every byte after the mark after its last line, is
    overwritten after the scan (no newline left there, so a reader of them would miscount the
    rows; the file's size and modification time kept) and the rank still gets its rows at
    their indexes."""
    chunk = 64
    monkeypatch.setattr(readers, "COUNT_CHUNK_BYTES", chunk)
    ids = [f"row-{i}" for i in range(ROWS)]
    lines = jsonl_lines(ids)
    starts = [sum(map(len, lines[:i])) for i in range(ROWS + 1)]
    for rank in range(WORLD):
        rows = RowShare(rank, WORLD).rows(ROWS, DONE)
        span = rows.span(0, ROWS)
        path = tmp_path / f"rank{rank}.jsonl"
        path.write_bytes(b"".join(lines))
        source = open_input(InputConfig(str(path), batch_rows=3))  # scans the file
        data = bytearray(path.read_bytes())
        marks = [m[2] for m in readers.scan_jsonl(path, path.name).marks]
        low = max(0, starts[span.start] - 2 * chunk)
        high = min([m for m in marks if m >= starts[span.stop]], default=len(data))
        data[:low] = b"x" * low
        data[high:] = b"x" * (len(data) - high)
        stat = path.stat()
        path.write_bytes(bytes(data))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        got = [r for b in source.rank_batches(["prompt"], None, rows) for r in b]
        assert [r.index for r in got] == list(range(ROWS)) and not any(r.error for r in got)
        for row in got:
            assert row.values == ({"prompt": f"p{row.index}"} if rows.reads(row.index) else {})


@pytest.mark.parametrize("id_column", ["uid", None])
@pytest.mark.parametrize("head", [b"\xef\xbb\xbf\n", b"\xef\xbb\xbf \r\n", b"\n\n"])
def test_a_blank_first_line_shifts_no_rank_row(tmp_path, monkeypatch, head, id_column):
    """A first line that is blank once its BOM is dropped is no row: every rank's rows carry
    their own line, seeking from a line mark or not, and no row is added at the end."""
    monkeypatch.setattr(readers, "COUNT_CHUNK_BYTES", 64)
    ids = [f"row-{i}" for i in range(ROWS)]
    path = tmp_path / "in.jsonl"
    path.write_bytes(head + b"".join(jsonl_lines(ids)))
    assert open_input(InputConfig(str(path))).num_rows == ROWS
    for rank in range(WORLD):
        rows = RowShare(rank, WORLD).rows(ROWS, DONE)
        got = rank_rows(path, ["uid", "prompt"], id_column, rows)
        assert [r.index for r in got] == list(range(ROWS)) and not any(r.error for r in got)
        for row in got:
            if rows.reads(row.index):
                assert row.values == {"uid": ids[row.index], "prompt": f"p{row.index}"}


def test_a_rank_read_that_disagrees_with_the_scan_stops(tmp_path, monkeypatch):
    """A file that no longer matches its scan (even with its size and modification time as
    they were) stops the job in one line, never with rows padded or shifted into place."""
    monkeypatch.setattr(readers, "COUNT_CHUNK_BYTES", 64)
    ids = [f"row-{i}" for i in range(ROWS)]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(jsonl_lines(ids)))
    stat = path.stat()
    edited = [i.replace("row", "new") for i in ids]  # the same size
    rows = RowShare(WORLD - 1, WORLD).rows(ROWS, set())
    for now in (edited, ids[:-2], [*ids, "extra"]):
        for id_column in ("uid", None):
            path.write_bytes(b"".join(jsonl_lines(ids)))
            source = open_input(InputConfig(str(path), batch_rows=2))
            path.write_bytes(b"".join(jsonl_lines(now)))
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            got = []
            with pytest.raises(BatchgenError, match="changed while the job read it"):
                for batch in source.rank_batches(["uid", "prompt"], id_column, rows):
                    got.extend(batch)
            assert all(r.values.get("uid") in (None, ids[r.index]) for r in got)


def test_with_an_id_column_a_rank_keeps_only_the_id_of_other_jsonl_lines(tmp_path):
    ids = [f"row-{i}" for i in range(ROWS)]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(jsonl_lines(ids)))
    rows = RowShare(1, WORLD).rows(ROWS, DONE)
    got = rank_rows(path, ["uid", "prompt"], "uid", rows)
    for row in got:
        own = {"uid": ids[row.index], "prompt": f"p{row.index}"}
        assert row.values == (own if rows.reads(row.index) else {"uid": ids[row.index]})


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_duplicate_ids_are_flagged_alike_when_each_rank_reads_its_part(tmp_path, kind):
    """Ids repeat within and across the ranks' blocks and committed rows; every world size
    prepares each row still to do once, with the errors of one process reading every row
    (a JSONL line that cannot be parsed is an error row of its owner only)."""
    ids = [f"u{(i * 7) % 11}" for i in range(ROWS)]  # 23 rows, 11 distinct ids
    path = tmp_path / f"in.{kind}"
    if kind == "parquet":
        write_parquet(path, ids)
    else:
        lines = jsonl_lines(ids)
        lines[14] = b"{not json\n"
        path.write_bytes(b"".join(lines))
    source = open_input(InputConfig(str(path), batch_rows=3))
    columns = ["uid", "prompt"]
    alone = {r.index: r for r in run_producer(source.batches(columns), DONE, None)}
    assert sum(r.error is not None for r in alone.values()) > ROWS // 3
    for world in (1, 2, 3, 5):
        together = []
        for rank in range(world):
            rows = RowShare(rank, world).rows(source.num_rows, DONE)
            together += run_producer(source.rank_batches(columns, "uid", rows), DONE, rows)
        assert sorted(r.index for r in together) == sorted(alone), world
        for row in together:
            assert (row.id, row.error) == (alone[row.index].id, alone[row.index].error)


def test_a_resumed_job_reads_only_the_ids_of_its_committed_row_groups(
    model_dir, tmp_path, monkeypatch
):
    """The job wires the share into the reader: alone, on a resume, a row group whose rows
    are all committed is read for its id column only (every read is recorded)."""
    ids = [f"row-{i}" for i in range(12)]
    inp = tmp_path / "in.parquet"
    pq.write_table(table(ids), inp, row_group_size=2)
    out = tmp_path / "out"
    sets = [
        f"model.path={json.dumps(str(model_dir('llama')))}",
        f"input.path={json.dumps(str(inp))}",
        f"output.dir={json.dumps(str(out))}",
        "runtime.quiet=true",
        "runtime.device='cpu'",
        "prompt.id_column='uid'",
        "sampling.max_new_tokens=4",
        "output.shard_rows=2",
        "runtime.max_num_seqs=2",
    ]
    spec = load_spec(None, sets)
    first = run_job(spec, engine=stop_after(Engine(spec.model.path, spec.engine), 4), stop=Event())
    assert first.interrupted and 0 < first.rows_committed < 12
    done = scan_committed(OutputLayout(out), print).indexes
    reads: list[tuple[list[int], list[str]]] = []  # (row groups, columns) per read
    iter_batches = pq.ParquetFile.iter_batches

    def recorded(self, batch_size, row_groups=None, columns=None, **kwargs):
        if "prompt" in self.schema_arrow.names:  # the input, not a shard
            reads.append((row_groups, columns))
        return iter_batches(self, batch_size, row_groups, columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", recorded)
    assert run_job(load_spec(None, sets)).complete
    results = pq.read_table(out / "results.parquet").to_pylist()
    assert sorted(r["id"] for r in results) == sorted(ids)
    wanted = [([g], ["prompt", "uid"] if {2 * g, 2 * g + 1} - done else ["uid"]) for g in range(6)]
    assert sorted(reads) == wanted and ([0], ["uid"]) in wanted, "row group 0 was committed"
