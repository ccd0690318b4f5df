"""batchgen: offline batch generation with a continuous-batching engine and exactly-once output.

Names are imported on first use, so `batchgen --help` does not load torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.api import Generator, generate
    from batchgen.engine import Engine, EngineConfig, Prompt, RequestOutput, SamplingParams
    from batchgen.errors import BatchgenError

_HOME = {
    "Generator": "batchgen.api",
    "generate": "batchgen.api",
    "Engine": "batchgen.engine",
    "EngineConfig": "batchgen.engine",
    "Prompt": "batchgen.engine",
    "RequestOutput": "batchgen.engine",
    "SamplingParams": "batchgen.engine",
    "BatchgenError": "batchgen.errors",
}
__all__ = [
    "BatchgenError",
    "Engine",
    "EngineConfig",
    "Generator",
    "Prompt",
    "RequestOutput",
    "SamplingParams",
    "generate",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value
