"""Turning an input row into prompt token ids and per-row sampling overrides."""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from typing import Any, NamedTuple

PROMPT_SOURCES = ("column", "template", "messages_column")
TRUNCATE = ("error", "left", "right")


@dataclass(frozen=True)
class PromptConfig:
    """Where each row's prompt and id come from. Exactly one of column / template /
    messages_column is used; with none given, the text column "prompt" is."""

    column: str | None = None  # a text column used as the prompt
    template: str | None = None  # a format string over columns: "Summarize: {article}"
    messages_column: str | None = None  # chat messages rendered with the tokenizer's template
    system_prompt: str | None = None  # prepended as a system message (chat) or ignored
    id_column: str | None = None  # None = the row's position in the input
    max_new_tokens_column: str | None = None
    temperature_column: str | None = None
    seed_column: str | None = None
    sampling_column: str | None = None  # a column of per-row sampling overrides (dict or JSON)
    passthrough: tuple[str, ...] = field(default=())  # input columns copied to the output
    truncate: str = "error"  # a prompt over the context: error row, or keep the left/right part

    def __post_init__(self) -> None:
        given = [name for name in PROMPT_SOURCES if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"prompt sources {given} are all set: give exactly one of "
                f"{', '.join(PROMPT_SOURCES)}"
            )
        if self.truncate not in TRUNCATE:
            raise ValueError(f"truncate={self.truncate!r} is not allowed: use one of {TRUNCATE}")
        if self.template is not None:
            template_fields(self.template)  # raises ValueError on a malformed template
        object.__setattr__(self, "passthrough", tuple(self.passthrough))

    @property
    def text_column(self) -> str | None:
        if self.template is None and self.messages_column is None:
            return self.column or "prompt"
        return self.column

    def columns_used(self) -> list[str]:
        """Every input column the job reads (checked against the input before model work)."""
        cols = [
            self.sampling_column,
            self.text_column,
            self.messages_column,
            self.id_column,
            self.max_new_tokens_column,
            self.temperature_column,
            self.seed_column,
            *self.passthrough,
        ]
        if self.template is not None:
            cols.extend(template_fields(self.template))
        return list(dict.fromkeys(c for c in cols if c is not None))


def template_fields(template: str) -> list[str]:
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ValueError(f"template {template!r} is malformed: {exc}") from exc
    if any(not n or not n.isidentifier() for n in names):
        raise ValueError(f"template {template!r} must name columns like {{column}}")
    return names


class RowPrompt(NamedTuple):
    """A row made ready for the engine, or the reason it cannot run."""

    index: int
    id: str
    prompt_ids: list[int] | None
    overrides: dict[str, Any]
    passthrough: dict[str, Any]
    error: str | None
    input_hash: str | None = None  # the row's hash, for sources checked row by row on resume


class PromptBuilder:
    """Renders and tokenizes rows; thread-safe (used from the tokenizer pool)."""

    def __init__(
        self, config: PromptConfig, tokenizer: Any, max_prompt_tokens: int, max_new_tokens: int
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens  # the context minus one generated token
        self.max_new_tokens = max_new_tokens

    def build(self, index: int, values: dict[str, Any]) -> RowPrompt:
        cfg = self.config
        row_id = str(index) if cfg.id_column is None else _str_id(values.get(cfg.id_column))
        passthrough = {c: values.get(c) for c in cfg.passthrough}
        try:
            if not row_id:
                raise ValueError(f"id column {cfg.id_column!r} is missing or null")
            overrides = self._overrides(values)
            ids = self._truncate(self._tokenize(values), overrides)
        except ValueError as exc:
            return RowPrompt(index, row_id, None, {}, passthrough, str(exc))
        return RowPrompt(index, row_id, ids, overrides, passthrough, None)

    def _tokenize(self, values: dict[str, Any]) -> list[int]:
        cfg, tok = self.config, self.tokenizer
        if cfg.messages_column is not None:
            messages = _value(values, cfg.messages_column)
            if not isinstance(messages, list) or not messages:
                raise ValueError(
                    f"column {cfg.messages_column!r} must hold a non-empty list "
                    "of {role, content} messages"
                )
            if cfg.system_prompt is not None and messages[0].get("role") != "system":
                messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as exc:  # jinja errors on malformed messages
                raise ValueError(
                    f"chat template failed on column {cfg.messages_column!r}: {exc}"
                ) from exc
            return list(tok(text, add_special_tokens=False).input_ids)
        if cfg.template is not None:
            fields = {name: _value(values, name) for name in template_fields(cfg.template)}
            text = cfg.template.format(**fields)
        else:
            text = _value(values, cfg.text_column)
            if not isinstance(text, str):
                raise ValueError(
                    f"column {cfg.text_column!r} holds {type(text).__name__}, not text"
                )
        if not text:
            raise ValueError("prompt is empty")
        return list(tok(text).input_ids)

    def _overrides(self, values: dict[str, Any]) -> dict[str, Any]:
        cfg = self.config
        columns = {
            "max_new_tokens": cfg.max_new_tokens_column,
            "temperature": cfg.temperature_column,
            "seed": cfg.seed_column,
        }
        out = _sampling_dict(values.get(cfg.sampling_column), cfg.sampling_column)
        picked = {key: values.get(col) for key, col in columns.items() if col is not None}
        out.update({key: value for key, value in picked.items() if value is not None})
        return out

    def _truncate(self, ids: list[int], overrides: dict[str, Any]) -> list[int]:
        mode = self.config.truncate
        if mode == "error" or len(ids) <= self.max_prompt_tokens:
            return ids
        new = overrides.get("max_new_tokens", self.max_new_tokens)
        keep = max(1, self.max_prompt_tokens + 1 - int(new))
        return ids[-keep:] if mode == "left" else ids[:keep]


def _sampling_dict(value: Any, column: str | None) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"column {column!r} is not a JSON object: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"column {column!r} must hold an object of sampling settings")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in value.items() if v is not None}


def _value(values: dict[str, Any], column: str | None) -> Any:
    value = values.get(column) if column is not None else None
    if value is None:
        raise ValueError(f"column {column!r} is missing or null")
    return value


def _str_id(value: Any) -> str:
    return "" if value is None else str(value)
