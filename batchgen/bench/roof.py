"""What a roofline divides by: the device's copy bandwidth and bf16 matmul rate.

The bench measures both on the GPU it runs on (`measure_roof`), so "of roofline" means the
same thing on an H100 as on an H200; `H200_REFERENCE` keeps the figures the first H200 runs
gave, for comparing with tables recorded before the bench measured its device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

COPY_BYTES = 1 << 30  # each side of the timed device-to-device copy
MATMUL_SIDE = 8192  # the timed bf16 matmul is square, this many rows and columns
WARMUP_S = 0.3  # run each kernel this long before timing it (clocks up, caches warm)
TIMED_RUNS = 20  # the best of these is the rate


@dataclass(frozen=True)
class DeviceRoof:
    """copy_bandwidth: bytes/s of a device copy, read + write; matmul_peak: bf16 FLOP/s."""

    copy_bandwidth: float
    matmul_peak: float
    source: str

    def describe(self) -> str:
        return (
            f"{self.source}: device copy {self.copy_bandwidth / 1e12:.2f} TB/s, "
            f"bf16 matmul {self.matmul_peak / 1e12:.0f} TFLOP/s"
        )


H200_REFERENCE = DeviceRoof(4.25e12, 790e12, "H200 reference")


def measure_roof(device: str = "cuda") -> DeviceRoof:
    """Time an 8,192-square bf16 matmul and a 1 GiB device copy on the device (best of
    TIMED_RUNS after WARMUP_S of each); about a second on a Hopper GPU."""
    import torch

    # the matmul first: cuBLAS's workspace, kept for the process, then lands outside the
    # copy's 1 GiB blocks, which empty_cache gives back (the engine sizes its KV cache from
    # the memory left free)
    mm_s = _matmul_seconds(device)
    copy_s = _copy_seconds(device)
    torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device)
    return DeviceRoof(2 * COPY_BYTES / copy_s, 2 * MATMUL_SIDE**3 / mm_s, f"{name}, measured")


def _copy_seconds(device: str) -> float:
    import torch

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _best_seconds(lambda: dst.copy_(src))


def _matmul_seconds(device: str) -> float:
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (
        torch.randn(MATMUL_SIDE, MATMUL_SIDE, generator=gen, device=device, dtype=torch.bfloat16)
        for _ in range(2)
    )
    out = torch.empty_like(a)
    return _best_seconds(lambda: torch.mm(a, b, out=out))


def _best_seconds(kernel: Callable[[], object]) -> float:
    """Seconds of the fastest of TIMED_RUNS launches, each timed by CUDA events, after
    launching the kernel for about WARMUP_S."""
    one_s = max(_timed_seconds(kernel), 1e-6)
    for _ in range(min(int(WARMUP_S / one_s), 10_000)):
        kernel()
    return min(_timed_seconds(kernel) for _ in range(TIMED_RUNS))


def _timed_seconds(kernel: Callable[[], object]) -> float:
    """One launch of the kernel, timed on the device by CUDA events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    kernel()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3
