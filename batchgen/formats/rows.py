"""The row formats (Parquet, JSONL, save_to_disk folders, hub datasets): each row's prompt,
id and settings come from the columns that [prompt] names."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchgen.errors import BatchgenError
from batchgen.formats.base import FinalFiles
from batchgen.io import InputSource, OutputLayout, open_input
from batchgen.io.arrow_values import check_exact
from batchgen.io.final import write_final
from batchgen.io.output_schema import RESERVED
from batchgen.io.readers import OPENAI_BATCH
from batchgen.io.writer import Columns, MayNotFit, parquet_stores
from batchgen.prompts import PromptBuilder

if TYPE_CHECKING:
    from batchgen.spec import JobSpec


class RowsFormat:
    def check(self, spec: JobSpec) -> None:
        clash = [c for c in spec.prompt.passthrough if c in RESERVED]
        if clash:
            raise BatchgenError(
                f"pass-through column {clash[0]!r} would overwrite an output column: "
                "rename it in the input"
            )
        if spec.model.served_model_name:
            raise BatchgenError(
                f"model.served_model_name names the model in {OPENAI_BATCH} lines and results "
                "only: remove it, or run the input with --format openai-batch"
            )
        if spec.prompt.system_prompt is not None and spec.prompt.messages_column is None:
            raise BatchgenError(
                "prompt.system_prompt applies to chat messages (prompt.messages_column) only: "
                "remove it, or put the text into prompt.template"
            )
        chat_only = spec.prompt.chat_options_given()
        if chat_only and spec.prompt.messages_column is None:
            named = " and ".join(f"prompt.{name}" for name in chat_only)
            verb, it = ("applies", "it") if len(chat_only) == 1 else ("apply", "them")
            raise BatchgenError(
                f"{named} {verb} to chat messages (prompt.messages_column) only: remove {it}"
            )
        try:
            spec.prompt.chat_options.checked()
        except ValueError as exc:
            raise BatchgenError(f"[prompt] {exc}") from None

    def open(self, spec: JobSpec) -> InputSource:
        return open_input(spec.input)

    def read_columns(self, spec: JobSpec) -> list[str] | None:
        return spec.prompt.columns_used() or None

    def id_column(self, spec: JobSpec) -> str | None:
        return spec.prompt.id_column

    def check_columns(self, spec: JobSpec, source: InputSource) -> None:
        _check_schema_types(spec, source)
        _check_messages_type(spec, source)
        _check_parquet_types(spec, source)
        check_exact(source.types, spec.prompt.columns_used(), source.nanosecond_times)
        if source.columns is None:
            return
        missing = [c for c in spec.prompt.columns_used() if c not in source.columns]
        if not missing:
            return
        if not source.sampled:  # a schema: what it lacks, no row has
            raise BatchgenError(
                f"input has no column {missing[0]!r} (columns: "
                f"{', '.join(source.columns)}): {_missing_remedy(missing[0], source)}"
            )
        # JSONL: lines vary, a key the first lines lack may come later; refused where no line
        # has it (without a pass over the files: where a needed key misses the first lines)
        if source.mentions is not None:
            found = source.mentions(missing)
            missing = [c for c in missing if c not in found]
        elif source.columns:
            missing = [c for c in missing if c in spec.prompt.required_columns()]
        else:
            missing = []
        if missing:
            seen = f" (keys of its first lines: {', '.join(source.columns)})"
            fix = "fix [prompt] or the input"
            if {"custom_id", "url", "body"} <= set(source.columns):
                fix = f"its lines are OpenAI Batch requests: run it with --format {OPENAI_BATCH}"
            raise BatchgenError(
                f"input has no column {missing[0]!r}: no line of {source.description} has "
                f"that key{seen if source.columns else ''}: {fix}"
            )

    def passthrough(self, spec: JobSpec, source: InputSource) -> Columns:
        declared = {name: source.types.get(name) for name in spec.prompt.passthrough}
        return {
            name: MayNotFit(kind) if kind is not None and name in source.promoted else kind
            for name, kind in declared.items()
        }

    def may_ask_logprobs(self, spec: JobSpec) -> bool:
        return spec.sampling.logprobs is not None or spec.prompt.sampling_column is not None

    def builder(self, spec: JobSpec, tokenizer: Any, max_prompt_tokens: int) -> PromptBuilder:
        return PromptBuilder(spec.prompt, tokenizer, max_prompt_tokens, spec.sampling)

    def write_results(self, spec: JobSpec, layout: OutputLayout, tokenizer: Any) -> FinalFiles:
        result = layout.results(spec.output.format)
        write_final(layout, spec.output.format, result)
        return FinalFiles.at(result)

    def report(self, spec: JobSpec, source: InputSource) -> str:
        rows = "unknown" if source.num_rows is None else f"{source.num_rows:,}"
        return f"{source.description}, {rows} rows"


def _check_parquet_types(spec: JobSpec, source: InputSource) -> None:
    """A pass-through column is written with the type the input declares; Parquet shards
    cannot hold some (an object without fields), and would fail at every commit."""
    if spec.output.format != "parquet":
        return
    for name in spec.prompt.passthrough:
        kind = source.types.get(name)
        if kind is not None and name not in source.promoted and not parquet_stores(kind):
            raise BatchgenError(
                f"pass-through column {name!r} has the type {kind}, which Parquet cannot store "
                '(an object without fields): set output.format = "jsonl", or leave the '
                "column out of prompt.passthrough"
            )


def _missing_remedy(column: str, source: InputSource) -> str:
    """What to do about a column the input lacks; where it names a Hive partition folder of
    the input (year=2024/), that batchgen reads only the files' own columns, as Hugging Face
    datasets does."""
    if not any(part.startswith(f"{column}=") for path in source.files for part in path.parts):
        return "fix [prompt] or the input"
    return (
        f"{column!r} is a partition folder name ({column}=...), and batchgen reads only the "
        "files' own columns, as Hugging Face datasets does: write it into the files, or fix "
        "[prompt]"
    )


def _check_messages_type(spec: JobSpec, source: InputSource) -> None:
    """A messages column typed as text (JSON text of messages, say) would make every row an
    error row: refused before any."""
    column = spec.prompt.messages_column
    kind = source.types.get(column) if column is not None else None
    if kind is not None and (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise BatchgenError(
            f"prompt.messages_column {column!r} holds text, not lists of {{role, content}} "
            "messages: if it is JSON text, parse it into a list column first (or use "
            "prompt.column for plain text)"
        )


def _check_schema_types(spec: JobSpec, source: InputSource) -> None:
    """A JSON schema per row must come as JSON text or a JSON line's object: stored as an Arrow
    struct (Parquet, datasets), every row's schema holds the keys of all rows' schemas, those
    it lacks as null, which changes what it allows ({} becomes {"const": null})."""
    p = spec.prompt
    where = []
    if p.json_schema_column is not None:
        where.append((p.json_schema_column, source.types.get(p.json_schema_column)))
    sampling = source.types.get(p.sampling_column) if p.sampling_column is not None else None
    has_schema = sampling is not None and pa.types.is_struct(sampling)
    if has_schema and sampling.get_field_index("json_schema") >= 0:
        where.append((f"{p.sampling_column}.json_schema", sampling.field("json_schema").type))
    for name, kind in where:
        nested = "struct" if kind is not None and pa.types.is_struct(kind) else None
        nested = "map" if kind is not None and pa.types.is_map(kind) else nested
        if nested is not None:
            raise BatchgenError(
                f"column {name!r} holds JSON schemas as an Arrow {nested}, which gives each row's "
                "schema the other rows' keys as null (changing what it allows): store each "
                "schema as JSON text (json.dumps) in a string column"
            )
