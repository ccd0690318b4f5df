"""Which files an input path names, the one rule for local and object-store input:

- a folder holding a save_to_disk marker at its top is a saved dataset (local only);

- a folder (prefix) names its data files below it, but none under a part that starts with
  '.' or '_' (a writer's temp files, _SUCCESS, .spark-staging/);
- a glob names what Python's glob matches: a hidden name (a part that starts with '.') after
  the pattern's static prefix only where a pattern part that starts with '.' matches it
  (`*` and `**` never match one);
- files are read in the order of their paths as text (below a folder: relative, '/' between
  parts), as a glob's matches and an object store's keys sort;
- a compressed data file (`rows.jsonl.gz`) is refused, not skipped: batchgen reads files
  uncompressed, at byte offsets.
"""

from __future__ import annotations

import fnmatch
import glob
from pathlib import PurePosixPath

from batchgen.errors import BatchgenError

# a folder holding one of these at its top is a datasets.save_to_disk folder
SAVED_DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")


# what a compressed file's name ends with (after its data extension)
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4", ".zip", ".br")


def read_order(relative: PurePosixPath | str) -> str:
    """The key files are read in the order of: the path as text."""
    return PurePosixPath(relative).as_posix()


def check_not_compressed(name: str, data_extensions: set[str] | dict[str, str]) -> None:
    """BatchgenError where `name` is a data file compressed as a whole (rows.jsonl.gz), which
    a folder's listing would otherwise pass over and a format guess would call unknown."""
    suffixes = [s.lower() for s in PurePosixPath(name).suffixes]
    if len(suffixes) >= 2 and suffixes[-1] in COMPRESSED and suffixes[-2] in data_extensions:
        raise BatchgenError(
            f"{name!r} is compressed ({suffixes[-1]}): batchgen reads parquet and jsonl files "
            "uncompressed: decompress it first (e.g. gunzip, zstd -d), or move it out of the "
            "input"
        )


def folder_skips(relative: PurePosixPath | str) -> bool:
    """Whether a folder's reader skips the file at `relative` (its path below the folder)."""
    return any(part.startswith((".", "_")) for part in PurePosixPath(relative).parts)


def saved_dataset_on_a_store(raw: str) -> BatchgenError:
    """The refusal of a save_to_disk folder named by a URL (datasets maps it from a local
    disk only)."""
    return BatchgenError(
        f"{raw!r} is a datasets.save_to_disk folder on an object store: save_to_disk folders "
        "must be local; copy it to a local folder, or write its rows as parquet or jsonl"
    )


def static_parts(pattern: str) -> int:
    """How many leading parts of a glob pattern hold no wildcard."""
    parts = PurePosixPath(pattern).parts
    return next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))


def glob_skips(pattern: str, match: str) -> bool:
    """Whether Python's glob leaves out `match`, a path the pattern matches when hidden names
    are matched too (as an object store's glob does): a hidden part after the static prefix
    that no pattern part starting with '.' matches."""
    start = static_parts(pattern)
    dotted = [part for part in PurePosixPath(pattern).parts[start:] if part.startswith(".")]
    return any(
        part.startswith(".") and not any(fnmatch.fnmatchcase(part, d) for d in dotted)
        for part in PurePosixPath(match).parts[start:]
    )


def glob_may_match(pattern: str, folder: str, written: list[str]) -> bool:
    """Could the glob `pattern` name a file written below `folder` (`written`: names relative
    to it)? pattern and folder: absolute local paths, or keys on one store. A recursive
    pattern (**) may match anything below its static part that it does not skip."""
    parts = PurePosixPath(pattern).parts
    static = PurePosixPath(*parts[: static_parts(pattern)])
    out = PurePosixPath(folder)
    if out != static and static not in out.parents:
        return False
    paths = [str(out / name) for name in written]
    if "**" in parts:
        return any(not glob_skips(pattern, path) for path in paths)
    whole = f"/{pattern.lstrip('/')}"  # anchored: the whole path matches, not its tail
    return any(
        PurePosixPath(f"/{path.lstrip('/')}").match(whole) and not glob_skips(pattern, path)
        for path in paths
    )
