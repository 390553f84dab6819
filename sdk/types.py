"""Pydantic models of the SDK's requests and results, shared by the clients, adapters and the HTTP server."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "abort", "content_filter"]

# NOTE: the names and meanings are engine.SamplingParams'; None means "the engine's default".
SAMPLING_FIELDS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
)


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role
    content: str
    name: str | None = None


class SamplingOptions(BaseModel):
    """Per-request generation knobs; values are checked by the engine, which names the field it rejects."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = None
    min_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    logprobs: int | None = None
    """Return each generated token's logprob plus its ``logprobs`` most likely candidates (0 = none)."""

    def sampling_kwargs(self) -> dict[str, Any]:
        """The fields set on this request, as ``engine.SamplingParams`` keyword arguments."""
        return self.model_dump(include=set(SAMPLING_FIELDS), exclude_none=True)


class _RequestBase(SamplingOptions):
    request_id: str | None = None
    """Caller-chosen id; one is generated when absent. Must be unique among running requests."""
    priority: int = 0
    """Smaller runs first; FIFO within a priority."""
    cache_salt: str | None = None
    """Requests with different salts never share KV blocks (tenant isolation)."""
    timeout: float | None = Field(default=None, gt=0)
    """Seconds before the request is aborted with ``RequestTimeout``."""


class ChatRequest(_RequestBase):
    """A chat request: the messages are rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_RequestBase):
    """A raw completion request: the prompt is text or token ids, used as given."""

    prompt: str | list[int]


class Usage(BaseModel):
    """Token counts of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (not recomputed)."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TopLogprob(BaseModel):
    """One candidate token and its log probability."""

    model_config = ConfigDict(frozen=True)

    token: str
    logprob: float


class TokenLogprob(BaseModel):
    """A generated token's log probability and the most likely candidates at its position."""

    model_config = ConfigDict(frozen=True)

    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = Field(default_factory=list)
    """Most likely first; as many as the request's ``logprobs`` asked for."""


class Delta(BaseModel):
    """New output of a streaming request; the last one has ``finish_reason`` and ``usage`` set."""

    request_id: str
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    """One per token of ``token_ids``, when the request set ``logprobs``."""
    prompt_token_ids: list[int] | None = None
    """The prompt as the engine tokenized it; set on a request's first delta only."""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


class CompletionResult(BaseModel):
    """The whole output of a finished request."""

    request_id: str
    model: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    """One per generated token, when the request set ``logprobs``."""


class ChatResult(CompletionResult):
    """The whole output of a finished chat request."""

    @property
    def message(self) -> ChatMessage:
        """The reply as an assistant message, ready to append to the conversation."""
        return ChatMessage(role="assistant", content=self.text)
