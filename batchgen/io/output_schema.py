"""The columns of an output row and their Arrow types, declared once.

Every shard and final file of a job has the same columns in the same order with the same types,
whatever the rows hold (an `error` column is a string column also when no row failed), so
result files of any job concatenate. Pass-through columns keep the input's type where the input
declares one (Parquet, datasets); otherwise their type is inferred from the values.
"""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa

KEY_COLUMNS = ("index", "sample_index")  # one output row per (input index, sample index)
INPUT_HASH = "input_hash"  # shards only: the hash of the input row (sources without a fingerprint)

_TOP = pa.struct([("token", pa.string()), ("token_id", pa.int64()), ("logprob", pa.float64())])
LOGPROBS_TYPE = pa.list_(
    pa.struct([*(_TOP[i] for i in range(_TOP.num_fields)), ("top_logprobs", pa.list_(_TOP))])
)
BASE: dict[str, pa.DataType] = {
    "index": pa.int64(),
    "id": pa.string(),
    "sample_index": pa.int64(),
    "text": pa.string(),
    "finish_reason": pa.string(),
    "num_prompt_tokens": pa.int64(),
    "num_generated_tokens": pa.int64(),
    "error": pa.string(),
}
LOGPROBS: dict[str, pa.DataType] = {"logprobs": LOGPROBS_TYPE}
TOKEN_IDS: dict[str, pa.DataType] = {
    "prompt_token_ids": pa.list_(pa.int64()),
    "token_ids": pa.list_(pa.int64()),
}
RESERVED = (*BASE, *LOGPROBS, *TOKEN_IDS, INPUT_HASH)  # names a pass-through column cannot take


def output_columns(*, logprobs: bool, token_ids: bool) -> dict[str, pa.DataType]:
    """batchgen's own columns of a job: base, then logprobs and token ids when it asks."""
    return {**BASE, **(LOGPROBS if logprobs else {}), **(TOKEN_IDS if token_ids else {})}


def shard_schema(
    own: Mapping[str, pa.DataType],
    passthrough: Mapping[str, pa.DataType | None],
    input_hash: bool,
) -> dict[str, pa.DataType | None]:
    """Column -> type of a shard (None = inferred from the values)."""
    return {**own, **passthrough, **({INPUT_HASH: pa.string()} if input_hash else {})}
