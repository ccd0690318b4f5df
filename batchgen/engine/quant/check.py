"""The model check of an FP8 model (batchgen.engine.probe), in two parts.

Why the probe cannot compare an FP8 model's log-probabilities as it does a 16-bit one's:
per-token FP8 activation rounding is a discontinuous function of its input. The engine and
the model's own forward pass compute the same function in different orders (fused RMSNorm,
rotary and SiLU kernels, merged q/k/v and gate/up GEMMs, Triton vs eager attention), so
their 16-bit activations differ by an ulp here and there; where an activation sits near an
FP8 rounding boundary that ulp moves it by a whole FP8 step (1/16 of its value), and the
next layers amplify such steps like any other perturbation. Measured on the tiny test Llama
(hidden 128, initializer_range 0.2) in Triton's CPU interpreter: fused FP8 vs its own FP8
forward 0.54 nats in bfloat16 and 2e-6 in float32 (the fused path computes the same
function); unfused FP8 1.02 in bfloat16 (the H200 gave 0.62 fused, 0.0039 in float32, where
_scaled_mm rounds its output to bfloat16). No tolerance separates such noise from a small
real error on every model, so the check is split:

1. The probe runs with activations unquantized (unquantized_activations): every FP8 layer
   multiplies its 16-bit input by its own FP8 weights, so the engine (attention, paged cache,
   scheduling, fused kernels, merged FP8 weights and per-channel scales) is compared with the
   model's own forward pass at the dtype's usual tolerance, as for a 16-bit model. CUDA graphs
   recorded the quantizing kernels; the probe's steps run eagerly anyway (probe.py).
2. The quantized product itself (on a GPU the Triton quantization kernel, and each GEMM the
   engine may pick: batchgen's Triton kernel with and without split K, torch._scaled_mm) is
   compared layer shape by layer shape with its emulation in torch (emulated_fp8_linear) on
   random activations with outlier columns.
An FP8 KV cache stays FP8 in the probe (the reference rounds keys and values as it stores
them): its rounding noise is within the tolerance on realistic weights (0.04-0.06 nats on the
tiny Llama with initializer_range 0.02). Models whose bfloat16 outputs move by more than the
tolerance under rounding alone (the tiny test Llama with initializer_range 0.2 is one: 0.37
nats between its float32 and bfloat16 forwards, 1.5 with FP8-rounded weights) are refused
in bfloat16 with or without FP8; run them in float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from batchgen.engine.quant.fp8 import (
    Fp8Linear,
    emulated_fp8_linear,
    quantize_rows,
    unquantized_activations,
)

GEMM_ROWS = 37  # activation rows of the product check (not a multiple of 16)
# ||fp8_linear - emulation|| / ||emulation||: the H200 measured 0.0016 (bfloat16 output
# rounding, summation order); a wrong scale, layout or cast is off by O(1)
GEMM_TOLERANCE = 1e-2


@contextlib.contextmanager
def fp8_probe_mode() -> Iterator[None]:
    """Activations unquantized while the probe runs (its steps run eagerly: probe.py)."""
    with unquantized_activations():
        yield


@torch.inference_mode()
def fp8_product_error(model: torch.nn.Module, dtype: torch.dtype) -> str | None:
    """None when every FP8 layer shape's product matches its emulation, else the reason."""
    shapes: dict[tuple[int, int], Fp8Linear] = {}
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            shapes.setdefault((module.out_features, module.in_features), module)
    generator = torch.Generator().manual_seed(0)
    for (rows, cols), layer in shapes.items():
        x = torch.randn(GEMM_ROWS, cols, generator=generator)
        x[:, :: max(1, cols // 4)] *= 50.0  # outlier columns set the per-token scales
        x = x.to(device=layer.weight.device, dtype=dtype)
        want = emulated_fp8_linear(x, layer.weight, layer.weight_scale)
        for path, got in _products(layer, x):
            error = ((got.float() - want.float()).norm() / want.float().norm()).item()
            if not error <= GEMM_TOLERANCE:  # NaN fails too
                return (
                    f"its FP8 {cols}->{rows} product ({path}) is off by {error:.3g} (relative) "
                    "from the FP8 emulation"
                )
    return None


def _products(layer: Fp8Linear, x: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The layer's product of x (no bias) by every GEMM the engine may run: the layer's own
    forward (on a GPU the Triton kernel for these rows), and on a GPU also _scaled_mm (larger
    batches) and the Triton kernel with K split (other batch sizes)."""
    yield "layer", layer(x) if layer.bias is None else layer(x) - layer.bias
    if not x.is_cuda:
        return
    from batchgen.engine.kernels.fp8_gemm import GemmConfig, fp8_matmul  # Triton kernels

    xq, xs = quantize_rows(x)
    weight, scale = layer.weight, layer.weight_scale
    yield "_scaled_mm", fp8_matmul(xq, xs, weight, scale, x.dtype, None)
    split = GemmConfig(16, 64, 128, 4, 4, split_k=2)
    yield "Triton, split K", fp8_matmul(xq, xs, weight, scale, x.dtype, split)
