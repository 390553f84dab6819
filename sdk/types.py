"""Pydantic models of the SDK's requests and results, shared by the clients, adapters and the HTTP server."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, computed_field, create_model, field_validator

from sdk.fields import REQUEST_KNOBS, SAMPLING_FIELDS, field, sampling_fields
from sdk.response_format import ResponseFormat, to_response_format
from sdk.tools import ToolCall, ToolCallDelta, ToolChoice, ToolSpec, to_tools

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "abort", "content_filter", "tool_calls"]


class ChatMessage(BaseModel):
    """One message of a conversation: text, an assistant's tool calls, or a tool's result.

    Raises:
        ValidationError: a message without content that is not an assistant's tool calls, tool
            calls on another role, or a tool result without its ``tool_call_id``
            (``sdk.fields.invalid_request`` names the field).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # NOTE: checked in this order, each field against those before it, so an error's loc is its field.
    role: Role
    tool_calls: list[ToolCall] | None = Field(default=None, validate_default=True)
    """The calls an assistant message made (``ChatResult.message`` carries them)."""
    tool_call_id: str | None = Field(default=None, validate_default=True)
    """The call a tool message answers."""
    content: str | None = Field(default=None, validate_default=True)
    name: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _only_assistants_call(cls, calls: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if calls and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"only assistant messages make calls, not {info.data['role']}")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _tool_results_name_their_call(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("role") == "tool" and not call_id:
            raise ValueError("a tool message needs the id of the call it answers")
        return call_id

    @field_validator("content")
    @classmethod
    def _content_or_calls(cls, content: str | None, info: ValidationInfo) -> str | None:
        if content is None and not info.data.get("tool_calls") and "role" in info.data:
            raise ValueError("a message needs content (or, from the assistant, tool_calls)")
        return content


class _SamplingBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def sampling_kwargs(self) -> dict[str, Any]:
        """The sampling fields set on this request, as ``engine.SamplingParams`` keyword arguments."""
        return self.model_dump(include=set(SAMPLING_FIELDS), exclude_none=True)


# NOTE: the fields, bounds and help are engine.SamplingParams' (sdk.fields); None = the engine's default.
SamplingOptions = create_model(
    "SamplingOptions",
    __base__=_SamplingBase,
    __doc__="Per-request generation knobs: ``engine.SamplingParams``' fields and bounds; None = the engine's default.",
    __module__=__name__,
    **sampling_fields(),
)
_RequestOptions = create_model(
    "_RequestOptions",
    __base__=SamplingOptions,
    __module__=__name__,
    **{name: field(k, default=k.default) for name, k in REQUEST_KNOBS.items()},
)


class _RequestBase(_RequestOptions):  # type: ignore[misc, valid-type]
    timeout: float | None = Field(default=None, gt=0)
    """Seconds before the request is aborted with ``RequestTimeout``."""
    response_format: Annotated[ResponseFormat | None, BeforeValidator(to_response_format)] = None
    """What the text must be: a pydantic class, a JSON schema or a format dict (``sdk.response_format``)."""


class ChatRequest(_RequestBase):
    """A chat request: the messages (and tools) are rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: Annotated[list[ToolSpec] | None, BeforeValidator(to_tools)] = None
    """Tools the model may call: OpenAI function specs, pydantic classes or callables (``sdk.tools``)."""
    tool_choice: ToolChoice | None = None
    """``"auto"`` (the default with tools), ``"none"``, ``"required"`` or a named tool."""
    parallel_tool_calls: bool | None = None
    """Whether one reply may make several calls (default: yes)."""


class CompletionRequest(_RequestBase):
    """A raw completion request: the prompt is text or token ids, used as given."""

    prompt: str | list[int]


class RequestLatency(BaseModel):
    """Where one request's time went, by the engine's clock, and where its prompt's KV came from.

    ``queue_s + prefill_s + decode_s == e2e_s``; ``preempted_s`` is the part of prefill and
    decode the request spent preempted. A phase the request never reached is None.
    """

    e2e_s: float | None = None
    """Arrival in the engine to finish."""
    queue_s: float | None = None
    """Arrival to first scheduled."""
    prefill_s: float | None = None
    """First scheduled to first token."""
    decode_s: float | None = None
    """First token to finish."""
    preempted_s: float = 0.0
    computed_prompt_tokens: int = 0
    """Prompt tokens the model computed."""
    cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache instead."""


class Usage(BaseModel):
    """Token counts of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (not recomputed)."""
    latency: RequestLatency | None = None
    """The engine's breakdown of the request's time, once it finished there; None before, or
    over a transport whose server does not report it."""

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
    """New output of one completion of a streaming request.

    Each completion's last delta has its ``finish_reason``; the request's very last delta
    also has ``usage`` (totals over its ``n`` completions).
    """

    request_id: str
    index: int = 0
    """Which of the request's ``n`` completions this continues."""
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    tool_calls: list[ToolCallDelta] | None = None
    """New output of the reply's tool calls (a call's id and name first, then argument fragments)."""
    logprobs: list[TokenLogprob] | None = None
    """One per token of ``token_ids``, when the request set ``logprobs``."""
    prompt_token_ids: list[int] | None = None
    """The prompt as the engine tokenized it; set on a request's first delta only."""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


class Choice(BaseModel):
    """One completion of a finished request."""

    index: int
    text: str
    """The reply's text, without its tool calls."""
    token_ids: list[int]
    finish_reason: FinishReason
    """``tool_calls`` when the reply made calls."""
    tool_calls: list[ToolCall] | None = None
    """The reply's complete tool calls (a call cut short by ``max_tokens`` is none)."""
    logprobs: list[TokenLogprob] | None = None
    """One per generated token, when the request set ``logprobs``."""
    parsed: Any = None
    """The text decoded under a JSON ``response_format``: an instance of its pydantic class, else
    the JSON value; None for other formats or a completion cut short (``finish_reason`` not "stop")."""


class CompletionResult(BaseModel):
    """The whole output of a finished request: its ``n`` completions (one unless ``n`` was set)."""

    request_id: str
    model: str
    choices: list[Choice] = Field(min_length=1)
    usage: Usage

    @property
    def text(self) -> str:
        """The first completion's text."""
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        """The first completion's token ids."""
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> FinishReason:
        """Why the first completion ended."""
        return self.choices[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """The first completion's logprobs, when the request set ``logprobs``."""
        return self.choices[0].logprobs

    @property
    def parsed(self) -> Any:
        """The first completion's ``parsed`` value (a JSON ``response_format``)."""
        return self.choices[0].parsed


class ChatResult(CompletionResult):
    """The whole output of a finished chat request."""

    @property
    def tool_calls(self) -> list[ToolCall] | None:
        """The first reply's tool calls."""
        return self.choices[0].tool_calls

    @property
    def message(self) -> ChatMessage:
        """The first reply as an assistant message (text and tool calls), ready to append to the conversation."""
        calls = self.tool_calls
        return ChatMessage(role="assistant", content=self.text if self.text or not calls else None, tool_calls=calls)
