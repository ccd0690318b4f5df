"""A job: spec -> checks -> engine + pipeline threads -> committed shards -> final file."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from tqdm import tqdm

from batchgen.engine import Engine, Prompt
from batchgen.engine.model_loader import resolve_model_path
from batchgen.errors import BatchgenError
from batchgen.io import (
    InputSource,
    ShardWriter,
    committed_indexes,
    open_input,
    remove_temp_files,
    write_final,
)
from batchgen.io.checkpoint import claim_output_dir, write_json_atomic
from batchgen.io.openai_batch import ID_COLUMN, OPENAI_BATCH, RequestBuilder, check_prompt_config
from batchgen.io.openai_results import write_openai_results
from batchgen.pipeline import Consumer, Producer, Stats, wait_for
from batchgen.prompts import PromptBuilder, RowPrompt
from batchgen.spec import JobSpec

OUTPUT_COLUMNS = (
    "index",
    "id",
    "sample_index",
    "logprobs",
    "text",
    "finish_reason",
    "num_prompt_tokens",
    "num_generated_tokens",
    "error",
    "prompt_token_ids",
    "token_ids",
)


class JobResult(NamedTuple):
    summary: dict[str, Any]
    interrupted: bool
    complete: bool


def check_job(spec: JobSpec, source: InputSource | None = None) -> InputSource:
    """Every check that needs no model: input readable, columns present. -> the input source.

    source: an input opened by the caller (an in-process dataset); None = open spec.input.
    """
    if spec.input.format == OPENAI_BATCH:
        check_prompt_config(spec.prompt)
        return source or open_input(spec.input)
    source = source or open_input(spec.input)
    needed = spec.prompt.columns_used()
    missing = [c for c in needed if source.columns is not None and c not in source.columns]
    if missing:
        raise BatchgenError(
            f"input has no column {missing[0]!r} (columns: "
            f"{', '.join(source.columns)}): fix [prompt] or the input"
        )
    clash = [c for c in spec.prompt.passthrough if c in OUTPUT_COLUMNS]
    if clash:
        raise BatchgenError(
            f"pass-through column {clash[0]!r} would overwrite an output column: "
            "rename it in the input"
        )
    return source


def run_job(
    spec: JobSpec,
    *,
    force_resume: bool = False,
    engine: Engine | None = None,
    stop: threading.Event | None = None,
    source: InputSource | None = None,
) -> JobResult:
    """Run (or resume) a job to completion, or until `stop` is set.

    engine: a loaded engine to use (kept loaded afterwards); source: see check_job.
    """
    source = check_job(spec, source)
    if engine is None:
        resolve_model_path(spec.model.path)  # a missing model folder fails before any output
    out_dir = Path(spec.output.dir)
    resuming = claim_output_dir(out_dir, spec.to_dict(), force_resume)
    remove_temp_files(out_dir)
    done = committed_indexes(out_dir)
    engine = engine or Engine(spec.model.path, spec.engine)
    if engine.tokenizer is None:
        raise BatchgenError(f"model '{spec.model.path}' has no tokenizer: batchgen jobs need one")
    stop = stop or threading.Event()
    started = time.perf_counter()
    total = None if source.num_rows is None else max(0, source.num_rows - len(done))
    with tqdm(total=total, unit="row", disable=spec.pipeline.quiet, dynamic_ncols=True) as bar:
        stats, producer = _run_pipeline(spec, source, engine, done, stop, _progress(bar, started))
    complete = producer.finished and not stop.is_set()
    summary = _summary(spec, stats, time.perf_counter() - started, resuming, out_dir, complete)
    write_json_atomic(out_dir / "summary.json", summary)
    return JobResult(summary, stop.is_set(), complete)


def _run_pipeline(
    spec: JobSpec, source: Any, engine: Engine, done: set[int], stop: threading.Event, on_row: Any
) -> tuple[Stats, Producer]:
    builder, columns, id_column = _prompt_stage(spec, engine)
    halt = threading.Event()  # stops the producer however the engine loop ends
    producer = Producer(
        source.batches(columns),
        builder,
        done,
        id_column,
        spec.pipeline.tokenizer_threads,
        spec.pipeline.prefetch_batches,
        halt,
    )
    out = spec.output
    writer = ShardWriter(Path(out.dir), out.format, out.shard_rows, out.shard_seconds)
    tok = engine.tokenizer
    consumer = Consumer(
        writer, lambda ids: tok.decode(ids, skip_special_tokens=True), out.include_token_ids, on_row
    )
    producer.start()
    consumer.start()
    try:
        _drive_engine(engine, spec, producer, consumer, stop)
    finally:
        halt.set()
        consumer.queue.put(None)
        wait_for(consumer)
    for thread in (producer, consumer):
        if thread.error is not None:
            raise thread.error
    return consumer.stats, producer


def _prompt_stage(spec: JobSpec, engine: Engine) -> tuple[Any, list[str] | None, str | None]:
    """-> (the row -> prompt builder, input columns to read (None = all), the id column)."""
    args = (engine.tokenizer, engine.max_model_len - 1, spec.sampling.max_new_tokens)
    if spec.input.format == OPENAI_BATCH:
        return RequestBuilder(spec.prompt, *args), None, ID_COLUMN
    return (
        PromptBuilder(spec.prompt, *args),
        spec.prompt.columns_used() or None,
        spec.prompt.id_column,
    )


def _drive_engine(
    engine: Engine, spec: JobSpec, producer: Producer, consumer: Consumer, stop: threading.Event
) -> None:
    """The engine thread: prompts in, finished requests out to the writer."""
    in_flight: dict[int, RowPrompt] = {}
    finished: dict[int, int] = {}  # samples finished so far, for prompts with n > 1

    def prompts() -> Any:
        for row in producer.prompts():
            if stop.is_set():
                return
            if row.error is not None:
                consumer.queue.put((row, None))
                continue
            in_flight[row.index] = row
            yield Prompt(row.prompt_ids, str(row.index), row.overrides or None)

    for out in engine.generate(prompts(), spec.sampling, decode=False, stop=stop):
        index = int(out.request_id)
        finished[index] = finished.get(index, 0) + 1
        if finished[index] == out.num_samples:
            del finished[index]
            consumer.queue.put((in_flight.pop(index), out))
        else:
            consumer.queue.put((in_flight[index], out))


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


def _summary(
    spec: JobSpec, stats: Stats, wall_s: float, resumed: bool, out_dir: Path, complete: bool
) -> dict[str, Any]:
    files = {"result_file": None}
    if complete and spec.output.final_file:
        files = _write_results(spec, out_dir)
    committed = len(committed_indexes(out_dir))
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
        "complete": complete,
        **files,
    }


def _write_results(spec: JobSpec, out_dir: Path) -> dict[str, str]:
    """The final file(s) in input order: results.<format>, or OpenAI results + errors files."""
    fmt = spec.output.format
    if spec.input.format == OPENAI_BATCH:
        results, errors = out_dir / "results.jsonl", out_dir / "errors.jsonl"
        write_openai_results(out_dir, fmt, spec.model.path, results, errors)
        return {"result_file": str(results), "error_file": str(errors)}
    result = out_dir / f"results.{fmt}"
    write_final(out_dir, fmt, result)
    return {"result_file": str(result)}
