"""CUDA events around each step's device work, read lazily: no host synchronization per step.

Events are recorded on the compute stream when the step's work is queued and read only once
the end event has completed (query() asks without waiting), a few at a time on later steps;
finish() waits once, at the end of the run. Times are milliseconds since an anchor event
recorded when the clock starts (the recorder takes its host start at the same instant).
Read events go back to a pool, so a long run creates a handful of events, not two per step.
"""

from __future__ import annotations

from array import array
from collections import deque

import torch


class CudaClock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.current_stream(device)
        torch.cuda.synchronize(device)
        self.anchor = torch.cuda.Event(enable_timing=True)
        self.anchor.record(self.stream)
        self.anchor.synchronize()  # the one wait before the run: the anchor's time is now
        self._pool: list[torch.cuda.Event] = []
        # (step, start, end), in launch order: a step's end completes after every earlier one
        self._pending: deque[tuple[int, torch.cuda.Event, torch.cuda.Event]] = deque()

    def _event(self) -> torch.cuda.Event:
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def begin(self) -> torch.cuda.Event:
        """Before the step's device work is queued."""
        return self._event()

    def end(self, step: int, start: torch.cuda.Event) -> None:
        """After it was queued."""
        self._pending.append((step, start, self._event()))

    def read(self, starts: array, ends: array, limit: int) -> None:
        """Fill starts[step] / ends[step] of up to `limit` completed steps, oldest first."""
        pending = self._pending
        while limit > 0 and pending:
            step, start, end = pending[0]
            if not end.query():
                return  # later steps' events are not done either
            pending.popleft()
            starts[step] = self.anchor.elapsed_time(start)
            ends[step] = self.anchor.elapsed_time(end)
            self._pool += (start, end)
            limit -= 1

    def finish(self, starts: array, ends: array) -> float:
        """Wait for the device, read every step left; -> the stop time (ms since the anchor)."""
        stop = self._event()
        stop.synchronize()
        self.read(starts, ends, len(self._pending))
        return self.anchor.elapsed_time(stop)
