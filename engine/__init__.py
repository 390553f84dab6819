"""paged inference engine: continuous batching over a paged KV cache with prefix sharing."""

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import EngineError, EngineOverloaded, EngineRestarting, ModelLoadError, RequestRejected
from engine.llm_engine import Engine
from engine.outputs import CompletionOutput, Logprob, PinnedPrefix, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineOverloaded",
    "EngineRestarting",
    "Logprob",
    "ModelLoadError",
    "PinnedPrefix",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
]
