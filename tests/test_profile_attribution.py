"""The cause of each idle gap, from synthetic step records (no engine, no device)."""

from __future__ import annotations

import pytest

from batchgen.profile.attribution import (
    SYNC_MIN_MS,
    Recompute,
    Stretch,
    attribute,
    busy,
    gap_cause,
    interference,
)
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


def rec(step: int, begin: float, end: float, **fields: object) -> StepRecord:
    """A step whose host scheduling starts 1 ms before its device work (CPU busy = begin..end)."""
    base = dict(host_schedule_ms=begin - 1.0, host_prepare_ms=begin - 0.5)
    return StepRecord(host_begin_ms=begin, host_end_ms=end, step=step, **(base | fields))


def info(device: str = "cpu", stop: float | None = None) -> RunInfo:
    on_gpu = device != "cpu"
    return RunInfo(
        "run", device, True, 8, 64, "2026-01-01T00:00:00",
        stop_host_ms=None if on_gpu else stop, stop_gpu_ms=stop if on_gpu else None,
    )  # fmt: skip


PREV = rec(0, 1.0, 2.0)


def test_no_demand_when_an_iteration_had_nothing_to_run() -> None:
    assert gap_cause(PREV, rec(1, 9.0, 10.0, idle_no_demand=3), on_gpu=False) == NO_DEMAND
    # it wins over everything else seen in the same gap
    both = rec(1, 9.0, 10.0, idle_no_demand=1, idle_blocked=2, preemptions=1)
    assert gap_cause(PREV, both, on_gpu=True) == NO_DEMAND


@pytest.mark.parametrize("limit", ["seqs", "blocks", "budget"])
def test_admission_blocked_when_requests_waited_and_nothing_launched(limit: str) -> None:
    record = rec(1, 9.0, 10.0, idle_blocked=1, blocked_by=limit)
    assert gap_cause(PREV, record, on_gpu=False) == ADMISSION_BLOCKED


def test_cache_pressure_when_a_preemption_left_nothing_to_launch() -> None:
    preempted = rec(1, 9.0, 10.0, idle_blocked=1, blocked_by="blocks", preemptions=2)
    assert gap_cause(PREV, preempted, on_gpu=False) == CACHE_PRESSURE
    pending = rec(1, 9.0, 10.0, idle_blocked=1, blocked_by="pending")
    assert gap_cause(PREV, pending, on_gpu=True) == CACHE_PRESSURE
    # a preemption in a step that launched at once leaves no gap of its own
    assert gap_cause(PREV, rec(1, 2.5, 3.0, preemptions=1), on_gpu=False) == HOST_STARVATION


def test_synchronization_when_the_host_waited_for_the_previous_step() -> None:
    # synchronous loop: step 0's tokens were waited for (0.8 ms) before step 1 was launched
    waited = rec(0, 1.0, 1.2, host_post_ms=1.3, host_ready_ms=2.1, host_done_ms=2.3)
    after = rec(1, 3.0, 4.0)
    assert gap_cause(waited, after, on_gpu=True) == SYNCHRONIZATION
    # on the CPU the device is the host: there is no wait on it
    assert gap_cause(waited, after, on_gpu=False) == HOST_STARVATION
    # a wait that did not block (the tokens were there) is no synchronization
    quick = waited._replace(host_ready_ms=1.3 + SYNC_MIN_MS / 2)
    assert gap_cause(quick, after, on_gpu=True) == HOST_STARVATION
    # overlapped: step 0 is post-processed after step 1 was launched
    overlapped = waited._replace(host_post_ms=4.5, host_ready_ms=5.5, host_done_ms=5.6)
    assert gap_cause(overlapped, after, on_gpu=True) == HOST_STARVATION
    # admission rules come first: a blocked loop also waits for the step in flight
    blocked = after._replace(idle_blocked=1, blocked_by="seqs")
    assert gap_cause(waited, blocked, on_gpu=True) == ADMISSION_BLOCKED


def test_host_starvation_otherwise_and_for_the_first_step() -> None:
    assert gap_cause(PREV, rec(1, 3.0, 4.0), on_gpu=True) == HOST_STARVATION
    assert gap_cause(None, rec(0, 1.0, 2.0), on_gpu=True) == HOST_STARVATION


def test_attribute_covers_the_wall_with_busy_time_and_caused_gaps() -> None:
    records = [
        rec(0, 1.0, 2.0),  # gap 1.0 from the start: host starvation
        rec(1, 2.5, 4.0),  # gap 0.5
        rec(2, 10.0, 11.0, idle_no_demand=2),  # gap 6.0
        rec(3, 12.0, 13.0, idle_blocked=1, blocked_by="seqs"),  # gap 1.0
    ]
    result = attribute(records, info(stop=15.0))  # tail 2.0: no demand
    assert [(g.step, g.cause) for g in result.gaps] == [
        (0, HOST_STARVATION),
        (1, HOST_STARVATION),
        (2, NO_DEMAND),
        (3, ADMISSION_BLOCKED),
        (None, NO_DEMAND),
    ]
    assert [g.ms for g in result.gaps] == [1.0, 0.5, 6.0, 1.0, 2.0]
    assert result.wall_ms == 15.0 and result.busy_ms == 4.5 and result.idle_ms == 10.5
    totals = result.by_cause()
    assert list(totals) == list(CAUSES)
    assert totals[NO_DEMAND] == (8.0, 2) and totals[HOST_STARVATION] == (1.5, 2)
    assert totals[SYNCHRONIZATION] == (0.0, 0)
    assert sum(ms for ms, _ in totals.values()) == result.wall_ms - result.busy_ms


def test_gpu_runs_use_event_times_and_skip_unread_steps() -> None:
    records = [
        rec(0, 1.0, 1.1, gpu_start_ms=1.5, gpu_end_ms=3.0),
        rec(1, 1.2, 1.3, gpu_start_ms=3.0, gpu_end_ms=4.0),  # queued ahead: no gap
        rec(2, 1.4, 1.5),  # the run was killed before its events were read
    ]
    result = attribute(records, info("cuda:0"))
    assert busy(records[0], on_gpu=True) == (1.5, 3.0)
    assert [g.ms for g in result.gaps] == [1.5, 0.0]
    assert result.steps == 2 and result.unread == 1 and result.wall_ms == 4.0


def test_prefill_interference_is_busy_time_above_decode_only_steps() -> None:
    decodes = [rec(i, 10.0 * i, 10.0 * i + ms, decode_tokens=4) for i, ms in enumerate((1, 3, 2))]
    mixed = rec(3, 40.0, 45.0, decode_tokens=4, prefill_tokens=100)  # median alone: 2.0
    nearest = rec(4, 50.0, 52.5, decode_tokens=6, prefill_tokens=10)  # no step had 6 alone
    prefill_only = rec(5, 60.0, 70.0, prefill_tokens=500)  # stretches no decode
    faster = rec(6, 80.0, 81.0, decode_tokens=4, prefill_tokens=1)
    records = [*decodes, mixed, nearest, prefill_only, faster]
    assert interference(records, on_gpu=False) == ([Stretch(3, 3.0, 2.0), Stretch(4, 0.5, 2.0)], [])
    assert interference([mixed, prefill_only], on_gpu=False) == ([], [])  # no baseline


def test_recompute_of_preempted_tokens_is_cache_pressure_while_busy() -> None:
    """A step's prefill time (above its decodes' baseline) splits by the recomputed share of
    its prefill tokens: that part is cache pressure, the rest prefill interference."""
    decodes = [rec(i, 10.0 * i, 10.0 * i + 2.0, decode_tokens=4) for i in range(3)]
    mixed = rec(3, 40.0, 46.0, decode_tokens=4, prefill_tokens=100, recompute_tokens=25)
    redo_only = rec(4, 50.0, 58.0, prefill_tokens=40, recompute_tokens=40)  # no decodes
    fresh = rec(5, 60.0, 61.0, prefill_tokens=10)  # nothing recomputed, no decodes: neither
    stretches, recomputes = interference([*decodes, mixed, redo_only, fresh], on_gpu=False)
    assert stretches == [Stretch(3, 3.0, 2.0)]  # 4 ms of prefill, 3/4 of it fresh tokens
    assert recomputes == [Recompute(3, 1.0, 25), Recompute(4, 8.0, 40)]
    result = attribute([*decodes, mixed, redo_only, fresh], info(stop=61.0))
    assert result.recomputes == recomputes and result.stretches == stretches
