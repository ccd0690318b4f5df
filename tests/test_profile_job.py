"""A job run with --profile (CPU): its records, the report whose causes add up to the measured
idle time, the picture and the trace; profiling is no part of the resume identity."""

from __future__ import annotations

import json
import struct
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.job import Hooks, run_job
from batchgen.profile import recorder
from batchgen.profile.attribution import attribute
from batchgen.profile.records import CAUSES
from batchgen.profile.report import write_report
from batchgen.profile.store import read_records
from tests.test_job import spec_for, write_jsonl

ROWS = [{"prompt": f"Tell me about item {i} and the weather."} for i in range(8)]
SETS = (
    "sampling.max_new_tokens=5",
    "sampling.ignore_eos=true",
    "runtime.max_num_seqs=3",
    "runtime.enable_prefix_caching=false",
)


@pytest.fixture(scope="module")
def profiled(model_dir, tmp_path_factory) -> tuple[Path, Path, dict]:
    """-> (output dir, records file, summary) of a job run once through the CLI."""
    tmp = tmp_path_factory.mktemp("profiled")
    inp = write_jsonl(tmp / "in.jsonl", ROWS)
    out = tmp / "out"
    args = ["run", "--model", str(model_dir("llama")), "--input", str(inp), "--output", str(out)]
    args += ["--quiet", "--profile", "--set", "runtime.device='cpu'"]
    for item in SETS:
        args += ["--set", item]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    files = list((out / "profile").glob("steps-*.parquet"))
    assert len(files) == 1 and f"batchgen report {out}" in result.output
    summary = json.loads((out / "summary.json").read_text())
    return out, files[0], summary


def test_records_hold_every_token_and_the_job_queues(profiled) -> None:
    _, path, summary = profiled
    _, records = read_records(path)
    assert sum(r.prefill_tokens for r in records) == summary["run_prompt_tokens"]
    assert sum(r.decode_tokens for r in records) == summary["run_generated_tokens"] - len(ROWS)
    assert all(r.tokenizer_depth >= 0 and r.writer_lag >= 0 for r in records)
    assert max(r.writer_lag for r in records) > 0  # rows wait for their shard's commit
    assert records[0].tokenizer_depth > 0 and not pq.read_table(path).column("cause").null_count
    assert not list(Path(path).parent.parent.glob("shards/*profile*"))


def test_the_causes_add_up_to_the_measured_idle_time(profiled) -> None:
    out, path, _ = profiled
    table = pq.read_table(path)
    info, records = read_records(path)
    # measured independently of the attribution: the wall minus each step's busy time
    begins, ends = (
        table.column("host_begin_ms").to_pylist(),
        table.column("host_end_ms").to_pylist(),
    )
    assert all(b >= e for b, e in zip(begins[1:], ends, strict=False))  # disjoint, in order
    idle = info.stop_host_ms - sum(e - b for b, e in zip(begins, ends, strict=True))
    result = CliRunner().invoke(main, ["report", str(out), "--top", "3"])
    assert result.exit_code == 0, result.output
    rows = {}
    for line in result.output.splitlines():
        for cause in (*CAUSES, "total idle"):
            if line.startswith(cause):
                rows[cause] = float(line[len(cause) :].split()[0])
    assert set(rows) == {*CAUSES, "total idle"}
    assert sum(rows[c] for c in CAUSES) == pytest.approx(idle, abs=0.26)  # 5 roundings
    assert rows["total idle"] == pytest.approx(idle, abs=0.06)
    # the stored causes are the rule's
    steps, causes = table.column("step").to_pylist(), table.column("cause").to_pylist()
    stored = dict(zip(steps, causes, strict=True))
    assert stored == {g.step: g.cause for g in attribute(records, info).gaps if g.step is not None}
    assert (
        "largest gaps (3 of" in result.output and "busy is each step's host time" in result.output
    )


def test_report_writes_a_picture_and_a_trace(profiled, tmp_path: Path) -> None:
    report = write_report(profiled[0], tmp_path / "elsewhere")
    assert report.timeline.parent == tmp_path / "elsewhere"
    data = report.timeline.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1400, 360)
    trace = json.loads(report.trace.read_text())["traceEvents"]
    steps = [e for e in trace if e.get("cat") == "step"]
    gaps = [e for e in trace if e.get("cat") == "gap"]
    assert len(steps) == report.result.steps and all(e["ph"] == "X" for e in steps + gaps)
    assert {e["name"].removeprefix("idle: ") for e in gaps} <= set(CAUSES)
    idle_us = sum(e["dur"] for e in gaps)
    assert idle_us / 1e3 == pytest.approx(report.result.idle_ms, abs=0.05)


def test_report_errors_are_one_line(profiled, tmp_path: Path) -> None:
    for args, message in (
        ([str(tmp_path)], f"no profile records in {tmp_path}: run the job with --profile"),
        ([str(tmp_path / "none")], "does not exist"),
        ([str(profiled[0]), "--run", "nope"], "no profile records of run 'nope'"),
        (
            [str(profiled[0]), "--out", str(tmp_path / "a-file" / "x")],
            f"cannot write the report into '{tmp_path / 'a-file' / 'x'}' (Not a directory): "
            "give a writable folder with --out",
        ),
    ):
        (tmp_path / "a-file").write_text("not a folder")
        result = CliRunner().invoke(main, ["report", *args])
        assert result.exit_code == 2 and message in result.output
        assert len(result.output.strip().splitlines()) == 1


def test_profiling_is_not_part_of_the_resume_identity(model_dir, tmp_path: Path) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", ROWS[:3])
    spec = spec_for(model_dir("llama"), inp, tmp_path / "out", *SETS)
    assert run_job(spec).complete
    leftover = tmp_path / "out" / "profile" / ".tmp-1-steps-x.parquet"  # a killed flush's
    leftover.parent.mkdir()
    leftover.write_bytes(b"partial")
    again = run_job(
        spec_for(model_dir("llama"), inp, tmp_path / "out", *SETS, "runtime.profile=true")
    )
    assert again.summary.resumed and again.summary.run_rows_ok == 0 and again.profile_file
    assert not leftover.exists()  # removed with the other temporary files on resume
    assert "steps" in write_report(tmp_path / "out").text  # a run that launched nothing


def test_records_are_flushed_while_the_job_runs(model_dir, tmp_path: Path, monkeypatch) -> None:
    """A killed run keeps the records of its last flush: here, a copy taken mid-run."""
    monkeypatch.setattr(recorder, "FLUSH_EVERY_S", 0.0)
    inp = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out"
    copy = tmp_path / "killed" / "profile" / "steps-mid.parquet"

    copied = threading.Event()

    def on_rows(rows: list) -> None:  # the writer thread, while rows 4.. are held back
        if copied.is_set():
            return
        deadline = time.monotonic() + 300  # a safety net, not a condition
        while not (files := list((out / "profile").glob("steps-*.parquet"))):
            assert time.monotonic() < deadline, "no records were flushed"
            time.sleep(0.01)
        copy.parent.mkdir(parents=True)
        copy.write_bytes(files[0].read_bytes())
        copied.set()

    spec = spec_for(model_dir("llama"), inp, out, *SETS, "runtime.profile=true")
    hooks = Hooks(on_rows=on_rows, admit=lambda index: index < 4 or copied.is_set())
    result = run_job(spec, hooks=hooks)
    assert result.complete
    info, records = read_records(copy)
    assert info.stop_host_ms is None and len(records) > 0
    assert len(records) < len(read_records(Path(result.profile_file))[1])
    assert "killed: records up to the last flush" in write_report(tmp_path / "killed").text


def test_an_engine_in_its_own_process_is_profiled_there(model_dir, tmp_path: Path) -> None:
    """The default on a GPU: the engine server records its own steps and writes them; the
    rows are those of the same job unprofiled, and the report reads the records."""
    inp = write_jsonl(tmp_path / "in.jsonl", ROWS)
    sets = (*SETS, "runtime.engine_process='process'")
    assert run_job(spec_for(model_dir("llama"), inp, tmp_path / "plain", *sets)).complete
    out = tmp_path / "out"
    result = run_job(spec_for(model_dir("llama"), inp, out, *sets, "runtime.profile=true"))
    assert result.complete and "engine_process" in result.summary.startup_s
    assert result.profile_file == str(next((out / "profile").glob("steps-*.parquet")))
    info, records = read_records(Path(result.profile_file))
    summary = result.summary
    assert info.stop_host_ms is not None and info.max_num_seqs == 3
    assert sum(r.prefill_tokens for r in records) == summary.run_prompt_tokens
    assert sum(r.decode_tokens for r in records) == summary.run_generated_tokens - len(ROWS)
    # the rows that wait in the engine's process are its tokenizer gauge; the writer is not
    assert all(r.tokenizer_depth >= 0 and r.writer_lag is None for r in records)
    assert max(r.tokenizer_depth for r in records) > 0
    assert "steps" in write_report(out).text
    rows = {name: pq.read_table(tmp_path / name / "results.parquet").to_pylist()
            for name in ("plain", "out")}  # fmt: skip
    assert rows["out"] == rows["plain"]


def test_a_profile_the_engine_process_cannot_write_is_a_warning(
    model_dir, tmp_path: Path, capsys
) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", ROWS[:3])
    out = tmp_path / "out"

    def block_the_folder(layout, committed) -> None:  # once the job has claimed the directory
        layout.profile.write_text("a file where the records' folder would be")

    sets = (*SETS, "runtime.engine_process='process'", "runtime.profile=true")
    spec = spec_for(model_dir("llama"), inp, out, *sets)
    result = run_job(spec, hooks=Hooks(on_start=block_the_folder))
    assert result.complete and result.summary.rows_ok == 3 and result.profile_file is None
    assert "the profile records could not be written" in capsys.readouterr().err
