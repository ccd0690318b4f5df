"""Data-parallel jobs on the CPU (gloo): ranks as real processes, started by hand, by torchrun
and by `batchgen run --gpus N`; every test waits for conditions, not clocks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pyarrow.parquet as pq
import pytest

from batchgen import BatchgenError
from batchgen.distributed import Place, engine_config, place_from_env
from batchgen.engine import Engine, EngineConfig
from batchgen.io import OutputLayout
from batchgen.io.checkpoint import DirectoryLock, RankLock
from batchgen.job import run_job
from batchgen.spec import load_spec
from tests.helpers import stop_after

ROWS = 40
# runtime.heartbeat_timeout_s where a test waits for a killed rank to be missed; the others
# keep the default (60 s): a few seconds of silence is a rank starved of the 2 cores, not lost
HEARTBEAT_S = 15
SETS = (
    "prompt.id_column='uid'",
    "prompt.sampling_column='s'",  # even rows greedy, odd rows sampled (seeded by runtime.seed)
    "sampling.max_new_tokens=12",
    "output.shard_rows=3",
    "runtime.max_num_seqs=2",
    "runtime.num_kv_blocks=64",
    "runtime.device='cpu'",
    "runtime.rank_timeout_s=120",  # no rank of a failed test waits long for the others
)


class Job(NamedTuple):
    model: Path
    input: Path
    expected: dict[str, tuple[str, str]]  # id -> (text, finish_reason), from one process


def sets_for(job: Job, out: Path, quiet: bool = True) -> list[str]:
    return [
        f"model.path={json.dumps(str(job.model))}",
        f"input.path={json.dumps(str(job.input))}",
        f"output.dir={json.dumps(str(out))}",
        f"runtime.quiet={str(quiet).lower()}",
        *SETS,
    ]


def command(
    job: Job, out: Path, *launcher: str, quiet: bool = True, sets: tuple[str, ...] = ()
) -> list[str]:
    """`batchgen run` for the job (launcher: e.g. torchrun and its options, before -m); sets
    replace the job's settings of their keys (two --set of one key are refused)."""
    keys = {item.partition("=")[0] for item in sets}
    base = [item for item in sets_for(job, out, quiet) if item.partition("=")[0] not in keys]
    args = [a for s in (*base, *sets) for a in ("--set", s)]
    head = [*launcher, "-m"] if launcher else [sys.executable, "-m"]
    return [*head, "batchgen", "run", *args]


def results(out: Path) -> dict[str, tuple[str, str]]:
    rows = pq.read_table(out / "results.parquet").to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == ROWS, "every row exactly once"
    return {r["id"]: (r["text"], r["finish_reason"]) for r in rows}


def shards_of(out: Path, rank: int) -> list[Path]:
    return list((out / "shards").glob(f"part-*-r{rank}-*")) if (out / "shards").exists() else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture
def started():
    """Processes a test starts; any still running at its end are stopped (SIGTERM: torchrun
    and `--gpus` pass it on to their ranks), killed if they do not stop."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def start(started: list[subprocess.Popen], cmd: list[str], **env: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        cmd, env=env or None, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    started.append(proc)
    return proc


def start_two_committing(
    started: list[subprocess.Popen], job: Job, out: Path
) -> tuple[subprocess.Popen, list[str]]:
    """`--gpus 2` on a long job (60x the tokens, one sequence at a time), once each rank has
    committed a shard -> the launcher, and the command that resumes the job."""
    longer = ("sampling.max_new_tokens=64", "sampling.ignore_eos=true", "runtime.max_num_seqs=1")
    cmd = command(job, out, sets=longer)
    launcher = start(started, [*cmd, "--gpus", "2"], **env())
    deadline = time.monotonic() + 600  # a safety net for a hung start, not a condition
    while not (shards_of(out, 0) and shards_of(out, 1)):
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "the ranks never committed"
        time.sleep(0.02)
    return launcher, cmd


@pytest.fixture(scope="module")
def job(model_dir, tmp_path_factory) -> Job:
    """The job's input, and its texts when one process runs it."""
    root = tmp_path_factory.mktemp("data-parallel")
    inp = root / "in.jsonl"
    rows = [
        {
            "uid": f"row-{i:03d}",
            "prompt": f"Item {i}: describe it in a few words.",
            "s": {"temperature": 0.9, "top_p": 0.95} if i % 2 else {"temperature": 0.0},
        }
        for i in range(ROWS)
    ]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    partial = Job(model_dir("llama"), inp, {})
    assert run_job(load_spec(None, sets_for(partial, root / "ref"))).complete
    return partial._replace(expected=results(root / "ref"))


@pytest.mark.slow
def test_a_killed_rank_stops_the_other_and_one_process_finishes_exactly_once(
    job, tmp_path, started
):
    """Two ranks started by hand (rank 0 hosts the store); SIGKILL rank 1 mid-run: rank 0
    stops within the heartbeat timeout with one line naming rank 1; the job resumes alone
    (2 -> 1) and every row comes out once, with the texts of a one-process run."""
    out = tmp_path / "out"
    base = env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    cmd = [*command(job, out), "--set", f"runtime.heartbeat_timeout_s={HEARTBEAT_S}"]
    ranks = [start(started, cmd, **base, RANK=str(r), LOCAL_RANK=str(r)) for r in (0, 1)]
    deadline = time.monotonic() + 600  # a safety net for a hung start, not a condition
    while not shards_of(out, 1):
        assert all(p.poll() is None for p in ranks), "both ranks run until one is killed"
        assert time.monotonic() < deadline, "the ranks never committed"
        time.sleep(0.02)
    ranks[1].send_signal(signal.SIGKILL)
    _, stderr = ranks[0].communicate(timeout=HEARTBEAT_S + 60)  # bounded: no hang
    ranks[1].wait()
    assert ranks[0].returncode == 1, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"batchgen: error: rank 1 stopped (no word from it for {HEARTBEAT_S}")
    assert last.endswith("run the same command again to resume")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and not summary["complete"]
    assert 0 < summary["rows_committed_total"] < ROWS

    resumed = run_job(load_spec(None, sets_for(job, out)))  # the same job, alone
    assert resumed.complete and resumed.summary.resumed
    assert not list(out.rglob(".tmp-*"))
    assert shards_of(out, 0) and shards_of(out, 1), "rows of both ranks (world 2) are kept"
    assert results(out) == job.expected


@pytest.mark.slow
def test_one_process_then_three_ranks_under_torchrun(job, tmp_path, started):
    """A job stopped alone resumes on three ranks (1 -> 3): each rank writes shards, rank 0's
    bar and summary count every rank's rows, and the texts are the one-process run's."""
    out = tmp_path / "out"
    spec = load_spec(None, sets_for(job, out))
    engine = stop_after(Engine(spec.model.path, spec.engine), outputs=10)
    first = run_job(spec, engine=engine, stop=threading.Event())
    assert first.interrupted and not first.complete
    todo = ROWS - first.rows_committed
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = command(job, out, *torchrun, "--nproc-per-node", "3", quiet=False)
    torchrun = start(started, cmd, **env())
    stdout, stderr = torchrun.communicate(timeout=600)
    assert torchrun.returncode == 0, stderr[-3000:]
    assert all(shards_of(out, rank) for rank in range(3)), "every rank wrote its share"
    summary = json.loads(stdout[stdout.index("{") :])  # rank 0's report alone
    assert summary["complete"] and summary["resumed"] and summary["world_size"] == 3
    assert summary["run_rows_ok"] == todo, "totals over the three ranks"
    assert summary["rows_ok"] == ROWS, "the job's rows, whichever run wrote them"
    assert f"{todo}/{todo}" in stderr, "one bar, counting every rank's rows"
    assert stdout.count('"world_size"') == 1, "the other ranks print no summary"
    assert results(out) == job.expected


@pytest.mark.slow
def test_an_error_on_rank_0_stops_every_rank_with_the_same_line(job, tmp_path, started):
    """Only rank 0 reads the output directory before the model loads; `--gpus 2` (the ranks
    started by batchgen, which share one stderr): both ranks exit 2, rank 0's line is printed
    once, nothing is written. So is an error in the spec every rank reads, and one that every
    rank's own checks find."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("not a job")
    cases = {
        "is not empty and holds no batchgen job": (out, ()),
        "unknown key runtime.bogus": (tmp_path / "o2", ("runtime.bogus=1",)),
        "num_kv_blocks=2 is too small": (tmp_path / "o3", ("runtime.num_kv_blocks=2",)),
    }
    for message, (where, sets) in cases.items():
        launcher = start(started, [*command(job, where, sets=sets), "--gpus", "2"], **env())
        _, stderr = launcher.communicate(timeout=300)
        assert launcher.returncode == 2, stderr
        lines = [line for line in stderr.splitlines() if line.startswith("batchgen:")]
        assert len(lines) == 1 and message in lines[0], stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_force_resume_on_ranks_refuses_rows_that_moved_and_keeps_the_record(job, tmp_path, started):
    """`--gpus 2 --force-resume` keeps committed rows at their input positions, as one process
    does: a row inserted at the top is refused in one line before anything is written, and the
    manifest still records the input the rows came from, so a plain run after it refuses too."""
    out = tmp_path / "out"
    shutil.copytree(job.input.parent / "ref", out)  # every row committed by one process
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    rows = job.input.read_text().splitlines(keepends=True)
    moved = tmp_path / job.input.name
    moved.write_text(json.dumps({"uid": "new", "prompt": "Inserted first."}) + "\n" + "".join(rows))
    sets = (f"input.path={json.dumps(str(moved))}",)
    for extra, message in (
        (["--force-resume"], "input row 0 now has id 'new' and its committed result is for id "
         "'row-000'"),
        ([], "the input changed"),
    ):  # fmt: skip
        cmd = [*command(job, out, sets=sets), "--gpus", "2", *extra]
        launcher = start(started, cmd, **env())
        _, stderr = launcher.communicate(timeout=300)
        lines = [line for line in stderr.splitlines() if line.startswith("batchgen:")]
        assert launcher.returncode == 2 and len(lines) == 1 and message in lines[0], stderr
    after = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "job.lock"}
    assert after == {k: v for k, v in before.items() if k != "job.lock"}, "nothing written"


def test_a_store_that_stops_answering_stops_the_rank_within_the_heartbeat_timeout(monkeypatch):
    """A store call has no time limit (rank 0, hosting it under --gpus, frozen: SIGSTOP, a
    hung machine): the rank's heartbeat notices its own loop stuck for timeout_s, stops the
    job naming rank 0, and its waits for rank 0's outcome end instead of lasting forever."""
    from batchgen.distributed import RANK_EXITS
    from batchgen.heartbeat import Heartbeat, Progress, publish_first_beat

    frozen = threading.Event()

    class Store:
        def __init__(self) -> None:
            self.data: dict[str, bytes] = {}

        def _wait(self) -> None:
            if frozen.is_set():
                threading.Event().wait()  # never answers

        def set(self, key: str, value: bytes) -> None:
            self._wait()
            self.data[key] = value

        def get(self, key: str) -> bytes:
            self._wait()
            return self.data[key]

        def multi_get(self, keys: list[str]) -> list[bytes]:
            self._wait()
            return [self.data[k] for k in keys]

        def check(self, keys: list[str]) -> bool:
            self._wait()
            return all(k in self.data for k in keys)

    class Group1:
        store, rank, world_size = Store(), 1, 2

    monkeypatch.setenv(RANK_EXITS, "/nonexistent")  # as under `batchgen run --gpus N`
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    group = Group1()
    publish_first_beat(group)
    group.store.set("beat/0", group.store.get("beat/1"))
    stop = threading.Event()
    beat = Heartbeat(group, stop, 1.0, lambda: Progress())
    beat.start()
    frozen.set()
    assert stop.wait(60), "the rank never stopped"
    assert beat.wait_outcome() is None  # returns: rank 0 gave none
    assert beat.stopped_by.rank == 0
    assert beat.stopped_by.why == (
        "rank 0 stopped (its store at 127.0.0.1:29999 has not answered for 1 s)"
    )
    beat.close()


def test_closing_the_heartbeat_joins_its_threads(monkeypatch):
    """Both heartbeat threads are over once close() returns: a thread left to end during the
    interpreter's exit frees the tensors its target holds there, and the rank aborts
    ("terminate called without an active exception", exit 134 after a complete job)."""
    from batchgen.heartbeat import Heartbeat, Progress, publish_first_beat

    class Store:
        def __init__(self) -> None:
            self.data: dict[str, bytes] = {}

        def set(self, key: str, value: bytes) -> None:
            self.data[key] = value

        def get(self, key: str) -> bytes:
            return self.data[key]

        def multi_get(self, keys: list[str]) -> list[bytes]:
            return [self.data[k] for k in keys]

        def check(self, keys: list[str]) -> bool:
            return all(k in self.data for k in keys)

    class Group:
        store, rank, world_size = Store(), 0, 1

    watchdog = Heartbeat._watchdog

    def slow_to_end(self: Heartbeat) -> None:  # as when the watchdog waits for the GIL
        watchdog(self)
        time.sleep(0.3)

    monkeypatch.setattr(Heartbeat, "_watchdog", slow_to_end)
    group = Group()
    publish_first_beat(group)
    beat = Heartbeat(group, threading.Event(), 60.0, lambda: Progress())
    beat.start()
    beat.close()
    assert not beat._thread.is_alive() and not beat._watch.is_alive()


def test_a_rank_checks_that_the_lock_is_still_its_runs(tmp_path):
    layout = OutputLayout(tmp_path / "out")
    with DirectoryLock(layout) as lock:
        RankLock(layout, lock.run).check()
        with pytest.raises(BatchgenError, match="lost the lock"):
            RankLock(layout, "another run").check()
    with pytest.raises(BatchgenError, match="lost the lock"):
        RankLock(layout, lock.run).check()  # released: the lock file is gone


def test_the_place_comes_from_the_launchers_environment():
    assert place_from_env({}) is None
    place = place_from_env(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    )
    assert place == Place(3, 4, 1, 2) and place.share.rank == 3
    with pytest.raises(BatchgenError, match="not a valid place"):
        place_from_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(BatchgenError, match="names no valid rank"):
        place_from_env({"RANK": "x", "WORLD_SIZE": "4"})


def test_a_rank_takes_its_share_of_the_cpu_and_no_pinned_gpu(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    config = engine_config(EngineConfig(device="cpu"), Place(1, 2, 1, 2))
    assert config.device == "cpu" and config.cpu_threads == max(1, cores // 2 - 1)
    with pytest.raises(BatchgenError, match="puts every rank of this machine on one GPU"):
        engine_config(EngineConfig(device="cuda:0"), Place(1, 2, 1, 2))


def children_of(pid: int) -> list[int]:
    """The pids of a process's children (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it has just exited
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ranks_whose_launcher_is_killed_stop_and_the_job_resumes(job, tmp_path, started):
    """SIGKILL of `batchgen run --gpus 2` (which cannot pass it on): its ranks stop on their
    own (they commit and exit) instead of running on unattended, holding the output
    directory; the same command then finishes the job, every row once."""
    out = tmp_path / "out"
    launcher, cmd = start_two_committing(started, job, out)
    ranks = children_of(launcher.pid)
    assert len(ranks) == 2
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 600  # a safety net, not a condition
    while not all(gone(pid) for pid in ranks):
        assert time.monotonic() < deadline, "the ranks never stopped"
        time.sleep(0.05)
    assert not (out / "results.parquet").exists(), "the ranks ran on without their launcher"
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert len(results(out)) == ROWS


def test_a_profiled_run_on_two_ranks_reports_as_one_run(job, tmp_path, started):
    """`--gpus 2 --profile`: each rank records its own steps under the run's one name; the
    run says where, its start-up phases begin with "process" as alone, and `report` shows
    rank 0's steps, naming rank 1's as the same run's."""
    out = tmp_path / "out"
    done = subprocess.run(
        [*command(job, out), "--gpus", "2", "--profile"], env=env(), capture_output=True,
        text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(results(out)) == ROWS
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["startup_s"])[:2] == ["process", "checks"]
    steps = sorted((out / "profile").glob("steps-*.parquet"), key=lambda p: "-r1-" in p.name)
    assert [("-r0-" in p.name, "-r1-" in p.name) for p in steps] == [(True, False), (False, True)]
    assert (
        f"batchgen: step records in {steps[0]} (rank 0's; each rank writes its own)" in done.stderr
    )
    report = subprocess.run(
        [sys.executable, "-m", "batchgen", "report", str(out)], capture_output=True, text=True
    )
    assert report.returncode == 0, report.stderr
    rank_1 = steps[1].name.removeprefix("steps-").removesuffix(".parquet")
    assert report.stdout.startswith(f"run {steps[0].name.removeprefix('steps-')[:-8]} on cpu")
    assert f"this is rank 0 of a data-parallel run; its other ranks' records: {rank_1}" in (
        report.stdout
    )
    assert "other run(s)" not in report.stdout


def _wait_in_thread(procs: list[subprocess.Popen]) -> threading.Thread:
    from batchgen.launch import _wait_all

    waiter = threading.Thread(target=_wait_all, args=(procs,), daemon=True)
    waiter.start()
    return waiter


@pytest.mark.parametrize("rank_1", ["kill -9 $$", "exit 3"])
def test_the_launcher_sees_any_rank_exit_and_stops_the_others(rank_1, started, monkeypatch):
    """Rank 1 killed (the others are sent SIGTERM at once) or failed (SIGTERM once GRACE_S is
    over, 0 here) while rank 0 runs on until signalled: the launcher stops rank 0 and returns;
    rank 1's exit is seen although rank 0 is still running."""
    monkeypatch.setattr("batchgen.launch.GRACE_S", 0.0)
    rank_0 = start(started, [sys.executable, "-c", "import time; time.sleep(3600)"])
    rank_1 = start(started, ["sh", "-c", rank_1])
    waiter = _wait_in_thread([rank_0, rank_1])
    waiter.join(timeout=60)  # a safety net for the old hang, not a condition
    assert not waiter.is_alive(), "the launcher never noticed rank 1's exit"
    assert rank_0.returncode == -signal.SIGTERM


FAIL_ON_FIRST_ATTEMPT = """
import os
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import batchgen.engine.engine as engine

    step, steps = engine.Engine.step, []

    def failing_step(self):
        steps.append(1)
        if len(steps) == 5:
            raise RuntimeError("rank 1 fails on the first attempt")
        return step(self)

    engine.Engine.step = failing_step
"""


@pytest.mark.slow
def test_torchrun_restarts_the_ranks_and_the_job_finishes(job, tmp_path, started):
    """torchrun --max-restarts 1 keeps its store over the restart: the second attempt's ranks
    meet and follow each other apart from the first attempt's keys (its process group's
    addresses, its stop), and the job finishes, every row once."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FAIL_ON_FIRST_ATTEMPT)
    out = tmp_path / "out"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts"]
    cmd = command(job, out, *torchrun, "1", "--nproc-per-node", "2")
    path = os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")])
    proc = start(started, cmd, **env(PYTHONPATH=path))
    _, stderr = proc.communicate(timeout=600)
    assert "rank 1 fails on the first attempt" in stderr, "the first attempt failed"
    assert proc.returncode == 0, stderr[-3000:]
    assert results(out) == job.expected


@pytest.mark.slow
def test_ranks_started_with_different_world_sizes_stop_with_one_line(job, tmp_path, started):
    """Rank 0 says WORLD_SIZE=2, rank 1 says 3: both stop as soon as they meet, with a line
    naming the other rank's WORLD_SIZE (exit 2); nothing is written."""
    out = tmp_path / "out"
    base = env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ranks = [
        start(started, command(job, out), **base, RANK=str(r), WORLD_SIZE=str(w))
        for r, w in ((0, 2), (1, 3))
    ]
    lines = [rank.communicate(timeout=300)[1].strip().splitlines()[-1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [2, 2], lines
    assert lines[0].startswith("batchgen: error: rank 1 has WORLD_SIZE=3 but rank 0 has "), lines
    assert lines[1].startswith("batchgen: error: rank 0 has WORLD_SIZE=2 but rank 1 has "), lines
    assert not out.exists()


@pytest.mark.slow
def test_a_network_interface_that_is_not_there_is_one_line_on_every_rank(job, tmp_path, started):
    """GLOO_SOCKET_IFNAME naming no interface of this machine: rank 0 of `--gpus 2` says that
    it could not set up the process group and what to check (exit 2, not a bug); rank 1 says
    the same, or, where rank 0 stopped first (taking the store it hosts), that rank 0 stopped
    and its lines say why."""
    out = tmp_path / "out"
    cmd = [*command(job, out), "--gpus", "2"]
    launcher = start(started, cmd, **env(GLOO_SOCKET_IFNAME="no-such-interface0"))
    _, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 2, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("batchgen:")]
    assert len(lines) == 2, stderr
    setup = [line for line in lines if "could not set up the process group" in line]
    assert setup, stderr
    for line in setup:
        assert "with the other ranks" in line
        assert "GLOO_SOCKET_IFNAME" in line and "WORLD_SIZE" in line
    for line in set(lines) - set(setup):  # rank 1, once rank 0 had stopped
        assert line.startswith("batchgen: error: rank 1 lost the store at "), stderr
        assert line.endswith("the rank that hosts it (rank 0) stopped; its lines say why")


@pytest.mark.slow
def test_a_rank_that_waits_alone_stops_naming_the_ranks_that_did_not_come(job, tmp_path, started):
    """Rank 0 of 3 started alone: once runtime.rank_timeout_s is over it stops with one line
    naming ranks 1 and 2 (exit 2)."""
    cmd = command(job, tmp_path / "out", sets=("runtime.rank_timeout_s=1",))
    base = env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="3")
    rank = start(started, cmd, **base, RANK="0")
    _, stderr = rank.communicate(timeout=300)
    assert rank.returncode == 2, stderr
    assert (
        stderr.strip()
        .splitlines()[-1]
        .startswith("batchgen: error: rank 0 could not meet the other ranks at 127.0.0.1:")
    )
    assert "rank(s) 1, 2 had not come within runtime.rank_timeout_s=1 s" in stderr


@pytest.mark.slow
@pytest.mark.parametrize(("gone", "status"), [(1, 1), (0, 4)])
def test_a_rank_that_exits_before_the_ranks_meet_stops_the_other_at_once(
    gone, status, job, tmp_path, started
):
    """`--gpus 2` where one rank exits (status 4) before it meets the other: the other one,
    waiting to meet it (rank 0 hosting the store, or rank 1 connecting to it), stops at once
    with one line naming it and its exit status, instead of waiting runtime.rank_timeout_s.
    The launcher's status is rank 0's."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        f"import os\nif os.environ.get('RANK') == '{gone}':\n    os._exit(4)\n"
    )
    path = os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")])
    launcher = start(
        started, [*command(job, tmp_path / "out"), "--gpus", "2"], **env(PYTHONPATH=path)
    )
    _, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == status, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("batchgen:")]
    assert lines == [
        f"batchgen: error: rank {gone} exited with status 4 before the ranks met (its own lines "
        f"say why), so rank {1 - gone} stops too: run the same command again once that is fixed"
    ], stderr


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("killed", ["1", "0"])
def test_a_rank_of_gpus_n_killed_mid_run_stops_the_other_at_once_naming_it(
    job, tmp_path, started, killed
):
    """SIGKILL of one rank of `batchgen run --gpus 2` while both generate: the launcher sees it
    at once and so does the other rank (not runtime.heartbeat_timeout_s later; rank 0 killed
    takes the store it hosts): it commits and stops with one line naming the killed rank and
    its signal (exit 1); the same command finishes the job."""
    out = tmp_path / "out"
    launcher, cmd = start_two_committing(started, job, out)
    victim = next(pid for pid in children_of(launcher.pid) if _rank_of(pid) == killed)
    os.kill(victim, signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 1, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"batchgen: error: rank {killed} was killed by SIGKILL: the committed rows are kept in "
        f"{out}; run the same command again to resume"
    )
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert len(results(out)) == ROWS


def _rank_of(pid: int) -> str:
    """RANK in a process's environment (Linux /proc)."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e[5:].decode() for e in env if e.startswith(b"RANK="))


@pytest.mark.slow
def test_a_rank_that_cannot_reach_the_store_says_so_in_one_line(job, tmp_path, started):
    """Rank 1 of 2 pointed at a port where no store listens: once runtime.rank_timeout_s is
    over it stops with batchgen's line alone (exit 2); torch's C++ log lines (a stack per try
    to connect) are off in a rank unless TORCH_CPP_LOG_LEVEL is set."""
    cmd = command(job, tmp_path / "out", sets=("runtime.rank_timeout_s=2",))
    base = env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    base.pop("TORCH_CPP_LOG_LEVEL", None)
    rank = start(started, cmd, **base, RANK="1")
    _, stderr = rank.communicate(timeout=300)
    assert rank.returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("batchgen: error: rank 1 could not meet the other ranks at ")
