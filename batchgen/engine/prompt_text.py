"""Checks on a text prompt, shared by the engine and the job's prompt builder (both tokenize
text with the tokenizer's special tokens): each names what is wrong in one line."""

from __future__ import annotations


def check_unicode(text: str) -> None:
    """ValueError where the text holds a lone surrogate (no tokenizer or file can hold it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("prompt is not valid Unicode (it holds a lone surrogate)") from None
