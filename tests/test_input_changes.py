"""An input file that changes after the job scanned it (local, or over http(s) from a local
server on 127.0.0.1, a thread) is refused in one line before any row of the new content is
given, and one whose bytes are the same is read whole: JSON Lines bytes are checked against
the scan's digests before their rows are given (their size, time or ETag are not asked);
a Parquet file's size and modification time (an object's ETag) are checked at every open and
every batch, every range request is conditional on the ETag, and a local file whose time
alone changed is hashed again and compared with the job's fingerprint."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen import BatchgenError
from batchgen.io import readers
from batchgen.io.readers import InputConfig, open_input
from batchgen.row_share import RowShare
from tests.helpers import LoopbackHandler

ROWS = 20


def jsonl(tag: str, rows: int = ROWS) -> bytes:
    lines = (json.dumps({"uid": f"u{i}", "prompt": f"{tag} {i}"}) + "\n" for i in range(rows))
    return "".join(lines).encode()


def parquet(tag: str, rows: int = ROWS) -> bytes:
    sink = io.BytesIO()
    table = pa.table(
        {"uid": [f"u{i}" for i in range(rows)], "prompt": [f"{tag} {i}" for i in range(rows)]}
    )
    pq.write_table(table, sink, row_group_size=5)
    return sink.getvalue()


MAKE = {"jsonl": jsonl, "parquet": parquet}


class Handler(LoopbackHandler):
    """/etag/<name>: byte ranges, a strong ETag, If-Match honoured (412); /bare/<name>: byte
    ranges, neither ETag nor Last-Modified; /backends/<name>: as /etag/, but the answers come
    from two backends in turn, each with an ETag of its own for the same bytes. FILES: name ->
    content; AFTER_HEAD: name -> the content served after the next HEAD request for it is
    answered; REFUSED: names answered 403 (a presigned URL expired); other names: 404."""

    FILES: ClassVar[dict[str, bytes]] = {}
    AFTER_HEAD: ClassVar[dict[str, bytes]] = {}
    REFUSED: ClassVar[set[str]] = set()
    answered: ClassVar[int] = 0  # answers so far (which backend answers next)

    def do_HEAD(self) -> None:
        name = self._answer(head=True)
        if name in self.AFTER_HEAD:
            self.FILES[name] = self.AFTER_HEAD.pop(name)

    def _answer(self, head: bool) -> str:
        kind, _, name = self.path.split("?")[0].lstrip("/").partition("/")
        data = self.FILES.get(name)
        if data is None:
            self._send(404, b"", {"Content-Length": "0"}, head)
            return name
        if name in self.REFUSED:
            self._send(403, b"expired", {"Content-Length": "7"}, head)
            return name
        headers = {"Accept-Ranges": "bytes"}
        if kind in ("etag", "backends"):
            backend = f"backend{Handler.answered % 2}-" if kind == "backends" else ""
            Handler.answered += 1
            headers["ETag"] = f'"{backend}{hashlib.sha256(data).hexdigest()[:16]}"'
            wanted = self.headers.get("If-Match")
            if wanted is not None and wanted != headers["ETag"]:
                self._send(412, b"", {"Content-Length": "0"}, head)
                return name
        match = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if match is None:
            self._send(200, data, {**headers, "Content-Length": str(len(data))}, head)
            return name
        start = int(match.group(1))
        end = min(int(match.group(2) or len(data) - 1), len(data) - 1)
        part = data[start : end + 1]
        headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        self._send(206, part, {**headers, "Content-Length": str(len(part))}, head)
        return name


class Server(ThreadingHTTPServer):
    """A server whose close also closes the connections a client keeps open (HTTP/1.1): once
    closed, nothing answers on its port."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.connections: set[socket.socket] = set()

    def process_request(self, request: Any, client_address: Any) -> None:
        self.connections.add(request)
        super().process_request(request, client_address)

    def server_close(self) -> None:
        super().server_close()
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


def serve() -> tuple[Server, str]:
    httpd = Server()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def stop(httpd: Server) -> None:
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def server() -> Iterator[str]:
    httpd, url = serve()
    try:
        yield url
    finally:
        stop(httpd)
        Handler.FILES.clear()
        Handler.AFTER_HEAD.clear()
        Handler.REFUSED.clear()
        Handler.answered = 0


def rows_until_refused(source: Any, rank: bool) -> list[Any]:
    """The rows given before the read is refused (it must be)."""
    got: list[Any] = []
    share = RowShare(1, 2).rows(ROWS, set())
    batches = source.rank_batches(["prompt"], "uid", share) if rank else source.batches()
    with pytest.raises(BatchgenError, match="changed while the job read it") as caught:
        for batch in batches:
            got.extend(row.values for row in batch)
    assert "\n" not in str(caught.value) and "run the same command again" in str(caught.value)
    return got


def changed(kind: str) -> list[tuple[str, bytes]]:
    """(what, new content): the same rows edited (for JSON Lines the same size), more rows."""
    return [("edited", MAKE[kind]("B")), ("grown", MAKE[kind]("A", ROWS + 5))]


@pytest.mark.parametrize("rank", [False, True])
@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_local_file_changed_after_the_scan_gives_no_row(
    tmp_path: Path, kind: str, rank: bool
) -> None:
    path = tmp_path / f"d.{kind}"
    for what, content in changed(kind):
        path.write_bytes(MAKE[kind]("A"))
        stat = path.stat()
        source = open_input(InputConfig(str(path), batch_rows=4))
        path.write_bytes(content)
        # JSON Lines: the old modification time kept (its bytes are checked); Parquet: a later one
        later = stat.st_mtime_ns + (0 if kind == "jsonl" else 10**9)
        os.utime(path, ns=(stat.st_atime_ns, later))
        got = rows_until_refused(source, rank)
        assert all(not v.get("prompt") or v["prompt"].startswith("A") for v in got), what


def read_all(source: Any, rank: bool) -> list[Any]:
    share = RowShare(1, 2).rows(ROWS, set())
    batches = source.rank_batches(["prompt"], "uid", share) if rank else source.batches()
    return [row.values for batch in batches for row in batch]


def touch(path: Path) -> None:
    """A later modification time, the same bytes."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def replace_same(path: Path) -> None:
    """The same bytes written to a new file that replaces it (a new inode), its time kept."""
    stat = path.stat()
    fresh = path.with_name(f".{path.name}.new")
    fresh.write_bytes(path.read_bytes())
    os.utime(fresh, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(fresh, path)


def replace_later(path: Path) -> None:
    """The same bytes atomically replacing it, with a later modification time."""
    replace_same(path)
    touch(path)


@pytest.mark.parametrize("rank", [False, True])
@pytest.mark.parametrize("how", [touch, replace_same, replace_later])
@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_local_file_with_the_same_bytes_is_read_whole(
    tmp_path: Path, kind: str, how: Callable[[Path], None], rank: bool
) -> None:
    """Touched or replaced by the same bytes after the scan (and the job's fingerprint): no
    change. JSON Lines bytes are checked against the scan's digests; a Parquet file whose
    time changed is hashed again and compared with its fingerprint's digest."""
    path = tmp_path / f"d.{kind}"
    path.write_bytes(MAKE[kind]("A"))
    source = open_input(InputConfig(str(path), batch_rows=4))
    before = source.fingerprint()
    how(path)
    got = read_all(source, rank)
    assert len(got) == ROWS and all(v.get("prompt") or v.get("uid") for v in got)
    assert source.fingerprint() == before


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_local_file_touched_midway_is_read_whole(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"d.{kind}"
    path.write_bytes(MAKE[kind]("A"))
    source = open_input(InputConfig(str(path), batch_rows=4))
    source.fingerprint()  # a job takes it before it reads a row
    got = []
    for batch in source.batches():
        got.extend(row.values["prompt"] for row in batch)
        replace_later(path)
    assert got == [f"A {i}" for i in range(ROWS)]


@pytest.mark.parametrize("rank", [False, True])
def test_a_parquet_file_rewritten_in_place_mid_read_is_changed_not_damaged(
    tmp_path: Path, rank: bool
) -> None:
    """Rewritten in place (the same file, other bytes) between two row groups: the next read
    fails to parse before the per-batch check can run; the line says the file changed, not
    that it is damaged (it is not: replacing it would be the wrong advice)."""
    path = tmp_path / "d.parquet"
    path.write_bytes(parquet("A"))
    source = open_input(InputConfig(str(path), batch_rows=5))
    source.fingerprint()
    share = RowShare(0, 1).rows(ROWS, set())
    batches = source.rank_batches(["prompt"], "uid", share) if rank else source.batches()
    with pytest.raises(BatchgenError) as caught:
        for _ in batches:
            with path.open("r+b") as f:  # in place: the reader's open file sees the bytes
                f.write(os.urandom(len(parquet("A"))))
    assert "changed while the job read it" in str(caught.value), caught.value
    assert "damaged" not in str(caught.value)


def test_a_parquet_file_whose_time_changed_before_its_fingerprint_is_refused(
    tmp_path: Path,
) -> None:
    """No digest to compare with yet: a changed time is a changed file."""
    path = tmp_path / "d.parquet"
    path.write_bytes(parquet("A"))
    source = open_input(InputConfig(str(path), batch_rows=4))
    touch(path)
    with pytest.raises(BatchgenError, match="changed while the job read it"):
        source.fingerprint()


def test_a_parquet_file_changed_after_its_fingerprint_is_refused_midway(tmp_path: Path) -> None:
    """Its time changed and its bytes differ (same size): hashed again, refused."""
    path = tmp_path / "d.parquet"
    path.write_bytes(parquet("A"))
    source = open_input(InputConfig(str(path), batch_rows=4))
    source.fingerprint()
    got = []
    with pytest.raises(BatchgenError, match="changed while the job read it"):
        for batch in source.batches():
            got.extend(row.values["prompt"] for row in batch)
            path.write_bytes(parquet("B"))
            touch(path)
    assert got == [f"A {i}" for i in range(4)]


@pytest.mark.parametrize("rank", [False, True])
def test_one_url_whose_backends_give_other_etags_for_the_same_bytes_is_read(
    server: str, rank: bool
) -> None:
    """JSON Lines: the span digests are the check, not the ETag (no If-Match is sent: each
    backend would refuse the other's ETag)."""
    Handler.FILES["d.jsonl"] = jsonl("A")
    source = open_input(InputConfig(f"{server}/backends/d.jsonl", batch_rows=4))
    got = read_all(source, rank)
    assert len(got) == ROWS and all(v.get("prompt") or v.get("uid") for v in got)


@pytest.mark.parametrize("rank", [False, True])
@pytest.mark.parametrize(
    ("where", "kind"), [("etag", "jsonl"), ("etag", "parquet"), ("bare", "jsonl")]
)
def test_an_http_file_changed_after_the_scan_gives_no_row(
    server: str, where: str, kind: str, rank: bool
) -> None:
    """With an ETag, the open's HEAD sees the change; without one (nor Last-Modified), a JSON
    Lines file's bytes are checked against its scan's."""
    for what, content in changed(kind):
        Handler.FILES[f"d.{kind}"] = MAKE[kind]("A")
        source = open_input(InputConfig(f"{server}/{where}/d.{kind}", batch_rows=4))
        Handler.FILES[f"d.{kind}"] = content
        got = rows_until_refused(source, rank)
        assert all(not v.get("prompt") or v["prompt"].startswith("A") for v in got), what


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_an_http_file_changed_once_opened_is_refused_by_its_range_requests(
    server: str, kind: str
) -> None:
    """The content changes right after the open's HEAD: the range requests carry If-Match,
    and the server's 412 is the same one line."""
    Handler.FILES[f"d.{kind}"] = MAKE[kind]("A")
    source = open_input(InputConfig(f"{server}/etag/d.{kind}", batch_rows=4))
    Handler.AFTER_HEAD[f"d.{kind}"] = MAKE[kind]("B")
    assert rows_until_refused(source, rank=False) == []


def test_a_job_over_an_input_changed_after_its_scan_commits_no_row(
    server: str, model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is edited (same size, no ETag) once the job has scanned it: the job stops in
    one line before any row is committed."""
    from batchgen.job import run_job
    from batchgen.spec import load_spec

    Handler.FILES["d.jsonl"] = jsonl("A")
    opened = readers._open_jsonl

    def open_then_edit(*args: Any) -> Any:
        source = opened(*args)
        Handler.FILES["d.jsonl"] = jsonl("B")
        return source

    monkeypatch.setattr(readers, "_open_jsonl", open_then_edit)
    out = tmp_path / "out"
    spec = load_spec(
        None,
        [
            f"model.path={json.dumps(str(model_dir('llama')))}",
            f"input.path={json.dumps(f'{server}/bare/d.jsonl')}",
            f"output.dir={json.dumps(str(out))}",
            "prompt.id_column='uid'",
            "prompt.passthrough=['prompt']",
            "output.format='jsonl'",
            "sampling.max_new_tokens=2",
            "runtime.quiet=true",
            "runtime.device='cpu'",
        ],
    )
    with pytest.raises(BatchgenError, match="changed while the job read it"):
        run_job(spec)
    assert not (out / "results.jsonl").exists()
    assert not [p for p in out.rglob("*") if p.is_file() and p.parent.name == "shards"]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_url_refused_after_the_scan_is_no_change(server: str, kind: str) -> None:
    """A presigned URL that expires while the job runs is said to be refused, not changed."""
    Handler.FILES[f"d.{kind}"] = MAKE[kind]("A")
    source = open_input(InputConfig(f"{server}/etag/d.{kind}", batch_rows=4))
    Handler.REFUSED.add(f"d.{kind}")
    with pytest.raises(BatchgenError, match=r"refused access \(HTTP 403\): the URL may have"):
        list(source.batches())


@pytest.mark.parametrize("rank", [False, True])
@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_server_gone_after_the_scan_is_a_failed_transfer_not_a_change(
    kind: str, rank: bool
) -> None:
    """Its port closed (the connection refused): run again, not "changed"."""
    httpd, url = serve()
    try:
        Handler.FILES[f"d.{kind}"] = MAKE[kind]("A")
        source = open_input(InputConfig(f"{url}/etag/d.{kind}", batch_rows=4))
    finally:
        stop(httpd)
        Handler.FILES.clear()
    with pytest.raises(BatchgenError) as caught:
        read_all(source, rank)
    line = str(caught.value)
    assert "the transfer failed: run again" in line and "changed" not in line, line
    assert "\n" not in line


def test_a_parquet_url_deleted_after_the_scan_is_gone(server: str) -> None:
    """Its server answers 404: the input changed (it is gone)."""
    Handler.FILES["d.parquet"] = parquet("A")
    source = open_input(InputConfig(f"{server}/etag/d.parquet", batch_rows=4))
    del Handler.FILES["d.parquet"]
    with pytest.raises(BatchgenError, match=r"changed while the job read it \(it is gone"):
        read_all(source, rank=False)
