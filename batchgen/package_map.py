"""importlib.metadata's map of import packages to distributions, kept between runs.

transformers up to 5.17 builds `importlib.metadata.packages_distributions()` as it is imported
(later versions build it only when a package's availability needs it). That reads the metadata
and the RECORD file of every installed distribution: 0.2 s for 116 distributions on the
development CPU, more on a host with a few hundred. Every batchgen process that imports
transformers paid it again for the same answer.

`keep_package_map()` makes this process's `packages_distributions()` answer from
$BATCHGEN_HOME (`home.package_map_file`) while what decides that answer is unchanged, and
compute it (and keep it) otherwise. What decides it is the import path and what lies on it: for
each `sys.path` folder, its own modification time and that of every `.dist-info` /
`.egg-info` entry in it (installing, upgrading or removing a distribution changes one of
them). Where a finder other than Python's own path finder can report distributions, nothing
is kept: its answer could change without any of those times.

Only batchgen's own processes do this (process_start.py); BATCHGEN_PACKAGE_MAP_CACHE=0 turns
it off.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.metadata
import json
import os
import sys
from collections.abc import Callable

from batchgen.home import package_map_file, turned_off

ENV = "BATCHGEN_PACKAGE_MAP_CACHE"
_METADATA_SUFFIXES = (".dist-info", ".egg-info")


def keep_package_map() -> bool:
    """Replace importlib.metadata.packages_distributions in this process by the kept one;
    -> whether it was replaced (not when turned off, or done already)."""
    current = importlib.metadata.packages_distributions
    if turned_off(ENV) or getattr(current, "_batchgen_kept", False):
        return False
    kept = _kept(current)
    kept._batchgen_kept = True  # type: ignore[attr-defined]
    importlib.metadata.packages_distributions = kept
    return True


def _kept(compute: Callable[[], dict[str, list[str]]]) -> Callable[[], dict[str, list[str]]]:
    def packages_distributions() -> dict[str, list[str]]:
        key = installation_key()
        if key is None:
            return compute()
        path = package_map_file()
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            stored = json.loads(path.read_text())
            if stored["key"] == key:
                return {str(k): [str(d) for d in v] for k, v in stored["map"].items()}
        answer = compute()
        with contextlib.suppress(OSError, TypeError, ValueError):  # kept where it can be
            from batchgen.io.atomic import write_json_atomic  # (pyarrow: only when writing)

            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, {"key": key, "map": answer})
        return answer

    return packages_distributions


def installation_key() -> list | None:
    """What packages_distributions() depends on, as JSON-able values; None when a finder other
    than Python's path finder can report distributions."""
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            continue
        if getattr(finder, "find_distributions", None) is not None:
            return None
    key: list = [sys.version]
    for entry in sys.path:
        folder = entry or "."
        try:
            own = os.stat(folder).st_mtime_ns
            with os.scandir(folder) as listing:
                infos = sorted(
                    [e.name, e.stat().st_mtime_ns]
                    for e in listing
                    if e.name.endswith(_METADATA_SUFFIXES)
                )
        except (NotADirectoryError, FileNotFoundError):
            key.append([entry, None])  # a zip file or a missing folder: its name is enough
            continue
        except OSError:
            return None
        key.append([entry, own, infos])
    return key
