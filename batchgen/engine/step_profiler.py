"""What the engine tells a step profiler (batchgen/profile/recorder.py is the one there is).

The engine calls these on its own thread, in this order for each launched step:
schedule_begin, scheduled(batch), then the runner's step hook (begin / end) around the
device work; post_begin / post_ready / post_end around the post-processing of a step's tokens,
which happens in launch order (a loop later when overlapped). empty() marks a loop iteration
that launched nothing; drop_in_flight() a launched step whose tokens will never be
post-processed (the engine aborted it). Each call must cost a few microseconds at most.
"""

from __future__ import annotations

from typing import Protocol

from batchgen.engine.scheduler import Batch


class StepProfiler(Protocol):
    def schedule_begin(self) -> None: ...

    def scheduled(self, batch: Batch) -> None: ...

    def empty(self) -> None: ...

    def post_begin(self) -> None: ...

    def post_ready(self) -> None: ...

    def post_end(self) -> None: ...

    def drop_in_flight(self) -> None: ...
