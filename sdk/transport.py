"""Transports: where a client's engine-level requests run.

The client builds an ``EngineRequest`` (prompt + sampling knobs, after the hooks ran),
a ``Transport`` executes it and yields the engine's ``Delta``s. ``InProcessTransport``
drives the ``engine.AsyncEngine`` of a ``sdk.runtime.Runtime`` in this process and passes
its deltas on as they come (it only moves tool calls out of their text); it renders and
tokenizes prompts on the ``sdk.prompt_worker`` threads, never on the event loop, after
checking that their characters can fit ``max_model_len``.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sdk.chat_template import check_prompt_chars, render_chat
from sdk.errors import EngineFailure, EngineRestarting, OverloadedError
from sdk.fields import from_engine
from sdk.prompt_worker import PROMPT_WORKER
from sdk.response_format import to_structured_output
from sdk.runtime import Runtime
from sdk.tools import ToolCallParser, ToolSpec, tool_constraint
from sdk.types import ChatMessage, Delta, SamplingOptions

if TYPE_CHECKING:
    from engine import AsyncEngine


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as the engine sees it: hooks have run, the chat template is applied."""

    request_id: str
    prompt: str | list[int]
    sampling: SamplingOptions  # the knobs set (None = the engine's default), the tenant's caps applied
    priority: int = 0
    cache_salt: str | None = None
    tenant: str | None = None  # the engine's fair share (engine.core.fair_share)
    weight: float = 1.0
    response_format: Any = None  # a sdk.response_format.ResponseFormat; None = free text
    tools: list[ToolSpec] | None = None  # rendered into the prompt already; the output is parsed for calls
    tool_choice: str | None = None  # "auto" | "none" | "required" | a tool's name (sdk.tools.to_tool_choice)
    parallel_tool_calls: bool = True


@dataclass(frozen=True, slots=True)
class PrefixPin:
    """A prefix whose KV blocks the engine keeps resident until unpinned."""

    pin_id: str
    token_ids: list[int]
    num_cached_tokens: int  # tokens already cached when it was pinned


class Transport(abc.ABC):
    """Executes engine-level requests; every method may be called from any event loop."""

    @property
    @abc.abstractmethod
    def model_name(self) -> str:
        """The served model's name, as results report it."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Longest prompt + completion, in tokens."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Make the transport ready (load or connect); idempotent."""

    @abc.abstractmethod
    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, tools: Sequence[ToolSpec] | None = None
    ) -> str | list[int]:
        """The prompt for ``messages`` (and ``tools``) under the model's chat template."""

    async def check_prompt_size(self, num_chars: int) -> None:
        """Refuse a prompt of ``num_chars`` characters that cannot fit ``max_model_len`` (before any work).

        Raises:
            InvalidRequestError: it cannot fit (``param="prompt"``). The default knows no bound.
        """

    async def prepare_prompt(
        self, tenant: str | None, messages: Sequence[ChatMessage] | None, prompt: str | list[int] | None,
        tools: Sequence[ToolSpec] | None = None,
    ) -> str | list[int]:  # fmt: skip
        """The engine prompt of a chat (``messages``, ``tools``) or of a raw ``prompt``.

        Raises:
            InvalidRequestError: as ``render_chat``, or past ``check_prompt_size``'s bound.
        """
        if messages is not None:
            return self.render_chat(messages, tools=tools)
        assert prompt is not None
        return prompt

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        """Run ``request``, yielding its deltas (``usage`` on the last); closing the iterator early aborts the request.

        Raises:
            InvalidRequestError: bad sampling knobs or a prompt the engine cannot serve.
            OverloadedError: the admission queue is full.
            EngineFailure: the engine failed while serving.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a running request and free its blocks; unknown ids are a no-op."""

    @abc.abstractmethod
    async def pin_prefix(self, prompt: str | list[int], cache_salt: str | None = None) -> PrefixPin:
        """Compute and keep resident the KV blocks of ``prompt``."""

    @abc.abstractmethod
    async def unpin_prefix(self, pin_id: str) -> None:
        """Release a pin; its blocks stay cached (evictable) until their space is needed."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """The engine's figures (keys as ``engine.AsyncEngine.stats()``)."""

    async def close(self) -> None:
        """Release what the transport holds open (connections); it stays usable. Idempotent."""


class InProcessTransport(Transport):
    """Runs requests on the engine of a ``Runtime`` of this process.

    Args:
        runtime: whose engine to drive (loaded on ``start()`` if need be); an engine is
            served through a ``Runtime(engine=...)``, which leaves it running when closed.
    """

    def __init__(self, runtime: Runtime | AsyncEngine) -> None:
        self.runtime = runtime if isinstance(runtime, Runtime) else Runtime(engine=runtime)

    @property
    def engine(self) -> AsyncEngine:
        return self.runtime.engine

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def start(self) -> None:
        await self.runtime.start()

    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, tools: Sequence[ToolSpec] | None = None
    ) -> list[int]:
        return render_chat(self.engine.tokenizer, messages, add_generation_prompt, tools, self.engine.max_model_len)

    async def check_prompt_size(self, num_chars: int) -> None:
        engine = self.engine
        if num_chars > engine.max_model_len:  # NOTE: the first long prompt reads the vocabulary (~0.1 s), off the loop
            await asyncio.to_thread(check_prompt_chars, engine.tokenizer, num_chars, engine.max_model_len)

    async def prepare_prompt(
        self, tenant: str | None, messages: Sequence[ChatMessage] | None, prompt: str | list[int] | None,
        tools: Sequence[ToolSpec] | None = None,
    ) -> str | list[int]:  # fmt: skip
        tokenizer = self.engine.tokenizer
        if messages is not None:
            return await PROMPT_WORKER.run(tenant, render_chat, tokenizer, messages, True, tools, self.engine.max_model_len)
        if isinstance(prompt, str):
            await self.check_prompt_size(len(prompt))
            from engine.llm_engine import tokenize

            return await PROMPT_WORKER.run(tenant, tokenize, tokenizer, prompt)
        assert prompt is not None
        return prompt

    async def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        from engine import errors as engine_errors
        from engine.sampling_params import SamplingParams

        stream = None
        try:
            params = SamplingParams(**request.sampling.sampling_kwargs(), structured_output=engine_constraint(request))
            stream = self.engine.stream(
                request.prompt, params, request_id=request.request_id, priority=request.priority,
                cache_salt=request.cache_salt, tenant=request.tenant, weight=request.weight,
            )  # fmt: skip
            if request.tools is None or request.tool_choice == "none":
                async for delta in stream:
                    yield delta
                return
            parsers = [ToolCallParser(request.tools) for _ in range(params.n)]
            async for delta in stream:
                yield _with_calls(delta, parsers[delta.index])
        except engine_errors.ParameterError as exc:  # bad knobs, a prompt that can never be served, an id in use
            raise from_engine(exc) from exc
        except engine_errors.EngineOverloaded as exc:
            raise OverloadedError(str(exc)) from exc
        except engine_errors.EngineRestarting as exc:
            raise EngineRestarting(str(exc), retry_after=exc.retry_after) from exc
        except engine_errors.EngineError as exc:
            raise EngineFailure(str(exc)) from exc
        finally:
            if stream is not None:
                await stream.aclose()

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def pin_prefix(self, prompt: str | list[int], cache_salt: str | None = None) -> PrefixPin:
        from engine.errors import ParameterError

        token_ids = prompt if isinstance(prompt, list) else self.engine.tokenizer.encode(prompt, add_special_tokens=False)
        try:
            pinned = await self.engine.pin_prefix(token_ids, cache_salt=cache_salt)
        except ParameterError as exc:
            raise from_engine(exc) from exc
        return PrefixPin(str(pinned.pin_id), list(token_ids), pinned.num_cached_tokens)

    async def unpin_prefix(self, pin_id: str) -> None:
        await self.engine.unpin_prefix(pin_id)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()


def engine_constraint(request: EngineRequest) -> Any:
    """The engine constraint of a request: its response format's, or its tool choice's."""
    if request.tools is not None and request.tool_choice is not None:
        return tool_constraint(request.tools, request.tool_choice, request.parallel_tool_calls)
    return to_structured_output(request.response_format)


def _with_calls(delta: Delta, parser: ToolCallParser) -> Delta:
    """``delta`` with its completion's tool calls moved out of its text (``finish_reason`` "tool_calls" once it made one)."""
    delta.text, calls = parser.feed(delta.text)
    delta.tool_calls = calls or None
    if delta.finish_reason is not None:
        delta.text += parser.finish()
        if delta.finish_reason == "stop" and parser.num_complete_calls:
            delta.finish_reason = "tool_calls"
    return delta
