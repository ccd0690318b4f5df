"""A job: spec -> checks -> lock -> engine -> identity -> pipeline threads -> committed shards
-> final file.

Nothing is written into the output directory before the job is known to be resumable there:
the lock is taken first, the identity recorded in the manifest is compared (settings and input
before the model loads, the model after), and only then is the manifest written.
"""

from __future__ import annotations

import errno
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
from tqdm import tqdm

from batchgen.engine import NOT_READY, Engine, Prompt
from batchgen.engine.model_loader import resolve_device, resolve_dtype, resolve_model_path
from batchgen.engine.runner import check_backend
from batchgen.errors import BatchgenError
from batchgen.io import InputSource, OutputLayout, ShardWriter, open_input
from batchgen.io.atomic import write_json_atomic
from batchgen.io.checkpoint import (
    IDENTITY_PARTS,
    Committed,
    DamagedManifest,
    DirectoryLock,
    Manifest,
    identity_changes,
    read_manifest,
    remove_temp_files,
    scan_committed,
    write_manifest,
)
from batchgen.io.final import write_final
from batchgen.io.openai_batch import (
    ID_COLUMN,
    OPENAI_BATCH,
    PASSTHROUGH,
    RequestBuilder,
    check_prompt_config,
)
from batchgen.io.openai_results import write_openai_results
from batchgen.io.output_location import check_output_outside_input
from batchgen.io.output_schema import RESERVED, output_columns, shard_schema
from batchgen.pipeline import Consumer, Producer, Stats, row_hash, wait_for
from batchgen.prompts import PromptBuilder, RowPrompt
from batchgen.spec import JobSpec

IDLE_WAIT_S = 0.05  # how long the engine thread waits for a prompt when it runs nothing


class JobResult(NamedTuple):
    summary: dict[str, Any]
    interrupted: bool
    complete: bool


class Hooks(NamedTuple):
    """How an in-process caller follows a job (the lazy datasets API)."""

    on_rows: Callable[[list[dict[str, Any]]], None] | None = None  # each finished input row
    admit: Callable[[int], bool] | None = None  # False = hold the row of this index back
    on_start: Callable[[OutputLayout, Committed], None] | None = None  # after the resume checks
    verify_rows: bool = True  # check a fingerprint-less input row by row before resuming


NO_HOOKS = Hooks()


def check_job(spec: JobSpec, source: InputSource | None = None) -> InputSource:
    """Every check that needs no model: input readable, columns present, output location.

    source: an input opened by the caller (an in-process dataset); None = open spec.input.
    """
    if spec.input.format == OPENAI_BATCH:
        check_prompt_config(spec.prompt)
    check_backend(spec.engine, resolve_device(spec.engine))  # before any model work
    if source is None:
        source = open_input(spec.input)
        check_output_outside_input(Path(spec.output.dir), spec.input, source)
        if source.num_rows == 0:
            raise BatchgenError(
                f"input {spec.input.path!r} holds no rows ({source.description}): nothing to do"
            )
    if spec.input.format == OPENAI_BATCH:
        return source
    needed = spec.prompt.columns_used()
    if source.sampled:  # JSONL: a column the first rows lack may come later, rows vary
        needed = spec.prompt.required_columns() if source.columns else []
    missing = [c for c in needed if source.columns is not None and c not in source.columns]
    if missing:
        raise BatchgenError(
            f"input has no column {missing[0]!r} (columns: "
            f"{', '.join(source.columns)}): fix [prompt] or the input"
        )
    clash = [c for c in spec.prompt.passthrough if c in RESERVED]
    if clash:
        raise BatchgenError(
            f"pass-through column {clash[0]!r} would overwrite an output column: "
            "rename it in the input"
        )
    return source


def job_columns(spec: JobSpec, source: InputSource) -> dict[str, pa.DataType | None]:
    """The job's fixed output columns: batchgen's own, then the pass-through ones."""
    openai = spec.input.format == OPENAI_BATCH
    logprobs = openai or spec.sampling.logprobs is not None or spec.prompt.sampling_column
    own = output_columns(logprobs=bool(logprobs), token_ids=spec.output.include_token_ids)
    names = PASSTHROUGH if openai else spec.prompt.passthrough
    passthrough = {name: source.types.get(name) for name in names}
    return shard_schema(own, passthrough, input_hash=source.fingerprint() is None)


def result_settings(spec: JobSpec, engine: Engine | None) -> dict[str, Any]:
    """Every setting that can change a row's output (flattened "section.key" -> value).
    Without an engine, the ones known before the model loads."""
    d = spec.to_dict()
    out = {f"{section}.{k}": v for section in ("prompt", "sampling") for k, v in d[section].items()}
    out["input.format"] = spec.input.format
    out["output.format"] = spec.output.format
    out["output.include_token_ids"] = spec.output.include_token_ids
    out["model.served_model_name"] = list(spec.model.served_model_name)
    if engine is None:
        dtype = resolve_dtype(spec.engine, resolve_device(spec.engine))
        out["runtime.seed"] = spec.engine.seed
    else:
        dtype = engine.dtype
        out["runtime.seed"] = engine.config.seed
        out["runtime.max_model_len"] = engine.max_model_len
    out["runtime.dtype"] = str(dtype).removeprefix("torch.")
    return out


def run_job(
    spec: JobSpec,
    *,
    force_resume: bool = False,
    engine: Engine | None = None,
    stop: threading.Event | None = None,
    source: InputSource | None = None,
    hooks: Hooks = NO_HOOKS,
    note: Callable[[str], None] | None = None,
) -> JobResult:
    """Run (or resume) a job to completion, or until `stop` is set.

    engine: a loaded engine to use (kept loaded afterwards); source: see check_job;
    note: where warnings go (default: stderr).
    """
    note = note or _to_stderr
    source = check_job(spec, source)
    if engine is None:
        resolve_model_path(spec.model.path)  # a missing model folder fails before any output
    layout = OutputLayout(Path(spec.output.dir))
    with DirectoryLock(layout) as lock:
        previous = _previous(layout, force_resume)
        fingerprint = source.fingerprint()
        current = {"settings": result_settings(spec, None), "input": fingerprint, "model": None}
        _check_resumable(layout, previous, current, ("settings", "input"), force_resume)
        engine = engine or Engine(spec.model.path, spec.engine)
        if engine.tokenizer is None:
            raise BatchgenError(
                f"model '{spec.model.path}' has no tokenizer: batchgen jobs need one"
            )
        current.update(settings=result_settings(spec, engine), model=engine.fingerprint)
        _check_resumable(layout, previous, current, IDENTITY_PARTS, force_resume)
        resuming = _claim(layout, spec, current, previous)
        remove_temp_files(layout)
        committed = scan_committed(layout, note)
        columns = job_columns(spec, source)
        if resuming and fingerprint is None and committed.indexes and hooks.verify_rows:
            _verify_rows(spec, source, committed)
        if hooks.on_start is not None:
            hooks.on_start(layout, committed)
        return _run(spec, source, engine, layout, committed, columns, stop, hooks, resuming, lock)


def _run(
    spec: JobSpec,
    source: InputSource,
    engine: Engine,
    layout: OutputLayout,
    committed: Committed,
    columns: dict[str, pa.DataType | None],
    stop: threading.Event | None,
    hooks: Hooks,
    resuming: bool,
    lock: DirectoryLock,
) -> JobResult:
    stop = stop or threading.Event()
    started = time.perf_counter()
    done = committed.indexes
    total = None if source.num_rows is None else max(0, source.num_rows - len(done))
    with tqdm(total=total, unit="row", disable=spec.pipeline.quiet, dynamic_ncols=True) as bar:
        stats, producer = _run_pipeline(
            spec, source, engine, layout, done, columns, stop, hooks, _progress(bar, started), lock
        )
    after = scan_committed(layout, _to_stderr)
    read_all = producer.finished and not stop.is_set()
    complete = read_all and after.indexes >= set(range(producer.rows_read))
    summary = _summary(stats, time.perf_counter() - started, resuming, len(after.indexes))
    summary["complete"] = complete
    summary |= _write_results(spec, layout) if complete and spec.output.final_file else {}
    summary.setdefault("result_file", None)
    write_json_atomic(layout.summary, summary)
    return JobResult(summary, stop.is_set(), complete)


def _previous(layout: OutputLayout, force: bool) -> Manifest | None:
    """The manifest of an earlier run, or None for a new (or, with force, adopted) directory."""
    out = layout.dir
    try:
        manifest = read_manifest(layout)
    except DamagedManifest as exc:
        if force:
            return None
        raise BatchgenError(
            f"output directory '{out}': {exc}: use another output directory, or --force-resume "
            "to keep its shards under this job's spec"
        ) from exc
    if manifest is not None or force:
        return manifest
    if layout.shard_paths():
        raise BatchgenError(
            f"output directory '{out}' holds shards but no {layout.manifest.name}: use another "
            "output directory, or --force-resume to keep its shards under this job's spec"
        )
    if layout.holds_anything_but_leftovers() and not _only_empty_shards_dir(layout):
        raise BatchgenError(
            f"output directory '{out}' is not empty and holds no batchgen job: "
            "choose a new or empty directory"
        )
    return None


def _only_empty_shards_dir(layout: OutputLayout) -> bool:
    entries = [p for p in layout.dir.iterdir() if p.name != layout.lock.name]
    return entries == [layout.shards] and not any(layout.shards.iterdir())


def _check_resumable(
    layout: OutputLayout,
    previous: Manifest | None,
    current: dict[str, Any],
    parts: tuple[str, ...],
    force: bool,
) -> None:
    if previous is None or force:
        return
    recorded = previous.identity
    if "settings" in parts and "model" not in parts:  # before the model loads
        keys = set(current["settings"])
        recorded = {
            **recorded,
            "settings": {k: v for k, v in recorded["settings"].items() if k in keys},
        }
    changes = identity_changes(recorded, current, parts)
    if changes:
        more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
        raise BatchgenError(
            f"output directory '{layout.dir}' holds results of another job: {changes[0]}{more}; "
            f"use another output directory, delete '{layout.dir}' to start over, or "
            "--force-resume to continue it anyway"
        )


def _claim(
    layout: OutputLayout, spec: JobSpec, identity: dict[str, Any], previous: Manifest | None
) -> bool:
    """Record the job in the manifest -> True when the directory already held it."""
    if previous is not None and previous.identity == identity:
        return True
    before = None if previous is None else {"spec": previous.spec, "identity": previous.identity}
    write_manifest(layout, spec.to_dict(), identity, before)
    return previous is not None or bool(layout.shard_paths())


def _verify_rows(spec: JobSpec, source: InputSource, committed: Committed) -> None:
    """For an input without a fingerprint: every committed row must still read the same."""
    last = max(committed.indexes)
    columns = _read_columns(spec)
    for batch in source.batches(columns):
        for row in batch:
            recorded = committed.hashes.get(row.index)
            if recorded is not None and recorded != row_hash(row):
                raise BatchgenError(
                    f"input row {row.index} is not the row the output directory holds a result "
                    "for: the input changed since the last run (or reads in another order); "
                    "use another output directory, or delete it to start over"
                )
            if row.index >= last:
                return
    raise BatchgenError(
        f"the input now has fewer rows than the output directory holds results for (up to "
        f"row {last}): the input changed; use another output directory, or delete it"
    )


def _read_columns(spec: JobSpec) -> list[str] | None:
    if spec.input.format == OPENAI_BATCH:
        return None
    return spec.prompt.columns_used() or None


def _run_pipeline(
    spec: JobSpec,
    source: InputSource,
    engine: Engine,
    layout: OutputLayout,
    done: set[int],
    columns: dict[str, pa.DataType | None],
    stop: threading.Event,
    hooks: Hooks,
    on_row: Any,
    lock: DirectoryLock,
) -> tuple[Stats, Producer]:
    builder, id_column = _prompt_stage(spec, engine)
    halt = threading.Event()  # stops the producer however the engine loop ends
    producer = Producer(
        source.batches(_read_columns(spec)),
        builder,
        done,
        id_column,
        spec.pipeline.tokenizer_threads,
        spec.pipeline.prefetch_batches,
        halt,
        hash_rows=source.fingerprint() is None,
    )
    out = spec.output
    writer = ShardWriter(
        layout, out.format, columns, out.shard_rows, out.shard_seconds, before_commit=lock.check
    )
    tok = engine.tokenizer
    consumer = Consumer(
        writer,
        lambda ids: tok.decode(ids, skip_special_tokens=True),
        out.include_token_ids,
        on_row,
        hooks.on_rows,
    )
    producer.start()
    consumer.start()
    try:
        _drive_engine(engine, spec, producer, consumer, stop, hooks.admit)
    finally:
        halt.set()
        consumer.queue.put(None)
        wait_for(consumer)
    if producer.error is not None:
        raise producer.error
    if consumer.error is not None:
        raise _write_failed(consumer.error, layout)
    return consumer.stats, producer


def _write_failed(exc: BaseException, layout: OutputLayout) -> BaseException:
    if isinstance(exc, BatchgenError):
        return exc
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        reason = "the disk is full"
    else:
        reason = (
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        )
    error = BatchgenError(
        f"writing results into '{layout.dir}' failed ({reason}): the rows committed so far are "
        "kept; fix the cause and run the same command again to resume"
    )
    error.__cause__ = exc
    return error


def _prompt_stage(spec: JobSpec, engine: Engine) -> tuple[Any, str | None]:
    """-> (the row -> prompt builder, the id column)."""
    args = (engine.tokenizer, engine.max_model_len - 1, spec.sampling)
    if spec.input.format == OPENAI_BATCH:
        return RequestBuilder(spec.prompt, *args, served_names=spec.model.names), ID_COLUMN
    return PromptBuilder(spec.prompt, *args), spec.prompt.id_column


def _drive_engine(
    engine: Engine,
    spec: JobSpec,
    producer: Producer,
    consumer: Consumer,
    stop: threading.Event,
    admit: Callable[[], bool] | None,
) -> None:
    """The engine thread: prompts in, finished requests out to the writer. It never waits
    for the tokenizer while the engine has work, and stops at once if the writer fails."""
    in_flight: dict[int, RowPrompt] = {}
    finished: dict[int, int] = {}  # samples finished so far, for prompts with n > 1

    def prompts() -> Any:
        held: RowPrompt | None = None  # a row the caller's admission held back
        while not (stop.is_set() or consumer.failed.is_set()):
            idle = not engine.has_unfinished()
            row = held or producer.next_row(IDLE_WAIT_S if idle else 0.0)
            held = None
            if row is None:
                return
            if row is NOT_READY:
                yield NOT_READY
                continue
            if admit is not None and not admit(row.index):
                held = row
                if idle:
                    time.sleep(IDLE_WAIT_S)
                yield NOT_READY
                continue
            if row.error is not None:
                consumer.queue.put((row, None))
                continue
            in_flight[row.index] = row
            # a seed derived from runtime.seed follows the row's id, not its position
            yield Prompt(row.prompt_ids, str(row.index), row.overrides or None, seed_key=row.id)

    for out in engine.generate(
        prompts(), spec.sampling, decode=False, stop=_either(stop, consumer)
    ):
        index = int(out.request_id)
        finished[index] = finished.get(index, 0) + 1
        if finished[index] == out.num_samples:
            del finished[index]
            consumer.queue.put((in_flight.pop(index), out))
        else:
            consumer.queue.put((in_flight[index], out))
        if consumer.failed.is_set():
            break


class _either:
    """An Event-like view: set when the job is stopped or the writer failed."""

    def __init__(self, stop: threading.Event, consumer: Consumer) -> None:
        self.stop, self.consumer = stop, consumer

    def is_set(self) -> bool:
        return self.stop.is_set() or self.consumer.failed.is_set()

    def set(self) -> None:
        self.stop.set()


def _progress(bar: tqdm, started: float) -> Any:
    last = [0.0]

    def on_row(stats: Stats) -> None:
        bar.update(1)
        now = time.perf_counter()
        if now - last[0] > 0.5:
            last[0] = now
            elapsed = max(now - started, 1e-9)
            bar.set_postfix(
                prompt_tok_s=f"{stats.prompt_tokens / elapsed:,.0f}",
                gen_tok_s=f"{stats.generated_tokens / elapsed:,.0f}",
                errors=stats.rows_error,
                refresh=False,
            )

    return on_row


def _summary(stats: Stats, wall_s: float, resumed: bool, committed: int) -> dict[str, Any]:
    return {
        "rows_ok": stats.rows_ok,
        "rows_error": stats.rows_error,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "wall_s": round(wall_s, 3),
        "generated_tokens_per_s": round(stats.generated_tokens / max(wall_s, 1e-9), 1),
        "rows_per_s": round((stats.rows_ok + stats.rows_error) / max(wall_s, 1e-9), 2),
        "rows_committed_total": committed,
        "resumed": resumed,
    }


def _write_results(spec: JobSpec, layout: OutputLayout) -> dict[str, str]:
    """The final file(s) in input order: results.<format>, or OpenAI results + errors files."""
    fmt = spec.output.format
    try:
        if spec.input.format == OPENAI_BATCH:
            results, errors = layout.openai_results, layout.openai_errors
            write_openai_results(layout, fmt, spec.model.names[0], results, errors)
            return {"result_file": str(results), "error_file": str(errors)}
        result = layout.results(fmt)
        write_final(layout, fmt, result)
        return {"result_file": str(result)}
    except OSError as exc:
        raise _write_failed(exc, layout) from exc


def _to_stderr(message: str) -> None:
    tqdm.write(f"batchgen: {message}", file=sys.stderr)
