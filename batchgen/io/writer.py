"""Checkpointed output: rows go to shards that become visible only whole.

Layout under the output folder:
    shards/part-<run-token>-<seq:06d>.<ext>   committed shards: the checkpoint
    shards/.tmp-...                            a shard being written (never read)
    <final file>                               every committed row in index order (optional)

A shard is written to a temporary name, flushed, fsynced, renamed into place, and the folder
fsynced: a kill at any instant leaves either the whole shard or none of it visible.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import IO, Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

OUTPUT_FORMATS = ("parquet", "jsonl")
SHARDS_DIR = "shards"
TEMP_PREFIX = ".tmp-"
FINAL_WINDOW_ROWS = 100_000  # write_final sorts this many index values at a time
SAMPLE = "sample_index"  # rows of one input index are told apart by their sample index
KEY_COLUMNS = ("index", SAMPLE)

Row = dict[str, Any]
Writer = Callable[[IO[bytes]], Any]  # fills an open binary file


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
        _check(bool(self.dir), "dir", self.dir, "a folder path")
        allowed = " or ".join(OUTPUT_FORMATS)
        _check(self.format in OUTPUT_FORMATS, "format", self.format, allowed)
        rows_ok = isinstance(self.shard_rows, int) and self.shard_rows >= 1
        _check(rows_ok, "shard_rows", self.shard_rows, "an integer >= 1")
        _check(self.shard_seconds > 0, "shard_seconds", self.shard_seconds, "a number > 0")


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed: use {allowed}")


class ShardWriter:
    """Buffers output rows and commits them as atomic shards."""

    def __init__(self, out_dir: Path, format: str, shard_rows: int, shard_seconds: float) -> None:
        _check(format in OUTPUT_FORMATS, "format", format, " or ".join(OUTPUT_FORMATS))
        self.dir = Path(out_dir) / SHARDS_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        _fsync_dir(self.dir.parent)  # the shards folder itself survives a crash
        self.format = format
        self.shard_rows = shard_rows
        self.shard_seconds = shard_seconds
        # unique per writer, sortable by start time: "20261130T120000-4242-a1b2c3"
        self.token = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"
        self.rows_committed = 0
        self._seq = 0
        self._rows: list[Row] = []
        self._first_row_at = 0.0  # time.monotonic() of the buffer's first row

    def add(self, row: Row) -> None:
        """Buffer one row (with an int "index" and a str "id"); commit if a limit is reached."""
        self.add_group([row])

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
        name = f"part-{self.token}-{self._seq:06d}.{self.format}"
        encode = _encode_parquet if self.format == "parquet" else _encode_jsonl
        _write_atomic(self.dir / name, partial(encode, self._rows))
        count = len(self._rows)
        self._seq += 1
        self._rows = []  # cleared only once the shard is durable: a failed commit can retry
        self.rows_committed += count
        return count


def _encode_jsonl(rows: list[Row], f: IO[bytes]) -> None:
    text = "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows)
    f.write(text.encode("utf-8"))


def _encode_parquet(rows: list[Row], f: IO[bytes]) -> None:
    names = dict.fromkeys(key for row in rows for key in row)  # union, first-seen order
    table = pa.table({name: _to_array([row.get(name) for row in rows]) for name in names})
    pq.write_table(table, f)


def _to_array(values: list[Any]) -> pa.Array:
    """Arrow's inferred type; values it cannot unify (int and str, say) fall back to text."""
    try:
        return pa.array(values)
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        return pa.array([_as_text(v) for v in values], type=pa.string())


def _as_text(value: Any) -> str | None:
    """Text form of a pass-through value: strings as they are, anything else as JSON."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def _write_atomic(path: Path, write: Writer) -> Any:
    """write(f) into a temp file beside `path`, fsync, rename over `path`; returns write's."""
    tmp = path.with_name(f"{TEMP_PREFIX}{os.getpid()}-{path.name}")
    try:
        with tmp.open("wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return result


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shard_paths(out_dir: Path, format: str | None = None) -> list[Path]:
    """Committed shards (of one format, or both), oldest run first."""
    exts = OUTPUT_FORMATS if format is None else (format,)
    shards = Path(out_dir) / SHARDS_DIR
    return sorted(p for ext in exts for p in shards.glob(f"part-*.{ext}"))


def _read_keys(path: Path) -> list[tuple[int, int]]:
    """(index, sample_index) of every row; sample_index is 0 where the column is absent."""
    if path.suffix == ".parquet":
        names = pq.read_schema(path).names
        table = pq.read_table(path, columns=[c for c in KEY_COLUMNS if c in names])
        index = table.column("index").to_pylist()
        sample = table.column(SAMPLE).to_pylist() if SAMPLE in names else [0] * len(index)
        return list(zip(index, (s or 0 for s in sample), strict=True))
    with path.open("rb") as f:
        return [_line_key(line) for line in f if line.strip()]


def _line_key(line: bytes) -> tuple[int, int]:
    row = json.loads(line)
    return row["index"], row.get(SAMPLE) or 0


def _read_index(path: Path) -> list[int]:
    return [index for index, _ in _read_keys(path)]


def committed_indexes(out_dir: Path) -> set[int]:
    """Input indexes already in committed shards (all samples of an index commit together);
    RuntimeError if an (index, sample_index) appears twice."""
    seen: set[tuple[int, int]] = set()
    for path in _shard_paths(out_dir):
        keys = _read_keys(path)
        fresh = set(keys)
        if len(fresh) != len(keys) or not seen.isdisjoint(fresh):
            dup = next(k for n, k in enumerate(keys) if k in seen or k in keys[:n])
            raise RuntimeError(
                f"index {dup[0]} (sample {dup[1]}) is committed twice (again in {path.name}): a bug"
            )
        seen |= fresh
    return {index for index, _ in seen}


def remove_temp_files(out_dir: Path) -> int:
    """Delete leftovers of killed writers; call only while no writer runs. Returns the count."""
    out_dir = Path(out_dir)
    temps = [*out_dir.glob(f"{TEMP_PREFIX}*"), *(out_dir / SHARDS_DIR).glob(f"{TEMP_PREFIX}*")]
    for path in temps:
        path.unlink(missing_ok=True)
    return len(temps)


class _Span(NamedTuple):
    path: Path
    lo: int  # smallest index in the shard
    hi: int  # largest index in the shard


def _windows(spans: list[_Span], window_rows: int) -> Iterator[tuple[int, int, list[Path]]]:
    """(start, end, shards holding an index in [start, end)) over the whole index range."""
    if not spans:
        return
    lo, hi = min(s.lo for s in spans), max(s.hi for s in spans)
    for start in range(lo, hi + 1, window_rows):
        end = start + window_rows
        hits = [s.path for s in spans if s.lo < end and s.hi >= start]
        if hits:
            yield start, end, hits


def write_final(
    out_dir: Path, format: str, path: Path, *, window_rows: int = FINAL_WINDOW_ROWS
) -> int:
    """Write every committed `format` shard's rows, sorted by index, to `path` atomically.

    Memory holds one window of window_rows index values (plus one shard) at a time.
    Returns the rows written; RuntimeError if an index was committed twice.
    """
    _check(format in OUTPUT_FORMATS, "format", format, " or ".join(OUTPUT_FORMATS))
    spans = []
    for shard in _shard_paths(out_dir, format):
        if indexes := _read_index(shard):
            spans.append(_Span(shard, min(indexes), max(indexes)))
    if format == "parquet":
        return _write_atomic(Path(path), lambda f: _final_parquet(spans, window_rows, f))
    return _write_atomic(Path(path), lambda f: _final_jsonl(spans, window_rows, f))


def _final_jsonl(spans: list[_Span], window_rows: int, f: IO[bytes]) -> int:
    written = 0
    for start, end, hits in _windows(spans, window_rows):
        lines: list[tuple[tuple[int, int], bytes]] = []  # (key, raw line), kept byte for byte
        for shard in hits:
            with shard.open("rb") as src:
                for line in src:
                    key = _line_key(line) if line.strip() else None
                    if key is not None and start <= key[0] < end:
                        lines.append((key, line if line.endswith(b"\n") else line + b"\n"))
        lines.sort(key=lambda item: item[0])
        _check_unique([key for key, _ in lines])
        f.writelines(line for _, line in lines)
        written += len(lines)
    return written


def _final_parquet(spans: list[_Span], window_rows: int, f: IO[bytes]) -> int:
    schema, text_columns = _unified_schema([s.path for s in spans])
    written = 0
    with pq.ParquetWriter(f, schema) as out:
        for start, end, hits in _windows(spans, window_rows):
            pieces = []
            for shard in hits:
                table = pq.read_table(shard)
                index = table.column("index")
                keep = pc.and_(pc.greater_equal(index, start), pc.less(index, end))
                pieces.append(_conform(table.filter(keep), schema, text_columns))
            window = pa.concat_tables(pieces)
            keys = [c for c in KEY_COLUMNS if c in window.column_names]
            window = window.sort_by([(c, "ascending") for c in keys])
            samples = window.column(SAMPLE).to_pylist() if SAMPLE in keys else [0] * window.num_rows
            _check_unique(list(zip(window.column("index").to_pylist(), samples, strict=True)))
            if window.num_rows:
                out.write_table(window)
            written += window.num_rows
    return written


def _unified_schema(paths: list[Path]) -> tuple[pa.Schema, set[str]]:
    """One schema for all shards: types promoted where Arrow can; else the column is text."""
    schemas = [pq.read_schema(p) for p in paths]
    names = dict.fromkeys(name for schema in schemas for name in schema.names)
    fields, text_columns = [], set()
    for name in names:
        types = {s.field(name).type for s in schemas if name in s.names}
        try:
            parts = [pa.schema([(name, t)]) for t in types]
            target = pa.unify_schemas(parts, promote_options="permissive").field(name).type
            for t in types:  # promotable is not always castable (struct field sets, say)
                pa.array([], type=t).cast(target)
        except pa.ArrowException:
            target = pa.string()
            text_columns.add(name)
        fields.append(pa.field(name, target))
    return pa.schema(fields), text_columns


def _conform(table: pa.Table, schema: pa.Schema, text_columns: set[str]) -> pa.Table:
    columns = []
    for target in schema:
        if target.name not in table.column_names:
            columns.append(pa.nulls(table.num_rows, target.type))
            continue
        column = table.column(target.name)
        if target.name in text_columns and column.type != pa.string():
            column = pa.array([_as_text(v) for v in column.to_pylist()], type=pa.string())
        columns.append(column.cast(target.type))
    return pa.Table.from_arrays(columns, schema=schema)


def _check_unique(sorted_keys: list[tuple[int, int]]) -> None:
    dups = [b for a, b in pairwise(sorted_keys) if a == b]
    if dups:
        raise RuntimeError(f"index {dups[0][0]} (sample {dups[0][1]}) is committed twice: a bug")
