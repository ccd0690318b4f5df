"""$BATCHGEN_HOME: what batchgen keeps between runs on one machine (the folders are named here).

- `models/`: the model folders batchgen builds (the embedded default model).
- `triton/`: Triton's compiled kernels (TRITON_CACHE_DIR, unless the environment sets it).
- `pycache/`: Python bytecode of the job's imports, only where the environment keeps none
  (see `use_bytecode_cache`).
- `logs/`: crash logs with the traceback of an internal error.
- `package_map.json`: the installed packages' import names -> distributions (package_map.py).
- `import_structure/`: transformers' map of what its modules export (import_structure.py).

This module imports nothing heavy: the command line calls it before torch is imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

DEFAULT_HOME = "~/.cache/batchgen"
# Set to 0 to keep batchgen from caching bytecode under $BATCHGEN_HOME.
BYTECODE_CACHE_ENV = "BATCHGEN_BYTECODE_CACHE"
# The import that dominates start-up: whether its bytecode is kept decides for all of them.
PROBE_PACKAGE = "torch"


def turned_off(variable: str) -> bool:
    """Whether an on-by-default switch in the environment is set to 0, false, no or off."""
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "no", "off")


def batchgen_home() -> Path:
    """$BATCHGEN_HOME, or ~/.cache/batchgen when unset or empty."""
    return Path(os.environ.get("BATCHGEN_HOME") or DEFAULT_HOME).expanduser()


def models_dir() -> Path:
    return batchgen_home() / "models"


def triton_cache_dir() -> Path:
    return batchgen_home() / "triton"


def bytecode_cache_dir() -> Path:
    return batchgen_home() / "pycache"


def logs_dir() -> Path:
    return batchgen_home() / "logs"


def package_map_file() -> Path:
    return batchgen_home() / "package_map.json"


def import_structure_dir() -> Path:
    return batchgen_home() / "import_structure"


def use_bytecode_cache() -> bool:
    """Keep the bytecode of this process's imports under $BATCHGEN_HOME/pycache, where Python
    would otherwise compile every module from source at every start.

    That happens when bytecode writing is off (PYTHONDONTWRITEBYTECODE, common in containers)
    and the installed packages hold no compiled bytecode (torch installed with --no-compile):
    `import torch, transformers` then takes ~10 s instead of ~4 s on every run. Python's own
    `sys.pycache_prefix` is pointed at the cache, so site-packages are never written. Nothing
    changes where Python already finds or writes bytecode, where the user set a prefix, or with
    BATCHGEN_BYTECODE_CACHE=0. Returns whether the cache is in use.
    """
    if turned_off(BYTECODE_CACHE_ENV):
        return False
    if sys.pycache_prefix is not None:
        return sys.pycache_prefix == str(bytecode_cache_dir())
    origin = _origin(PROBE_PACKAGE)
    if origin is None or os.path.exists(importlib.util.cache_from_source(origin)):
        return False  # nothing to gain, or Python finds the bytecode beside the source
    if not sys.dont_write_bytecode and os.access(os.path.dirname(origin), os.W_OK):
        return False  # Python writes it beside the sources itself
    folder = bytecode_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False  # an unwritable home: start as before
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = False
    return True


def _origin(package: str) -> str | None:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return spec.origin
