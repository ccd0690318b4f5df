"""Output text: the text of output tokens as they read after the prompt.

A tokenizer's decode treats its tokens as the whole text, and some cut what only the start of a
text may lose: Llama 2's, Mistral's and other SentencePiece tokenizers strip the leading space
of the first piece ("▁yes" alone decodes to "yes"). An output is not the start of its text, so
its tokens are decoded behind the prompt's last tokens and the prompt's own text is cut off (as
vLLM's detokenizer does): "▁yes" after a prompt reads " yes", the text its grammar, its stop
strings and its logprob tokens saw. Every output text (rows, stop strings, structured-output
checks, `Engine.generate`) is decoded here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchgen.token_bytes import continues_utf8, token_bytes_of, unfinished_utf8

CONTEXT_TOKENS = 5  # tokens decoded before an output (vLLM's detokenizer starts with 5)

TextIds = tuple[Sequence[int], Sequence[int]]  # (the tokens before, the output's tokens)


def output_text(tokenizer: Any, before: Sequence[int], ids: Sequence[int]) -> str:
    """The text of `ids` as it reads after the tokens `before` (only their last
    CONTEXT_TOKENS matter), special tokens left out. A context whose text ends in U+FFFD is
    used only where its bytes are whole UTF-8 (the prompt's own U+FFFD): one that ends inside
    a character the output does not go on with (a prompt cut inside it) loses the tokens of
    that unfinished character from its end; one whose first tokens are the last bytes of a
    character (byte pieces: a run of them that is not whole UTF-8 decodes as U+FFFD each) is
    shortened from its start until its text is whole. Where no context's text is a prefix of
    the joint text (bytes of one character split across the two), `ids` alone are decoded."""
    context = _without_unfinished_end(tokenizer, list(before[-CONTEXT_TOKENS:]), ids)
    for start in range(len(context)):
        head = tokenizer.decode(context[start:], skip_special_tokens=True)
        if head.endswith("\ufffd") and not _whole_utf8(tokenizer, context[start:]):
            continue
        joint = tokenizer.decode(context[start:] + list(ids), skip_special_tokens=True)
        if joint.startswith(head):
            return joint[len(head) :]
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def _without_unfinished_end(tokenizer: Any, context: list[int], ids: Sequence[int]) -> list[int]:
    """context without the tokens at its end that hold a character it begins and does not
    finish, where the output's first bytes do not go on with it: that character is the
    prompt's (a U+FFFD of its text), and a context ending in it has no whole text to cut off."""
    token_bytes = token_bytes_of(tokenizer)
    data = b"".join(token_bytes(i) for i in context if i not in token_bytes.special)
    pending = unfinished_utf8(data)
    first = next((token_bytes(i) for i in ids if i not in token_bytes.special), b"")
    if not pending or (first and continues_utf8(pending, first[:1])):
        return context
    left = len(pending)  # bytes still to drop, from the end
    while left > 0 and context:
        token = context.pop()
        if token not in token_bytes.special:
            left -= len(token_bytes(token))
    return context


def _whole_utf8(tokenizer: Any, ids: Sequence[int]) -> bool:
    """Whether the bytes of `ids` (special tokens left out) are whole UTF-8 characters."""
    token_bytes = token_bytes_of(tokenizer)
    data = b"".join(token_bytes(i) for i in ids if i not in token_bytes.special)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def output_texts(tokenizer: Any, items: Sequence[TextIds]) -> list[str]:
    """output_text of each (before, ids)."""
    return [output_text(tokenizer, before, ids) for before, ids in items]
