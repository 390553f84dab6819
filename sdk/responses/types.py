"""The Responses API's objects: the request, the response with its output items, and its stream events.

The shapes are OpenAI's (``openai.types.responses``), so the openai client, the OpenAI Agents
SDK and LangChain read them as they read OpenAI's own; ``paged serve`` and the SDK
(``AsyncClient.respond``) share these types. The request's sampling fields are the engine's
knobs (``sdk.fields``) under the Responses names: ``max_output_tokens`` is ``max_tokens``,
``top_logprobs`` is ``logprobs``; vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``,
``seed``, ``priority``, ``cache_salt`` ...) are taken too. Input items stay JSON objects here:
``sdk.responses.items`` reads them, naming the path of whatever it refuses.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, StringConstraints, create_model, model_serializer

from sdk.fields import REQUEST_KNOBS, SAMPLING_KNOBS, field, sampling_fields

# NOTE: OpenAI's bounds on metadata: 16 pairs, keys of 64 characters, values of 512
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]
INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content")
"""``include`` values served: logprobs on the text; reasoning is always sent in the clear, never encrypted."""


def new_id(prefix: str) -> str:
    """An id as OpenAI writes them: ``resp_``, ``msg_``, ``fc_``, ``rs_`` and 32 hex digits (unguessable)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class TextConfig(BaseModel):
    """``text``: the reply's format (``{"type": "text" | "json_object" | "json_schema", ...}``)."""

    model_config = ConfigDict(extra="ignore")

    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    """Accepted; a reply's length is the model's (bound it with ``max_output_tokens``)."""


class ReasoningConfig(BaseModel):
    """``reasoning``: ``effort`` reaches the chat template as ``reasoning_effort``; ``"none"`` also turns
    thinking off (``enable_thinking: false``); ``summary`` is accepted (the reasoning itself is sent)."""

    model_config = ConfigDict(extra="ignore")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class _RequestFields(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send vendor extras

    model: str | None = None
    input: str | list[dict[str, Any]]
    """A user message's text, or input items (``sdk.responses.items``)."""
    instructions: str | None = None
    """The system message of this response (a previous response's instructions are not carried over)."""
    tools: list[dict[str, Any]] | None = None
    """Function tools: ``{"type": "function", "name", "description", "parameters", "strict"}``."""
    tool_choice: str | dict[str, Any] | None = None
    """``"auto"`` (the default with tools), ``"none"``, ``"required"`` or ``{"type": "function", "name": ...}``."""
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    user: str | None = None
    store: bool = True
    """Keep the response (``GET /v1/responses/{id}``) and let later requests continue it."""
    previous_response_id: str | None = None
    """Continue that stored response's conversation: send only the new items."""
    truncation: Literal["auto", "disabled"] | None = None
    """``auto``: drop the conversation's oldest items until it fits the context; ``disabled`` (default): a 400."""
    stream: bool = False
    include: list[Literal[INCLUDABLE]] | None = None  # type: ignore[valid-type]
    # fields of OpenAI's that this server does not serve: a 400 naming the field when set
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None

    def unsupported(self) -> str | None:
        """The name of a field set that this server cannot honour, if any."""
        for name in ("conversation", "prompt", "max_tool_calls"):
            if getattr(self, name) is not None:
                return name
        return "background" if self.background else None


ResponseRequest = create_model(
    "ResponseRequest",
    __base__=_RequestFields,
    __module__=__name__,
    __doc__="A request to ``POST /v1/responses`` (and ``AsyncClient.respond``), OpenAI's fields and the engine's knobs.",
    **sampling_fields(exclude=("max_tokens", "logprobs", "n")),
    max_output_tokens=field(SAMPLING_KNOBS["max_tokens"]),
    top_logprobs=field(SAMPLING_KNOBS["logprobs"]),
    priority=field(REQUEST_KNOBS["priority"]),
    cache_salt=field(REQUEST_KNOBS["cache_salt"]),
)


# --------------------------------------------------------------------------- output items

Status = Literal["in_progress", "completed", "incomplete"]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class OutputText(BaseModel):
    """A part of a message's content: its text."""

    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class ReasoningText(BaseModel):
    """A part of a reasoning item's content: the reasoning as the model wrote it."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class MessageItem(BaseModel):
    """The assistant's text."""

    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: new_id("msg"))
    role: Literal["assistant"] = "assistant"
    status: Status = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    """A call of a function tool: ``arguments`` is its JSON text; answer it with a ``function_call_output`` of ``call_id``."""

    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: new_id("fc"))
    call_id: str
    name: str
    arguments: str = ""
    status: Status = "in_progress"


class ReasoningItem(BaseModel):
    """A thinking model's reasoning (``sdk.reasoning``), apart from its answer."""

    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: new_id("rs"))
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Status = "in_progress"


OutputItem = Annotated[Union[MessageItem, FunctionCallItem, ReasoningItem], Field(discriminator="type")]


# --------------------------------------------------------------------------- the response


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    cache_write_tokens: int = 0
    """Always 0: the prefix cache is written as a side effect, never as a paid write."""


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    """Tokens the reply spent before its answer began, when it reasoned."""


class ResponseUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class Response(BaseModel):
    """A response: its status, output items and usage, and the request fields it ran with."""

    id: str = Field(default_factory=lambda: new_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None

    @property
    def output_text(self) -> str:
        """The text of every message item, joined (as the openai client's ``Response.output_text``)."""
        return "".join(part.text for item in self.output if isinstance(item, MessageItem) for part in item.content)

    @property
    def function_calls(self) -> list[FunctionCallItem]:
        """The function calls among the output items."""
        return [item for item in self.output if isinstance(item, FunctionCallItem)]


# --------------------------------------------------------------------------- stream events


TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
"""The event types that end a response's stream, each with the response as it ended."""


class ResponseEvent(BaseModel):
    """One server-sent event of a streamed response: ``type`` says which of OpenAI's it is and
    which fields it has; ``sequence_number`` counts the response's events from 0."""

    model_config = ConfigDict(extra="ignore")

    type: str
    sequence_number: int
    response: Response | None = None
    output_index: int | None = None
    item: OutputItem | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: OutputText | ReasoningText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    logprobs: list[TokenLogprob] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if value is not None}  # each type's own fields


class DeletedResponse(BaseModel):
    """What ``DELETE /v1/responses/{id}`` answers."""

    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItemList(BaseModel):
    """A page of a response's input items (``GET /v1/responses/{id}/input_items``)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
