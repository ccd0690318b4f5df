"""Input named by an http(s) URL, served by a local HTTP server on 127.0.0.1 (a thread): one
object read by byte ranges; a server that cannot give it whole and by range is one line."""

from __future__ import annotations

import gzip
import io
import json
import re
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen import BatchgenError
from batchgen.io.readers import InputConfig, open_input
from tests.helpers import LoopbackHandler

pytest.importorskip("aiohttp")

PROMPTS = [f"Item {i}: describe it in a few words." for i in range(12)]
JSONL = "".join(json.dumps({"uid": f"u{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS))


def _parquet() -> bytes:
    sink = io.BytesIO()
    table = pa.table({"uid": [f"u{i}" for i in range(12)], "prompt": PROMPTS})
    pq.write_table(table, sink, row_group_size=4)
    return sink.getvalue()


def _big_parquet() -> bytes:
    """Over 64 KiB (Arrow's footer read), in row groups, uncompressed."""
    sink = io.BytesIO()
    table = pa.table(
        {"uid": [f"u{i}" for i in range(BIG)], "prompt": [f"p{i} " * 8 for i in range(BIG)]}
    )
    pq.write_table(table, sink, row_group_size=500, compression="none")
    return sink.getvalue()


BIG = 3000
CAP = 4096
FILES = {"d.jsonl": JSONL.encode(), "d.parquet": _parquet(), "big.parquet": _big_parquet()}


class Handler(LoopbackHandler):
    """/plain/<name>: with Range; /gzip/<name>: Content-Encoding gzip; /short/<name>: half
    the body its Content-Length announces; /norange/<name>: the whole file whatever the Range
    (as `python -m http.server`); /probe/<name>: a one-byte range alone answered as asked;
    /e<status>/<name>: that status to every request; /get<status>/<name>: to a GET alone;
    /cap/<name>: a range answered with CAP bytes at most (206, a correct Content-Range);
    /breakmid/<name>: a range from byte 1 to 64 KiB before the end broken off midway."""

    def _answer(self, head: bool) -> None:
        kind, _, name = self.path.split("?")[0].lstrip("/").partition("/")
        data = FILES.get(name)
        refused = re.match(r"(e|get)(\d+)$", kind)
        if data is None:
            self._send(404, b"not found", {"Content-Length": "9"}, head)
        elif refused and (refused.group(1) == "e" or not head):
            body = b"<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>"
            self._send(int(refused.group(2)), body, {"Content-Length": str(len(body))}, head)
        elif kind == "plain":
            self._plain(data, head)
        elif kind == "norange" or (kind == "probe" and not self._one_byte()):
            self._send(200, data, {"Content-Length": str(len(data))}, head)
        elif kind in ("probe", "cap"):
            self._plain(data, head, cap=CAP if kind == "cap" else None)
        elif kind == "breakmid":
            self._plain(data, head, short=0 < self._start() < len(data) - 65536)
        elif kind == "gzip":
            body = gzip.compress(data, mtime=0)
            self._send(
                200, body, {"Content-Length": str(len(body)), "Content-Encoding": "gzip"}, head
            )
        else:  # short
            self._plain(data, head, short=True)

    def _one_byte(self) -> bool:
        match = re.match(r"bytes=(\d+)-(\d+)$", self.headers.get("Range") or "")
        return match is not None and match.group(1) == match.group(2)

    def _start(self) -> int:
        """The first byte a range request asks for (-1: no range, or one byte alone)."""
        match = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        return -1 if match is None or self._one_byte() else int(match.group(1))

    def _plain(self, data: bytes, head: bool, short: bool = False, cap: int | None = None) -> None:
        """short: half the body its Content-Length announces, then the connection closed."""
        match = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        code, part, headers = 200, data, {}
        if match is not None:
            start = int(match.group(1))
            end = min(int(match.group(2) or len(data) - 1), len(data) - 1)
            end = end if cap is None else min(end, start + cap - 1)
            code, part = 206, data[start : end + 1]
            headers = {
                "Content-Range": f"bytes {start}-{end}/{len(data)}",
                "Accept-Ranges": "bytes",
            }
        cut = len(part) > 1 and short
        self._send(
            code,
            part[: len(part) // 2] if cut else part,
            headers | {"Content-Length": str(len(part))},
            head,
        )
        self.close_connection = cut


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("name", ["d.jsonl", "d.parquet"])
@pytest.mark.parametrize("query", ["", "?X-Amz-Signature=ab*c&X-Amz-Expires=60"])
def test_an_http_url_is_read_as_one_object(server: str, name: str, query: str) -> None:
    """The whole URL reaches the server (a query string is no glob); the fingerprint names
    the file without its query, so a fresh presigned URL is the same input."""
    source = open_input(InputConfig(path=f"{server}/plain/{name}{query}"))
    rows = [row.values for batch in source.batches() for row in batch]
    assert source.num_rows == 12 and [r["uid"] for r in rows] == [f"u{i}" for i in range(12)]
    (entry,) = source.fingerprint()["files"]
    assert entry["name"] == name and entry["size"] == len(FILES[name])


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("gzip/d.jsonl", "cannot be read by byte ranges: download it"),
        ("gzip/d.parquet", "cannot be read by byte ranges: download it"),
        ("short/d.jsonl", "the transfer failed: run again"),
        ("short/d.parquet", "the transfer failed: run again"),
        ("norange/d.jsonl", "cannot be read by byte ranges: download it"),
        ("norange/d.parquet", "cannot be read by byte ranges: download it"),
        ("plain/missing.jsonl", "does not exist"),
        ("e404/d.jsonl", "does not exist: check the URL"),
        ("e410/d.jsonl", "does not exist: check the URL"),
        ("e403/d.jsonl", "refused access (HTTP 403): the URL may have expired or need credentials"),
        ("e401/d.parquet", "refused access (HTTP 401): the URL may have expired"),
        ("e500/d.jsonl", "server error (HTTP 500): run again later"),
        ("e503/d.parquet", "server error (HTTP 503): run again later"),
        ("e429/d.jsonl", "server error (HTTP 429): run again later"),
        ("get403/d.parquet", "refused access (HTTP 403): the URL may have expired"),
        ("get503/d.jsonl", "server error (HTTP 503): run again later"),
        ("plain/*.jsonl", "does not exist"),
    ],
)
def test_what_cannot_be_read_over_http_is_one_line(server: str, where: str, message: str) -> None:
    with pytest.raises(BatchgenError) as caught:
        source = open_input(InputConfig(path=f"{server}/{where}"))
        source.fingerprint()
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("name", FILES)
def test_a_read_midway_that_a_server_answers_whole_is_one_line(server: str, name: str) -> None:
    """The server answers the one-byte check by its range, later ones with the whole file."""
    from batchgen.io.fs import as_path

    with as_path(f"{server}/probe/{name}").open() as f, pytest.raises(OSError) as caught:
        f.seek(len(FILES[name]) // 2)
        f.read(4)
    assert "cannot be read by byte ranges: download it" in str(caught.value)


def test_validate_refuses_a_server_that_ignores_range_requests(server: str, tmp_path: Path) -> None:
    """A user's error, exit 2, before any model work: not an internal error."""
    from click.testing import CliRunner

    from batchgen.cli import main

    for name in FILES:
        args = ["validate", "--model", "default", "--input", f"{server}/norange/{name}"]
        result = CliRunner().invoke(main, [*args, "--output", str(tmp_path / "out")])
        assert result.exit_code == 2, result.output
        assert "cannot be read by byte ranges: download it and give the local file" in result.output


def test_a_job_over_an_http_url_resumes_under_a_fresh_query_string(
    server: str, model_dir, tmp_path: Path
) -> None:
    from batchgen.job import run_job
    from batchgen.spec import load_spec

    def spec(query: str):
        return load_spec(
            None,
            [
                f"model.path={json.dumps(str(model_dir('llama')))}",
                f"input.path={json.dumps(f'{server}/plain/d.parquet{query}')}",
                f"output.dir={json.dumps(str(tmp_path / 'out'))}",
                "prompt.id_column='uid'",
                "sampling.max_new_tokens=4",
                "runtime.quiet=true",
                "runtime.device='cpu'",
            ],
        )

    first = run_job(spec("?sig=1"))
    assert first.complete and first.summary.rows_ok == 12
    again = run_job(spec("?sig=2"))
    assert again.complete and again.summary.resumed and again.summary.run_rows_ok == 0


@pytest.mark.parametrize("name", ["big.parquet", "d.jsonl"])
def test_ranges_answered_short_are_read_whole(server: str, name: str) -> None:
    """A server may answer a range request with fewer bytes than asked: the rest is asked
    for, every row comes whole."""
    source = open_input(InputConfig(path=f"{server}/cap/{name}"))
    rows = [row.values for batch in source.batches() for row in batch]
    count = BIG if name == "big.parquet" else 12
    assert [r["uid"] for r in rows] == [f"u{i}" for i in range(count)]
    if name == "big.parquet":
        assert [r["prompt"] for r in rows] == [f"p{i} " * 8 for i in range(BIG)]


@pytest.mark.parametrize("rank", [False, True])
def test_a_parquet_transfer_broken_midway_is_no_damaged_file(server: str, rank: bool) -> None:
    """The footer reads whole, then a row group's transfer breaks off: the line says the
    transfer failed (run again), not that the file is damaged (replace it)."""
    from batchgen.row_share import RowShare

    source = open_input(InputConfig(path=f"{server}/breakmid/big.parquet"))
    share = RowShare(0, 2).rows(BIG, set())
    with pytest.raises(BatchgenError) as caught:
        list(source.rank_batches(["prompt"], "uid", share) if rank else source.batches())
    message = str(caught.value)
    assert "the transfer failed: run again" in message and "\n" not in message
    assert "damaged" not in message and "replace" not in message


def test_a_server_that_cannot_be_reached_is_one_line_that_says_so() -> None:
    """A port nothing listens on (a server that was just closed): not 'does not exist'."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = httpd.server_address[1]
    httpd.server_close()
    with pytest.raises(BatchgenError) as caught:
        open_input(InputConfig(path=f"http://127.0.0.1:{port}/plain/d.jsonl"))
    line = str(caught.value)
    assert f"cannot reach 127.0.0.1:{port} (" in line, line
    assert line.endswith("check the address and run again") and "\n" not in line


@pytest.mark.parametrize("where", ["plain", "norange"])
@pytest.mark.parametrize("content", [b"", b"\n"])
def test_an_empty_jsonl_url_is_read_as_an_empty_local_file(
    server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str, content: bytes
) -> None:
    """Under two bytes: nothing to read by range (not checked), no rows, as a local one."""
    monkeypatch.setitem(FILES, "empty.jsonl", content)
    source = open_input(InputConfig(path=f"{server}/{where}/empty.jsonl"))
    (tmp_path / "empty.jsonl").write_bytes(content)
    local = open_input(InputConfig(path=str(tmp_path / "empty.jsonl")))
    assert source.num_rows == local.num_rows == 0
    assert list(source.batches()) == list(local.batches()) == []


def test_an_empty_parquet_url_is_refused_as_an_empty_local_file(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(FILES, "empty.parquet", b"")
    with pytest.raises(BatchgenError, match=r"Parquet file size is 0 bytes\): replace or remove"):
        open_input(InputConfig(path=f"{server}/plain/empty.parquet"))


def lines_with_errors(rows: int) -> bytes:
    """JSON Lines with a blank line, a malformed line and a line without its end."""
    lines = [json.dumps({"uid": f"u{i}", "prompt": f"p{i} " * 8}) for i in range(rows)]
    lines[rows // 3] = "{not json"
    lines[rows // 2] = "   "
    return ("\n".join(lines)).encode()


def read_counting(url: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list, int]:
    """(rows and errors of every row, of a rank's rows; the bytes its store files gave)."""
    import fsspec.spec

    from batchgen.io import readers
    from batchgen.row_share import RowShare

    given = [0]
    read = fsspec.spec.AbstractBufferedFile.read

    def counted(self: object, length: int = -1) -> bytes:
        data = read(self, length)
        given[0] += len(data)
        return data

    monkeypatch.setattr(readers, "COUNT_CHUNK_BYTES", 4096)  # many line marks and spans
    monkeypatch.setattr(fsspec.spec.AbstractBufferedFile, "read", counted)
    source = open_input(InputConfig(path=url, batch_rows=64))
    share = RowShare(1, 3).rows(source.num_rows, set())

    def seen(batches: Iterator[list[Any]]) -> list[tuple[int, Any, str | None]]:
        # an error names the file as given: the line number and reason are compared
        return [(r.index, r.values, r.error and r.error[len(url) :]) for b in batches for r in b]

    return seen(source.batches()), seen(source.rank_batches(None, None, share)), given[0]


def test_a_long_jsonl_url_is_read_at_a_cost_per_line_that_does_not_grow(
    server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Its lines are read through a buffer: the bytes its store file gives are a few times
    the file's (the scan, the read, a rank's read), not a block per line; rows, line numbers
    and errors are the local file's."""
    data = lines_with_errors(3000)
    monkeypatch.setitem(FILES, "long.jsonl", data)
    rows, ranked, given = read_counting(f"{server}/plain/long.jsonl", monkeypatch)
    (tmp_path / "long.jsonl").write_bytes(data)
    local_rows, local_ranked, _ = read_counting(str(tmp_path / "long.jsonl"), monkeypatch)
    assert rows == local_rows and ranked == local_ranked and len(rows) == 2999
    assert any("line 1001: malformed JSON" in (error or "") for _, _, error in rows)
    assert given < 4 * len(data), given
