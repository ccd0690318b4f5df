"""Reading one rank's rows of a data-parallel job (which rows: batchgen/row_share.py).

Every rank is given every row in input order, so that it counts the rows and checks every id
(a duplicate id is flagged alike at any world size), but reads the job's columns only where
its own rows are:
- Parquet: a row group that holds none of the rank's rows is read for its id column alone,
  or not at all without an id column (its row count comes from the footer);
- JSONL without an id column: only the byte range from the line mark before the rank's first
  row (the input's scan records one line start per chunk it reads) to the end of its last row
  is read, and only the rank's own lines in it are decoded; the other rows are counted from
  the scan. With an id column every line is parsed, for its id alone where it is not the
  rank's (JSON Lines has no column to read ids from without the rest of the line).
A row read whole comes as readers.py gives it; any other as {id_column: value}, or {}
without an id column (None and its error for a JSONL line that cannot be parsed).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io import readers
from batchgen.io.arrow_values import python_rows_or_errors
from batchgen.io.fs import InputChanged, Pin, arrow_file
from batchgen.row_share import RankRows


def parquet_rank_rows(
    files: list[tuple[Path, str]],
    pins: list[Pin],
    batch_rows: int,
    columns: list[str] | None,
    id_column: str | None,
    rows: RankRows,
) -> Iterator[readers.Parsed]:
    start = 0  # index of the file's first row in the whole input
    for (path, name), pin in zip(files, pins, strict=True):
        try:
            with _open_parquet(path, pin) as pf:
                check = partial(readers.still_scanned, path, pin)
                yield from _parquet_file_rows(
                    pf, start, batch_rows, columns, id_column, rows, check
                )
                start += pf.metadata.num_rows
        except (pa.ArrowException, OSError) as exc:
            damaged = (
                f"parquet file {name!r} is damaged ({readers._reason(exc)}): "
                "replace it and run again"
            )
            raise readers.parquet_failure(exc, name, damaged, path, pin) from exc


@contextmanager
def _open_parquet(path: Path, pin: Pin) -> Iterator[pq.ParquetFile]:
    # pre_buffer (on by default) would read a whole row group's column chunks at once
    with (
        arrow_file(path, pin) as f,
        pq.ParquetFile(f, buffer_size=readers.PARQUET_BUFFER_BYTES, pre_buffer=False) as pf,
    ):
        yield pf


def _parquet_file_rows(
    pf: pq.ParquetFile,
    start: int,
    batch_rows: int,
    columns: list[str] | None,
    id_column: str | None,
    rows: RankRows,
    check: Callable[[], None],
) -> Iterator[readers.Parsed]:
    """One file's rows; start: the index of its first row in the whole input; check: called
    before each batch's rows are given (InputChanged when the file is no longer the one
    scanned)."""
    names = pf.schema_arrow.names
    # read one column even when no wanted one is present, so rows still count
    whole = None if columns is None else [c for c in columns if c in names] or names[:1]
    ids = [id_column] if id_column in names else []
    for group in range(pf.num_row_groups):
        count = pf.metadata.row_group(group).num_rows
        if rows.overlaps(start, start + count):
            batches = pf.iter_batches(
                batch_rows, row_groups=[group], columns=whole, use_threads=False
            )
            index = start
            for batch in batches:
                check()
                for values, error in python_rows_or_errors(batch):
                    own = rows.reads(index)
                    if values is None:
                        yield None, error
                    else:
                        yield (
                            readers.project(values, columns) if own else _id(values, id_column),
                            None,
                        )
                    index += 1
        elif ids:  # the id column alone: a later row with one of these ids is a duplicate
            for batch in pf.iter_batches(
                batch_rows, row_groups=[group], columns=ids, use_threads=False
            ):
                check()
                for values, error in python_rows_or_errors(batch):
                    yield values, error
        else:  # nothing of it is needed but its row count
            for _ in range(count):
                yield _id({}, id_column), None
        start += count


def jsonl_rank_rows(
    files: list[tuple[Path, str]],
    scans: list[readers.JsonlScan],
    columns: list[str] | None,
    id_column: str | None,
    rows: RankRows,
) -> Iterator[readers.Parsed]:
    index = 0  # of the file's first row in the whole input
    for (path, name), scan in zip(files, scans, strict=True):
        if id_column is not None:  # every line is parsed for its id
            lines = _jsonl_lines(path, name, scan, 0, index, columns, id_column, rows)
            count = 0
            for count, parsed in enumerate(lines, start=1):
                _check_count(name, scan, count)
                yield parsed
            _check_count(name, scan, count, whole=True)
        else:
            yield from _jsonl_span(path, name, scan, index, columns, rows)
        index += scan.rows


def _jsonl_span(
    path: Path,
    name: str,
    scan: readers.JsonlScan,
    start: int,
    columns: list[str] | None,
    rows: RankRows,
) -> Iterator[readers.Parsed]:
    """A file without an id column: only the bytes from the line mark before the rank's first
    row to its last row are read; every other row is {} (counted, never read)."""
    span = rows.span(start, start + scan.rows)
    if not span:
        yield from (({}, None) for _ in range(scan.rows))
        return
    k = bisect.bisect_right([m[0] for m in scan.marks], span.start - start) - 1
    mark = scan.marks[k]
    yield from (({}, None) for _ in range(mark[0]))
    index = start + mark[0]
    lines = _jsonl_lines(path, name, scan, k, index, columns, None, rows)
    for parsed in lines:
        _check_count(name, scan, index - start + 1)
        yield parsed
        index += 1
        if index >= span.stop and index < start + scan.rows:
            lines.close()  # past the rank's last row: the rest is only counted
            break
    else:
        _check_count(name, scan, index - start, whole=True)
    yield from (({}, None) for _ in range(start + scan.rows - index))


def _check_count(name: str, scan: readers.JsonlScan, rows: int, whole: bool = False) -> None:
    """The file's lines read so far (whole: all of them) agree with its scan's row count; a
    disagreement is a file that changed since it was scanned (its rows would be another
    content's), so it stops the job."""
    if rows > scan.rows or (whole and rows != scan.rows):
        raise InputChanged(name, f"its row count ({rows} now, {scan.rows} then) differs")


def _jsonl_lines(
    path: Path,
    name: str,
    scan: readers.JsonlScan,
    k: int,
    index: int,
    columns: list[str] | None,
    id_column: str | None,
    rows: RankRows,
) -> Iterator[readers.Parsed]:
    """Lines from the scan's k-th mark on; index: the whole input's index of the first one."""
    mark = scan.marks[k]
    for lineno, raw in readers.jsonl_lines(path, mark[2], mark[1], (name, scan)):
        own = rows.reads(index)
        if own or id_column is not None:
            values, error = readers.parse_json_line(raw, f"{name} line {lineno}")
            if values is not None:
                values = readers.project(values, columns) if own else _id(values, id_column)
            yield values, error
        else:  # another rank's line, never decoded
            yield {}, None
        index += 1


def _id(values: readers.Values, id_column: str | None) -> readers.Values:
    """A row of another rank: its id alone."""
    return {} if id_column is None else {id_column: values.get(id_column)}
