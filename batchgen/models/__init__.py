"""Locally built Hugging Face models: tiny test fixtures and the embedded default model."""

from batchgen.home import batchgen_home
from batchgen.models.tiny import (
    ARCHS,
    CHAT_TEMPLATE,
    DEFAULT_MODEL_ARCH,
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_SEED,
    DEFAULT_MODEL_SHAPE,
    DEFAULT_MODEL_VERSION,
    SPECIAL_TOKENS,
    TINY_SHAPE,
    TOKENIZER_VOCAB_SIZE,
    SpecialTokens,
    TinyShape,
    build_tiny_model,
    build_tokenizer,
    default_model_folder,
    default_model_path,
)

__all__ = [
    "ARCHS",
    "CHAT_TEMPLATE",
    "DEFAULT_MODEL_ARCH",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_MODEL_SEED",
    "DEFAULT_MODEL_SHAPE",
    "DEFAULT_MODEL_VERSION",
    "SPECIAL_TOKENS",
    "TINY_SHAPE",
    "TOKENIZER_VOCAB_SIZE",
    "SpecialTokens",
    "TinyShape",
    "batchgen_home",
    "build_tiny_model",
    "build_tokenizer",
    "default_model_folder",
    "default_model_path",
]
