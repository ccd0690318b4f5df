"""The output directory must not be somewhere the input reads: a rerun would read its own
results as input rows; on an object store, it must be reachable before any model work."""

from __future__ import annotations

import glob
import os
from pathlib import Path, PurePath

from batchgen.errors import BatchgenError
from batchgen.io.atomic import write_atomic
from batchgen.io.fs import AnyPath, is_object, scheme_of, store_error
from batchgen.io.layout import OUTPUT_FORMATS, TEMP_PREFIX, OutputLayout
from batchgen.io.readers import InputConfig, InputSource


def check_output_outside_input(out_dir: AnyPath, config: InputConfig, source: InputSource) -> None:
    if is_object(out_dir) or scheme_of(config.path):
        _check_urls(out_dir, config, source)
        return
    out = out_dir.expanduser().resolve()
    for path in source.files:
        if _inside(path.resolve(), out):
            raise _refusal(out_dir, config.path)
    raw = config.path
    local = Path(raw).expanduser()
    if glob.has_magic(raw):
        if _glob_may_match(local, out):
            raise _refusal(out_dir, raw)
    elif local.is_dir() and _inside(out, local.resolve()):
        hidden = out.relative_to(local.resolve()).parts
        if not any(part.startswith((".", "_")) for part in hidden):  # the reader skips those
            raise _refusal(out_dir, raw)


def _check_urls(out_dir: AnyPath, config: InputConfig, source: InputSource) -> None:
    """Object-store URLs: the same rule on keys. A glob refuses any output below its static
    part (no guess at what it may match)."""
    out = str(out_dir).rstrip("/")
    if any(_inside_key(str(path), out) for path in source.files):
        raise _refusal(out_dir, config.path)
    raw = config.path.rstrip("/")
    static = raw[: min((raw.find(c) for c in "*?[" if c in raw), default=len(raw))]
    if not _inside_key(out, static.rstrip("/")):
        return
    hidden = out[len(static) :].split("/")
    if glob.has_magic(raw) or not any(part.startswith((".", "_")) for part in hidden):
        raise _refusal(out_dir, config.path)


def _inside_key(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + "/")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _glob_may_match(pattern: Path, out: Path) -> bool:
    """Could a file batchgen writes under `out` match the pattern?"""
    absolute = pattern if pattern.is_absolute() else Path.cwd() / pattern
    parts = absolute.parts
    static = Path(*parts[: next(i for i, p in enumerate(parts) if glob.has_magic(p))])
    if not _inside(out, static.resolve()):
        return False
    if "**" in parts:
        return True  # recursive: anything below the static part may match
    layout = OutputLayout(out)
    written = [layout.results(f) for f in OUTPUT_FORMATS] + [layout.openai_errors]
    written += [layout.shard("x", 0, 1, f) for f in OUTPUT_FORMATS]
    resolved = PurePath(static.resolve(), *parts[len(static.parts) :])
    return any(PurePath(p).match(str(resolved)) for p in written)


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
        probe.unlink(missing_ok=True)
    except Exception as exc:  # the store library's own errors (auth, bucket, network)
        raise store_error(exc, out_dir, "writing") from exc
