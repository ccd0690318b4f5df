"""A model's tokenizer. Loading one needs transformers' tokenizer code only, not its model
code: a job whose engine runs in another process loads its tokenizer here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from batchgen.engine.model_path import resolve_model_path
from batchgen.errors import BatchgenError, first_line

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model: Any) -> Any:
    """The tokenizer of `model` (a folder, hub id, "default" or a loaded model); None for a
    local folder that has none (token-id prompts only)."""
    source = resolve_model_path(model) if isinstance(model, (str, Path)) else model.name_or_path
    folder = Path(source)
    if folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # missing or damaged tokenizer files
        raise BatchgenError(
            f"could not load a tokenizer for '{source}' ({first_line(exc)}): check its files"
        ) from exc
