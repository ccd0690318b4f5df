"""How a process batchgen owns (the command line, the engine server, a tokenizer worker) imports
its heavy modules: `prepare_imports()` first thing, then torch and transformers inside
`heavy_imports()`.

- Bytecode is kept under $BATCHGEN_HOME where the environment keeps none
  (`home.use_bytecode_cache`).
- Packages batchgen never uses are kept from being imported (`skipped_imports`).
- importlib.metadata's package -> distribution map is kept between runs (`package_map`), and
  so is transformers' import structure (`import_structure`).
- Python's cyclic garbage collector is paused while the heavy modules load. Importing torch and
  transformers' model code makes ~600k tracked objects, and the collections their allocations
  trigger walk the older ones again and again: `import torch, batchgen.engine.engine` took
  3.76-4.43 s with the collector and 3.05-3.18 s without it on the development CPU. What imports
  make (modules, classes, functions) lives as long as the process, so it is moved out of the
  collector's sight (`gc.freeze`) before collections start again: later ones walk only what
  was made after.

The Python API leaves the caller's process as it is. BATCHGEN_PAUSE_GC=0 keeps the collector
running.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from batchgen.home import turned_off, use_bytecode_cache
from batchgen.import_structure import keep_import_structure
from batchgen.package_map import keep_package_map
from batchgen.skipped_imports import skip_unused_imports

PAUSE_GC_ENV = "BATCHGEN_PAUSE_GC"


def prepare_imports() -> None:
    """Before this process imports torch: the bytecode cache, the skipped packages, the kept
    package map and import structure."""
    use_bytecode_cache()
    skip_unused_imports()
    keep_package_map()
    keep_import_structure()


@contextlib.contextmanager
def heavy_imports() -> Iterator[None]:
    """The collector paused inside; on leaving, what was made inside (and before) is frozen
    and the collector runs again. Nothing changes where it was paused already (by the caller,
    or an enclosing heavy_imports) or BATCHGEN_PAUSE_GC=0."""
    if not gc.isenabled() or turned_off(PAUSE_GC_ENV):
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
