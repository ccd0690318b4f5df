"""Checks on a text prompt, shared by the engine and the job's prompt builder (both tokenize
text with the tokenizer's special tokens): each names what is wrong in one line."""

from __future__ import annotations

from typing import Any


def check_unicode(text: str) -> None:
    """ValueError where the text holds a lone surrogate (no tokenizer or file can hold it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("prompt is not valid Unicode (it holds a lone surrogate)") from None


def check_one_bos(tokenizer: Any, text: str, ids: list[int], instead: str) -> None:
    """ValueError where the text begins with the BOS token's text and the tokenizer added its
    own BOS before it (ids: the text's ids with special tokens), so the model would see two.
    instead: what else to pass, named in the message."""
    if two_bos(tokenizer, text, ids):
        raise ValueError(
            f"the prompt text already begins with the BOS token {tokenizer.bos_token}, and the "
            f"tokenizer adds another: remove it from the text, or {instead}"
        )


def two_bos(tokenizer: Any, text: str, ids: list[int]) -> bool:
    """Whether the text begins with the BOS token's text and the tokenizer added its own BOS
    before it (ids: the text's ids with special tokens)."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not isinstance(bos, str) or not bos or bos_id is None or not text.startswith(bos):
        return False
    in_ids = next((i for i, token in enumerate(ids) if token != bos_id), len(ids))
    return in_ids > _leading(text, bos)


def _leading(text: str, piece: str) -> int:
    """How many times text begins with piece, one after another."""
    count = 0
    while text.startswith(piece, count * len(piece)):
        count += 1
    return count
