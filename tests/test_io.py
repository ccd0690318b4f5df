"""Readers and the shard writer: streaming, error rows, job-level errors, atomic commits."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.errors import BatchgenError
from batchgen.io import InputConfig, OutputConfig, OutputLayout, RawRow, ShardWriter, open_input
from batchgen.io.checkpoint import remove_temp_files, scan_committed
from batchgen.io.final import write_final
from batchgen.io.output_schema import BASE
from batchgen.io.writer import MayNotFit
from batchgen.job import job_columns
from batchgen.spec import load_spec

STAMP = datetime(2024, 1, 1, 12, 0, 0, 654321)


def read_all(path: Path | str, columns: list[str] | None = None, **config: Any) -> list[RawRow]:
    source = open_input(InputConfig(str(path), **config))
    return [row for batch in source.batches(columns) for row in batch]


def write_parquet(path: Path, start: int, count: int) -> None:
    ids = [f"r{i}" for i in range(start, start + count)]
    pq.write_table(
        pa.table({"id": ids, "prompt": [f"p{i}" for i in range(start, start + count)]}), path
    )


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def one_line_error(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(excinfo.value)
    assert message and "\n" not in message
    return message


# ---------------------------------------------------------------- parquet


def test_parquet_single_file_batches_and_num_rows(tmp_path: Path) -> None:
    write_parquet(tmp_path / "data.parquet", 0, 10)
    source = open_input(InputConfig(str(tmp_path / "data.parquet"), batch_rows=4))
    assert source.columns == ["id", "prompt"] and source.num_rows == 10
    assert "parquet" in source.description
    batches = list(source.batches())
    assert [len(b) for b in batches] == [4, 4, 2]
    rows = [row for batch in batches for row in batch]
    assert [r.index for r in rows] == list(range(10))
    assert rows[3] == RawRow(3, {"id": "r3", "prompt": "p3"}, None)


def test_parquet_directory_and_glob_continue_index_across_sorted_files(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_parquet(data / "b.parquet", 3, 4)  # sorted after a.parquet
    write_parquet(data / "a.parquet", 0, 3)
    (data / "notes.txt").write_text("ignored")
    for path in (data, data / "*.parquet"):
        source = open_input(InputConfig(str(path), batch_rows=5))
        assert source.num_rows == 7 and "2 parquet files" in source.description
        rows = [row for batch in source.batches() for row in batch]
        assert [r.index for r in rows] == list(range(7))
        assert [r.values["id"] for r in rows] == [f"r{i}" for i in range(7)]


def test_parquet_column_projection_fills_absent_columns(tmp_path: Path) -> None:
    path = tmp_path / "d.pq"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["x", "y"], "big": [1, 2]}), path)
    rows = read_all(path, columns=["prompt", "missing"])
    assert [r.values for r in rows] == [
        {"prompt": "x", "missing": None},
        {"prompt": "y", "missing": None},
    ]
    assert [r.values for r in read_all(path, columns=["missing"])] == [{"missing": None}] * 2


# ---------------------------------------------------------------- JSONL


def test_jsonl_error_rows_and_blank_lines(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "data.jsonl",
        [
            b'{"id": "a", "prompt": "one"}',
            b"",
            b"   ",
            b'{"id": "b", "prompt": ',  # line 4: malformed
            b"[1, 2]",  # line 5: not an object
            b'{"id": "c", "prompt": "caf\xff"}',  # line 6: bad utf-8
            b'{"id": "d", "prompt": "caf\xc3\xa9", "extra": 1}',
        ],
    )
    source = open_input(InputConfig(str(path), batch_rows=2))
    assert source.num_rows == 5 and source.columns == ["id", "prompt", "extra"]
    rows = [row for batch in source.batches() for row in batch]
    assert [r.index for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0].values == {"id": "a", "prompt": "one"} and rows[0].error is None
    assert rows[1].values is None
    assert rows[1].error.startswith(f"{path} line 4: malformed JSON: Expecting value at column")
    assert rows[2] == RawRow(2, None, f"{path} line 5: expected a JSON object, got an array")
    assert rows[3].values is None
    assert rows[3].error == f"{path} line 6: not valid UTF-8 (byte 0xff at column 27)"
    assert rows[4].values == {"id": "d", "prompt": "café", "extra": 1}


def test_jsonl_errors_in_a_folder_name_the_file(tmp_path: Path) -> None:
    write_lines(tmp_path / "a.jsonl", [b'{"a": 1}'])
    write_lines(tmp_path / "b.jsonl", [b'{"a": 2}', b"{oops}", b"7"])
    rows = read_all(tmp_path)
    assert [r.index for r in rows] == [0, 1, 2, 3]
    assert rows[2].error.startswith("b.jsonl line 2: malformed JSON: ")
    assert rows[3].error == "b.jsonl line 3: expected a JSON object, got a number"


def test_a_first_line_nested_too_deeply_is_an_error_row(tmp_path: Path) -> None:
    """Telling JSON Lines from one JSON document parses the first line: one nested past
    Python's recursion limit is a bad line (an error row), never a crash of the job."""
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 100_000 + "]" * 100_000 + '\n{"prompt": "hi"}\n')
    rows = read_all(path, ["prompt"])
    assert rows[0] == RawRow(0, None, f"{path} line 1: malformed JSON: nested too deeply")
    assert rows[1] == RawRow(1, {"prompt": "hi"}, None)


def test_jsonl_projection_num_rows_without_final_newline_and_bom(tmp_path: Path) -> None:
    path = tmp_path / "d.ndjson"
    path.write_bytes(b'\xef\xbb\xbf{"id": "a", "p": 1}\n\n{"id": "b"}')  # BOM, no final newline
    source = open_input(InputConfig(str(path)))
    assert source.num_rows == 2
    rows = [r for b in source.batches(["p"]) for r in b]
    assert [r.values for r in rows] == [{"p": 1}, {"p": None}]


def test_jsonl_num_rows_counts_across_chunk_boundaries(tmp_path: Path, monkeypatch) -> None:
    import batchgen.io.readers as readers

    monkeypatch.setattr(readers, "COUNT_CHUNK_BYTES", 7)  # lines and blanks straddle chunks
    lines = [b'{"i": %d}' % i if i % 3 else b" \t " for i in range(40)] + [b"", b""]
    path = write_lines(tmp_path / "d.jsonl", lines)
    source = open_input(InputConfig(str(path)))
    assert source.num_rows == len(read_all(path)) == sum(1 for line in lines if line.strip())


@pytest.mark.parametrize("chunk", [1 << 20, 2, 7])
@pytest.mark.parametrize(
    "data",
    [
        b'\xef\xbb\xbf{"p": 0}\n{"p": 1}\n',
        b'\xef\xbb\xbf\n{"p": 0}\n{"p": 1}\n',  # a BOM alone on the first line
        b'\xef\xbb\xbf \t\r\n{"p": 0}\r\n\r\n{"p": 1}',
        b'\xef\xbb\xbf\r\n{"p": 0}\r\n{"p": 1}\r\n',
        b'\n  \n{"p": 0}\n\n{"p": 1}\n \n',
        b"\xef\xbb\xbf",
        b"\xef\xbb\xbf\n",
    ],
)
def test_jsonl_num_rows_is_the_rows_read(tmp_path: Path, monkeypatch, data, chunk) -> None:
    """The scan's row count (and so every row index) agrees with the lines the reader gives,
    whatever blank lines, BOM and line ends the file has."""
    import batchgen.io.readers as readers

    monkeypatch.setattr(readers, "COUNT_CHUNK_BYTES", chunk)
    path = tmp_path / "d.jsonl"
    path.write_bytes(data)
    source = open_input(InputConfig(str(path)))
    rows = [r for b in source.batches(["p"]) for r in b]
    assert source.num_rows == len(rows) and not any(r.error for r in rows)
    assert [r.values["p"] for r in rows] == list(range(len(rows)))


def test_json_array_file_is_a_job_error(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"id": "a"}], indent=2))
    with pytest.raises(BatchgenError) as excinfo:
        open_input(InputConfig(str(path)))
    assert "not JSON Lines" in one_line_error(excinfo)
    path.write_text(json.dumps([{"id": "a"}, {"id": "b"}]))  # on one line
    with pytest.raises(BatchgenError, match="not JSON Lines"):
        open_input(InputConfig(str(path), format="jsonl"))


def test_a_first_line_that_is_an_array_is_an_error_row(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('[{"prompt": "a"}]\n{"prompt": "b"}\n')
    source = open_input(InputConfig(str(path)))
    rows = [row for batch in source.batches() for row in batch]
    assert [r.values for r in rows] == [None, {"prompt": "b"}]
    assert "line 1" in rows[0].error and rows[1].error is None


# ---------------------------------------------------------------- datasets folders, hub


def test_save_to_disk_dataset_and_dataset_dict(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"id": ["a", "b", "c"], "prompt": ["x", "y", "z"]})
    ds.save_to_disk(str(tmp_path / "single"))
    source = open_input(InputConfig(str(tmp_path / "single"), batch_rows=2))
    assert source.columns == ["id", "prompt"] and source.num_rows == 3
    rows = [r for b in source.batches(["prompt"]) for r in b]
    assert rows == [RawRow(i, {"prompt": p}, None) for i, p in enumerate("xyz")]

    test = datasets.Dataset.from_dict({"id": ["t"], "prompt": ["q"]})
    datasets.DatasetDict({"train": ds, "test": test}).save_to_disk(str(tmp_path / "dict"))
    rows = read_all(tmp_path / "dict", split="test")
    assert rows == [RawRow(0, {"id": "t", "prompt": "q"}, None)]
    with pytest.raises(BatchgenError) as excinfo:
        open_input(InputConfig(str(tmp_path / "dict"), split="validation"))
    message = one_line_error(excinfo)
    assert "'validation'" in message and "train" in message and "test" in message


def test_a_split_named_for_an_input_without_splits_is_refused(tmp_path: Path) -> None:
    """input.split names a split of a DatasetDict folder or a hub dataset; on files, a folder
    holding one saved dataset or an OpenAI batch file it would be ignored (every row read as
    if it were that split's): one line instead. The default split reads them as before."""
    from batchgen.formats.openai_batch.reader import open_batch_file

    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text('{"prompt": "a"}\n')
    write_parquet(tmp_path / "rows.parquet", 0, 2)
    inputs = [(jsonl, open_input), (tmp_path / "rows.parquet", open_input)]
    inputs.append((jsonl, open_batch_file))
    if importlib.util.find_spec("datasets") is not None:  # a folder of one saved dataset
        import datasets

        datasets.Dataset.from_dict({"prompt": ["x"]}).save_to_disk(str(tmp_path / "single"))
        inputs.append((tmp_path / "single", open_input))
    for path, opener in inputs:
        with pytest.raises(BatchgenError) as excinfo:
            opener(InputConfig(str(path), split="test"))
        message = one_line_error(excinfo)
        assert message.startswith("input.split = 'test', but ") and "no splits" in message
        assert message.endswith("remove input.split")
        assert opener(InputConfig(str(path))).num_rows is not None


@pytest.mark.parametrize("fmt", ["numpy", "torch", "pandas"])
def test_a_dataset_saved_with_a_format_gives_plain_values(tmp_path: Path, fmt: str) -> None:
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("torch" if fmt == "torch" else fmt)
    data = {"prompt": ["x", "y"], "doc_id": [101, 102], "score": [0.5, 1.25], "tags": [[1], []]}
    ds = datasets.Dataset.from_dict(data).with_format(fmt)
    ds.save_to_disk(str(tmp_path / "saved"))
    rows = read_all(tmp_path / "saved", batch_rows=1)
    assert [r.values for r in rows] == [
        dict(zip(data, v, strict=True)) for v in zip(*data.values(), strict=True)
    ]
    assert all(type(r.values["doc_id"]) is int for r in rows)


def test_hub_name_offline_is_a_quick_job_error(monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # read once at import time
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(BatchgenError) as excinfo:
        open_input(InputConfig("someone/no-such-dataset-xyz"))
    assert time.monotonic() - start < 120, "no retries while offline"
    message = one_line_error(excinfo)
    assert "could not load hub dataset 'someone/no-such-dataset-xyz'" in message
    assert "offline" in message


# ---------------------------------------------------------------- job-level errors


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: d / "missing.parquet", "does not exist"),
        (lambda d: d / "missing.txt", "does not exist"),
        (lambda d: "missing.txt", "does not exist"),
        (lambda d: d / "nothing-*.parquet", "no files match"),
        (lambda d: d / "empty_dir", "holds no"),
        (lambda d: d / "notes.txt", "cannot tell the format"),
        (lambda d: d / "corrupt.parquet", "cannot read parquet file"),
        (lambda d: d / "truncated.parquet", "cannot read parquet file"),
    ],
)
def test_job_level_errors_are_one_line(tmp_path: Path, make, expected: str) -> None:
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty_dir" / "readme.md").write_text("no data here")
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "corrupt.parquet").write_text("this is not parquet")
    write_parquet(tmp_path / "good.parquet", 0, 100)
    data = (tmp_path / "good.parquet").read_bytes()
    (tmp_path / "truncated.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(BatchgenError) as excinfo:
        open_input(InputConfig(str(make(tmp_path))))
    assert expected in one_line_error(excinfo)


def test_hub_and_saved_folders_without_datasets_installed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # the GPU machine has no datasets
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "state.json").write_text("{}")
    for path in ("owner/name", str(tmp_path / "saved")):
        with pytest.raises(BatchgenError) as excinfo:
            open_input(InputConfig(path))
        assert "needs the 'datasets' package" in one_line_error(excinfo)


def test_bad_config_values_name_field_and_allowed() -> None:
    with pytest.raises(ValueError, match=r"format='csv' is not allowed: use one of auto, parquet"):
        InputConfig("x.csv", format="csv")
    with pytest.raises(ValueError, match="batch_rows=0"):
        InputConfig("x.parquet", batch_rows=0)
    with pytest.raises(ValueError, match="format='csv'"):
        OutputConfig("out", format="csv")
    with pytest.raises(ValueError, match="shard_rows=0"):
        OutputConfig("out", shard_rows=0)


def test_format_override_reads_an_odd_extension(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "data.txt", [b'{"id": "a"}'])
    assert read_all(path, format="jsonl") == [RawRow(0, {"id": "a"}, None)]


# ---------------------------------------------------------------- writer


def rows(indexes: list[int], **extra: Any) -> list[dict[str, Any]]:
    return [{"index": i, "id": f"r{i}", "text": f"t{i}", **extra} for i in indexes]


def make_writer(
    out: Path, fmt: str, shard_rows: int = 10_000, seconds: float = 3600, extra: tuple = ()
) -> ShardWriter:
    columns = {**BASE, **dict.fromkeys(extra)}  # extra: pass-through columns, types inferred
    return ShardWriter(OutputLayout(out), fmt, columns, shard_rows, seconds)


def committed(out: Path) -> set[int]:
    notes: list[str] = []
    found = scan_committed(OutputLayout(out), notes.append)
    assert not notes, notes
    return found.indexes


def shard_files(out: Path) -> list[Path]:
    return sorted((out / "shards").iterdir())


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_commit_is_atomic_and_leaves_no_temp_file(tmp_path: Path, fmt: str) -> None:
    writer = make_writer(tmp_path, fmt, shard_rows=3)
    for row in rows([0, 1, 2, 3]):
        writer.add_group([row])  # the third row commits a shard
    files = shard_files(tmp_path)
    assert len(files) == 1 and files[0].name.startswith("part-")
    assert files[0].name.endswith(f"-000000-n3.{fmt}")  # the name says how many rows it holds
    assert writer.commit() == 1 and writer.commit() == 0
    assert not [p for p in shard_files(tmp_path) if p.name.startswith(".tmp-")]
    assert committed(tmp_path) == {0, 1, 2, 3}


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_every_shard_has_the_same_columns_and_types(tmp_path: Path, fmt: str) -> None:
    """An error column is a string column also when no row of the shard failed."""
    writer = make_writer(tmp_path, fmt, shard_rows=1)
    writer.add_group([{"index": 0, "id": "a", "text": "ok", "error": None}])
    writer.add_group([{"index": 1, "id": "b", "text": None, "error": "bad row"}])
    first, second = shard_files(tmp_path)
    if fmt == "parquet":
        schemas = [pq.read_schema(p) for p in (first, second)]
        assert schemas[0] == schemas[1] and schemas[0].field("error").type == pa.string()
        pa.concat_tables([pq.read_table(first), pq.read_table(second)])
    else:
        keys = [list(json.loads(p.read_text())) for p in (first, second)]
        assert keys[0] == keys[1] == list(BASE)


def test_time_limit_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer commits once its first row is shard_seconds old (the writer's clock moved by
    hand: a busy machine's pause between two calls is not the writer's age)."""
    from batchgen.io import writer as writer_module

    now = [100.0]
    monkeypatch.setattr(writer_module.time, "monotonic", lambda: now[0])
    writer = make_writer(tmp_path, "parquet", shard_rows=100, seconds=0.2)
    writer.add_group(rows([0]))
    now[0] += 0.19
    writer.maybe_commit()
    assert shard_files(tmp_path) == []
    now[0] += 0.01
    writer.maybe_commit()
    assert len(shard_files(tmp_path)) == 1


def test_committed_indexes_across_writers_and_crash_leftovers(tmp_path: Path) -> None:
    for fmt, batch in (("parquet", [5, 1, 3]), ("jsonl", [0, 2])):
        writer = make_writer(tmp_path, fmt, shard_rows=2)
        for row in rows(batch):
            writer.add_group([row])
        writer.commit()
    # a writer killed mid-shard leaves a temp file with garbage: never read, then removed
    (tmp_path / "shards" / ".tmp-123-part-x-000000.parquet").write_bytes(b"PAR1 garbage")
    (tmp_path / ".tmp-123-results.parquet").write_bytes(b"half a file")
    assert committed(tmp_path) == {0, 1, 2, 3, 5}
    assert remove_temp_files(OutputLayout(tmp_path)) == 2
    assert not list(tmp_path.rglob(".tmp-*"))
    assert committed(tmp_path) == {0, 1, 2, 3, 5}


def test_an_index_in_two_shards_is_an_error_naming_both(tmp_path: Path) -> None:
    writer = make_writer(tmp_path, "jsonl")
    writer.add_group(rows([1]))
    writer.add_group(rows([2]))
    writer.commit()
    writer.add_group(rows([2]))
    writer.commit()
    with pytest.raises(BatchgenError, match=r"row 2 \(sample 0\) is committed in two shards"):
        committed(tmp_path)
    with pytest.raises(BatchgenError, match=r"row 2 \(sample 0\) is committed twice"):
        write_final(OutputLayout(tmp_path), "jsonl", tmp_path / "out.jsonl")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
@pytest.mark.parametrize("damage", ["truncate", "garbage", "cut_at_a_line", "empty"])
def test_a_damaged_shard_is_moved_aside_and_its_rows_are_not_committed(
    tmp_path: Path, fmt: str, damage: str
) -> None:
    writer = make_writer(tmp_path, fmt, shard_rows=3)
    for row in rows(list(range(6))):
        writer.add_group([row])
    _, second = shard_files(tmp_path)
    data = second.read_bytes()
    if damage == "truncate":
        second.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        second.write_bytes(b"\x00garbage" * 20)
    elif damage == "cut_at_a_line":  # whole lines, one row missing
        second.write_bytes(
            data[: data.rindex(b"\n", 0, len(data) - 1) + 1] if fmt == "jsonl" else b""
        )
    else:
        second.write_bytes(b"")
    notes: list[str] = []
    found = scan_committed(OutputLayout(tmp_path), notes.append)
    assert found.indexes == {0, 1, 2} and found.damaged == [second.name]
    assert len(notes) == 1 and second.name in notes[0] and "generated again" in notes[0]
    assert (tmp_path / "damaged" / second.name).exists() and not second.exists()


def test_add_rejects_rows_without_index_and_id(tmp_path: Path) -> None:
    writer = make_writer(tmp_path, "jsonl")
    with pytest.raises(TypeError):
        writer.add_group([{"id": "a"}])


def write_shards(out: Path, fmt: str, shards: list[list[dict[str, Any]]], extra=()) -> None:
    writer = make_writer(out, fmt, extra=extra)
    for shard in shards:
        writer.add_group(shard)
        writer.commit()


def read_final(path: Path, fmt: str) -> list[dict[str, Any]]:
    if fmt == "parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_write_final_orders_overlapping_shards(tmp_path: Path, fmt: str) -> None:
    # roughly in order, with stragglers: the shards' index ranges overlap
    shards = [[0, 2, 1, 4], [3, 6, 5, 17], [8, 7, 9, 10, 12], [11, 13, 14, 15, 16]]
    write_shards(tmp_path, fmt, [rows(s) for s in shards])
    final = tmp_path / f"results.{fmt}"
    assert write_final(OutputLayout(tmp_path), fmt, final, window_rows=4) == 18
    got = read_final(final, fmt)
    assert [r["index"] for r in got] == list(range(18))
    assert got[5] == {**dict.fromkeys(BASE), "index": 5, "id": "r5", "text": "t5"}
    assert not list(tmp_path.glob(".tmp-*"))


def test_the_final_parquet_is_written_in_pieces_of_bounded_text(
    tmp_path: Path, monkeypatch
) -> None:
    """A window's texts together may pass 2 GiB, past a string column's 32-bit offsets: the
    window is reordered with 64-bit offsets and written in pieces of at most PIECE_BYTES
    (one row at least), the same rows in the same order as one piece, types and metadata
    kept."""
    from batchgen.io import final as final_module

    extra = ("blob", "tag")
    shards = [
        [{"index": i, "id": f"r{i}", "text": "x" * (i * 7), "blob": b"\x00" * i, "tag": None}
         for i in order]
        for order in ([5, 1, 3], [0, 4, 2], [7, 6])
    ]  # fmt: skip
    write_shards(tmp_path, "parquet", shards, extra=extra)
    whole = tmp_path / "whole.parquet"
    write_final(OutputLayout(tmp_path), "parquet", whole)
    written: list[int] = []
    real = pq.ParquetWriter.write_table

    def record(self, table, *args, **kwargs):
        written.append(table.num_rows)
        return real(self, table, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", record)
    monkeypatch.setattr(final_module, "PIECE_BYTES", 30)
    pieces = tmp_path / "pieces.parquet"
    assert write_final(OutputLayout(tmp_path), "parquet", pieces) == 8
    assert len(written) > 3 and sum(written) == 8
    one, many = pq.read_table(whole), pq.read_table(pieces)
    assert many.schema.equals(one.schema, check_metadata=True)
    assert many.to_pylist() == one.to_pylist()
    assert [r["index"] for r in many.to_pylist()] == list(range(8))


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_write_final_with_no_shards(tmp_path: Path, fmt: str) -> None:
    final = tmp_path / f"results.{fmt}"
    assert write_final(OutputLayout(tmp_path), fmt, final) == 0 and final.exists()


def test_pass_through_columns_of_varying_types(tmp_path: Path) -> None:
    extra = ("meta", "score", "tag", "extra")
    shards = [
        # within one shard: int and str in "meta" cannot share an Arrow type -> JSON text
        [
            {"index": 0, "id": "a", "meta": 1, "score": 1, "tag": None},
            {"index": 1, "id": "b", "meta": "x", "score": 2, "tag": None},
        ],
        # across shards: score int -> float promotes; tag null -> str
        [{"index": 2, "id": "c", "meta": 3, "score": 2.5, "tag": "t", "extra": [1, 2]}],
        [{"index": 3, "id": "d", "meta": {"k": 1}, "score": 4, "tag": None}],
    ]
    write_shards(tmp_path, "parquet", shards, extra=extra)
    final = tmp_path / "results.parquet"
    assert write_final(OutputLayout(tmp_path), "parquet", final, window_rows=2) == 4
    table = pq.read_table(final)
    assert table.schema.field("score").type == pa.float64()
    assert table.schema.field("meta").type == pa.string()
    assert table.schema.field("error").type == pa.string()
    assert table.column("meta").to_pylist() == ["1", '"x"', "3", '{"k": 1}']
    assert table.column("score").to_pylist() == [1.0, 2.0, 2.5, 4.0]
    assert table.column("tag").to_pylist() == [None, None, "t", None]
    assert table.column("extra").to_pylist() == [None, None, [1, 2], None]


MIXED = (  # column: (first file's type and values, second file's)
    ("score", (pa.int64(), [1, 2]), (pa.float64(), [1.5, 2.75])),
    ("meta", (pa.struct([("a", pa.int64())]), [{"a": 1}]), (None, [{"a": 3, "b": "kept"}])),
    ("ts", (pa.timestamp("s"), [datetime(2024, 1, 1)]), (pa.timestamp("us"), [STAMP])),
    ("tag", (pa.int64(), [7]), (pa.string(), ["seven"])),
)


def test_parquet_files_with_different_types_declare_a_common_one(tmp_path: Path) -> None:
    for i in (0, 1):
        pq.write_table(
            pa.table({name: pa.array(kinds[i][1][:1], kinds[i][0]) for name, *kinds in MIXED}),
            tmp_path / f"part-{i}.parquet",
        )
    source = open_input(InputConfig(str(tmp_path)))
    assert source.types["score"] == pa.float64()
    assert source.types["meta"] == pa.struct([("a", pa.int64()), ("b", pa.string())])
    assert source.types["ts"] == pa.timestamp("us")
    assert "tag" not in source.types  # int and text have no common type: inferred per shard
    assert source.promoted == {"score", "meta", "ts"}  # the writer checks each value against these
    single = open_input(InputConfig(str(tmp_path / "part-0.parquet")))
    assert single.types["score"] == pa.int64() and single.promoted == frozenset()
    paths = {"input.path": str(tmp_path), "output.dir": str(tmp_path / "out")}
    spec = load_spec(None, values={**paths, "prompt.passthrough": ["score", "tag"]})
    columns = job_columns(spec, source)
    assert columns["score"] == MayNotFit(pa.float64()) and columns["tag"] is None
    assert job_columns(spec, single)["score"] == pa.int64()
    rows = [r.values for b in source.batches() for r in b]
    assert rows[1] == {"score": 1.5, "meta": {"a": 3, "b": "kept"}, "ts": STAMP, "tag": "seven"}


def test_a_declared_type_never_changes_a_pass_through_value(tmp_path: Path) -> None:
    """A value the declared type would change (cut, round, drop keys of) is stored in the
    type its values infer to instead; values that fit keep the declared type."""
    declared = {name: MayNotFit(first[0]) for name, first, _ in MIXED}
    values = {name: [*first[1][:1], *second[1][:1]] for name, first, second in MIXED}
    writer = ShardWriter(OutputLayout(tmp_path), "parquet", {**BASE, **declared}, 10, 3600)
    writer.add_group(
        [{"index": i, "id": f"r{i}", **{c: v[i] for c, v in values.items()}} for i in (0, 1)]
    )
    writer.commit()
    fitting = {"index": 2, "id": "r2", "score": 5, "meta": {"a": 5}, "ts": None, "tag": 1}
    writer.add_group([fitting])
    writer.commit()
    first, second = (pq.read_table(p) for p in shard_files(tmp_path))
    values["meta"][0]["b"] = None  # a key no value of the first file has: null
    values["tag"] = ["7", '"seven"']  # a number and a string share no type: JSON text
    for name, got in values.items():
        assert first.column(name).to_pylist() == got, name
    assert second.schema.field("score").type == pa.int64()
    assert second.schema.field("meta").type == declared["meta"].type
    assert second.to_pylist()[0] == {**dict.fromkeys(BASE), **fitting}


NANOS = 1234567890123  # 00:20:34.567890123 after midnight or the epoch; its 123 ns are cut to us
NS_TYPES = {"t": pa.time64("ns"), "ts": pa.timestamp("ns", "UTC"), "d": pa.duration("ns")}
NS_TEXT = {
    "t": "00:20:34.567890123",
    "ts": "1970-01-01T00:20:34.567890123+00:00",
    "d": "P0DT0H20M34.567890123S",
}


@pytest.mark.parametrize("pandas", [True, False])
def test_nanosecond_values_reach_both_output_formats_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pandas: bool
) -> None:
    """A time64[ns] value (and without pandas a timestamp[ns] or duration[ns] one, which
    Python's datetime types cannot hold) is read, stored and written to the nanosecond: the
    same nanoseconds in Parquet, ISO 8601 text to the nanosecond in JSON Lines."""
    from batchgen.io import arrow_values

    if not pandas:
        monkeypatch.setattr(arrow_values, "_have_pandas", lambda: False)
    table = pa.table({name: pa.array([NANOS, None], kind) for name, kind in NS_TYPES.items()})
    pq.write_table(table, tmp_path / "in.parquet")
    source = open_input(InputConfig(str(tmp_path / "in.parquet")))
    read = [r.values for b in source.batches() for r in b]
    assert str(read[0]["t"]) == NS_TEXT["t"] and read[1] == dict.fromkeys(NS_TYPES)
    for fmt in ("parquet", "jsonl"):
        columns = {**BASE, **{name: source.types[name] for name in NS_TYPES}}
        writer = ShardWriter(OutputLayout(tmp_path / fmt), fmt, columns, 10, 3600)
        writer.add_group([{"index": i, "id": str(i), **values} for i, values in enumerate(read)])
        writer.commit()
        (shard,) = shard_files(tmp_path / fmt)
        if fmt == "parquet":
            stored = pq.read_table(shard)
            for name, kind in NS_TYPES.items():
                assert stored.schema.field(name).type == kind, name
                assert stored.column(name).cast(pa.int64()).to_pylist() == [NANOS, None], name
        else:
            first, second = (json.loads(line) for line in shard.read_text().splitlines())
            assert {name: first[name] for name in NS_TYPES} == NS_TEXT
            assert {name: second[name] for name in NS_TYPES} == dict.fromkeys(NS_TYPES)


def test_durations_are_written_to_json_in_iso_8601() -> None:
    """Exact to the value's unit (a pandas Timedelta's nanoseconds too), a negative one with
    its sign in front, never Python's "1 day, 0:00:00.000005"."""
    from datetime import timedelta

    from batchgen.io.writer import json_line

    pd = pytest.importorskip("pandas")
    durations = {
        "day": timedelta(days=1, microseconds=5),
        "zero": timedelta(0),
        "back": timedelta(seconds=-1),
        "long": timedelta(days=3, hours=25, minutes=61, seconds=1.5),
        "ns": pd.Timedelta(NANOS, "ns"),
        "back_ns": pd.Timedelta(-1, "ns"),
    }
    assert json.loads(json_line({"v": list(durations.values())}))["v"] == [
        "P1DT0H0M0.000005S",
        "P0DT0H0M0S",
        "-P0DT0H0M1S",
        "P4DT2H1M1.5S",
        "P0DT0H20M34.567890123S",
        "-P0DT0H0M0.000000001S",
    ]


def test_float32_values_read_as_their_own_shortest_text(tmp_path: Path) -> None:
    """A float32 (or float16) value keeps its exact value, and its text (a template's, an
    id's) is the shortest that reads back as the same float32, as Arrow shows it: 0.1, not the
    double's 0.10000000149011612; a float64 value is left as it is."""
    datasets = pytest.importorskip("datasets")
    values = [0.1, 16777217.0, 1e-7, None]
    table = pa.table(
        {
            "f32": pa.array(values, pa.float32()),
            "f16": pa.array(values[:1] * 4, pa.float16()),
            "f64": pa.array(values, pa.float64()),
        }
    )
    pq.write_table(table, tmp_path / "in.parquet")
    datasets.Dataset(table).save_to_disk(str(tmp_path / "saved"))
    for path in ("in.parquet", "saved"):
        rows = [r.values for r in read_all(tmp_path / path)]
        assert [str(r["f32"]) for r in rows] == ["0.1", "16777216.0", "1e-07", "None"]
        assert [r["f32"] for r in rows] == table.column("f32").to_pylist()  # the exact values
        assert "{f16} {f32!r} {f32:.2f} {f32:>6}|".format(**rows[0]) == "0.1 0.1 0.10    0.1|"
        assert str(rows[0]["f64"]) == "0.1" and type(rows[0]["f64"]) is float


def test_a_pass_through_type_parquet_cannot_store_is_refused_before_the_job(
    tmp_path: Path,
) -> None:
    """An object without fields (struct<>, at any depth) of a datasets input: Parquet shards
    cannot hold it, so a Parquet job is refused in one line naming the column before any
    model work (it failed at every commit); a JSON Lines job takes it."""
    from batchgen.job import check_job

    datasets = pytest.importorskip("datasets")
    data = {"prompt": ["a", "b"], "e": [{}, {}], "deep": [[{}], []], "ok": [{"x": 1}, {}]}
    datasets.Dataset.from_dict(data).save_to_disk(str(tmp_path / "saved"))
    values = {"input.path": str(tmp_path / "saved"), "output.dir": str(tmp_path / "out")}
    for column, kind in (("e", "struct<>"), ("deep", "list<item: struct<>>")):
        spec = load_spec(None, values={**values, "prompt.passthrough": ["ok", column]})
        with pytest.raises(BatchgenError) as excinfo:
            check_job(spec)
        assert one_line_error(excinfo).startswith(
            f"pass-through column {column!r} has the type {kind}, which Parquet cannot store"
        )
        as_lines = {**values, "prompt.passthrough": [column], "output.format": "jsonl"}
        check_job(load_spec(None, values=as_lines))
    check_job(load_spec(None, values={**values, "prompt.passthrough": ["ok"]}))


def test_columns_whose_nanoseconds_would_be_cut_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the job starts, in one line: a time64[ns] inside a list or struct, a time64[ns]
    column of a datasets input (which reads it to the microsecond), and without pandas a
    timestamp[ns] inside a list; a column the job does not use is not looked at."""
    from batchgen.io import arrow_values
    from batchgen.job import check_job

    datasets = pytest.importorskip("datasets")
    nested = pa.array([[NANOS]], pa.list_(pa.time64("ns")))
    stamps = pa.array([[NANOS]], pa.list_(pa.timestamp("ns")))
    table = pa.table({"prompt": ["hi"], "times": nested, "stamps": stamps, "t": [NANOS]})
    table = table.set_column(3, "t", pa.array([NANOS], pa.time64("ns")))
    pq.write_table(table, tmp_path / "in.parquet")
    datasets.Dataset(table.select(["prompt", "t"])).save_to_disk(str(tmp_path / "saved"))

    def check(path: str, column: str) -> None:
        values = {"input.path": str(tmp_path / path), "output.dir": str(tmp_path / "out")}
        check_job(load_spec(None, values={**values, "prompt.passthrough": [column]}))

    with pytest.raises(BatchgenError) as excinfo:
        check("in.parquet", "times")
    assert one_line_error(excinfo).startswith(
        "column 'times' holds time64[ns] inside a list or struct, whose nanoseconds would be cut"
    )
    with pytest.raises(BatchgenError) as excinfo:
        check("saved", "t")
    assert one_line_error(excinfo).startswith("column 't' is time64[ns], whose nanoseconds")
    check("in.parquet", "t")
    check("in.parquet", "stamps")  # pandas gives its values to the nanosecond
    monkeypatch.setattr(arrow_values, "_have_pandas", lambda: False)
    with pytest.raises(BatchgenError) as excinfo:
        check("in.parquet", "stamps")
    assert one_line_error(excinfo).endswith("or install pandas")
    check("in.parquet", "t")


@pytest.mark.parametrize(
    ("ints", "expected"),
    [
        ([1, -(2**53)], [1.0, -(2.0**53), 0.5]),  # exact as doubles: promoted
        ([1, 2**53 + 1], ["1", "9007199254740993", "0.5"]),  # past 2^53: text, never rounded
        ([2**63 - 1, 2], ["9223372036854775807", "2", "0.5"]),
    ],
)
def test_final_merge_of_int_and_float_shards_loses_no_digit(
    tmp_path: Path, ints: list[int], expected: list[Any]
) -> None:
    """Integers in one shard, floats in another: the final file holds them as one shard of
    both would (a double where every integer is exact as one, else text), and never fails."""
    rows = [{"index": i, "id": f"r{i}", "v": v} for i, v in enumerate([*ints, 0.5])]
    merged = []
    for name, shards in (("two", [rows[:-1], rows[-1:]]), ("one", [rows])):
        write_shards(tmp_path / name, "parquet", shards, extra=("v",))
        final = tmp_path / name / "results.parquet"
        write_final(OutputLayout(tmp_path / name), "parquet", final)
        merged.append(pq.read_table(final).column("v").to_pylist())
    assert merged[0] == merged[1] == expected


def test_final_merge_of_decimal_and_float_shards_rounds_no_decimal(tmp_path: Path) -> None:
    """Arrow's safe cast takes a decimal to the nearest double: exact decimals in one shard,
    doubles in another are merged as text, never rounded (a decimal a double holds exactly
    still promotes)."""
    from decimal import Decimal

    for values, promoted in (([Decimal("12345678901234567.89")], False), ([Decimal("2.5")], True)):
        rows = [{"index": i, "id": f"r{i}", "v": v} for i, v in enumerate([*values, 0.1])]
        out = tmp_path / str(promoted)
        write_shards(out, "parquet", [rows[:-1], rows[-1:]], extra=("v",))
        types = {pq.read_schema(p).field("v").type for p in (out / "shards").glob("*.parquet")}
        assert types == {pa.float64(), pa.array(values).type}
        write_final(OutputLayout(out), "parquet", out / "results.parquet")
        column = pq.read_table(out / "results.parquet").column("v")
        if promoted:
            assert column.type == pa.float64() and column.to_pylist() == [2.5, 0.1]
        else:
            assert column.type == pa.string() and "12345678901234567.89" in column[0].as_py()


TOKYO = timezone(timedelta(hours=9))


@pytest.mark.parametrize(
    ("values", "texts"),
    [
        ([2.5, True, False], ["2.5", "true", "false"]),  # Arrow: 1.0, 0.0
        ([{"score": 0.5}, {"score": True}], ['{"score": 0.5}', '{"score": true}']),
        ([[1.5], [True]], ["[1.5]", "[true]"]),
        (  # Arrow: the zone dropped
            [datetime(2020, 1, 1, 12), datetime(2020, 1, 1, 12, tzinfo=TOKYO)],
            ['"2020-01-01T12:00:00"', '"2020-01-01T12:00:00+09:00"'],
        ),
        (  # Arrow: both at the first one's offset
            [datetime(2020, 1, 1, 12, tzinfo=TOKYO), datetime(2020, 1, 1, 12, tzinfo=UTC)],
            ['"2020-01-01T12:00:00+09:00"', '"2020-01-01T12:00:00+00:00"'],
        ),
        (  # Arrow: the time of day cut
            [date(2020, 1, 1), datetime(2020, 1, 1, 23, 59)],
            ['"2020-01-01"', '"2020-01-01T23:59:00"'],
        ),
        ([b"\x00", "a"], ['"AA=="', '"a"']),  # Arrow: the text as bytes
    ],
)
def test_an_inferred_type_that_would_change_a_value_is_text(
    tmp_path: Path, values: list[Any], texts: list[str]
) -> None:
    """Values that Arrow infers one type for but reads some of back as another kind are
    written as each value's JSON text; the shard's other columns keep their types."""
    shard = [{"index": i, "id": f"r{i}", "v": v, "n": i} for i, v in enumerate(values)]
    write_shards(tmp_path, "parquet", [shard], extra=("v", "n"))
    (path,) = shard_files(tmp_path)
    table = pq.read_table(path)
    assert table.column("v").to_pylist() == texts
    assert table.schema.field("v").metadata == {b"batchgen.encoding": b"json"}
    assert table.schema.field("n").type == pa.int64()


@pytest.mark.parametrize(
    ("values", "kind"),
    [
        ([1, 2.5], pa.float64()),
        ([{"a": 1}, {"a": 2, "b": "x"}], pa.struct([("a", pa.int64()), ("b", pa.string())])),
        ([datetime(2020, 1, 1, 12, tzinfo=TOKYO)] * 2, pa.timestamp("us", tz="+09:00")),
        ([date(2020, 1, 1), None], pa.date32()),
    ],
)
def test_an_inferred_type_that_keeps_every_value_is_kept(
    tmp_path: Path, values: list[Any], kind: pa.DataType
) -> None:
    shard = [{"index": i, "id": f"r{i}", "v": v} for i, v in enumerate(values)]
    write_shards(tmp_path, "parquet", [shard], extra=("v",))
    (path,) = shard_files(tmp_path)
    assert pq.read_schema(path).field("v").type == kind


def test_a_column_parquet_cannot_store_is_text_alone(tmp_path: Path) -> None:
    """An empty object (a struct of no field, which Parquet cannot store) makes its own column
    text in that shard, not the shard's other columns: their types in the result file do not
    depend on where shards were cut."""
    shard = [
        {"index": 0, "id": "a", "meta": {"k": 1}, "score": 5, "tag": "x"},
        {"index": 1, "id": "b", "meta": {}, "score": 6, "tag": "y"},
    ]
    for name, shards in (("whole", [shard]), ("cut", [shard[:1], shard[1:]])):
        write_shards(tmp_path / name, "parquet", shards, extra=("meta", "score", "tag"))
        final = tmp_path / name / "results.parquet"
        write_final(OutputLayout(tmp_path / name), "parquet", final)
        table = pq.read_table(final)
        assert table.schema.field("score").type == pa.int64(), name
        assert table.schema.field("tag").type == pa.string(), name
        assert table.column("tag").to_pylist() == ["x", "y"], name
    assert table.column("meta").to_pylist() == ['{"k": 1}', "{}"]


def test_a_text_column_holds_each_values_json_text(tmp_path: Path) -> None:
    """Written as text, 5, "5", 5.0, true and "true" stay apart: each value is its JSON text
    (strings quoted), in a shard and where the result file merges shards of strings or ints
    into a column another shard wrote as text."""
    mixed = [5, "5", 5.0, True, "true", None, [1, "1"], float("nan")]
    values = [*mixed, "a", "5", 7]
    shard = [{"index": i, "id": f"r{i}", "v": v} for i, v in enumerate(values)]
    write_shards(tmp_path, "parquet", [shard[:8], shard[8:10], shard[10:]], extra=("v",))
    final = tmp_path / "results.parquet"
    write_final(OutputLayout(tmp_path), "parquet", final)
    table = pq.read_table(final)
    texts = table.column("v").to_pylist()
    assert texts == [
        "5",
        '"5"',
        "5.0",
        "true",
        '"true"',
        None,
        '[1, "1"]',
        "NaN",
        '"a"',
        '"5"',
        "7",
    ]
    assert table.schema.field("v").metadata == {b"batchgen.encoding": b"json"}
    back = [None if t is None else json.loads(t) for t in texts[:7]]
    assert [(type(v), v) for v in back] == [(type(v), v) for v in mixed[:7]]


@pytest.mark.parametrize(
    ("values", "texts"),
    [
        ([Decimal("0.10"), 0.5], ['"0.10"', "0.5"]),  # Arrow: 0.10 as the double 0.1
        (["a", b"b"], ['"a"', '"Yg=="']),  # Arrow: the text as bytes
    ],
)
def test_the_result_file_promotes_shard_types_only_where_every_value_keeps_its_kind(
    tmp_path: Path, values: list[Any], texts: list[str]
) -> None:
    shards = [[{"index": i, "id": f"r{i}", "v": v}] for i, v in enumerate(values)]
    write_shards(tmp_path, "parquet", shards, extra=("v",))
    final = tmp_path / "results.parquet"
    write_final(OutputLayout(tmp_path), "parquet", final)
    assert pq.read_table(final).column("v").to_pylist() == texts


def test_shard_is_complete_on_disk_before_rename(tmp_path: Path, monkeypatch) -> None:
    """The rename is the commit: at that instant the temp file is whole and fsynced."""
    seen: list[tuple[str, int]] = []
    real_replace, real_fsync = os.replace, os.fsync
    synced: set[int] = set()

    def fsync(fd: int) -> None:
        synced.add(os.fstat(fd).st_ino)
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        assert Path(src).name.startswith(".tmp-") and os.stat(src).st_ino in synced
        seen.append((Path(dst).name, pq.read_table(src).num_rows))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    writer = make_writer(tmp_path, "parquet", shard_rows=5)
    for row in rows(list(range(5))):
        writer.add_group([row])
    assert len(seen) == 1 and seen[0][1] == 5 and seen[0][0].startswith("part-")


def test_failed_commit_keeps_rows_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    writer = make_writer(tmp_path, "parquet", shard_rows=100)
    writer.add_group(rows([0]))

    def boom(src: Any, dst: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        writer.commit()
    monkeypatch.undo()
    assert list((tmp_path / "shards").iterdir()) == []
    assert writer.commit() == 1 and committed(tmp_path) == {0}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_samples_of_one_index_stay_together_and_ordered(tmp_path: Path, fmt: str) -> None:
    writer = make_writer(tmp_path, fmt, shard_rows=3)
    group = [{"index": 1, "id": "a", "sample_index": s, "text": f"s{s}"} for s in (2, 0, 1)]
    writer.add_group([{"index": 2, "id": "b", "sample_index": 0, "text": "x"}])
    writer.add_group(group)  # would straddle the 3-row limit: stays in one shard
    writer.add_group([{"index": 0, "id": "c", "sample_index": 0, "text": "y"}])
    writer.commit()
    assert committed(tmp_path) == {0, 1, 2}
    shards = sorted((tmp_path / "shards").glob("part-*"))
    assert len(shards) == 2
    out = tmp_path / f"final.{fmt}"
    assert write_final(OutputLayout(tmp_path), fmt, out) == 5
    if fmt == "jsonl":
        got = [json.loads(x) for x in out.read_text().splitlines()]
    else:
        got = pq.read_table(out).to_pylist()
    assert [(r["index"], r["sample_index"]) for r in got] == [
        (0, 0),
        (1, 0),
        (1, 1),
        (1, 2),
        (2, 0),
    ]


def test_files_are_read_in_the_order_of_their_paths_as_text(tmp_path: Path) -> None:
    """A folder's files below subfolders sort as their paths' text, as a glob's matches and
    an object store's keys do: the same files get the same row indexes however named."""
    data = tmp_path / "data"
    (data / "a").mkdir(parents=True)
    for name in ("a/b.jsonl", "a-c.jsonl", "a.d.jsonl"):
        (data / name).write_text(json.dumps({"prompt": name}) + "\n")
    orders = [
        [r.values["prompt"] for r in read_all(path)] for path in (data, data / "**" / "*.jsonl")
    ]
    assert orders == [["a-c.jsonl", "a.d.jsonl", "a/b.jsonl"]] * 2


def test_compressed_inputs_are_refused_not_skipped(tmp_path: Path) -> None:
    """A compressed data file is refused in one line naming it (batchgen reads files
    uncompressed), whether a folder holds it, it is named, or its format is given."""
    import gzip

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text(json.dumps({"prompt": "a"}) + "\n")
    (data / "b.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "b"}\n'))
    for path, fmt in ((data, "auto"), (data / "b.jsonl.gz", "auto"), (data / "*", "auto")):
        with pytest.raises(BatchgenError, match=r"b.jsonl.gz' is compressed \(.gz\): batchgen"):
            open_input(InputConfig(str(path), format=fmt))
    with pytest.raises(BatchgenError, match=r"is gzip-compressed, not JSON Lines text"):
        open_input(InputConfig(str(data / "b.jsonl.gz"), format="jsonl"))
    (data / "b.jsonl.gz").unlink()
    assert [r.values["prompt"] for r in read_all(data)] == ["a"]


def test_a_parquet_file_with_two_columns_of_one_name_is_refused(tmp_path: Path) -> None:
    table = pa.Table.from_arrays(
        [pa.array(["p"]), pa.array([1]), pa.array([3])], ["prompt", "k", "k"]
    )
    pq.write_table(table, tmp_path / "twice.parquet")
    with pytest.raises(BatchgenError, match="has two columns named 'k': rename one of them"):
        open_input(InputConfig(str(tmp_path / "twice.parquet")))


def test_view_typed_columns_pass_through_to_the_result_file(tmp_path: Path) -> None:
    """string_view and binary_view columns (at any depth) are stored as string and binary,
    with the same values: the result file's merge has no kernels for views."""
    views = {
        "s": pa.array(["x", None, "é"], pa.string_view()),
        "b": pa.array([b"a", None, b"\x00"], pa.binary_view()),
        "l": pa.array([["u"], [], None], pa.list_(pa.string_view())),
    }
    pq.write_table(pa.table(views), tmp_path / "in.parquet")
    source = open_input(InputConfig(str(tmp_path / "in.parquet")))
    assert [source.types[c] for c in views] == [pa.string(), pa.binary(), pa.list_(pa.string())]
    read = [r.values for b in source.batches() for r in b]
    columns = {**BASE, **{name: source.types[name] for name in views}}
    layout = OutputLayout(tmp_path / "out")
    writer = ShardWriter(layout, "parquet", columns, 2, 3600)
    writer.add_group([{"index": i, "id": str(i), **v} for i, v in enumerate(reversed(read))])
    writer.commit()
    final = tmp_path / "out" / "results.parquet"
    write_final(layout, "parquet", final)
    got = pq.read_table(final)
    assert {c: got.column(c).to_pylist() for c in views} == {
        c: list(reversed(a.to_pylist())) for c, a in views.items()
    }
