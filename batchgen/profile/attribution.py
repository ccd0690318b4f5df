"""Where the device waited: every idle gap between steps gets one cause, from the records alone.

Busy time is a step's device work: on CUDA from its start event to its end event; on the CPU
(which runs the device work synchronously on the host) from the runner's step hook begin to
end on the host clock: block-table update, forward pass and sampling. Idle time is the rest of
the run: the gap before each step (from the previous step's end, or the run's start) and the
tail after the last step. Busy + idle = wall, and every idle millisecond has one cause.
Pure functions over StepRecords: no engine, no device.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import NamedTuple

from batchgen.profile.records import (
    ADMISSION_BLOCKED,
    CACHE_PRESSURE,
    CAUSES,
    HOST_STARVATION,
    NO_DEMAND,
    SYNCHRONIZATION,
    RunInfo,
    StepRecord,
)

# A wait for a step's tokens shorter than this did not block: the tokens were already there.
SYNC_MIN_MS = 0.05


def gap_cause(previous: StepRecord | None, record: StepRecord, on_gpu: bool) -> str:
    """The cause of the idle gap before `record` (previous: the step before it, None for the
    run's first step). Evidence is what the host saw between launching the two steps; the
    first rule that holds names the cause:

    1. no demand: a loop iteration launched nothing while no request was waiting (the input
       was exhausted, or the tokenizer had no prepared row).
    2. cache pressure: an iteration launched nothing while requests waited, and a request was
       preempted since the previous step, or the first waiting request is a preempted one
       whose last token was still in flight.
    3. admission blocked: an iteration launched nothing while requests waited but could not be
       admitted (the sequence cap, free KV blocks, or the token budget: blocked_by).
    4. synchronization (a device only: on the CPU the device is the host): the host waited
       for the previous step's tokens (a host wait on the device that blocked at least
       SYNC_MIN_MS) before launching this step, so this step's scheduling and input
       preparation could not overlap the previous step's device work: a synchronous loop,
       or any wait on the newest launched work.
    5. host starvation: otherwise. Work was runnable and the host was not waiting on the
       device, but the device finished the previous step before the host had launched this
       one (post-processing, scheduling, input preparation, launch, the job loop, the GIL).
    """
    if record.idle_no_demand:
        return NO_DEMAND
    if record.idle_blocked:
        if record.preemptions or record.blocked_by == "pending":
            return CACHE_PRESSURE
        return ADMISSION_BLOCKED
    if on_gpu and previous is not None and _waited_for(previous, record):
        return SYNCHRONIZATION
    return HOST_STARVATION


def _waited_for(previous: StepRecord, record: StepRecord) -> bool:
    """The host blocked on `previous`'s tokens before it launched `record`."""
    post, ready, begin = previous.host_post_ms, previous.host_ready_ms, record.host_begin_ms
    if post is None or ready is None or begin is None:
        return False
    return post < begin and ready - post >= SYNC_MIN_MS


class Gap(NamedTuple):
    step: int | None  # the step after the gap; None for the tail after the last step
    start_ms: float
    end_ms: float
    cause: str

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms


class Stretch(NamedTuple):
    """A decode step that carried prefill chunks and ran longer than its decodes alone."""

    step: int
    extra_ms: float  # busy time above the baseline
    baseline_ms: float  # median busy time of decode-only steps with as many decodes


class Recompute(NamedTuple):
    """Device time a step spent recomputing KV that preemptions dropped (cache pressure while
    the device was busy): the step's prefill time (busy time above the decode-only baseline of
    its decodes; all of it without decodes) times the recomputed share of its prefill tokens."""

    step: int
    ms: float
    tokens: int


class Attribution(NamedTuple):
    gaps: list[Gap]
    stretches: list[Stretch]  # their extra_ms excludes recompute time (counted in recomputes)
    recomputes: list[Recompute]
    wall_ms: float
    busy_ms: float
    steps: int  # steps with a known busy interval
    unread: int  # steps without one (GPU times never read: the run was killed)

    @property
    def idle_ms(self) -> float:
        return sum(g.ms for g in self.gaps)

    def by_cause(self) -> dict[str, tuple[float, int]]:
        """cause -> (idle ms, gaps), in CAUSES order (every cause present)."""
        out = {c: (0.0, 0) for c in CAUSES}
        for gap in self.gaps:
            ms, count = out[gap.cause]
            out[gap.cause] = (ms + gap.ms, count + 1)
        return out


def busy(record: StepRecord, on_gpu: bool) -> tuple[float, float] | None:
    """The step's busy interval (see the module doc); None when unknown."""
    start, end = (
        (record.gpu_start_ms, record.gpu_end_ms)
        if on_gpu
        else (record.host_begin_ms, record.host_end_ms)
    )
    return None if start is None or end is None else (start, end)


def attribute(records: Sequence[StepRecord], info: RunInfo) -> Attribution:
    """Every gap with its cause, the tail after the last step (no demand: nothing was left to
    launch), and the prefill interference."""
    on_gpu = info.on_gpu
    known = [(r, b) for r in records if (b := busy(r, on_gpu)) is not None]
    gaps: list[Gap] = []
    end = 0.0  # the previous step's busy end (the run's start for the first step)
    previous: StepRecord | None = None
    for record, (start, stop) in known:
        gaps.append(Gap(record.step, end, max(start, end), gap_cause(previous, record, on_gpu)))
        end, previous = max(stop, end), record
    wall = info.stop_gpu_ms if on_gpu else info.stop_host_ms
    if wall is not None and wall > end:
        gaps.append(Gap(None, end, wall, NO_DEMAND))
    wall = end if wall is None else max(wall, end)
    busy_ms = sum(b[1] - b[0] for _, b in known)
    stretches, recomputes = interference([r for r, _ in known], on_gpu)
    return Attribution(
        gaps, stretches, recomputes, wall, busy_ms, len(known), len(records) - len(known)
    )


def interference(
    records: Sequence[StepRecord], on_gpu: bool
) -> tuple[list[Stretch], list[Recompute]]:
    """Steps whose prefill tokens cost device time, split in two: prefill interference (steps
    with decodes and prefill tokens, busy longer than the median decode-only step of the same
    number of decodes, or of the nearest number when no step had exactly as many) and
    recompute (the share of a step's prefill time spent on tokens a preemption dropped)."""
    alone: dict[int, list[float]] = {}
    for r in records:
        b = busy(r, on_gpu)
        if b is not None and r.decode_tokens and not r.prefill_tokens:
            alone.setdefault(r.decode_tokens, []).append(b[1] - b[0])
    medians = {d: statistics.median(v) for d, v in alone.items()}
    stretches, recomputes = [], []
    for r in records:
        b = busy(r, on_gpu)
        if b is None or not r.prefill_tokens:
            continue
        baseline = 0.0
        if r.decode_tokens:
            if not medians:
                continue
            nearest = min(medians, key=lambda d: (abs(d - r.decode_tokens), d))
            baseline = medians[nearest]
        prefill_ms = (b[1] - b[0]) - baseline
        if prefill_ms <= 0:
            continue
        share = min(r.recompute_tokens, r.prefill_tokens) / r.prefill_tokens
        if share:
            recomputes.append(Recompute(r.step, prefill_ms * share, r.recompute_tokens))
        if r.decode_tokens and share < 1:
            stretches.append(Stretch(r.step, prefill_ms * (1 - share), baseline))
    return stretches, recomputes
