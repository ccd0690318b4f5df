"""Where an engine runs and in which dtype, from its settings (torch only: a job's process
decides this without loading transformers' model code)."""

from __future__ import annotations

import torch

from batchgen.engine.config import EngineConfig
from batchgen.errors import BatchgenError


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BatchgenError(f"device={config.device!r} but CUDA is not available: use device='cpu'")
    return device


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, config.dtype)
