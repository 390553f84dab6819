"""The SDK's requests and results, shared by the clients, adapters and the HTTP server.

Requests and results are pydantic models. What streams is the engine's own ``Delta`` (with
its ``TokenLogprob``s and, on a request's last delta, its ``Usage``): the one delta type from
the engine to the wire, re-exported here.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, create_model, field_validator

from engine.outputs import Delta, RequestLatency, TokenLogprob, TopLogprob, Usage
from sdk.data_url import to_data_url
from sdk.errors import LengthFinishReasonError
from sdk.fields import REQUEST_KNOBS, SAMPLING_FIELDS, field, sampling_fields
from sdk.response_format import ResponseFormat, to_response_format
from sdk.tools import ToolCall, ToolChoice, ToolSpec, to_tools

__all__ = [
    "ChatMessage", "ChatRequest", "ChatResult", "Choice", "CompletionRequest", "CompletionResult", "ContentPart",
    "Delta", "FinishReason", "ImagePart", "ImageUrl", "RequestLatency", "Role", "SamplingOptions", "TextPart",
    "TokenLogprob", "TopLogprob", "Usage",
]  # fmt: skip

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "abort", "content_filter", "tool_calls"]


class TextPart(BaseModel):
    """A text part of a message's content (OpenAI's ``{"type": "text", "text": ...}``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["text"] = "text"
    text: str


class ImageUrl(BaseModel):
    """Where an image part's bytes are: a base64 ``data:`` URL, or a remote URL a server allows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str
    detail: Literal["auto", "low", "high"] | None = None
    """OpenAI's resolution hint; accepted and ignored (the model's processor sets the resolution)."""


class ImagePart(BaseModel):
    """An image part of a message's content (OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["image_url"] = "image_url"
    image_url: ImageUrl

    @classmethod
    def of(cls, image: bytes | str, mime_type: str | None = None) -> ImagePart:
        """An image part from raw bytes (as a data URL; ``mime_type`` None = read from the bytes) or a URL.

        Raises:
            InvalidRequestError: bytes that are not a PNG, JPEG, WebP or GIF image.
        """
        if isinstance(image, str):
            return cls(image_url=ImageUrl(url=image))
        return cls(image_url=ImageUrl(url=to_data_url(image, mime_type)))


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    """One message of a conversation: text (a string, or text and image parts), an assistant's
    tool calls, or a tool's result.

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
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    """A string, or OpenAI content parts (``TextPart``, ``ImagePart``) in order."""
    name: str | None = None

    @property
    def text(self) -> str:
        """The message's text: its string content, or its text parts joined (what input filters read)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    @property
    def image_parts(self) -> list[tuple[int, ImagePart]]:
        """The image parts of the content, with their index in it."""
        if not isinstance(self.content, list):
            return []
        return [(j, part) for j, part in enumerate(self.content) if isinstance(part, ImagePart)]

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
    def _content_or_calls(cls, content: str | list[Any] | None, info: ValidationInfo) -> str | list[Any] | None:
        if content is None and not info.data.get("tool_calls") and "role" in info.data:
            raise ValueError("a message needs content (or, from the assistant, tool_calls)")
        return content


class _SamplingBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def sampling_kwargs(self) -> dict[str, Any]:
        """The sampling fields set on this request, as ``engine.SamplingParams`` keyword arguments."""
        return self.model_dump(include=set(SAMPLING_FIELDS), exclude_none=True)

    def sampling(self, max_tokens: int | None) -> SamplingOptions:
        """This request's sampling knobs alone, ``max_tokens`` as given (already checked: not validated again)."""
        return SamplingOptions.model_construct(**{**self.sampling_kwargs(), "max_tokens": max_tokens})


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
    default_max_tokens: ClassVar[int | None] = None
    """``max_tokens`` of a request that sets none (a tenant's cap still bounds it); None = the engine's default."""

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
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra chat-template variables, e.g. ``{"enable_thinking": False}`` for Qwen3; a template ignores those it does not read."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _only_template_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or ()) & _RENDER_ARGUMENTS)
        if taken:
            raise ValueError(f"{', '.join(taken)} {'is' if len(taken) == 1 else 'are'} set by the SDK, not by template variables")
        return kwargs


# NOTE: apply_chat_template's own arguments and the variables the SDK renders: never template variables
_RENDER_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


class CompletionRequest(_RequestBase):
    """A raw completion request: the prompt is text or token ids, used as given."""

    prompt: str | list[int]


class Choice(BaseModel):
    """One completion of a finished request."""

    index: int
    text: str
    """The reply's text, without its reasoning and tool calls."""
    reasoning: str | None = None
    """A thinking model's reasoning, apart from the text (``sdk.reasoning``); None when the reply had none."""
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
    cut_off: bool = False
    """The reply reached its token limit inside its constraint (``sdk.cut_off``): ``parsed`` is None,
    a cut call is not in ``tool_calls``, and ``raise_for_cut_off()`` raises."""


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

    def raise_for_cut_off(self) -> Self:
        """This result, unless a completion was cut inside its constraint (``Choice.cut_off``).

        Example:
            pet = (await client.chat(prompt, response_format=Pet)).raise_for_cut_off().parsed

        Raises:
            LengthFinishReasonError: the first such completion's text and token count.
        """
        for choice in self.choices:
            if choice.cut_off:
                raise LengthFinishReasonError(choice.text, max_tokens=len(choice.token_ids), request_id=self.request_id)
        return self


class ChatResult(CompletionResult):
    """The whole output of a finished chat request."""

    @property
    def tool_calls(self) -> list[ToolCall] | None:
        """The first reply's tool calls."""
        return self.choices[0].tool_calls

    @property
    def reasoning(self) -> str | None:
        """The first reply's reasoning (thinking models); None when it had none."""
        return self.choices[0].reasoning

    @property
    def message(self) -> ChatMessage:
        """The first reply as an assistant message (text and tool calls), ready to append to the conversation."""
        calls = self.tool_calls
        return ChatMessage(role="assistant", content=self.text if self.text or not calls else None, tool_calls=calls)
