"""batchgen: offline batch generation with a continuous-batching engine and exactly-once output."""

from batchgen.api import Generator, generate
from batchgen.engine import Engine, EngineConfig, Prompt, RequestOutput, SamplingParams
from batchgen.errors import BatchgenError

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
