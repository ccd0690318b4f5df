"""The run as a Chrome trace (JSON trace events; opens in Perfetto and chrome://tracing).

Track "device": one complete event (ph "X") per step and one per idle gap, named by its cause.
Track "engine thread (host)": each step's schedule, prepare, launch, token wait and
post-processing. Counters (ph "C"): batch size and waiting requests, tokenizer queue and writer
lag. Times are microseconds since the run's start (host and device clocks anchored together).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from batchgen.io.atomic import write_atomic
from batchgen.profile.attribution import Attribution, busy
from batchgen.profile.records import CACHE_PRESSURE, PREFILL_INTERFERENCE, RunInfo, StepRecord

DEVICE, HOST = 1, 2
HOST_PHASES = (  # name, from, to
    ("schedule", "host_schedule_ms", "host_prepare_ms"),
    ("prepare", "host_prepare_ms", "host_begin_ms"),
    ("launch", "host_begin_ms", "host_end_ms"),
    ("wait for tokens", "host_post_ms", "host_ready_ms"),
    ("post-process", "host_ready_ms", "host_done_ms"),
)


def chrome_trace(
    records: Sequence[StepRecord], result: Attribution, info: RunInfo
) -> dict[str, Any]:
    return {
        "traceEvents": [*_names(info), *_device(records, result, info), *_host(records)],
        "displayTimeUnit": "ms",
        "otherData": {"run": info.run, "device": info.device, "started": info.started},
    }


def write_trace(path: Path, trace: dict[str, Any]) -> None:
    text = json.dumps(trace, separators=(",", ":"), allow_nan=False)
    write_atomic(path, lambda f: f.write(text.encode("ascii")))


def _names(info: RunInfo) -> list[dict[str, Any]]:
    def meta(name: str, tid: int | None, value: str) -> dict[str, Any]:
        event = {"name": name, "ph": "M", "pid": 1, "args": {"name": value}}
        return event if tid is None else {**event, "tid": tid}

    return [
        meta("process_name", None, f"batchgen run {info.run} ({info.device})"),
        meta("thread_name", DEVICE, "device: steps and idle gaps"),
        meta("thread_name", HOST, "engine thread (host)"),
    ]


def _complete(name: str, cat: str, tid: int, start: float, end: float, **args: Any) -> dict:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": 1,
        "tid": tid,
        "ts": round(start * 1e3, 3),
        "dur": round(max(0.0, end - start) * 1e3, 3),
        "args": args,
    }


def _device(
    records: Sequence[StepRecord], result: Attribution, info: RunInfo
) -> Iterator[dict[str, Any]]:
    stretched = {s.step: round(s.extra_ms, 3) for s in result.stretches}
    redone = {r.step: round(r.ms, 3) for r in result.recomputes}
    for r in records:
        span = busy(r, info.on_gpu)
        if span is None:
            continue
        args = {
            "prefill_tokens": r.prefill_tokens,
            "decode_tokens": r.decode_tokens,
            "graphed": r.graphed,
            "preemptions": r.preemptions,
        }
        if r.step in stretched:
            args[f"{PREFILL_INTERFERENCE} ms"] = stretched[r.step]
        if r.step in redone:
            args[f"{CACHE_PRESSURE} (recompute) ms"] = redone[r.step]
            args["recompute_tokens"] = r.recompute_tokens
        yield _complete(f"step {r.step}", "step", DEVICE, *span, **args)
        yield _counter("batch", span[0], running=r.running, waiting=r.waiting)
        if r.tokenizer_depth is not None and r.writer_lag is not None:
            yield _counter("queues", span[0], tokenizer=r.tokenizer_depth, writer_lag=r.writer_lag)
    for gap in result.gaps:
        if gap.ms > 0:
            where = "after the last step" if gap.step is None else f"before step {gap.step}"
            yield _complete(
                f"idle: {gap.cause}", "gap", DEVICE, gap.start_ms, gap.end_ms, gap=where
            )


def _host(records: Sequence[StepRecord]) -> Iterator[dict[str, Any]]:
    for r in records:
        for name, start, end in HOST_PHASES:
            a, b = getattr(r, start), getattr(r, end)
            if a is not None and b is not None and b > a:
                yield _complete(name, "host", HOST, a, b, step=r.step)


def _counter(name: str, at: float, **values: int) -> dict[str, Any]:
    return {"name": name, "ph": "C", "pid": 1, "ts": round(at * 1e3, 3), "args": values}
