"""Attention for Hugging Face models over a paged KV cache: the shared types (base), the
PyTorch reference backend, the Triton backend, and the transformers adapter.

Its names are imported on first use: a job whose engine runs in another process checks its
backend (select.py) without loading transformers' model code, which the adapter needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.engine.attention.base import (
        AttentionBackend,
        AttentionMetadata,
        KVCache,
        LayerSpec,
    )
    from batchgen.engine.attention.hf_adapter import (
        ATTENTION_NAME,
        attention_audit,
        attention_scope,
        batchgen_attention,
        register,
        step_context,
    )
    from batchgen.engine.attention.reference import ReferenceBackend

_HOMES = {
    "AttentionBackend": "base",
    "AttentionMetadata": "base",
    "KVCache": "base",
    "LayerSpec": "base",
    "ATTENTION_NAME": "hf_adapter",
    "attention_audit": "hf_adapter",
    "attention_scope": "hf_adapter",
    "batchgen_attention": "hf_adapter",
    "register": "hf_adapter",
    "step_context": "hf_adapter",
    "ReferenceBackend": "reference",
}
__all__ = [
    "ATTENTION_NAME",
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "LayerSpec",
    "ReferenceBackend",
    "attention_audit",
    "attention_scope",
    "batchgen_attention",
    "register",
    "step_context",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
