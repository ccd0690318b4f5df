"""OpenAI Batch files as an input format: request lines in, OpenAI output and error files out."""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchgen.errors import BatchgenError
from batchgen.formats.base import FinalFiles
from batchgen.formats.openai_batch.builder import PROMPT_KEYS, RequestBuilder
from batchgen.formats.openai_batch.reader import open_batch_file
from batchgen.formats.openai_batch.requests import ID_COLUMN, PASSTHROUGH_TYPES
from batchgen.formats.openai_batch.results import write_openai_results
from batchgen.io import InputSource, OutputLayout
from batchgen.io.readers import OPENAI_BATCH
from batchgen.prompts import PromptConfig
from batchgen.token_bytes import TokenBytes

if TYPE_CHECKING:
    from batchgen.io.writer import Columns
    from batchgen.spec import JobSpec


class OpenAIBatchFormat:
    def check(self, spec: JobSpec) -> None:
        """Only system_prompt and truncate apply: each line's body says where its prompt is."""
        default = PromptConfig()
        for field in dataclasses.fields(spec.prompt):
            if field.name in PROMPT_KEYS:
                continue
            if getattr(spec.prompt, field.name) != getattr(default, field.name):
                raise BatchgenError(
                    f"[prompt] {field.name} does not apply to {OPENAI_BATCH} input (each "
                    f"line's body holds its prompt): remove it; only "
                    f"{' and '.join(PROMPT_KEYS)} apply"
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
        return FinalFiles(str(results), str(errors))

    def report(self, spec: JobSpec, source: InputSource) -> str:
        """How many lines cannot run, by error code, with the first message of each."""
        codes: collections.Counter[str] = collections.Counter()
        first: dict[str, str] = {}
        lines = 0
        names = spec.model.names
        for batch in source.batches():
            for row in batch:
                lines += 1
                values = row.values or {}
                code, message = values.get("error_code"), values.get("error_message")
                if code is None and values.get("model") not in (None, *names):
                    code, message = "model_not_found", f"model {values['model']!r} is not served"
                if code is not None:
                    codes[code] += 1
                    first.setdefault(code, f"line {values.get('line')}: {message}")
        if not codes:
            return f"{source.description}, {lines:,} lines, all valid"
        parts = "; ".join(f"{n} {code} (e.g. {first[code]})" for code, n in codes.most_common())
        bad = sum(codes.values())
        return f"{source.description}, {lines:,} lines, {bad} invalid: {parts}"
