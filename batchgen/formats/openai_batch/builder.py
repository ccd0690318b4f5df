"""Parsed OpenAI Batch lines -> prompts: chat bodies through the chat template, completion
prompts as text; a line that failed to parse, or names a model this job does not serve, becomes
an error row that keeps its custom_id and error code."""

from __future__ import annotations

import re
from typing import Any

from batchgen.engine.model_path import prompt_over_context
from batchgen.engine.sampling_params import STRUCTURED, SamplingParams
from batchgen.formats.openai_batch.requests import (
    CHAT_OPTIONS_COLUMN,
    FIELDS_COLUMN,
    ID_COLUMN,
    MESSAGES,
    PASSTHROUGH,
    SAMPLING_COLUMN,
    field_pattern,
    in_body_terms,
)
from batchgen.prompts import PromptBuilder, PromptConfig, RowPrompt, writable

# the [prompt] keys that apply to these files (chat_template_kwargs: the default of chat lines,
# whose own keys win)
PROMPT_KEYS = ("system_prompt", "truncate", "chat_template_kwargs")


class RequestBuilder:
    def __init__(
        self,
        config: PromptConfig,
        tokenizer: Any,
        max_prompt_tokens: int,
        sampling: SamplingParams,
        served_names: tuple[str, ...],
    ) -> None:
        self.served_names = served_names  # body.model must be one of these (or absent)
        self.context = max_prompt_tokens + 1  # max_model_len
        common = {
            "id_column": ID_COLUMN,
            "sampling_column": SAMPLING_COLUMN,
            "passthrough": PASSTHROUGH,
            "truncate": config.truncate,
        }
        # a line's own response_format (or guided_*) replaces the job's structured setting,
        # which is only the default for lines that give none (_prepare)
        off = {field: getattr(SamplingParams(), field) for field in STRUCTURED}
        self.job_format = {
            k: getattr(sampling, k) for k in STRUCTURED if getattr(sampling, k) != off[k]
        }
        self.job_off = {k: off[k] for k in self.job_format}  # the job's setting, turned off
        args = (tokenizer, max_prompt_tokens, sampling.replace(**off))
        self.system_prompt = config.system_prompt  # chat requests only: a completion is refused
        chat = PromptConfig(
            messages_column=MESSAGES,
            system_prompt=self.system_prompt,
            chat_template_kwargs=config.chat_template_kwargs,
            **common,
        )
        self.chat = PromptBuilder(chat, *args, chat_options_column=CHAT_OPTIONS_COLUMN)
        self.text = PromptBuilder(PromptConfig(column="prompt", **common), *args)

    def build(self, index: int, values: dict[str, Any]) -> RowPrompt:
        return self.build_many([(index, values)])[0]

    def build_many(self, rows: list[tuple[int, dict[str, Any]]]) -> list[RowPrompt]:
        """Error lines as error rows; chat and completion bodies each tokenized in a batch."""
        prepared = [self._prepare(values) for _, values in rows]
        rows = [(index, values) for (index, _), (values, _) in zip(rows, prepared, strict=True)]
        out: list[RowPrompt | None] = [self._error_row(index, values) for index, values in rows]
        for builder, chat in ((self.chat, True), (self.text, False)):
            todo = [
                i
                for i, (_, values) in enumerate(rows)
                if out[i] is None and (values.get(MESSAGES) is not None) is chat
            ]
            for i, built in zip(todo, builder.build_many([rows[i] for i in todo]), strict=True):
                off = prepared[i][1]
                if off and built.prompt_ids is not None:  # the engine's base is the job's
                    built = built._replace(overrides={**off, **built.overrides})
                fields = rows[i][1].get(FIELDS_COLUMN) or {}
                built = _in_body_terms(built, fields)
                out[i] = self._within_context(_messages_in_body_terms(built), fields)
        return out

    def _prepare(self, values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """-> (the line's values as PromptBuilder checks them, the job's settings the line turns
        off). A line's own structured setting (text included) replaces the job's; without one,
        the job's is checked with the line's values as the engine will run them. A field the
        line turned off (None: chat `logprobs: false`) overrides the job's value."""
        own = values.get(SAMPLING_COLUMN)
        if not isinstance(own, dict):
            return values, {}
        off = {field: None for field, value in own.items() if value is None}
        given = {field: value for field, value in own.items() if value is not None}
        if self.job_format and not set(given).isdisjoint(STRUCTURED):
            off = {**self.job_off, **off}
        elif self.job_format:
            given = {**self.job_format, **given}
        return {**values, SAMPLING_COLUMN: given}, off

    def _within_context(self, row: RowPrompt, fields: dict[str, str]) -> RowPrompt:
        """As OpenAI and vLLM answer it: a line whose own max_tokens cannot fit beside its
        prompt in the context is an error line, not one cut short at the context. fields: the
        body field each of the line's sampling values came from (max_tokens or
        max_completion_tokens for the limit)."""
        if row.prompt_ids is None:
            return row
        over = prompt_over_context(len(row.prompt_ids), self.context)
        if over is not None:  # refused here as the engine would, so validate finds it
            return row._replace(prompt_ids=None, overrides={}, error=over)
        asked = row.overrides.get("max_new_tokens")
        if asked is None:
            return row
        room = self.context - len(row.prompt_ids)
        if asked <= room:
            return row
        field = fields.get("max_new_tokens", "max_tokens")
        message = (
            f"{field}={asked:,} is too large: the model's context is {self.context:,} tokens "
            f"(max_model_len) and the request has {len(row.prompt_ids):,} prompt tokens, so at "
            f"most {room:,} can be generated: lower {field}"
        )
        passthrough = {**row.passthrough, "error_code": "invalid_value", "error_param": field}
        return row._replace(prompt_ids=None, overrides={}, passthrough=passthrough, error=message)

    def _error_row(self, index: int, values: dict[str, Any]) -> RowPrompt | None:
        """The row of a line that cannot run (bad line, model not served), else None."""
        model = values.get("model")
        unserved = model is not None and model not in self.served_names
        completion = values.get(MESSAGES) is None
        if values.get("error_code") is None and completion and self.system_prompt is not None:
            values = {
                **values,
                "error_code": "invalid_value",
                "error_param": "prompt",
                "error_message": (
                    "[prompt] system_prompt applies to /v1/chat/completions requests only, "
                    "and this is a /v1/completions request: remove system_prompt from the "
                    "job, or send the request as chat messages"
                ),
            }
        if values.get("error_code") is None and unserved:
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
        return None


def _messages_in_body_terms(row: RowPrompt) -> RowPrompt:
    """A chat line's error about its messages (the chat template failed on them) naming the
    body's messages, not the column they are read from, with messages as its param."""
    column = f"column {MESSAGES!r}"
    if row.error is None or row.passthrough.get("error_code") or column not in row.error:
        return row
    passthrough = {**row.passthrough, "error_code": "invalid_value", "error_param": MESSAGES}
    return row._replace(error=row.error.replace(column, "the request's messages"),
                        passthrough=passthrough)  # fmt: skip


def _in_body_terms(row: RowPrompt, fields: dict[str, str]) -> RowPrompt:
    """A line's error about its own sampling values (a rule between two of them, or with the
    job's, or with its prompt: met where they meet) in the line's terms: each SamplingParams
    field it gave named by its body field (min_tokens, max_completion_tokens), the first of
    them as the error's param."""
    if row.prompt_ids is not None or row.error is None or row.passthrough.get("error_code"):
        return row
    found = sorted(
        (match.start(), field)
        for field in fields
        if (match := re.search(field_pattern(field), row.error)) is not None
    )
    if not found:
        return row
    first = fields[found[0][1]]
    passthrough = {**row.passthrough, "error_code": "invalid_value", "error_param": first}
    return row._replace(error=in_body_terms(row.error, fields), passthrough=passthrough)


def _writable_value(value: Any) -> Any:
    return writable(value) if isinstance(value, str) else value
