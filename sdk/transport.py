"""Transports: where a client's engine-level requests run.

The client builds an ``EngineRequest`` (prompt + sampling knobs, after the hooks ran),
a ``Transport`` executes it and yields the engine's ``Delta``s. ``InProcessTransport``
drives the ``engine.AsyncEngine`` of a ``sdk.runtime.Runtime`` in this process and passes
its deltas on as they come (it only moves a chat reply's reasoning and tool calls out of
its text, ``sdk.reasoning`` and ``sdk.tools``); it renders and
tokenizes prompts on the ``sdk.prompt_worker`` threads, never on the event loop, after
checking that their characters can fit ``max_model_len``.
"""

from __future__ import annotations

import abc
import asyncio
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sdk.chat_template import check_prompt_chars, render_chat
from engine.pooling.params import PoolingParams
from sdk.errors import EngineFailure, EngineRestarting, InvalidRequestError, NotFoundError, OverloadedError
from sdk.fields import from_engine
from sdk.images import ImageInfo, ImageLimits, LoadedImage, load_message_images
from sdk.prompt_worker import PROMPT_WORKER
from sdk.reasoning import PromptReasoning, ReasoningParser, after_reasoning, check_parser_name, reasoning_format
from sdk.response_format import to_structured_output
from sdk.runtime import Runtime
from sdk.tools import ToolCallParser, ToolSpec, tool_constraint
from sdk.types import ChatMessage, CompletionResult, Delta, SamplingOptions

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
    chat_template_kwargs: dict[str, Any] | None = None  # rendered into the prompt already (sent to a remote server)
    reasoning: PromptReasoning | None = None  # parse the reply's reasoning; constraints apply after it
    resume_token_ids: list[int] | None = None  # output its caller already got: the engine continues after it


class ImagePrompt(list):  # type: ignore[type-arg]
    """A chat prompt's token ids (a ``list[int]``) with the checked images its placeholders stand for, in order."""

    images: tuple[LoadedImage, ...]

    def __init__(self, token_ids: list[int], images: Sequence[LoadedImage]) -> None:
        super().__init__(token_ids)
        self.images = tuple(images)

    def engine_input(self) -> dict[str, Any]:
        """The engine's multimodal input (vLLM's form): the token ids and the images' pixels."""
        return {"prompt_token_ids": list(self), "multi_modal_data": {"image": [i.image for i in self.images]}}


@dataclass(frozen=True, slots=True)
class Pooled:
    """A transport's answer to ``embed`` or ``score``: one embedding (or score) per input, and the tokens read."""

    values: list[Any]  # list[list[float]] (embeddings) or list[float] (scores), in input order
    num_tokens: int
    model: str | None = None  # the model that answered, where it is not the transport's ``model_name``


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
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, tools: Sequence[ToolSpec] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str | list[int]:  # fmt: skip
        """The prompt for ``messages`` (and ``tools``, template variables) under the model's chat template."""

    def prompt_reasoning(self, prompt: str | list[int]) -> PromptReasoning | None:
        """The reasoning of a chat ``prompt``'s reply, to parse here; None = none (or parsed by a remote server)."""
        return None

    async def prompt_images(self, prompt: str | list[int]) -> list[ImageInfo]:
        """What the audit record says of a prepared prompt's images (hash, size, MIME type); never their bytes."""
        return [image.info for image in prompt.images] if isinstance(prompt, ImagePrompt) else []

    async def check_prompt_size(self, num_chars: int) -> None:
        """Refuse a prompt of ``num_chars`` characters that cannot fit ``max_model_len`` (before any work).

        Raises:
            InvalidRequestError: it cannot fit (``param="prompt"``). The default knows no bound.
        """

    async def prepare_prompt(
        self, tenant: str | None, messages: Sequence[ChatMessage] | None, prompt: str | list[int] | None,
        tools: Sequence[ToolSpec] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str | list[int]:  # fmt: skip
        """The engine prompt of a chat (``messages``, ``tools``, template variables) or of a raw ``prompt``.

        Raises:
            InvalidRequestError: as ``render_chat``, or past ``check_prompt_size``'s bound.
        """
        if messages is not None:
            return self.render_chat(messages, tools=tools, chat_template_kwargs=chat_template_kwargs)
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

    def pooling_model_name(self, task: str) -> str:
        """The name of the model ``embed`` (``task="embed"``) or ``score`` (``"score"``) runs on."""
        return self.model_name

    async def embed(self, inputs: Sequence[str | list[int]], params: PoolingParams) -> Pooled:
        """The embeddings of ``inputs`` (checked: non-empty texts or token-id lists), in order.

        Raises:
            InvalidRequestError: the model does not embed (``param="model"``), bad ``params``, an input
                over the model's length with truncation off (``param="input.i"``).
            OverloadedError, EngineRestarting, EngineFailure: as ``generate``.
        """
        raise InvalidRequestError.about("model", f"{self.model_name!r} is not served for embeddings here")

    async def score(self, query: str | Sequence[str], documents: Sequence[str], params: PoolingParams) -> Pooled:
        """The relevance of each of ``documents`` to ``query`` (a cross-encoder's, or the embeddings' cosine);
        with a list of queries, document ``i``'s to query ``i`` (pairs, checked to be as many).

        Raises:
            InvalidRequestError: a generative model (``param="model"``), bad ``params``, a pair over the
                model's length with truncation off (``param="documents.i"``). Others as ``embed``.
        """
        raise InvalidRequestError.about("model", f"{self.model_name!r} is not served for scores here")

    async def respond(self, request: Any) -> AsyncIterator[Any] | None:
        """Run a Responses API request (``sdk.responses.ResponseRequest``) on a server that keeps its
        conversations: its stream events. None: the client runs it here (``sdk.responses.service``)."""
        return None

    async def retrieve(self, request_id: str) -> CompletionResult:
        """The whole result of a request a server journalled as it shut down (``RequestJournalled``).

        Raises:
            NotFoundError: no such request here (``param="request_id"``); in process, never one.
        """
        raise NotFoundError(f"request_id: no journalled request {request_id!r} here", param="request_id")

    async def close(self) -> None:
        """Release what the transport holds open (connections); it stays usable. Idempotent."""


class InProcessTransport(Transport):
    """Runs requests on the engine of a ``Runtime`` of this process.

    Args:
        runtime: whose engine to drive (loaded on ``start()`` if need be); an engine is
            served through a ``Runtime(engine=...)``, which leaves it running when closed.
        reasoning_parser: how chat replies' reasoning is split from their text: ``"auto"``
            (from the chat template), ``"none"``, or a family (``sdk.reasoning.REASONING_PARSERS``).
        image_limits: what a request's images may be (``sdk.images.ImageLimits``); None = its defaults.
        model: which of the runtime's chat models it runs on, by name (``Runtime.chat_engine``); None = the first.

    Raises:
        InvalidRequestError: an unknown ``reasoning_parser``.
    """

    def __init__(
        self, runtime: Runtime | AsyncEngine, reasoning_parser: str = "auto", image_limits: ImageLimits | None = None,
        model: str | None = None,
    ) -> None:  # fmt: skip
        self.runtime = runtime if isinstance(runtime, Runtime) else Runtime(engine=runtime)
        self.reasoning_parser = check_parser_name(reasoning_parser)
        self.image_limits = image_limits or ImageLimits()
        self.model = model

    @property
    def engine(self) -> AsyncEngine:
        """The chat engine it runs on (after ``start()``).

        Raises:
            NotFoundError: ``model`` names none of the runtime's chat models.
        """
        return self.runtime.engine if self.model is None else self.runtime.chat_engine(self.model)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def start(self) -> None:
        await self.runtime.start()

    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, tools: Sequence[ToolSpec] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:  # fmt: skip
        engine = self.engine
        return render_chat(
            engine.tokenizer, messages, add_generation_prompt, tools, engine.max_model_len, chat_template_kwargs,
            self._image_placeholder(),
        )  # fmt: skip

    def _image_placeholder(self) -> str | None:
        """The text that stands for an image in the engine's prompts; None when its model takes no images."""
        engine = self.engine
        # NOTE: an engine (or a stand-in) that does not say takes no images
        return engine.image_placeholder if getattr(engine, "accepts_images", False) else None

    def prompt_reasoning(self, prompt: str | list[int]) -> PromptReasoning | None:
        tokenizer = self.engine.tokenizer
        fmt = reasoning_format(self.reasoning_parser, getattr(tokenizer, "chat_template", None))
        if fmt is None or not isinstance(prompt, list):  # NOTE: chat prompts are token ids here
            return None
        return PromptReasoning(fmt, fmt.start_of(tokenizer.decode(prompt[-_TAIL_TOKENS:])))

    async def check_prompt_size(self, num_chars: int) -> None:
        engine = self.engine
        if num_chars > engine.max_model_len:  # NOTE: the first long prompt reads the vocabulary (~0.1 s), off the loop
            await asyncio.to_thread(check_prompt_chars, engine.tokenizer, num_chars, engine.max_model_len)

    async def prepare_prompt(
        self, tenant: str | None, messages: Sequence[ChatMessage] | None, prompt: str | list[int] | None,
        tools: Sequence[ToolSpec] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str | list[int]:  # fmt: skip
        engine = self.engine
        task = getattr(engine, "task", "generate")  # NOTE: a stand-in engine that does not say generates
        if task != "generate":  # NOTE: before rendering: a pooling model's tokenizer has no chat template
            from engine.errors import UnsupportedTask

            raise from_engine(UnsupportedTask(engine.model_name, "generate", task))
        tokenizer = engine.tokenizer
        if messages is not None:
            placeholder = self._image_placeholder()
            # NOTE: rendered first: a text model's images, or text spelling the placeholder, are refused before any is decoded
            token_ids = await PROMPT_WORKER.run(
                tenant, render_chat, tokenizer, messages, True, tools, self.engine.max_model_len, chat_template_kwargs,
                placeholder,
            )  # fmt: skip
            if placeholder is None or not any(m.image_parts for m in messages):
                return token_ids
            return ImagePrompt(token_ids, await load_message_images(messages, self.image_limits, tenant))
        if isinstance(prompt, str):
            await self.check_prompt_size(len(prompt))
            from engine.processor import tokenize

            return await PROMPT_WORKER.run(tenant, tokenize, tokenizer, prompt)
        assert prompt is not None
        return prompt

    async def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        from engine import errors as engine_errors
        from engine.sampling_params import SamplingParams

        stream = None
        try:
            params = SamplingParams(**request.sampling.sampling_kwargs(), structured_output=engine_constraint(request))
            prompt = request.prompt.engine_input() if isinstance(request.prompt, ImagePrompt) else request.prompt
            # NOTE: only a continuation names resume_token_ids: a stand-in engine need not know it
            resume = {} if request.resume_token_ids is None else {"resume_token_ids": request.resume_token_ids}
            stream = self.engine.stream(
                prompt, params, request_id=request.request_id, priority=request.priority,
                cache_salt=request.cache_salt, tenant=request.tenant, weight=request.weight, **resume,
            )  # fmt: skip
            parse_calls = request.tools is not None and request.tool_choice != "none"
            if request.reasoning is None and not parse_calls:
                async for delta in stream:
                    yield delta
                return
            parsers = [
                _ReplyParser(
                    request.reasoning.parser() if request.reasoning is not None else None,
                    ToolCallParser(request.tools) if parse_calls and request.tools is not None else None,
                )
                for _ in range(params.n)
            ]
            async for delta in stream:
                yield parsers[delta.index].split(delta)
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

    def pooling_model_name(self, task: str) -> str:
        return self.runtime.pooling_engine(task).model_name

    async def embed(self, inputs: Sequence[str | list[int]], params: PoolingParams) -> Pooled:
        # NOTE: one engine call per input: the engine's driver batches concurrent ones under its token budget
        engine = self.runtime.pooling_engine("embed")
        outs = await _pooled([engine.embed(x, params) for x in inputs], [f"input.{i}" for i in range(len(inputs))])
        return Pooled([o.outputs.embedding for o in outs], sum(len(o.prompt_token_ids) for o in outs), engine.model_name)

    async def score(self, query: str | Sequence[str], documents: Sequence[str], params: PoolingParams) -> Pooled:
        engine = self.runtime.pooling_engine("score")
        pairs = not isinstance(query, str)
        queries = list(query) if pairs else [query]
        names = [f"documents.{i}" for i in range(len(documents))]
        if engine.task == "embed":  # NOTE: an embedder's score is a cosine: each query embedded once, not per document
            from engine.pooling.api import cosine

            query_names = [f"query.{i}" for i in range(len(queries))] if pairs else ["query"]
            outs = await _pooled([engine.embed(x, params) for x in (*queries, *documents)], [*query_names, *names])
            embedded = [o.outputs.embedding for o in outs[: len(queries)]]
            scores = [cosine(embedded[i if pairs else 0], o.outputs.embedding) for i, o in enumerate(outs[len(queries) :])]
        else:
            each = queries if pairs else queries * len(documents)
            outs = await _pooled([engine.score(q, d, params) for q, d in zip(each, documents)], names)
            scores = [o.outputs.score for o in outs]
        return Pooled(scores, sum(len(o.prompt_token_ids) for o in outs), engine.model_name)

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
        """The chat engine's figures; its pooling ones (``pooling_*``, ``pooling``) summed over the pooling engines
        beside it."""
        stats = self.engine.stats()
        beside = {id(e): e.stats() for e in (self.runtime.pooling_engine(t) for t in ("embed", "score")) if e is not self.engine}
        for other in beside.values():
            for key, value in other.items():
                if key.startswith("pooling_") and isinstance(value, (int, float)):
                    stats[key] = stats.get(key, 0) + value
        if beside and "pooling" in stats:
            from engine.pooling.pooling_stats import merge_pooling

            stats["pooling"] = merge_pooling(stats["pooling"], *(o["pooling"] for o in beside.values() if "pooling" in o))
        return stats

    @property
    def block_size(self) -> int:
        """Tokens per KV cache block."""
        return self.engine.config.block_size


async def _pooled(calls: list[Any], params: Sequence[str]) -> list[Any]:
    """The results of the engine's pooling ``calls`` (one per input), in order; the first failure as the SDK's
    error, call ``i``'s input naming it as ``params[i]`` (``input.3``, ``query``)."""
    from engine import errors as engine_errors

    results = await asyncio.gather(*calls, return_exceptions=True)
    for i, out in enumerate(results):
        if not isinstance(out, BaseException):
            continue
        if isinstance(out, engine_errors.ParameterError) and out.param in ("prompt", "documents"):
            # NOTE: the engine saw this input alone ("prompt 0 ..."): name it by its place in the request
            reason = _ENGINE_INPUT.sub("", str(out))
            raise InvalidRequestError.about(params[i], reason) from out
        if isinstance(out, engine_errors.ParameterError):
            raise from_engine(out) from out
        if isinstance(out, engine_errors.EngineOverloaded):
            raise OverloadedError(str(out)) from out
        if isinstance(out, engine_errors.EngineRestarting):
            raise EngineRestarting(str(out), retry_after=out.retry_after) from out
        if isinstance(out, engine_errors.EngineError):
            raise EngineFailure(str(out)) from out
        raise out
    return results


_ENGINE_INPUT = re.compile(r"^(prompt|documents?) \d+:? ")


def engine_constraint(request: EngineRequest) -> Any:
    """The engine constraint of a request: its tool choice's over its response format's (``sdk.tools.tool_constraint``),
    after its reasoning."""
    constraint = to_structured_output(request.response_format)
    if request.tools is not None and request.tool_choice is not None:
        constraint = tool_constraint(request.tools, request.tool_choice, request.parallel_tool_calls, constraint)
    if request.reasoning is None:
        return constraint
    return after_reasoning(constraint, request.reasoning.format, request.reasoning.start)


class _ReplyParser:
    """Moves one completion's reasoning, then its tool calls, out of its text: the tool-call
    parser reads only the answer."""

    def __init__(self, reasoning: ReasoningParser | None, calls: ToolCallParser | None) -> None:
        self._reasoning = reasoning
        self._calls = calls

    def split(self, delta: Delta) -> Delta:
        """``delta`` with ``reasoning`` and ``tool_calls`` set (``finish_reason`` "tool_calls" once it made one)."""
        last = delta.finish_reason is not None
        if self._reasoning is not None:
            delta.reasoning, delta.text = self._reasoning.feed(delta.text)
            if last:
                reasoning, answer = self._reasoning.finish()
                delta.reasoning += reasoning
                delta.text += answer
        if self._calls is not None:
            delta.text, calls = self._calls.feed(delta.text)
            delta.tool_calls = calls or None
            if last:
                delta.text += self._calls.finish()
                if delta.finish_reason == "stop" and self._calls.num_complete_calls:
                    delta.finish_reason = "tool_calls"
        return delta


_TAIL_TOKENS = 8  # a prompt's last tokens, whose text shows whether its template opened or closed the reasoning
