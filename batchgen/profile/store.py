"""Step records as columns: appended by the recorder, written as one Parquet file per run.

In memory every column is an array.array (a step appends a few numbers; nothing else per step):
floats use NaN for unknown, gauges -1, codes small ints. On disk they are Parquet columns with
nulls, the derived durations, and, once the run ended, each step's gap and its cause; the
RunInfo travels in the file's metadata. The file is replaced atomically at each write.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError
from batchgen.io.atomic import write_atomic
from batchgen.io.fs import arrow_file
from batchgen.profile.attribution import attribute
from batchgen.profile.records import BLOCKED_BY, RunInfo, StepRecord

FLOATS = (  # ms since the run's start; NaN = unknown
    "host_schedule_ms",
    "host_prepare_ms",
    "host_begin_ms",
    "host_end_ms",
    "host_post_ms",
    "host_ready_ms",
    "host_done_ms",
    "gpu_start_ms",
    "gpu_end_ms",
)
INTS = (
    "prefill_tokens",
    "decode_tokens",
    "running",
    "waiting",
    "free_blocks",
    "preemptions",
    "evictions",
    "tokenizer_depth",  # -1 = no gauge (an engine outside a job)
    "writer_lag",  # -1 = no gauge
    "idle_no_demand",
    "idle_blocked",
    "recompute_tokens",
)
CODES = ("graphed", "blocked_by", "admit_limit")  # bool; index into BLOCKED_BY (both limits)
COLUMNS = FLOATS + INTS + CODES  # the recorder appends one value to each, in this order
DURATIONS = {  # derived column -> (from, to)
    "schedule_ms": ("host_schedule_ms", "host_prepare_ms"),
    "prepare_ms": ("host_prepare_ms", "host_begin_ms"),
    "launch_ms": ("host_begin_ms", "host_end_ms"),
    "sync_ms": ("host_post_ms", "host_ready_ms"),
    "post_ms": ("host_ready_ms", "host_done_ms"),
    "gpu_ms": ("gpu_start_ms", "gpu_end_ms"),
}
META_KEY = b"batchgen.profile"

Arrays = dict[str, array]


def new_arrays() -> Arrays:
    kinds = {**dict.fromkeys(FLOATS, "d"), **dict.fromkeys(INTS, "q"), **dict.fromkeys(CODES, "b")}
    return {name: array(kinds[name]) for name in COLUMNS}


def snapshot(arrays: Arrays) -> Arrays:
    """A copy of the complete rows, safe to take on another thread while the recorder appends:
    a step appends to the columns in order and each slice is one copy under the GIL, so the
    shortest column counts the rows every column holds (values filled in later by index are
    taken as they are at that instant)."""
    rows = min(len(values) for values in arrays.values())
    return {name: values[:rows] for name, values in arrays.items()}


def to_table(arrays: Arrays, info: RunInfo) -> pa.Table:
    """Arrow columns over the arrays' buffers: no Python object per row, and no pa.array (its
    first use in a process imports pandas, a quarter of a second holding the GIL that the
    engine thread would feel while a flush runs)."""
    n = len(arrays[COLUMNS[0]])
    data: dict[str, pa.Array] = {"step": _arrow(np.arange(n, dtype=np.int64), pa.int64())}
    floats = {name: np.frombuffer(arrays[name], dtype=np.float64) for name in FLOATS}
    for name, values in floats.items():
        data[name] = _arrow(values, pa.float64(), ~np.isnan(values))
    for name in INTS:
        values = np.frombuffer(arrays[name], dtype=np.int64)
        data[name] = _arrow(values, pa.int64(), values >= 0)
    graphed = np.packbits(np.frombuffer(arrays["graphed"], dtype=np.int8) != 0, bitorder="little")
    data["graphed"] = pa.Array.from_buffers(pa.bool_(), n, [None, pa.py_buffer(graphed)])
    for name in ("blocked_by", "admit_limit"):
        codes = _arrow(np.frombuffer(arrays[name], dtype=np.int8), pa.int8())
        data[name] = pa.DictionaryArray.from_arrays(codes, _strings(BLOCKED_BY))
    for name, (start, end) in DURATIONS.items():
        values = floats[end] - floats[start]
        data[name] = _arrow(values, pa.float64(), ~np.isnan(values))
    table = pa.table(data)
    return table.replace_schema_metadata({META_KEY: json.dumps(info._asdict()).encode()})


def _strings(values: tuple[str, ...]) -> pa.Array:
    offsets = np.cumsum([0, *(len(v.encode()) for v in values)], dtype=np.int32)
    data = pa.py_buffer("".join(values).encode())
    return pa.Array.from_buffers(pa.string(), len(values), [None, pa.py_buffer(offsets), data])


def _arrow(values: np.ndarray, kind: pa.DataType, valid: np.ndarray | None = None) -> pa.Array:
    """An Arrow array over values' buffer; null where `valid` is False."""
    if valid is None:
        return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(values)])
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    nulls = len(values) - int(np.count_nonzero(valid))
    return pa.Array.from_buffers(kind, len(values), [bitmap, pa.py_buffer(values)], nulls)


def with_causes(table: pa.Table, info: RunInfo) -> pa.Table:
    """The table with gap_ms and cause: the idle gap before each step and its cause (null for a
    step whose busy interval is unknown)."""
    gaps = {g.step: g for g in attribute(records_of(table), info).gaps if g.step is not None}
    steps = table.column("step").to_pylist()
    found = [gaps.get(step) for step in steps]
    table = table.append_column("gap_ms", pa.array([g and g.ms for g in found], pa.float64()))
    return table.append_column("cause", pa.array([g and g.cause for g in found], pa.string()))


def write_table(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: pq.write_table(table, f))


def records_of(table: pa.Table) -> list[StepRecord]:
    columns = [table.column(name).to_pylist() for name in StepRecord._fields]
    return [StepRecord(*values) for values in zip(*columns, strict=True)]


def read_records(path: Path) -> tuple[RunInfo, list[StepRecord]]:
    """-> the run and its records; BatchgenError for a file that is not a profile."""
    try:
        with arrow_file(path) as f:
            table = pq.read_table(f)
        meta = (table.schema.metadata or {})[META_KEY]
        info = RunInfo(**json.loads(meta))
        return info, records_of(table)
    except (OSError, KeyError, TypeError, ValueError, pa.ArrowException) as exc:
        raise BatchgenError(
            f"'{path}' is not a readable batchgen profile ({type(exc).__name__}): "
            "run the job again with --profile"
        ) from exc
