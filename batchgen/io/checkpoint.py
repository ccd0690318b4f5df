"""What makes an output directory a checkpoint: its manifest, its lock and its committed rows.

The manifest records the job's spec and its identity: every setting that can change a row's
output, a fingerprint of the input and one of the model. Resuming is allowed only when the
identity is unchanged; `force` (--force-resume) accepts a change on purpose. The lock keeps two
runs from writing one directory at once. The committed rows are read from the shards; a shard
that cannot be read whole is moved aside and its rows are generated again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError
from batchgen.io.atomic import write_json_atomic
from batchgen.io.fs import AnyPath, abort_uploads, arrow_file, store_error
from batchgen.io.layout import OutputLayout
from batchgen.io.output_schema import COUNT_COLUMNS, INPUT_HASH, KEY_COLUMNS, RowCounts

MANIFEST_VERSION = 2
IDENTITY_PARTS = ("settings", "input", "model")
GENERATION_DEFAULTS = "model.generation_defaults"  # the model's sampling values a job takes
# settings an earlier batchgen did not record, with the value they then had: an identity
# without one is the same job where the setting still has that value
UNRECORDED_SETTINGS: dict[str, Any] = {
    GENERATION_DEFAULTS: {},
    "prompt.chat_template_kwargs": None,
    "prompt.add_generation_prompt": True,
    "prompt.continue_final_message": False,
}
Key = tuple[int, int]  # (input index, sample index)


# -- identity --------------------------------------------------------------------------------


def identity_changes(
    recorded: dict[str, Any],
    current: dict[str, Any],
    parts: tuple[str, ...],
    forceable: bool = True,
) -> list[str]:
    """Human-readable differences between two identities, over the named parts. Settings are
    compared on the keys `current` holds (before the model loads it holds fewer); forceable:
    the caller offers --force-resume."""
    out: list[str] = []
    for part in parts:
        old, new = recorded.get(part), current.get(part)
        if part == "settings":
            for key in sorted(new or {}):
                a, b = (old or {}).get(key), (new or {}).get(key)
                if key == GENERATION_DEFAULTS and b and not a:
                    out.append(
                        f"the model's generation_config.json values {b} are taken now, and the "
                        'earlier run took none (runtime.generation_config = "ignore" runs it '
                        "as it ran)"
                    )
                elif key not in (old or {}):  # an identity written before batchgen recorded it
                    if key in UNRECORDED_SETTINGS and b == UNRECORDED_SETTINGS[key]:
                        continue
                    out.append(f"setting {key} was not recorded by the earlier run (now {b!r})")
                elif a != b:
                    out.append(f"setting {key} changed ({a!r} -> {b!r})")
        elif part == "input" and _content(old) != _content(new):
            out.append(f"the input changed ({describe_input_change(old, new)})")
        elif part == "model" and _older_fingerprint(old, new):
            keep = "--force-resume keeps the earlier rows" if forceable else "start over"
            out.append(
                "the model's fingerprint was recorded by an older batchgen, which did not "
                f"record its {' and '.join(sorted(set(new) - set(old)))}: if the model is the "
                f"same, {keep}"
            )
        elif part == "model" and _content(old) != _content(new):
            out.append(f"the model changed ({_model_change(old, new)})")
    return out


def _content(fingerprint: dict[str, Any] | None) -> Any:
    """What identifies an input or a model: file contents in read order, model digests; not
    the names they are found under (a copy elsewhere is the same)."""
    if fingerprint and fingerprint.get("kind") == "files":
        return [(f["size"], f["sha256"]) for f in fingerprint["files"]]
    if isinstance(fingerprint, dict):
        return {k: v for k, v in fingerprint.items() if k != "name"}
    return fingerprint


def describe_input_change(old: dict[str, Any] | None, new: dict[str, Any] | None) -> str:
    if not old or not new or old.get("kind") != new.get("kind"):
        return "another kind of input"
    if old["kind"] != "files":
        return "its fingerprint differs"
    a, b = old["files"], new["files"]
    before, after = {f["name"]: f for f in a}, {f["name"]: f for f in b}
    for name, y in after.items():  # a file under its earlier name, with other bytes
        x = before.get(name)
        if x is not None and x["sha256"] != y["sha256"]:
            return _file_change(name, x, y)
    added = [f["name"] for f in b if f["name"] not in before]
    gone = [f["name"] for f in a if f["name"] not in after]
    if added or gone:
        return "; ".join(
            f"{len(names)} file(s) {verb}: {names[0]!r}{' ...' if len(names) > 1 else ''}"
            for verb, names in (("added", added), ("gone", gone))
            if names
        )
    return "its fingerprint differs"


def moved_files(old: dict[str, Any] | None, new: dict[str, Any] | None) -> str | None:
    """Why an input's files no longer hold its earlier rows at their positions (a file gone,
    or another put before or among the earlier ones), else None: the earlier files, each under
    its name or with its content, come first and in their order. Within a file rows may have
    changed; other kinds of input cannot be told."""
    if not old or not new or old.get("kind") != "files" or new.get("kind") != "files":
        return None
    a, b = old["files"], new["files"]
    for i, x in enumerate(a):
        if i >= len(b):
            return f"{x['name']!r} is gone"
        y = b[i]
        if x["name"] != y["name"] and (x["size"], x["sha256"]) != (y["size"], y["sha256"]):
            return f"{y['name']!r} now comes where {x['name']!r} came in read order"
    return None


def committed_ids(layout: OutputLayout) -> dict[int, str]:
    """index -> id of every committed row (read again from the shards, those columns only)."""
    return {
        row["index"]: row["id"]
        for path in layout.shard_paths()
        for row in iter_shard_rows(path, ["index", "id"])
    }


def _file_change(name: str, x: dict[str, Any], y: dict[str, Any]) -> str:
    if x["size"] != y["size"]:
        return f"{name!r}: {x['size']:,} -> {y['size']:,} bytes"
    return f"{name!r}: same size, other content"


def _older_fingerprint(old: Any, new: Any) -> bool:
    """The earlier run's model fingerprint lacks a part this batchgen records (its digests
    cannot be compared: the model may be the same)."""
    return isinstance(old, dict) and isinstance(new, dict) and bool(set(new) - set(old))


def _model_change(old: dict[str, Any] | None, new: dict[str, Any] | None) -> str:
    if not old or not new:
        return "no fingerprint recorded"
    what = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k) and k != "name"]
    return " and ".join(what) + " differ" if what else "its fingerprint differs"


# -- manifest --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    spec: dict[str, Any]
    identity: dict[str, Any]


def read_manifest(layout: OutputLayout) -> Manifest | None:
    """The recorded manifest; None when there is none. BatchgenError when it is damaged."""
    path = layout.manifest
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_bytes())
        if not isinstance(data, dict) or not isinstance(data.get("spec"), dict):
            raise ValueError("no spec")
        identity = data.get("identity")
        if data.get("version") != MANIFEST_VERSION or not isinstance(identity, dict):
            raise ValueError("written by an older batchgen (no identity)")
        if not all(part in identity for part in IDENTITY_PARTS):
            raise ValueError("identity incomplete")
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        raise DamagedManifest(f"{path.name} cannot be used ({_reason(exc)})") from exc
    return Manifest(data["spec"], identity)


class DamagedManifest(BatchgenError):
    """The manifest exists but cannot be read as one."""


def write_manifest(
    layout: OutputLayout, spec: dict[str, Any], identity: dict[str, Any], previous: Any = None
) -> None:
    data = {"version": MANIFEST_VERSION, "spec": spec, "identity": identity}
    if previous is not None:
        data["previous"] = previous
    write_json_atomic(layout.manifest, data)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def write_failed(exc: BaseException, layout: OutputLayout) -> BaseException:
    """A failed write into the output directory (a full disk, a quota, an I/O error) as the
    one line that says so; a BatchgenError as it is."""
    if isinstance(exc, BatchgenError):
        return exc
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = "the disk is full" if exc.errno == errno.ENOSPC else "the disk quota is used up"
    else:
        reason = (
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        )
    error = BatchgenError(
        f"writing results into '{layout.dir}' failed ({reason}): the rows committed so far are "
        "kept; fix the cause and run the same command again to resume"
    )
    error.__cause__ = exc
    return error


@contextlib.contextmanager
def writing_into(layout: OutputLayout) -> Iterator[None]:
    """An OSError raised in the block is a failed write into the directory (write_failed)."""
    try:
        yield
    except OSError as exc:
        raise write_failed(exc, layout) from exc


# -- lock ------------------------------------------------------------------------------------


def new_run_token() -> str:
    """Names one run in its lock file (random)."""
    return secrets.token_hex(8)


def check_directory_writable(out: Path) -> None:
    """What taking a local directory's lock refuses, found without writing anything: the
    path is a file, or the directory cannot be created or written in (no permission, a
    read-only file system, a file where a folder above it should be)."""
    if out.exists() and not out.is_dir():
        raise BatchgenError(f"output directory '{out}' is a file: choose a directory path")
    existing = out.absolute()
    while not existing.exists():
        if existing.is_symlink():  # a link to nothing: mkdir would find the link there
            raise BatchgenError(
                f"cannot create output directory '{out}' ({existing} is a symbolic link to "
                f"'{os.readlink(existing)}', which does not exist): create that folder, or "
                "choose another path"
            )
        existing = existing.parent
    if not existing.is_dir():
        raise BatchgenError(
            f"cannot create output directory '{out}' ({existing} is a file): choose a writable path"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        doing = "write in" if existing == out.absolute() else "create"
        raise BatchgenError(
            f"cannot {doing} output directory '{out}' ({existing} is not writable: no "
            "permission, or a read-only file system): choose a writable directory"
        )


@dataclass
class DirectoryLock:
    """An exclusive lock on an output directory, held from acquire() to release().

    The lock file holds the owner's pid and host. On one host the kernel's advisory lock
    (flock) decides: a lock file left by a dead process is stale and taken over. The directory
    is created when missing, and removed again on release if this lock created it and nothing
    was written into it. The file also names this run (`run`, random), so that the other ranks
    of a data-parallel job can check that the lock rank 0 took is still this run's
    (RankLock).
    """

    layout: OutputLayout
    run: str = field(default_factory=new_run_token)
    _fd: int | None = None
    _created: bool = False

    def acquire(self) -> None:
        out = self.layout.dir
        check_directory_writable(out)
        self._created = not out.exists()
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BatchgenError(
                f"cannot create output directory '{out}' ({_reason(exc)}): choose a writable path"
            ) from exc
        for _ in range(10):  # the file may be replaced between open and flock: try again
            try:
                fd = os.open(self.layout.lock, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise BatchgenError(
                    f"cannot write in output directory '{out}' ({_reason(exc)}): "
                    "choose a writable directory"
                ) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                owner = _read_owner(fd)
                os.close(fd)
                raise BatchgenError(
                    f"output directory '{out}' is in use by another batchgen run ({owner}): "
                    "wait for it to finish, or stop it; use another directory to run both"
                ) from None
            if _same_file(fd, self.layout.lock):
                self._fd = fd
                try:
                    _write_owner(fd, self.run)
                except OSError as exc:
                    self.release()
                    raise write_failed(exc, self.layout) from exc
                return
            os.close(fd)
        raise BatchgenError(f"could not lock output directory '{out}': try again")

    def check(self) -> None:
        """BatchgenError unless this run still holds the lock (the directory or its lock file
        removed or replaced under it: another run may be writing now)."""
        if self._fd is None or not _same_file(self._fd, self.layout.lock):
            raise _lost_lock(self.layout)

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.layout.lock.unlink()
        os.close(self._fd)
        self._fd = None
        if self._created:
            with contextlib.suppress(OSError):
                self.layout.dir.rmdir()  # only when empty: nothing was written

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class RankLock:
    """The directory's lock as another rank of a data-parallel job sees it: rank 0 holds the
    lock for every rank of the run; before each commit a rank checks that the lock file still
    names that run (not removed, and not taken by another run since)."""

    layout: OutputLayout
    run: str  # the DirectoryLock.run of rank 0's lock

    def check(self) -> None:
        """BatchgenError unless the lock file still names this run: "lost the lock" when it is
        gone or names another run; a failure to read it (refused credentials, the network) is
        reported as such."""
        lock = self.layout.lock
        try:
            owner = json.loads(lock.read_bytes())
        except (FileNotFoundError, ValueError):  # removed, or replaced by something else
            owner = None
        except Exception as exc:  # OSError, or a store library's own error
            raise store_error(exc, lock, "reading the lock") from exc
        if not isinstance(owner, dict) or owner.get("run") != self.run:
            raise _lost_lock(self.layout)


def _lost_lock(layout: OutputLayout) -> BatchgenError:
    return BatchgenError(
        f"lost the lock on output directory '{layout.dir}' (its lock file was "
        "removed or replaced while this run wrote it): no more rows are written; run "
        "the same command again once no other run uses the directory"
    )


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _write_owner(fd: int, run: str) -> None:
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "run": run}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, text, 0)


def _read_owner(fd: int) -> str:
    try:
        owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {owner['pid']} on {owner['host']}"
    except (ValueError, KeyError, TypeError, OSError):
        return "owner unknown"


# -- committed rows --------------------------------------------------------------------------


class DamagedShard(Exception):
    """A committed shard that cannot be read whole."""


@dataclass
class Committed:
    """What the committed shards hold."""

    indexes: set[int] = field(default_factory=set)
    hashes: dict[int, str] = field(default_factory=dict)  # index -> input row hash, if recorded
    damaged: list[str] = field(default_factory=list)  # shards moved aside (their rows rerun)
    counts: RowCounts = field(default_factory=RowCounts)  # of every committed output row


def read_shard_keys(path: AnyPath) -> tuple[list[Key], list[str | None], RowCounts]:
    """(index, sample_index) and input hash of every row, and the rows' counts; DamagedShard
    if unreadable."""
    try:
        if path.suffix == ".parquet":
            with arrow_file(path) as f:
                shard = pq.ParquetFile(f)
                names = shard.schema_arrow.names
                wanted = [c for c in (*KEY_COLUMNS, INPUT_HASH, *COUNT_COLUMNS) if c in names]
                rows = shard.read(columns=wanted).to_pylist()
        else:
            data = path.read_bytes()
            rows = [json.loads(line) for line in data.split(b"\n") if line.strip()]
            if data and not data.endswith(b"\n"):
                raise ValueError("the last line is cut short")
        keys = [_key(row) for row in rows]
        counts = RowCounts()
        for row in rows:
            counts.add(*(row.get(c) for c in COUNT_COLUMNS))
    except (pa.ArrowException, OSError, ValueError, TypeError, KeyError) as exc:
        raise DamagedShard(_reason(exc)) from exc
    declared = OutputLayout.shard_rows(path)
    if not keys or (declared is not None and declared != len(keys)):
        raise DamagedShard(f"{len(keys)} rows where its name says {declared}")
    return keys, [row.get(INPUT_HASH) for row in rows], counts


def _key(row: Any) -> Key:
    index, sample = row["index"], row.get("sample_index") or 0
    if not isinstance(index, int) or not isinstance(sample, int) or index < 0 or sample < 0:
        raise ValueError(f"bad key ({index!r}, {sample!r})")
    return index, sample


def scan_committed(
    layout: OutputLayout, note: Callable[[str], None], aside: bool = True
) -> Committed:
    """Read every shard's keys. A damaged shard is moved to damaged/ (its rows rerun), with a
    note (aside=False: noted only, nothing moved); a key committed in two shards is an error
    naming both."""
    committed = Committed()
    where: dict[Key, str] = {}
    for path in layout.shard_paths():
        try:
            keys, hashes, counts = read_shard_keys(path)
        except DamagedShard as exc:
            if aside:
                _move_aside(layout, path)
            committed.damaged.append(path.name)
            moved = "moved" if aside else "a run moves it"
            note(
                f"shard {path.name} is damaged ({exc}): {moved} to {layout.damaged.name}/; "
                "its rows are generated again"
            )
            continue
        committed.counts.merge(counts)
        for key, digest in zip(keys, hashes, strict=True):
            if key in where:
                raise BatchgenError(
                    f"row {key[0]} (sample {key[1]}) is committed in two shards, {where[key]} and "
                    f"{path.name}: remove the shard that does not belong to this job"
                )
            where[key] = path.name
            committed.indexes.add(key[0])
            if digest is not None:
                committed.hashes[key[0]] = digest
    return committed


def _move_aside(layout: OutputLayout, path: AnyPath) -> None:
    layout.damaged.mkdir(exist_ok=True)
    path.rename(layout.damaged / path.name)


def remove_temp_files(layout: OutputLayout) -> int:
    """Delete leftovers of killed writers (temp files; on an object store, uploads never
    completed); call only under the lock. Returns the count."""
    temps = layout.temp_files()
    for path in temps:
        path.unlink(missing_ok=True)
    return len(temps) + abort_uploads(layout.dir)


def remove_result_files(layout: OutputLayout) -> None:
    """Delete the result files an earlier run wrote, before this run commits a row: they are
    written again when the job completes, and one left beside the shards of a job that grew
    (--force-resume) and then stopped would lack the new rows. Call only under the lock."""
    for path in layout.result_files():
        if path.exists():  # a delete of nothing is a request some credentials may not make
            path.unlink()


def iter_shard_rows(path: AnyPath, columns: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """A shard's rows (of Parquet, only `columns` where given; JSON Lines rows whole)."""
    if path.suffix == ".parquet":
        with arrow_file(path) as f:
            for batch in pq.ParquetFile(f).iter_batches(1024, columns=columns):
                yield from batch.to_pylist()
        return
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
