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


SMALL_BUDGET, LARGE_BUDGET = 8192, 16384  # tokens per step (EngineConfig.max_num_batched_tokens)
LARGE_GPU_BYTES = 70 * 1024**3
ACTIVATION_MARGIN = 2  # the larger budget only where twice its estimated activations fit


def token_budget(
    config: EngineConfig, device: torch.device, spare_bytes: int = 0, token_bytes: int = 0
) -> int:
    """Tokens per step: config.max_num_batched_tokens, or where it is unset LARGE_BUDGET on a
    GPU of LARGE_GPU_BYTES or more other than an A100 (vLLM measured the larger budget slower
    there) whose memory beside the weights and the KV cache (spare_bytes) holds
    ACTIVATION_MARGIN times a step's activations at token_bytes per token, else SMALL_BUDGET;
    never below max_num_seqs."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    budget = SMALL_BUDGET
    if device.type == "cuda" and spare_bytes >= ACTIVATION_MARGIN * LARGE_BUDGET * token_bytes:
        props = torch.cuda.get_device_properties(device)
        if props.total_memory >= LARGE_GPU_BYTES and "A100" not in props.name.upper():
            budget = LARGE_BUDGET
    return max(budget, config.max_num_seqs)
