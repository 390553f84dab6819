"""LlamaIndex adapter: ``PagedLLM``, a chat LLM on an in-process engine or a remote one (``base_url``).

Chat is the native path (the model's chat template); completion derives from it through
LlamaIndex's ``chat_to_completion_decorator`` family, except ``formatted=True`` prompts,
which are sent as given. Structured prediction (``structured_predict``, its async and
streaming forms, ``as_structured_llm``) constrains the reply to the output class's JSON
schema in the engine; any call also takes ``response_format`` (``sdk.response_format``).
``PagedLLM`` is a ``FunctionCallingLLM``: ``chat_with_tools`` and its async and streaming
forms, ``predict_and_call`` and ``FunctionAgent`` run on the SDK's tools (``sdk.tools``), whose
calls the engine holds to the tools' schemas; calls travel as ``ToolCallBlock``s and tool
results as ``tool`` messages with ``additional_kwargs["tool_call_id"]``. A thinking model's
reasoning (``sdk.reasoning``) comes as the reply's ``ThinkingBlock``, and while streaming as
each response's ``additional_kwargs["thinking_delta"]`` (where LlamaIndex's agents read it).
A reply cut at ``max_tokens`` inside its constraint (``sdk.cut_off``) raises
``LengthFinishReasonError``, so structured prediction and agents never see a half object or call.
``ImageBlock``s in a message's blocks reach a multimodal model as image parts (``sdk.images``), in
order with its text. Every call goes through an SDK client, so hooks and audit apply.

    from sdk.integrations.llamaindex import PagedLLM
    from llama_index.core import Settings
    Settings.llm = PagedLLM(max_tokens=128, temperature=0)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

try:
    from llama_index.core.base.llms.generic_utils import (
        achat_to_completion_decorator,
        astream_chat_to_completion_decorator,
        chat_to_completion_decorator,
        stream_chat_to_completion_decorator,
    )
    from llama_index.core.base.llms.types import (
        ChatMessage as LIChatMessage,
    )
    from llama_index.core.base.llms.types import (
        ChatResponse,
        ChatResponseAsyncGen,
        ChatResponseGen,
        CompletionResponse,
        CompletionResponseAsyncGen,
        CompletionResponseGen,
        ImageBlock,
        LLMMetadata,
        MessageRole,
        TextBlock,
        ThinkingBlock,
        ToolCallBlock,
    )
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.function_calling import FunctionCallingLLM
    from llama_index.core.llms.llm import ToolSelection
    from llama_index.core.prompts import BasePromptTemplate
    from llama_index.core.types import Model, PydanticProgramMode
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("sdk.integrations.llamaindex needs llama-index-core: pip install 'paged[llamaindex]'") from exc
from pydantic import Field, PrivateAttr, create_model

from sdk.client import AsyncClient
from sdk.closing import AsyncClosing, Closing
from sdk.cut_off import CutOffWatch
from sdk.fields import REQUEST_KNOBS, SAMPLING_FIELDS, field, sampling_fields
from sdk.hooks import Hook
from sdk.policy import TenantPolicy
from sdk.runtime import Runtime
from sdk.sync import Client
from sdk.tools import ToolCall, ToolCallDelta, collect_calls, new_call_id
from sdk.types import ChatMessage, ChatResult, CompletionResult, Delta, ImagePart, TextPart

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

DEFAULT_NUM_OUTPUT = 256  # the engine's max_tokens default
_Kwargs = Optional[dict[str, Any]]  # a structured-prediction program's llm_kwargs
_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
    MessageRole.TOOL: "tool",
}


def to_sdk_messages(messages: Sequence[LIChatMessage]) -> list[ChatMessage]:
    """LlamaIndex messages as SDK messages: text, ``ImageBlock``s (as image parts, in order with the
    text), an assistant's ``ToolCallBlock``s, and tool results (role ``tool``, the call's id in
    ``additional_kwargs["tool_call_id"]``)."""
    out = []
    for message in messages:
        if message.role not in _ROLES:
            raise ValueError(f"unsupported message role {message.role!s}")
        role = _ROLES[message.role]
        calls = [
            ToolCall(id=b.tool_call_id or new_call_id(), name=b.tool_name, arguments=_arguments(b.tool_kwargs))
            for b in message.blocks if isinstance(b, ToolCallBlock)
        ]  # fmt: skip
        images = any(isinstance(b, ImageBlock) for b in message.blocks)
        out.append(
            ChatMessage(
                role=role,  # type: ignore[arg-type]
                content=_parts(message.blocks) if images else message.content or "",
                tool_calls=calls or None,
                tool_call_id=message.additional_kwargs.get("tool_call_id") if role == "tool" else None,
            )
        )
    return out


def _parts(blocks: Sequence[Any]) -> list[TextPart | ImagePart]:
    """A message's text and image blocks as SDK content parts, in order: an image given by URL alone is
    sent as its URL (the engine's intake decides whether it may be fetched), else as its bytes."""
    parts: list[TextPart | ImagePart] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            parts.append(TextPart(text=block.text))
        elif isinstance(block, ImageBlock) and block.image is None and block.path is None and block.url is not None:
            parts.append(ImagePart.of(str(block.url)))
        elif isinstance(block, ImageBlock):
            parts.append(ImagePart.of(block.resolve_image().read(), block.image_mimetype))
    return parts


def _arguments(tool_kwargs: dict[str, Any] | str) -> dict[str, Any]:
    """A ``ToolCallBlock``'s arguments as a dict (they may be given as their JSON text)."""
    return json.loads(tool_kwargs) if isinstance(tool_kwargs, str) else tool_kwargs


def _assistant(text: str, calls: Sequence[ToolCall] | None, reasoning: str | None = None) -> LIChatMessage:
    """A reply as a LlamaIndex message: its reasoning's ``ThinkingBlock`` (if any), its text, then a ``ToolCallBlock`` per call."""
    blocks: list[Any] = [ThinkingBlock(content=reasoning)] if reasoning else []
    blocks.append(TextBlock(text=text))
    blocks += [ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=c.arguments) for c in calls or ()]
    return LIChatMessage(role=MessageRole.ASSISTANT, blocks=blocks)


class _StreamedReply:
    """A streamed reply so far, as the ``ChatResponse`` of each new delta: the reasoning and text
    so far and the calls complete so far (a call shows once its arguments are whole)."""

    def __init__(self) -> None:
        self._text = ""
        self._reasoning = ""
        self._deltas: list[ToolCallDelta] = []
        self._calls: list[ToolCall] = []

    def add(self, delta: Delta, additional_kwargs: dict[str, Any]) -> ChatResponse:
        self._text += delta.text
        self._reasoning += delta.reasoning
        if delta.tool_calls:
            self._deltas += delta.tool_calls
            self._calls = collect_calls(self._deltas)
        if delta.reasoning:
            additional_kwargs = {**additional_kwargs, "thinking_delta": delta.reasoning}
        message = _assistant(self._text, self._calls, self._reasoning)
        return ChatResponse(message=message, delta=delta.text, additional_kwargs=additional_kwargs)


def _watch(options: dict[str, Any]) -> CutOffWatch:
    """What raises a streamed reply cut inside the call's constraint (``sdk.cut_off``), in place of its last response."""
    return CutOffWatch(options.get("response_format"), options.get("tools"), options.get("tool_choice"))


# NOTE: a LlamaIndex LLM returns one response per call: n is not a knob here.
_UNSUPPORTED = {"n"}
_KNOBS = [name for name in SAMPLING_FIELDS if name not in _UNSUPPORTED]

# The engine's sampling knobs as fields, with their bounds and help (sdk.fields); None = the engine's default.
_SamplingKnobs = create_model(
    "_SamplingKnobs",
    __base__=FunctionCallingLLM,
    __module__=__name__,
    **{**sampling_fields(exclude=_UNSUPPORTED), "cache_salt": field(REQUEST_KNOBS["cache_salt"])},
)


class PagedLLM(_SamplingKnobs, Closing, AsyncClosing):  # type: ignore[misc, valid-type]
    """paged's engine, in-process or at ``base_url``, as a LlamaIndex function-calling chat LLM
    (sync, async and streaming).

    Example:
        .. code-block:: python

            llm = PagedLLM(max_tokens=64, temperature=0)  # or PagedLLM(base_url=..., api_key=...)
            print(llm.complete("Name a colour.").text)
            for r in llm.stream_chat([ChatMessage(role="user", content="Hi")]):
                print(r.delta, end="")
            response = llm.chat_with_tools([FunctionTool.from_defaults(fn=add)], "2 + 3?", tool_required=True)
            print(llm.get_tool_calls_from_response(response))
    """

    model: str | None = Field(
        default=None,
        description="HF model directory or .gguf path; None = the bundled model. With base_url: the remote model id.",
    )
    base_url: str | None = Field(
        default=None, description="OpenAI-compatible endpoint (paged serve, vLLM) to run on; None = in-process."
    )
    api_key: str | None = Field(default=None, description="Bearer token for base_url.", exclude=True, repr=False)
    context_window: int | None = Field(default=None, description="Prompt budget; None = the engine's max_model_len.")
    timeout: float | None = Field(default=None, description="Seconds before a request is aborted.")
    max_retries: int = Field(default=2, description="Retries of requests refused as overloaded.")
    reasoning_parser: str = Field(
        default="auto", description="How a thinking model's reasoning is split from the reply (sdk.reasoning); in-process only."
    )
    hooks: list[Hook] = Field(default_factory=list, description="SDK hooks run on every call.", exclude=True)
    tenant: str | None = Field(default=None, description="Tenant id for hook contexts, audit records and the fair share.")
    policy: TenantPolicy | None = Field(
        default=None, description="The tenant's priority cap, limits and cache isolation; None = none.", exclude=True
    )
    engine_config: dict[str, Any] = Field(
        default_factory=dict, description="engine.EngineConfig fields for the in-process engine (not with base_url)."
    )
    runtime: Runtime | None = Field(
        default=None, description="Share one engine between adapters and clients; None = a runtime of its own.", exclude=True
    )
    # NOTE: the base class defaults to FunctionCallingProgram for a function-calling LLM; the text
    # program, whose reply the engine holds to the output class's schema, needs no tool prompt.
    pydantic_program_mode: PydanticProgramMode = Field(
        default=PydanticProgramMode.LLM,
        description="How structured_predict runs: LLM = a reply held to the output class's schema; FUNCTION = a tool call.",
    )

    _client: Client | None = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "PagedLLM"

    @property
    def client(self) -> Client:
        """The SDK client (built on first use; in-process: on the engine of ``runtime``, or of its own)."""
        if self._client is None:
            self._client = Client(
                self.model, runtime=self.runtime, base_url=self.base_url, api_key=self.api_key, hooks=self.hooks,
                tenant=self.tenant, policy=self.policy, route="llamaindex", max_retries=self.max_retries,
                reasoning_parser=self.reasoning_parser, **self.engine_config,
            )  # fmt: skip
        return self._client

    @property
    def aclient(self) -> AsyncClient:
        return self.client.aclient

    def start(self) -> None:
        """Load the engine (or connect to ``base_url``) now, so the first call does not wait for it."""
        self.client.start()

    def close(self) -> None:
        """Close the adapter's connections and its own runtime (``Client.close``); a shared ``runtime`` stays open."""
        if self._client is not None:
            self._client.close()

    async def aclose(self) -> None:
        """``close()`` from async code (``AsyncClient.aclose``)."""
        if self._client is not None:
            await self._client.aclient.aclose()

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window or self.client.max_model_len,
            num_output=self.max_tokens or DEFAULT_NUM_OUTPUT,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self.client.model_name,
        )

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        options = {name: getattr(self, name) for name in _KNOBS}
        options.update(timeout=self.timeout, cache_salt=self.cache_salt, **kwargs)
        options["stop"] = options["stop"] or None
        return {k: v for k, v in options.items() if v is not None}

    @staticmethod
    def _extra(delta: Delta | CompletionResult) -> dict[str, Any]:
        if delta.finish_reason is None or delta.usage is None:
            return {}
        return {"finish_reason": delta.finish_reason, "usage": dataclasses.asdict(delta.usage)}

    def _response(self, result: ChatResult) -> ChatResponse:
        message = _assistant(result.text, result.tool_calls, result.reasoning)
        return ChatResponse(message=message, raw=result.model_dump(), additional_kwargs=self._extra(result))

    # --- chat: the native path ----------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[LIChatMessage], **kwargs: Any) -> ChatResponse:
        result = self.client.chat(to_sdk_messages(messages), **self._options(kwargs))
        return self._response(result.raise_for_cut_off())

    @llm_chat_callback()
    async def achat(self, messages: Sequence[LIChatMessage], **kwargs: Any) -> ChatResponse:
        result = await self.aclient.chat(to_sdk_messages(messages), **self._options(kwargs))
        return self._response(result.raise_for_cut_off())

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[LIChatMessage], **kwargs: Any) -> ChatResponseGen:
        options = self._options(kwargs)
        stream = self.client.stream(to_sdk_messages(messages), **options)

        def gen() -> ChatResponseGen:
            reply, watch = _StreamedReply(), _watch(options)
            try:
                for delta in stream:
                    if (cut := watch.add(delta)) is not None:
                        raise cut
                    yield reply.add(delta, self._extra(delta))
            finally:
                stream.close()  # type: ignore[attr-defined]

        return gen()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[LIChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        options = self._options(kwargs)
        stream = self.aclient.stream(to_sdk_messages(messages), **options)

        async def gen() -> ChatResponseAsyncGen:
            reply, watch = _StreamedReply(), _watch(options)
            try:
                async for delta in stream:
                    if (cut := watch.add(delta)) is not None:
                        raise cut
                    yield reply.add(delta, self._extra(delta))
            finally:
                await stream.aclose()  # type: ignore[attr-defined]

        return gen()

    # --- completion: derived from chat, or raw when the prompt is already formatted -------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        if not formatted:
            return chat_to_completion_decorator(self.chat)(prompt, **kwargs)
        result = self.client.complete(prompt, **self._options(kwargs)).raise_for_cut_off()
        return CompletionResponse(text=result.text, raw=result.model_dump(), additional_kwargs=self._extra(result))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        if not formatted:
            return await achat_to_completion_decorator(self.achat)(prompt, **kwargs)
        result = (await self.aclient.complete(prompt, **self._options(kwargs))).raise_for_cut_off()
        return CompletionResponse(text=result.text, raw=result.model_dump(), additional_kwargs=self._extra(result))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        if not formatted:
            return stream_chat_to_completion_decorator(self.stream_chat)(prompt, **kwargs)
        options = self._options(kwargs)
        stream = self.client.stream(prompt=prompt, **options)

        def gen() -> CompletionResponseGen:
            text, watch = "", _watch(options)
            try:
                for delta in stream:
                    if (cut := watch.add(delta)) is not None:
                        raise cut
                    text += delta.text
                    yield CompletionResponse(text=text, delta=delta.text, additional_kwargs=self._extra(delta))
            finally:
                stream.close()  # type: ignore[attr-defined]

        return gen()

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        if not formatted:
            return await astream_chat_to_completion_decorator(self.astream_chat)(prompt, **kwargs)
        options = self._options(kwargs)
        stream = self.aclient.stream(prompt=prompt, **options)

        async def gen() -> CompletionResponseAsyncGen:
            text, watch = "", _watch(options)
            try:
                async for delta in stream:
                    if (cut := watch.add(delta)) is not None:
                        raise cut
                    text += delta.text
                    yield CompletionResponse(text=text, delta=delta.text, additional_kwargs=self._extra(delta))
            finally:
                await stream.aclose()  # type: ignore[attr-defined]

        return gen()

    # --- function calling: the SDK's tools, constrained in the engine ----------------------

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: Union[str, LIChatMessage, None] = None,
        chat_history: Optional[list[LIChatMessage]] = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: Union[str, dict[str, Any], None] = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``chat`` arguments for a turn with ``tools``.

        ``tool_choice`` is ``"auto"``, ``"none"``, ``"required"``, a tool's name or OpenAI's named
        choice; unset, it is ``"required"`` with ``tool_required`` and ``"auto"`` otherwise.
        """
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(LIChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str) else user_msg)
        specs = [tool.metadata.to_openai_tool(skip_length_check=True) for tool in tools]
        if not specs:
            return {"messages": messages, **kwargs}
        if tool_choice is None:
            tool_choice = "required" if tool_required else "auto"
        elif isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):
            tool_choice = {"type": "function", "function": {"name": tool_choice}}
        return {
            "messages": messages, "tools": specs, "tool_choice": tool_choice,
            "parallel_tool_calls": allow_parallel_tool_calls, **kwargs,
        }  # fmt: skip

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The reply's tool calls (its ``ToolCallBlock``s) as ``ToolSelection``s.

        Raises:
            ValueError: the reply made no call and ``error_on_no_tool_call`` is set.
        """
        selections = [
            ToolSelection(tool_id=b.tool_call_id or "", tool_name=b.tool_name, tool_kwargs=_arguments(b.tool_kwargs))
            for b in response.message.blocks if isinstance(b, ToolCallBlock)
        ]  # fmt: skip
        if not selections and error_on_no_tool_call:
            raise ValueError("Expected at least one tool call, but the reply made none.")
        return selections

    # --- structured prediction: the engine constrains the reply to the output class -------
    # NOTE: the base class's program (LLMTextCompletionProgram: chat, then parse) does the work;
    # each override only adds the constraint to the program's llm_kwargs.

    def _constrained(self, output_cls: type[Model], llm_kwargs: _Kwargs) -> dict[str, Any]:
        """``llm_kwargs`` with the engine constraint to ``output_cls``'s JSON schema; the FUNCTION
        program's tool call is constrained as a call already."""
        if self.pydantic_program_mode != PydanticProgramMode.LLM:
            return llm_kwargs or {}
        return {**(llm_kwargs or {}), "response_format": output_cls}

    def structured_predict(
        self, output_cls: type[Model], prompt: BasePromptTemplate, llm_kwargs: _Kwargs = None, **prompt_args: Any
    ) -> Model:
        """An ``output_cls`` instance from the prompt's reply, which the engine holds to its JSON schema."""
        llm_kwargs = self._constrained(output_cls, llm_kwargs)
        return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)

    async def astructured_predict(
        self, output_cls: type[Model], prompt: BasePromptTemplate, llm_kwargs: _Kwargs = None, **prompt_args: Any
    ) -> Model:
        """The async ``structured_predict``."""
        llm_kwargs = self._constrained(output_cls, llm_kwargs)
        return await super().astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)

    def stream_structured_predict(
        self, output_cls: type[Model], prompt: BasePromptTemplate, llm_kwargs: _Kwargs = None, **prompt_args: Any
    ) -> Generator[Any, None, None]:
        """Partial objects as the reply grows; the last is the whole ``output_cls`` instance."""
        llm_kwargs = self._constrained(output_cls, llm_kwargs)
        return super().stream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)

    async def astream_structured_predict(
        self, output_cls: type[Model], prompt: BasePromptTemplate, llm_kwargs: _Kwargs = None, **prompt_args: Any
    ) -> AsyncGenerator[Any, None]:
        """The async ``stream_structured_predict``."""
        llm_kwargs = self._constrained(output_cls, llm_kwargs)
        return await super().astream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
