"""Swap chains of small ops in known Hugging Face decoder layers for fused Triton kernels.

RMSNorm and SiLU-and-mul are replaced per module instance (the model object only); the rotary
embedding, a module-level function in the modeling file, is swapped only while batchgen runs a
forward pass (`rope_swapped`). Models of other families run unchanged.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

FUSED_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
FUSED_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")


def fuse_modules(model: nn.Module) -> list[nn.Module]:
    """Point known RMSNorm and gated-SiLU MLP modules at fused kernels; -> the modules changed."""
    from batchgen.engine.kernels import fused_ops

    changed = []
    for module in model.modules():
        name = type(module).__name__
        if name in FUSED_NORMS and hasattr(module, "variance_epsilon"):
            module.forward = _norm_forward(module, fused_ops.rms_norm)
            changed.append(module)
        elif name in FUSED_MLPS and isinstance(getattr(module, "act_fn", None), nn.SiLU):
            module.forward = _mlp_forward(module, fused_ops.silu_mul)
            changed.append(module)
    return changed


def unfuse_modules(modules: list[nn.Module]) -> None:
    """Give the modules their class's forward back."""
    for module in modules:
        module.__dict__.pop("forward", None)


def _norm_forward(module: nn.Module, kernel: Any) -> Any:
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return kernel(hidden_states, module.weight, module.variance_epsilon)

    return forward


def _mlp_forward(module: nn.Module, kernel: Any) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return module.down_proj(kernel(module.gate_proj(x), module.up_proj(x)))

    return forward


class RopeSwap:
    """Replaces the modeling file's apply_rotary_pos_emb with the fused kernel while active.

    The kernel computes rotate-half rotary embeddings. Whether the model's own function does
    the same is not assumed: the first call computes both and compares them (interleaved
    rotary, partial rotary or another signature differ), and the swap stays off for good
    where they differ.
    """

    def __init__(self, model: nn.Module) -> None:
        self.module = sys.modules.get(type(model).__module__)
        self.original = getattr(self.module, "apply_rotary_pos_emb", None)
        self.verified: bool | None = None  # None: not compared yet

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.original is None or self.verified is False:
            yield
            return
        self.module.apply_rotary_pos_emb = self._fused
        try:
            yield
        finally:
            self.module.apply_rotary_pos_emb = self.original

    def _fused(self, *args: Any, **kwargs: Any) -> Any:
        from batchgen.engine.kernels.fused_ops import rope

        if self.verified is False or kwargs or len(args) != 4:
            return self.original(*args, **kwargs)
        q, k, cos, sin = args
        if cos.shape[-1] != q.shape[-1] or q.shape[0] != 1:
            return self.original(*args, **kwargs)
        fused = rope(q, cos, sin), rope(k, cos, sin)
        if self.verified is None:
            expected = self.original(*args)
            self.verified = _close(fused, expected)
            if not self.verified:
                return expected
        return fused


def _close(got: tuple[torch.Tensor, ...], expected: Any) -> bool:
    if not isinstance(expected, tuple) or len(expected) != len(got):
        return False
    for a, b in zip(got, expected, strict=True):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape:
            return False
        tol = 1e-5 if a.dtype == torch.float32 else 2e-2
        if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol):
            return False
    return True
