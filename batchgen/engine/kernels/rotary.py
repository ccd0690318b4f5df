"""Rotate-half rotary embedding of q and k in one kernel, rounding once (the Hugging Face op
rounds three times), and the same rotation fused with the KV write: q rotated, k rotated
straight into its cache slot, v copied into its own (one launch for all three).
fusion.RopeCheck compares the rotation with the model's own function before either is used."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.engine.kernels.kv_write import fp8_stored
from batchgen.engine.kernels.launch import cdiv, launch, next_power_of_2
from batchgen.engine.quant.fp8 import FP8_DTYPE, FP8_MAX


@triton.jit
def _rope_heads(
    src_ptr, dst_ptr, stride_h, stride_oh, heads, h0, c1, c2, s1, s2, i,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, SATURATE: tl.constexpr = False,
    FP8_MAX: tl.constexpr = 448.0, scale_ptr=None, SCALED: tl.constexpr = False,
):  # fmt: skip
    """Rotate heads [h0, h0 + BLOCK_H) of one token (rows of src/dst at stride_h/stride_oh),
    rounding to src's dtype; SATURATE: dst is an FP8 cache, stored as write_kv stores it."""
    h = h0 + tl.arange(0, BLOCK_H)
    mask = (h < heads)[:, None] & (i < HALF)[None, :]
    src = src_ptr + h[:, None].to(tl.int64) * stride_h + i[None, :]
    dst = dst_ptr + h[:, None].to(tl.int64) * stride_oh + i[None, :]
    x1 = tl.load(src, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask).to(tl.float32)
    y1 = _stored((x1 * c1 - x2 * s1).to(src_ptr.dtype.element_ty), scale_ptr, SATURATE, SCALED,
        FP8_MAX)  # fmt: skip
    y2 = _stored((x2 * c2 + x1 * s2).to(src_ptr.dtype.element_ty), scale_ptr, SATURATE, SCALED,
        FP8_MAX)  # fmt: skip
    tl.store(dst, y1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, y2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _stored(x, scale_ptr, SATURATE: tl.constexpr, SCALED: tl.constexpr, FP8_MAX: tl.constexpr):
    """x as written to a cache: where SATURATE (an FP8 cache) as write_kv stores it."""
    if SATURATE:
        x = fp8_stored(x, scale_ptr, SCALED, FP8_MAX)
    return x


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, t, stride_ct, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """Token t's cos and sin halves as [1, BLOCK] float32 rows, and the lane index."""
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + i, mask=mask).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + i, mask=mask).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_ct + i, mask=mask).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + i, mask=mask).to(tl.float32)[None, :]
    return c1, c2, s1, s2, i


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, vo_ptr, slot_ptr, scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
    stride_qot, stride_qoh, stride_kob, stride_kos, stride_koh, num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    CACHE: tl.constexpr, BLOCK_SIZE: tl.constexpr, SATURATE: tl.constexpr,
    FP8_MAX: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """Program (t, j): token t's q heads [j * BLOCK_H, ...) rotated into qo while j < q_blocks,
    then its k heads rotated into ko: its row t (stride_kob), or with CACHE its cache slot
    (ko, vo: [blocks, BLOCK_SIZE, Hkv, D] caches; slot -1, a padding token, writes nothing),
    where its v heads are copied too. cos/sin are read once per program (one program per
    head and token, 327k programs per 8b prefill step of 8,192 tokens, took 5x the kernel's
    bytes' bound)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    c1, c2, s1, s2, i = _cos_sin(cos_ptr, sin_ptr, t, stride_ct, HALF, BLOCK)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if j < q_blocks:
        _rope_heads(
            q_ptr + t * stride_qt, qo_ptr + t * stride_qot, stride_qh, stride_qoh, num_q_heads,
            j * BLOCK_H, c1, c2, s1, s2, i, HALF, BLOCK_H,
        )  # fmt: skip
        return
    h0 = (j - q_blocks) * BLOCK_H
    at = t * stride_kob
    if CACHE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:
            return
        at = (slot // BLOCK_SIZE) * stride_kob + (slot % BLOCK_SIZE) * stride_kos
    _rope_heads(
        k_ptr + t * stride_kt, ko_ptr + at, stride_kh, stride_koh, num_k_heads, h0,
        c1, c2, s1, s2, i, HALF, BLOCK_H, SATURATE, FP8_MAX, scale_ptr, SCALED,
    )  # fmt: skip
    if CACHE:
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_k_heads) & (d < 2 * HALF)
        x = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        dst = vo_ptr + at + h * stride_koh + d
        x = _stored(x, scale_ptr + 1, SATURATE, SCALED, FP8_MAX)
        tl.store(dst, x.to(vo_ptr.dtype.element_ty), mask=mask)


ROPE_BLOCK_H = 8  # heads per program of _rope_kernel


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding. x: [1, H, T, D] (any strides), cos/sin: [1, T, D]
    -> [1, H, T, D] (a transposed view of a contiguous [1, T, H, D])."""
    return rope_qk(x, x[:, :0], cos, sin)[0]


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """rope() of q [1, Hq, T, D] and k [1, Hk, T, D] in one launch (same dtype)."""
    _, q_heads, tokens, dim = q.shape
    q_out = torch.empty((tokens, q_heads, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, k.shape[1], dim), dtype=k.dtype, device=k.device)
    if tokens:  # k_out as a "cache" of one-token blocks, token t in block t
        _launch(q[0].transpose(0, 1), k[0].transpose(0, 1), None, cos, sin, q_out, k_out[:, None])
    return q_out[None].transpose(1, 2), k_out[None].transpose(1, 2)


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """rope_qk() of q [T, Hq, D] and k [T, Hkv, D] with write_kv() of the rotated k and of v
    [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D], in one launch: returns the
    rotated q [T, Hq, D]; k's rotation exists only in the cache. Values are what rope_qk then
    write_kv (with the same scales) store, bit for bit. cos/sin: [1, T, D] or [T, D]; every
    last dim contiguous."""
    tokens, q_heads, dim = q.shape
    if v.shape != k.shape or k_cache.shape != v_cache.shape or k.shape[0] != tokens:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if k_cache.shape[2:] != k.shape[1:] or k_cache.stride() != v_cache.stride():
        raise ValueError(f"cache {tuple(k_cache.shape)} does not hold k {tuple(k.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, v, k_cache)) or dim % 2:
        raise ValueError("rope_write_kv needs contiguous last dims and an even head size")
    q_out = torch.empty((tokens, q_heads, dim), dtype=q.dtype, device=q.device)
    if tokens:
        _launch(q, k, (v, v_cache, slot_mapping), cos, sin, q_out, k_cache, kv_scales)
    return q_out


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor,
    k_dst: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """_rope_kernel: q [T, Hq, D] rotated into q_out, k [T, Hk, D] into k_dst [blocks,
    block_size, Hk, D]: at row t (values None: k_dst holds one token per block), or at each
    token's slot with v copied likewise (values: v, v's cache, slots; kv_scales: an FP8
    cache's, as write_kv takes them)."""
    tokens, q_heads, dim = q.shape
    v, v_dst, slots = values if values is not None else (k, k_dst, k)  # unread without CACHE
    cos2, sin2 = cos.reshape(tokens, dim).contiguous(), sin.reshape(tokens, dim).contiguous()
    blocks = cdiv(q_heads, ROPE_BLOCK_H) + cdiv(k.shape[1], ROPE_BLOCK_H)
    launch(_rope_kernel, (tokens, blocks),
        q, k, v, cos2, sin2, q_out, k_dst, v_dst, slots, slots if kv_scales is None else kv_scales,
        *q.stride()[:2], *k.stride()[:2],
        *v.stride()[:2], cos2.stride(0), *q_out.stride()[:2], *k_dst.stride()[:3], q_heads,
        k.shape[1], HALF=dim // 2, BLOCK=next_power_of_2(dim // 2),
        BLOCK_H=ROPE_BLOCK_H, BLOCK_D=next_power_of_2(dim), CACHE=values is not None,
        BLOCK_SIZE=k_dst.shape[1], SATURATE=k_dst.dtype == FP8_DTYPE, FP8_MAX=FP8_MAX,
        SCALED=k_dst.dtype == FP8_DTYPE and kv_scales is not None,
    )  # fmt: skip
