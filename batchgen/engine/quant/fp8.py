"""FP8 E4M3 linear layers: weights with one scale per output channel, activations with one
scale per token (computed on the fly), GEMM in FP8 with float32 accumulation.

Value = fp8 x scale. Scales are float32; a scale is amax / FP8_MAX of what it covers, so the
largest magnitude maps onto the largest finite FP8 value and nothing saturates.

On a CUDA GPU with FP8 GEMMs (compute capability 9.0+) a linear is one fused Triton kernel
(row amax -> scale -> cast) and an FP8 GEMM with row-wise scales: batchgen's Triton kernel at
decode batch sizes, torch._scaled_mm where cuBLAS's large tiles fill the GPU
(batchgen.engine.kernels.fp8_gemm). Elsewhere (the CPU)
the same FP8 values are multiplied in float32: the same numbers up to summation order, at no
speed-up (an emulation for tests and CPU runs, announced by a warning when a model is
quantized there).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
MIN_SCALE = 1e-12  # an all-zero row gets this scale (its values stay 0)
FP8_GEMM_CAPABILITY = (9, 0)  # row-wise scaled FP8 GEMMs in torch._scaled_mm


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [N, K] -> (fp8 [N, K], float32 scale [N]), one scale per output channel."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)  # [N]
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_weight(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """fp8 [N, K] x scale [N] -> [N, K] in dtype."""
    return (weight.float() * scale.float()[:, None]).to(dtype)


def fp8_cache_values(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """What an FP8 cache of this scale stores for x: x / scale in E4M3, saturated at
    +-FP8_MAX (beyond it the cast would give NaN), NaN as 0: an FP8 cache never holds NaN
    (decode's TMA copies read the slots past a sequence's end, multiplied by 0). write_kv's
    reference."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).nan_to_num(nan=0.0).to(FP8_DTYPE)


def round_to_fp8(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x as an FP8 cache of this scale gives it back (fp8_cache_values times scale), in
    x.dtype."""
    return (fp8_cache_values(x, scale).float() * scale).to(x.dtype)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (fp8 [M, K], float32 scale [M]): dynamic per-token scales, in torch."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] contiguous -> (fp8 [M, K], float32 scale [M]); the Triton kernel on CUDA."""
    if x.is_cuda:
        from batchgen.engine.kernels.fp8_quant import quantize_rows_triton

        return quantize_rows_triton(x)
    return quantize_rows_reference(x)


# attribute of a 16-bit activation carrying its FP8 rows, made by the kernel that wrote it
_FP8_ROWS = "_batchgen_fp8_rows"


def attach_fp8_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Record on x (a kernel's fresh output) what quantize_rows makes of it: fp8 q [M, K] and
    float32 scale [M], M * K = x.numel(). An FP8 linear given x uses them instead of
    quantizing again. x must not be changed in place afterwards (no caller does)."""
    setattr(x, _FP8_ROWS, (q, scale))


def _rows_of(x: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 = x as [M, K] -> its FP8 rows: the attached ones, else quantized now."""
    rows = getattr(x, _FP8_ROWS, None)
    if rows is not None and rows[0].shape == x2.shape:
        return rows
    return quantize_rows(x2.contiguous())


# True only inside unquantized_activations() (the model check at start-up)
_UNQUANTIZED_ACTIVATIONS = [False]


@contextmanager
def unquantized_activations() -> Iterator[None]:
    """While open, FP8 layers multiply their 16-bit input, not quantized, by their FP8 weights
    (dequantized to the input's dtype): a 16-bit model with FP8-rounded weights, without the
    per-token activation rounding whose discontinuities the model check must not compare
    (batchgen.engine.quant.check)."""
    _UNQUANTIZED_ACTIVATIONS[0] = True
    try:
        yield
    finally:
        _UNQUANTIZED_ACTIVATIONS[0] = False


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [..., K] 16/32-bit; weight: fp8 [N, K]; scale: float32 [N] -> [..., N] in x.dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if _UNQUANTIZED_ACTIVATIONS[0]:
        out = torch.nn.functional.linear(x2, dequantize_weight(weight, scale, x.dtype))
        out = out if bias is None else out + bias
    elif x2.shape[0] == 0:
        out = fp8_rows_linear(x2, x2.new_empty(0), weight, scale, bias, x.dtype)
    else:
        out = fp8_rows_linear(*_rows_of(x, x2), weight, scale, bias, x.dtype)
    return out.reshape(*shape[:-1], weight.shape[0])


def activations_unquantized() -> bool:
    """Inside unquantized_activations(): FP8 layers take their 16-bit input as it is."""
    return _UNQUANTIZED_ACTIVATIONS[0]


def fp8_rows_linear(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """An activation's FP8 rows (fp8 [M, K], float32 scales [M], as quantize_rows makes them)
    times an FP8 weight [N, K] with its scales [N], plus bias -> [M, N] in dtype."""
    if xq.shape[0] == 0:
        out = torch.empty(0, weight.shape[0], dtype=dtype, device=xq.device)
    elif xq.is_cuda:
        from batchgen.engine.kernels.fp8_gemm import fp8_matmul, gpu_gemm_config

        out = fp8_matmul(xq, xs, weight, scale, dtype, gpu_gemm_config(xq, weight))
    else:
        out = _fp8_product(xq, xs, weight, scale, dtype)
    return out if bias is None else out + bias


def emulated_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [M, K] -> [M, N]: what fp8_linear computes (no bias), in torch on x's device: the
    oracle of the GPU path (Triton quantization and torch._scaled_mm)."""
    return _fp8_product(*quantize_rows_reference(x), weight, scale, x.dtype)


def _fp8_product(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """fp8 [M, K] x scale [M] times fp8 [N, K] x scale [N] -> [M, N] in dtype (float32 math)."""
    return ((xq.float() @ weight.float().t()) * xs[:, None] * scale[None, :]).to(dtype)


class Fp8Linear(nn.Module):
    """A Linear whose weight is FP8 E4M3 [out, in] with a float32 scale per output row.

    weight and weight_scale are buffers (not parameters): the model's dtype stays that of its
    16-bit parameters, and nothing treats FP8 values as trainable.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if weight.dtype != FP8_DTYPE or scale.shape != (weight.shape[0],):
            raise ValueError(
                f"Fp8Linear needs an fp8 [N, K] weight and a [N] scale, got {weight.dtype} "
                f"{tuple(weight.shape)} and {tuple(scale.shape)}"
            )
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale.float())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        weight, scale = quantize_weight(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(weight, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3"
