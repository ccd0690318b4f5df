"""The output directory must not be somewhere the input reads: a rerun would read its own
results as input rows."""

from __future__ import annotations

import glob
from pathlib import Path, PurePath

from batchgen.errors import BatchgenError
from batchgen.io.layout import OUTPUT_FORMATS, OutputLayout
from batchgen.io.readers import InputConfig, InputSource


def check_output_outside_input(out_dir: Path, config: InputConfig, source: InputSource) -> None:
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


def _refusal(out_dir: Path, input_path: str) -> BatchgenError:
    return BatchgenError(
        f"output directory '{out_dir}' is where the input {input_path!r} reads files: a rerun "
        "would read its own results as input; choose an output directory outside the input"
    )
