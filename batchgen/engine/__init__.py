"""The continuous-batching engine: token ids in, token ids out."""

from batchgen.engine.config import EngineConfig
from batchgen.engine.engine import Engine
from batchgen.engine.request import Prompt, RequestOutput
from batchgen.engine.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "Prompt", "RequestOutput", "SamplingParams"]
