"""Fused KV write: new K and V tokens into their paged-cache slots, one launch for both."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.engine.kernels.launch import launch, next_power_of_2
from batchgen.engine.quant.fp8 import FP8_DTYPE, FP8_MAX


@triton.jit
def fp8_stored(x, scale_ptr, SCALED: tl.constexpr, FP8_MAX: tl.constexpr):
    """x as an FP8 cache stores it, in float32 (fp8_cache_values): divided by its scale (when
    SCALED), clamped to the largest finite FP8 value (beyond it the cast would give NaN), and
    NaN as 0, so the cache never holds NaN (decode's TMA copies read whole blocks)."""
    x = x.to(tl.float32)
    if SCALED:
        x = x / tl.load(scale_ptr)
    return tl.where(x == x, tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX), 0.0)


@triton.jit
def _kv_write_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    slot_ptr,  # [T] int64, -1 = padding
    scale_ptr,  # [2] float32 (key scale, value scale), read when SCALED
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SATURATE: tl.constexpr,  # an FP8 cache: clamp to its largest finite value first
    FP8_MAX: tl.constexpr,
    SCALED: tl.constexpr,  # an FP8 cache with scales: store x / scale
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)  # [BLOCK_H, BLOCK_D]
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    kc = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d * stride_kcd
    vc = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d * stride_vcd
    if SATURATE:
        k = fp8_stored(k, scale_ptr, SCALED, FP8_MAX)
        v = fp8_stored(v, scale_ptr + 1, SCALED, FP8_MAX)
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Write k, v: [T, Hkv, D] (any strides) into caches [num_blocks, block_size, Hkv, D].

    slot_mapping: [T] int64 flat slot (block * block_size + offset); -1 = padding, skipped.
    Values are cast to the cache dtype; an FP8 E4M3 cache stores k / kv_scales[0] and
    v / kv_scales[1] (kv_scales: [2] float32 on the device; None: 1), saturated at +-448.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape != v_cache.shape:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} or cache shapes differ")
    if k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"cache {tuple(k_cache.shape)} does not hold k {tuple(k.shape)}")
    if num_tokens == 0:
        return
    launch(
        _kv_write_kernel,
        (num_tokens,),
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        slot_mapping if kv_scales is None else kv_scales,  # never read without scales
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        SATURATE=k_cache.dtype == FP8_DTYPE,
        FP8_MAX=FP8_MAX,
        SCALED=k_cache.dtype == FP8_DTYPE and kv_scales is not None,
        num_warps=4,
    )
