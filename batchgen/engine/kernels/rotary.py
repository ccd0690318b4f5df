"""Rotate-half rotary embedding of q and k in one kernel, rounding once (the Hugging Face op
rounds three times); fusion.RopeCheck compares it with the model's own function before use."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_heads(
    src_ptr, dst_ptr, stride_h, stride_oh, heads, h0, c1, c2, s1, s2, i,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Rotate heads [h0, h0 + BLOCK_H) of one token (rows of src/dst at stride_h/stride_oh)."""
    h = h0 + tl.arange(0, BLOCK_H)
    mask = (h < heads)[:, None] & (i < HALF)[None, :]
    src = src_ptr + h[:, None].to(tl.int64) * stride_h + i[None, :]
    dst = dst_ptr + h[:, None].to(tl.int64) * stride_oh + i[None, :]
    x1 = tl.load(src, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask).to(tl.float32)
    tl.store(dst, (x1 * c1 - x2 * s1).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * c2 + x1 * s2).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    qo_ptr,
    ko_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Program (t, j): token t, q heads [j * BLOCK_H, ...) while j < q_blocks, then k heads.
    cos/sin are read once per program (one program per head and token, 327k programs per 8b
    prefill step of 8,192 tokens, took 5x the kernel's bytes' bound)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + i, mask=mask).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + i, mask=mask).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_ct + i, mask=mask).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + i, mask=mask).to(tl.float32)[None, :]
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if j < q_blocks:
        _rope_heads(
            q_ptr + t * stride_qt, qo_ptr + t * stride_qot, stride_qh, stride_qoh, num_q_heads,
            j * BLOCK_H, c1, c2, s1, s2, i, HALF, BLOCK_H,
        )  # fmt: skip
    else:
        _rope_heads(
            k_ptr + t * stride_kt, ko_ptr + t * stride_kot, stride_kh, stride_koh, num_k_heads,
            (j - q_blocks) * BLOCK_H, c1, c2, s1, s2, i, HALF, BLOCK_H,
        )  # fmt: skip


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
    k_heads = k.shape[1]
    q_out = torch.empty((1, tokens, q_heads, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((1, tokens, k_heads, dim), dtype=k.dtype, device=k.device)
    cos2, sin2 = cos.reshape(tokens, dim).contiguous(), sin.reshape(tokens, dim).contiguous()
    blocks = triton.cdiv(q_heads, ROPE_BLOCK_H) + triton.cdiv(k_heads, ROPE_BLOCK_H)
    if tokens and blocks:
        _rope_kernel[(tokens, blocks)](
            q, k, cos2, sin2, q_out, k_out, q.stride(2), q.stride(1), k.stride(2), k.stride(1),
            cos2.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(1), k_out.stride(2),
            q_heads, k_heads, HALF=dim // 2, BLOCK=triton.next_power_of_2(dim // 2),
            BLOCK_H=ROPE_BLOCK_H,
        )  # fmt: skip
    return q_out.transpose(1, 2), k_out.transpose(1, 2)
