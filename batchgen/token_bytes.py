"""A token's own bytes: what it adds to the text, for OpenAI-style logprobs (`bytes`, and a
`token` string that can show them).

Decoding one token alone loses bytes: a byte-level BPE token (GPT-2, Llama 3, Qwen) or a
byte-fallback token (`<0xE2>`, Llama 2, Mistral) may hold part of a UTF-8 character, which
decodes to U+FFFD. The bytes are read off the token's vocabulary entry instead, as its
tokenizer's decoder would turn it into bytes: byte-level entries through GPT-2's byte table,
byte-fallback entries as the byte they name, word-piece markers (`▁`) as the text they stand
for. A special token is its own string (`</s>`, `<|eot_id|>`), as vLLM shows it, although the
text leaves it out: tokens that add nothing would all show as the same empty string. Any other
tokenizer's tokens are decoded alone.
"""

from __future__ import annotations

import codecs
import json
import re
import weakref
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character a byte-level vocabulary writes for
    each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return {c: b for b, c in chars.items()}


BYTE_LEVEL = _byte_level_table()


_KEPT: weakref.WeakKeyDictionary[Any, TokenBytes] = weakref.WeakKeyDictionary()


def token_bytes_of(tokenizer: Any) -> TokenBytes:
    """The tokenizer's TokenBytes, kept per tokenizer where it can be (its caches fill once)."""
    try:
        found = _KEPT.get(tokenizer)
    except TypeError:  # neither hashable nor weakly referable: not kept
        return TokenBytes(tokenizer)
    if found is None:
        found = _KEPT[tokenizer] = TokenBytes(tokenizer)
    return found


def unfinished_utf8(data: bytes) -> bytes:
    """The bytes at the end of data that begin a UTF-8 character and do not finish it."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data)
    return decoder.getstate()[0]


def continues_utf8(pending: bytes, first: bytes) -> bool:
    """Whether `first` goes on with the unfinished UTF-8 character `pending`."""
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(pending + first)
    except UnicodeDecodeError:
        return False
    return True


class TokenBytes:
    """token id -> its bytes, for one tokenizer (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        flagged = (i for i, token in added.items() if getattr(token, "special", False))
        # the tokens a decode that skips special tokens leaves out
        self.special = frozenset((*tokenizer.all_special_ids, *flagged))
        self.added = {i: t.content for i, t in added.items() if i not in self.special}
        steps = _decoder_steps(tokenizer)
        kinds = {step.get("type") for step in steps}
        self.byte_level = "ByteLevel" in kinds
        self.byte_fallback = "ByteFallback" in kinds
        self.replace = [
            (step["pattern"]["String"], step["content"])
            for step in steps
            if step.get("type") == "Replace" and "String" in (step.get("pattern") or {})
        ] + [(step["replacement"], " ") for step in steps if step.get("type") == "Metaspace"]
        self._bytes_of: dict[int, bytes] = {}
        self._text_of: dict[int, str] = {}

    def __call__(self, token_id: int) -> bytes:
        out = self._bytes_of.get(token_id)
        if out is None:
            out = self._bytes_of[token_id] = self._bytes(token_id)
        return out

    def text(self, token_id: int) -> str:
        """The token as a string: its text, with bytes that are not (yet) a whole UTF-8
        character written as \\xNN escapes (as OpenAI's API writes them)."""
        out = self._text_of.get(token_id)
        if out is None:
            out = self._text_of[token_id] = self(token_id).decode("utf-8", "backslashreplace")
        return out

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.special:  # as vLLM decodes it
            return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self.byte_level and all(c in BYTE_LEVEL for c in piece):
                return bytes(BYTE_LEVEL[c] for c in piece)
            if self.byte_fallback and (match := _BYTE_FALLBACK.fullmatch(piece)):
                return bytes([int(match[1], 16)])
            if self.replace and not self.byte_level:
                for pattern, content in self.replace:
                    piece = piece.replace(pattern, content)
                return piece.encode("utf-8")
        return self.tokenizer.decode([token_id], skip_special_tokens=True).encode("utf-8")


def _decoder_steps(tokenizer: Any) -> list[dict[str, Any]]:
    """The decoder steps of a fast tokenizer (a Sequence flattened); [] for any other."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return []
    try:
        decoder = json.loads(decoder.__getstate__())
    except (ValueError, TypeError, AttributeError):
        return []
    steps, todo = [], [decoder]
    while todo:
        step = todo.pop(0)
        if isinstance(step, dict):
            if step.get("type") == "Sequence":
                todo[:0] = step.get("decoders") or []
            else:
                steps.append(step)
    return steps
