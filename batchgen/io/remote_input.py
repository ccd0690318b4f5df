"""Input files named by an object-store URL, found by the rules local input follows
(io/input_names.py): one object, a glob, or a prefix (folder) whose data files are read in
sorted order. An http(s) URL names one object: its '?' starts a query string (a presigned
URL's), and a web server lists no folders."""

from __future__ import annotations

import glob
from typing import Any
from urllib.parse import urlsplit

from batchgen.errors import BatchgenError, first_line
from batchgen.io.fs import (
    URL_SCHEMES,
    ObjectPath,
    as_path,
    http_status,
    status_line,
    store_error,
    unreached,
)
from batchgen.io.input_names import (
    SAVED_DATASET_MARKERS,
    check_not_compressed,
    folder_skips,
    glob_skips,
    read_order,
    saved_dataset_on_a_store,
)


def find_objects(raw: str, wanted: set[str]) -> list[tuple[ObjectPath, str]]:
    """[(object, name used in messages)] in read order. wanted: the file extensions a prefix
    (folder) is searched for. BatchgenError (one line) when nothing is found, the bucket is
    missing or access is refused."""
    root: ObjectPath = as_path(raw)
    try:
        if root.scheme in URL_SCHEMES:
            return _one_object(root, raw)
        if glob.has_magic(raw):
            found = root.fs.glob(root.key)
            keys = sorted(k for k in found if not glob_skips(root.key, k) and root.fs.isfile(k))
            if not keys:
                raise BatchgenError(f"no files match {raw!r}: check the pattern")
            return [(ObjectPath(root.fs, root.scheme, k), f"{root.scheme}://{k}") for k in keys]
        if _kind(root, raw) == "file":
            return [(root, raw)]
        found = list(root.rglob("*"))
        if any(str(path.relative_to(root)) in SAVED_DATASET_MARKERS for path in found):
            raise saved_dataset_on_a_store(raw)
        kept = [path for path in found if not folder_skips(path.relative_to(root))]
        for path in kept:
            check_not_compressed(path.relative_to(root).as_posix(), wanted)
        files = sorted(
            (path for path in kept if path.suffix.lower() in wanted),
            key=lambda path: read_order(path.relative_to(root)),
        )
    except BatchgenError:
        raise
    except Exception as exc:  # the store library's own errors (auth, bucket, network)
        raise store_error(exc, root, "reading") from exc
    if not files and not root.exists():
        raise BatchgenError(f"input {raw!r} does not exist: check the path")
    if not files:
        raise BatchgenError(
            f"{raw!r} holds no {'/'.join(sorted(wanted))} files: give a data file, a prefix "
            "holding them, or a glob"
        )
    return [(path, path.relative_to(root).as_posix()) for path in files]


def _one_object(path: ObjectPath, raw: str) -> list[tuple[ObjectPath, str]]:
    """An http(s) URL's object; its server's byte ranges are checked unless it holds under two
    bytes (nothing to read by range: an empty file is read as a local one is)."""
    info = _info(path, raw)
    if info is None:
        raise BatchgenError(f"input {raw!r} does not exist: check the URL")
    size = info.get("size")
    if size is None or size >= 2:
        _check_ranges(path, raw)
    return [(path, raw)]


def _check_ranges(path: ObjectPath, raw: str) -> None:
    """One byte read by a range request (the second: a server that ignores Range answers the
    whole file, which is refused before its body is read), so a server that cannot serve the
    file by byte ranges is one line before any work, not a failure midway."""
    try:
        path.check_ranges()
    except OSError as exc:
        lines = str(exc).strip().splitlines()
        raise BatchgenError(f"input {raw!r}: {lines[0] if lines else type(exc).__name__}") from exc


def _kind(path: ObjectPath, raw: str) -> str | None:
    """ "file", "directory", or None when nothing is there (_info)."""
    info = _info(path, raw)
    return None if info is None else info["type"]


def _info(path: ObjectPath, raw: str) -> dict[str, Any] | None:
    """What the store tells of `path` (its "type": "file" or "directory", its "size"), or None
    when nothing is there; the store's errors (access refused) propagate, where `is_file`
    would hide them. A web server's refusal (fsspec raises FileNotFoundError for every
    status, and for a server it cannot reach) is one line by its status, or says the server
    could not be reached."""
    try:
        return path.info()
    except FileNotFoundError as exc:
        if (line := status_line(http_status(exc))) is not None:
            raise BatchgenError(f"input {raw!r}: {line}") from exc
        if (cause := unreached(exc)) is not None:
            host = urlsplit(str(path)).netloc.rpartition("@")[2]
            raise BatchgenError(
                f"input {raw!r}: cannot reach {host} ({first_line(cause)}): check the address "
                "and run again"
            ) from exc
        return None
