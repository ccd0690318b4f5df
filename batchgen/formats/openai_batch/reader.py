"""OpenAI Batch input files: JSON lines read as the row reader reads JSONL, each parsed into
row values (a line that cannot run carries its error code and message; nothing is dropped)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pyarrow as pa

from batchgen.errors import BatchgenError
from batchgen.formats.openai_batch.requests import COLUMNS, PASSTHROUGH_TYPES, parse_request
from batchgen.io import InputConfig, InputSource
from batchgen.io.readers import (
    JsonlScan,
    Parsed,
    check_no_split,
    describe_files,
    find_files,
    jsonl_lines,
    jsonl_source,
    parse_json_line,
    project,
    scan_jsonl,
)


def open_batch_file(config: InputConfig) -> InputSource:
    files = find_files(config)
    if files is None:
        raise BatchgenError(f"input {config.path!r} does not exist: check the path")
    check_no_split(config, "an OpenAI batch file has")
    scans = [scan_jsonl(path, name) for path, name in files]
    description = describe_files(files, "OpenAI batch", config.path)
    reader = partial(_rows, files, scans)
    source = jsonl_source(files, scans, list(COLUMNS), description, config, reader)
    types = {name: pa.type_for_alias(alias) for name, alias in PASSTHROUGH_TYPES.items()}
    return dataclasses.replace(source, types=types, sampled=False)


def _rows(
    files: list[tuple[Path, str]], scans: list[JsonlScan], columns: list[str] | None
) -> Iterator[Parsed]:
    for (path, name), scan in zip(files, scans, strict=True):
        for lineno, raw in jsonl_lines(path, scan=(name, scan)):
            values, error = parse_json_line(raw, f"{name} line {lineno}")
            yield project(parse_request(values, error, lineno), columns), None
