"""Host<->device movement for the overlapped loop: pinned double buffers and CUDA events.

Step N's metadata is staged in host buffer N % 2 and copied on the copy stream into device
buffer N % 2; the compute stream waits on that copy's event. A host buffer is rewritten only
after its previous copy completed, a device buffer only after the step that read it finished.
Sampled tokens (and logprobs, when asked for) go device->host into pinned memory on the output
stream, with an event the host waits on when it post-processes the step. On the CPU all of
this degenerates to plain tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from batchgen.engine.sampling_params import MAX_LOGPROBS

LOGPROB_WIDTH = 1 + 2 * MAX_LOGPROBS  # chosen + the alternatives' logprobs and ids


class StepOutput(NamedTuple):
    tokens_device: torch.Tensor  # [S] int64
    tokens_host: torch.Tensor  # [S] int64, pinned on CUDA; valid once ready_event completed
    ready_event: torch.cuda.Event | None
    logprobs_host: torch.Tensor | None = None  # [S, 1 + 2k] float32 (see sampler)


class Transfer:
    def __init__(self, input_size: int, max_samples: int, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.host_in: list[torch.Tensor] = []
        self.dev_in: list[torch.Tensor] = []
        self._allocate_inputs(input_size)
        pin = self.cuda
        self.host_out = [
            torch.zeros(max_samples, dtype=torch.int64, pin_memory=pin) for _ in (0, 1)
        ]
        self.host_logprobs = [
            torch.zeros(max_samples, LOGPROB_WIDTH, pin_memory=pin) for _ in (0, 1)
        ]
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.out_stream = torch.cuda.Stream(device)
            self.copied = [torch.cuda.Event() for _ in (0, 1)]
            self.consumed = [torch.cuda.Event() for _ in (0, 1)]
            self.ready = [torch.cuda.Event() for _ in (0, 1)]
            for e in (*self.copied, *self.consumed):
                e.record()
        self.step = 0

    def _allocate_inputs(self, size: int) -> None:
        self.host_in = [torch.zeros(size, dtype=torch.int64, pin_memory=self.cuda) for _ in (0, 1)]
        # numpy views for staging: one single-threaded memcpy, where torch's copy_ of a large
        # step (8192 prompt tokens: ~45k values) wakes its intra-op thread pool
        self.host_in_np = [t.numpy() for t in self.host_in]
        self.dev_in = (
            [torch.zeros(size, dtype=torch.int64, device=self.device) for _ in (0, 1)]
            if self.cuda
            else self.host_in
        )

    def to_device(self, flat: torch.Tensor) -> torch.Tensor:
        """Stage a step's flat metadata and send it; -> device view for the compute stream."""
        size = flat.shape[0]
        if size > self.host_in[0].shape[0]:  # rare: grow both buffer pairs
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self._allocate_inputs(2 * size)
        k = self.step % 2
        if self.cuda:
            self.copied[k].synchronize()  # the host buffer's previous copy is done
        self.host_in_np[k][:size] = flat.numpy()
        if not self.cuda:
            return self.host_in[k][:size]
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.consumed[k])
            self.dev_in[k][:size].copy_(self.host_in[k][:size], non_blocking=True)
            self.copied[k].record()
        torch.cuda.current_stream(self.device).wait_event(self.copied[k])
        return self.dev_in[k][:size]

    def finish(self, tokens: torch.Tensor, logprobs: torch.Tensor | None) -> StepOutput:
        """After the step's kernels were queued: start the copies back; advance the step."""
        k = self.step % 2
        self.step += 1
        n = tokens.shape[0]
        host = self.host_out[k][:n]
        host_lp = None if logprobs is None else self.host_logprobs[k][:n, : logprobs.shape[1]]
        if not self.cuda:
            host.copy_(tokens)
            if host_lp is not None:
                host_lp.copy_(logprobs)
            return StepOutput(tokens, host, None, host_lp)
        compute = torch.cuda.current_stream(self.device)
        self.consumed[k].record(compute)
        with torch.cuda.stream(self.out_stream):
            self.out_stream.wait_stream(compute)
            host.copy_(tokens, non_blocking=True)
            if host_lp is not None:
                host_lp.copy_(logprobs, non_blocking=True)
            self.ready[k].record()
        tokens.record_stream(self.out_stream)
        if logprobs is not None:
            logprobs.record_stream(self.out_stream)
        return StepOutput(tokens, host, self.ready[k], host_lp)


def wait_tokens(out: StepOutput) -> list[int]:
    """Host values of a step's sampled tokens (blocks until the copy is done)."""
    if out.ready_event is not None:
        out.ready_event.synchronize()
    return out.tokens_host.tolist()
