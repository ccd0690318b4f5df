"""The per-step profile record, the run it belongs to, and the names of the idle causes.

Every time is in milliseconds since the run's start: host times (host_*) on the host's
perf_counter, GPU times (gpu_*) on the device's clock from CUDA events, anchored at the same
start (one synchronization when the recorder starts; they agree up to the clocks' drift).
A step is one launched batch; "the gap before step k" is the device idle time between step
k-1's end and step k's start (for step 0: between the run's start and its start).
"""

from __future__ import annotations

from typing import NamedTuple

# The causes of an idle gap (batchgen/profile/attribution.py holds the rule of each).
NO_DEMAND = "no demand"
ADMISSION_BLOCKED = "admission blocked"
CACHE_PRESSURE = "cache pressure"
SYNCHRONIZATION = "synchronization"
HOST_STARVATION = "host starvation"
CAUSES = (NO_DEMAND, ADMISSION_BLOCKED, CACHE_PRESSURE, SYNCHRONIZATION, HOST_STARVATION)
# not a gap: decode steps stretched by the prefill chunks they carried (the GPU was busy)
PREFILL_INTERFERENCE = "prefill interference"

# Why requests that waited were not admitted, at a loop iteration that launched nothing.
BLOCKED_BY = ("", "seqs", "blocks", "pending", "budget")  # index = the recorder's code


class StepRecord(NamedTuple):
    """One launched step. Fields after host_end_ms may be unknown (None): post-processing
    happens a loop later when overlapped, GPU times are read a few steps later, and a run
    that was killed never filled the last ones."""

    host_schedule_ms: float  # Engine.step() began scheduling
    host_prepare_ms: float  # scheduled: the runner builds the step's host metadata
    # the device work starts being queued (the runner's step hook); None if the launch failed
    host_begin_ms: float | None
    host_end_ms: float | None  # queued (on the CPU: block tables, forward pass and sampling done)
    host_post_ms: float | None = None  # post-processing of this step's tokens began
    host_ready_ms: float | None = None  # ... its tokens were on the host (the wait ended)
    host_done_ms: float | None = None  # ... post-processing ended
    gpu_start_ms: float | None = None  # CUDA events around the step's device work
    gpu_end_ms: float | None = None
    graphed: bool = False  # replayed a CUDA graph
    prefill_tokens: int = 0  # tokens of chunks longer than one token
    decode_tokens: int = 0  # one-token chunks (the attention kernels' decodes)
    running: int = 0  # requests running after this step was scheduled (the batch size)
    waiting: int = 0  # ... requests waiting
    free_blocks: int = 0  # ... KV blocks an allocation could take (free + evictable cached)
    preemptions: int = 0  # requests preempted since the previous step was scheduled
    evictions: int = 0  # prefix-cache blocks evicted since then
    tokenizer_depth: int | None = None  # prepared rows waiting for the engine (jobs only)
    writer_lag: int | None = None  # rows handed to the writer, not yet committed (jobs only)
    idle_no_demand: int = 0  # loop iterations since the previous launch that launched
    # nothing with no request waiting
    idle_blocked: int = 0  # ... that launched nothing while requests waited
    blocked_by: str = ""  # the last such iteration's limit: seqs, blocks, pending, budget
    recompute_tokens: int = 0  # prefill tokens recomputing KV that a preemption dropped
    admit_limit: str = ""  # why this step admitted no more waiting requests ("": none waited)
    step: int = 0  # the step's number in the run (0, 1, ...)


class RunInfo(NamedTuple):
    """What the records of one run share (kept in the Parquet file's metadata)."""

    run: str  # the run's token (the shard writer's)
    device: str  # "cpu" or "cuda:N"
    overlap: bool
    max_num_seqs: int
    num_blocks: int
    started: str  # local wall-clock time of the start, ISO 8601 with its UTC offset
    stop_host_ms: float | None = None  # when recording stopped (None: the run was killed)
    stop_gpu_ms: float | None = None  # ... on the device clock (CUDA)

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"
