"""Bad rows become error rows and the job goes on; a bad job is one line before any work; a
fault mid-run keeps every committed row and the rerun completes exactly once."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen import BatchgenError
from batchgen.cli import EXIT_INTERNAL_ERROR, main
from batchgen.io import writer as writer_module
from batchgen.job import run_job
from batchgen.summary import process_age_s
from tests.test_job import read_rows, spec_for, write_jsonl

GOOD = {"id": "good", "prompt": "Tell me something."}


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


# Raw JSONL lines (JSON text, so lone surrogates can be written as escapes) -> expected error.
BAD_LINES = {
    "surrogate-prompt": ('{"id": "sp", "prompt": "bad \\udc00 text"}', "not valid Unicode"),
    "surrogate-id": ('{"id": "x\\udc00", "prompt": "hi"}', "not valid Unicode"),
    "surrogate-pass": ('{"id": "spt", "prompt": "hi", "tag": "\\ud800"}', "column 'tag'"),
    "sampling-number": ('{"id": "sn", "prompt": "hi", "s": 5}', "object of sampling"),
    "stop-ids-int": ('{"id": "si", "prompt": "hi", "s": {"stop_token_ids": 5}}', "stop_token_ids"),
    "stop-int": ('{"id": "st", "prompt": "hi", "s": {"stop": 5}}', "stop=5"),
    "huge-n": ('{"id": "hn", "prompt": "hi", "s": {"n": 100000000}}', "n=100000000"),
    "inf-tokens": ('{"id": "it", "prompt": "hi", "s": {"max_new_tokens": Infinity}}', "max_new"),
    "list-tokens": ('{"id": "lt", "prompt": "hi", "s": {"max_new_tokens": [1]}}', "max_new"),
    "deep-pass": (json.dumps({"id": "dp", "prompt": "hi", "tag": nested(50)}), "nested"),
}


def test_parquet_strings_that_are_not_utf8_are_error_rows(model_dir, tmp_path: Path) -> None:
    """pyarrow reads string bytes that are not UTF-8 (from writers that do not check) and
    fails only as they become Python: such a row (prompt, id or pass-through column) is an
    error row naming its column, as a JSONL line's bad bytes are, and the job goes on, alone
    and when a resume reads the committed rows' ids alone."""

    def text(values: list[bytes]) -> pa.Array:
        return pa.array(values, pa.binary()).view(pa.string())  # not checked

    inp = tmp_path / "in.parquet"
    ids = [b"r0", b"r1", b"r2", b"r\xfe3", b"r4", b"r5"]
    prompts = [b"a", b"b \xff", b"c", b"d", b"e", b"f"]
    tags = [b"x", b"x", b"\xc3", b"x", b"x", b"x"]
    table = pa.table({"id": text(ids), "prompt": text(prompts), "tag": text(tags)})
    pq.write_table(table, inp, row_group_size=2)
    sets = ("prompt.id_column='id'", "sampling.max_new_tokens=2", "output.shard_rows=1")
    sets += ("prompt.passthrough=['tag']",)
    out = tmp_path / "out"
    spec = spec_for(model_dir("llama"), inp, out, *sets)
    first = run_job(spec)
    assert first.complete
    rows = read_rows(out)
    assert [r["index"] for r in rows] == list(range(6))
    errors = {r["index"]: r["error"] for r in rows if r["error"] is not None}
    assert set(errors) == {1, 2, 3}, errors
    assert "column 'prompt' is not valid UTF-8 (byte 0xff at 3)" in errors[1]
    assert "column 'tag' is not valid UTF-8" in errors[2]
    assert "column 'id' is not valid UTF-8" in errors[3]
    assert [r["id"] for r in rows if r["index"] in (0, 4, 5)] == ["r0", "r4", "r5"]
    # a resume with rows 4 and 5 left: row groups 0 and 1 are read as their ids alone
    for shard in (out / "shards").glob("part-*"):
        if min(pq.read_table(shard).column("index").to_pylist()) >= 4:
            shard.unlink()
    again = run_job(spec)
    assert again.complete and [r["index"] for r in read_rows(out)] == list(range(6))


def lines_input(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_rows_that_used_to_kill_the_job_are_error_rows(model_dir, tmp_path: Path, fmt: str):
    model = model_dir("llama")
    lines = [
        json.dumps(GOOD),
        *(line for line, _ in BAD_LINES.values()),
        json.dumps(GOOD | {"id": "good-2"}),
    ]
    spec = spec_for(
        model,
        lines_input(tmp_path, lines),
        tmp_path / "out",
        "prompt.id_column='id'",
        "prompt.sampling_column='s'",
        "prompt.passthrough=['tag']",
        "sampling.max_new_tokens=4",
        f"output.format='{fmt}'",
    )
    result = run_job(spec)
    assert result.complete
    rows = read_rows(tmp_path / "out")
    assert [r["index"] for r in rows] == list(range(len(lines)))
    assert rows[0]["error"] is None and rows[-1]["error"] is None
    for row, (name, (_, message)) in zip(rows[1:-1], BAD_LINES.items(), strict=True):
        assert row["finish_reason"] == "error", name
        assert message in row["error"], (name, row["error"])
    assert rows[2]["id"] == "x\\udc00", "an id that cannot be written is escaped, not dropped"


def test_chat_rows_with_bad_messages_are_error_rows(model_dir, tmp_path: Path) -> None:
    rows = [
        {"id": "ok", "m": [{"role": "user", "content": "hi"}]},
        {"id": "str-item", "m": ["hello"]},
        {"id": "no-role", "m": [{"content": "hi"}]},
    ]
    for system in (None, "Be brief."):
        out = tmp_path / f"out-{system is None}"
        sets = ["prompt.messages_column='m'", "prompt.id_column='id'", "sampling.max_new_tokens=3"]
        if system:
            sets.append(f"prompt.system_prompt='{system}'")
        assert run_job(
            spec_for(model_dir("llama"), write_jsonl(tmp_path / "c.jsonl", rows), out, *sets)
        ).complete
        got = read_rows(out)
        assert got[0]["error"] is None
        assert "message 0 must be an object with a string role" in got[1]["error"]
        assert "message 0 has no role: give each message a role as text" in got[2]["error"]


def test_over_long_rows_are_refused_by_length_before_tokenizing(model_dir, tmp_path: Path) -> None:
    model = model_dir("llama", max_position_embeddings=64)
    huge = "word " * 400_000  # 2 MB: far more than 64 tokens could ever cover
    inp = write_jsonl(tmp_path / "in.jsonl", [GOOD, {"id": "huge", "prompt": huge}])
    sets = ("prompt.id_column='id'", "sampling.max_new_tokens=4")
    assert run_job(spec_for(model, inp, tmp_path / "out", *sets)).complete
    rows = read_rows(tmp_path / "out")
    assert rows[0]["error"] is None and "characters" in rows[1]["error"]
    left = spec_for(model, inp, tmp_path / "left", *sets, "prompt.truncate='left'")
    assert run_job(left).complete
    rows = read_rows(tmp_path / "left")
    assert rows[1]["error"] is None and rows[1]["num_prompt_tokens"] <= 60


def test_non_finite_numbers_in_jsonl_output_are_null(model_dir, tmp_path: Path) -> None:
    inp = lines_input(tmp_path, ['{"id": "a", "prompt": "hi", "x": NaN, "y": [Infinity, 1.5]}'])
    spec = spec_for(
        model_dir("llama"), inp, tmp_path / "out", "prompt.passthrough=['x', 'y']",
        "output.format='jsonl'", "sampling.max_new_tokens=2",
    )  # fmt: skip
    assert run_job(spec).complete
    text = (tmp_path / "out" / "results.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    row = json.loads(text)
    assert row["x"] is None and row["y"] == [None, 1.5]


# ---------------------------------------------------------------- faults mid-run


def _fail_commits(monkeypatch, fail_on: set[int], error: OSError) -> list[int]:
    """Make the shard encoder fail on the given commit numbers (0-based); -> commit counter."""
    calls = [0]
    real = writer_module.encode_parquet

    def encode(rows, columns, f):
        n = calls[0]
        calls[0] += 1
        if n in fail_on:
            raise error
        return real(rows, columns, f)

    monkeypatch.setattr(writer_module, "encode_parquet", encode)
    return calls


@pytest.mark.parametrize("when", ["mid-run", "last-commit"])
def test_a_full_disk_stops_the_job_and_the_rerun_completes(
    model_dir, tmp_path: Path, monkeypatch, when: str
) -> None:
    model = model_dir("llama")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i}."} for i in range(42)])
    sets = ("output.shard_rows=4", "sampling.max_new_tokens=6", "runtime.max_num_seqs=4")
    full = OSError(errno.ENOSPC, "No space left on device")
    fail = {2} if when == "mid-run" else {10}  # 10: the 11th shard, 2 rows, the final commit
    calls = _fail_commits(monkeypatch, fail, full)
    with pytest.raises(BatchgenError, match=r"the disk is full.*run the same command again"):
        run_job(spec_for(model, inp, tmp_path / "out", *sets))
    if when == "mid-run":
        assert calls[0] <= 4, "the engine stopped right after the writer failed"
    summary = tmp_path / "out" / "summary.json"
    assert not summary.exists() or not json.loads(summary.read_text())["complete"]
    monkeypatch.undo()
    result = run_job(spec_for(model, inp, tmp_path / "out", *sets))
    assert result.complete and result.summary.rows_committed_total == 42
    assert [r["index"] for r in read_rows(tmp_path / "out")] == list(range(42))


@pytest.mark.parametrize("write", ["lock", "manifest", "summary"])
def test_a_full_disk_at_the_jobs_own_files_is_the_same_line_and_the_rerun_completes(
    model_dir, tmp_path: Path, monkeypatch, write: str
) -> None:
    """Not only shards: the lock's owner, the manifest and summary.json failing for a full
    disk stop the job with the same one line (exit 2 from the command line, not an internal
    error), and the rerun completes."""
    import batchgen.io.checkpoint as checkpoint
    import batchgen.job as job_module

    model = model_dir("llama")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i}."} for i in range(6)])
    out = tmp_path / "out"
    sets = ("output.shard_rows=4", "sampling.max_new_tokens=4")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if write == "lock":
        monkeypatch.setattr(checkpoint, "_write_owner", full)
    elif write == "manifest":
        monkeypatch.setattr(job_module, "write_manifest", full)
    else:
        real = job_module.write_json_atomic
        monkeypatch.setattr(
            job_module, "write_json_atomic",
            lambda path, *a, **k: full() if path.name == "summary.json" else real(path, *a, **k),
        )  # fmt: skip
    with pytest.raises(
        BatchgenError, match=r"^writing results into .* failed \(the disk is full\)"
    ):
        run_job(spec_for(model, inp, out, *sets))
    if write == "lock":
        assert not out.exists(), "the folder the run made is removed with its lock"
    monkeypatch.undo()
    result = run_job(spec_for(model, inp, out, *sets))
    assert result.complete and [r["index"] for r in read_rows(out)] == list(range(6))


def test_an_output_directory_removed_mid_run_is_one_line_then_resumes(
    model_dir, tmp_path: Path, monkeypatch
) -> None:
    import shutil

    model = model_dir("llama")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i}."} for i in range(20)])
    out = tmp_path / "out"
    sets = ("output.shard_rows=4", "sampling.max_new_tokens=6", "runtime.max_num_seqs=4")
    real = writer_module.encode_parquet
    calls = [0]

    def encode(rows, columns, f):
        calls[0] += 1
        if calls[0] == 2:
            shutil.rmtree(out)
        return real(rows, columns, f)

    monkeypatch.setattr(writer_module, "encode_parquet", encode)
    with pytest.raises(BatchgenError, match=r"writing results into .* failed"):
        run_job(spec_for(model, inp, out, *sets))
    monkeypatch.undo()
    assert run_job(spec_for(model, inp, out, *sets)).complete
    assert [r["index"] for r in read_rows(out)] == list(range(20))


def test_leftovers_of_a_kill_during_the_final_merge_or_the_first_manifest(
    model_dir, tmp_path: Path
) -> None:
    """What a SIGKILL leaves in these two moments: a temp file beside a missing final file,
    and a temp manifest in an otherwise empty directory. Both reruns complete exactly once."""
    model = model_dir("llama")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i}."} for i in range(6)])
    out = tmp_path / "merge"
    assert run_job(spec_for(model, inp, out, "sampling.max_new_tokens=3")).complete
    (out / "results.parquet").rename(out / ".tmp-4242-results.parquet")
    (out / ".tmp-4242-results.parquet").write_bytes(b"PAR1 half")
    again = run_job(spec_for(model, inp, out, "sampling.max_new_tokens=3"))
    assert again.complete and again.summary.run_rows_ok == 0
    assert [r["index"] for r in read_rows(out)] == list(range(6))
    assert not list(out.glob(".tmp-*"))
    fresh = tmp_path / "manifest"
    fresh.mkdir()
    (fresh / ".tmp-4242-job.json").write_text('{"version": 2, "sp')
    assert run_job(spec_for(model, inp, fresh, "sampling.max_new_tokens=3")).complete
    assert len(read_rows(fresh)) == 6


# ---------------------------------------------------------------- one line, before any work


def cli(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, [line for line in result.output.splitlines() if line.strip()]


@pytest.fixture
def base(model_dir, tmp_path: Path) -> list[str]:
    inp = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    return ["--model", str(model_dir("llama")), "--input", str(inp), "--quiet"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--set", "prompt.truncate=inf"], "prompt.truncate = inf: expected a string"),
        (["--set", "prompt.truncate=['left']"], "prompt.truncate"),
        (["--set", "runtime.device='tpu'"], "device='tpu' is not allowed"),
        (["--set", "runtime.attention_backend='triton'"], "runs on a CUDA GPU"),
        (["--set", "runtime.cuda_graph_capture='lazy'"], "use first_use or startup"),
        (["--max-new-tokens", "5", "--set", "sampling.max_new_tokens=6"], "given twice"),
    ],
)
def test_bad_settings_are_one_line(base, tmp_path: Path, monkeypatch, extra, message) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the kernel tests set it
    code, lines = cli("run", *base, "--output", str(tmp_path / "out"), *extra)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "out" / "job.json").exists()


def test_output_directory_that_is_a_file_or_inside_one(base, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    for out, message in ((tmp_path / "afile", "is a file"), (tmp_path / "afile" / "o", "afile")):
        code, lines = cli("run", *base, "--output", str(out))
        assert code == 2 and len(lines) == 1 and message in lines[0], lines


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_directory(base, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    code, lines = cli("run", *base, "--output", str(ro / "out"))
    assert code == 2 and len(lines) == 1 and "writable" in lines[0], lines


def test_a_column_only_a_partition_folder_names_is_refused_saying_so(tmp_path: Path) -> None:
    """Hive partition folders (year=2024/) are not read as columns (as Hugging Face datasets
    reads them): a job naming one is refused with one line that says so."""
    for year in (2024, 2025):
        (tmp_path / "in" / f"year={year}").mkdir(parents=True)
        table = pa.table({"prompt": ["hi"], "k": [year]})
        pq.write_table(table, tmp_path / "in" / f"year={year}" / "part-0.parquet")
    base = ("validate", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "o"))
    code, lines = cli(*base, "--set", "prompt.passthrough=['k', 'year']")
    assert code == 2 and len(lines) == 1, lines
    assert "'year' is a partition folder name (year=...), and batchgen reads only" in lines[0]
    code, lines = cli(*base, "--set", "prompt.passthrough=['month']")
    assert code == 2 and lines[0].endswith("): fix [prompt] or the input"), lines


def test_bad_job_files_and_inputs_are_one_line(model_dir, tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_bytes('[input]\npath = "caf\u00e9.jsonl"\n'.encode("latin-1"))
    code, lines = cli("validate", str(job))
    assert code == 2 and len(lines) == 1 and "not UTF-8" in lines[0], lines
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    code, lines = cli("validate", "--input", str(empty), "--output", str(tmp_path / "o"))
    assert code == 2 and len(lines) == 1 and "holds no rows" in lines[0], lines
    utf16 = tmp_path / "u16.jsonl"
    for encoding in ("utf-16", "utf-16-le", "utf-32-be"):  # with a BOM, and without one
        utf16.write_bytes((json.dumps(GOOD) + "\n").encode(encoding))
        code, lines = cli("validate", "--input", str(utf16), "--output", str(tmp_path / "o"))
        assert code == 2 and len(lines) == 1 and "UTF-16" in lines[0], (encoding, lines)
    weights = tmp_path / "pickled"
    weights.mkdir()
    (weights / "config.json").write_text((model_dir("llama") / "config.json").read_text())
    (weights / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    inp = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    code, lines = cli(
        "run", "--model", str(weights), "--input", str(inp), "--output", str(tmp_path / "w")
    )
    assert code == 2 and len(lines) == 1 and "could not load model" in lines[0], lines


def test_an_unexpected_error_is_one_line_and_a_log(base, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path / "home"))

    def broken(*args, **kwargs):
        raise KeyError("something internal")

    monkeypatch.setattr("batchgen.job.run_job", broken)
    code, lines = cli("run", *base, "--output", str(tmp_path / "out"))
    assert code == EXIT_INTERNAL_ERROR and len(lines) == 1, lines
    assert "internal error (KeyError" in lines[0] and "traceback is in" in lines[0]
    log = Path(lines[0].rsplit("traceback is in ", 1)[1])
    assert "Traceback" in log.read_text() and "something internal" in log.read_text()


def test_parquet_rows_with_surrogates_and_deep_values(model_dir, tmp_path: Path) -> None:
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["hi", "there"], "k": [1, 2]}), inp)
    spec = spec_for(model_dir("llama"), inp, tmp_path / "out", "sampling.max_new_tokens=2")
    assert run_job(spec).complete and len(read_rows(tmp_path / "out")) == 2


def test_a_lost_lock_stops_the_writer_then_the_rerun_completes(
    model_dir, tmp_path: Path, monkeypatch
) -> None:
    """A run whose lock file is removed under it (another run could take the directory) writes
    no further shard."""
    from batchgen.io.checkpoint import DirectoryLock

    model = model_dir("llama")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i}."} for i in range(20)])
    out = tmp_path / "out"
    sets = ("output.shard_rows=4", "sampling.max_new_tokens=6", "runtime.max_num_seqs=4")
    real_check = DirectoryLock.check
    calls = [0]

    def check(self: DirectoryLock) -> None:
        calls[0] += 1
        if calls[0] == 2:
            (out / "job.lock").unlink()
        real_check(self)

    monkeypatch.setattr(DirectoryLock, "check", check)
    with pytest.raises(BatchgenError, match="lost the lock"):
        run_job(spec_for(model, inp, out, *sets))
    assert len(list((out / "shards").glob("part-*"))) == 1
    monkeypatch.undo()
    assert run_job(spec_for(model, inp, out, *sets)).complete
    assert [r["index"] for r in read_rows(out)] == list(range(20))


def test_openai_lines_with_lone_surrogates_or_huge_n_are_error_lines(model_dir, tmp_path: Path):
    lines = [
        '{"custom_id": "ok", "method": "POST", "url": "/v1/completions", '
        '"body": {"prompt": "hi", "max_tokens": 2}}',
        '{"custom_id": "x\\udc00", "method": "POST", "url": "/v1/completions", '
        '"body": {"prompt": "hi", "max_tokens": 2}}',
        '{"custom_id": "big", "method": "POST", "url": "/v1/completions", '
        '"body": {"prompt": "hi", "n": 100000000}}',
        '{"custom_id": "m", "method": "POST", "url": "/v1/completions", '
        '"body": {"prompt": "hi", "model": "\\ud800"}}',
    ]
    spec = spec_for(
        model_dir("llama"), lines_input(tmp_path, lines), tmp_path / "out",
        "input.format='openai-batch'",
    )  # fmt: skip
    assert run_job(spec).complete
    ok = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    bad = [json.loads(x) for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert [json.loads(x)["custom_id"] for x in ok] == ["ok"]
    assert [x["custom_id"] for x in bad] == ["x\\udc00", "big", "m"]  # escaped, not dropped
    codes = [x["response"]["body"]["error"]["code"] for x in bad]
    assert (
        codes[1] == "invalid_value"
        and "n=100000000" in bad[1]["response"]["body"]["error"]["message"]
    )
    assert "not valid Unicode" in bad[0]["response"]["body"]["error"]["message"]


KILL_AT_RENAME = """
import os, sys, time
from pathlib import Path
target, marker = sys.argv[1], Path(sys.argv[2])
real = os.replace
def replace(src, dst, *a, **k):
    if str(dst).endswith(target):  # the file is written whole; stop before it is renamed
        marker.write_text("ready")
        time.sleep(600)
    return real(src, dst, *a, **k)
os.replace = replace
from batchgen.cli import main
main(sys.argv[3:])
"""


@pytest.mark.slow
@pytest.mark.parametrize("target", ["job.json", "results.jsonl"])
def test_sigkill_while_writing_the_manifest_or_the_final_file(
    model_dir, tmp_path: Path, target: str
) -> None:
    """A real SIGKILL at the moment the manifest or the final file is about to become visible;
    the rerun completes exactly once."""
    import signal
    import subprocess
    import sys
    import time

    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i}."} for i in range(6)])
    out, marker = tmp_path / "out", tmp_path / "marker"
    args = ["run", "--model", str(model_dir("llama")), "--input", str(inp), "--output", str(out)]
    args += ["--quiet", "--max-new-tokens", "3", "--output-format", "jsonl"]
    cmd = [sys.executable, "-c", KILL_AT_RENAME, target, str(marker), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (out / target).exists() and list(out.glob(".tmp-*")), "killed before the rename"
    rerun = CliRunner().invoke(main, args)
    assert rerun.exit_code == 0, rerun.output
    assert [r["index"] for r in read_rows(out)] == list(range(6))
    assert not list(out.rglob(".tmp-*"))


def test_a_cli_run_reports_start_up_from_the_process_start(base, tmp_path: Path) -> None:
    """From the CLI the start-up phases begin at the process's start ("process": interpreter,
    imports, the spec) and end at the first committed row."""
    out = tmp_path / "out"
    code, lines = cli("run", *base, "--output", str(out))
    assert code == 0, lines
    phases = json.loads((out / "summary.json").read_text())["startup_s"]
    assert {"process", "checks", "load", "first_row"} <= set(phases)  # the file sorts keys
    assert 0 < phases["process"] <= process_age_s()  # this test's process began before the run
