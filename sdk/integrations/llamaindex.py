"""LlamaIndex adapter: ``PagedLLM``, a chat LLM on an in-process engine or a remote one (``base_url``);
``PagedEmbedding`` and ``PagedRerank`` (``sdk.integrations.llamaindex_retrieval``) are re-exported here.

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

from collections.abc import AsyncGenerator, Generator, Sequence
from contextlib import aclosing, closing
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Union

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
from pydantic import Field

from sdk.integrations.base import (
    GenerationAdapter, awatched, finish_info, named_tool_choice, tool_arguments, tool_call, watch_of, watched,
)  # fmt: skip
from sdk.integrations.llamaindex_retrieval import PagedEmbedding, PagedRerank
from sdk.tools import ToolCall, ToolCallDelta, collect_calls
from sdk.types import ChatMessage, ChatResult, Delta, ImagePart, TextPart

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
        calls = [tool_call(b.tool_call_id, b.tool_name, b.tool_kwargs) for b in message.blocks if isinstance(b, ToolCallBlock)]
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


class PagedLLM(GenerationAdapter, FunctionCallingLLM):  # type: ignore[misc, valid-type]
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

    context_window: int | None = Field(default=None, description="Prompt budget; None = the engine's max_model_len.")
    # NOTE: the base class defaults to FunctionCallingProgram for a function-calling LLM; the text
    # program, whose reply the engine holds to the output class's schema, needs no tool prompt.
    pydantic_program_mode: PydanticProgramMode = Field(
        default=PydanticProgramMode.LLM,
        description="How structured_predict runs: LLM = a reply held to the output class's schema; FUNCTION = a tool call.",
    )

    _route: ClassVar[str] = "llamaindex"

    @classmethod
    def class_name(cls) -> str:
        return "PagedLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window or self.client.max_model_len,
            num_output=self.max_tokens or DEFAULT_NUM_OUTPUT,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self.client.model_name,
        )

    def _response(self, result: ChatResult) -> ChatResponse:
        message = _assistant(result.text, result.tool_calls, result.reasoning)
        return ChatResponse(message=message, raw=result.model_dump(), additional_kwargs=finish_info(result))

    # --- chat: the native path ----------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[LIChatMessage], **kwargs: Any) -> ChatResponse:
        result = self.client.chat(to_sdk_messages(messages), **self._request_options(kwargs))
        return self._response(result.raise_for_cut_off())

    @llm_chat_callback()
    async def achat(self, messages: Sequence[LIChatMessage], **kwargs: Any) -> ChatResponse:
        result = await self.aclient.chat(to_sdk_messages(messages), **self._request_options(kwargs))
        return self._response(result.raise_for_cut_off())

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[LIChatMessage], **kwargs: Any) -> ChatResponseGen:
        options = self._request_options(kwargs)
        deltas = watched(self.client.stream(to_sdk_messages(messages), **options), watch_of(options))

        def gen() -> ChatResponseGen:
            reply = _StreamedReply()
            with closing(deltas):
                for delta in deltas:
                    yield reply.add(delta, finish_info(delta))

        return gen()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[LIChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        options = self._request_options(kwargs)
        deltas = awatched(self.aclient.stream(to_sdk_messages(messages), **options), watch_of(options))

        async def gen() -> ChatResponseAsyncGen:
            reply = _StreamedReply()
            async with aclosing(deltas):
                async for delta in deltas:
                    yield reply.add(delta, finish_info(delta))

        return gen()

    # --- completion: derived from chat, or raw when the prompt is already formatted -------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        if not formatted:
            return chat_to_completion_decorator(self.chat)(prompt, **kwargs)
        result = self.client.complete(prompt, **self._request_options(kwargs)).raise_for_cut_off()
        return CompletionResponse(text=result.text, raw=result.model_dump(), additional_kwargs=finish_info(result))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        if not formatted:
            return await achat_to_completion_decorator(self.achat)(prompt, **kwargs)
        result = (await self.aclient.complete(prompt, **self._request_options(kwargs))).raise_for_cut_off()
        return CompletionResponse(text=result.text, raw=result.model_dump(), additional_kwargs=finish_info(result))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        if not formatted:
            return stream_chat_to_completion_decorator(self.stream_chat)(prompt, **kwargs)
        options = self._request_options(kwargs)
        deltas = watched(self.client.stream(prompt=prompt, **options), watch_of(options))

        def gen() -> CompletionResponseGen:
            text = ""
            with closing(deltas):
                for delta in deltas:
                    text += delta.text
                    yield CompletionResponse(text=text, delta=delta.text, additional_kwargs=finish_info(delta))

        return gen()

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        if not formatted:
            return await astream_chat_to_completion_decorator(self.astream_chat)(prompt, **kwargs)
        options = self._request_options(kwargs)
        deltas = awatched(self.aclient.stream(prompt=prompt, **options), watch_of(options))

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async with aclosing(deltas):
                async for delta in deltas:
                    text += delta.text
                    yield CompletionResponse(text=text, delta=delta.text, additional_kwargs=finish_info(delta))

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
        return {
            "messages": messages, "tools": specs, "tool_choice": named_tool_choice(tool_choice),
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
            ToolSelection(tool_id=b.tool_call_id or "", tool_name=b.tool_name, tool_kwargs=tool_arguments(b.tool_kwargs))
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


__all__ = ["PagedEmbedding", "PagedLLM", "PagedRerank", "to_sdk_messages"]
