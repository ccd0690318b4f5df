"""OpenAI Batch request lines -> row values (or the reason a line cannot run).

A line is `{"custom_id", "method": "POST", "url", "body"}` with url /v1/chat/completions (body
has `messages`) or /v1/completions (body has `prompt`). Files written for OpenAI or vLLM run
unchanged: OpenAI's and vLLM's sampling fields map onto SamplingParams, fields that change
nothing here are accepted, and a field whose value batchgen cannot honour makes the line an
error line naming it. Where the body gives no value, the job's [sampling] value applies; for
what neither gives, OpenAI's defaults (temperature 1, top_p 1, n 1, no penalties, no stop
strings: put into the job's sampling when its spec is read) and otherwise batchgen's.
"""

from __future__ import annotations

import json
import re
from typing import Any

from batchgen.engine.sampling_params import MAX_TOKENS, SamplingParams
from batchgen.prompts import CHAT_OPTIONS, ChatOptionError, ChatOptions, chat_message

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
LINE_KEYS = ("custom_id", "method", "url", "body")
ID_COLUMN = "custom_id"
SAMPLING_COLUMN = "sampling"
# copied into every output row: what the final OpenAI lines need beyond the generation
PASSTHROUGH_TYPES = {"url": "string", "model": "string", "line": "int64"} | dict.fromkeys(
    ("error_code", "error_param"), "string"
)  # Arrow type names
PASSTHROUGH = tuple(PASSTHROUGH_TYPES)
# SamplingParams field -> the body field of the line that gave it, named in the line's errors
FIELDS_COLUMN = "body_fields"
CHAT_OPTIONS_COLUMN = "chat_options"  # a chat line's own ChatOptions values (vLLM's fields)
MESSAGES = "messages"  # a chat line's messages, as the body names them
COLUMNS = (ID_COLUMN, MESSAGES, "prompt", SAMPLING_COLUMN, FIELDS_COLUMN, "error_message")
COLUMNS += (CHAT_OPTIONS_COLUMN,)
COLUMNS += PASSTHROUGH

# body field -> SamplingParams field, where the meaning is the same (OpenAI's, then vLLM's)
SAMPLING_FIELDS = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "n": "n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "top_k": "top_k",
    "min_p": "min_p",
    "min_tokens": "min_new_tokens",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
}
# the job's sampling for OpenAI Batch input, where the job's [sampling] does not say
OPENAI_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "stop": (),
}
# fields that change nothing here -> the values that keep it so (None = any value)
HARMLESS: dict[str, tuple[Any, ...] | None] = {
    "user": None,
    "metadata": None,
    "store": None,
    "service_tier": None,
    "safety_identifier": None,
    "prompt_cache_key": None,
    "parallel_tool_calls": None,  # there are no tools to call
    "stream": (False,),
    "stream_options": None,  # only read when streaming
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
}
GUIDED = ("guided_json", "guided_regex", "guided_choice")  # vLLM's structured outputs
LOGPROB_FIELDS = ("logprobs", "top_logprobs")
RESPONSE_FORMAT = "response_format"  # text, json_object or json_schema (structured outputs)
CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}
CHAT_ONLY |= set(CHAT_OPTIONS)  # vLLM's: how the messages are rendered
CHAT_ONLY |= {"functions", "function_call", "response_format", "modalities"}
CHAT_ONLY |= {"parallel_tool_calls", "store", "metadata", "service_tier"}
COMPLETIONS_ONLY = {"prompt", "echo", "suffix", "best_of"}


class RequestError(Exception):
    """Why a line cannot run: an OpenAI-style error code, a message and the parameter."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def parse_request(obj: dict[str, Any] | None, error: str | None, line: int) -> dict[str, Any]:
    """One parsed JSON line (or the reader's error for it) -> the row's values (COLUMNS)."""
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row["line"] = line
    try:
        if obj is None:
            raise RequestError("invalid_json_line", error or "not a JSON object")
        row[ID_COLUMN] = _custom_id(obj)
        row["url"] = _envelope(obj)
        row.update(_body(row["url"], obj["body"]))
    except RequestError as exc:
        row.update(error_code=exc.code, error_message=exc.message, error_param=exc.param)
    return row


def _custom_id(obj: dict[str, Any]) -> str:
    value = obj.get("custom_id")
    if value is None:
        raise RequestError("missing_required_parameter", "custom_id is missing", "custom_id")
    if not isinstance(value, str) or not value:
        raise RequestError(
            "invalid_value", f"custom_id={value!r} must be a non-empty string", "custom_id"
        )
    return value


def _envelope(obj: dict[str, Any]) -> str:
    """Check method, url and the line's keys -> the url."""
    unknown = sorted(set(obj) - set(LINE_KEYS))
    if unknown:
        raise RequestError(
            "unknown_parameter",
            f"unknown key {unknown[0]!r} in the line: a line has {', '.join(LINE_KEYS)}",
            unknown[0],
        )
    if obj.get("method") != "POST":
        raise RequestError(
            "invalid_method", f"method={obj.get('method')!r} is not supported: use POST", "method"
        )
    url = obj.get("url")
    if url not in URLS:
        raise RequestError(
            "invalid_url",
            f"url={url!r} is not supported: use {CHAT_URL} or {COMPLETIONS_URL}",
            "url",
        )
    if not isinstance(obj.get("body"), dict):
        raise RequestError("missing_required_parameter", "body must be a JSON object", "body")
    return url


def _body(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request body -> messages or prompt, model and sampling overrides."""
    wrong = CHAT_ONLY if url == COMPLETIONS_URL else COMPLETIONS_ONLY
    for field, value in body.items():
        known = field in SAMPLING_FIELDS or field in HARMLESS or field in LOGPROB_FIELDS
        known = known or field == RESPONSE_FORMAT or field in CHAT_OPTIONS
        if field in wrong or not (known or field in ("model", "messages", "prompt")):
            raise RequestError(
                "unknown_parameter", f"unknown or unsupported body field {field!r} for {url}", field
            )
        allowed = HARMLESS.get(field)
        if field in HARMLESS and allowed is not None and value is not None and value not in allowed:
            raise RequestError(
                "unsupported_value",
                f"{field}={value!r} is not supported by batchgen (it accepts "
                f"{' or '.join(repr(a) for a in allowed)})",
                field,
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("invalid_value", f"model={model!r} must be a string", "model")
    sampling, fields = _sampling(url, body)
    out: dict[str, Any] = {"model": model, SAMPLING_COLUMN: sampling, FIELDS_COLUMN: fields}
    if url == CHAT_URL:
        out[MESSAGES] = _messages(body.get(MESSAGES))
        out[CHAT_OPTIONS_COLUMN] = _chat_options(body)
    else:
        out["prompt"] = _prompt(body.get("prompt"))
    return out


def _sampling(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Body fields -> (SamplingParams overrides of the job's sampling, each checked (param =
    the body field); the body field each override came from)."""
    given = {k: v for k, v in body.items() if v is not None}
    if "max_tokens" in given and "max_completion_tokens" in given:
        raise RequestError(
            "invalid_value", "give max_tokens or max_completion_tokens, not both", "max_tokens"
        )
    if isinstance(given.get("stop"), str):
        given["stop"] = [given["stop"]]
    _check_constraints(given)
    out: dict[str, Any] = {}
    source: dict[str, str] = {}  # SamplingParams field -> the body field it came from
    for key, value in given.items():
        if key in SAMPLING_FIELDS:
            field = SAMPLING_FIELDS[key]
            out[field] = tuple(value) if isinstance(value, list) else value
            source[field] = key
    if "logprobs" in given:  # chat's `logprobs: false` is None: off, whatever the job's
        out["logprobs"] = _logprobs(url, given)
        source["logprobs"] = "top_logprobs" if "top_logprobs" in given else "logprobs"
    elif "top_logprobs" in given:
        _logprobs(url, given)  # refused: it needs logprobs: true
    if RESPONSE_FORMAT in given:
        field, value = _response_format(given[RESPONSE_FORMAT])
        out[field] = value
        source[field] = RESPONSE_FORMAT
    for field, key in source.items():
        if out[field] is not None:
            _check_value(key, field, out[field])
    return out, source


def _check_constraints(given: dict[str, Any]) -> None:
    """At most one structured output constraint (none may silently win over another), and no
    empty one (an empty choice would constrain nothing)."""
    named = [key for key in GUIDED if key in given]
    kind = given.get(RESPONSE_FORMAT)
    if not (isinstance(kind, dict) and kind.get("type") == "text") and RESPONSE_FORMAT in given:
        named.append(RESPONSE_FORMAT)
    if len(named) > 1:
        raise RequestError(
            "invalid_value",
            f"{named[0]} and {named[1]} are both given: a request takes at most one structured "
            f"output constraint ({', '.join(GUIDED)} or a {RESPONSE_FORMAT} of type "
            "json_object or json_schema)",
            named[1],
        )
    if given.get("guided_choice") == []:
        raise RequestError(
            "invalid_value",
            "guided_choice=[] constrains nothing: give at least one string, or leave it out",
            "guided_choice",
        )


def _response_format(value: Any) -> tuple[str, Any]:
    """{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}} ->
    (SamplingParams field, value); text is json_object off (free text, whatever the job's
    structured setting)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return "json_object", False
    if kind == "json_object":
        return "json_object", True
    if kind == "json_schema":
        schema = value.get("json_schema")
        schema = schema.get("schema") if isinstance(schema, dict) else None
        if not isinstance(schema, dict):
            raise RequestError(
                "invalid_value",
                "response_format json_schema needs json_schema.schema, a JSON schema object",
                RESPONSE_FORMAT,
            )
        return "json_schema", schema
    raise RequestError(
        "invalid_value",
        f"{RESPONSE_FORMAT}={value!r} must have type text, json_object or json_schema",
        RESPONSE_FORMAT,
    )


def _logprobs(url: str, body: dict[str, Any]) -> int | None:
    """Chat: logprobs (bool) + top_logprobs (int); completions: logprobs (int)."""
    value = body.get("logprobs")
    if url == COMPLETIONS_URL:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise RequestError(
                "invalid_value", f"logprobs={value!r} must be an integer", "logprobs"
            )
        return value
    if value is not None and not isinstance(value, bool):
        raise RequestError("invalid_value", f"logprobs={value!r} must be true or false", "logprobs")
    top = body.get("top_logprobs")
    if top is not None and not value:
        raise RequestError("invalid_value", "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if value else None


def field_pattern(field: str) -> str:
    """field as a word of its own, not part of a dotted key (the job's sampling.max_new_tokens)."""
    return rf"(?<![\w.]){re.escape(field)}(?!\w)"


def in_body_terms(message: str, names: dict[str, str]) -> str:
    """message with each SamplingParams field of names (field -> the body field it came
    from) named by its body field."""
    for field, key in names.items():
        message = re.sub(field_pattern(field), key, message)
    return message


def _check_value(key: str, field: str, value: Any) -> None:
    """One field's value alone; rules between fields (min_tokens <= max_tokens) are checked
    where the line's values meet the job's (prompts.PromptBuilder)."""
    alone = {field: value}
    if field == "min_new_tokens":
        alone["max_new_tokens"] = MAX_TOKENS
    try:
        SamplingParams(**alone)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        if isinstance(value, tuple):  # the line gave a list: written as JSON writes it
            message = message.replace(f"{field}={value!r}", f"{field}={json.dumps(list(value))}")
        raise RequestError("invalid_value", in_body_terms(message, {field: key}), key) from exc


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RequestError(
            "missing_required_parameter", "messages must be a non-empty list", "messages"
        )
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError("invalid_value", "each message needs a role", "messages")
        try:
            out.append(chat_message(message))
        except ValueError as exc:
            raise RequestError("invalid_value", f"message {i}: {exc}", "messages") from exc
    return out


def _chat_options(body: dict[str, Any]) -> dict[str, Any] | None:
    """A chat line's own rendering options (None: the job's), checked as vLLM checks them:
    continue_final_message needs add_generation_prompt: false."""
    given = {k: body[k] for k in CHAT_OPTIONS if body.get(k) is not None}
    if not given:
        return None
    try:
        ChatOptions(**given).checked()
    except ChatOptionError as exc:
        raise RequestError("invalid_value", str(exc), exc.field) from exc
    return given


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or not value:
        raise RequestError(
            "invalid_value" if value is not None else "missing_required_parameter",
            "prompt must be one non-empty string",
            "prompt",
        )
    return value
