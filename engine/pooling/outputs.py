"""The outputs of pooling requests, in vLLM's shapes: ``EmbeddingRequestOutput`` and ``ScoringRequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EmbeddingOutput:
    """One input's embedding."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class ScoringOutput:
    """One (query, document) pair's relevance: the sigmoid of the cross-encoder's logit, or the logit."""

    score: float


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """An embedding request's result: ``outputs.embedding``; ``prompt_token_ids`` is what the model read."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass(slots=True)
class ScoringRequestOutput:
    """A scoring request's result: ``outputs.score``; ``prompt_token_ids`` is the pair as the model read it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
