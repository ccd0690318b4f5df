"""A loaded model's weights onto the GPU through pinned buffers, on several threads.

`Module.to("cuda")` copies each tensor from pageable memory: the driver stages it through a
small pinned buffer of its own, one copy at a time (an 8b model, 14.5 GB: 2.3 s on an H200
host). Here threads copy chunks into pinned buffers of their own (the CPU copy releases the
GIL) and each queues the chunk's device copy on its own stream while it fills its next
buffer: 0.73 s for the same model. The bytes are copied as they are (same dtype, no cast).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

CHUNK_BYTES = 64 << 20  # one pinned buffer; each thread has two
THREADS = 4  # 4 and 8 copied equally fast on an H200 host (16 cores)


def upload_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model.to(device)` for a model on the CPU. Parameters keep their identity (tied
    weights stay one tensor); on a device other than CUDA this is `model.to(device)`."""
    if device.type != "cuda":
        return model.to(device)
    tensors = [t for t in unique_tensors(model) if t.device.type == "cpu" and t.is_contiguous()]
    copies = [torch.empty_like(t, device=device, memory_format=torch.contiguous_format)
              for t in tensors]  # fmt: skip
    jobs = list(_chunks(tensors))
    lock = threading.Lock()
    pending = iter(jobs)

    def take() -> tuple[int, int, int] | None:
        with lock:
            return next(pending, None)

    def work() -> None:
        stream = torch.cuda.Stream(device)
        buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in "ab"]
        done: list[torch.cuda.Event | None] = [None, None]
        turn = 0
        while (job := take()) is not None:
            index, start, size = job
            if done[turn] is not None:
                done[turn].synchronize()  # this buffer's last device copy has read it
            staged = buffers[turn][:size]
            staged.copy_(_bytes(tensors[index])[start : start + size])
            with torch.cuda.stream(stream):
                _bytes(copies[index])[start : start + size].copy_(staged, non_blocking=True)
                done[turn] = torch.cuda.Event()
                done[turn].record(stream)
            turn ^= 1
        stream.synchronize()

    threads = min(THREADS, max(1, len(jobs)))
    with ThreadPoolExecutor(threads, "batchgen-upload") as pool:
        for future in [pool.submit(work) for _ in range(threads)]:
            future.result()  # a thread's error is raised here
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # the pinned buffers go back now, not at exit
    swap = {id(t): c for t, c in zip(tensors, copies, strict=True)}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and id(param) in swap:
                param.data = swap[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None and id(buffer) in swap:
                module._buffers[name] = swap[id(buffer)]
    return model.to(device)  # what is left (a strided view, another device's): torch's way


def unique_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers, each once (a tied weight is one tensor)."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None:
                seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def _chunks(tensors: list[torch.Tensor]) -> Iterator[tuple[int, int, int]]:
    """(tensor index, byte offset, bytes) of every chunk, largest tensors first."""
    order = sorted(range(len(tensors)), key=lambda i: -_nbytes(tensors[i]))
    for index in order:
        total = _nbytes(tensors[index])
        for start in range(0, total, CHUNK_BYTES):
            yield index, start, min(CHUNK_BYTES, total - start)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)
