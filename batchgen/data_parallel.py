"""A job run by several ranks (torchrun, or `batchgen run --gpus N`): each rank runs one
engine on its share of the rows (row_share.py) and commits its own shards into the one output
directory; the committed set is the union of every rank's shards, read back from them.

Start-up, in steps every rank passes together (Group.agree: when one rank fails, every rank
raises the same one-line error):
1. every rank: the checks that need no model (input, columns, model folder, its device);
   rank 0 also takes the directory's lock and compares the settings and input with the
   manifest (nothing is written yet);
2. every rank loads its engine; every rank's identity (settings, input, model) goes to rank 0;
3. rank 0: every rank must run the job rank 0 runs (the same input and model on every node)
   and the one the manifest records; it writes the manifest, removes what killed writers left,
   reads the committed set, and sends it, with the lock's run, to every rank.
Then every rank generates its share with a heartbeat (heartbeat.py), and the ranks end
together: rank 0 alone re-reads the committed set, writes the final file and summary.json
(totals over the ranks). Rank 0 alone holds the lock, from before the manifest is read until
every rank has ended; the others check before each commit that the lock is still its run's.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from tqdm import tqdm

from batchgen import distributed
from batchgen.distributed import Failure, Group
from batchgen.engine import Engine
from batchgen.engine.model_loader import resolve_model_path
from batchgen.errors import BatchgenError, JobStopped
from batchgen.heartbeat import Heartbeat, Progress, RankEnd, Stop, total
from batchgen.io import InputSource, OutputLayout
from batchgen.io.atomic import write_json_atomic
from batchgen.io.checkpoint import (
    IDENTITY_PARTS,
    DirectoryLock,
    Manifest,
    RankLock,
    identity_changes,
    remove_temp_files,
    scan_committed,
)
from batchgen.job import (
    NO_HOOKS,
    JobResult,
    check_job,
    check_resumable,
    claim,
    job_columns,
    previous_run,
    result_settings,
    run_pipeline,
    verify_rows,
    write_results,
)
from batchgen.pipeline import Stats
from batchgen.spec import JobSpec
from batchgen.summary import JobSummary


class Plan(NamedTuple):
    """What rank 0 sends every rank before the rows are shared out."""

    done: set[int]  # input rows in committed shards
    resuming: bool
    run: str  # the run named in the lock file (RankLock)


class Outcome(NamedTuple):
    """What rank 0 sends every rank at the end."""

    summary: JobSummary
    stop: Stop | None  # why the job stopped early, when a rank stopped it


def run_ranks(
    spec: JobSpec,
    group: Group,
    *,
    force_resume: bool = False,
    stop: threading.Event | None = None,
    note: Callable[[str], None] | None = None,
) -> JobResult:
    """Run (or resume) this rank's share of a job; every rank returns the job's summary."""
    stop = stop or threading.Event()
    note = note or _to_stderr
    layout = OutputLayout(Path(spec.output.dir))
    lock = DirectoryLock(layout) if group.rank == 0 else None
    if group.rank != 0:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one progress bar: rank 0's
    try:
        return _run(spec, group, layout, lock, stop, note, force_resume)
    finally:
        if lock is not None:
            lock.release()


def _run(
    spec: JobSpec,
    group: Group,
    layout: OutputLayout,
    lock: DirectoryLock | None,
    stop: threading.Event,
    note: Callable[[str], None],
    force: bool,
) -> JobResult:
    started = time.perf_counter()

    def checks() -> tuple[JobSpec, InputSource, Manifest | None]:
        mine = dataclasses.replace(spec, engine=distributed.engine_config(spec.engine, group.place))
        source = check_job(mine)
        resolve_model_path(spec.model.path)
        previous = None
        if lock is not None:
            lock.acquire()
            previous = previous_run(layout, force)
            current = {"settings": result_settings(mine, None), "input": source.fingerprint()}
            check_resumable(layout, previous, current, ("settings", "input"), force)
        return mine, source, previous

    mine, source, previous = group.agree(checks)
    startup = {"checks": round(time.perf_counter() - started, 3)}
    loaded: list[Engine] = []

    def load() -> dict[str, Any]:
        engine = Engine(mine.model.path, mine.engine)
        loaded.append(engine)
        if engine.tokenizer is None:
            raise BatchgenError(
                f"model '{spec.model.path}' has no tokenizer: batchgen jobs need one"
            )
        settings = result_settings(mine, engine)
        return {"settings": settings, "input": source.fingerprint(), "model": engine.fingerprint}

    identities = group.gather(load)
    engine = loaded[0]
    startup |= engine.startup_s
    latest = [Stats()]
    before = engine.cache_stats

    def progress() -> Progress:
        s, c = latest[0], engine.cache_stats - before
        return Progress(s.rows_ok, s.rows_error, s.prompt_tokens, s.generated_tokens, *c)

    beat = Heartbeat(group, stop, spec.pipeline.heartbeat_timeout_s, progress)

    def prepare() -> Plan:
        assert lock is not None
        for k, other in enumerate(identities[1:], start=1):
            changes = identity_changes(other, identities[0], IDENTITY_PARTS)
            if changes:
                raise BatchgenError(
                    f"rank {k} does not run rank 0's job ({changes[0]} on rank 0): give every "
                    "rank the same input, model and settings"
                )
        current = identities[0]
        check_resumable(layout, previous, current, IDENTITY_PARTS, force)
        resuming = claim(layout, spec, current, previous)
        remove_temp_files(layout)  # no rank writes before this step is passed
        committed = scan_committed(layout, note)
        if resuming and current["input"] is None and committed.indexes:
            verify_rows(mine, source, committed)
        return Plan(committed.indexes, resuming, lock.run)

    beat.publish_first_beat()  # every rank's beat exists once the step below is passed
    plan = group.agree_on_root(prepare)
    return _generate(mine, group, layout, lock, source, engine, plan, beat, stop, startup, latest)


def _generate(
    spec: JobSpec,
    group: Group,
    layout: OutputLayout,
    lock: DirectoryLock | None,
    source: InputSource,
    engine: Engine,
    plan: Plan,
    beat: Heartbeat,
    stop: threading.Event,
    startup: dict[str, float],
    latest: list[Stats],
) -> JobResult:
    started = time.perf_counter()
    todo = None if source.num_rows is None else max(0, source.num_rows - len(plan.done))
    quiet = spec.pipeline.quiet or group.rank != 0
    bar = tqdm(total=todo, unit="row", disable=quiet, dynamic_ncols=True)
    if not quiet:
        beat.on_beat = _progress(bar, started)
    beat.start()
    failure, error, read_all, rows_read = None, None, False, 0
    try:
        check = lock.check if lock is not None else RankLock(layout, plan.run).check
        on_row = latest.__setitem__  # the writer's counts, read by the heartbeat
        stats, producer = run_pipeline(
            spec,
            source,
            engine,
            layout,
            plan.done,
            job_columns(spec, source),
            stop,
            NO_HOOKS,
            lambda s: on_row(0, s),
            check,
            group.place.share,
        )
        latest[0] = stats
        read_all, rows_read = producer.finished and not stop.is_set(), producer.rows_read
    except Exception as exc:  # every rank learns of it and stops; raised below
        failure, error = _failure(exc), exc
    if latest[0].first_row_at is not None:
        startup["first_row"] = round(latest[0].first_row_at - started, 3)
    beat.finish(RankEnd(group.rank, read_all, failure, beat.progress(), startup))
    try:
        if group.rank == 0:
            outcome = _end_on_rank0(spec, layout, plan, beat, started, rows_read, bar, error)
        else:
            outcome = beat.wait_outcome()
    finally:
        beat.close()
        bar.close()
    if error is not None:
        raise error
    why = beat.stopped_by or (None if outcome is None else outcome.stop)
    if outcome is None:  # rank 0 was lost before it ended the job
        why = why or Stop(0, "rank 0 stopped before the job ended")
    summary = outcome.summary if outcome is not None else _local_summary(beat, plan, started)
    if why is not None and why.failure is not None:
        if why.failure.user:
            raise BatchgenError(f"rank {why.rank}: {why.failure.message}")
        raise JobStopped(
            f"rank {why.rank} stopped with an internal error ({why.failure.message[:200]}); "
            "its log holds the traceback"
        )
    if why is not None and why.rank != group.rank:
        return JobResult(summary, interrupted=False, stopped_by=why.why)
    return JobResult(summary, interrupted=stop.is_set())


def _end_on_rank0(
    spec: JobSpec,
    layout: OutputLayout,
    plan: Plan,
    beat: Heartbeat,
    started: float,
    rows_read: int,
    bar: tqdm,
    error: BaseException | None,
) -> Outcome:
    """Wait for every rank's end, then write the final file and summary.json; publish them
    (an outcome is published even when this fails, so that no rank waits for it)."""
    ends = beat.wait_ends()
    why = beat.stopped_by
    try:
        after = scan_committed(layout, _to_stderr)
        ended = all(k in ends and ends[k].read_all for k in range(beat.world))
        complete = ended and error is None and after.indexes >= set(range(rows_read))
        files = write_results(spec, layout) if complete and spec.output.final_file else None
    except Exception as exc:
        failed = Stop(0, "rank 0 failed", _failure(exc))
        beat.publish_outcome(Outcome(_local_summary(beat, plan, started), failed))
        raise
    done = total([ends[k].progress if k in ends else beat.last[k] for k in range(beat.world)])
    beat.on_beat = None  # the bar's last update is this thread's
    bar.update(done.rows - bar.n)
    phases: dict[str, float] = {}
    for end in ends.values():  # the job waited for the slowest rank in each phase
        for phase, seconds in end.startup_s.items():
            phases[phase] = max(phases.get(phase, 0.0), seconds)
    summary = JobSummary(
        rows_ok=done.rows_ok,
        rows_error=done.rows_error,
        prompt_tokens=done.prompt_tokens,
        prompt_tokens_cached=done.cached_prompt_tokens,
        prefix_cache_hit_rate=round(done.cached_prompt_tokens / done.admitted_prompt_tokens, 4)
        if done.admitted_prompt_tokens
        else 0.0,
        generated_tokens=done.generated_tokens,
        wall_s=time.perf_counter() - started,
        rows_committed_total=len(after.indexes),
        resumed=plan.resuming,
        complete=complete,
        result_file=None if files is None else files.result_file,
        error_file=None if files is None else files.error_file,
        startup_s=phases,
        world_size=beat.world,
    )
    write_json_atomic(layout.summary, summary.to_dict())
    outcome = Outcome(summary, why)
    beat.publish_outcome(outcome)
    return outcome


def _local_summary(beat: Heartbeat, plan: Plan, started: float) -> JobSummary:
    """This rank's own counts, when no summary of the job's can be had."""
    p = beat.progress()
    return JobSummary(
        rows_ok=p.rows_ok,
        rows_error=p.rows_error,
        prompt_tokens=p.prompt_tokens,
        prompt_tokens_cached=p.cached_prompt_tokens,
        prefix_cache_hit_rate=0.0,
        generated_tokens=p.generated_tokens,
        wall_s=time.perf_counter() - started,
        rows_committed_total=len(plan.done),
        resumed=plan.resuming,
        complete=False,
        world_size=beat.world,
    )


def _failure(exc: BaseException) -> Failure:
    if isinstance(exc, BatchgenError):
        return Failure(True, " ".join(str(exc).split()))
    lines = str(exc).strip().splitlines()
    return Failure(False, f"{type(exc).__name__}: {lines[0] if lines else ''}")


def _progress(bar: tqdm, started: float) -> Callable[[list[Progress]], None]:
    """Rank 0's bar: every rank's rows and tokens (each beat)."""

    def on_beat(progress: list[Progress]) -> None:
        done = total(progress)
        elapsed = max(time.perf_counter() - started, 1e-9)
        hit = done.cached_prompt_tokens / max(done.admitted_prompt_tokens, 1)
        bar.set_postfix(
            prompt_tok_s=f"{done.prompt_tokens / elapsed:,.0f}",
            gen_tok_s=f"{done.generated_tokens / elapsed:,.0f}",
            cache_hit=f"{hit:.0%}",
            errors=done.rows_error,
            refresh=False,
        )
        bar.update(done.rows - bar.n)

    return on_beat


def _to_stderr(message: str) -> None:
    tqdm.write(f"batchgen: {message}", file=sys.stderr)
