"""OpenAI Batch output files from a finished job's committed rows.

Every request lands in exactly one file, in input order (as OpenAI's output and error files):
- results.jsonl: `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"},
  "error": null}`, body a `chat.completion` or `text_completion` whose `choices` are the n
  samples of the request, with `usage`;
- errors.jsonl: `{"id", "custom_id", "response": {"status_code": 400 (404 for a model that is
  not served), "request_id", "body": {"error": {"message", "type", "param", "code", "line"}}},
  "error": null}` for every line that failed (bad JSON, duplicate custom_id, unsupported url,
  unknown body field, bad value, a prompt over the context, ...).
"""

from __future__ import annotations

import codecs
import itertools
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from batchgen.formats.openai_batch.requests import CHAT_URL
from batchgen.io.atomic import write_atomic
from batchgen.io.checkpoint import iter_shard_rows
from batchgen.io.final import write_final
from batchgen.io.layout import OutputLayout, temp_path
from batchgen.token_bytes import TokenBytes, continues_utf8

Row = dict[str, Any]


def write_openai_results(
    layout: OutputLayout,
    shard_format: str,
    model: str,
    results: Path,
    errors: Path,
    tokens: TokenBytes,
) -> tuple[int, int]:
    """Write `results` and `errors` from the committed shards -> (ok lines, error lines).

    model: the name put in a response when the request's body gave none; tokens: the model's
    token bytes (logprobs give each token's bytes, which its decoded text may have lost).
    """
    sorted_rows = temp_path(layout.dir / f"sorted.{shard_format}")
    write_final(layout, shard_format, sorted_rows)
    created = int(time.time())

    def fill(ok_file: IO[bytes], error_file: IO[bytes]) -> tuple[int, int]:
        groups = _groups(iter_shard_rows(sorted_rows))
        return _emit(groups, ok_file, error_file, model, created, tokens)

    try:  # both files atomically: errors first, then results
        return write_atomic(results, lambda ok: write_atomic(errors, lambda bad: fill(ok, bad)))
    finally:
        sorted_rows.unlink(missing_ok=True)


def _groups(rows: Iterator[Row]) -> Iterator[list[Row]]:
    """The rows of one request (its samples), in input order."""
    for _, group in itertools.groupby(rows, key=lambda r: r["index"]):
        yield sorted(group, key=lambda r: r.get("sample_index") or 0)


def _emit(
    groups: Iterator[list[Row]],
    ok_file: IO[bytes],
    error_file: IO[bytes],
    model: str,
    created: int,
    tokens: TokenBytes,
) -> tuple[int, int]:
    seen: set[str] = set()  # custom_ids so far: a later line with one is the duplicate
    counts = [0, 0]
    for rows in groups:
        custom_id = rows[0]["id"] or None
        duplicate = custom_id in seen
        if custom_id is not None:
            seen.add(custom_id)
        failed = next((r for r in rows if r["error"] is not None), None)
        if failed is None:
            line, target, slot = _success(rows, custom_id, model, created, tokens), ok_file, 0
        else:
            line, target, slot = _failure(failed, custom_id, duplicate), error_file, 1
        text = json.dumps(line, ensure_ascii=False, allow_nan=False)  # only standard JSON
        target.write((text + "\n").encode("utf-8"))
        counts[slot] += 1
    return counts[0], counts[1]


STATUS = {"model_not_found": 404}  # error code -> HTTP status; any other: 400


def line_error(row: Row, custom_id: str | None, duplicate: bool) -> Row:
    """The error object of a failed line (`batchgen validate` counts the same): row holds
    `error` (the message) and the pass-through `error_code`, `error_param` and `line`; a
    duplicated custom_id is the line's error, whatever else is wrong with it."""
    error = {
        "message": row["error"],
        "type": "invalid_request_error",
        "param": row.get("error_param"),
        "code": row.get("error_code") or "invalid_request",
        "line": row.get("line"),
    }
    if duplicate:
        message = f"custom_id {custom_id!r} is used by an earlier line: make custom_ids unique"
        error.update(code="duplicate_custom_id", message=message, param="custom_id")
    return error


def _failure(row: Row, custom_id: str | None, duplicate: bool) -> Row:
    error = line_error(row, custom_id, duplicate)
    index = row["index"]
    response = {
        "status_code": STATUS.get(error["code"], 400),
        "request_id": f"req_{index}",
        "body": {"error": error},
    }
    return {"id": f"batch_req_{index}", "custom_id": custom_id, "response": response, "error": None}


def _success(
    rows: list[Row], custom_id: str | None, model: str, created: int, tokens: TokenBytes
) -> Row:
    first = rows[0]
    index, chat = first["index"], first.get("url") == CHAT_URL
    prompt_tokens = first["num_prompt_tokens"]
    completion_tokens = sum(r["num_generated_tokens"] for r in rows)
    choices = [_chat_choice(r, tokens) if chat else _text_choice(r, tokens) for r in rows]
    body: Row = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{index}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": first.get("model") or model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    if first.get("prompt_token_ids") is not None:  # output.include_token_ids: as vLLM's
        _add_token_ids(body, rows, chat)
    response = {"status_code": 200, "request_id": f"req_{index}", "body": body}
    return {"id": f"batch_req_{index}", "custom_id": custom_id, "response": response, "error": None}


def _add_token_ids(body: Row, rows: list[Row], chat: bool) -> None:
    """The token ids as vLLM's return_token_ids gives them: a chat completion's prompt ids in
    the body, a text completion's in each choice; each choice's generated ids (`token_ids`)."""
    prompt_ids = rows[0]["prompt_token_ids"]
    if chat:
        body["prompt_token_ids"] = prompt_ids
    for choice, row in zip(body["choices"], rows, strict=True):
        if not chat:
            choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = row["token_ids"]


def _chat_choice(row: Row, tokens: TokenBytes) -> Row:
    logprobs = None
    if row.get("logprobs") is not None:
        content = [
            {
                **_chat_logprob(lp, tokens),
                "top_logprobs": [_chat_logprob(t, tokens) for t in lp["top_logprobs"]],
            }
            for lp in row["logprobs"]
        ]
        logprobs = {"content": content, "refusal": None}
    return {
        "index": row.get("sample_index") or 0,
        "message": {"role": "assistant", "content": row["text"], "refusal": None},
        "logprobs": logprobs,
        "finish_reason": row["finish_reason"],
    }


def _chat_logprob(entry: Row, tokens: TokenBytes) -> Row:
    token_id = entry["token_id"]
    own = tokens(token_id)
    return {"token": tokens.text(token_id), "logprob": _logprob(entry), "bytes": list(own)}


def _text_choice(row: Row, tokens: TokenBytes) -> Row:
    logprobs = None
    if row.get("logprobs") is not None:
        entries = row["logprobs"]
        logprobs = {
            "tokens": [tokens.text(lp["token_id"]) for lp in entries],
            "token_logprobs": [_logprob(lp) for lp in entries],
            "top_logprobs": [_top_logprobs(lp, tokens) for lp in entries],
            "text_offset": _text_offsets([lp["token_id"] for lp in entries], tokens),
        }
    return {
        "index": row.get("sample_index") or 0,
        "text": row["text"],
        "logprobs": logprobs,
        "finish_reason": row["finish_reason"],
    }


def _top_logprobs(position: Row, tokens: TokenBytes) -> dict[str, float]:
    """One position's top logprobs keyed by token text, as the completions format keys them:
    the sampled token first, then the top k without it (up to k + 1 entries, as OpenAI's API
    and vLLM give them). Two tokens can show the same text (a byte-fallback `<0x41>` and the
    piece `A`): the later one is then keyed `token_id:N`, as vLLM's
    --return-tokens-as-token-ids keys tokens, so that no entry is lost and the sampled token
    keeps its text."""
    sampled = position["token_id"]
    top = [e for e in position["top_logprobs"] if e["token_id"] != sampled]
    out: dict[str, float] = {}
    for entry in ({"token_id": sampled, "logprob": position["logprob"]}, *top):
        key = tokens.text(entry["token_id"])
        if key in out:
            key = f"token_id:{entry['token_id']}"
        if key in out:
            raise RuntimeError(f"two top logprobs entries for token {key!r}")
        out[key] = _logprob(entry)
    return out


LOWEST_LOGPROB = -9999.0  # what OpenAI's API and vLLM write for -inf


def _logprob(entry: Row) -> float:
    """An entry's logprob as a JSON number: -inf (and null, which is how JSON Lines shards
    keep -inf and NaN) as LOWEST_LOGPROB, as vLLM writes it; JSON has no infinity."""
    value = entry["logprob"]
    if value is None or math.isnan(value):
        return LOWEST_LOGPROB
    return max(float(value), LOWEST_LOGPROB)


def _text_offsets(token_ids: list[int], tokens: TokenBytes) -> list[int]:
    """Where each token's text starts in the choice's text (0 for the first token: the prompt
    is not echoed): the characters its earlier tokens' bytes decode to, special tokens adding
    none (the text leaves them out); a token that ends a character another began starts at
    that character."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    offsets, length = [], 0
    for token_id in token_ids:
        data = b"" if token_id in tokens.special else tokens(token_id)
        pending = decoder.getstate()[0]  # an earlier token's unfinished character
        if pending and data and not continues_utf8(pending, data[:1]):
            # it never finishes: its replacement character is the earlier token's text
            length += len(decoder.decode(b"", final=True))
            decoder.reset()
        offsets.append(length)
        length += len(decoder.decode(data))
    return offsets
