"""Host<->device movement for the overlapped loop: pinned double buffers and CUDA events.

Step N writes its metadata into host buffer N % 2 and copies it on the copy stream into device
buffer N % 2; the compute stream waits on that copy's event. A host buffer is rewritten only
after its previous copy completed, a device buffer only after the step that read it finished.
Sampled tokens go device->host into pinned memory on the output stream, with an event the host
waits on when it post-processes the step. On the CPU all of this degenerates to plain tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class StepOutput(NamedTuple):
    tokens_device: torch.Tensor  # [S] int64
    tokens_host: torch.Tensor  # [S] int64, pinned on CUDA; valid once ready_event completed
    ready_event: torch.cuda.Event | None


class Transfer:
    def __init__(self, input_size: int, max_samples: int, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        pin = self.cuda
        self.host_in = [torch.zeros(input_size, dtype=torch.int64, pin_memory=pin) for _ in (0, 1)]
        self.host_out = [
            torch.zeros(max_samples, dtype=torch.int64, pin_memory=pin) for _ in (0, 1)
        ]
        if self.cuda:
            self.dev_in = [
                torch.zeros(input_size, dtype=torch.int64, device=device) for _ in (0, 1)
            ]
            self.copy_stream = torch.cuda.Stream(device)
            self.out_stream = torch.cuda.Stream(device)
            self.copied = [torch.cuda.Event() for _ in (0, 1)]
            self.consumed = [torch.cuda.Event() for _ in (0, 1)]
            self.ready = [torch.cuda.Event() for _ in (0, 1)]
            for e in (*self.copied, *self.consumed):
                e.record()
        else:
            self.dev_in = self.host_in
        self.step = 0

    def host_buffer(self) -> torch.Tensor:
        """The host buffer for the next step, once its previous copy has completed."""
        k = self.step % 2
        if self.cuda:
            self.copied[k].synchronize()
        return self.host_in[k]

    def to_device(self, size: int) -> torch.Tensor:
        """Copy this step's first `size` host values; -> device view for the compute stream."""
        k = self.step % 2
        if not self.cuda:
            return self.host_in[k][:size]
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.consumed[k])
            self.dev_in[k][:size].copy_(self.host_in[k][:size], non_blocking=True)
            self.copied[k].record()
        torch.cuda.current_stream(self.device).wait_event(self.copied[k])
        return self.dev_in[k][:size]

    def finish(self, tokens: torch.Tensor) -> StepOutput:
        """After the step's kernels were queued: start the token copy back; advance the step."""
        k = self.step % 2
        self.step += 1
        host = self.host_out[k][: tokens.shape[0]]
        if not self.cuda:
            host.copy_(tokens)
            return StepOutput(tokens, host, None)
        compute = torch.cuda.current_stream(self.device)
        self.consumed[k].record(compute)
        with torch.cuda.stream(self.out_stream):
            self.out_stream.wait_stream(compute)
            host.copy_(tokens, non_blocking=True)
            self.ready[k].record()
        tokens.record_stream(self.out_stream)
        return StepOutput(tokens, host, self.ready[k])


def wait_tokens(out: StepOutput) -> list[int]:
    """Host values of a step's sampled tokens (blocks until the copy is done)."""
    if out.ready_event is not None:
        out.ready_event.synchronize()
    return out.tokens_host.tolist()
