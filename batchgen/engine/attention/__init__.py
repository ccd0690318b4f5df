"""Attention for Hugging Face models over a paged KV cache: the shared types (base), the
PyTorch reference backend, the Triton backend, and the transformers adapter."""

from batchgen.engine.attention.base import AttentionBackend, AttentionMetadata, KVCache, LayerSpec
from batchgen.engine.attention.hf_adapter import (
    ATTENTION_NAME,
    attention_audit,
    attention_scope,
    batchgen_attention,
    register,
    step_context,
)
from batchgen.engine.attention.reference import ReferenceBackend

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
