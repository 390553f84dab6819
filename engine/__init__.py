"""paged inference engine: continuous batching over a paged KV cache with prefix sharing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.errors import (
    EngineError, EngineOverloaded, EngineRestarting, ModelLoadError, RequestRejected, UnsupportedTask,
)
from engine.outputs import CompletionOutput, Logprob, PinnedPrefix, RequestOutput
from engine.pooling.outputs import EmbeddingOutput, EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput
from engine.pooling.params import PoolingParams
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import Engine

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineOverloaded",
    "EngineRestarting",
    "Logprob",
    "ModelLoadError",
    "PinnedPrefix",
    "PoolingParams",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "UnsupportedTask",
]


def __getattr__(name: str) -> Any:
    """``Engine`` and ``AsyncEngine`` on first use: the engine's core (and through it the model
    code, torch) stays out of ``engine.config``, ``engine.knobs`` and the other plain modules."""
    if name == "Engine":
        from engine.llm_engine import Engine

        return Engine
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
