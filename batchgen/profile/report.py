"""`batchgen report OUT_DIR`: a run's idle time per cause, its largest gaps, the timeline
picture and the Chrome trace."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from batchgen.errors import BatchgenError
from batchgen.io.atomic import write_atomic
from batchgen.io.layout import OutputLayout, run_of
from batchgen.profile.attribution import Attribution, Gap, attribute
from batchgen.profile.records import (
    ADMISSION_BLOCKED,
    CACHE_PRESSURE,
    NO_DEMAND,
    PREFILL_INTERFERENCE,
    RunInfo,
    StepRecord,
)
from batchgen.profile.store import read_records
from batchgen.profile.timeline import draw_timeline
from batchgen.profile.trace import chrome_trace, write_trace

CPU_BUSY = (
    "On the CPU the device work runs on the host: busy is each step's host time from the "
    "runner's step hook begin to end (block-table update, forward pass, sampling)."
)


GPU_BUSY = (
    "Busy is each step's time between its CUDA events on the compute stream (block-table "
    "update, forward pass, sampling); host and GPU clocks are aligned once, at the start."
)


class Report(NamedTuple):
    text: str  # the table, the largest gaps and where the files are
    info: RunInfo
    result: Attribution
    timeline: Path
    trace: Path


def find_run(out_dir: Path, run: str | None) -> Path:
    """The records file of `run` (default: the newest run's; of a data-parallel run, its
    lowest rank's) in an output directory."""
    layout = OutputLayout(out_dir)
    if not layout.dir.is_dir():
        what = "is not a folder" if layout.dir.exists() else "does not exist"
        raise BatchgenError(f"output directory '{out_dir}' {what}: give a job's output directory")
    runs = layout.profile_runs()
    if not runs:
        raise BatchgenError(f"no profile records in {out_dir}: run the job with --profile")
    if run is not None and run not in runs:
        raise BatchgenError(
            f"no profile records of run {run!r} in {out_dir}: runs are {', '.join(runs)}"
        )
    if run is None:
        newest = run_of(runs[-1])[0]
        run = next(token for token in runs if run_of(token)[0] == newest)
    return layout.profile_steps(run)


def write_report(out_dir: Path, out: Path | None = None, run: str | None = None, top: int = 10):
    """Read a run's records, attribute its idle time, write the PNG and the trace (next to
    the records, or into `out`) -> the Report."""
    path = find_run(Path(out_dir), run)
    info, records = read_records(path)
    result = attribute(records, info)
    folder = path.parent if out is None else Path(out)
    timeline = OutputLayout.profile_timeline(folder, info.run)
    trace = OutputLayout.profile_trace(folder, info.run)
    picture = draw_timeline(records, result, info)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(timeline, lambda f: f.write(picture))
        write_trace(trace, chrome_trace(records, result, info))
    except OSError as exc:
        raise BatchgenError(
            f"cannot write the report into '{folder}' ({exc.strerror or type(exc).__name__}): "
            "give a writable folder with --out"
        ) from exc
    lines = [*render(records, result, info, top), f"timeline: {timeline}"]
    lines.append(f"trace: {trace} (open it in Perfetto or chrome://tracing)")
    lines.extend(_others(OutputLayout(Path(out_dir)).profile_runs(), info.run))
    return Report("\n".join(lines), info, result, timeline, trace)


def _others(runs: list[str], shown: str) -> list[str]:
    """Where the directory holds other records than the ones shown: the other ranks of a
    data-parallel run (one file each), and other runs."""
    name, rank = run_of(shown)
    ranks = [t for t in runs if t != shown and run_of(t)[0] == name]
    others = len({run_of(t)[0] for t in runs} - {name})
    lines = []
    if ranks:
        listed = ", ".join(f"{t} (rank {run_of(t)[1]})" for t in ranks[:4])
        more = f" and {len(ranks) - 4} more" if len(ranks) > 4 else ""
        lines.append(
            f"this is rank {rank} of a data-parallel run; its other ranks' records: {listed}"
            f"{more}: choose one with --run"
        )
    if others:
        lines.append(f"{others} other run(s) recorded here: choose one with --run")
    return lines


def render(
    records: Sequence[StepRecord], result: Attribution, info: RunInfo, top: int
) -> list[str]:
    wall = max(result.wall_ms, 1e-9)
    ended = "" if info.stop_host_ms is not None else " (killed: records up to the last flush)"
    lines = [
        f"run {info.run} on {info.device}, {result.steps} steps{ended}, wall {wall:.1f} ms",
        f"device busy {result.busy_ms:.1f} ms ({result.busy_ms / wall:.1%}), "
        f"idle {result.idle_ms:.1f} ms ({result.idle_ms / wall:.1%}): each gap has one cause",
        "",
        f"{'cause':<22}{'idle ms':>12}{'% of wall':>12}{'gaps':>8}",
    ]
    for cause, (ms, count) in result.by_cause().items():
        lines.append(f"{cause:<22}{ms:>12.1f}{ms / wall:>12.1%}{count:>8}")
    lines.append(f"{'total idle':<22}{result.idle_ms:>12.1f}{result.idle_ms / wall:>12.1%}")
    lines += ["", *_not_idle(records, result, info, wall), ""]
    lines += _top_gaps(records, result.gaps, top)
    if result.unread:
        lines.append(f"{result.unread} steps have no device times (the run was killed)")
    lines.append(GPU_BUSY if info.on_gpu else CPU_BUSY)
    return lines


def _not_idle(
    records: Sequence[StepRecord], result: Attribution, info: RunInfo, wall: float
) -> list[str]:
    """Device time spent, not idle, on what a cause made the device do: prefill chunks that
    stretched decode steps, and recomputing what preemptions dropped."""
    extra = sum(s.extra_ms for s in result.stretches)
    redo = sum(r.ms for r in result.recomputes)
    mixed = sum(1 for r in records if r.decode_tokens and r.prefill_tokens)
    preemptions = sum(r.preemptions for r in records)
    evictions = sum(r.evictions for r in records)
    tokens = sum(r.recompute_tokens for r in records)
    held = [r for r in records if r.admit_limit == "blocks"]
    lines = [
        "device time spent on a cause (not idle: the device was busy):",
        f"{'cause':<22}{'busy ms':>12}{'% of wall':>12}{'steps':>8}",
        f"{PREFILL_INTERFERENCE:<22}{extra:>12.1f}{extra / wall:>12.1%}"
        f"{len(result.stretches):>8}  of {mixed} mixed steps: above the median decode-only step",
        f"{CACHE_PRESSURE:<22}{redo:>12.1f}{redo / wall:>12.1%}{len(result.recomputes):>8}"
        f"  recomputing {tokens} tokens that {preemptions} preemptions dropped",
        f"prefix-cache evictions: {evictions}",
    ]
    if held:
        batch = sum(r.running for r in held) / len(held)
        lines.append(
            f"{CACHE_PRESSURE}: {len(held)} of {len(records)} steps ran while requests waited "
            f"for free KV blocks (mean batch {batch:.1f} of max_num_seqs {info.max_num_seqs})"
        )
    return lines


def _top_gaps(records: Sequence[StepRecord], gaps: Sequence[Gap], top: int) -> list[str]:
    by_step = {r.step: i for i, r in enumerate(records)}
    largest = sorted(gaps, key=lambda g: g.ms, reverse=True)[:top]
    lines = [f"largest gaps ({len(largest)} of {len(gaps)}):"]
    lines.append(f"{'step':>8}{'gap ms':>10}  {'cause':<20}what the host did")
    for gap in largest:
        step = "tail" if gap.step is None else str(gap.step)
        index = None if gap.step is None else by_step.get(gap.step)
        detail = "after the last step: nothing left to launch"
        if index is not None:
            detail = describe(records, index, gap.cause)
        lines.append(f"{step:>8}{gap.ms:>10.2f}  {gap.cause:<20}{detail}")
    return lines


def describe(records: Sequence[StepRecord], index: int, cause: str) -> str:
    """The host's time between launching step index - 1 and step index, by phase."""
    r = records[index]
    if cause == NO_DEMAND:
        return f"{r.idle_no_demand} loop(s) found nothing to run"
    if cause in (ADMISSION_BLOCKED, CACHE_PRESSURE):
        limit = r.blocked_by or "?"
        return (
            f"{r.idle_blocked} loop(s) could not admit (limit: {limit}, {r.preemptions} preempted)"
        )
    start = records[index - 1].host_end_ms if index else 0.0
    if start is None or r.host_begin_ms is None:
        return ""
    wait = post = 0.0
    for j in (index - 1, index - 2):
        p = records[j] if j >= 0 else None
        if p and p.host_post_ms is not None and start <= p.host_post_ms < r.host_begin_ms:
            wait += (p.host_ready_ms or p.host_post_ms) - p.host_post_ms
            post += (p.host_done_ms or p.host_post_ms) - (p.host_ready_ms or p.host_post_ms)
    schedule = r.host_prepare_ms - r.host_schedule_ms
    prepare = r.host_begin_ms - r.host_prepare_ms
    total = r.host_begin_ms - start
    other = max(0.0, total - wait - post - schedule - prepare)
    return (
        f"host {total:.2f} ms: wait {wait:.2f}, post-process {post:.2f}, "
        f"schedule {schedule:.2f}, prepare {prepare:.2f}, other {other:.2f}"
    )
