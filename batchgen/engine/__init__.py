"""The continuous-batching engine: token ids in, token ids out.

Its names are imported on first use, so a process that needs only a light part of the
package (a tokenizer worker imports batchgen.engine.sampling_params) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.engine.config import EngineConfig
    from batchgen.engine.engine import Engine
    from batchgen.engine.request import NOT_READY, Prompt, RequestOutput
    from batchgen.engine.sampling_params import SamplingParams

_HOMES = {
    "EngineConfig": "batchgen.engine.config",
    "NOT_READY": "batchgen.engine.request",
    "Engine": "batchgen.engine.engine",
    "Prompt": "batchgen.engine.request",
    "RequestOutput": "batchgen.engine.request",
    "SamplingParams": "batchgen.engine.sampling_params",
}
__all__ = ["NOT_READY", "Engine", "EngineConfig", "Prompt", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
