"""Checkpointed output: rows go to shards that become visible only whole.

A shard is written through the one atomic write (io/atomic.py): a kill at any instant leaves
either the whole shard or none of it visible. Its columns are the job's fixed schema
(io/output_schema.py); where and under which name is the layout's (io/layout.py).
"""

from __future__ import annotations

import base64
import datetime
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import check_field
from batchgen.io.arrow_values import Nanos, arrow_inputs, iso_duration, python_values
from batchgen.io.atomic import fsync_dir, write_atomic
from batchgen.io.fs import check_output_url
from batchgen.io.layout import OUTPUT_FORMATS, OutputLayout, new_run_token

Row = dict[str, Any]


@dataclass(frozen=True)
class MayNotFit:
    """A pass-through column's declared type that some of its values may not fit: the type
    Arrow promotes the input files' disagreeing types to (an int column in one file, a float
    one in another). A shard stores the column in it only where every value reads back
    unchanged, else in the values' inferred type. A plain declared type is the type the
    values were read from (or batchgen's own): stored in it without that check."""

    type: pa.DataType


# column -> type (None = inferred from the values)
Columns = Mapping[str, pa.DataType | MayNotFit | None]


@dataclass(frozen=True)
class OutputConfig:
    """Where and how results are written."""

    dir: str
    format: str = "parquet"  # parquet | jsonl
    shard_rows: int = 1000  # commit a shard after this many rows ...
    shard_seconds: float = 30.0  # ... or this many seconds after the shard's first row
    include_token_ids: bool = False
    final_file: bool = True  # write one result file in input order at the end

    def __post_init__(self) -> None:
        check_field(bool(self.dir), "dir", self.dir, "a folder path")
        check_output_url(self.dir)
        allowed = " or ".join(OUTPUT_FORMATS)
        check_field(self.format in OUTPUT_FORMATS, "format", self.format, allowed)
        rows_ok = isinstance(self.shard_rows, int) and self.shard_rows >= 1
        check_field(rows_ok, "shard_rows", self.shard_rows, "an integer >= 1")
        check_field(self.shard_seconds > 0, "shard_seconds", self.shard_seconds, "a number > 0")


class ShardWriter:
    """Buffers output rows and commits them as atomic shards with fixed columns."""

    def __init__(
        self,
        layout: OutputLayout,
        format: str,
        columns: Columns,
        shard_rows: int,
        shard_seconds: float,
        before_commit: Callable[[], None] | None = None,
        rank: int | None = None,
    ) -> None:
        check_field(format in OUTPUT_FORMATS, "format", format, " or ".join(OUTPUT_FORMATS))
        self.layout = layout
        self.before_commit = before_commit  # raises when the shard must not be written
        layout.shards.mkdir(parents=True, exist_ok=True)
        fsync_dir(layout.dir)  # the shards folder itself survives a crash
        self.format = format
        self.columns = dict(columns)
        self.shard_rows = shard_rows
        self.shard_seconds = shard_seconds
        # unique per writer (layout.new_run_token); a rank of a data-parallel job adds its
        # rank ("...-4242-r3-..."): pids of processes on different nodes may be equal, ranks of
        # one run are not
        where = f"{os.getpid()}" if rank is None else f"{os.getpid()}-r{rank}"
        self.token = new_run_token(where)
        self._seq = 0
        self._rows: list[Row] = []
        self.rows_committed = 0  # rows in the shards this writer committed
        self._first_row_at = 0.0  # time.monotonic() of the buffer's first row

    def add_group(self, rows: list[Row]) -> None:
        """Buffer rows that must land in the same shard (the samples of one input row)."""
        for row in rows:
            if not isinstance(row.get("index"), int) or not isinstance(row.get("id"), str):
                raise TypeError(f"an output row needs an int 'index' and a str 'id', got {row!r}")
        if not self._rows:
            self._first_row_at = time.monotonic()
        self._rows.extend(rows)
        if len(self._rows) >= self.shard_rows:
            self.commit()
        else:
            self.maybe_commit()

    def maybe_commit(self) -> None:
        """Commit if the buffer's first row is shard_seconds old."""
        if self._rows and time.monotonic() - self._first_row_at >= self.shard_seconds:
            self.commit()

    def commit(self) -> int:
        """Write the buffered rows as one shard now; returns the rows written (0 = none)."""
        if not self._rows:
            return 0
        if self.before_commit is not None:
            self.before_commit()
        path = self.layout.shard(self.token, self._seq, len(self._rows), self.format)
        encode = encode_parquet if self.format == "parquet" else encode_jsonl
        write_atomic(path, partial(encode, self._rows, self.columns))
        count = len(self._rows)
        self.rows_committed += count
        self._seq += 1
        self._rows = []  # cleared only once the shard is durable: a failed commit can retry
        return count


def encode_jsonl(rows: list[Row], columns: Columns, f: IO[bytes]) -> None:
    text = "".join(json_line({c: row.get(c) for c in columns}) for row in rows)
    f.write(text.encode("utf-8"))


def json_line(row: Row) -> str:
    """One JSON line. JSON has no NaN or infinity: such numbers are written as null."""
    try:
        return json.dumps(row, ensure_ascii=False, default=json_value, allow_nan=False) + "\n"
    except ValueError:
        return json.dumps(_finite(row), ensure_ascii=False, default=json_value) + "\n"


def json_value(value: Any) -> Any:
    """JSON's form of a value JSON has no type for: dates, times and durations in ISO 8601,
    bytes in base64, anything else (a decimal) as its exact text; never Python's repr of it."""
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time, Nanos)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return iso_duration(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    return str(value)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def encode_parquet(rows: list[Row], columns: Columns, f: IO[bytes]) -> None:
    """A shard is checked before it is committed: if Parquet cannot store (or read back) what
    the values of an undeclared column inferred to (an empty object, say), those columns are
    written as text (JSON) in this shard instead."""
    data = _parquet_bytes(to_table(rows, columns))
    if data is None:
        data = _parquet_bytes(to_table(rows, columns, undeclared_as_text=True))
    if data is None:
        raise ValueError("these rows cannot be stored as Parquet")
    f.write(data)


def _parquet_bytes(table: pa.Table) -> bytes | None:
    sink = pa.BufferOutputStream()
    try:
        pq.write_table(table, sink)
        data = sink.getvalue()
        pq.read_schema(pa.BufferReader(data))  # e.g. nesting deeper than readers take
    except (pa.ArrowException, OSError):
        return None
    return data.to_pybytes()


def warm_encoders(format: str) -> None:
    """For Parquet shards, encode a one-row shard in memory and read its schema back, so that
    a job's first commit does not pay pyarrow's first-use costs (a process pays them once):
    its first conversion of Python values imports pandas where pandas is installed (0.15-0.2 s
    on a 2-core machine), inside the job's clock and, for a shard committed mid-run, on the
    writer thread beside the engine's. JSON Lines shards never convert: nothing to do."""
    if format != "parquet":
        return
    row = {"index": 0, "id": "0", "text": "", "num_generated_tokens": 0, "error": None}
    _parquet_bytes(to_table([row], dict.fromkeys(row)))


def to_table(rows: list[Row], columns: Columns, undeclared_as_text: bool = False) -> pa.Table:
    arrays = {}
    for name, type in columns.items():
        values = [row.get(name) for row in rows]
        if type is None and undeclared_as_text:
            arrays[name] = pa.array([as_text(v) for v in values], type=pa.string())
        else:
            arrays[name] = _to_array(values, type)
    return pa.table(arrays)


def _to_array(values: list[Any], type: pa.DataType | MayNotFit | None) -> pa.Array:
    """Values of their declared type, or Arrow's inferred type (text where it cannot unify).
    A type that values may not fit (`MayNotFit`) is kept only if every value reads back
    unchanged (Arrow would cut 1.5 to 1 in an int column, drop a struct's extra keys, round a
    time): else the type is inferred, as for an undeclared column."""
    declared = type.type if isinstance(type, MayNotFit) else type
    if declared is not None:
        try:
            array = pa.array(arrow_inputs(values, declared), type=declared)
            if not isinstance(type, MayNotFit) or _holds(array, values):
                return array
        except (pa.ArrowException, OverflowError, TypeError, ValueError):
            pass  # a value the declared type cannot hold: infer, as for an undeclared column
    try:
        return pa.array(values)
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        return pa.array([as_text(v) for v in values], type=pa.string())


def _holds(array: pa.Array, values: list[Any]) -> bool:
    """Whether `array` holds `values` without loss: each reads back equal."""
    stored = python_values(array)
    return stored == values or all(map(_same, values, stored))


def _same(value: Any, stored: Any) -> bool:
    """One value read back unchanged: equal numbers (1 as 1.0, NaN as NaN), an object's keys
    all kept (a struct field it lacks reads back null), lists item by item."""
    if isinstance(value, float) and isinstance(stored, float) and math.isnan(value):
        return math.isnan(stored)
    if isinstance(value, (Mapping, list, tuple)) and value == stored:
        return True  # whole, at C speed (a NaN inside makes == fail: then item by item)
    if isinstance(value, Mapping) and isinstance(stored, Mapping):
        kept = all(key in stored for key in value)
        return kept and all(_same(value.get(key), item) for key, item in stored.items())
    if isinstance(value, (list, tuple)) and isinstance(stored, (list, tuple)):
        return len(value) == len(stored) and all(map(_same, value, stored))
    return bool(value == stored)


def as_text(value: Any) -> str | None:
    """Text form of a pass-through value: strings as they are, anything else as JSON."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=json_value)
