"""Fused elementwise kernels that replace chains of small PyTorch ops in a decoder layer.

Each matches the Hugging Face ops it replaces rounding for rounding (RMSNorm, the residual add
before it, SiLU-and-mul); rotary embedding is in rotary.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.engine.kernels.launch import cdiv, launch, next_power_of_2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    q_ptr,  # fp8 [rows, n_cols] (read when QUANT)
    scale_ptr,  # float32 [rows] (read when QUANT)
    res_ptr,  # [rows, n_cols] added to x first (read when ADD)
    sum_ptr,  # [rows, n_cols] x + res as stored, in x's dtype (written when ADD)
    stride_x,
    stride_o,
    stride_r,
    stride_s,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    QUANT: tl.constexpr,
    ADD: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:  # residual + x rounded to their dtype, as torch's add stores it, then normed
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty)  # HF rounds to the input dtype here
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    if QUANT:  # what quantize_rows computes from the stored row, without reading it back
        yf = y.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(yf), axis=0) / FP8_MAX, MIN_SCALE)
        q = tl.minimum(tl.maximum(yf / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool = False
) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim; x: [..., D] -> same shape and dtype.

    quantize: also the FP8 E4M3 rows an FP8 linear would quantize the result to (per-token
    scales, as quantize_rows), attached to the result (quant.fp8.attach_fp8_rows), in the
    same pass.
    """
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype),
                      device=x.device)  # fmt: skip
    q, scale = _fp8_buffers(rows, quantize)
    launch_rms_norm(rows, weight, eps, out, q if quantize else None, scale)
    return _with_rows(out.view(x.shape), q, scale, quantize)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    quantize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, rms_norm(residual + x, weight, eps, quantize)) in one pass: the sum
    rounded to the inputs' dtype as torch's add stores it, then normed from that, so both are
    bit for bit what the separate ops give. x, residual: [..., D] of one shape and dtype."""
    rows = _rows(x)
    total = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, residual.dtype),
                        device=x.device)  # fmt: skip
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, total.dtype),
                      device=x.device)  # fmt: skip
    q, scale = _fp8_buffers(rows, quantize)
    launch_rms_norm(rows, weight, eps, out, q if quantize else None, scale,
                    residual=_rows(residual), total=total)  # fmt: skip
    return total.view(x.shape), _with_rows(out.view(x.shape), q, scale, quantize)


def launch_rms_norm(
    rows: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    q: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    total: torch.Tensor | None = None,
) -> None:
    """out [M, D] = rms_norm of rows [M, D] (unit column stride); with q (fp8 [M, D], or
    float32 to keep the scaled, clamped values before the cast) and scale [M] also the
    result's FP8 rows; with residual and total ([M, D]), of total = rows + residual, which
    is stored too."""
    add = residual is not None and total is not None
    if rows.shape[0]:
        launch(_rms_norm_kernel, (rows.shape[0],),
            rows, weight, out, rows if q is None else q, rows if scale is None else scale,
            residual if add else rows, total if add else rows, rows.stride(0), out.stride(0),
            residual.stride(0) if add else 0, total.stride(0) if add else 0, rows.shape[1], eps,
            BLOCK=next_power_of_2(rows.shape[1]), QUANT=q is not None, ADD=add,
            **_fp8_consts(),
        )  # fmt: skip


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [M, D] rows with a unit column stride (a view where it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _with_rows(
    result: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, quantize: bool
) -> torch.Tensor:
    """result, with its FP8 rows attached when quantize."""
    if quantize:
        from batchgen.engine.quant.fp8 import attach_fp8_rows

        attach_fp8_rows(result, q, scale)
    return result


def _fp8_buffers(rows: torch.Tensor, quantize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from batchgen.engine.quant.fp8 import FP8_DTYPE

    if not quantize:  # placeholders, never read
        return rows, rows
    q = torch.empty(rows.shape, dtype=FP8_DTYPE, device=rows.device)
    return q, torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)


def _fp8_consts() -> dict[str, float]:
    from batchgen.engine.quant.fp8 import FP8_MAX, MIN_SCALE

    return {"FP8_MAX": FP8_MAX, "MIN_SCALE": MIN_SCALE}


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
        launch(_silu_mul_kernel, (cdiv(n, block),), gate, up, out, n, BLOCK=block)
    return out


@triton.jit
def _silu_mul_merged_kernel(gu_ptr, out_ptr, stride_gu, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    _silu_mul_cols(gu_ptr, out_ptr, row, stride_gu, stride_o, n_cols, cols)


@triton.jit
def _silu_mul_values(gu_ptr, row, stride_gu, n_cols, cols, DTYPE: tl.constexpr):
    """silu(gate) * up at `cols` of one row of gate_up, rounded to DTYPE as Hugging Face
    rounds it; -> float32 (0 past n_cols)."""
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DTYPE)  # HF rounds silu's result
    return (act.to(tl.float32) * u).to(DTYPE).to(tl.float32)


@triton.jit
def _silu_mul_cols(gu_ptr, out_ptr, row, stride_gu, stride_o, n_cols, cols):
    """_silu_mul_values, stored in out's row in its dtype; -> them in float32."""
    out = _silu_mul_values(gu_ptr, row, stride_gu, n_cols, cols, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=cols < n_cols)
    return out


def silu_mul_merged(gate_up: torch.Tensor, quantize: bool = False) -> torch.Tensor:
    """silu(gate) * up where gate_up: [..., 2I] holds gate then up (one merged GEMM's output)
    -> [..., I]. quantize: also its FP8 rows, attached as rms_norm(quantize=True) does."""
    rows = _rows(gate_up)
    half = gate_up.shape[-1] // 2
    out = torch.empty((rows.shape[0], half), dtype=gate_up.dtype, device=gate_up.device)
    shape = (*gate_up.shape[:-1], half)
    if quantize:
        q, scale = _fp8_buffers(out, True)
        launch_silu_mul_quant(rows, out, q, scale)
        return _with_rows(out.view(shape), q, scale, True)
    block = 1024
    if rows.shape[0]:
        launch(
            _silu_mul_merged_kernel,
            (rows.shape[0], cdiv(half, block)),
            rows,
            out,
            rows.stride(0),
            out.stride(0),
            half,
            BLOCK=block,
        )
    return out.view(shape)


@triton.jit
def _silu_mul_quant_kernel(
    gu_ptr,
    out_ptr,
    q_ptr,
    scale_ptr,
    stride_gu,
    stride_o,
    n_cols,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    """One program per row: the 16-bit result and its amax, then its FP8 row from it. Rows are
    few in a decode step (256 programs on an H200 with 4 warps: 14.3 us against 10.7 us for
    the two kernels it replaces), so each program has 16 warps."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = _silu_mul_cols(gu_ptr, out_ptr, row, stride_gu, stride_o, n_cols, cols)
        amax = tl.maximum(amax, tl.abs(y))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.debug_barrier()  # this program's stores above are what it reads below
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(out_ptr + row * stride_o + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(y / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def launch_silu_mul_quant(
    gate_up: torch.Tensor, out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor
) -> None:
    """out [M, I] = silu(gate) * up of gate_up [M, 2I] (unit column stride), and q (fp8
    [M, I], or float32 to keep the scaled, clamped values before the cast) and scale [M]:
    quantize_rows of out."""
    if gate_up.shape[0]:
        launch(_silu_mul_quant_kernel, (gate_up.shape[0],),
            gate_up, out, q, scale, gate_up.stride(0), out.stride(0), out.shape[1],
            BLOCK=2048, **_fp8_consts(), num_warps=16,
        )  # fmt: skip


@triton.jit
def _silu_mul_fp8_row_kernel(
    gu_ptr,
    q_ptr,
    scale_ptr,
    stride_gu,
    n_cols,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    """One program per row, the whole row in registers: gate_up read once, only the FP8 row
    and its scale written."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    y = _silu_mul_values(gu_ptr, row, stride_gu, n_cols, cols, gu_ptr.dtype.element_ty)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FP8_MAX, MIN_SCALE)
    q = tl.minimum(tl.maximum(y / scale, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=cols < n_cols)
    tl.store(scale_ptr + row, scale)


ROW_IN_REGISTERS = 32768  # longest SiLU-and-mul row _silu_mul_fp8_row_kernel keeps whole


def silu_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 rows (fp8 [M, I], float32 scales [M]) that quantize_rows makes of
    silu_mul_merged(gate_up) ([..., 2I], M rows), without keeping the 16-bit result: for an
    FP8 projection that takes them directly (the fused MLP). Rows longer than
    ROW_IN_REGISTERS go through _silu_mul_quant_kernel with a scratch 16-bit row (computing
    the values again instead measured slower on an H200)."""
    rows = _rows(gate_up)
    half = rows.shape[1] // 2
    q, scale = _fp8_buffers(rows[:, :half], True)
    block = next_power_of_2(half)
    if block > ROW_IN_REGISTERS:
        launch_silu_mul_quant(rows, torch.empty_like(q, dtype=gate_up.dtype), q, scale)
    elif rows.shape[0]:
        launch(_silu_mul_fp8_row_kernel, (rows.shape[0],),
            rows, q, scale, rows.stride(0), half, BLOCK=block, **_fp8_consts(),
            num_warps=16 if block >= 4096 else 4,
        )  # fmt: skip
    return q, scale
