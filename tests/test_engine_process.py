"""The engine in a process of its own (EngineProcess): the same results as the engine in this
process, calls that stop early, errors in one line, and a server that dies with its job."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from batchgen import BatchgenError, Engine, EngineConfig, SamplingParams
from batchgen.engine import NOT_READY, Prompt
from batchgen.engine.remote import client
from batchgen.engine.remote.client import (
    PIPE_BYTES,
    EngineProcess,
    EngineServer,
    load_key,
    waited_phases,
)
from batchgen.engine.remote.placement import kept_cores, off_cores
from batchgen.engine.remote.protocol import pack_prompt, unpack_prompt
from batchgen.engine.request import VocabChecked
from batchgen.job import run_job
from batchgen.spec import PipelineConfig, load_spec

CPU = EngineConfig(device="cpu")


@pytest.fixture(scope="module")
def model(model_dir) -> Path:
    return model_dir("llama")


@pytest.fixture(scope="module")
def served(model: Path):
    with EngineProcess(str(model), CPU, quiet=True) as engine:
        yield engine


def _prompts() -> list:
    """Token ids (a list, a tuple, numpy's integers), text, overrides (seeded sampling, n,
    logprobs, a stop string), and prompts the engine rejects (empty, outside the vocabulary,
    not token ids: floats, bools, bytes whose length is or is not a multiple of 8, an
    array)."""
    return [
        [5, 6, 7, 8],
        "The weather today is",
        Prompt([9, 10, 11], "sampled", {"temperature": 0.9, "seed": 3, "n": 2}),
        Prompt("Tell me a story", "logprobs", {"logprobs": 2, "max_new_tokens": 5}),
        Prompt([12, 13], "stopped", {"stop": ["e"], "max_new_tokens": 20}),
        Prompt([1, 2, 3], None, None, "seed-key"),
        [],
        [10**12],
        [-3, 4],
        [1.5, 2.5],
        Prompt([True, 5, 6], "bools"),
        Prompt([5, False], "bools at the end"),
        Prompt(b"\x05\x00\x00\x00\x00\x00\x00\x00", "8 bytes"),
        Prompt(b"hello", "5 bytes"),
        Prompt((5, 6, 7), "tuple"),
        Prompt([np.int64(5), np.int32(6)], "numpy ints"),
        Prompt(np.array([5, 6, 7]), "numpy array"),
    ]


def _by_key(outputs) -> dict:
    return {(o.request_id, o.sample_index): o._replace(first_token_time=0.0) for o in outputs}


def test_results_match_the_engine_in_this_process(model: Path, served: EngineProcess) -> None:
    params = SamplingParams(max_new_tokens=7)
    with Engine(str(model), CPU) as engine:
        expected = _by_key(engine.generate(_prompts(), params, decode=True))
    got = _by_key(served.generate(_prompts(), params, decode=True))
    assert got.keys() == expected.keys()
    for key, out in expected.items():
        assert got[key] == out, key
        assert all(type(t) is int for t in got[key].prompt_token_ids), key
    assert {o.finish_reason for o in got.values()} >= {"length", "error"}
    assert not served.has_unfinished()
    # a second call on the same process: its default ids count from 0 again
    again = _by_key(served.generate([[5, 6, 7, 8]], params, decode=True))
    assert again[("0", 0)] == expected[("0", 0)]
    assert served.cache_stats.prompt_tokens > 0
    assert served.max_model_len == engine.max_model_len
    assert served.dtype == engine.dtype and served.fingerprint == engine.fingerprint
    assert served.config == engine.config  # block size and token budget as it resolved them
    assert served.config.block_size == engine.config.block_size == 16
    assert served.config.max_num_batched_tokens == engine.config.max_num_batched_tokens == 8192


def test_a_call_stopped_or_left_early_lets_the_next_one_run(served: EngineProcess) -> None:
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    many = [Prompt([i + 1, 7, 8], str(i), {"max_new_tokens": 2 + i}) for i in range(64)]
    stop = threading.Event()
    taken = []
    for out in served.generate(many, params, stop=stop):
        taken.append(out)
        stop.set()  # after the first result: the step in flight ends the call
    assert 1 <= len(taken) < len(many)
    assert not served.has_unfinished()
    results = served.generate(many, params)
    next(results)
    results.close()  # the caller stops taking results: the server's call is stopped too
    short = list(served.generate([[3, 4]], params.replace(max_new_tokens=2)))
    assert [len(o.output_token_ids) for o in short] == [2]


def test_a_second_call_while_one_is_open_is_refused(served: EngineProcess) -> None:
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    first = [Prompt([5, 6, 7], "a0", {"max_new_tokens": 1}), Prompt([8, 9], "a1")]
    alone = {o.request_id: o.output_token_ids for o in served.generate(first, params)}
    calls = served.generate(first, params)
    taken = [next(calls)]
    with pytest.raises(BatchgenError, match="previous generate call is still open"):
        list(served.generate([[3, 4]], params))
    taken += list(calls)
    assert {o.request_id: o.output_token_ids for o in taken} == alone
    assert len(list(served.generate([[3, 4]], params))) == 1
    (one,) = served.generate("The weather today is", params)  # one text: one prompt
    assert one.finish_reason == "length"


def test_a_list_of_params_is_refused_in_one_line_and_the_engine_serves_on(
    served: EngineProcess,
) -> None:
    """The served engine takes one SamplingParams per call: a list of them (which Engine
    pairs with the prompts) is refused before anything is sent, not failed in the server."""
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    with pytest.raises(BatchgenError, match="one SamplingParams per generate call"):
        list(served.generate([[3, 4], [5, 6]], [params, params]))
    assert len(list(served.generate([[3, 4]], params))) == 1


def test_each_id_is_one_prompts_in_a_served_call(served: EngineProcess) -> None:
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    items = [Prompt([5, 6, 7], "2"), [8, 9], [10, 11], Prompt([5, 6], "2"), [12]]
    outs = list(served.generate(items, params))
    errors = [(o.request_id, o.error) for o in outs if o.finish_reason == "error"]
    assert [rid for rid, _ in errors] == ["2", "2"]  # the position 2; the id given again
    assert "its id is its position, '2'" in errors[0][1]
    assert "ids must be unique" in errors[1][1]
    done = sorted((o.request_id, o.prompt_token_ids) for o in outs if o.error is None)
    assert done == [("1", [8, 9]), ("2", [5, 6, 7]), ("4", [12])]


def test_grammar_errors_and_cache_clearing_are_answered(served: EngineProcess) -> None:
    pytest.importorskip("llguidance")  # structured outputs' extra (make setup installs it)
    with pytest.raises(ValueError, match="regex"):
        served.check_sampling(SamplingParams(regex="("))
    served.check_sampling(SamplingParams(regex="[ab]+"))
    served.clear_prefix_cache()


def test_a_model_that_cannot_load_is_one_clear_error(model: Path) -> None:
    config = EngineConfig(device="cpu", cpu_kv_cache_gib=1e-6)
    with pytest.raises(BatchgenError) as in_process:
        Engine(str(model), config)
    with pytest.raises(BatchgenError) as served:
        EngineProcess(str(model), config, quiet=True)
    assert str(served.value) == str(in_process.value)
    assert "\n" not in str(served.value)
    with pytest.raises(BatchgenError, match="does not exist"):
        EngineProcess("/no/such/model", config)


def test_a_server_killed_mid_call_is_a_one_line_error(model: Path) -> None:
    engine = EngineProcess(str(model), CPU, quiet=True)
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)

    def prompts():
        yield [1, 2, 3]
        engine.server.process.send_signal(signal.SIGKILL)  # while its 200 tokens run
        engine.server.process.wait()
        while True:
            yield NOT_READY

    with pytest.raises(BatchgenError) as failed:
        list(engine.generate(prompts(), params))
    assert "was killed by SIGKILL (out of memory, or killed by hand)" in str(failed.value)
    assert "run the same command again" in str(failed.value)
    with pytest.raises(BatchgenError, match="killed by SIGKILL"):  # and the next call too
        list(engine.generate([[1, 2]], params))
    engine.close()


def test_an_engine_process_failure_brings_its_traceback_to_the_jobs_log(monkeypatch, capfd) -> None:
    """A failure the user did not cause, in the engine's process: its traceback comes with
    the error (the job's crash log holds it, as for an engine in the job's process), and
    nothing goes to the terminal beside the job's one line."""
    import traceback

    from batchgen.engine.remote import server
    from batchgen.engine.remote.client import EngineServer
    from batchgen.engine.remote.protocol import receive

    exits: list[int] = []
    monkeypatch.setattr(server.os, "_exit", exits.append)
    read, write = os.pipe()
    with os.fdopen(write, "wb") as answers:
        try:
            raise RuntimeError("injected engine fault\nsecond line")
        except RuntimeError as exc:
            server._report(answers, exc)
    with os.fdopen(read, "rb") as pipe:
        message = receive(pipe)
    assert exits == [1] and capfd.readouterr().err == ""
    failed = EngineServer.failure(None, message)  # type: ignore[arg-type]
    assert str(failed) == "the engine process failed: RuntimeError: injected engine fault"
    logged = "".join(traceback.format_exception(failed))
    assert "the engine process's traceback:" in logged and "in test_an_engine_process" in logged


@pytest.fixture
def only_here(monkeypatch) -> types.ModuleType:
    """A module only this process has (as a script's __main__ is): the engine's process
    cannot import its types, so it cannot unpickle them."""
    module = types.ModuleType("batchgen_test_only_here")

    class Overrides(dict):
        pass

    class Stops(list):
        pass

    for cls in (Overrides, Stops):
        cls.__module__, cls.__qualname__ = module.__name__, cls.__name__
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def _within(seconds: float, call: Callable[[], Any]) -> Any:
    """call() on a thread -> what it returned, or raises what it raised; fails if it has not
    ended within `seconds` (a safety net for a hang, not a condition)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_overrides_and_seed_keys_of_the_callers_own_types_are_served(model, only_here) -> None:
    """Sampling overrides of a dict subclass, and a seed key of any type, give the results
    they give in this process: they travel as a plain dict and as text."""
    params = SamplingParams(max_new_tokens=3)

    def prompts() -> list[Prompt]:
        return [
            Prompt([5, 6], "a", only_here.Overrides(max_new_tokens=2, n=2, temperature=0.8)),
            Prompt([7, 8], "b", {"temperature": 0.8}, only_here.Stops(["key"])),
        ]

    with Engine(str(model), CPU) as engine:
        expected = _by_key(engine.generate(prompts(), params))
    with EngineProcess(str(model), CPU, quiet=True) as served:
        got = _within(60, lambda: _by_key(served.generate(prompts(), params)))
    assert got == expected and len(got) == 3


def test_a_message_the_engine_process_cannot_read_is_a_one_line_error(model, only_here) -> None:
    """What still cannot reach the engine's process (a type only this one has, inside an
    override) ends the call with one line saying so, never a wait for an answer."""
    params = SamplingParams(max_new_tokens=3)
    bad = Prompt([5, 6], "a", {"stop": only_here.Stops(["x"])})
    with EngineProcess(str(model), CPU, quiet=True) as served:
        with pytest.raises(RuntimeError) as failed:
            _within(60, lambda: list(served.generate([[7, 8], bad], params)))
        why = "cannot read a message from the job's process (ModuleNotFoundError: No module "
        assert why in str(failed.value) and only_here.__name__ in str(failed.value)
        assert "\n" not in str(failed.value)
        with pytest.raises(BatchgenError, match="exited with status 1"):  # and the next call too
            _within(60, lambda: list(served.generate([[7, 8]], params)))


def test_an_answer_this_process_cannot_read_is_a_one_line_error(model, monkeypatch) -> None:
    """An answer the job's side cannot unpickle: the call, and every later one, fails saying
    so, and the server (whose answers are lost) is stopped."""
    real = client.receive

    def receive(pipe: Any) -> tuple:
        message = real(pipe)
        if message[0] == "outputs":
            raise AttributeError("Can't get attribute 'Gone' on <module 'elsewhere'>")
        return message

    monkeypatch.setattr(client, "receive", receive)
    params = SamplingParams(max_new_tokens=3)
    engine = EngineProcess(str(model), CPU, quiet=True)
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError) as failed:
                _within(60, lambda: list(engine.generate([[5, 6]], params)))
            why = "cannot read an answer from the engine process (AttributeError: Can't get "
            assert str(failed.value).startswith(why)
            assert "\n" not in str(failed.value)
        assert engine.server.process.wait(timeout=60) == -signal.SIGKILL
    finally:
        engine.close()


PARENT = """
import sys, time
from batchgen.engine.remote.client import EngineServer
server = EngineServer()
print(server.process.pid, flush=True)
time.sleep(600)
"""


def test_a_server_ends_with_its_job_process(tmp_path: Path) -> None:
    """The job's process killed (SIGKILL, no clean-up): its engine's process goes too."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    assert _alive(pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    """Whether pid runs (a zombie, exited but not yet reaped by init, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _job_spec(model: Path, tmp_path: Path, name: str, place: str, **extra: object):
    inp = tmp_path / "in.jsonl"
    if not inp.exists():
        rows = [{"uid": f"r{i}", "prompt": f"Item {i}: the weather is"} for i in range(30)]
        rows.append({"uid": "bad", "prompt": ""})  # an error row
        inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    values = {
        "model.path": str(model),
        "input.path": str(inp),
        "output.dir": str(tmp_path / name),
        "prompt.id_column": "uid",
        "sampling.max_new_tokens": 6,
        "sampling.n": 2,
        "sampling.temperature": 0.8,
        "runtime.device": "cpu",
        "runtime.quiet": True,
        "runtime.engine_process": place,
        "output.shard_rows": 4,
        **extra,
    }
    return load_spec(None, values=values)


def test_a_job_with_its_engine_in_its_own_process(model: Path, tmp_path: Path) -> None:
    thread = run_job(_job_spec(model, tmp_path, "thread", "thread"))
    own = run_job(_job_spec(model, tmp_path, "process", "process"))
    assert own.complete and thread.complete
    rows = {name: pq.read_table(tmp_path / name / "results.parquet").to_pylist()
            for name in ("thread", "process")}  # fmt: skip
    assert rows["process"] == rows["thread"] and len(rows["thread"]) == 2 * 30 + 1
    phases = own.summary.startup_s
    assert list(phases)[:2] == ["checks", "engine_process"] and "load" in phases
    assert "engine_process" not in thread.summary.startup_s
    assert own.summary.rows_error == thread.summary.rows_error == 1


MODEL_CODE_CHECK = """
import json, sys
from batchgen.job import run_job
from batchgen.spec import load_spec
result = run_job(load_spec(None, values=json.loads(sys.argv[1])))
heavy = ("transformers.modeling_utils", "batchgen.engine.engine", "batchgen.engine.model_loader")
print(json.dumps({"complete": result.complete, "loaded": [m for m in heavy if m in sys.modules]}))
"""


def test_a_job_whose_engine_runs_elsewhere_does_not_load_model_code(model: Path, tmp_path):
    """The job's process reads, tokenizes and writes: transformers' model code (seconds of
    imports on a slow host) is left to the engine's process."""
    spec = _job_spec(model, tmp_path, "light", "process")
    values = {"model.path": str(model), "input.path": str(spec.input.path), "runtime.quiet": True,
              "output.dir": str(tmp_path / "light"), "runtime.device": "cpu",
              "runtime.engine_process": "process", "sampling.max_new_tokens": 2}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", MODEL_CODE_CHECK, json.dumps(values)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"complete": True, "loaded": []}


@pytest.mark.gpu
def test_a_gpu_job_runs_its_engine_in_its_own_process(model: Path, tmp_path: Path) -> None:
    """On a GPU the default (auto) is the engine's own process; the rows are the same (one
    request at a time: GPU logits may move in the last bit with the batch's make-up)."""
    gpu = {"runtime.device": "cuda", "runtime.max_num_seqs": 1, "sampling.n": 1}
    own = run_job(_job_spec(model, tmp_path, "auto", "auto", **gpu))
    thread = run_job(_job_spec(model, tmp_path, "thread", "thread", **gpu))
    assert "engine_process" in own.summary.startup_s
    assert "engine_process" not in thread.summary.startup_s
    rows = {name: pq.read_table(tmp_path / name / "results.parquet").to_pylist()
            for name in ("thread", "auto")}  # fmt: skip
    assert rows["auto"] == rows["thread"]


def test_where_the_engine_runs() -> None:
    auto = PipelineConfig()
    assert auto.own_engine_process(cuda=True)
    assert not auto.own_engine_process(cuda=False)
    assert not auto.own_engine_process(cuda=True, data_parallel=True)
    assert PipelineConfig(profile=True).own_engine_process(cuda=True)  # profiled where it runs
    assert PipelineConfig(engine_process="process").own_engine_process(cuda=False)
    assert not PipelineConfig(engine_process="thread").own_engine_process(cuda=True)
    with pytest.raises(ValueError, match="engine_process='gpu' is not allowed"):
        PipelineConfig(engine_process="gpu")


def test_an_unused_early_server_is_closed(model: Path, tmp_path: Path) -> None:
    """The command line starts a server before it knows torch sees a GPU; a job whose engine
    stays in its process closes it."""
    server = EngineServer()
    result = run_job(_job_spec(model, tmp_path, "early", "thread"), engine_server=server)
    assert result.complete and server.closed
    assert server.process.wait(timeout=60) == 0


def _pipe_limit() -> int:
    try:
        return min(PIPE_BYTES, int(Path("/proc/sys/fs/pipe-max-size").read_text()))
    except OSError:
        return 0


@pytest.mark.skipif(not _pipe_limit(), reason="pipe capacities are Linux's")
def test_prompt_ids_the_jobs_process_checked_skip_the_engine_threads_check(model: Path):
    """Ids all inside the engine's vocabulary travel marked, and the engine takes them as
    they are; anything else, and ids marked for another vocabulary, the engine checks."""
    assert unpack_prompt(pack_prompt([5, 6, 7], "a", 100)[0]) == (Prompt([5, 6, 7], "a"), True)
    marked = unpack_prompt(pack_prompt(Prompt([5, 6, 7], "b", {"n": 2}), "0", 100)[0])[0]
    assert type(marked.prompt) is VocabChecked and marked.prompt.vocab == 100
    for prompt, vocab in (([5, 100], 100), ([-1, 5], 100), ([], 100), ([5, 6], None)):
        row = pack_prompt(prompt, "c", vocab)[0]
        assert row[-1] is None and type(unpack_prompt(row)[0].prompt) is list, prompt
    for prompt in (["x"], [True, 5], b"\x05" * 8, b"hello"):  # not token ids: sent as they are
        row = pack_prompt(prompt, "d", 100)[0]
        assert row[1] is prompt and unpack_prompt(row) == (Prompt(prompt, "d"), False)
    params = SamplingParams(max_new_tokens=3)
    with Engine(str(model), CPU) as engine:
        vocab = engine.shape.vocab_size
        prompts = [VocabChecked([5, 6, 7], vocab), [5, 6, 7], VocabChecked([vocab + 1], vocab + 9)]
        outs = {o.request_id: o for o in engine.generate(prompts, params)}
    assert outs["0"].output_token_ids == outs["1"].output_token_ids != []
    assert type(outs["0"].prompt_token_ids) is list
    assert outs["2"].finish_reason == "error" and "outside the vocabulary" in outs["2"].error


def test_the_servers_pipes_hold_a_wave_of_results() -> None:
    """A wave of 256 rows x 256 tokens (~300 KB pickled) goes into the pipe in one write, not
    in steps the job's reader must drain while the engine thread waits."""
    server = EngineServer()
    try:
        for pipe in (server.process.stdin, server.process.stdout):
            assert fcntl.fcntl(pipe.fileno(), fcntl.F_GETPIPE_SZ) == _pipe_limit() > 300_000
    finally:
        server.close()


@pytest.mark.slow
def test_sigkill_and_sigterm_with_the_engine_in_its_own_process(model: Path, tmp_path) -> None:
    """Exactly once after a SIGKILL of the job's process mid-run, and SIGTERM stops it after
    the step in flight with every handed row committed (tests/test_kill.py's, with the engine
    in a process of its own)."""
    from tests.test_kill import committed, make_job, results, start, wait_for_shards

    extra = ("--set", "runtime.engine_process='process'")
    cmd = make_job(model, tmp_path, "out", extra)
    out = tmp_path / "out"
    proc = start(cmd)
    wait_for_shards(proc, out, 2, timeout=900)
    assert proc.poll() is None, "the job must be mid-run when killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc = start(cmd)
    wait_for_shards(proc, out, committed(out) + 2, timeout=900)
    assert proc.poll() is None, "the job must be mid-run when signalled"
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    final = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    assert final.returncode == 0, final.stderr
    reference = subprocess.run(make_job(model, tmp_path, "ref"), capture_output=True, text=True)
    assert reference.returncode == 0, reference.stderr
    expected, got = results(tmp_path / "ref"), results(out)
    assert {k: r["text"] for k, r in got.items()} == {k: r["text"] for k, r in expected.items()}


def test_an_engine_process_killed_mid_job_stops_the_job_with_exit_1(model: Path, tmp_path) -> None:
    """SIGKILL of the job's engine process (the kernel's, when memory runs out): one line
    naming it and its signal, exit 1 (rows not committed, as a lost rank gives), and the same
    command finishes the job exactly once."""
    from tests.test_data_parallel import children_of
    from tests.test_kill import make_job, results, start, wait_for_shards

    cmd = make_job(model, tmp_path, "out", ("--set", "runtime.engine_process='process'"))
    out = tmp_path / "out"
    proc = start(cmd)
    wait_for_shards(proc, out, 2, timeout=900)
    assert proc.poll() is None, "the job must be mid-run when its engine is killed"
    (engine,) = children_of(proc.pid)
    os.kill(engine, signal.SIGKILL)
    stderr = proc.communicate(timeout=120)[1]
    stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
    assert proc.returncode == 1, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"batchgen: error: the engine process (pid {engine}) was killed by ")
    assert last.endswith(
        "SIGKILL (out of memory, or killed by hand) before it finished: the committed rows are "
        "kept; run the same command again to resume"
    ), last
    final = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    assert final.returncode == 0, final.stderr
    reference = subprocess.run(make_job(model, tmp_path, "ref"), capture_output=True, text=True)
    assert reference.returncode == 0, reference.stderr
    expected, got = results(tmp_path / "ref"), results(out)
    assert {k: r["text"] for k, r in got.items()} == {k: r["text"] for k, r in expected.items()}


def test_the_cores_a_job_keeps_for_its_engine() -> None:
    sixteen = set(range(16))
    assert kept_cores(None, sixteen) == {14, 15}
    assert kept_cores(None, set(range(4))) == frozenset()  # too few to keep any by default
    assert kept_cores(3, sixteen) == {13, 14, 15}
    assert kept_cores(0, sixteen) == frozenset()
    assert kept_cores(16, sixteen) == frozenset()  # never all of them
    rows = load_spec(None, ["input.path='x.jsonl'", "output.dir='out'"])
    assert rows.engine_cores(sixteen) == {14, 15}
    for structured in ("sampling.json_object=true", "input.format='openai-batch'"):
        spec = load_spec(None, ["input.path='x.jsonl'", "output.dir='out'", structured])
        assert spec.engine_cores(sixteen) == frozenset(), structured  # grammar threads need cores
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two cores")
    kept = kept_cores(1, before)
    seen = []
    with off_cores(kept):
        thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        thread.start()
        thread.join()
        assert os.sched_getaffinity(0) == before - kept
    assert seen == [before - kept]  # a thread started inside stays off them too
    assert os.sched_getaffinity(0) == before


def test_an_engine_process_runs_on_the_cores_kept_for_it(model: Path) -> None:
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two cores")
    kept = kept_cores(1, before)
    with EngineProcess(str(model), CPU, quiet=True, cpus=kept) as engine:
        pid = engine.server.process.pid
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        assert len(threads) > 1  # the pipe reader at least
        assert all(_affinity(t) in (kept, None) for t in threads)  # all of them, once loaded
        assert engine.server.cpus == kept
        assert len(list(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2)))) == 1


def _affinity(thread: int) -> set[int] | None:
    """A thread's cores; None once it has ended (between listing and asking)."""
    try:
        return os.sched_getaffinity(thread)
    except ProcessLookupError:
        return None


def test_which_jobs_keep_cores_for_their_engine(model: Path, tmp_path: Path) -> None:
    sixteen = set(range(16))
    plain = _job_spec(model, tmp_path, "a", "process")
    assert plain.engine_cores(sixteen) == {14, 15}
    schema = _job_spec(model, tmp_path, "b", "process", **{"sampling.regex": "[ab]+"})
    assert schema.engine_cores(sixteen) == frozenset()  # its mask fill needs the cores
    per_row = _job_spec(model, tmp_path, "c", "process", **{"prompt.sampling_column": "s"})
    assert per_row.engine_cores(sixteen) == frozenset()
    asked = _job_spec(model, tmp_path, "d", "process", **{"runtime.engine_cpus": 4})
    assert asked.engine_cores(sixteen) == {12, 13, 14, 15}


KEEP_OFF = """
import os, threading
from batchgen.engine.remote.placement import keep_process_off
kept, seen = threading.Event(), []
def look():
    kept.wait()  # already running when the process is kept off the core
    seen.append(os.sched_getaffinity(0))
worker = threading.Thread(target=look)
worker.start()
keep_process_off(frozenset({max(os.sched_getaffinity(0))}))
kept.set()
worker.join()
later = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
later.start()
later.join()
print(*(sorted(s) for s in [*seen, os.sched_getaffinity(0)]))
"""


def test_keeping_a_process_off_cores_covers_its_running_threads() -> None:
    before = sorted(os.sched_getaffinity(0))
    if len(before) < 2:
        pytest.skip("needs two cores")
    run = subprocess.run([sys.executable, "-c", KEEP_OFF], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    rest = str(before[:-1])
    assert run.stdout.strip() == f"{rest} {rest} {rest}"  # running, started later, the caller


def test_waited_phases_count_only_what_came_after_the_ask() -> None:
    phases = {"load": 2.0, "shape": 0.5, "kv_cache_and_graphs": 1.5}
    # asked before the engine began: its phases whole, the rest of the wait before them
    assert waited_phases(10.0, 15.0, 11.0, phases) == {"engine_process": 1.0, **phases}
    # asked during "shape": "load" is gone, "shape" counts its part after the ask
    assert waited_phases(12.25, 14.0, 10.0, phases) == {
        "engine_process": 0.0, "load": 0.0, "shape": 0.25, "kv_cache_and_graphs": 1.5,
    }  # fmt: skip
    # asked after the engine was ready: only the wait itself (the pipes, the tokenizer)
    assert waited_phases(20.0, 20.5, 10.0, phases) == {
        "engine_process": 0.5, "load": 0.0, "shape": 0.0, "kv_cache_and_graphs": 0.0,
    }  # fmt: skip


def _ready(server: EngineServer) -> None:
    """Wait until the server has answered its load (the answer is left for EngineProcess)."""
    message = None
    while message is None:
        message = server.next(0.05)
    server.inbox.put(message)


def test_a_server_asked_early_for_the_same_engine_is_taken(model: Path) -> None:
    """The command line asks its early server for the job's model; the job's EngineProcess
    takes that engine (no second load) and counts none of its phases as waited for."""
    server = EngineServer()
    server.load(load_key(str(model), CPU, True, None))
    _ready(server)
    with EngineProcess(str(model), CPU, quiet=True, server=server) as engine:
        assert engine.server is server
        waited = engine.startup_s
        assert next(iter(waited)) == "engine_process" and "load" in waited
        assert all(waited[k] == 0.0 for k in waited if k != "engine_process")
        whole = engine.engine_startup_s
        assert list(whole)[:2] == ["process", "load"] and whole["load"] > 0
        out = list(engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3)))
        assert len(out[0].output_token_ids) == 3


def test_a_server_asked_for_another_engine_is_replaced(model: Path) -> None:
    early = EngineServer()
    early.load(load_key(str(model), EngineConfig(device="cpu", max_num_seqs=3), True, None))
    with EngineProcess(str(model), CPU, quiet=True, server=early) as engine:
        assert engine.server is not early and early.closed
        assert early.process.wait(timeout=60) is not None
        assert engine.config.max_num_seqs == CPU.max_num_seqs
        assert len(list(engine.generate([[5, 6]], SamplingParams(max_new_tokens=2)))) == 1


def test_the_command_line_loads_the_engine_before_the_job_asks(model: Path, tmp_path) -> None:
    """`batchgen run` whose engine gets a process of its own asks it for the model at once;
    the summary gives the phases waited for and the engine process's own."""
    spec = _job_spec(model, tmp_path, "cli", "process")
    args = ["run", "--model", str(model), "--input", str(spec.input.path), "--output",
            str(tmp_path / "cli"), "--quiet", "--set", "runtime.device='cpu'", "--set",
            "runtime.engine_process='process'", "--max-new-tokens", "4"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "batchgen", *args], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["rows_ok"] == 30 and summary["rows_error"] == 1
    waited, whole = summary["startup_s"], summary["engine_startup_s"]
    assert {"process", "checks", "engine_process", "load", "first_row"} <= set(waited)
    assert {"process", "load", "kv_cache_and_graphs"} <= set(whole) and whole["load"] > 0
    assert all(waited[k] <= whole[k] + 1e-3 for k in ("load", "shape", "kv_cache_and_graphs"))
    # the engine process started after this one: the job was ready no sooner than it was
    ready = sum(v for k, v in waited.items() if k != "first_row")
    assert ready >= sum(whole.values()) - 0.05, (waited, whole)


def test_an_early_load_does_not_come_before_the_jobs_own_errors(model: Path, tmp_path) -> None:
    """The early server is loading when the job finds its input missing: that is the error,
    and the server goes."""
    args = ["run", "--model", str(model), "--input", str(tmp_path / "missing.jsonl"),
            "--output", str(tmp_path / "out"), "--quiet", "--set", "runtime.device='cpu'",
            "--set", "runtime.engine_process='process'"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "batchgen", *args], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "missing.jsonl" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_a_server_closed_while_it_loads_ends_without_finishing(model: Path) -> None:
    """A job that stops before it needs its engine (bad input) closes the early server: it
    ends at once, not after its load."""
    server = EngineServer()
    server.load(load_key(str(model), CPU, True, None))
    server.close()  # in the pipe before the server has read its load request
    assert server.process.returncode is not None  # it ended (0; killed only after 30 s)
    messages = [server.inbox.get()[0]]  # the answers until the pipe's end (it has ended)
    while messages[-1] != "eof":
        messages.append(server.inbox.get()[0])
    assert messages == ["eof"]  # no "ready": it did not finish loading


@pytest.fixture
def started_servers(monkeypatch) -> list[EngineServer]:
    """A GPU "visible" to the command line, and every EngineServer it starts."""
    from batchgen.engine.remote import client, placement

    made: list[EngineServer] = []
    real = client.EngineServer.__init__

    def init(self) -> None:
        real(self)
        made.append(self)

    monkeypatch.setattr(placement, "gpu_visible", lambda: True)
    monkeypatch.setattr(client.EngineServer, "__init__", init)
    return made


@pytest.fixture
def sixteen_cores(monkeypatch) -> list[set[int]]:
    """This process "may use" 16 cores, and keeping it off some (keep_process_off) takes them
    from what os.sched_getaffinity answers, as on a 16-core host: the affinities it was given."""
    from batchgen.engine.remote import placement

    given = [set(range(16))]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(given[-1]))
    monkeypatch.setattr(placement, "_all_threads_on", lambda cores: given.append(set(cores)))
    return given


@pytest.mark.parametrize("place", ["process", "thread"])
def test_the_command_line_starts_the_engine_process_before_reading_the_spec(
    model: Path, tmp_path: Path, started_servers: list, sixteen_cores: list, place: str
) -> None:
    """Where a GPU is visible the server starts before the spec is read; a job whose engine
    gets a process takes that one, any other closes it. Where it is taken, the cores kept for
    it are decided once: the job's process, already kept off them, does not ask again."""
    from click.testing import CliRunner

    from batchgen.cli import main

    spec = _job_spec(model, tmp_path, "cli", place)
    args = ["run", "--model", str(model), "--input", str(spec.input.path), "--output",
            str(tmp_path / place), "--quiet", "--set", "runtime.device='cpu'", "--set",
            f"runtime.engine_process='{place}'", "--max-new-tokens", "2"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert len(started_servers) == 1  # the one started first, taken or closed
    assert started_servers[0].closed and started_servers[0].process.wait(timeout=60) is not None
    summary = json.loads((tmp_path / place / "summary.json").read_text())
    assert summary["rows_ok"] == 30 and bool(summary["engine_startup_s"]) == (place == "process")
    if place == "process":
        assert started_servers[0].cpus == {14, 15} and sixteen_cores[-1] == set(range(14))


def test_a_bad_spec_closes_the_engine_process_started_before_it(
    tmp_path: Path, started_servers: list
) -> None:
    from click.testing import CliRunner

    from batchgen.cli import main

    args = ["run", "--model", "default", "--input", str(tmp_path / "missing.jsonl"),
            "--output", str(tmp_path / "out"), "--set", "runtime.bogus=1"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "bogus" in lines[0], lines
    assert len(started_servers) == 1 and started_servers[0].closed
    assert started_servers[0].process.wait(timeout=60) is not None


def test_a_send_blocked_on_one_pipe_holds_back_no_other_pipe() -> None:
    """Messages to one pipe are whole whichever threads send them; a sender blocked on a
    full pipe (its reader busy) does not stop a send to another pipe."""
    import select

    from batchgen.engine.remote.protocol import receive, send

    full_r, full_w = _pipe()
    free_r, free_w = _pipe()
    big = ("rows", b"x" * (4 << 20))  # far more than a pipe holds: its send blocks
    blocked = threading.Thread(target=send, args=(full_w, big), daemon=True)
    blocked.start()
    assert select.select([full_r], [], [], 60)[0], "the blocked send has begun writing"
    sent = threading.Event()

    def send_both() -> None:
        send(free_w, ("a", 1))
        send(free_w, ("b", 2))
        sent.set()

    threading.Thread(target=send_both, daemon=True).start()
    assert sent.wait(60), "a send to another pipe waited for the blocked one"
    assert [receive(free_r), receive(free_r)] == [("a", 1), ("b", 2)]
    assert receive(full_r) == big  # the blocked send, whole once read
    blocked.join(60)
    for f in (full_r, full_w, free_r, free_w):
        f.close()


def _pipe() -> tuple[Any, Any]:
    """(read end, write end) of a new pipe, as buffered files."""
    r, w = os.pipe()
    return os.fdopen(r, "rb"), os.fdopen(w, "wb")
