"""A job run by several ranks (torchrun, or `batchgen run --gpus N`): each rank runs one
engine on its share of the rows (row_share.py) and commits its own shards into the one output
directory; the committed set is the union of every rank's shards, read back from them.

The ranks start together (rank_start.py), generate with a heartbeat (heartbeat.py) and end
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
from typing import Any, NamedTuple

from tqdm import tqdm

from batchgen.distributed import Failure, Group
from batchgen.errors import BatchgenError, JobStopped
from batchgen.formats.base import FinalFiles
from batchgen.heartbeat import Heartbeat, Progress, RankEnd, Stop, total
from batchgen.io import OutputLayout
from batchgen.io.checkpoint import RankLock, scan_committed
from batchgen.io.object_lock import OutputLock, output_lock
from batchgen.io.output_schema import RowCounts
from batchgen.job import (
    NO_HOOKS,
    JobResult,
    job_columns,
    run_pipeline,
    show_rates,
    write_results,
    write_summary,
)
from batchgen.pipeline import Stats
from batchgen.rank_start import Plan, Started, start_rank
from batchgen.spec import JobSpec
from batchgen.summary import JobSummary


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
    process_s: float | None = None,
) -> JobResult:
    """Run (or resume) this rank's share of a job; every rank returns the job's summary.
    process_s: the "process" start-up phase (from the command line)."""
    stop = stop or threading.Event()
    note = note or _to_stderr
    layout = OutputLayout(spec.output.dir)
    lock = output_lock(layout) if group.rank == 0 else None
    if group.rank != 0:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one progress bar: rank 0's
    try:
        return _run(spec, group, layout, lock, stop, note, force_resume, process_s)
    finally:
        if lock is not None:
            lock.release()


def _run(
    spec: JobSpec,
    group: Group,
    layout: OutputLayout,
    lock: OutputLock | None,
    stop: threading.Event,
    note: Callable[[str], None],
    force: bool,
    process_s: float | None,
) -> JobResult:
    ready = start_rank(spec, group, layout, lock, note, force, process_s)
    engine, latest = ready.engine, [Stats()]
    before = engine.cache_stats

    def progress() -> Progress:
        s, c = latest[0], engine.cache_stats - before
        return Progress(s.rows_ok, s.rows_error, s.prompt_tokens, s.generated_tokens, *c)

    beat = Heartbeat(group, stop, spec.pipeline.heartbeat_timeout_s, progress)
    return _generate(ready, group, layout, lock, beat, stop, latest)


def _generate(
    ready: Started,
    group: Group,
    layout: OutputLayout,
    lock: OutputLock | None,
    beat: Heartbeat,
    stop: threading.Event,
    latest: list[Stats],
) -> JobResult:
    spec, source, plan, startup = ready.spec, ready.source, ready.plan, ready.startup_s
    started = time.perf_counter()
    todo = None if source.num_rows is None else max(0, source.num_rows - len(plan.done))
    quiet = spec.pipeline.quiet or group.rank != 0
    bar = tqdm(total=todo, unit="row", disable=quiet, dynamic_ncols=True)
    if not quiet:
        beat.on_beat = _progress(bar, started)
    beat.start()
    failure, error, read_all, rows_read, profile = None, None, False, 0, None
    try:
        check = lock.check if lock is not None else RankLock(layout, plan.run).check
        stats, producer, profile = run_pipeline(
            spec,
            source,
            ready.engine,
            layout,
            plan.done,
            job_columns(spec, source),
            stop,
            NO_HOOKS,
            lambda s: latest.__setitem__(0, s),  # the writer's counts, for the heartbeat
            check,
            group.place.share,
            plan.name,
        )
        latest[0] = stats
        read_all, rows_read = producer.finished, producer.rows_read
    except Exception as exc:  # every rank learns of it and stops; raised below
        failure, error = Failure.of(exc), exc
    if latest[0].first_row_at is not None:
        startup["first_row"] = round(latest[0].first_row_at - started, 3)
    beat.finish(RankEnd(group.rank, read_all, failure, beat.progress(), startup))
    try:
        if group.rank == 0:
            tokenizer = ready.engine.tokenizer
            outcome = _end_on_rank0(
                spec, layout, plan, beat, started, rows_read, bar, error, tokenizer
            )
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
    summary = (
        outcome.summary
        if outcome is not None  # else this rank's own counts: no rank has the job's
        else _own_summary(plan, beat, started)
    )
    if why is not None and why.failure is not None:
        if why.failure.user:
            raise BatchgenError(f"rank {why.rank}: {why.failure.message}")
        raise JobStopped(
            f"rank {why.rank} stopped with an internal error ({why.failure.message[:200]}); "
            "its log holds the traceback"
        )
    profile_file = None if profile is None else str(profile)
    if why is not None and why.rank != group.rank:
        return JobResult(summary, interrupted=False, stopped_by=why.why, profile_file=profile_file)
    interrupted = stop.is_set() and not summary.complete
    return JobResult(summary, interrupted, profile_file=profile_file)


def _own_summary(plan: Plan, beat: Heartbeat, started: float) -> JobSummary:
    """This rank's own counts as a summary (where no rank has the job's)."""
    counts = _known_counts(plan, beat)
    return _summary(beat.progress(), started, len(plan.done), counts, plan.resuming, beat.world)


def _end_on_rank0(
    spec: JobSpec,
    layout: OutputLayout,
    plan: Plan,
    beat: Heartbeat,
    started: float,
    rows_read: int,
    bar: tqdm,
    error: BaseException | None,
    tokenizer: Any,
) -> Outcome:
    """Wait for every rank's end, then write the final file and summary.json; publish them
    (an outcome is published even when this fails, so that no rank waits for it)."""
    ends = beat.wait_ends()
    try:
        after = scan_committed(layout, _to_stderr)
        ended = all(k in ends and ends[k].read_all for k in range(beat.world))
        complete = ended and error is None and after.indexes >= set(range(rows_read))
        final = complete and spec.output.final_file
        files = write_results(spec, layout, tokenizer) if final else None
    except Exception as exc:
        failed = Stop(0, "rank 0 failed", Failure.of(exc))
        mine = _own_summary(plan, beat, started)
        beat.publish_outcome(Outcome(mine, failed))
        raise
    done = total([ends[k].progress if k in ends else beat.last[k] for k in range(beat.world)])
    beat.on_beat = None  # the bar's last update is this thread's
    _show(bar, started, done)
    phases: dict[str, float] = {}
    for end in ends.values():  # the job waited for the slowest rank in each phase
        for phase, seconds in end.startup_s.items():
            phases[phase] = max(phases.get(phase, 0.0), seconds)
    summary = _summary(
        done, started, len(after.indexes), after.counts, plan.resuming, beat.world, complete,
        files, phases,
    )  # fmt: skip
    write_summary(layout, summary)
    outcome = Outcome(summary, beat.stopped_by)
    beat.publish_outcome(outcome)
    return outcome


def _known_counts(plan: Plan, beat: Heartbeat) -> RowCounts:
    """The job's counts where no rank scanned its shards at the end: those committed before
    this run, and this run's rows."""
    job = dataclasses.replace(plan.counts)
    job.merge(_run_counts(beat.progress()))
    return job


def _run_counts(done: Progress) -> RowCounts:
    return RowCounts(done.rows_ok, done.rows_error, done.prompt_tokens, done.generated_tokens)


def _summary(
    done: Progress,
    started: float,
    committed: int,
    job: RowCounts,
    resumed: bool,
    world_size: int,
    complete: bool = False,
    files: FinalFiles | None = None,
    startup_s: dict[str, float] | None = None,
) -> JobSummary:
    hit = (
        done.cached_prompt_tokens / done.admitted_prompt_tokens
        if done.admitted_prompt_tokens
        else 0
    )
    return JobSummary(
        **JobSummary.counts(job, _run_counts(done)),
        prompt_tokens_cached=done.cached_prompt_tokens,
        prefix_cache_hit_rate=round(hit, 4),
        wall_s=time.perf_counter() - started,
        rows_committed_total=committed,
        resumed=resumed,
        complete=complete,
        result_file=None if files is None else files.result_file,
        error_file=None if files is None else files.error_file,
        startup_s=startup_s or {},
        world_size=world_size,
    )


def _progress(bar: tqdm, started: float) -> Callable[[list[Progress]], None]:
    """Rank 0's bar: every rank's rows and tokens (each beat)."""

    def on_beat(progress: list[Progress]) -> None:
        _show(bar, started, total(progress))

    return on_beat


def _show(bar: tqdm, started: float, done: Progress) -> None:
    """The bar at the job's totals so far: its rows, rates and error rows."""
    hit = done.cached_prompt_tokens / max(done.admitted_prompt_tokens, 1)
    elapsed = time.perf_counter() - started
    show_rates(bar, elapsed, done.prompt_tokens, done.generated_tokens, done.rows_error, hit)
    bar.update(done.rows - bar.n)


def _to_stderr(message: str) -> None:
    tqdm.write(f"batchgen: {message}", file=sys.stderr)
