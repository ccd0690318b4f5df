"""The one atomic file write: a temporary file beside the target, fsync, rename, fsync the folder.

A reader sees either the old file (or none) or the whole new one, after a kill at any instant.
The temporary name starts with the layout's TEMP_PREFIX, so a resumed run can remove leftovers.
On an object store the same contract is the store's: the object is uploaded whole
(io/fs.py, ObjectPath.write_whole).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from batchgen.io.fs import AnyPath, is_object
from batchgen.io.layout import temp_path

Writer = Callable[[IO[bytes]], Any]  # fills an open binary file


def write_atomic(path: AnyPath, write: Writer) -> Any:
    """write(f) into a temp file beside `path`, fsync, rename over `path`; -> write's result."""
    if is_object(path):
        return path.write_whole(write)
    path = Path(path)
    tmp = temp_path(path)
    try:
        with tmp.open("wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return result


def write_json_atomic(path: AnyPath, data: Any, sort_keys: bool = True) -> None:
    """sort_keys=False keeps the dicts' own order (where it means something)."""
    text = json.dumps(data, indent=2, sort_keys=sort_keys, ensure_ascii=True, allow_nan=False)
    write_atomic(path, lambda f: f.write(text.encode("ascii") + b"\n"))


def fsync_dir(path: AnyPath) -> None:
    """Make a folder's entries durable (an object store has no folders: nothing to do)."""
    if is_object(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
