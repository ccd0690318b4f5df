"""The lock of an output directory on an object store, where there is no flock: the lock object
is created with a conditional PUT (If-None-Match: *), which the store grants to one writer only.

What it guarantees:
- two runs never both hold the lock: of two PUTs racing for a missing lock object, one fails;
- a run checks before every shard commit that the lock object still names its run (as the
  other ranks of a data-parallel job do, RankLock), and writes no more rows when it does not;
- a lock left by a killed run is taken over when the run took it on this host and its process
  is gone: no process has its pid, or the one that has it started later (the lock records its
  process's start time), or it is this process, which does not hold that lock (a restarted
  container gives the rerun the same pid). The takeover is a conditional PUT on the stale
  object's ETag (If-Match): of two runs taking over at once, one wins. A lock taken on another
  host cannot be judged from here: the error names its owner and the object to delete once
  that run is known to be gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.errors import BatchgenError
from batchgen.io.checkpoint import DirectoryLock, RankLock, new_run_token
from batchgen.io.fs import ObjectPath, is_object, store_error
from batchgen.io.layout import OutputLayout

_PRECONDITION_CODES = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")
_HELD: set[str] = set()  # the runs whose lock this process holds now


def output_lock(layout: OutputLayout) -> OutputLock:
    """The lock of an output directory: flock on a local disk, a conditional PUT on a store."""
    return ObjectLock(layout) if is_object(layout.dir) else DirectoryLock(layout)


@dataclass
class ObjectLock:
    """An exclusive lock on an output prefix, held from acquire() to release()."""

    layout: OutputLayout
    run: str = field(default_factory=new_run_token)
    _held: bool = False

    def acquire(self) -> None:
        lock: ObjectPath = self.layout.lock
        pid = os.getpid()
        owner = {"pid": pid, "host": socket.gethostname(), "run": self.run}
        body = json.dumps(owner | {"started": _start_time(pid)})
        try:
            try:
                lock.write_whole(lambda f: f.write(body.encode()), IfNoneMatch="*")
            except OSError as exc:
                if not _precondition_failed(exc):
                    raise
                self._take_over(lock, body)
        except BatchgenError:
            raise
        except Exception as exc:  # the store library's own errors (auth, bucket, network)
            raise store_error(exc, self.layout.dir, "writing the lock of") from exc
        self._held = True
        _HELD.add(self.run)

    def _take_over(self, lock: ObjectPath, body: str) -> None:
        etag = lock.fs.info(lock.key)["ETag"]
        owner = _owner(lock)
        if not _stale(owner):
            raise _in_use(self.layout, owner)
        try:
            lock.write_whole(lambda f: f.write(body.encode()), IfMatch=etag)
        except OSError as exc:
            if _precondition_failed(exc):  # another run took it over first
                raise _in_use(self.layout, _owner(lock)) from None
            raise

    def check(self) -> None:
        """BatchgenError unless the lock object still names this run."""
        RankLock(self.layout, self.run).check()

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        _HELD.discard(self.run)
        with contextlib.suppress(Exception):  # a lock left behind is taken over next time
            if _owner(self.layout.lock).get("run") == self.run:
                self.layout.lock.unlink(missing_ok=True)

    def __enter__(self) -> ObjectLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _precondition_failed(exc: BaseException) -> bool:
    if isinstance(exc, FileExistsError):
        return True
    response = getattr(exc.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code") in _PRECONDITION_CODES


def _owner(lock: ObjectPath) -> dict[str, Any]:
    try:
        owner = json.loads(lock.read_bytes())
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot: /proc/<pid>/stat field 22); None
    where there is no such process or no /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text[text.rindex(")") + 2 :].split()[19])  # fields from the 3rd on
    except (OSError, ValueError, IndexError):
        return None


def _stale(owner: dict[str, Any]) -> bool:
    """Taken on this host by a process that is gone: its pid is no process's, or this one's
    (which holds no such lock), or a process's that started after it."""
    pid = owner.get("pid")
    if owner.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    if pid == os.getpid():
        return owner.get("run") not in _HELD
    started = owner.get("started")
    if isinstance(started, int) and _start_time(pid) not in (None, started):
        return True  # the pid was given to another process since
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def _in_use(layout: OutputLayout, owner: dict[str, Any]) -> BatchgenError:
    who = f"pid {owner['pid']} on {owner['host']}" if "pid" in owner else "owner unknown"
    return BatchgenError(
        f"output directory '{layout.dir}' is in use by another batchgen run ({who}): wait for "
        f"it to finish, or stop it; if that run is gone (killed on another machine), delete "
        f"{layout.lock} and run again"
    )


OutputLock = DirectoryLock | ObjectLock  # acquire / check / release / run
