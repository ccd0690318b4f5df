"""Fused elementwise kernels that replace chains of small PyTorch ops in a decoder layer.

Each matches the Hugging Face op it replaces rounding-for-rounding where the original rounds
(RMSNorm and SiLU-and-mul); rotary embedding rounds once instead of three times.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty)  # HF rounds to the input dtype here
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim; x: [..., D] -> same shape and dtype."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), shape[-1], eps,
            BLOCK=triton.next_power_of_2(shape[-1]),
        )  # fmt: skip
    return out.view(shape)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # HF rounds silu's result
    tl.store(out_ptr + offs, (act.to(tl.float32) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for contiguous tensors of one shape."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    block = 1024
    if n:
        _silu_mul_kernel[(triton.cdiv(n, block),)](gate, up, out, n, BLOCK=block)
    return out


@triton.jit
def _silu_mul_merged_kernel(gu_ptr, out_ptr, stride_gu, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # HF rounds silu's result
    out = (act.to(tl.float32) * u).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def silu_mul_merged(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up where gate_up: [..., 2I] holds gate then up (one merged GEMM's output)
    -> [..., I]."""
    shape = gate_up.shape
    rows = gate_up.reshape(-1, shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    half = shape[-1] // 2
    out = torch.empty((rows.shape[0], half), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if rows.shape[0]:
        _silu_mul_merged_kernel[(rows.shape[0], triton.cdiv(half, block))](
            rows, out, rows.stride(0), out.stride(0), half, BLOCK=block
        )
    return out.view(*shape[:-1], half)


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    x1 = tl.load(x_ptr + t * stride_xt + h * stride_xh + i, mask=mask).to(tl.float32)
    x2 = tl.load(x_ptr + t * stride_xt + h * stride_xh + HALF + i, mask=mask).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_ct + i, mask=mask).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + i, mask=mask).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_ct + i, mask=mask).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + i, mask=mask).to(tl.float32)
    dst = out_ptr + t * stride_ot + h * stride_oh
    tl.store(dst + i, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + i, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding. x: [1, H, T, D] (any strides), cos/sin: [1, T, D]
    -> [1, H, T, D] (a transposed view of a contiguous [1, T, H, D])."""
    _, heads, tokens, dim = x.shape
    out = torch.empty((1, tokens, heads, dim), dtype=x.dtype, device=x.device)
    cos2, sin2 = cos.reshape(tokens, dim).contiguous(), sin.reshape(tokens, dim).contiguous()
    if tokens:
        _rope_kernel[(tokens, heads)](
            x, cos2, sin2, out, x.stride(2), x.stride(1), cos2.stride(0), out.stride(1),
            out.stride(2), HALF=dim // 2, BLOCK=triton.next_power_of_2(dim // 2),
        )  # fmt: skip
    return out.transpose(1, 2)
