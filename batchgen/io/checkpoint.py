"""The output directory's record of its job: which spec produced the committed shards.

Resuming is allowed only with the same model, input, prompt, sampling and output format (runtime
settings may change: they do not change results). `force` accepts a changed spec on purpose.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from batchgen.errors import BatchgenError

MANIFEST = "job.json"
IDENTITY_SECTIONS = ("model", "input", "prompt", "sampling")
IDENTITY_OUTPUT_KEYS = ("format", "include_token_ids")


def identity(spec: dict[str, Any]) -> dict[str, Any]:
    """The part of a resolved spec that decides what each output row holds."""
    out = {name: spec[name] for name in IDENTITY_SECTIONS}
    out["output"] = {k: spec["output"][k] for k in IDENTITY_OUTPUT_KEYS}
    return out


def claim_output_dir(out_dir: Path, spec: dict[str, Any], force: bool) -> bool:
    """Check out_dir may hold this job and record its spec; -> True when resuming."""
    manifest = out_dir / MANIFEST
    if manifest.is_file():
        recorded = json.loads(manifest.read_text())
        changes = _diff(identity(recorded["spec"]), identity(spec))
        if changes and not force:
            raise BatchgenError(
                f"output directory '{out_dir}' holds a job with a different spec ({changes[0]}"
                f"{' and more' if len(changes) > 1 else ''}): use another output directory, or "
                "--force-resume to continue it with the new spec"
            )
        write_json_atomic(
            manifest, {"spec": spec, "previous": recorded.get("spec")} if changes else recorded
        )
        return True
    if out_dir.exists() and any(out_dir.iterdir()):
        raise BatchgenError(
            f"output directory '{out_dir}' is not empty and holds no batchgen job: "
            "choose a new or empty directory"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(manifest, {"spec": spec})
    return False


def _diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new)):
            out += _diff(old.get(key), new.get(key), f"{prefix}{'.' if prefix else ''}{key}")
        return out
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Atomic: a temp file, fsync, rename."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
