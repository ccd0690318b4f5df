"""OpenAI Batch input files: each JSON line -> row values for the job (or the reason it fails).

A line is `{"custom_id", "method": "POST", "url", "body"}` with url /v1/chat/completions (body
has `messages`) or /v1/completions (body has `prompt`). Body fields map onto SamplingParams and
travel in the row's "sampling" column; a field the body does not give keeps the job's
[sampling] value. A line that cannot run keeps its custom_id and an error code, and becomes an
error line of the output (see openai_results.py); nothing is dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from batchgen.engine.sampling_params import SamplingParams
from batchgen.errors import BatchgenError
from batchgen.prompts import PromptBuilder, PromptConfig, RowPrompt, writable

OPENAI_BATCH = "openai-batch"  # the input format name
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
LINE_KEYS = ("custom_id", "method", "url", "body")
ID_COLUMN = "custom_id"
SAMPLING_COLUMN = "sampling"
# copied into every output row: what the final OpenAI lines need beyond the generation
PASSTHROUGH = ("url", "model", "line", "error_code", "error_param")
PASSTHROUGH_TYPES = {"url": "string", "model": "string", "line": "int64"} | dict.fromkeys(
    ("error_code", "error_param"), "string"
)  # Arrow type names of the pass-through columns
COLUMNS = (ID_COLUMN, "messages", "prompt", SAMPLING_COLUMN, "error_message", *PASSTHROUGH)
# body field -> SamplingParams field, where the meaning is the same
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
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "logprobs"}
BODY_FIELDS = {
    CHAT_URL: _COMMON
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
    },
    COMPLETIONS_URL: _COMMON | {"prompt", "presence_penalty", "frequency_penalty"},
}
PROMPT_KEYS = ("system_prompt", "truncate")  # the [prompt] keys that apply to these files


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
    if url not in BODY_FIELDS:
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
    unknown = sorted(set(body) - BODY_FIELDS[url])
    if unknown:
        raise RequestError(
            "unknown_parameter",
            f"unknown or unsupported body field {unknown[0]!r} for {url}: "
            f"supported are {', '.join(sorted(BODY_FIELDS[url]))}",
            unknown[0],
        )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("invalid_value", f"model={model!r} must be a string", "model")
    out: dict[str, Any] = {"model": model, SAMPLING_COLUMN: _sampling(url, body)}
    if url == CHAT_URL:
        out["messages"] = _messages(body.get("messages"))
    else:
        out["prompt"] = _prompt(body.get("prompt"))
    return out


def _sampling(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Body fields -> SamplingParams overrides, each checked (param = the body field)."""
    given = {k: v for k, v in body.items() if v is not None}
    if "max_tokens" in given and "max_completion_tokens" in given:
        raise RequestError(
            "invalid_value", "give max_tokens or max_completion_tokens, not both", "max_tokens"
        )
    if not isinstance(given.get("stop", ""), (str, list)):
        raise RequestError("invalid_value", "stop must be a string or a list of strings", "stop")
    if isinstance(given.get("stop"), str):
        given["stop"] = [given["stop"]]
    out: dict[str, Any] = {}
    source: dict[str, str] = {}  # SamplingParams field -> the body field it came from
    for key, value in given.items():
        if key in SAMPLING_FIELDS:
            field = SAMPLING_FIELDS[key]
            out[field] = tuple(value) if isinstance(value, list) else value
            source[field] = key
    logprobs = _logprobs(url, given)
    if logprobs is not None:
        out["logprobs"] = logprobs
        source["logprobs"] = "top_logprobs" if "top_logprobs" in given else "logprobs"
    for field, value in out.items():
        _check_value(source[field], field, value)
    return out


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


def _check_value(key: str, field: str, value: Any) -> None:
    try:
        SamplingParams(**{field: value})
    except (ValueError, TypeError) as exc:
        message = str(exc) if key == field else f"{key}: {exc}"
        raise RequestError("invalid_value", message, key) from exc


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RequestError(
            "missing_required_parameter", "messages must be a non-empty list", "messages"
        )
    out = []
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError("invalid_value", "each message needs a role", "messages")
        out.append({**message, "content": _content(message.get("content"))})
    return out


def _content(value: Any) -> str:
    """A message's content: text, or a list of text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in value
    ):
        return "".join(p["text"] for p in value)
    raise RequestError(
        "invalid_value", "message content must be text or a list of text parts", "messages"
    )


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


def check_prompt_config(config: PromptConfig) -> None:
    """Only system_prompt and truncate apply: each line's body says where its prompt is."""
    default = PromptConfig()
    for field in dataclasses.fields(config):
        if field.name in PROMPT_KEYS:
            continue
        if getattr(config, field.name) != getattr(default, field.name):
            raise BatchgenError(
                f"[prompt] {field.name} does not apply to {OPENAI_BATCH} input (each line's "
                f"body holds its prompt): remove it; only {' and '.join(PROMPT_KEYS)} apply"
            )


class RequestBuilder:
    """PromptBuilder for parsed OpenAI lines: chat bodies through the chat template,
    completion prompts as text; a line that failed to parse becomes an error row."""

    def __init__(
        self,
        config: PromptConfig,
        tokenizer: Any,
        max_prompt_tokens: int,
        sampling: SamplingParams,
        served_names: tuple[str, ...],
    ) -> None:
        self.served_names = served_names  # body.model must be one of these (or absent)
        common = {
            "id_column": ID_COLUMN,
            "sampling_column": SAMPLING_COLUMN,
            "passthrough": PASSTHROUGH,
            "system_prompt": config.system_prompt,
            "truncate": config.truncate,
        }
        args = (tokenizer, max_prompt_tokens, sampling)
        self.chat = PromptBuilder(PromptConfig(messages_column="messages", **common), *args)
        self.text = PromptBuilder(PromptConfig(column="prompt", **common), *args)

    def build(self, index: int, values: dict[str, Any]) -> RowPrompt:
        model = values.get("model")
        if (
            values.get("error_code") is None
            and model is not None
            and model not in self.served_names
        ):
            values = {
                **values,
                "error_code": "model_not_found",
                "error_param": "model",
                "error_message": (
                    f"the model {model!r} does not exist here: this job serves "
                    f"{', '.join(map(repr, self.served_names))} (declare other names with "
                    "model.served_model_name)"
                ),
            }
        if values.get("error_code") is not None:
            passthrough = {c: _writable_value(values.get(c)) for c in PASSTHROUGH}
            row_id = writable(values.get(ID_COLUMN) or "")
            message = writable(values["error_message"])
            return RowPrompt(index, row_id, None, {}, passthrough, message)
        builder = self.chat if values.get("messages") is not None else self.text
        return builder.build(index, values)


def _writable_value(value: Any) -> Any:
    return writable(value) if isinstance(value, str) else value
