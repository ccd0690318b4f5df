"""Which attention backend a config gets on a device, checked before any model work."""

from __future__ import annotations

import os

import torch

from batchgen.engine.attention.base import AttentionBackend
from batchgen.engine.attention.reference import ReferenceBackend
from batchgen.engine.config import EngineConfig
from batchgen.errors import BatchgenError


def check_backend(config: EngineConfig, device: torch.device) -> str:
    """The attention backend this config gets on device -> "reference" or "triton";
    BatchgenError when it cannot run there (checked before any model work)."""
    choice = config.attention_backend
    if choice == "auto":
        choice = "triton" if device.type == "cuda" and _has_triton() else "reference"
    if choice == "triton" and not _has_triton():
        raise BatchgenError("attention_backend='triton' needs triton: pip install triton")
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise BatchgenError(
            f"attention_backend='triton' runs on a CUDA GPU, not on {device}: use "
            "attention_backend='auto' or 'reference' (or TRITON_INTERPRET=1 to test the kernels)"
        )
    return choice


def make_backend(config: EngineConfig, device: torch.device) -> AttentionBackend:
    if check_backend(config, device) == "reference":
        return ReferenceBackend()
    from batchgen.engine.attention.triton import TritonBackend

    return TritonBackend()


def uses_triton(backend: object) -> bool:
    return isinstance(backend, _triton_type())


def _triton_type() -> type:
    if not _has_triton():
        return type(None)
    from batchgen.engine.attention.triton import TritonBackend

    return TritonBackend


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
