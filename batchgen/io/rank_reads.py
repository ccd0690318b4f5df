"""Reading one rank's rows of a data-parallel job (which rows: batchgen/row_share.py).

Every rank is given every row in input order, so that it counts the rows and checks every id
(a duplicate id is flagged alike at any world size), but reads the job's columns only where
its own rows are:
- Parquet: a row group that holds none of the rank's rows is read for its id column alone,
  or not at all without an id column (its row count comes from the footer);
- JSONL: every line is passed over as bytes to count it, but only the rank's own lines are
  decoded and parsed, and the others only when the job has an id column (for the id alone).
  A line's row index is its count of non-blank lines before it, so a rank cannot seek to its
  first line without such a pass (the input's fingerprint reads every byte at open anyway).
A row read whole comes as readers.py gives it; any other as {id_column: value}, or {}
without an id column (None and its error for a JSONL line that cannot be parsed).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError
from batchgen.io import readers
from batchgen.io.fs import arrow_file
from batchgen.row_share import RankRows


def parquet_rank_rows(
    files: list[tuple[Path, str]],
    batch_rows: int,
    columns: list[str] | None,
    id_column: str | None,
    rows: RankRows,
) -> Iterator[readers.Parsed]:
    start = 0  # index of the file's first row in the whole input
    for path, name in files:
        try:
            with _open_parquet(path) as pf:
                yield from _parquet_file_rows(pf, start, batch_rows, columns, id_column, rows)
                start += pf.metadata.num_rows
        except (pa.ArrowException, OSError) as exc:
            raise BatchgenError(
                f"parquet file {name!r} is damaged ({readers._reason(exc)}): "
                "replace it and run again"
            ) from exc


@contextmanager
def _open_parquet(path: Path) -> Iterator[pq.ParquetFile]:
    # pre_buffer (on by default) would read a whole row group's column chunks at once
    with (
        arrow_file(path) as f,
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
) -> Iterator[readers.Parsed]:
    """One file's rows; start: the index of its first row in the whole input."""
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
                for values in batch.to_pylist():
                    own = rows.reads(index)
                    yield readers.project(values, columns) if own else _id(values, id_column), None
                    index += 1
        elif ids:  # the id column alone: a later row with one of these ids is a duplicate
            for batch in pf.iter_batches(
                batch_rows, row_groups=[group], columns=ids, use_threads=False
            ):
                for value in batch.column(0).to_pylist():
                    yield {id_column: value}, None
        else:  # nothing of it is needed but its row count
            for _ in range(count):
                yield _id({}, id_column), None
        start += count


def jsonl_rank_rows(
    files: list[tuple[Path, str]],
    columns: list[str] | None,
    id_column: str | None,
    rows: RankRows,
) -> Iterator[readers.Parsed]:
    index = 0
    for path, name in files:
        for lineno, raw in readers.jsonl_lines(path):
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
