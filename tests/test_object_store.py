"""Jobs whose input and output live on an object store: a real S3-compatible server (moto's,
on 127.0.0.1, with credentials checked) started and stopped by a fixture; every wait is for a
condition, not a clock."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen import BatchgenError
from batchgen.cli import main
from batchgen.io import OutputLayout
from batchgen.io.object_lock import ObjectLock
from batchgen.job import run_job
from batchgen.spec import load_spec

moto_server = pytest.importorskip("moto.server")

BUCKET = "batchgen-test"
PROMPTS = [f"Item {i}: describe it in a few words." for i in range(12)]


class S3(NamedTuple):
    client: Any  # boto3 S3 client with the test credentials
    endpoint: str

    def url(self, key: str) -> str:
        return f"s3://{BUCKET}/{key}"

    def keys(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=data)

    def uploads(self, prefix: str) -> list[str]:
        found = self.client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix)
        return [u["Key"] for u in found.get("Uploads", [])]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    """moto's S3 server on 127.0.0.1 with request signing checked (an IAM user's key), the
    endpoint and key in the environment the way a user sets them (AWS_ENDPOINT_URL_S3,
    AWS_ACCESS_KEY_ID, ...), no config file of the machine's user read."""
    import boto3
    import moto.settings

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server._server.server_port}"
    empty = tmp_path_factory.mktemp("aws") / "none"
    env = {
        "AWS_ACCESS_KEY_ID": "bootstrap",
        "AWS_SECRET_ACCESS_KEY": "bootstrap",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ENDPOINT_URL_IAM": endpoint,
        "AWS_CONFIG_FILE": str(empty),
        "AWS_SHARED_CREDENTIALS_FILE": str(empty),
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("AWS_PROFILE", raising=False)
        mp.delenv("AWS_ENDPOINT_URL", raising=False)
        for key, value in env.items():
            mp.setenv(key, value)
        iam = boto3.session.Session().client("iam")
        iam.create_user(UserName="batchgen")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*"}]}
        policy["Statement"][0]["Resource"] = "*"
        iam.put_user_policy(
            UserName="batchgen", PolicyName="all", PolicyDocument=json.dumps(policy)
        )
        key = iam.create_access_key(UserName="batchgen")["AccessKey"]
        mp.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        mp.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        # from here on every request's signature is checked against the user's key
        reset = f"{endpoint}/moto-api/reset-auth"
        headers = {"Content-Type": "text/plain"}
        urllib.request.urlopen(urllib.request.Request(reset, b"0", headers)).read()
        client = boto3.session.Session().client("s3")
        client.create_bucket(Bucket=BUCKET)
        try:
            yield S3(client, endpoint)
        finally:
            server.stop()
            moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = float("inf")


def prompts_parquet(n: int) -> bytes:
    table = pa.table({"uid": [f"row-{i:04d}" for i in range(n)], "prompt": PROMPTS * (n // 12)})
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=16)
    return sink.getvalue()


def spec_for(model: Path, inp: str, out: str, *sets: str) -> Any:
    return load_spec(
        None,
        [
            f"model.path={json.dumps(str(model))}",
            f"input.path={json.dumps(inp)}",
            f"output.dir={json.dumps(out)}",
            "prompt.id_column='uid'",
            "sampling.max_new_tokens=8",
            "output.shard_rows=5",
            "runtime.quiet=true",
            "runtime.device='cpu'",
            *sets,
        ],
    )


def test_a_job_reads_parquet_from_s3_and_writes_its_checkpoint_to_s3(
    s3: S3, model_dir, tmp_path: Path
) -> None:
    """The same rows as the job on local files; every name the layout declares, as keys;
    the lock gone afterwards; a rerun resumes and generates nothing."""
    model = model_dir("llama")
    data = prompts_parquet(12)
    s3.put("job1/in/a.parquet", data)
    s3.put("job1/in/_skip/b.parquet", b"not read: under a '_' part")
    (tmp_path / "in.parquet").write_bytes(data)

    local = run_job(spec_for(model, str(tmp_path / "in.parquet"), str(tmp_path / "out")))
    remote = run_job(spec_for(model, s3.url("job1/in"), s3.url("job1/out")))
    assert remote.complete and remote.summary.rows_ok == 12
    assert remote.result_file == s3.url("job1/out/results.parquet")
    expected = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    got = pq.read_table(io.BytesIO(s3.get("job1/out/results.parquet"))).to_pylist()
    assert [r["id"] for r in got] == [f"row-{i:04d}" for i in range(12)]
    assert [r["text"] for r in got] == [r["text"] for r in expected]
    assert local.summary.rows_ok == 12

    keys = s3.keys("job1/out/")
    names = [k.removeprefix("job1/out/") for k in keys]
    assert {"job.json", "summary.json", "results.parquet"} <= set(names)
    shards = [n for n in names if n.startswith("shards/part-")]
    assert len(shards) == 3 and len(names) == len(shards) + 3, names  # no lock, no temp

    again = run_job(spec_for(model, s3.url("job1/in"), s3.url("job1/out")))
    assert again.summary.resumed and again.complete and again.summary.run_rows_ok == 0
    assert again.summary.rows_ok == 12  # the job's rows, whichever run wrote them


def cli_job(model: Path, s3: S3, prefix: str) -> list[str]:
    return [
        sys.executable, "-m", "batchgen", "run",
        "--model", str(model),
        "--input", s3.url(f"{prefix}/in.parquet"),
        "--output", s3.url(f"{prefix}/out"),
        "--output-format", "jsonl",
        "--set", "sampling.max_new_tokens=8",
        "--quiet",
        "--set", "prompt.id_column='uid'",
        "--set", "output.shard_rows=3",
        "--set", "runtime.device='cpu'",
        "--set", "runtime.max_num_seqs=4",
    ]  # fmt: skip


def test_sigkill_mid_run_and_a_rerun_give_every_row_exactly_once(
    s3: S3, model_dir, tmp_path: Path
) -> None:
    """A `batchgen run` subprocess killed (-9) once shards are committed: every visible shard
    is whole, its lock is left behind; an upload it never completed is aborted by the rerun,
    which takes the stale lock over and finishes with every row once (and no row twice: the
    final merge refuses a key committed twice)."""
    model = model_dir("llama")
    rows = 36
    s3.put("kill/in.parquet", prompts_parquet(rows))
    cmd = cli_job(model, s3, "kill")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 300  # a bound for a hung run; the wait is for committed shards
    while len(s3.keys("kill/out/shards/")) < 2 and proc.poll() is None:
        assert time.time() < deadline, "no shard committed"
        time.sleep(0.05)
    assert proc.poll() is None, f"the job ended before the kill: {proc.stderr.read()[-500:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for key in s3.keys("kill/out/shards/"):
        lines = s3.get(key).decode().splitlines()
        assert lines and len(lines) == int(key.rsplit("-n", 1)[1].split(".")[0]), key
        assert all(json.loads(line)["id"] for line in lines)
    assert "kill/out/job.lock" in s3.keys("kill/out/"), "the killed run's lock is left"
    started = s3.client.create_multipart_upload(Bucket=BUCKET, Key="kill/out/results.jsonl")
    assert s3.uploads("kill/out/") == ["kill/out/results.jsonl"]
    assert started["UploadId"]

    # the rerun in process (one interpreter start less): the same job, resumed
    sets = ("output.format='jsonl'", "output.shard_rows=3", "runtime.max_num_seqs=4")
    final = run_job(spec_for(model, s3.url("kill/in.parquet"), s3.url("kill/out"), *sets))
    assert final.complete and final.summary.resumed
    assert s3.uploads("kill/out/") == [], "the rerun aborts uploads a killed run left"
    assert "kill/out/job.lock" not in s3.keys("kill/out/")
    got = [json.loads(line) for line in s3.get("kill/out/results.jsonl").decode().splitlines()]
    assert [r["id"] for r in got] == [f"row-{i:04d}" for i in range(rows)], "every row once"
    summary = json.loads(s3.get("kill/out/summary.json"))
    assert summary["resumed"] and 0 < summary["run_rows_ok"] < rows
    assert summary["rows_ok"] == rows  # the job's, over both runs


def validate(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["validate", "--template", "{prompt}", *args])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("input", "bucket 'no-such-bucket' does not exist"),
        ("output", "bucket 'no-such-bucket' does not exist"),
        ("key", "does not exist: check the path"),
        ("credentials", "was refused"),
    ],
)
def test_store_errors_are_one_clear_line(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, message: str
) -> None:
    s3.put("errors/in.parquet", prompts_parquet(12))
    inp, out = s3.url("errors/in.parquet"), s3.url("errors/out")
    if where == "input":
        inp = "s3://no-such-bucket/in.parquet"
    elif where == "output":
        out = "s3://no-such-bucket/out"
    elif where == "key":
        inp = s3.url("errors/missing.parquet")
    else:
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    code, output = validate("--input", inp, "--output", out)
    assert code == 2, output
    line = output.strip()
    assert "\n" not in line and line.startswith("batchgen: error:"), output
    assert message in line, line
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in line
    if where == "credentials":
        assert "AWS_ACCESS_KEY_ID" in line  # says where credentials come from


def test_validate_checks_the_output_location_and_leaves_nothing(s3: S3) -> None:
    s3.put("ok/in.parquet", prompts_parquet(12))
    code, output = validate("--input", s3.url("ok/in.parquet"), "--output", s3.url("ok/out"))
    assert code == 0, output
    assert "ok: parquet file s3://" in output
    assert s3.keys("ok/out") == []


def test_the_lock_is_a_conditional_put_and_a_stale_one_is_taken_over(s3: S3) -> None:
    layout = OutputLayout(s3.url("lock/out"))
    first, second = ObjectLock(layout), ObjectLock(layout)
    first.acquire()
    with pytest.raises(BatchgenError, match=r"in use by another batchgen run \(pid \d+ on "):
        second.acquire()
    first.check()
    first.release()
    assert s3.keys("lock/") == []

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    import socket

    s3.put(
        "lock/out/job.lock", json.dumps({"pid": int(gone), "host": socket.gethostname()}).encode()
    )
    with second:  # its process is gone: taken over
        assert json.loads(s3.get("lock/out/job.lock"))["run"] == second.run
        s3.put("lock/out/job.lock", b'{"pid": 1, "host": "elsewhere", "run": "other"}')
        with pytest.raises(BatchgenError, match="lost the lock"):
            second.check()
    assert s3.keys("lock/") == ["lock/out/job.lock"], "another run's lock is not removed"
    with pytest.raises(
        BatchgenError, match=r"elsewhere\): .* delete s3://batchgen-test/lock/out/job.lock"
    ):
        ObjectLock(layout).acquire()


def test_a_failed_write_leaves_no_object(s3: S3) -> None:
    from batchgen.io.atomic import write_atomic
    from batchgen.io.fs import as_path

    target = as_path(s3.url("partial/shard.jsonl"))

    def fail(f: Any) -> None:
        f.write(b'{"index": 0}\n')
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        write_atomic(target, fail)
    assert s3.keys("partial/") == []
    write_atomic(target, lambda f: f.write(b"whole\n"))
    assert s3.get("partial/shard.jsonl") == b"whole\n"


def test_a_scheme_without_its_library_or_unknown_is_one_line() -> None:
    from batchgen.io.fs import as_path

    with pytest.raises(BatchgenError, match=r"unknown scheme ftpx:// \(batchgen reads s3://"):
        as_path("ftpx://host/data.parquet")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(BatchgenError, match=r"needs the 'gcsfs' package.*pip install gcsfs"):
            as_path("gs://bucket/data.parquet")


def test_uploads_a_killed_run_left_at_a_bucket_root_are_aborted(s3: S3) -> None:
    """Output at a bucket's root (s3://bucket): its prefix is the whole bucket."""
    from batchgen.io.fs import abort_uploads, as_path

    s3.client.create_bucket(Bucket="root-out")
    s3.client.create_multipart_upload(Bucket="root-out", Key="results.jsonl")
    assert abort_uploads(as_path("s3://root-out")) == 1
    assert s3.client.list_multipart_uploads(Bucket="root-out").get("Uploads", []) == []


@pytest.mark.parametrize("url", ["S3://bucket/run1", "s3://bucket/run1", "Https://host/d.jsonl"])
def test_a_url_scheme_is_matched_in_any_case(url: str) -> None:
    from batchgen.io.fs import as_path, is_object, scheme_of

    scheme = url.split(":")[0].lower()
    assert scheme_of(url) == scheme
    path = as_path(url)
    assert is_object(path) and str(path) == f"{scheme}://{url.split('://')[1]}"
    assert scheme_of("FILE:///tmp/x") is None and str(as_path("FILE:///tmp/x")) == "/tmp/x"


@pytest.mark.parametrize(
    "pattern",
    [
        "data/*.parquet",
        "data/**/*.parquet",
        "data/*/*.parquet",
        "data/.*.parquet",
        "data/.spark-staging/*.parquet",
        "data/[.]part-1.parquet",
    ],
)
def test_a_glob_names_the_same_files_on_s3_as_on_a_local_disk(
    s3: S3, tmp_path: Path, pattern: str
) -> None:
    """Hidden names (a writer's temp file, .spark-staging/) only where the pattern names a
    hidden part, as Python's glob does on a local disk."""
    from batchgen.io.readers import InputConfig, find_files

    tree = ["part-0.parquet", ".part-1.parquet", ".spark-staging/part-2.parquet"]
    tree += ["sub/part-3.parquet", "sub/.x/part-4.parquet"]
    for name in tree:
        s3.put(f"hidden/data/{name}", prompts_parquet(12))
        (tmp_path / "data" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / name).write_bytes(prompts_parquet(12))

    def found(base: str) -> list[str]:
        try:
            files = find_files(InputConfig(path=f"{base}/{pattern}"))
        except BatchgenError as exc:
            return [str(exc).replace(f"{base}/", "")]
        return [name.removeprefix(f"{base}/") for _, name in files]

    local = found(str(tmp_path))
    assert found(s3.url("hidden")) == local
    assert any(".part-1" in name for name in local) == pattern.startswith("data/.*")


@pytest.mark.parametrize(
    "out", ["hf://datasets/me/data/out", "https://example.invalid/out", "GS://bucket/out"]
)
def test_output_on_a_store_other_than_s3_is_refused_up_front(out: str, tmp_path: Path) -> None:
    """Only s3:// has the conditional PUT the lock needs: any other scheme is one line before
    the input is read or the store is reached."""
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    code, output = validate("--input", str(tmp_path / "in.jsonl"), "--output", out)
    assert code == 2 and output.count("\n") == 1, output
    assert "writes output to a local folder or s3:// only" in output
    with pytest.raises(BatchgenError, match="local folder or s3:// only"):
        OutputLayout(out)


@pytest.mark.parametrize(
    ("pattern", "out", "refused"),
    [
        ("data*/*.parquet", "data-out", True),
        ("data*/*.parquet", "other/out", False),
        ("data/*.parquet", "data/out", False),
        ("data/*/*.parquet", "data/out", True),
        ("data/**/*.parquet", "data/out", True),
        ("data/**/*.parquet", "data/.out", False),
        ("data/.*/*.parquet", "data/.out", True),
        ("data", "data/out", True),
        ("data", "data/_out", False),
    ],
)
def test_an_output_the_input_may_read_is_refused_alike_on_s3_and_locally(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pattern: str, out: str, refused: bool
) -> None:
    """One rule: a glob is refused where it may match a file the job writes (results,
    shards), not by comparing the URLs' text."""
    from batchgen.job import check_job

    monkeypatch.chdir(tmp_path)
    for key in ("data/a.parquet", "data/sub/b.parquet", "data/.h/d.parquet", "data1/c.parquet"):
        s3.put(f"outin/{key}", prompts_parquet(12))
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(prompts_parquet(12))
    for base in (str(tmp_path), s3.url("outin")):
        spec = spec_for(Path("m"), f"{base}/{pattern}", f"{base}/{out}")
        if refused:
            with pytest.raises(BatchgenError, match="would read its own results as input"):
                check_job(spec)
        else:
            check_job(spec)


def test_a_lock_that_cannot_be_read_is_a_store_error_not_a_lost_lock(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credentials revoked while a run holds the lock: its next check names the refusal; only
    a lock that is gone or names another run is "lost"."""
    import boto3

    iam = boto3.session.Session().client("iam")
    key = iam.create_access_key(UserName="batchgen")["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    lock = ObjectLock(OutputLayout(s3.url("revoked/out")))
    lock.acquire()
    lock.check()
    iam.delete_access_key(UserName="batchgen", AccessKeyId=key["AccessKeyId"])
    with pytest.raises(BatchgenError) as caught:
        lock.check()
    assert "lost the lock" not in str(caught.value)
    assert "reading the lock s3://batchgen-test/revoked/out/job.lock" in str(caught.value)
    assert "check the credentials" in str(caught.value)
    monkeypatch.undo()  # the fixture's credentials again, in a fresh filesystem
    s3.client.delete_object(Bucket=BUCKET, Key="revoked/out/job.lock")
    with pytest.raises(BatchgenError, match="lost the lock"):
        ObjectLock(OutputLayout(s3.url("revoked/out")), run=lock.run).check()


def test_a_lock_whose_pid_is_this_process_or_a_later_process_is_taken_over(s3: S3) -> None:
    """A restarted container gives the rerun the dead run's pid, or an unrelated process has
    it now: the lock records when its process started, so either is seen as gone. A lock this
    process holds, or a live process's with its own start time, stays in use."""
    import socket

    def _start_time(pid: int) -> int:  # /proc/<pid>/stat field 22
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text[text.rindex(")") + 2 :].split()[19])

    layout = OutputLayout(s3.url("pid/out"))
    host = socket.gethostname()
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as live:
        try:
            started = _start_time(live.pid)
            dead = [
                {"pid": os.getpid(), "host": host, "run": "dead-run"},  # this process' pid
                {"pid": live.pid, "host": host, "run": "dead-run", "started": started - 1},
            ]
            for owner in dead:
                s3.put("pid/out/job.lock", json.dumps(owner).encode())
                with ObjectLock(layout) as lock:
                    body = json.loads(s3.get("pid/out/job.lock"))
                    assert body["run"] == lock.run and body["started"] == _start_time(os.getpid())
            owner = {"pid": live.pid, "host": host, "run": "live-run", "started": started}
            s3.put("pid/out/job.lock", json.dumps(owner).encode())
            with pytest.raises(
                BatchgenError, match=f"in use by another batchgen run \\(pid {live.pid}"
            ):
                ObjectLock(layout).acquire()
        finally:
            live.kill()
    s3.client.delete_object(Bucket=BUCKET, Key="pid/out/job.lock")
    with ObjectLock(layout), pytest.raises(BatchgenError, match="in use"):
        ObjectLock(layout).acquire()  # held by this process: not stale


@pytest.mark.parametrize("fmt", ["auto", "arrow", "jsonl"])
def test_a_save_to_disk_folder_on_s3_is_refused_in_one_line(
    s3: S3, tmp_path: Path, fmt: str
) -> None:
    """Its dataset_info.json is no JSONL input, and datasets maps such a folder from a local
    disk only."""
    datasets = pytest.importorskip("datasets")
    from batchgen.io.readers import InputConfig, open_input

    datasets.Dataset.from_dict({"prompt": PROMPTS}).save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "saved").iterdir():
        s3.put(f"saved/ds/{path.name}", path.read_bytes())
    with pytest.raises(BatchgenError, match="save_to_disk folders must be local") as caught:
        open_input(InputConfig(path=s3.url("saved/ds"), format=fmt))
    assert s3.url("saved/ds") in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("rank", [False, True])
def test_a_parquet_object_rewritten_midway_gives_no_row_of_its_new_content(
    s3: S3, monkeypatch: pytest.MonkeyPatch, rank: bool
) -> None:
    """The object is replaced (same layout, other values) once its first batch is given; its
    reads fetch small blocks, so later batches would come from the new object: each batch is
    checked against the object's ETag (one HEAD) before its rows are given."""
    from batchgen.io import InputConfig, fs, open_input
    from batchgen.row_share import RowShare

    monkeypatch.setattr(fs, "STORE_BLOCK_BYTES", 1024)

    def content(tag: str) -> bytes:
        table = pa.table(
            {
                "uid": [f"u{i:03d}" for i in range(64)],
                "prompt": [f"{tag}{i:03d}" for i in range(64)],
            }
        )
        sink = io.BytesIO()
        pq.write_table(table, sink, row_group_size=16, compression="none")
        return sink.getvalue()

    key = f"midway/{rank}.parquet"
    s3.put(key, content("A"))
    source = open_input(InputConfig(s3.url(key), batch_rows=16))
    source.fingerprint()
    share = RowShare(0, 2).rows(64, set())
    batches = source.rank_batches(["prompt"], "uid", share) if rank else source.batches()
    got: list[str] = []
    with pytest.raises(BatchgenError, match="changed while the job read it"):
        for batch in batches:
            got.extend(row.values.get("prompt") or row.values["uid"] for row in batch)
            s3.put(key, content("B"))
    assert got and not [value for value in got if value.startswith("B")]


def test_a_long_jsonl_object_is_read_at_a_cost_per_line_that_does_not_grow(
    s3: S3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As over http(s): the bytes its store file gives are a few times the file's, not a
    block per line; rows, line numbers and errors are the local file's."""
    from tests.test_http_input import lines_with_errors, read_counting

    data = lines_with_errors(3000)
    s3.put("long/d.jsonl", data)
    rows, ranked, given = read_counting(s3.url("long/d.jsonl"), monkeypatch)
    (tmp_path / "d.jsonl").write_bytes(data)
    local_rows, local_ranked, _ = read_counting(str(tmp_path / "d.jsonl"), monkeypatch)
    assert rows == local_rows and ranked == local_ranked and len(rows) == 2999
    assert given < 4 * len(data), given


def test_a_folder_marker_is_an_empty_folder_and_a_delete_refusal_is_one_line(
    s3: S3, model_dir, monkeypatch
) -> None:
    """A console-made folder (the empty `name/` object) is an empty output folder, as an
    empty local one is; credentials that may write but not delete there are refused in one
    line before any model work (a job deletes its lock and temp objects), naming the delete."""
    from batchgen.io.fs import ObjectPath

    model = model_dir("llama")
    s3.put("mark/in/a.parquet", prompts_parquet(12))
    s3.put("mark/out/", b"")
    assert run_job(spec_for(model, s3.url("mark/in"), s3.url("mark/out"))).complete

    def refused(self: ObjectPath, missing_ok: bool = False) -> None:
        raise PermissionError("Access Denied")

    monkeypatch.setattr(ObjectPath, "unlink", refused)
    loads: list[str] = []
    monkeypatch.setattr("batchgen.job.load_engine", lambda *a, **k: loads.append("load"))
    match = r"deleting s3://.*mark/none/\.tmp-validate-\d+ was refused \(Access Denied\)"
    with pytest.raises(BatchgenError, match=match + ".*a job deletes its lock and temp objects"):
        run_job(spec_for(model, s3.url("mark/in"), s3.url("mark/none")))
    assert not loads and all(".tmp-validate-" in k for k in s3.keys("mark/none/"))


def test_a_read_refused_under_a_prefix_names_the_object_and_the_credentials(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchgen.io.fs import ObjectPath

    s3.put("denied/in/a.jsonl", b'{"prompt": "hi"}\n')
    opened = ObjectPath.open

    def refused(self: ObjectPath, *args: Any, **kwargs: Any) -> Any:
        if self.key.endswith("a.jsonl"):
            raise PermissionError("Access Denied")
        return opened(self, *args, **kwargs)

    monkeypatch.setattr(ObjectPath, "open", refused)
    code, output = validate("--input", s3.url("denied/in"), "--output", s3.url("denied/out"))
    assert code == 2 and output.count("\n") == 1, output
    assert f"reading {s3.url('denied/in/a.jsonl')} was refused (Access Denied)" in output
    assert "check the credentials" in output
