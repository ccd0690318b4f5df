"""FP8 GEMM with row-wise scales for the decode batch sizes: out = (xq @ w^T) * xs[:, None] * ws.

torch._scaled_mm (cuBLAS) runs one 128 x 128 tile shape for every FP8 product; at decode batch
sizes (M <= 256) a projection with N = 4096 then has 64 tiles or fewer for 132 SMs, and half
the GPU waits. This kernel takes smaller tiles there (and can split K), so every SM gets work.
`gemm_config` says when it is used; elsewhere fp8_linear keeps _scaled_mm.

Measured on an H200 (CUDA-graph timed, us, exact accumulation; this choice against
_scaled_mm): 8b down (4096 x 14336) 41.0 -> 19.9 at M = 16, 37.5 -> 21.4 at M = 64, 37.5 -> 26.9
at M = 128; 8b o (4096 x 4096) 12.9 -> 8.0 at M = 64; 1b down (2048 x 8192) 22.2 -> 15.1 at
M = 256. At M = 256 on the 8b shapes the kernel is no faster than cuBLAS (o 13.2 both, down 38.8
against 37.7), so those stay on _scaled_mm.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from batchgen.engine.kernels.launch import cdiv, launch


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # > 1: float32 partial products summed by a second kernel


GROUP_M = 8  # programs of one column of M tiles run together (weight tiles stay in L2)
# Above this many output tiles per SM (and M > 64) cuBLAS's large tiles fill the GPU.
FULL_GPU_TILES_PER_SM = 1.5
# Hopper's FP8 tensor cores add products at reduced precision when one accumulation runs
# over a long K; the kernel moves the sum into float32 registers every this many K elements
# (at most once per K tile). Measured on the H200 against the exact product (bf16 output, K up
# to 14336): relative error 1.7e-3 at 256, 128, 64 or 32, as torch._scaled_mm's (2.4e-3 to
# 3.7e-3 with its fast accumulation); 256 is the fastest of them. With one sum over all of K
# the float32 output drifted from the exact product (the first GPU run of the tests failed).
EXACT_ACCUMULATION_K = 256
# torch._scaled_mm's products summed in the tensor cores over all of K. Measured on an H200
# (bf16 output, against the exact product of the same FP8 values): relative error 2.1e-3 at K =
# 4096 and 3.3e-3 at K = 14336, against 1.7e-3 with float32 sums, while rounding the operands
# to FP8 moves the product by 2.6e-2 (weights alone) to 3.7e-2 (weights and activations, random
# normal values at K = 4096); 12% faster at 8,192 rows (8b projections:
# 1,313-1,334 against 1,154-1,231 TFLOP/s), 3-10% at 256. vLLM's FP8 GEMMs sum the same way.
SCALED_MM_FAST_ACCUMULATION = True
MIN_SPLIT_K = 2048  # split K only into parts at least this long
MAX_SPLIT = 4


def gemm_config(m: int, n: int, k: int, sms: int) -> GemmConfig | None:
    """The tiles for an [m, k] x [k, n] FP8 product on a GPU of `sms` SMs; None: _scaled_mm.

    Tiles of 16 / 32 / 64 rows as M needs (M <= 16 / 32 / more) and 64 columns, so a decode
    batch spreads over the SMs; K is split (up to 4 ways, parts of >= 2048) while the programs
    stay under two per SM. Problems that fill the GPU with large tiles (more than 1.5 tiles of
    64 x 64 per SM, M > 64) go to cuBLAS."""
    if k % 16:
        return None
    if m <= 32:
        config = GemmConfig(16 if m <= 16 else 32, 64, 128, 4, 4)
    else:
        config = GemmConfig(64, 64, 256, 4, 3)
    tiles = cdiv(m, config.block_m) * cdiv(n, config.block_n)
    if m > 64 and tiles > FULL_GPU_TILES_PER_SM * sms:
        return None
    split = 1
    while (
        split < MAX_SPLIT
        and tiles * split * 2 <= 2 * sms
        and k % (split * 2 * config.block_k) == 0
        and k // (split * 2) >= MIN_SPLIT_K
    ):
        split *= 2
    return config._replace(split_k=split)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,  # [M, K] fp8, row-major
    b_ptr,  # [N, K] fp8, row-major (the weight)
    a_scale_ptr,  # [M] float32
    b_scale_ptr,  # [N] float32
    c_ptr,  # [M, N] (split 1) or [SPLIT, M, N] float32 partials
    M,
    N,
    K,
    k_per_split,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GM: tl.constexpr,
    EVEN_K: tl.constexpr,  # every split's range lies inside K: no mask along K
    EXACT_K: tl.constexpr,  # products summed at reduced precision before a float32 add
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    group = GM * tiles_n
    first_m = pid // group * GM
    group_m = tl.minimum(tiles_m - first_m, GM)
    pm = first_m + (pid % group) % group_m
    pn = (pid % group) // group_m
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k0 = split * k_per_split
    a_p = a_ptr + rm[:, None].to(tl.int64) * K + (k0 + rk)[None, :]
    b_p = b_ptr + rn[None, :].to(tl.int64) * K + (k0 + rk)[:, None]
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, k_per_split, BK):
        if EVEN_K:
            a = tl.load(a_p, mask=m_ok[:, None], other=0.0)
            b = tl.load(b_p, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = k0 + k + rk < K
            a = tl.load(a_p, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_p, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=EXACT_K)
        a_p += BK
        b_p += BK
    sa = tl.load(a_scale_ptr + rm, mask=m_ok, other=0.0)
    sb = tl.load(b_scale_ptr + rn, mask=n_ok, other=0.0)
    acc = acc * sa[:, None] * sb[None, :]
    c = c_ptr + split * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, c_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in range(1, SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=ok)


def fp8_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    config: GemmConfig,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """xq: fp8 [M, K], xs: float32 [M], weight: fp8 [N, K], scale: float32 [N] -> [M, N] in
    out_dtype. Both operands row-major; K a multiple of 16. No host synchronization."""
    m, k = xq.shape
    n = weight.shape[0]
    if weight.shape[1] != k or not (xq.is_contiguous() and weight.is_contiguous()) or k % 16:
        raise ValueError(
            f"fp8_gemm needs row-major [M, K] and [N, K] with K % 16 == 0, got "
            f"{tuple(xq.shape)} and {tuple(weight.shape)}"
        )
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    split = config.split_k
    k_per_split = cdiv(cdiv(k, split), config.block_k) * config.block_k
    split = cdiv(k, k_per_split)  # no empty split
    dest = out if split == 1 else torch.empty(split, m, n, device=xq.device)
    grid = (cdiv(m, config.block_m) * cdiv(n, config.block_n), split)
    launch(_fp8_gemm_kernel, grid,
        xq, weight, xs, scale, dest, m, n, k, k_per_split,
        BM=config.block_m, BN=config.block_n, BK=config.block_k, GM=GROUP_M,
        EVEN_K=k_per_split * split == k, EXACT_K=min(EXACT_ACCUMULATION_K, config.block_k),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split > 1:
        block = 1024
        launch(
            _sum_splits_kernel,
            (cdiv(m * n, block),),
            dest,
            out,
            m * n,
            SPLIT=split,
            BLOCK=block,
            num_warps=4,
        )
    return out


def gpu_gemm_config(xq: torch.Tensor, weight: torch.Tensor) -> GemmConfig | None:
    """The Triton kernel's tiles for this product on its GPU, or None for _scaled_mm."""
    if not (xq.is_contiguous() and weight.is_contiguous()):
        return None
    return gemm_config(xq.shape[0], *weight.shape, _sm_count(xq.device))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def fp8_matmul(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    config: GemmConfig | None,
) -> torch.Tensor:
    """fp8 [M, K] x scale [M] times fp8 [N, K] x scale [N] -> [M, N] in dtype, on a GPU: the
    Triton kernel with config's tiles, or torch._scaled_mm when config is None."""
    if config is not None:
        return fp8_gemm(xq, xs, weight, scale, config, out_dtype=dtype)
    return torch._scaled_mm(
        xq,
        weight.t(),  # [K, N], column-major: weight is [N, K] row-major
        scale_a=xs[:, None],  # [M, 1]
        scale_b=scale[None, :],  # [1, N]
        out_dtype=torch.bfloat16,  # what row-wise scaling produces
        use_fast_accum=SCALED_MM_FAST_ACCUMULATION,
    ).to(dtype)
