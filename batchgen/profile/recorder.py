"""The step recorder: the engine's StepProfiler and the runner's StepHook in one object.

Per step it appends a few numbers to preallocated columns (store.py) and, on CUDA, records two
events it reads a few steps later (device_clock.py): no host synchronization, no I/O on the
engine thread. Every FLUSH_EVERY_S the columns are copied and written by a background thread,
so a killed run keeps the records up to the last flush; close() writes them all, with each
gap's cause.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from batchgen.engine import Engine
from batchgen.engine.scheduler import Batch, ScheduledChunk, Scheduler
from batchgen.profile.device_clock import CudaClock
from batchgen.profile.records import BLOCKED_BY, RunInfo
from batchgen.profile.store import (
    COLUMNS,
    new_arrays,
    snapshot,
    to_table,
    with_causes,
    write_table,
)

FLUSH_EVERY_S = 15.0
READS_PER_STEP = 2  # CUDA steps whose times are read per step (catches up after a stall)
_NAN = math.nan


class Gauges(NamedTuple):
    """The job's queues, read at each step (cheap: counters)."""

    tokenizer_depth: Callable[[], int]  # prepared rows waiting for the engine
    writer_lag: Callable[[], int]  # rows handed to the writer, not yet committed


def _no_gauge() -> int:
    return -1


class StepRecorder:
    """Records every step `engine` launches from attach() to close() into `path`."""

    def __init__(self, engine: Engine, path: Path, run: str, gauges: Gauges | None = None) -> None:
        self.engine = engine
        self.path = Path(path)
        self.scheduler: Scheduler = engine.scheduler
        self.arrays = new_arrays()
        self._append = tuple(self.arrays[name].append for name in COLUMNS)
        a = self.arrays
        self._begin, self._end, self._graphed = a["host_begin_ms"], a["host_end_ms"], a["graphed"]
        self._post, self._ready, self._done = (
            a["host_post_ms"],
            a["host_ready_ms"],
            a["host_done_ms"],
        )
        self._depth, self._lag = gauges or (_no_gauge, _no_gauge)
        self._launched: deque[int] = deque()  # launched steps not yet post-processed
        self._posting = -1  # the step being post-processed
        self._idle = [0, 0, 0]  # since the last launch: no-demand loops, blocked loops, code
        self._preemptions = self.scheduler.num_preemptions
        self._evictions = engine.blocks.cache.num_evictions
        self._scheduled_at = 0.0
        self._flusher = _Flusher(self.path, self.arrays, lambda: self.info)
        self._previous_hook: Any = None
        self.clock = CudaClock(engine.device) if engine.device.type == "cuda" else None
        self.t0 = time.perf_counter()  # the run's start: host times count from here
        self._next_flush = self.t0 + FLUSH_EVERY_S
        self.info = RunInfo(
            run,
            str(engine.device),
            engine.config.overlap,
            engine.config.max_num_seqs,
            engine.num_blocks,
            time.strftime("%Y-%m-%dT%H:%M:%S%z"),  # with its UTC offset
        )

    def attach(self) -> StepRecorder:
        runner = self.engine.runner
        self._previous_hook = runner.step_hook
        runner.step_hook = self
        self.engine.profiler = self
        return self

    def close(self) -> Path:
        """Stop recording; write every record with its gap's cause -> the file."""
        stop = self._ms(time.perf_counter())
        self.engine.profiler = None
        if self.engine.runner is not None:
            self.engine.runner.step_hook = self._previous_hook
        gpu_stop = None
        if self.clock is not None:
            gpu_stop = self.clock.finish(self.arrays["gpu_start_ms"], self.arrays["gpu_end_ms"])
        self._flusher.stop()
        self.info = self.info._replace(stop_host_ms=stop, stop_gpu_ms=gpu_stop)
        write_table(self.path, with_causes(to_table(self.arrays, self.info), self.info))
        return self.path

    def _ms(self, t: float) -> float:
        return (t - self.t0) * 1e3

    # -- the engine's StepProfiler ------------------------------------------------------------

    def schedule_begin(self) -> None:
        self._scheduled_at = time.perf_counter()

    def scheduled(self, batch: Batch) -> None:
        now = time.perf_counter()
        if self.clock is not None:
            self.clock.read(self.arrays["gpu_start_ms"], self.arrays["gpu_end_ms"], READS_PER_STEP)
        s = self.scheduler
        decodes = _leading_decodes(batch)
        preemptions, evictions = s.num_preemptions, s.blocks.cache.num_evictions
        idle = self._idle
        values = (
            *(self._ms(self._scheduled_at), self._ms(now)),
            *(_NAN,) * 7,  # filled by the hook, the post-processing and the clock
            batch.num_tokens - decodes,
            decodes,
            len(s.running),
            len(s.waiting),
            s.blocks.num_free_blocks,
            preemptions - self._preemptions,
            evictions - self._evictions,
            self._depth(),
            self._lag(),
            idle[0],
            idle[1],
            _recomputed(batch.chunks, decodes),
            0,
            idle[2],
            BLOCKED_BY.index(blocked_by(s)) if s.waiting else 0,
        )
        for append, value in zip(self._append, values, strict=True):
            append(value)
        self._preemptions, self._evictions = preemptions, evictions
        self._idle = [0, 0, 0]
        if now >= self._next_flush:
            self._next_flush = now + FLUSH_EVERY_S
            self._flusher.request()

    def empty(self) -> None:
        s = self.scheduler
        if not s.waiting:
            self._idle[0] += 1
        else:
            self._idle[1] += 1
            self._idle[2] = BLOCKED_BY.index(blocked_by(s))

    def post_begin(self) -> None:
        self._posting = step = self._launched.popleft() if self._launched else -1
        if step >= 0:
            self._post[step] = self._ms(time.perf_counter())

    def post_ready(self) -> None:
        if self._posting >= 0:
            self._ready[self._posting] = self._ms(time.perf_counter())

    def post_end(self) -> None:
        if self._posting >= 0:
            self._done[self._posting] = self._ms(time.perf_counter())
        self._posting = -1

    def drop_in_flight(self) -> None:
        self._launched.clear()

    # -- the runner's StepHook ----------------------------------------------------------------

    def begin(self) -> Any:
        self._begin[-1] = self._ms(time.perf_counter())
        return self.clock.begin() if self.clock is not None else None

    def end(self, mark: Any, graphed: bool, token_graph: bool = False) -> None:
        step = len(self._end) - 1
        self._end[step] = self._ms(time.perf_counter())
        self._graphed[step] = graphed or token_graph
        self._launched.append(step)
        if self.clock is not None:
            self.clock.end(step, mark)


def _leading_decodes(batch: Batch) -> int:
    """One-token chunks: the scheduler puts them first, so a bisection counts them."""
    chunks = batch.chunks
    low, high = 0, len(chunks)
    while low < high:
        mid = (low + high) // 2
        if chunks[mid].num_tokens == 1:
            low = mid + 1
        else:
            high = mid
    return low


def _recomputed(chunks: list[ScheduledChunk], decodes: int) -> int:
    """Tokens of the prefill chunks (those after the leading decodes) that recompute KV a
    preemption dropped: below their request's num_lost_tokens."""
    total = 0
    for chunk in chunks[decodes:]:
        lost = chunk.request.num_lost_tokens
        if lost > chunk.start:
            total += min(lost, chunk.start + chunk.num_tokens) - chunk.start
    return total


def blocked_by(s: Scheduler) -> str:
    """Why the first waiting request is not admitted (the scheduler's _admit, in its order)."""
    if len(s.running) >= s.max_num_seqs:
        return "seqs"
    head = s.waiting[0]
    if head.num_pending:
        return "pending"
    if not s.chunked and head.num_tokens - head.num_computed_tokens > s.max_num_batched_tokens:
        return "budget"
    return "blocks"


class _Flusher(threading.Thread):
    """Copies and writes the records off the engine thread when asked (request() only sets an
    event: the engine thread copies nothing); a request during a write is served after it."""

    def __init__(self, path: Path, arrays: dict, info: Callable[[], RunInfo]) -> None:
        super().__init__(name="batchgen-profile", daemon=True)
        self.path, self.arrays, self.info = path, arrays, info
        self.wanted = threading.Event()
        self.stopping = False
        self.error: BaseException | None = None
        self.start()

    def request(self) -> None:
        self.wanted.set()

    def run(self) -> None:
        while True:
            self.wanted.wait()
            self.wanted.clear()
            if self.stopping:
                return
            try:
                write_table(self.path, to_table(snapshot(self.arrays), self.info()))
            except Exception as exc:  # the final write reports it; the job goes on
                self.error = exc

    def stop(self) -> None:
        self.stopping = True
        self.wanted.set()
        self.join()
