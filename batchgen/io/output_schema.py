"""The columns of an output row and their Arrow types, declared once.

Every shard and final file of a job has the same columns in the same order with the same types,
whatever the rows hold (an `error` column is a string column also when no row failed), so
result files of any job concatenate. Pass-through columns keep the input's type where the input
declares one (Parquet, datasets); otherwise their type is inferred from the values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    from batchgen.io.writer import Columns

KEY_COLUMNS = ("index", "sample_index")  # one output row per (input index, sample index)
INPUT_HASH = "input_hash"  # shards only: the hash of the input row (sources without a fingerprint)

_TOP = pa.struct([("token", pa.string()), ("token_id", pa.int64()), ("logprob", pa.float64())])
LOGPROBS_TYPE = pa.list_(
    pa.struct([*(_TOP[i] for i in range(_TOP.num_fields)), ("top_logprobs", pa.list_(_TOP))])
)


def _column(arrow: pa.DataType, group: str) -> dict[str, Any]:
    """A field's metadata: one of the job's own columns (group: base, logprobs or token_ids)."""
    return {"arrow": arrow, "group": group}


_INT, _STR = pa.int64(), pa.string()
_IDS = pa.list_(pa.int64())


@dataclass(frozen=True)
class OutputRow:
    """One output row: a sample of an input row. Its own fields are the job's own columns
    (their Arrow types and groups declared here, once); then the pass-through columns."""

    index: int = field(default=None, metadata=_column(_INT, "base"))
    id: str = field(default=None, metadata=_column(_STR, "base"))
    sample_index: int = field(default=None, metadata=_column(_INT, "base"))
    text: str | None = field(default=None, metadata=_column(_STR, "base"))
    finish_reason: str = field(default=None, metadata=_column(_STR, "base"))
    num_prompt_tokens: int = field(default=None, metadata=_column(_INT, "base"))
    num_generated_tokens: int = field(default=None, metadata=_column(_INT, "base"))
    error: str | None = field(default=None, metadata=_column(_STR, "base"))
    logprobs: list[dict[str, Any]] | None = field(
        default=None, metadata=_column(LOGPROBS_TYPE, "logprobs")
    )
    prompt_token_ids: list[int] | None = field(default=None, metadata=_column(_IDS, "token_ids"))
    token_ids: list[int] | None = field(default=None, metadata=_column(_IDS, "token_ids"))
    passthrough: Mapping[str, Any] = field(default_factory=dict)
    input_hash: str | None = None  # shards only (INPUT_HASH)

    def record(self, columns: Iterable[str]) -> dict[str, Any]:
        """The row as the writer's column -> value mapping, for the job's columns."""
        own = {name: getattr(self, name) for name in _OWN}
        own[INPUT_HASH] = self.input_hash
        return {c: own[c] if c in own else self.passthrough.get(c) for c in columns}


COUNT_COLUMNS = ("error", "num_prompt_tokens", "num_generated_tokens")  # what RowCounts reads


@dataclass
class RowCounts:
    """Output rows (samples) ok and failed, and their tokens: counted the same way from the
    rows a run writes and from committed shards (COUNT_COLUMNS), so a job's totals over
    several runs equal one uninterrupted run's."""

    rows_ok: int = 0
    rows_error: int = 0
    prompt_tokens: int = 0  # of the samples the engine ran (not of prompts it refused)
    generated_tokens: int = 0

    def add(self, error: str | None, prompt_tokens: int | None, generated: int | None) -> None:
        """Count one output row (its COUNT_COLUMNS values)."""
        if error is None:
            self.rows_ok += 1
        else:
            self.rows_error += 1
        self.generated_tokens += generated or 0
        # the engine ran the sample: no error, or one found in what it generated (a refused
        # prompt, or one that failed in the engine, has no generated token)
        if error is None or generated:
            self.prompt_tokens += prompt_tokens or 0

    def merge(self, other: RowCounts) -> None:
        self.rows_ok += other.rows_ok
        self.rows_error += other.rows_error
        self.prompt_tokens += other.prompt_tokens
        self.generated_tokens += other.generated_tokens


def _group(name: str) -> dict[str, pa.DataType]:
    return {
        f.name: f.metadata["arrow"] for f in fields(OutputRow) if f.metadata.get("group") == name
    }


BASE = _group("base")
LOGPROBS = _group("logprobs")
TOKEN_IDS = _group("token_ids")
_OWN = (*BASE, *LOGPROBS, *TOKEN_IDS)
RESERVED = (*BASE, *LOGPROBS, *TOKEN_IDS, INPUT_HASH)  # names a pass-through column cannot take


def output_columns(*, logprobs: bool, token_ids: bool) -> dict[str, pa.DataType]:
    """batchgen's own columns of a job: base, then logprobs and token ids when it asks."""
    return {**BASE, **(LOGPROBS if logprobs else {}), **(TOKEN_IDS if token_ids else {})}


def shard_schema(
    own: Mapping[str, pa.DataType],
    passthrough: Columns,
    input_hash: bool,
) -> Columns:
    """Column -> type of a shard (None = inferred from the values)."""
    return {**own, **passthrough, **({INPUT_HASH: pa.string()} if input_hash else {})}


def common_type(name: str, kinds: set[pa.DataType]) -> pa.DataType | None:
    """The type Arrow promotes column `name`'s `kinds` to (int32 and int64: int64), if each
    of them casts to it; else None. Whether each value fits it is the caller's to check.
    View types are given as their plain ones (string_view: string), whose values are the
    same: Arrow's kernels that merge a job's shards (take, filter) have none for views."""
    if len(kinds) == 1:
        return without_views(next(iter(kinds)))
    try:
        parts = [pa.schema([(name, kind)]) for kind in kinds]
        target = pa.unify_schemas(parts, promote_options="permissive").field(name).type
        for kind in kinds:  # promotable is not always castable (struct field sets, say)
            pa.array([], type=kind).cast(target)
    except (pa.ArrowException, NotImplementedError):
        return None
    return without_views(target)


def without_views(kind: pa.DataType) -> pa.DataType:
    """kind with string_view and binary_view (at any depth) as string and binary."""
    if getattr(pa.types, "is_string_view", lambda _: False)(kind):
        return pa.string()
    if getattr(pa.types, "is_binary_view", lambda _: False)(kind):
        return pa.binary()
    if pa.types.is_struct(kind):
        return pa.struct([f.with_type(without_views(f.type)) for f in kind])
    if pa.types.is_map(kind):
        key, item = kind.key_field, kind.item_field
        return pa.map_(without_views(key.type), item.with_type(without_views(item.type)))
    if pa.types.is_list(kind):
        return pa.list_(kind.value_field.with_type(without_views(kind.value_type)))
    if pa.types.is_large_list(kind):
        return pa.large_list(kind.value_field.with_type(without_views(kind.value_type)))
    if pa.types.is_fixed_size_list(kind):
        value = kind.value_field.with_type(without_views(kind.value_type))
        return pa.list_(value, kind.list_size)
    return kind
