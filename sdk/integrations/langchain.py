"""LangChain adapters: ``PagedChat`` (a chat model) and ``PagedLLM`` (a text-completion LLM); ``PagedEmbeddings``
and ``PagedRerank`` (``sdk.integrations.langchain_retrieval``) are re-exported here.

Both run through an SDK client, on an in-process engine (the adapter's own, or that of
the ``runtime`` it is given) or, with ``base_url``, on a remote OpenAI-compatible one, so
hooks and audit apply to every call.
Structured output is the engine's constraint: ``PagedChat.with_structured_output`` or a
per-call ``response_format`` (any spelling ``sdk.response_format`` takes). Tool calls
(``PagedChat.bind_tools``) are the SDK's: a forced choice is held to valid calls by the engine.
A reply cut at ``max_tokens`` inside its constraint (``sdk.cut_off``) raises
``LengthFinishReasonError``, as ``ChatOpenAI`` does; ``with_structured_output(include_raw=True)``
returns it as ``parsing_error`` with the raw reply.
Image content blocks (OpenAI's ``image_url``, LangChain's standard ``image`` with ``base64`` and
``mime_type`` or ``url``, Anthropic's ``image`` with a base64 ``source``) reach a multimodal model as
image parts (``sdk.images``); a text-only model refuses them with ``InvalidRequestError``.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing, closing
from operator import itemgetter
from typing import Any, ClassVar, Literal

try:
    from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
    from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
    from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
    from langchain_core.language_models.llms import LLM
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_core.messages import ChatMessage as LCChatMessage
    from langchain_core.messages import convert_to_openai_image_block, is_data_content_block
    from langchain_core.messages.ai import UsageMetadata
    from langchain_core.messages.tool import tool_call_chunk
    from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
    from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
    from langchain_core.outputs import ChatGenerationChunk, ChatResult, GenerationChunk, LLMResult
    from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
    from langchain_core.tools import BaseTool
    from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
    from langchain_core.utils.pydantic import is_basemodel_subclass
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("sdk.integrations.langchain needs langchain-core: pip install 'paged[langchain]'") from exc
from pydantic import PrivateAttr

from sdk.cut_off import CutOffWatch
from sdk.errors import LengthFinishReasonError
from sdk.integrations.base import (
    KNOBS, GenerationAdapter, awatched, finish_info, named_tool_choice, tool_call, watch_of, watched,
)  # fmt: skip
from sdk.integrations.langchain_retrieval import PagedEmbeddings, PagedRerank
from sdk.types import ChatMessage, Delta, ImagePart, TextPart, TokenLogprob

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
PROVIDER = "paged"
_PER_CALL = frozenset({*KNOBS, "request_id", "priority", "cache_salt", "timeout", "response_format"})
_CHAT_OPTIONS = frozenset({"tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs"})
_CALL_BLOCKS = {"tool_use", "tool_call"}  # an AI message's calls as content blocks (Anthropic's, LangChain's)
_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "user": "user", "assistant": "assistant"}


class _PagedParams(GenerationAdapter):  # type: ignore[misc, valid-type]
    """What the LangChain adapters share: the settings and sampling knobs (``sdk.integrations.base``), the
    per-call options LangChain passes, and the one stream both models' calls run through."""

    _raise_cut_offs: bool = PrivateAttr(default=True)  # False: a cut-off reply is returned, marked "length"

    _route: ClassVar[str] = "langchain"
    _per_call: ClassVar[frozenset[str]] = _PER_CALL

    @property
    def _model_display_name(self) -> str:
        if self.model or self.base_url is None:
            return self.model or BUNDLED_MODEL_NAME
        try:
            return self.aclient.model_name  # the endpoint's first model, once connected
        except RuntimeError:
            return "unknown"

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        if kwargs.get("model") not in (None, self.model):
            raise ValueError("a per-call model override is not supported; create another adapter for that model")
        unknown = set(kwargs) - self._per_call - {"model"}
        if unknown:
            raise ValueError(f"unsupported argument(s): {', '.join(sorted(unknown))}")
        options = {k: v for k, v in kwargs.items() if k != "model"}
        if stop is not None:
            options["stop"] = stop
        return self._request_options(options)

    def _watch(self, options: dict[str, Any]) -> CutOffWatch | None:
        """What raises a reply cut inside the call's constraint; None when cut-off replies are returned."""
        return watch_of(options) if self._raise_cut_offs else None

    def _input(self, call_input: Any) -> dict[str, Any]:
        """A call's input as the SDK client's ``stream`` arguments: ``messages`` or ``prompt``."""
        raise NotImplementedError

    def _to_chunk(self, delta: Delta) -> Any:
        """An SDK delta as the model's chunk (``ChatGenerationChunk`` or ``GenerationChunk``)."""
        raise NotImplementedError

    def _stream(
        self, call_input: Any, stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> Iterator[Any]:  # fmt: skip
        options = self._options(stop, kwargs)
        stream = self.client.stream(**self._input(call_input), **options)
        with closing(watched(stream, self._watch(options))) as deltas:
            for delta in deltas:
                chunk = self._to_chunk(delta)
                if run_manager:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _astream(
        self, call_input: Any, stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> AsyncIterator[Any]:  # fmt: skip
        options = self._options(stop, kwargs)
        stream = self.aclient.stream(**self._input(call_input), **options)
        async with aclosing(awatched(stream, self._watch(options))) as deltas:
            async for delta in deltas:
                chunk = self._to_chunk(delta)
                if run_manager:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self._model_display_name, "base_url": self.base_url, "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed, "stop": self.stop,
        }  # fmt: skip


def to_sdk_messages(messages: Sequence[BaseMessage]) -> list[ChatMessage]:
    """LangChain messages as SDK messages, with an AI message's tool calls, a tool result's call id,
    and image content blocks as image parts; other non-text blocks are refused."""
    out = []
    for message in messages:
        if isinstance(message, LCChatMessage):
            role = _ROLES.get(message.role, message.role)
        elif isinstance(message, (HumanMessage, AIMessage, SystemMessage, ToolMessage)):
            role = _ROLES[message.type]
        else:
            raise ValueError(f"unsupported message type {type(message).__name__}")
        if isinstance(message.content, str):
            content: str | list[Any] = message.content
        else:
            parts: list[Any] = []
            for block in message.content:
                if isinstance(block, str):
                    parts.append(TextPart(text=block))
                elif block.get("type") == "text":
                    parts.append(TextPart(text=block["text"]))
                elif block.get("type") in _CALL_BLOCKS and isinstance(message, AIMessage):
                    continue  # the same call is in message.tool_calls
                elif block.get("type") in ("image", "image_url"):
                    parts.append(_image_part(block))
                else:
                    raise ValueError(f"unsupported content block type {block.get('type')!r}: text and images only")
            images = any(isinstance(p, ImagePart) for p in parts)
            content = parts if images else "".join(p.text for p in parts)
        calls = None
        if isinstance(message, AIMessage) and message.tool_calls:
            calls = [tool_call(c.get("id"), c["name"], c["args"]) for c in message.tool_calls]
        call_id = message.tool_call_id if isinstance(message, ToolMessage) else None
        out.append(ChatMessage(role=role, content=None if calls and not content else content, name=message.name,  # type: ignore[arg-type]
                               tool_calls=calls, tool_call_id=call_id))  # fmt: skip
    return out


def _image_part(block: dict[str, Any]) -> ImagePart:
    """An image content block as an SDK image part: OpenAI's ``image_url`` (an object or a bare URL), LangChain's
    standard ``image`` (``base64`` + ``mime_type``, or ``url``; v0's ``source_type`` too) or Anthropic's base64 ``source``.

    Raises:
        ValueError: an image block of another form (a provider file id), naming it.
    """
    if block["type"] == "image_url":
        url = block["image_url"]["url"] if isinstance(block["image_url"], dict) else block["image_url"]
        return ImagePart.of(url)
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64":  # Anthropic's
        return ImagePart.of(f"data:{source.get('media_type', '')};base64,{source['data']}")
    if is_data_content_block(block) and (block.get("mime_type") or block.get("url") or block.get("source_type") == "url"):
        return ImagePart.of(convert_to_openai_image_block(block)["image_url"]["url"])
    data = block.get("base64") or (block.get("data") if block.get("source_type") == "base64" else None)
    if data is not None:  # no MIME type given: read it from the bytes
        return ImagePart.of(base64.b64decode(data))
    raise ValueError(f"unsupported image block {sorted(block)}: give base64 data (with mime_type) or a url")


def _logprob_dict(logprob: TokenLogprob) -> dict[str, Any]:
    """A token's logprob as ChatOpenAI's ``response_metadata`` spells it (without bytes)."""
    top = [{"token": c.token, "logprob": c.logprob} for c in logprob.top_logprobs]
    return {"token": logprob.token, "logprob": logprob.logprob, "top_logprobs": top}


class PagedChat(_PagedParams, BaseChatModel):
    """Chat model on paged's engine (continuous batching, shared prefix cache), in-process or remote.

    Setup:
        ``pip install paged``; the bundled SmolLM2-135M-Instruct needs no download.

    Instantiate:
        .. code-block:: python

            from sdk.integrations.langchain import PagedChat
            chat = PagedChat(temperature=0, max_tokens=128, hooks=[AuditLog("audit.jsonl")])
            remote = PagedChat(base_url="http://gpu-box:8000/v1", api_key=KEY, temperature=0)

    Invoke:
        .. code-block:: python

            chat.invoke([("system", SYSTEM), ("human", "Hi!")]).content

    Stream:
        .. code-block:: python

            for chunk in chat.stream("Tell me a joke"):
                print(chunk.content, end="")

    Async:
        .. code-block:: python

            await chat.ainvoke("Hi"); [c async for c in chat.astream("Hi")]; await chat.abatch(["a", "b"])

    Structured output:
        .. code-block:: python

            class Joke(BaseModel):
                setup: str = Field(max_length=80)
                punchline: str = Field(max_length=80)

            chat.with_structured_output(Joke).invoke("Tell me a joke")  # a Joke: the engine masks any other text
            chat.invoke("Tell me a joke", response_format=Joke).content  # its JSON

    Tool calling:
        .. code-block:: python

            reply = chat.bind_tools([get_weather], tool_choice="required").invoke("Weather in Paris?")
            reply.tool_calls  # [{"name": "get_weather", "args": {"city": "Paris"}, "id": ..., "type": "tool_call"}]

    Concurrent calls with one system prompt compute its KV once; instances given one
    ``runtime=`` share its engine and prefix cache. Responses carry
    ``usage_metadata`` (``input_token_details.cache_read`` = prompt tokens from the cache)
    and ``response_metadata`` (``finish_reason``, ``model_name``).
    """

    streaming: bool = False
    """Stream tokens to callbacks during ``invoke`` (LangChain's convention)."""

    _per_call: ClassVar[frozenset[str]] = _PER_CALL | _CHAT_OPTIONS

    @property
    def _llm_type(self) -> str:
        return "paged-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider=PROVIDER, ls_model_name=kwargs.get("model") or self._model_display_name, ls_model_type="chat"
        )
        if (temperature := kwargs.get("temperature", self.temperature)) is not None:
            params["ls_temperature"] = temperature
        if (max_tokens := kwargs.get("max_tokens", self.max_tokens)) is not None:
            params["ls_max_tokens"] = max_tokens
        if stop := stop or self.stop:
            params["ls_stop"] = stop
        return params

    def _to_chunk(self, delta: Delta) -> ChatGenerationChunk:
        # NOTE: as ChatOpenAI does, logprobs ride in response_metadata; merging chunks concatenates them.
        logprobs = {"logprobs": {"content": [_logprob_dict(t) for t in delta.logprobs]}} if delta.logprobs else {}
        # NOTE: merging chunks joins the fragments of each call index into the message's tool_calls.
        calls = [tool_call_chunk(name=c.name, args=c.arguments, id=c.id, index=c.index) for c in delta.tool_calls or ()]
        # NOTE: where langchain-core reads a reasoning block from (content_blocks), as ChatDeepSeek sends it
        reasoning = {"reasoning_content": delta.reasoning} if delta.reasoning else {}
        if delta.finish_reason is None:
            message = AIMessageChunk(
                content=delta.text, id=delta.request_id, tool_call_chunks=calls, response_metadata=logprobs,
                additional_kwargs=reasoning,
            )  # fmt: skip
            return ChatGenerationChunk(message=message)
        assert delta.usage is not None
        usage = UsageMetadata(
            input_tokens=delta.usage.prompt_tokens,
            output_tokens=delta.usage.completion_tokens,
            total_tokens=delta.usage.total_tokens,
            input_token_details={"cache_read": delta.usage.cached_tokens},
        )
        metadata = {"finish_reason": delta.finish_reason, "model_name": self.aclient.model_name,
                    "model_provider": PROVIDER, **logprobs}  # fmt: skip
        message = AIMessageChunk(
            content=delta.text, id=delta.request_id, tool_call_chunks=calls, usage_metadata=usage,
            response_metadata=metadata, chunk_position="last", additional_kwargs=reasoning,
        )  # fmt: skip
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": delta.finish_reason})

    def _input(self, call_input: list[BaseMessage]) -> dict[str, Any]:
        return {"messages": to_sdk_messages(call_input)}

    def _generate(
        self, messages: list[BaseMessage], stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> ChatResult:  # fmt: skip
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    async def _agenerate(
        self, messages: list[BaseMessage], stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> ChatResult:  # fmt: skip
        return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """This model with ``tools`` offered on every call; replies carry ``tool_calls``.

        Args:
            tools: ``BaseTool``s, ``@tool`` functions, pydantic classes, OpenAI tool dicts or
                typed callables (``convert_to_openai_tool``).
            tool_choice: ``"auto"`` (None, the default: text or calls), ``"none"``,
                ``"required"`` / ``"any"`` (at least one call), a tool's name or
                ``{"type": "function", "function": {"name": ...}}`` (one call of that tool), or
                True (one call of the only tool). A forced choice is held to valid calls by the engine.
            parallel_tool_calls: False = at most one call per reply (default: several may follow).
            strict: Passed to ``convert_to_openai_tool``; constrained calls always follow the schema.
            kwargs: Per-call options bound to every call (``max_tokens``, ``temperature``...).
        """
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        if tool_choice is not None and tool_choice is not False:
            kwargs["tool_choice"] = _tool_choice(tool_choice, [t["function"]["name"] for t in formatted])
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        self._options(None, kwargs)  # refuses unknown options here rather than on the first call
        return self.bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "json_mode", "function_calling"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Any]:
        """This model with its replies parsed into ``schema``; the engine guarantees the JSON.

        Args:
            schema: A pydantic class (results are instances of it), a ``TypedDict`` class or
                a JSON schema / OpenAI function dict (results are dicts). Optional for ``json_mode``.
            method: ``"json_schema"``: the reply is constrained to ``schema``.
                ``"json_mode"``: the reply is constrained to be a JSON object; ``schema`` only
                shapes parsing, so the prompt must ask for its fields.
                ``"function_calling"``: ``schema`` is bound as the one tool, its call forced;
                the result is the call's arguments (the raw reply is a tool-call message).
            include_raw: Return ``{"raw": AIMessage, "parsed": ..., "parsing_error": ...}``; a
                reply that does not parse, or was cut by ``max_tokens``
                (``LengthFinishReasonError``), then sets ``parsing_error`` and ``parsed=None``
                instead of raising.
            strict: Accepted for compatibility; the reply always follows the schema.
            kwargs: Per-call options bound to every call (``max_tokens``, ``temperature``...).

        Streaming yields the object parsed so far as it grows (for a pydantic class, once
        it validates).
        """
        del strict  # the engine's constraint is always strict
        if method not in ("json_schema", "json_mode", "function_calling"):
            raise ValueError(f"unknown method {method!r}: use 'json_schema', 'json_mode' or 'function_calling'")
        if schema is None and method != "json_mode":
            raise ValueError(f"method={method!r} needs a schema; only method='json_mode' takes none")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        # NOTE: with include_raw the model returns a cut-off reply and the parser step raises for it,
        # so the raw reply is kept and the error lands in parsing_error
        model = self._returning_cut_offs() if include_raw else self
        traced = {"ls_structured_output_format": {"kwargs": {"method": method}, "schema": schema}}
        parser: Runnable[Any, Any]
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]  # type: ignore[arg-type]
            llm = model.bind_tools([schema], tool_choice=name, parallel_tool_calls=False, **kwargs).bind(**traced)  # type: ignore[list-item]
            parser = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                if is_pydantic else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )  # fmt: skip
        else:
            response_format = {"type": "json_object"} if method == "json_mode" else convert_to_json_schema(schema)  # type: ignore[arg-type]
            self._options(None, kwargs)  # refuses unknown options here rather than on the first call
            llm = model.bind(response_format=response_format, **traced, **kwargs)
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()  # type: ignore[arg-type]
        if not include_raw:
            return llm | parser
        parser = RunnableLambda(_refuse_cut_off) | parser
        parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        no_parse = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parse.with_fallbacks([no_parse], exception_key="parsing_error")

    def _returning_cut_offs(self) -> PagedChat:
        """This model on the same client, returning a reply cut inside its constraint (marked ``"length"``)."""
        model = self.model_copy()
        model._raise_cut_offs = False
        return model


def _refuse_cut_off(message: AIMessage) -> AIMessage:
    """The reply, unless it was cut by its token limit (under a schema every cut is inside it).

    Raises:
        LengthFinishReasonError: with the reply's text and token count.
    """
    if message.response_metadata.get("finish_reason") != "length":
        return message
    num_tokens = message.usage_metadata["output_tokens"] if message.usage_metadata else 0
    raise LengthFinishReasonError(message.text, max_tokens=num_tokens, request_id=message.id or "")


def _tool_choice(choice: dict[str, Any] | str | bool, names: list[str]) -> dict[str, Any] | str:
    """LangChain's tool-choice spellings as the SDK's (``sdk.tools.to_tool_choice`` checks the result)."""
    if choice is True:
        if len(names) != 1:
            raise ValueError(f"tool_choice=True needs exactly one tool; got {len(names)}")
        choice = names[0]
    return "required" if choice == "any" else named_tool_choice(choice)


class PagedLLM(_PagedParams, LLM):
    """Text-completion LLM on paged's engine (in-process or ``base_url``): the prompt is used as given.

    Instantiate / invoke / stream:
        .. code-block:: python

            from sdk.integrations.langchain import PagedLLM
            llm = PagedLLM(max_tokens=64, temperature=0)
            llm.invoke("The capital of France is")
            for text in llm.stream("Once upon a time"):
                print(text, end="")

    ``generation_info`` of the last chunk holds ``finish_reason`` and the token usage.
    """

    @property
    def _llm_type(self) -> str:
        return "paged-llm"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = PROVIDER
        params["ls_model_name"] = kwargs.get("model") or self._model_display_name
        return params

    def _to_chunk(self, delta: Delta) -> GenerationChunk:
        return GenerationChunk(text=delta.text, generation_info=finish_info(delta) or None)

    def _input(self, call_input: str) -> dict[str, Any]:
        return {"prompt": call_input}

    def _generate(
        self, prompts: list[str], stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> LLMResult:  # fmt: skip
        generations = []
        for prompt in prompts:
            generation = GenerationChunk(text="")
            for chunk in self._stream(prompt, stop, run_manager, **kwargs):
                generation += chunk
            generations.append([generation])
        return LLMResult(generations=generations)

    async def _agenerate(
        self, prompts: list[str], stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> LLMResult:  # fmt: skip
        async def one(prompt: str) -> GenerationChunk:
            generation = GenerationChunk(text="")
            async for chunk in self._astream(prompt, stop, run_manager, **kwargs):
                generation += chunk
            return generation

        generations = await asyncio.gather(*(one(p) for p in prompts))  # the engine batches them
        return LLMResult(generations=[[g] for g in generations])

    def _call(
        self, prompt: str, stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any,
    ) -> str:  # fmt: skip
        return self._generate([prompt], stop, run_manager, **kwargs).generations[0][0].text


__all__ = ["PagedChat", "PagedEmbeddings", "PagedLLM", "PagedRerank"]
