"""Dynamic per-token FP8 quantization: one program per row, amax -> scale -> cast, fused."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.engine.kernels.launch import launch, next_power_of_2

MAX_BLOCK_K = 4096  # columns per loop iteration; wider rows loop


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [M, K] 16/32-bit
    q_ptr,  # [M, K] fp8
    scale_ptr,  # [M] float32
    K,
    stride_x,
    stride_q,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
    tl.store(scale_ptr + row, scale)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] with unit column stride -> (fp8 e4m3 [M, K], float32 scale [M]).
    No host synchronization (CUDA-graph capturable)."""
    from batchgen.engine.quant.fp8 import FP8_DTYPE

    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows needs a [M, K] row-major tensor, got {tuple(x.shape)}")
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    launch_quantize_rows(x, q, scale)
    return q, scale


def launch_quantize_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Fill q [M, K] (fp8; a float32 q keeps the scaled, clamped values before the cast) and
    scale [M] from x [M, K]."""
    from batchgen.engine.quant.fp8 import FP8_MAX, MIN_SCALE

    m, k = x.shape
    if m == 0:
        return
    launch(
        _quantize_rows_kernel,
        (m,),
        x,
        q,
        scale,
        k,
        x.stride(0),
        q.stride(0),
        FP8_MAX=FP8_MAX,
        MIN_SCALE=MIN_SCALE,
        BLOCK_K=min(next_power_of_2(k), MAX_BLOCK_K),
        num_warps=4,
    )
