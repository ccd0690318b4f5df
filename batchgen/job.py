"""A job: spec -> checks -> lock -> engine -> identity -> pipeline threads -> committed shards
-> final file.

Nothing is written into the output directory before the job is known to be resumable there:
the lock is taken first, the identity recorded in the manifest is compared (settings and input
before the model loads, the model after), and only then is the manifest written.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from tqdm import tqdm

from batchgen.engine.attention.select import check_backend
from batchgen.engine.device import resolve_device, resolve_dtype
from batchgen.engine.model_path import (
    DEFAULT_MODEL,
    check_max_model_len,
    file_generation_defaults,
    model_context,
    model_vocab,
    resolve_model_path,
)
from batchgen.engine.prefix_cache import CacheStats
from batchgen.engine.remote.client import EngineProcess, EngineServer, RemoteRecorder
from batchgen.engine.remote.placement import off_cores
from batchgen.engine.request import NOT_READY, Prompt
from batchgen.engine.sampling_params import with_defaults
from batchgen.errors import BatchgenError
from batchgen.formats import input_format
from batchgen.formats.base import FinalFiles
from batchgen.io import InputSource, OutputLayout, ShardWriter
from batchgen.io.atomic import write_json_atomic
from batchgen.io.checkpoint import (
    GENERATION_DEFAULTS,
    IDENTITY_PARTS,
    Committed,
    DamagedManifest,
    Manifest,
    check_directory_writable,
    committed_ids,
    identity_changes,
    moved_files,
    read_manifest,
    remove_result_files,
    remove_temp_files,
    scan_committed,
    write_failed,
    write_manifest,
    writing_into,
)
from batchgen.io.fs import as_path, is_object
from batchgen.io.layout import OUTPUT_FORMATS
from batchgen.io.object_lock import OutputLock, output_lock
from batchgen.io.output_location import check_output_access, check_output_outside_input
from batchgen.io.output_schema import INPUT_HASH, output_columns, shard_schema
from batchgen.pipeline import Consumer, Producer, Stats, wait_for
from batchgen.prompts import RowPrompt, check_template_bos, row_id
from batchgen.row_share import ALONE, RowShare
from batchgen.spec import JobSpec
from batchgen.summary import JobSummary
from batchgen.token_bytes import TokenBytes
from batchgen.tokenizer_pool import TokenizerPool, row_hash

if TYPE_CHECKING:  # an engine in this process is imported only when the job makes one
    from batchgen.engine.engine import Engine
    from batchgen.io.writer import Columns

IDLE_WAIT_S = 0.05  # how long the engine thread waits for a prompt when it runs nothing


class JobResult(NamedTuple):
    summary: JobSummary  # what summary.json holds (for people and scripts)
    interrupted: bool  # this process was asked to stop (a signal)
    stopped_by: str | None = None  # another rank of a data-parallel job stopped it: why
    profile_file: str | None = None  # this run's step records (runtime.profile)

    @property
    def complete(self) -> bool:
        """Every input row is in a committed shard (read back)."""
        return self.summary.complete

    @property
    def rows_committed(self) -> int:
        """Input rows in committed shards, over all runs."""
        return self.summary.rows_committed_total

    @property
    def result_file(self) -> str | None:
        """The final file, when the job completed."""
        return self.summary.result_file


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
    fmt = input_format(spec.input.format)
    fmt.check(spec)
    check_backend(spec.engine, resolve_device(spec.engine))  # before any model work
    if source is None:
        source = fmt.open(spec)
        check_output_outside_input(as_path(spec.output.dir), spec.input, source)
        if source.num_rows == 0:
            raise BatchgenError(
                f"input {spec.input.path!r} holds no rows ({source.description}): nothing to do"
            )
    fmt.check_columns(spec, source)
    return source


def job_columns(spec: JobSpec, source: InputSource) -> Columns:
    """The job's fixed output columns: batchgen's own, then the pass-through ones."""
    fmt = input_format(spec.input.format)
    own = output_columns(
        logprobs=fmt.may_ask_logprobs(spec), token_ids=spec.output.include_token_ids
    )
    passthrough = fmt.passthrough(spec, source)
    return shard_schema(own, passthrough, input_hash=source.fingerprint() is None)


def model_defaults(spec: JobSpec, engine: Engine | EngineProcess) -> dict[str, Any]:
    """The model's recommended sampling values (runtime.generation_config) that the job
    takes: those of the fields its own [sampling] does not set."""
    return _not_given(spec, engine.generation_defaults)


def file_model_defaults(spec: JobSpec) -> dict[str, Any]:
    """model_defaults as far as the model's folder says before it loads (`validate`)."""
    if spec.engine.generation_config != "auto":
        return {}
    return _not_given(spec, file_generation_defaults(spec.model.path))


def _not_given(spec: JobSpec, recommended: dict[str, Any]) -> dict[str, Any]:
    """The recommended values of the fields the job does not set, by name."""
    if spec.sampling_given is None:
        return {}
    return {k: v for k, v in sorted(recommended.items()) if k not in spec.sampling_given}


def model_defaults_line(taken: dict[str, Any], lead: str) -> str:
    """The one line that names the model's values a job takes (`lead`: who takes them)."""
    values = ", ".join(f"{k}={v!r}" for k, v in taken.items())
    return (
        f"{lead} the model's generation_config.json values {values} where the job does not "
        'set them (runtime.generation_config = "ignore" keeps batchgen\'s defaults)'
    )


def with_model_defaults(spec: JobSpec, engine: Engine | EngineProcess) -> JobSpec:
    """The job as it runs: its [sampling] with the model's recommended values taken."""
    taken = model_defaults(spec, engine)
    if not taken:
        return spec
    try:
        return dataclasses.replace(spec, sampling=with_defaults(spec.sampling, taken))
    except ValueError as exc:
        raise BatchgenError(str(exc)) from None


def note_model_defaults(
    spec: JobSpec, engine: Engine | EngineProcess, note: Callable[[str], None]
) -> None:
    """One line naming the model's recommended values the job takes, as vLLM warns."""
    taken = model_defaults(spec, engine)
    if taken:
        note(model_defaults_line(taken, "taking"))


def result_settings(spec: JobSpec, engine: Engine | None) -> dict[str, Any]:
    """Every setting that can change a row's output (flattened "section.key" -> value).
    Without an engine, the ones known before the model loads."""
    d = spec.to_dict()
    out = {f"{section}.{k}": v for section in ("prompt", "sampling") for k, v in d[section].items()}
    out["input.format"] = spec.input.format
    out["output.format"] = spec.output.format
    out["output.include_token_ids"] = spec.output.include_token_ids
    out["model.served_model_name"] = list(spec.model.served_model_name)
    out["runtime.quantization"] = spec.engine.quantization  # FP8 weights round differently
    out["runtime.kv_cache_dtype"] = spec.engine.kv_cache_dtype  # as does an FP8 KV cache
    if engine is None:
        dtype = resolve_dtype(spec.engine, resolve_device(spec.engine))
        out["runtime.seed"] = spec.engine.seed
        if spec.engine.max_model_len is not None:  # the engine's; unset: the model's, once loaded
            out["runtime.max_model_len"] = spec.engine.max_model_len
    else:
        dtype = engine.dtype
        out["runtime.seed"] = engine.config.seed
        out["runtime.max_model_len"] = engine.max_model_len
        out[GENERATION_DEFAULTS] = model_defaults(spec, engine)
    out["runtime.dtype"] = str(dtype).removeprefix("torch.")
    return out


def write_summary(layout: OutputLayout, summary: JobSummary) -> None:
    """summary.json: the summary's fields in their order (a full disk: one line)."""
    with writing_into(layout):
        write_json_atomic(layout.summary, summary.to_dict(), sort_keys=False)


def load_engine(
    spec: JobSpec, data_parallel: bool = False, server: EngineServer | None = None
) -> Engine | EngineProcess:
    """The job's engine, in a process of its own (started here, or the early `server`) or in
    this one (PipelineConfig.own_engine_process); transformers' progress bars follow
    runtime.quiet while it loads. A server the engine does not use is closed; one placed by
    its starter (the command line, which keeps this process off its cores) keeps its cores."""
    cuda = resolve_device(spec.engine).type == "cuda"
    if spec.pipeline.own_engine_process(cuda, data_parallel):
        if server is not None and server.cpus:
            cpus = server.cpus
        else:
            cpus = spec.engine_cores(os.sched_getaffinity(0))
        return EngineProcess(
            spec.model.path, spec.engine, quiet=spec.pipeline.quiet, server=server, cpus=cpus
        )
    if server is not None:
        server.close()
    began = time.perf_counter()  # the engine's imports (seconds, the first time) count in "load"
    from batchgen.engine.engine import Engine
    from batchgen.engine.model_loader import hf_progress_bars

    imports_s = time.perf_counter() - began
    with hf_progress_bars(shown=not spec.pipeline.quiet):
        engine = Engine(spec.model.path, spec.engine)
    engine.startup_s["load"] = round(engine.startup_s.get("load", 0.0) + imports_s, 3)
    return engine


def run_job(
    spec: JobSpec,
    *,
    force_resume: bool | None = False,
    engine: Engine | None = None,
    stop: threading.Event | None = None,
    source: InputSource | None = None,
    hooks: Hooks = NO_HOOKS,
    note: Callable[[str], None] | None = None,
    process_s: float | None = None,
    engine_server: EngineServer | None = None,
) -> JobResult:
    """Run (or resume) a job to completion, or until `stop` is set.

    force_resume: resume an output directory whose job differs; None where the caller offers
    no such option (the datasets API: refusals name another checkpoint_dir instead);
    engine: a loaded engine to use (kept loaded afterwards); source: see check_job;
    note: where warnings go (default: stderr); process_s: the process's age when the caller
    began the job (the CLI's; reported as the first start-up phase); engine_server: an
    EngineServer the caller started early, for the job's engine if that gets a process of its
    own (the caller closes it after the job: a no-op once the engine has taken and closed it).
    """
    note = note or _to_stderr
    started = time.perf_counter()
    source = check_job(spec, source)
    if engine is None:  # a missing model folder, a setting it cannot take: before any output
        resolve_model_path(spec.model.path)
        check_model_before_load(spec)
    layout = OutputLayout(spec.output.dir)
    check_output_access(layout.dir)  # on a store: list, write and delete, before the lock
    with output_lock(layout) as lock:
        previous, current = check_output_dir(spec, layout, source, force_resume)
        startup = {} if process_s is None else {"process": process_s}
        startup["checks"] = round(time.perf_counter() - started, 3)
        owned = engine is None
        if owned:
            engine = load_engine(spec, server=engine_server)
            startup |= engine.startup_s
        try:
            return _with_engine(spec, engine, layout, previous, current, source, lock,
                                startup, force_resume, stop, hooks, note)  # fmt: skip
        finally:
            if owned:
                engine.close()  # the job's own engine: its memory (and process) go now


def _with_engine(
    spec: JobSpec,
    engine: Engine | EngineProcess,
    layout: OutputLayout,
    previous: Manifest | None,
    current: dict[str, Any],
    source: InputSource,
    lock: OutputLock,
    startup: dict[str, float],
    force_resume: bool | None,
    stop: threading.Event | None,
    hooks: Hooks,
    note: Callable[[str], None],
) -> JobResult:
    """The job once its engine is loaded: the model's identity checked, the manifest claimed,
    then the pipeline."""
    check_tokenizer(spec, engine.tokenizer)
    running = with_model_defaults(spec, engine)  # the job as it runs; `spec` as it was given
    try:  # a job-wide value the model cannot take is one error, not one per row
        engine.check_sampling(running.sampling)
    except ValueError as exc:
        raise BatchgenError(f"[sampling] {exc}") from None
    current.update(settings=result_settings(spec, engine), model=engine.fingerprint)
    resuming, committed = take_directory(
        spec, source, layout, previous, current, force_resume, note, hooks.verify_rows
    )
    columns = job_columns(spec, source)
    note_model_defaults(spec, engine, note)  # quiet or not: how the rows are sampled
    if hooks.on_start is not None:
        hooks.on_start(layout, committed)
    kept = engine.server.cpus if isinstance(engine, EngineProcess) else frozenset()
    with off_cores(kept):  # the job's threads leave the engine process its cores
        return _run(
            running, source, engine, layout, committed, columns, stop, hooks, resuming, lock,
            startup,
        )  # fmt: skip


def _run(
    spec: JobSpec,
    source: InputSource,
    engine: Engine,
    layout: OutputLayout,
    committed: Committed,
    columns: Columns,
    stop: threading.Event | None,
    hooks: Hooks,
    resuming: bool,
    lock: OutputLock,
    startup: dict[str, float],
) -> JobResult:
    stop = stop or threading.Event()
    started = time.perf_counter()
    done = committed.indexes
    total = None if source.num_rows is None else max(0, source.num_rows - len(done))
    before = engine.cache_stats  # the engine may have run other work before this job

    def cache() -> CacheStats:
        return engine.cache_stats - before

    with tqdm(total=total, unit="row", disable=spec.pipeline.quiet, dynamic_ncols=True) as bar:
        on_row = _progress(bar, started, cache)
        stats, producer, profile = run_pipeline(
            spec, source, engine, layout, done, columns, stop, hooks, on_row, lock.check
        )
        show_rates(bar, time.perf_counter() - started, stats.prompt_tokens,  # the last rows'
                   stats.generated_tokens, stats.rows_error, cache().hit_rate)  # fmt: skip
    after = scan_committed(layout, _to_stderr)
    # a stop that came once every row was committed leaves the job complete
    complete = producer.finished and after.indexes >= set(range(producer.rows_read))
    final = complete and spec.output.final_file
    files = write_results(spec, layout, engine.tokenizer) if final else None
    if stats.first_row_at is not None:
        startup["first_row"] = round(stats.first_row_at - started, 3)
    cached = cache()
    summary = JobSummary(
        **JobSummary.counts(after.counts, stats),
        prompt_tokens_cached=cached.cached_tokens,
        prefix_cache_hit_rate=round(cached.hit_rate, 4),
        wall_s=time.perf_counter() - started,
        rows_committed_total=len(after.indexes),
        resumed=resuming,
        complete=complete,
        result_file=None if files is None else files.result_file,
        error_file=None if files is None else files.error_file,
        startup_s=startup,
        # the job's own engine process: its phases, whole (startup_s has what was waited for)
        engine_startup_s=engine.engine_startup_s if "engine_process" in startup else {},
    )
    write_summary(layout, summary)
    interrupted = stop.is_set() and not complete
    return JobResult(summary, interrupted, profile_file=None if profile is None else str(profile))


def check_output_dir(
    spec: JobSpec,
    layout: OutputLayout,
    source: InputSource,
    force: bool | None,
    new_needs_input: bool = True,
) -> tuple[Manifest | None, dict[str, Any]]:
    """Whether the output directory takes this job, as far as is known before the model
    loads (reads only) -> (the earlier run's manifest, the job's identity so far). The input's
    fingerprint (a hash of its files) is taken for a new directory only if new_needs_input
    (a run records it; a check alone does not need it)."""
    previous = previous_run(layout, force)
    current = {
        "settings": result_settings(spec, None),
        "input": source.fingerprint() if previous is not None or new_needs_input else None,
        "model": None,
    }
    check_resumable(layout, previous, current, ("settings", "input"), force)
    return previous, current


def check_output_dir_before_lock(spec: JobSpec, source: InputSource, force: bool) -> None:
    """What `run` would refuse about the output directory before any model work, checked
    without taking its lock or writing into it (`batchgen validate`)."""
    layout = OutputLayout(spec.output.dir)
    if is_object(layout.dir):
        check_output_access(layout.dir)  # a probe object: a store's permissions show no other way
    else:
        check_directory_writable(layout.dir)
    previous, current = check_output_dir(spec, layout, source, force, new_needs_input=False)
    if previous is not None:  # its committed rows as `run` checks them, none moved aside
        committed = scan_committed(layout, _to_stderr, aside=False)
        check_committed(spec, source, layout, previous, current, force, committed)


def check_model_before_load(spec: JobSpec) -> None:
    """What loading the model would refuse at start, found without loading it from the spec
    and the model's config.json (the embedded default's context: the shape it is built
    with; it is not built here): a local model path that does not exist, a max_model_len over
    the model's context, an unchunked step budget under it, a num_kv_blocks too small for the
    start-up check, [sampling] stop_token_ids outside the vocabulary, a structured output that
    cannot compile. What needs the model itself (its tokenizer, its forward pass) stays with
    the run."""
    from batchgen.engine.config import DEFAULT_BLOCK_SIZE, check_prefill_budget
    from batchgen.engine.grammar import check_grammar, grammar_spec
    from batchgen.engine.probe_requests import check_probe_room, probe_tokens
    from batchgen.engine.request import outside_vocab, stop_id_problem

    config = spec.engine
    limit = model_context(spec.model.path)
    if limit is not None:
        check_max_model_len(config.max_model_len, limit)
        max_model_len = config.max_model_len or limit
        check_prefill_budget(config, max_model_len)
        # an FP8 cache's unset block size depends on the GPU: left to the run
        block_size = config.block_size or (
            DEFAULT_BLOCK_SIZE if config.kv_cache_dtype != "fp8" else None
        )
        if config.check_model and config.num_kv_blocks is not None and block_size is not None:
            check_probe_room(config.num_kv_blocks, block_size, probe_tokens(max_model_len))
    sampling = spec.sampling
    vocab = model_vocab(spec.model.path)
    if vocab is not None and sampling.stop_token_ids:
        bad = outside_vocab(sampling.stop_token_ids, vocab)
        if bad is not None:
            raise BatchgenError(f"[sampling] {stop_id_problem(bad, vocab)}")
    grammar = grammar_spec(sampling)
    if grammar is not None:
        try:
            check_grammar(grammar)
        except ValueError as exc:
            raise BatchgenError(f"[sampling] {exc}") from None


def check_tokenizer(spec: JobSpec, tokenizer: Any) -> None:
    """What the model's tokenizer makes impossible for every row, one error instead of one
    per row: no tokenizer, chat messages without a chat template, a prompt.template that
    begins with the BOS the tokenizer adds itself."""
    if tokenizer is None:
        raise BatchgenError(f"model '{spec.model.path}' has no tokenizer: batchgen jobs need one")
    if spec.prompt.messages_column is not None and not getattr(tokenizer, "chat_template", None):
        raise BatchgenError(
            f"model '{spec.model.path}' has no chat template, so prompt.messages_column cannot "
            "be rendered: use an instruction-tuned model, or prompt.column / prompt.template"
        )
    try:
        check_template_bos(spec.prompt, tokenizer)
    except ValueError as exc:
        raise BatchgenError(str(exc)) from None


def check_tokenizer_before_load(spec: JobSpec) -> None:
    """`validate`: check_tokenizer and the [sampling] structured output compiled for the
    model's tokenizer (a grammar no text matches), as the run finds them once the model is
    loaded; for a local model folder, or the embedded default once built (a hub id's
    tokenizer is left to the run, which downloads it)."""
    from batchgen.engine.grammar import check_grammar, grammar_spec
    from batchgen.engine.tokenizer_loader import load_tokenizer
    from batchgen.models import default_model_folder

    folder = default_model_folder() if spec.model.path == DEFAULT_MODEL else None
    folder = folder or Path(spec.model.path).expanduser()
    if not (folder / "config.json").is_file():
        return
    tokenizer = load_tokenizer(str(folder))
    check_tokenizer(spec, tokenizer)
    grammar = grammar_spec(spec.sampling)
    if grammar is not None:
        try:
            check_grammar(grammar, tokenizer, model_vocab(spec.model.path))
        except ValueError as exc:
            raise BatchgenError(f"[sampling] {exc}") from None


def previous_run(layout: OutputLayout, force: bool | None) -> Manifest | None:
    """The manifest of an earlier run, or None for a new (or, with force, adopted) directory.
    A directory holding files but no batchgen job is refused, with force too: its files are
    the user's, and a run would write over them."""
    out = layout.dir
    try:
        manifest = read_manifest(layout)
    except DamagedManifest as exc:
        if force:
            return None
        raise BatchgenError(
            f"output directory '{out}': {exc}: {_keep_shards(layout, force)}"
        ) from exc
    if manifest is not None:
        return manifest
    if layout.shard_paths():
        if force:  # a batchgen job's shards without its manifest: adopted
            return None
        raise BatchgenError(
            f"output directory '{out}' holds shards but no {layout.manifest.name}: "
            f"{_keep_shards(layout, force)}"
        )
    if layout.holds_anything_but_leftovers() and not _only_empty_shards_dir(layout):
        raise BatchgenError(
            f"output directory '{out}' is not empty and holds no batchgen job: "
            "choose a new or empty directory"
            + (" (--force-resume adopts only a batchgen job's shards)" if force else "")
        )
    return None


def _keep_shards(layout: OutputLayout, force: bool | None) -> str:
    """What to do about a directory of shards that no manifest describes."""
    if force is None:
        return _another_checkpoint_dir(layout)
    return (
        "use another output directory, or --force-resume to keep its shards under this job's spec"
    )


def _another_checkpoint_dir(layout: OutputLayout) -> str:
    """The way out of a refused output directory where --force-resume is not offered."""
    return f"use another checkpoint_dir, or delete '{layout.dir}' to start over"


def _only_empty_shards_dir(layout: OutputLayout) -> bool:
    entries = [p for p in layout.dir.iterdir() if p.name != layout.lock.name]
    return entries == [layout.shards] and not any(layout.shards.iterdir())


def check_resumable(
    layout: OutputLayout,
    previous: Manifest | None,
    current: dict[str, Any],
    parts: tuple[str, ...],
    force: bool | None,
) -> None:
    """force None: no --force-resume is offered (the datasets API)."""
    _check_shard_format(layout, current["settings"]["output.format"])
    if previous is None or force:
        return
    changes = identity_changes(previous.identity, current, parts, forceable=force is not None)
    if changes:
        more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
        remedy = (
            _another_checkpoint_dir(layout)
            if force is None
            else f"use another output directory, delete '{layout.dir}' to start over, or "
            "--force-resume to continue it anyway"
        )
        raise BatchgenError(
            f"output directory '{layout.dir}' holds results of another job: {changes[0]}{more}; "
            f"{remedy}"
        )


def _check_shard_format(layout: OutputLayout, format: str) -> None:
    """Committed shards of another output format are refused, --force-resume or not: the
    final file is merged from shards of the job's format only, so their rows would be lost."""
    held = [f for f in OUTPUT_FORMATS if layout.shard_paths(f)]
    if not held or held == [format]:
        return
    if len(held) > 1:
        raise BatchgenError(
            f"output directory '{layout.dir}' holds both {' and '.join(held)} shards: no run "
            "can merge them; use a new output directory"
        )
    raise BatchgenError(
        f"output directory '{layout.dir}' holds {held[0]} shards: set output.format to "
        f"{held[0]} to resume it, or use a new output directory for {format} output"
    )


def take_directory(
    spec: JobSpec,
    source: InputSource,
    layout: OutputLayout,
    previous: Manifest | None,
    current: dict[str, Any],
    force: bool | None,
    note: Callable[[str], None],
    verify: bool = True,
) -> tuple[bool, Committed]:
    """Make the output directory this job's (the lock held, the model loaded): the job must be
    the one the manifest records (or --force-resume) and its committed rows this input's
    (check_committed); only then is the manifest written and what killed writers and the last
    run's result files left removed -> (resuming, committed). A refusal leaves the directory
    as it was (but for damaged shards moved aside), so the next run is checked against the
    same record. verify: an input without a fingerprint is read again row by row here."""
    check_resumable(layout, previous, current, IDENTITY_PARTS, force)
    committed = scan_committed(layout, note)
    check_committed(spec, source, layout, previous, current, force, committed, verify)
    resuming = claim(layout, spec, current, previous)
    remove_temp_files(layout)
    remove_result_files(layout)
    return resuming, committed


def check_committed(
    spec: JobSpec,
    source: InputSource,
    layout: OutputLayout,
    previous: Manifest | None,
    current: dict[str, Any],
    force: bool | None,
    committed: Committed,
    verify: bool = True,
) -> None:
    """The committed rows must be this input's (reads only): none past the input's last row
    (a shard of another job copied in), at their input positions under --force-resume, and,
    for an input without a fingerprint (verify), each still the row it was."""
    if not committed.indexes:
        return
    if force and previous is not None:
        recorded = previous.identity.get("input")
        check_kept_positions(spec, source, layout, committed, recorded, current["input"])
    if verify and current["input"] is None:
        verify_rows(spec, source, committed)
    last = max(committed.indexes)
    if source.num_rows is not None and last >= source.num_rows:
        raise BatchgenError(
            f"the output directory holds a result for row {last:,} but the input has "
            f"{source.num_rows:,} rows: a shard in {layout.shards} is another job's; remove it, "
            "or use another output directory"
        )


def claim(
    layout: OutputLayout, spec: JobSpec, identity: dict[str, Any], previous: Manifest | None
) -> bool:
    """Record the job in the manifest -> True when the directory already held it."""
    if previous is not None and previous.identity == identity:
        return True
    before = None if previous is None else {"spec": previous.spec, "identity": previous.identity}
    with writing_into(layout):
        write_manifest(layout, spec.to_dict(), identity, before)
    return previous is not None or bool(layout.shard_paths())


def verify_rows(spec: JobSpec, source: InputSource, committed: Committed) -> None:
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


def check_kept_positions(
    spec: JobSpec,
    source: InputSource,
    layout: OutputLayout,
    committed: Committed,
    recorded: dict[str, Any] | None,
    now: dict[str, Any] | None,
) -> None:
    """--force-resume keeps committed rows at their input positions: refused where the input
    no longer holds them there (a file gone or put before the earlier ones, fewer rows than
    are committed, another id at a committed row's position: rows inserted or removed), which
    would leave an input row without its result and give another one two. Rows edited in
    place, or added after the others, keep their positions. recorded, now: the input's
    fingerprint as the earlier run recorded it and as it is."""
    if recorded == now:
        return
    fix = f"use another output directory, or delete '{layout.dir}' to start over"
    where = "--force-resume keeps committed rows at their input positions, but"
    moved = moved_files(recorded, now)
    if moved is not None:
        raise BatchgenError(f"{where} {moved}: {fix}")
    last = max(committed.indexes)
    if source.num_rows is not None and last >= source.num_rows:
        raise BatchgenError(
            f"{where} the input now has {source.num_rows:,} rows and row {last:,} is committed: "
            f"{fix}"
        )
    column = spec.prompt.id_column
    if column is None:
        return
    ids = committed_ids(layout)
    for batch in source.batches([column]):
        for row in batch:
            want = ids.get(row.index)
            got = None if row.values is None else row_id(column, row.index, row.values)
            if want is not None and got is not None and got != want:
                raise BatchgenError(
                    f"{where} input row {row.index:,} now has id {got!r} and its committed "
                    f"result is for id {want!r} (rows were inserted or removed): {fix}"
                )
            if row.index >= last:
                return


def _read_columns(spec: JobSpec) -> list[str] | None:
    return input_format(spec.input.format).read_columns(spec)


def run_pipeline(
    spec: JobSpec,
    source: InputSource,
    engine: Engine,
    layout: OutputLayout,
    done: set[int],
    columns: Columns,
    stop: threading.Event,
    hooks: Hooks,
    on_row: Any,
    before_commit: Callable[[], None],
    share: RowShare = ALONE,
    run_name: str | None = None,
) -> tuple[Stats, Producer, Path | None]:
    """Generate this process's share of the rows not in `done` into committed shards
    -> (counts, the producer, the step records' file when the job profiles).
    before_commit: raises when no shard may be written (the directory's lock is lost).
    run_name: the name the ranks of a data-parallel run share in their files' names."""
    builder, id_column = _prompt_stage(spec, engine)
    tokenizers = TokenizerPool(
        builder,
        engine.tokenizer,
        id_column,
        threads=spec.pipeline.tokenizer_threads,
        processes=spec.pipeline.tokenizer_processes,
        warn=_to_stderr,
    )
    halt = threading.Event()  # stops the producer however the engine loop ends
    rows = share.rows(source.num_rows, done)
    producer = Producer(
        source.rank_batches(_read_columns(spec), id_column, rows),
        tokenizers,
        done,
        id_column,
        spec.pipeline.prefetch_batches * source.batch_rows,
        halt,
        hash_rows=INPUT_HASH in columns,
        share=rows,
    )
    out = spec.output
    writer = ShardWriter(
        layout,
        out.format,
        columns,
        out.shard_rows,
        out.shard_seconds,
        before_commit=before_commit,
        rank=None if share.world_size == 1 else share.rank,
        run=run_name,
    )
    consumer = Consumer(
        writer,
        tokenizers.decode,
        TokenBytes(engine.tokenizer).text,
        out.include_token_ids,
        on_row,
        hooks.on_rows,
    )
    producer.start()
    consumer.start()
    recorder = None
    if spec.pipeline.profile:
        recorder = _start_profile(engine, layout, writer.token, producer, consumer)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(spec.pipeline.switch_interval_ms / 1e3)
    try:
        _drive_engine(engine, spec, producer, consumer, stop, hooks.admit)
    finally:
        sys.setswitchinterval(switch)
        halt.set()
        profile = _stop_profile(recorder)
        consumer.queue.put(None)
        wait_for(consumer)
        tokenizers.close()
    if producer.error is not None:
        raise producer.error
    if consumer.error is not None:
        raise write_failed(consumer.error, layout)
    return consumer.stats, producer, profile


def _start_profile(
    engine: Engine, layout: OutputLayout, run: str, producer: Producer, consumer: Consumer
) -> Any:
    """A step recorder on the engine for this run (imported only when a job profiles): in
    the engine's own process when it has one (that process writes the records)."""
    if isinstance(engine, EngineProcess):
        return RemoteRecorder(engine, layout.profile_steps(run), run).attach()
    from batchgen.profile.recorder import Gauges, StepRecorder

    gauges = Gauges(producer.ready_rows, consumer.lag)
    return StepRecorder(engine, layout.profile_steps(run), run, gauges).attach()


def _stop_profile(recorder: Any) -> Path | None:
    """Write the run's records -> their file; a failed write is a warning (the rows are
    what the job is for)."""
    if recorder is None:
        return None
    try:
        return recorder.close()
    except Exception as exc:
        _to_stderr(f"the profile records could not be written ({type(exc).__name__}: {exc})")
        return None


def _prompt_stage(spec: JobSpec, engine: Engine) -> tuple[Any, str | None]:
    """-> (the row -> prompt builder, the id column)."""
    fmt = input_format(spec.input.format)
    return fmt.builder(spec, engine.tokenizer, engine.max_model_len - 1), fmt.id_column(spec)


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
    in_flight: dict[str, RowPrompt] = {}  # request id -> its row, until its last sample

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
                consumer.hand(row, None)
                continue
            request_id = str(row.index)
            in_flight[request_id] = row
            # a seed derived from runtime.seed follows the row's id (in a split, the split's
            # name and the id), not its position in the run
            key = row.id if spec.seed_scope is None else f"{spec.seed_scope}/{row.id}"
            yield Prompt(row.prompt_ids, request_id, row.overrides or None, seed_key=key)

    for out in engine.generate(
        prompts(), spec.sampling, decode=False, stop=_either(stop, consumer), check_outputs=False
    ):
        row = in_flight.pop(out.request_id) if out.last else in_flight[out.request_id]
        consumer.hand(row, out)
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


def _progress(bar: tqdm, started: float, cache: Callable[[], CacheStats]) -> Any:
    last = [0.0]

    def on_row(stats: Stats) -> None:
        bar.update(1)
        now = time.perf_counter()
        if now - last[0] > 0.5:
            last[0] = now
            show_rates(bar, now - started, stats.prompt_tokens, stats.generated_tokens,
                       stats.rows_error, cache().hit_rate)  # fmt: skip

    return on_row


def show_rates(
    bar: tqdm, elapsed: float, prompt_tokens: int, generated_tokens: int, errors: int, hit: float
) -> None:
    """The progress bar's postfix: token rates, prefix cache hits, error rows."""
    elapsed = max(elapsed, 1e-9)
    bar.set_postfix(
        prompt_tok_s=f"{prompt_tokens / elapsed:,.0f}",
        gen_tok_s=f"{generated_tokens / elapsed:,.0f}",
        cache_hit=f"{hit:.0%}",
        errors=errors,
        refresh=False,
    )


def write_results(spec: JobSpec, layout: OutputLayout, tokenizer: Any) -> FinalFiles:
    """The final file(s) in input order (the format decides which)."""
    try:
        return input_format(spec.input.format).write_results(spec, layout, tokenizer)
    except OSError as exc:
        raise write_failed(exc, layout) from exc


def _to_stderr(message: str) -> None:
    tqdm.write(f"batchgen: {message}", file=sys.stderr)
