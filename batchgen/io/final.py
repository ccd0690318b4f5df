"""The final results file: every committed row, sorted by (index, sample index), written
atomically. Memory holds one window of index values (plus one shard) at a time. Shard-only
columns (the input hash) are left out."""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import pairwise
from typing import IO, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError
from batchgen.io.atomic import write_atomic
from batchgen.io.checkpoint import read_shard_keys
from batchgen.io.fs import AnyPath, arrow_file
from batchgen.io.layout import OUTPUT_FORMATS, OutputLayout
from batchgen.io.output_schema import INPUT_HASH, KEY_COLUMNS, common_type
from batchgen.io.writer import is_text_field, same_value, text_array, text_field

FINAL_WINDOW_ROWS = 100_000  # write_final sorts this many index values at a time
PIECE_BYTES = 256 << 20  # of text and bytes per table the final Parquet writer is given
SAMPLE = KEY_COLUMNS[1]


class _Span(NamedTuple):
    path: AnyPath
    lo: int  # smallest index in the shard
    hi: int  # largest index in the shard


def write_final(
    layout: OutputLayout,
    format: str,
    path: AnyPath,
    *,
    window_rows: int = FINAL_WINDOW_ROWS,
    keep: tuple[str, ...] = (),
) -> int:
    """Write every committed `format` shard's rows, sorted, to `path` -> the rows written.

    keep: shard-only columns to keep (by default they are left out)."""
    drop = () if INPUT_HASH in keep else (INPUT_HASH,)
    if format not in OUTPUT_FORMATS:
        raise ValueError(f"format={format!r} is not allowed: use {' or '.join(OUTPUT_FORMATS)}")
    spans = []
    for shard in layout.shard_paths(format):
        indexes = [index for index, _ in read_shard_keys(shard)[0]]
        spans.append(_Span(shard, min(indexes), max(indexes)))
    if format == "parquet":
        return write_atomic(path, lambda f: _final_parquet(spans, window_rows, drop, f))
    return write_atomic(path, lambda f: _final_jsonl(spans, window_rows, drop, f))


def _windows(spans: list[_Span], window_rows: int) -> Iterator[tuple[int, int, list[AnyPath]]]:
    """(start, end, shards holding an index in [start, end)) over the whole index range."""
    if not spans:
        return
    lo, hi = min(s.lo for s in spans), max(s.hi for s in spans)
    for start in range(lo, hi + 1, window_rows):
        end = start + window_rows
        hits = [s.path for s in spans if s.lo < end and s.hi >= start]
        if hits:
            yield start, end, hits


def _final_jsonl(spans: list[_Span], window_rows: int, drop: tuple[str, ...], f: IO[bytes]) -> int:
    written = 0
    for start, end, hits in _windows(spans, window_rows):
        lines: list[tuple[tuple[int, int], bytes]] = []
        for shard in hits:
            with shard.open("rb") as src:
                for line in src:
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    key = (row["index"], row.get(SAMPLE) or 0)
                    if start <= key[0] < end:
                        if any(c in row for c in drop):
                            row = {k: v for k, v in row.items() if k not in drop}
                            line = json.dumps(row, ensure_ascii=False).encode("utf-8")
                        lines.append((key, line.rstrip(b"\n") + b"\n"))
        lines.sort(key=lambda item: item[0])
        _check_unique([key for key, _ in lines])
        f.writelines(line for _, line in lines)
        written += len(lines)
    return written


def _final_parquet(
    spans: list[_Span], window_rows: int, drop: tuple[str, ...], f: IO[bytes]
) -> int:
    schema = _unified_schema([s.path for s in spans], drop)
    written = 0
    with pq.ParquetWriter(f, schema) as out:
        for start, end, hits in _windows(spans, window_rows):
            pieces = []
            for shard in hits:
                with arrow_file(shard) as src:
                    table = pq.read_table(src)
                index = table.column("index")
                keep = pc.and_(pc.greater_equal(index, start), pc.less(index, end))
                pieces.append(_conform(table.filter(keep), schema))
            window = pa.concat_tables(pieces)
            keys = [c for c in KEY_COLUMNS if c in window.column_names]
            order = pc.sort_indices(window.select(keys), [(c, "ascending") for c in keys])
            ordered = window.select(keys).take(order)
            indexes = ordered.column("index").to_pylist()
            samples = ordered.column(SAMPLE).to_pylist() if SAMPLE in keys else [0] * len(order)
            _check_unique(list(zip(indexes, samples, strict=True)))
            for piece in _sorted_pieces(window, order, schema):
                out.write_table(piece)
            written += window.num_rows
    return written


def _sorted_pieces(window: pa.Table, order: pa.Array, schema: pa.Schema) -> Iterator[pa.Table]:
    """The window's rows in `order`, as tables of at most PIECE_BYTES of text and bytes each
    (one row at least). A string or binary column's offsets are 32-bit: a window's values
    together may pass 2 GiB (long texts, wide pass-through columns), so the window is joined
    as large_string / large_binary and each piece taken from it (its offsets from 0) is cast
    back, well under that."""
    wide = window.cast(pa.schema([_widened(field) for field in window.schema])).combine_chunks()
    sizes = np.zeros(window.num_rows, dtype=np.int64)
    for column, field in zip(wide.columns, wide.schema, strict=True):
        if field.type in (pa.large_string(), pa.large_binary()):
            lengths = pc.fill_null(pc.binary_length(column), 0).take(order)
            sizes += lengths.to_numpy(zero_copy_only=False)
    start, total = 0, 0
    for row, size in enumerate(sizes.tolist()):
        if row > start and total + size > PIECE_BYTES:
            yield wide.take(order.slice(start, row - start)).cast(schema)
            start, total = row, 0
        total += size
    if window.num_rows > start:
        yield wide.take(order.slice(start)).cast(schema)


def _widened(field: pa.Field) -> pa.Field:
    wide = {pa.string(): pa.large_string(), pa.binary(): pa.large_binary()}.get(field.type)
    return field if wide is None else field.with_type(wide)


def _unified_schema(paths: list[AnyPath], drop: tuple[str, ...]) -> pa.Schema:
    """One schema for all shards: types promoted where Arrow can and every shard's values fit
    the promoted type unchanged; else the column is text (each value's JSON text), as a shard
    writes a column whose own values mix (integers past 2^53 beside floats, say), and so is a
    column any shard wrote as text."""
    schemas = []
    for path in paths:
        with arrow_file(path) as f:
            schemas.append(pq.read_schema(f))
    names = dict.fromkeys(n for schema in schemas for n in schema.names if n not in drop)
    fields = []
    for name in names:
        found = [s.field(name) for s in schemas if name in s.names]
        target = common_type(name, {field.type for field in found})
        text = any(map(is_text_field, found)) or target is None
        if text or not _fits(paths, schemas, name, target):
            fields.append(text_field(name))
        else:
            fields.append(pa.field(name, target))
    return pa.schema(fields)


def _fits(paths: list[AnyPath], schemas: list[pa.Schema], name: str, target: pa.DataType) -> bool:
    """Whether every shard's values of column `name` read back unchanged from `target`, by kind
    and value as a shard checks its own (an int64 past 2^53 is no exact double, nor a decimal
    0.10; text is no bytes); reads only shards of another type."""
    for path, schema in zip(paths, schemas, strict=True):
        if name not in schema.names or schema.field(name).type == target:
            continue
        with arrow_file(path) as f:
            column = pq.read_table(f, columns=[name]).column(name)
        try:
            stored = column.cast(target, safe=True)
        except (pa.ArrowException, NotImplementedError):
            return False
        if not same_value(column.to_pylist(), stored.to_pylist()):
            return False
    return True


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    columns = []
    for target in schema:
        if target.name not in table.column_names:
            columns.append(pa.nulls(table.num_rows, target.type))
            continue
        column = table.column(target.name)
        if is_text_field(target) and not is_text_field(table.field(target.name)):
            column = text_array(column.to_pylist())  # a shard's strings quoted too: "5", not 5
        columns.append(column.cast(target.type))
    return pa.Table.from_arrays(columns, schema=schema)


def _check_unique(sorted_keys: list[tuple[int, int]]) -> None:
    dups = [b for a, b in pairwise(sorted_keys) if a == b]
    if dups:
        raise BatchgenError(
            f"row {dups[0][0]} (sample {dups[0][1]}) is committed twice: remove the extra shard"
        )
