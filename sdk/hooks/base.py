"""The hook interface: ``Hook``, what hooks see of a request (``RequestContext``) and how a chain runs them.

A hook subclasses ``Hook`` and overrides what it needs; the client runs the hooks of a
request in the order given:

- ``on_request(ctx)`` before the request reaches the engine: may rewrite ``ctx.messages`` /
  ``ctx.prompt`` (redact) or raise ``ContentBlocked`` (block). Nothing is allocated yet, and
  images are not decoded yet: a filter reads a message's text (``ChatMessage.text``), and
  ``ctx.images`` (hash and size of each) is filled once the prompt is prepared.
- ``on_chunk(ctx, delta)`` for each output delta before the caller sees it: returning
  ``Stop(reason)`` withholds the delta, aborts the engine request (its blocks are freed)
  and ends the stream with ``finish_reason="content_filter"``.
- ``on_finish(ctx)`` exactly once per request, whatever the outcome (finished, blocked,
  failed, aborted, cancelled); ``ctx`` then holds usage, finish reason, error and timing.

A request the client refuses before its hooks reaches none of them: invalid options, a
priority or ``max_tokens`` past the tenant's policy, a rate limit (``RateLimited``) or a
prompt too long by its characters alone.

A hook that raises in ``on_request`` / ``on_chunk`` fails closed (``HookFailed``) unless its
class sets ``fail_closed = False`` (audit hooks do): then the failure is logged and counted
in ``HookChain.num_failures`` and the request goes on. ``on_finish`` failures are always
logged and counted, never raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from sdk.errors import ContentBlocked, HookFailed
from sdk.images import ImageInfo
from sdk.tools import ToolCall, ToolCallDelta, collect_calls
from sdk.types import ChatMessage, Delta, FinishReason, Usage

if TYPE_CHECKING:
    from sdk.transport import EngineRequest

logger = logging.getLogger(__name__)

RequestKind = Literal["chat", "completion", "embed", "rerank", "score"]
POOLING_KINDS: frozenset[str] = frozenset({"embed", "rerank", "score"})


@dataclass(frozen=True, slots=True)
class Stop:
    """Returned by ``Hook.on_chunk`` to end the stream with ``finish_reason="content_filter"``."""

    reason: str


@dataclass(frozen=True, slots=True)
class FilterDecision:
    """One filter action on a request, as written to the audit log (never the matched text)."""

    hook: str
    stage: Literal["input", "output"]
    action: str  # "block" | "redact" | "stop"
    detail: str = ""


@dataclass(frozen=True, slots=True)
class RequestOrigin:
    """Where a request came from, as a server tells the SDK client (``AsyncClient.chat(..., origin=...)``).

    ``headers`` has lower-case names and never the credentials (``authorization``,
    ``proxy-authorization``, ``cookie``).
    """

    client_address: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """The in-process engine that served a request: what loading the same one again takes."""

    model: str | None  # as the engine was given it; None = the bundled model
    model_dir: Path  # the Hugging Face directory it loaded (a GGUF's conversion)
    settings: Mapping[str, Any]  # the EngineConfig fields that change the numbers (dtype, device, ...)


@dataclass(slots=True)
class RequestContext:
    """What hooks see of one request. Filters may rewrite ``messages`` / ``prompt`` (a pooling request's
    ``inputs`` / ``query``) in ``on_request``."""

    request_id: str
    model: str
    route: str  # who sent it: "client", "langchain", "llamaindex", "http", ...
    kind: RequestKind
    params: dict[str, Any]  # the knobs actually sent (SamplingOptions fields; a pooling request's PoolingParams)
    tenant: str | None = None
    client_address: str | None = None  # the peer's address, over HTTP
    headers: Mapping[str, str] = field(default_factory=dict)  # RequestOrigin.headers: lower-case, no credentials
    messages: list[ChatMessage] | None = None
    prompt: str | list[int] | None = None
    # a pooling request's: what it embeds (texts or token-id lists) or the documents it scores, and the query
    inputs: list[str | list[int]] | None = None
    query: str | list[str] | None = None  # a score request's may be one per input (pairs)
    started_at: float = field(default_factory=time.time)  # wall clock, seconds
    start_monotonic: float = field(default_factory=time.monotonic)
    first_token_monotonic: float | None = None
    end_monotonic: float | None = None
    # per completion (n of them), the text emitted so far in pieces (``output_texts`` joins them)
    output_pieces: list[list[str]] = field(default_factory=lambda: [[]])
    # per completion, a thinking model's reasoning emitted so far in pieces (sdk.reasoning)
    reasoning_pieces: list[list[str]] = field(default_factory=lambda: [[]])
    # per completion, the tool-call deltas emitted so far (``tool_calls`` assembles them)
    tool_call_deltas: list[list[ToolCallDelta]] = field(default_factory=lambda: [[]])
    finish_reason: FinishReason | None = None
    usage: Usage = field(default_factory=Usage)
    error: BaseException | None = None
    decisions: list[FilterDecision] = field(default_factory=list)
    # what re-running the request takes (the audit log's replay part):
    model_source: ModelSource | None = None  # None over a remote transport
    engine_request: EngineRequest | None = None  # as the engine got it; None until the prompt is prepared
    prompt_token_ids: list[int] | None = None  # the engine's prompt ids, once its first output came
    # per completion, the token ids emitted so far (as output_texts)
    output_token_ids: list[list[int]] = field(default_factory=lambda: [[]])
    # the request's images as checked (hash, bytes, width, height, MIME type; never the bytes), once its prompt is prepared
    images: list[ImageInfo] = field(default_factory=list)

    @property
    def is_pooling(self) -> bool:
        """Whether the request embeds or scores (``inputs`` set) rather than generates."""
        return self.kind in POOLING_KINDS

    @property
    def input_field(self) -> str:
        """The request field of ``inputs``, as errors name an item of it (``input.3``, ``documents.1``)."""
        return "input" if self.kind == "embed" else "documents"

    @property
    def output_texts(self) -> list[str]:
        """Per completion (n of them), the text emitted so far; during on_chunk, before the current delta."""
        return ["".join(pieces) for pieces in self.output_pieces]

    @property
    def reasoning_texts(self) -> list[str]:
        """Per completion, the reasoning emitted so far (empty for models without reasoning)."""
        return ["".join(pieces) for pieces in self.reasoning_pieces]

    @property
    def output_text(self) -> str:
        """The first completion's text emitted so far (the only one unless ``n`` was set)."""
        return "".join(self.output_pieces[0])

    @property
    def tool_calls(self) -> list[list[ToolCall]]:
        """Per completion, its complete tool calls so far."""
        return [collect_calls(deltas) for deltas in self.tool_call_deltas]

    @property
    def latency(self) -> float | None:
        """Seconds from arrival to the end, once finished."""
        return None if self.end_monotonic is None else self.end_monotonic - self.start_monotonic

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output delta, if any came."""
        if self.first_token_monotonic is None:
            return None
        return self.first_token_monotonic - self.start_monotonic

    def record(self, hook: str, stage: Literal["input", "output"], action: str, detail: str = "") -> None:
        """Note a filter decision for the audit record."""
        self.decisions.append(FilterDecision(hook, stage, action, detail))


class Hook:
    """Base of every hook: subclass and override the hook points you need (all async).

    Example:
        class NoShouting(Hook):
            async def on_chunk(self, ctx, delta):
                return Stop("shouting") if delta.text.isupper() else None
    """

    fail_closed: ClassVar[bool] = True
    """When the hook raises in on_request / on_chunk, reject the request (True) or log, count and go on."""

    @property
    def name(self) -> str:
        """The hook's name in errors and audit decisions."""
        return type(self).__name__

    async def on_request(self, ctx: RequestContext) -> None:
        """Before admission: inspect or rewrite the input, or raise ``ContentBlocked``."""

    async def on_chunk(self, ctx: RequestContext, delta: Delta) -> Stop | None:
        """For each output delta before the caller sees it; return ``Stop`` to end the stream."""
        return None

    async def on_finish(self, ctx: RequestContext) -> None:
        """Exactly once per request, after its outcome is known (also on errors and aborts)."""


class HookChain:
    """Runs a list of hooks in order with the failure semantics in the module docstring."""

    def __init__(self, hooks: Sequence[Hook] = ()) -> None:
        for hook in hooks:
            if not isinstance(hook, Hook):
                raise TypeError(f"hooks must be sdk.hooks.Hook instances; got {type(hook).__name__}")
        self.hooks = tuple(hooks)
        self.num_failures = 0

    def _failed(self, hook: Hook, stage: str) -> None:
        self.num_failures += 1
        logger.exception("hook %s failed in %s", hook.name, stage)

    async def on_request(self, ctx: RequestContext) -> None:
        """Run every ``on_request``; raises ``ContentBlocked`` or ``HookFailed`` to reject the request."""
        for hook in self.hooks:
            try:
                await hook.on_request(ctx)
            except ContentBlocked as exc:
                exc.hook = exc.hook or hook.name
                ctx.record(exc.hook, "input", "block", exc.reason)
                raise
            except Exception as exc:
                if hook.fail_closed:
                    raise HookFailed(hook.name, "on_request") from exc
                self._failed(hook, "on_request")

    async def on_chunk(self, ctx: RequestContext, delta: Delta) -> Stop | None:
        """Run every ``on_chunk`` until one stops the stream; raises ``HookFailed`` to fail closed."""
        for hook in self.hooks:
            try:
                stop = await hook.on_chunk(ctx, delta)
            except Exception as exc:
                if hook.fail_closed:
                    raise HookFailed(hook.name, "on_chunk") from exc
                self._failed(hook, "on_chunk")
                continue
            if stop is not None:
                ctx.record(hook.name, "output", "stop", stop.reason)
                return stop
        return None

    async def on_finish(self, ctx: RequestContext) -> None:
        """Run every ``on_finish``; never raises (failures are logged and counted)."""
        for hook in self.hooks:
            try:
                await hook.on_finish(ctx)
            except Exception:
                self._failed(hook, "on_finish")
