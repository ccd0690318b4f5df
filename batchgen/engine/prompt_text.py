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


# normalizers that never turn many characters into few (NFC/NFKC compose at most a few into
# one, within the prompt builder's slack); pre-tokenizers that drop no character
_KEEPING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"}


def keeps_every_character(tokenizer: Any) -> bool:
    """Whether every character of a text reaches a token of its own or shares one with its
    neighbours, so a text of N characters has at least N / (longest token) tokens: byte-level
    BPE, BPE or Unigram with byte fallback, under normalizers and pre-tokenizers that drop no
    character. False where that cannot be read (a tokenizer without a Rust backend) or does
    not hold: WordPiece and word-level models (a long word is one unknown token), whitespace
    splitting (spaces dropped), fused unknown tokens, stripping normalizers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return False
    import json

    try:
        spec = json.loads(backend.to_str())
    except (ValueError, TypeError, RuntimeError):
        return False
    normalizers = _parts(spec.get("normalizer"), "normalizers")
    pre_tokenizers = _parts(spec.get("pre_tokenizer"), "pretokenizers")
    if any(not _keeps(n, _KEEPING_NORMALIZERS) for n in normalizers):
        return False
    if any(not _keeps(p, _KEEPING_PRE_TOKENIZERS) for p in pre_tokenizers):
        return False
    model = spec.get("model") or {}
    byte_level = any(p.get("type") == "ByteLevel" for p in pre_tokenizers)
    if model.get("type") == "BPE":
        return bool(byte_level or model.get("byte_fallback") or not model.get("fuse_unk"))
    return model.get("type") == "Unigram" and bool(model.get("byte_fallback") or byte_level)


def _parts(component: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """A tokenizer.json normalizer or pre-tokenizer as its list of steps (a Sequence's)."""
    if not component:
        return []
    if component.get("type") == "Sequence":
        return [step for part in component.get(key) or [] for step in _parts(part, key)]
    return [component]


def _keeps(step: dict[str, Any], keeping: set[str]) -> bool:
    kind = step.get("type")
    if kind == "Replace":  # one character for another (" " -> "▁"), not a pattern or a removal
        pattern = step.get("pattern") or {}
        return len(pattern.get("String") or "") == 1 and bool(step.get("content"))
    if kind == "Split":
        return step.get("behavior") != "Removed"
    return kind in keeping
