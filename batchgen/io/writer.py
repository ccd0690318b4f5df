"""Checkpointed output: rows go to shards that become visible only whole.

A shard is written through the one atomic write (io/atomic.py): a kill at any instant leaves
either the whole shard or none of it visible. Its columns are the job's fixed schema
(io/output_schema.py); where and under which name is the layout's (io/layout.py).
"""

from __future__ import annotations

import base64
import datetime
import decimal
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
    unchanged, else as an undeclared column (in the inferred type, else as text). A plain
    declared type is the type the values were read from (or batchgen's own): stored in it
    without that check."""

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
        dir_ok = isinstance(self.dir, str) and bool(self.dir.strip())
        check_field(dir_ok, "dir", self.dir, "a folder path")
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
        run: str | None = None,
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
        # one run are not. run: the run's name the ranks share (rank 0's), None: a new one
        where = f"{os.getpid()}" if rank is None else f"{os.getpid()}-r{rank}"
        self.token = new_run_token(where, run)
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
    """A shard is checked before it is committed: a column whose inferred type Parquet cannot
    store (or read back), an empty object say, is written as text in this shard instead; the
    other columns keep their types."""
    table = to_table(rows, columns)
    data = _parquet_bytes(table)
    if data is None:
        for i, name in enumerate(table.column_names):
            declared = isinstance(columns[name], pa.DataType)  # stored as read: never text
            if not declared and _parquet_bytes(table.select([i])) is None:
                text = text_array([row.get(name) for row in rows])
                table = table.set_column(i, text_field(name), text)
        data = _parquet_bytes(table)
    if data is None:
        raise ValueError("these rows cannot be stored as Parquet")
    f.write(data)


def parquet_stores(type: pa.DataType) -> bool:
    """Whether a Parquet file can hold a column of this type (not an object without fields,
    struct<>, at any depth)."""
    return _parquet_bytes(pa.table({"c": pa.array([], type=type)})) is not None


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


def to_table(rows: list[Row], columns: Columns) -> pa.Table:
    fields, arrays = [], []
    for name, type in columns.items():
        values = [row.get(name) for row in rows]
        array = _to_array(values, type)
        fields.append(pa.field(name, array.type) if array is not None else text_field(name))
        arrays.append(array if array is not None else text_array(values))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _to_array(values: list[Any], type: pa.DataType | MayNotFit | None) -> pa.Array | None:
    """Values of their declared type, or of Arrow's inferred type; None where neither holds
    them (the column is then written as text). A type that values may not fit (`MayNotFit`)
    and an inferred one are kept only if every value reads back unchanged: Arrow would cut
    1.5 to 1 in an int column, drop a struct's extra keys, round a time, read true back as
    1.0 beside a float, or give every timestamp of a column the first one's time zone."""
    declared = type.type if isinstance(type, MayNotFit) else type
    if declared is not None:
        try:
            array = pa.array(arrow_inputs(values, declared), type=declared)
            if not isinstance(type, MayNotFit) or same_value(values, python_values(array)):
                return array
        except (pa.ArrowException, OverflowError, TypeError, ValueError):
            pass  # a value the declared type cannot hold: infer, as for an undeclared column
    try:
        array = pa.array(values)
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        return None
    return array if same_value(values, python_values(array)) else None


# what a value is, beyond its Python type: kinds a value must keep when stored (a bool is no
# number, a datetime no date); numbers are one kind (1 stored in a float column reads back 1.0)
_KINDS = (
    bool,
    (int, float, decimal.Decimal),
    str,
    (bytes, bytearray, memoryview),
    datetime.datetime,
    datetime.date,
    datetime.time,
    datetime.timedelta,
)
_PLAIN = frozenset({type(None), bool, int, float, str, bytes})  # == of two of one type: exact


def _kind(value: Any) -> Any:
    return next((i for i, kind in enumerate(_KINDS) if isinstance(value, kind)), type(value))


def same_value(value: Any, stored: Any) -> bool:
    """One value read back unchanged, in kind and value: a number as an equal number (1 as
    1.0, NaN as NaN), a datetime or time with its UTC offset (or without one), an object with
    each of its keys (a struct field it lacks reads back null), a list item by item."""
    if isinstance(value, Mapping):
        if not isinstance(stored, Mapping) or not all(key in stored for key in value):
            return False
        return all(same_value(value.get(key), item) for key, item in stored.items())
    if isinstance(value, (list, tuple)):
        if not isinstance(stored, (list, tuple)) or len(value) != len(stored):
            return False
        kinds = set(map(type, value))
        if kinds <= _PLAIN and kinds == set(map(type, stored)) and value == stored:
            return True  # equal items of one plain type on both sides (Arrow's): C speed
        return all(map(same_value, value, stored))
    if _kind(value) != _kind(stored):
        return False
    if isinstance(value, float) and math.isnan(value):
        return math.isnan(stored)
    if isinstance(value, (datetime.datetime, datetime.time)):
        return value == stored and value.utcoffset() == stored.utcoffset()
    return bool(value == stored)


JSON_TEXT = {b"batchgen.encoding": b"json"}  # metadata of a column written as JSON text


def text_field(name: str) -> pa.Field:
    """A column no Arrow type holds the values of: each value as its JSON text."""
    return pa.field(name, pa.string(), metadata=JSON_TEXT)


def is_text_field(field: pa.Field) -> bool:
    return field.metadata == JSON_TEXT


def text_array(values: list[Any]) -> pa.Array:
    return pa.array([as_text(v) for v in values], type=pa.string())


def as_text(value: Any) -> str | None:
    """A value's JSON text, as a JSON Lines shard holds it (strings quoted, so 5 and "5"
    differ), NaN and infinities as Python's json writes them; null stays null."""
    if value is None:
        return None
    return json.dumps(value, ensure_ascii=False, default=json_value)
