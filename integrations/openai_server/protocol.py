"""OpenAI wire schemas: the request and response bodies of the routes, in pydantic.

Only what crosses the wire lives here; the routes turn a request into SDK calls and SDK
results back into these bodies. The sampling fields and their bounds are the engine's
(``sdk.fields``), under their OpenAI names (``sdk.wire``). Unknown request fields are ignored
(clients send vendor extras), but fields that would change the answer and that we cannot
honour are rejected with a 400 naming them, never silently dropped.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, create_model, model_serializer

from sdk.fields import REQUEST_KNOBS, SAMPLING_KNOBS, field, sampling_fields
from sdk.types import RequestLatency
from sdk.wire import WIRE_NAMES, Route


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# --------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    model_config = ConfigDict(extra="allow")  # NOTE: request_id, on a journalled request's error only

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ImageUrlParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: str
    detail: str | None = None  # sdk.wire checks it, naming its path in the message


class ContentPart(BaseModel):
    """A content part: ``text`` or ``image_url`` (``sdk.wire.message_from_wire`` refuses other types, naming them)."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None
    image_url: ImageUrlParam | None = None


class FunctionCallParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str  # JSON text


class ToolCallParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(BaseModel):
    """A message as OpenAI sends it; ``sdk.wire.message_from_wire`` makes it an SDK message."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None


class _RequestFields(BaseModel):
    """Fields the chat and completion requests share besides the sampling knobs."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False  # vLLM's extension: token ids on every choice
    # structured output, read by sdk.wire.format_from_wire: OpenAI's field, then vLLM's
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> str | None:
        """The name of a field we cannot honour, if the request sets one."""
        return None


def _with_knobs(name: str, route: Route, base: type[BaseModel], **overrides: Any) -> type[BaseModel]:
    """``base`` plus every engine sampling knob (wire-named) and ``priority`` / ``cache_salt``, bounds included."""
    fields: dict[str, Any] = sampling_fields(renames=WIRE_NAMES[route])
    fields.update(priority=field(REQUEST_KNOBS["priority"]), cache_salt=field(REQUEST_KNOBS["cache_salt"]))
    fields.update(overrides)
    return create_model(name, __base__=base, __module__=__name__, **fields)


class _ChatFields(_RequestFields):
    messages: list[ChatMessageParam] = Field(min_length=1)
    logprobs: bool = False  # the flag; how many candidates is top_logprobs (the engine's logprobs)
    # tools, read by the SDK (sdk.tools): OpenAI function specs and tool choice
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra template variables (enable_thinking)


class _CompletionFields(_RequestFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string, several, one token list or several."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            return []
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != self.n:  # type: ignore[attr-defined]
            return "best_of"
        if self.echo:
            return "echo"
        return None


ChatCompletionRequest = _with_knobs(
    "ChatCompletionRequest", "chat", _ChatFields,
    # OpenAI's newer name for max_tokens; it wins when both are given
    max_completion_tokens=field(SAMPLING_KNOBS["max_tokens"]),
)  # fmt: skip
CompletionRequest = _with_knobs("CompletionRequest", "completion", _CompletionFields)  # max_tokens: routes.COMPLETION_MAX_TOKENS


# --------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None
    latency: RequestLatency | None = None  # an extension: the engine's per-request breakdown


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # vLLM's: a thinking model's reasoning, apart from content
    tool_calls: list[dict[str, Any]] | None = None  # sdk.wire.tool_call_to_wire

    @model_serializer(mode="wrap")
    def _keep_content(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        data.setdefault("content", self.content)  # OpenAI sends null content beside tool calls
        return data


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # sdk.wire.tool_call_delta_to_wire

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in ("tool_calls", "reasoning_content"):
            if getattr(self, name) is None:
                data.pop(name, None)  # absent, not null, from chunks without them (as OpenAI's)
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class Reply(BaseModel):
    """What every completion object begins with: its id, its kind (``object``), when it was made and the model."""

    id: str
    object: str
    created: int = Field(default_factory=now)
    model: str


class ChatCompletionResponse(Reply):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(Reply):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(Reply):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "paged"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
