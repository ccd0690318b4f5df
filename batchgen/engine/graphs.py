"""CUDA graphs for decode steps at bucketed batch sizes.

A decode-only step (every sequence has one query token and samples) of B sequences is padded
to the smallest size >= B; its fixed metadata is copied into the graph's static input buffer
and the graph replays the whole forward pass to logits. Sampling stays outside the graph.

The largest size is captured at start-up, and with it the memory pool all sizes share. The
others are captured at start-up too, or (first_use) just before the first step that needs
them: a job's start-up then skips most of the capture (1.3-1.9 s on an 8b model), which its
tail pays later, one size at a time. Each capture waits for the device to be idle, so a step
in flight is never touched; a capture that fails leaves that size to run eagerly (the same
inputs, padding rows included), with a warning.
"""

from __future__ import annotations

import bisect
import contextlib
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from batchgen.engine.scheduler import Batch
from batchgen.engine.step_inputs import HostStep, prepare_step
from batchgen.engine.step_layout import Layout

Forward = Callable[[torch.Tensor, HostStep], torch.Tensor]  # (flat step buffer, host) -> logits


class CaptureReport(NamedTuple):
    sizes: tuple[int, ...]
    seconds: float
    pool_bytes: int  # device memory the graphs hold (allocated while capturing)


class DecodeGraphs:
    """forward: the runner's forward pass (capturable for decode-only layouts); pad_slot: the
    relay slot padding rows use; sizes: batch sizes to capture, those above limit dropped;
    first_use: capture all but the largest before their first step, not now."""

    def __init__(
        self,
        forward: Forward,
        device: torch.device,
        pad_slot: int,
        sizes: tuple[int, ...],
        limit: int,
        first_use: bool = False,
    ) -> None:
        self.sizes = sorted({s for s in sizes if s <= limit})
        self.forward, self.device, self.pad_slot = forward, device, pad_slot
        biggest = self.sizes[-1] if self.sizes else 0
        self.static = torch.zeros(
            Layout(biggest, biggest, biggest).fixed_size, dtype=torch.int64, device=device
        )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.eager: set[int] = set()  # sizes whose capture failed: their steps run eagerly
        self.pool = torch.cuda.graph_pool_handle()
        self.report = self._capture_all(self.sizes[-1:] if first_use else self.sizes)

    def close(self) -> None:
        """Release the graphs and their memory pool now (not at the next garbage collection)."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.static = None
        self.forward = None

    def padded_size(self, batch: Batch) -> int:
        """The graph size this step replays at, or 0 to run it eagerly."""
        b = len(batch.chunks)
        if b == 0 or batch.num_tokens != b or batch.num_samples != b:
            return 0
        i = bisect.bisect_left(self.sizes, b)
        return self.sizes[i] if i < len(self.sizes) else 0

    def replay(self, flat: torch.Tensor, host: HostStep) -> torch.Tensor:
        """The step's logits, by its graph (captured now if this is its size's first step)."""
        layout = host.layout
        if layout.B not in self.graphs and not self._capture_now(layout.B):
            return self.forward(flat, host)
        graph, logits = self.graphs[layout.B]
        self.static[: layout.fixed_size].copy_(flat[: layout.fixed_size])
        graph.replay()
        return logits

    @torch.inference_mode()
    def _capture_all(self, sizes: list[int]) -> CaptureReport:
        device = self.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        started = time.perf_counter()
        for size in reversed(sizes):  # largest first: smaller graphs reuse its pool
            self.graphs[size] = self._capture(size)
        torch.cuda.synchronize(device)
        return CaptureReport(
            tuple(sizes),
            time.perf_counter() - started,
            torch.cuda.memory_allocated(device) - before,
        )

    def _capture_now(self, size: int) -> bool:
        """Capture `size` between steps (first_use); False: it failed, and runs eagerly."""
        if size in self.eager:
            return False
        try:
            with torch.inference_mode():
                self.graphs[size] = self._capture(size)
            return True
        except Exception as exc:  # the device stays usable; this size's steps run eagerly
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.device)
            self.eager.add(size)
            text = str(exc).strip().splitlines()
            reason = f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__
            warnings.warn(
                f"batchgen: the CUDA graph for {size} sequences could not be captured, those "
                f"decode steps run eagerly ({reason})",
                stacklevel=3,
            )
            return False

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture a step of `size` padding rows (valid inputs that touch only scratch). Only
        this thread's CUDA calls are checked while it captures: the engine's other threads
        (a grammar's mask fill waits on a copy event) go on."""
        host, staged = prepare_step(Batch([], 0), size, self.pad_slot)
        self.static[: host.layout.fixed_size].copy_(staged[: host.layout.fixed_size])
        flat = self.static
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # warm up (kernel compiles, cuBLAS's workspace for this stream, lazy initialisation
        # stay out of the graph): the first size twice, the others once (the first warmed
        # what all sizes share; -14 forwards of start-up)
        with torch.cuda.stream(stream):
            for _ in range(1 if self.graphs else 2):
                self.forward(flat, host)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self.forward(flat, host)
        return graph, logits
