"""generate() over an IterableDataset, lazily: each input row is read once, carried to its
result by its index, and yielded in input order as results arrive.

The job runs on a thread while the caller iterates. Prompts are admitted only a window ahead
of what the caller has taken (the window grows as the caller keeps taking), so taking two rows
generates about two rows; closing the iterator stops the job after the step in flight.
Rows a checkpoint already holds are read back from it, each checked against the input row it
was made from (a changed input is an error, never a result attached to another row). The first
example, and every later one whose keys differ, is checked before it goes on (the caller's check:
an input column an output column would overwrite); the first is read before the job starts.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any

from batchgen.engine import Engine
from batchgen.errors import BatchgenError
from batchgen.io import InputSource, OutputLayout
from batchgen.io.checkpoint import Committed, iter_shard_rows
from batchgen.io.final import write_final
from batchgen.io.layout import temp_path
from batchgen.io.output_schema import INPUT_HASH
from batchgen.io.readers import RawRow
from batchgen.job import Hooks, run_job
from batchgen.spec import JobSpec
from batchgen.tokenizer_pool import row_hash

FIRST_WINDOW = 4  # rows admitted ahead of the caller before it has taken any
_POLL_S = 0.05

# (an example's keys, whether it is the first) -> None, or raises BatchgenError
ExampleCheck = Callable[[list[str], bool], None]


@dataclasses.dataclass
class _State:
    """Shared between the job thread and the caller's iteration (guarded by `cond`)."""

    cond: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    examples: dict[int, tuple[dict[str, Any], str]] = dataclasses.field(default_factory=dict)
    results: dict[int, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    committed: Committed | None = None
    committed_rows: Path | None = None  # the checkpoint's rows, sorted by index
    next_index: int = 0  # the next input index the caller takes
    rows_read: int | None = None  # set once the input is exhausted
    done: bool = False
    error: BaseException | None = None


def stream_rows(
    ds: Any,
    spec: JobSpec,
    engine: Engine,
    out_dir: Path,
    columns: list[str],
    prefix: str,
    read_columns: list[str] | None,
    check: ExampleCheck,
) -> Iterator[dict[str, Any]]:
    """Yield {**input row, **prefixed output columns} in input order (n rows per index)."""
    state = _State()
    examples = _checked(iter(ds), check)
    first = next(examples, None)  # refused here, before the job touches the output
    examples = chain([first] if first is not None else [], examples)
    source = _tapped_source(ds, examples, spec.input.batch_rows, read_columns, state)
    stop = threading.Event()
    hooks = Hooks(
        on_rows=lambda rows: _deliver(state, rows),
        admit=lambda index: index < state.next_index + max(FIRST_WINDOW, state.next_index),
        on_start=lambda layout, done: _prepare_committed(state, layout, done, spec.output.format),
        verify_rows=False,  # checked here, row by row, before a committed row is yielded
    )
    thread = threading.Thread(
        target=_run, args=(spec, engine, source, stop, hooks, state), daemon=True
    )
    thread.start()
    try:
        yield from _in_order(state, columns, prefix)
    finally:
        stop.set()
        thread.join()
        if state.committed_rows is not None:
            state.committed_rows.unlink(missing_ok=True)


def _run(
    spec: JobSpec,
    engine: Engine,
    source: InputSource,
    stop: threading.Event,
    hooks: Hooks,
    state: _State,
) -> None:
    try:
        run_job(spec, force_resume=None, engine=engine, source=source, stop=stop, hooks=hooks)
    except BaseException as exc:
        state.error = exc
    finally:
        with state.cond:
            state.done = True
            state.cond.notify_all()


def _checked(examples: Iterator[dict[str, Any]], check: ExampleCheck) -> Iterator[dict[str, Any]]:
    """The examples, each one whose keys differ from the last checked one's checked first."""
    seen: frozenset[str] | None = None
    for example in examples:
        if seen is None or example.keys() != seen:
            check(list(example), seen is None)
            seen = frozenset(example)
        yield example


def _tapped_source(
    ds: Any,
    examples: Iterable[dict[str, Any]],
    batch_rows: int,
    read_columns: list[str] | None,
    state: _State,
) -> InputSource:
    """The dataset's examples as a job input (read once) that also hands each whole example to
    the iteration."""
    names = list(ds.column_names or [])

    def read_rows(columns: list[str] | None) -> Iterator[tuple[dict[str, Any], None]]:
        index = 0
        for example in examples:
            values = example if columns is None else {c: example.get(c) for c in columns}
            digest = row_hash(RawRow(index, values, None))
            with state.cond:
                state.examples[index] = (example, digest)
                state.cond.notify_all()
            yield values, None
            index += 1
        with state.cond:
            state.rows_read = index
            state.cond.notify_all()

    description = f"datasets.IterableDataset(columns {names})"
    return InputSource(names or None, None, description, batch_rows, read_rows)


def _deliver(state: _State, rows: list[dict[str, Any]]) -> None:
    with state.cond:
        state.results[rows[0]["index"]] = rows
        state.cond.notify_all()


def _prepare_committed(state: _State, layout: OutputLayout, committed: Committed, fmt: str) -> None:
    """On the job thread, under the lock: the checkpoint's rows sorted into one temp file."""
    if committed.indexes:
        path = temp_path(layout.dir / f"stream.{fmt}")
        write_final(layout, fmt, path, keep=(INPUT_HASH,))
        state.committed_rows = path
    with state.cond:
        state.committed = committed
        state.cond.notify_all()


def _in_order(state: _State, columns: list[str], prefix: str) -> Iterator[dict[str, Any]]:
    stored: Iterator[dict[str, Any]] | None = None
    pending: dict[str, Any] | None = None
    while True:
        index = state.next_index
        ready = _wait(state, partial(_ready, state, index))
        if ready == "end":
            return
        example, digest = state.examples.pop(index)
        if index in state.committed.indexes:
            if stored is None:
                stored = iter_shard_rows(state.committed_rows)
                pending = next(stored, None)
            rows = []
            while pending is not None and pending["index"] == index:
                rows.append(pending)
                pending = next(stored, None)
            if rows[0].get(INPUT_HASH) not in (None, digest):
                raise BatchgenError(
                    f"input row {index} is not the row the checkpoint holds a result for: the "
                    "dataset changed (or reads in another order) since the checkpoint was "
                    "written; use another checkpoint_dir, or delete it to start over"
                )
        else:
            with state.cond:
                rows = state.results.pop(index)
        for row in rows:
            yield {**example, **{prefix + c: row.get(c) for c in columns}}
        with state.cond:
            state.next_index = index + 1
            state.cond.notify_all()


def _ready(state: _State, index: int) -> str | None:
    """'row' when index can be yielded, 'end' when the input ended before it, else None."""
    if state.error is not None:
        raise state.error
    if state.rows_read is not None and index >= state.rows_read:
        return "end"
    ready = state.committed is not None and index in state.examples
    if ready and (index in state.committed.indexes or index in state.results):
        return "row"
    if state.done:
        raise BatchgenError("generation stopped before the end: iterate again to resume")
    return None


def _wait(state: _State, check: Callable[[], str | None]) -> str:
    with state.cond:
        while True:
            result = check()
            if result is not None:
                return result
            state.cond.wait(_POLL_S)
