"""FP8 (E4M3) weights and activations: quantization, the FP8 linear layer, checkpoints."""

from batchgen.engine.quant.convert import check_fp8_device, is_quantized, quantize_model
from batchgen.engine.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Linear,
    dequantize_weight,
    fp8_linear,
    quantize_rows,
    quantize_weight,
)

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "Fp8Linear",
    "check_fp8_device",
    "dequantize_weight",
    "fp8_linear",
    "is_quantized",
    "quantize_model",
    "quantize_rows",
    "quantize_weight",
]
