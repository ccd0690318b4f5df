"""Stop strings: matched on the detokenized text, also when they span tokens."""

from __future__ import annotations

from typing import Any

from batchgen.engine.request import Request

BYTES_PER_CHAR = 4  # a byte-level token may hold a single byte of a UTF-8 character


def check_stop_strings(request: Request, tokenizer: Any) -> str | None:
    """After a token was appended: the output text cut at the first stop string, or None.

    Only the tail that the newest token can have completed a match in is decoded each step;
    the full text is decoded once, when a match is found.
    """
    params = request.params
    if not params.stop or len(request.output_token_ids) < params.min_new_tokens:
        return None
    longest = max(len(s) for s in params.stop)
    tail_ids = request.output_token_ids[-(BYTES_PER_CHAR * longest + 2) :]
    tail = tokenizer.decode(tail_ids, skip_special_tokens=True)
    if not any(s in tail for s in params.stop):
        return None
    text = tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
    position, stop = min((text.find(s), s) for s in params.stop if s in text)
    end = position + len(stop) if params.include_stop_str_in_output else position
    return text[:end]
