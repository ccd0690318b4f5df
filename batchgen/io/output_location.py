"""The output directory must not be somewhere the input reads: a rerun would read its own
results as input rows; on an object store, it must be reachable before any model work."""

from __future__ import annotations

import glob
import os
from pathlib import Path, PurePosixPath

from batchgen.errors import BatchgenError
from batchgen.io.atomic import write_atomic
from batchgen.io.fs import URL_SCHEMES, AnyPath, as_path, is_object, scheme_of, store_error
from batchgen.io.input_names import folder_skips, glob_may_match
from batchgen.io.layout import OUTPUT_FORMATS, TEMP_PREFIX, OutputLayout
from batchgen.io.readers import InputConfig, InputSource


def check_output_outside_input(out_dir: AnyPath, config: InputConfig, source: InputSource) -> None:
    """The same rule for local paths and keys on a store (io/input_names.py): no input file
    inside the output directory, no input folder above it (unless its reader skips the
    part between), no input glob that may match a file it writes."""
    if any(_inside(_where(path), _where(out_dir)) for path in source.files):
        raise _refusal(out_dir, config.path)
    raw = config.path
    out, inp = _where(out_dir), _where(_input_root(raw))
    if out[0] != inp[0]:  # another store (or local beside a store): nothing shared
        return
    if glob.has_magic(raw) and (scheme_of(raw) is None or scheme_of(raw) not in URL_SCHEMES):
        if glob_may_match(inp[1], out[1], _written()):
            raise _refusal(out_dir, raw)
    elif (
        _is_folder(raw)
        and _inside(out, inp)
        and not folder_skips(PurePosixPath(out[1]).relative_to(inp[1]))
    ):
        raise _refusal(out_dir, raw)


def _input_root(raw: str) -> AnyPath:
    """The input path as written (a glob's pattern unexpanded)."""
    return as_path(raw) if scheme_of(raw) else Path(raw).expanduser()


def _where(path: AnyPath) -> tuple[str, str]:
    """(store, path on it): ("", absolute resolved path) for a local path, (scheme, key) for
    an object. A glob's static part is resolved, its pattern kept."""
    if is_object(path):
        return path.scheme, path.key
    absolute = Path(path) if Path(path).is_absolute() else Path.cwd() / path
    parts = absolute.parts
    static = next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))
    resolved = Path(*parts[:static]).resolve()
    return "", str(PurePosixPath(resolved, *parts[static:]))


def _is_folder(raw: str) -> bool:
    """Whether the input names a folder (or a prefix on a store, not one object)."""
    if scheme_of(raw) is None:
        return Path(raw).expanduser().is_dir()
    return scheme_of(raw) not in URL_SCHEMES


def _inside(path: tuple[str, str], folder: tuple[str, str]) -> bool:
    return path[0] == folder[0] and (
        path[1] == folder[1] or PurePosixPath(folder[1]) in PurePosixPath(path[1]).parents
    )


def _written() -> list[str]:
    """What batchgen writes below an output directory, relative to it."""
    layout = OutputLayout(Path("/"))
    written = [layout.results(f) for f in OUTPUT_FORMATS] + [layout.openai_errors]
    written += [layout.shard("x", 0, 1, f) for f in OUTPUT_FORMATS]
    return [str(PurePosixPath(p).relative_to("/")) for p in written]


def _refusal(out_dir: AnyPath, input_path: str) -> BatchgenError:
    return BatchgenError(
        f"output directory '{out_dir}' is where the input {input_path!r} reads files: a rerun "
        "would read its own results as input; choose an output directory outside the input"
    )


def check_output_access(out_dir: AnyPath) -> None:
    """On an object store: the bucket exists and this process may list, write and delete
    under the prefix (a probe object, named as a temp file). BatchgenError, one line. A local
    directory is checked when its lock is taken."""
    if not is_object(out_dir):
        return
    probe = out_dir / f"{TEMP_PREFIX}validate-{os.getpid()}"
    try:
        list(out_dir.iterdir())
        write_atomic(probe, lambda f: f.write(b"batchgen validate\n"))
    except Exception as exc:  # the store library's own errors (auth, bucket, network)
        raise store_error(exc, out_dir, "writing") from exc
    try:
        probe.unlink(missing_ok=True)
    except Exception as exc:  # a job deletes its lock, temp files and outdated result files
        error = store_error(exc, probe, "deleting")
        raise BatchgenError(
            f"{error}; a job deletes its lock and temp objects under its output, so it needs "
            "this too (the probe object is left: remove it once allowed)"
        ) from exc
