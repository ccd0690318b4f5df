"""Quantize a loaded 16-bit model's Linear layers to FP8, in place."""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from batchgen.engine.quant.fp8 import FP8_GEMM_CAPABILITY, Fp8Linear
from batchgen.errors import BatchgenError

GEMM_MULTIPLE = 16  # FP8 GEMMs need in and out features divisible by this
CPU_EMULATION = (
    "batchgen: FP8 on the CPU is an emulation (the same FP8 values multiplied in float32): "
    "outputs as on an FP8 GPU up to rounding, no speed-up"
)


def check_fp8_device(device: torch.device, setting: str = "quantization='fp8'") -> None:
    """BatchgenError on a GPU without FP8 support; a warning on the CPU (emulated there).
    setting: what asked for FP8, named in the message."""
    if device.type == "cpu":
        warnings.warn(CPU_EMULATION, stacklevel=3)
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_GEMM_CAPABILITY:
        major, minor = FP8_GEMM_CAPABILITY
        raise BatchgenError(
            f"runtime.{setting} needs a GPU with FP8 support (compute capability "
            f"{major}.{minor}+, e.g. H100/H200); {torch.cuda.get_device_name(device)} is "
            f"{capability[0]}.{capability[1]}: run this model without FP8"
        )


def check_adopted(model: nn.Module, quantization: str | None, device: torch.device) -> None:
    """A model passed in is used as it is: quantization='fp8' needs it quantized already,
    and a quantized one a device that runs FP8."""
    if is_quantized(model):
        check_fp8_device(device)
    elif quantization == "fp8":
        raise BatchgenError(
            "runtime.quantization='fp8' but the model passed in is not quantized (batchgen "
            "never changes a caller's model): quantize it first with "
            "batchgen.engine.quant.quantize_model(model), or pass its folder"
        )


def quantizable(module: nn.Module) -> bool:
    return (
        type(module) is nn.Linear
        and module.in_features % GEMM_MULTIPLE == 0
        and module.out_features % GEMM_MULTIPLE == 0
    )


@torch.no_grad()
def quantize_model(model: nn.Module) -> int:
    """Replace every quantizable nn.Linear except the output embedding (lm_head) with an
    Fp8Linear (per-output-channel weight scales), one layer at a time so that at most one
    16-bit weight is copied at once. Norms, embeddings and the lm_head stay 16-bit.
    -> the number of layers quantized."""
    keep = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = [n for n, m in model.named_modules() if m is not keep and quantizable(m)]
    for name in names:  # by name: each 16-bit weight is freed once its layer is replaced
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear.from_linear(getattr(parent, child)))
    return len(names)


def check_coverage(model: nn.Module, quantized: int) -> None:
    """After quantize_model quantized `quantized` layers: BatchgenError where it quantized
    none (the model's matrices are not nn.Linear layers, e.g. GPT-2's Conv1D), else a warning
    line where weight matrices outside the embeddings stay 16-bit (fused MoE experts kept
    as 3-D parameters, layers of other classes or widths)."""
    if not quantized:
        raise BatchgenError(
            f"runtime.quantization='fp8' but this {type(model).__name__} has no nn.Linear "
            "layers batchgen can quantize (its weight matrices are of other classes, or not "
            f"multiples of {GEMM_MULTIPLE} wide): run it without quantization"
        )
    left = _unquantized_matrices(model)
    if not left:
        return
    fp8 = sum(m.weight.numel() for m in model.modules() if isinstance(m, Fp8Linear))
    count = sum(left.values())
    names = ", ".join(list(left)[:2]) + (", ..." if len(left) > 2 else "")
    warnings.warn(
        f"batchgen: quantization='fp8' leaves {count:,} weights ({count / (count + fp8):.0%} "
        f"of those outside embeddings and norms) in 16 bits, in {len(left)} tensor(s) that "
        f"are not nn.Linear layers batchgen quantizes ({names})",
        stacklevel=3,
    )


def _unquantized_matrices(model: nn.Module) -> dict[str, int]:
    """name -> size of each weight of two or more dimensions left 16-bit, outside the
    embeddings and the lm_head."""
    kept = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        with contextlib.suppress(AttributeError, NotImplementedError):
            kept.add(getattr(model, getter)())
    out = {}
    for module_name, module in model.named_modules():
        if module in kept or isinstance(module, nn.Embedding | Fp8Linear):
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dim() >= 2:
                out[f"{module_name}.{name}" if module_name else name] = param.numel()
    return out


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear) for m in model.modules())
