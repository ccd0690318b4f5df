"""Packages batchgen's own processes keep from being imported.

transformers up to 5.17 imports scikit-learn whenever it is installed, as its model classes
load (`generation/candidate_generator.py` takes `roc_curve` for assisted decoding's threshold,
at import time; later versions import it when used): 1.3 s of an H200 host's 5-7 s of
start-up imports, for a function batchgen never calls. Its losses for object detection import
SciPy wherever it is installed (`loss/loss_for_object_detection.py`, for
`linear_sum_assignment`), as `modeling_utils` loads: 0.35 s of the engine's imports on that
host (measured with SciPy marked missing: 3.46-4.61 s against 3.69-6.29 s for `import torch,
batchgen.engine.engine`, three alternating pairs). Outside model families batchgen refuses
(detection, segmentation, FNet), text models do not use it. A None entry in `sys.modules` makes the
package look missing: `importlib.util.find_spec` answers None (transformers then treats it as
not installed) and an import of it raises ImportError, never a silent substitute.

Only processes batchgen owns do this (the command line, the engine server, the tokenizer
workers): the Python API leaves the caller's process as it is. BATCHGEN_SKIP_IMPORTS=0 turns
it off.
"""

from __future__ import annotations

import sys

from batchgen.home import turned_off

SKIPPED = ("sklearn", "scipy")
ENV = "BATCHGEN_SKIP_IMPORTS"


def skip_unused_imports() -> tuple[str, ...]:
    """Mark SKIPPED packages missing in this process (before transformers is imported);
    -> those marked now (none when turned off or already imported)."""
    if turned_off(ENV):
        return ()
    marked = tuple(name for name in SKIPPED if name not in sys.modules)
    for name in marked:
        sys.modules[name] = None  # type: ignore[assignment]
    return marked
