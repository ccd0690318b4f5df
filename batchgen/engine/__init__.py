"""The continuous-batching engine: token ids in, token ids out."""

from batchgen.engine.config import EngineConfig
from batchgen.engine.engine import NOT_READY, Engine
from batchgen.engine.request import Prompt, RequestOutput
from batchgen.engine.sampling_params import SamplingParams

__all__ = ["NOT_READY", "Engine", "EngineConfig", "Prompt", "RequestOutput", "SamplingParams"]
