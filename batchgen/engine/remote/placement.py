"""Where a job's engine process runs: the cores it has to itself, and whether a GPU is there
to run it on (asked before torch is imported)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

MIN_CORES_TO_KEEP = 8  # a job's process with fewer cores keeps none for its engine by default
KEPT_CORES = 2  # ... else this many: the engine thread and the server's other threads


def kept_cores(setting: int | None, allowed: set[int]) -> frozenset[int]:
    """The cores an engine process runs on alone, the job's own threads on the others:
    `setting` of them (None: KEPT_CORES where the process may use MIN_CORES_TO_KEEP or more,
    else none), the last of `allowed`, and never all of them.

    Measured through `batchgen run` on a 16-core H200 host (1b shape, generated tok/s): 8,192
    rows x 16 new tokens 11,332 with the engine process on two cores and the job's process on
    the other 14, against 10,318 with the engine in the job's process and 9,957-10,359 with
    both processes free to use every core; 2,048 x 256: 66,744, 61,688 and 57,969-59,617. The
    job's tokenizer threads, the Rust pool under them and Arrow's pool, left free, take cores
    the engine thread is waiting for."""
    count = (KEPT_CORES if len(allowed) >= MIN_CORES_TO_KEEP else 0) if setting is None else setting
    if count <= 0 or count >= len(allowed):
        return frozenset()
    return frozenset(sorted(allowed)[-count:])


def keep_process_off(cores: frozenset[int]) -> None:
    """Every thread of this process (and every one it starts later) off `cores` (Linux: per
    thread, from /proc/self/task). For a process batchgen owns: the command line's."""
    if cores:
        _all_threads_on(os.sched_getaffinity(0) - cores)


def pin_process(cores: frozenset[int]) -> None:
    """Every thread of this process (and every one it starts later) on `cores` only. The
    engine server does this once its engine is loaded: its start-up (imports, the weights'
    copy on several threads, graph capture) runs on every core it may use."""
    if cores:
        _all_threads_on(set(cores))


def _all_threads_on(cores: set[int]) -> None:
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cores)


@contextlib.contextmanager
def off_cores(cores: frozenset[int]) -> Iterator[None]:
    """Inside, the calling thread (and every thread it starts) runs off `cores`; its own
    affinity comes back after. Threads already running elsewhere are left alone."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, before - cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def gpu_visible() -> bool:
    """Whether this machine shows this process an NVIDIA GPU, without importing torch (a guess
    made before torch is imported; torch has the last word)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidia0") or os.path.isdir("/proc/driver/nvidia/gpus")
