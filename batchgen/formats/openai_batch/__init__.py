"""OpenAI Batch files as an input format: request lines in, OpenAI output and error files out."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchgen.engine.model_path import model_context
from batchgen.engine.tokenizer_loader import load_tokenizer
from batchgen.errors import BatchgenError
from batchgen.formats.base import FinalFiles
from batchgen.formats.openai_batch.builder import PROMPT_KEYS, RequestBuilder
from batchgen.formats.openai_batch.reader import open_batch_file
from batchgen.formats.openai_batch.requests import ID_COLUMN, PASSTHROUGH_TYPES
from batchgen.formats.openai_batch.results import line_error, write_openai_results
from batchgen.io import InputSource, OutputLayout
from batchgen.io.readers import OPENAI_BATCH
from batchgen.prompts import CHAT_OPTIONS, PromptConfig
from batchgen.token_bytes import TokenBytes

if TYPE_CHECKING:
    from batchgen.io.writer import Columns
    from batchgen.spec import JobSpec


class OpenAIBatchFormat:
    def check(self, spec: JobSpec) -> None:
        """Only PROMPT_KEYS apply: each line's body says where its prompt is."""
        default = PromptConfig()
        for field in dataclasses.fields(spec.prompt):
            if field.name in PROMPT_KEYS:
                continue
            if getattr(spec.prompt, field.name) != getattr(default, field.name):
                where = (
                    "a chat line's body sets it"
                    if field.name in CHAT_OPTIONS
                    else "each line's body holds its prompt"
                )
                raise BatchgenError(
                    f"[prompt] {field.name} does not apply to {OPENAI_BATCH} input ({where}): "
                    f"remove it; only {', '.join(PROMPT_KEYS)} apply"
                )

    def open(self, spec: JobSpec) -> InputSource:
        return open_batch_file(spec.input)

    def read_columns(self, spec: JobSpec) -> list[str] | None:
        return None

    def id_column(self, spec: JobSpec) -> str | None:
        return ID_COLUMN

    def check_columns(self, spec: JobSpec, source: InputSource) -> None:
        return None  # every line is parsed into the same columns

    def passthrough(self, spec: JobSpec, source: InputSource) -> Columns:
        return {name: pa.type_for_alias(alias) for name, alias in PASSTHROUGH_TYPES.items()}

    def may_ask_logprobs(self, spec: JobSpec) -> bool:
        return True

    def builder(self, spec: JobSpec, tokenizer: Any, max_prompt_tokens: int) -> RequestBuilder:
        return RequestBuilder(
            spec.prompt, tokenizer, max_prompt_tokens, spec.sampling, spec.model.names
        )

    def write_results(self, spec: JobSpec, layout: OutputLayout, tokenizer: Any) -> FinalFiles:
        results, errors = layout.openai_results, layout.openai_errors
        name, tokens = spec.model.names[0], TokenBytes(tokenizer)
        write_openai_results(layout, spec.output.format, name, results, errors, tokens)
        return FinalFiles.at(results, errors)

    def report(self, spec: JobSpec, source: InputSource) -> str:
        """How many lines cannot run, by error code, with the first message of each: each
        line built as the run builds it (the model's tokenizer and context, the job's
        sampling), a duplicated custom_id found as the run finds it."""
        tokenizer = load_tokenizer(spec.model.path)
        if tokenizer is None:
            raise BatchgenError(
                f"model '{spec.model.path}' has no tokenizer: batchgen jobs need one"
            )
        context = spec.engine.max_model_len or model_context(spec.model.path, fetch=True)
        builder = self.builder(spec, tokenizer, (context or UNKNOWN_CONTEXT) - 1)
        codes: collections.Counter[str] = collections.Counter()
        first: dict[str, str] = {}
        lines = 0
        for error in _line_errors(builder, source):
            lines += 1
            if error is not None:
                codes[error["code"]] += 1
                first.setdefault(error["code"], f"line {error['line']}: {error['message']}")
        unknown = "" if context else " (the model's context is unknown: not checked against it)"
        if not codes:
            return f"{source.description}, {lines:,} lines, all valid{unknown}"
        parts = "; ".join(f"{n} {code} (e.g. {first[code]})" for code, n in codes.most_common())
        bad = sum(codes.values())
        return f"{source.description}, {lines:,} lines, {bad} invalid: {parts}{unknown}"


UNKNOWN_CONTEXT = 2**40  # stands for a context that cannot be had: no line is over it


def _line_errors(builder: RequestBuilder, source: InputSource) -> Iterator[dict[str, Any] | None]:
    """Each line's error object as the output's error file gives it; None for a line that
    runs."""
    seen: set[str] = set()
    for batch in source.batches():
        rows = [(row.index, row.values or {}) for row in batch]
        for raw, built in zip(batch, builder.build_many(rows), strict=True):
            custom_id = built.id or None
            duplicate = custom_id in seen
            if custom_id is not None:
                seen.add(custom_id)
            message = built.error if raw.values is not None else raw.error
            if message is None and not duplicate:
                yield None
            else:
                yield line_error({"error": message, **built.passthrough}, custom_id, duplicate)
