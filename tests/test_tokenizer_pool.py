"""Tokenizer processes: rows and texts made in a worker process equal those made in the job's
own process, a job with them writes the same results, and they end with the job's process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from batchgen.engine.detokenize import output_texts
from batchgen.engine.sampling_params import SamplingParams
from batchgen.errors import BatchgenError
from batchgen.io import RawRow
from batchgen.job import run_job
from batchgen.prompts import PromptBuilder, PromptConfig
from batchgen.spec import load_spec
from batchgen.tokenizer_pool import (
    DECODE_CHUNK_TOKENS,
    TokenizerPool,
    prepare_rows,
)
from tests.test_job import read_rows, spec_for, write_jsonl

ROWS = [
    (
        RawRow(0, {"uid": "a", "prompt": "Hello there, how are you?", "k": [1, {"x": "é"}]}, None),
        None,
    ),
    (RawRow(1, None, "line 2 is not valid JSON"), None),
    (RawRow(2, {"uid": "a", "prompt": "A repeated id.", "k": 2}, None), "a"),
    (RawRow(3, {"uid": "c", "prompt": "", "k": 3}, None), None),  # empty prompt: error row
    (RawRow(4, {"uid": "d", "prompt": "x " * 200, "k": None}, None), None),  # long
    (RawRow(5, {"uid": "e", "prompt": "Short.", "sampling": '{"temperature": -1}'}, None), None),
]


def wait_started(pool: TokenizerPool, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pool.in_processes:
        assert time.monotonic() < deadline, "the tokenizer process did not start"
        time.sleep(0.05)


def test_a_worker_process_prepares_and_decodes_as_the_job_process_does(model_dir) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir("llama"))
    config = PromptConfig(id_column="uid", passthrough=("k",), sampling_column="sampling")
    builder = PromptBuilder(config, tok, 64, SamplingParams(max_new_tokens=4))
    ids = [tok("Some text, decoded back.").input_ids, [], [tok.eos_token_id, 7], [5]]
    seqs = [(ids[0][:3], x) for x in ids] + [((), x) for x in ids]  # (context, output)
    seqs = seqs * (2 * DECODE_CHUNK_TOKENS // len(ids[0]))  # more than one decode task
    pool = TokenizerPool(builder, tok, "uid", threads=1, processes=2)
    try:
        wait_started(pool)
        pool.builder = pool.tokenizer = None  # from here only the workers can do the work
        got = pool.prepare(ROWS, hash_rows=True).result(timeout=120)
        texts = pool.decode(seqs)
    finally:
        pool.close()
    assert got == prepare_rows(builder, ROWS, "uid", True)
    assert [r.error is None for r in got] == [True, False, False, False, True, False]
    assert texts == output_texts(tok, seqs)


def test_a_job_with_tokenizer_processes_writes_the_same_rows(model_dir, tmp_path: Path) -> None:
    model = model_dir("llama")
    rows = [{"id": f"r{i}", "prompt": f"Tell me about item {i}.", "k": i} for i in range(10)]
    rows[3]["prompt"] = ""  # an error row
    rows[6]["id"] = "r5"  # a duplicate id
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    sets = (
        "sampling.max_new_tokens=6",
        "sampling.logprobs=2",
        "prompt.id_column='id'",
        "prompt.passthrough=['k']",
        "output.format='jsonl'",
        "output.include_token_ids=true",
    )
    results = []
    for processes in (0, 1):
        out = tmp_path / f"out-{processes}"
        spec = spec_for(model, inp, out, *sets, f"runtime.tokenizer_processes={processes}")
        assert run_job(spec).complete
        results.append(read_rows(out))
    assert results[0] == results[1]
    assert [r["error"] is None for r in results[0]].count(False) == 2
    assert all(r["logprobs"] for r in results[0] if r["error"] is None)


SCRIPT = """
import sys, time
from pathlib import Path
from transformers import AutoTokenizer
from batchgen.engine.sampling_params import SamplingParams
from batchgen.prompts import PromptBuilder, PromptConfig
from batchgen.tokenizer_pool import TokenizerPool
with open(sys.argv[2], "a") as marks:  # once per run of this script (no __main__ guard)
    marks.write("ran\\n")
tok = AutoTokenizer.from_pretrained(sys.argv[1])
builder = PromptBuilder(PromptConfig(), tok, 64, SamplingParams())
pool = TokenizerPool(builder, tok, None, threads=1, processes=2)
while not pool.in_processes:
    time.sleep(0.05)
pool.decode([((), [5] * 64)] * 200)  # both workers running
print(" ".join(str(w.process.pid) for w in pool.workers), flush=True)
time.sleep(600)
"""


def test_tokenizer_processes_end_when_the_job_process_is_killed(model_dir, tmp_path) -> None:
    """...and do not run the caller's script again (it has no __main__ guard here)."""
    script, marks = tmp_path / "job.py", tmp_path / "marks"
    script.write_text(SCRIPT)
    job = subprocess.Popen(
        [sys.executable, str(script), str(model_dir("llama")), str(marks)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        workers = [int(pid) for pid in job.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(pid) for pid in workers)
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, f"tokenizer processes {workers} outlived the job"
        time.sleep(0.05)
    assert marks.read_text() == "ran\n"


def _alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie (its parent died; init reaps it)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return status.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("bad", ["-1", "65", "1.5", "'two'"])
def test_tokenizer_processes_setting_is_checked(bad: str) -> None:
    sets = ["input.path='x.jsonl'", "output.dir='out'", f"runtime.tokenizer_processes={bad}"]
    with pytest.raises(BatchgenError, match="tokenizer_processes"):
        load_spec(None, sets)


def _started_pool(model_dir, warnings: list[str]) -> tuple[TokenizerPool, Any]:
    tok = AutoTokenizer.from_pretrained(model_dir("llama"))
    config = PromptConfig(id_column="uid", passthrough=("k",), sampling_column="sampling")
    builder = PromptBuilder(config, tok, 64, SamplingParams(max_new_tokens=4))
    pool = TokenizerPool(builder, tok, "uid", threads=1, processes=2, warn=warnings.append)
    wait_started(pool)
    return pool, tok


def _decode_tasks(tok: Any) -> list[tuple[Any, list[int]]]:
    ids = tok("Some text, decoded back.").input_ids
    return [(ids[:3], ids), ((), ids)] * (2 * DECODE_CHUNK_TOKENS // len(ids))


def test_tokenizer_processes_outlive_a_sigterm_to_the_process_group(model_dir) -> None:
    """A SIGTERM to the whole group is the job's to handle: the workers go on answering."""
    warnings: list[str] = []
    pool, tok = _started_pool(model_dir, warnings)
    try:
        for worker in pool.workers:
            worker.process.send_signal(signal.SIGTERM)
        got = pool.prepare(ROWS, hash_rows=True).result(timeout=120)
        texts = pool.decode(_decode_tasks(tok))
        assert all(worker.process.poll() is None for worker in pool.workers)
        assert pool.in_processes and warnings == []
    finally:
        pool.close()
    assert got == prepare_rows(pool.builder, ROWS, "uid", True)
    assert texts == output_texts(tok, _decode_tasks(tok))


def test_a_killed_tokenizer_process_costs_no_rows(model_dir) -> None:
    """A worker killed mid-job (the OOM killer): its tasks and all later ones run in the job's
    process, with the same results and one warning."""
    warnings: list[str] = []
    pool, tok = _started_pool(model_dir, warnings)
    try:
        for worker in pool.workers:
            worker.process.kill()
            worker.process.wait()
        texts = pool.decode(_decode_tasks(tok))
        got = [pool.prepare(ROWS, hash_rows=True).result(timeout=120) for _ in range(3)]
        assert not pool.in_processes
    finally:
        pool.close()
    assert got == [prepare_rows(pool.builder, ROWS, "uid", True)] * 3
    assert texts == output_texts(tok, _decode_tasks(tok))
    assert len(warnings) == 1 and "tokenizer process" in warnings[0], warnings
    assert "exit code -9" in warnings[0]


def test_a_killed_tokenizer_process_mid_prepare_costs_no_rows(model_dir) -> None:
    """The first task to see the worker gone is a prepare: it is run again in this process."""
    warnings: list[str] = []
    pool, _ = _started_pool(model_dir, warnings)
    try:
        pool.workers[0].process.kill()
        pool.workers[0].process.wait()
        got = [pool.prepare(ROWS, hash_rows=False).result(timeout=120) for _ in range(2)]
    finally:
        pool.close()
    assert got == [prepare_rows(pool.builder, ROWS, "uid", False)] * 2
    assert len(warnings) == 1, warnings


def test_a_worker_whose_job_is_gone_ends_without_a_traceback() -> None:
    """The job's process killed while a worker answers (its pipe's reader gone): the worker
    returns quietly, as the engine's server does, instead of printing a BrokenPipeError on
    the job's terminal."""
    import io
    import pickle

    from batchgen.tokenizer_pool import _serve

    requests = io.BytesIO(pickle.dumps((None, None)) + pickle.dumps(("ping", ())))
    read, write = os.pipe()
    os.close(read)
    answers = os.fdopen(write, "wb")
    _serve(requests, answers)  # returns: no exception
    assert answers.closed, "closed, so that nothing is left to flush at the worker's exit"
