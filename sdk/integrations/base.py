"""The base of the framework adapters: the client's settings as fields, the client's lifecycle, and the helpers
every adapter's requests and replies share.

An adapter is ``class PagedX(PagedAdapter, FrameworkBase)`` (``GenerationAdapter`` for one that
generates text: it adds the engine's sampling knobs) with a ``_route`` of its own, which hook
contexts and audit records name; its calls run on ``self.client`` / ``self.aclient`` with
``self._request_options(...)``:

    class PagedEmbeddings(PagedAdapter, Embeddings):
        _route: ClassVar[str] = "langchain-embeddings"

The settings fields are ``ClientSettings``'s (``sdk.settings``), so ``PagedX(base_url=...,
hooks=[...])`` and ``PagedX(settings=ClientSettings(...))`` build the same client (given whole, the
settings' own defaults apply: ``max_retries`` 0); ``timeout`` is the one per-request field every
adapter has.

The client is built eagerly, in ``model_validator(mode="after")``, as LangChain's partner
packages build theirs, for every adapter (LlamaIndex's too): building it is cheap (the engine
loads, or the endpoint is connected, on the first call or ``start()``), so a lazy client would
save nothing, while settings that contradict each other are refused where they are given, not
on a first call far away, and ``close()`` has no unbuilt client to allow for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, create_model, model_validator

from sdk.client import AsyncClient
from sdk.closing import AsyncClosing, Closing
from sdk.cut_off import CutOffWatch
from sdk.fields import REQUEST_KNOBS, SAMPLING_FIELDS, SAMPLING_KNOBS, field, sampling_fields
from sdk.hooks import Hook
from sdk.images import ImageLimits
from sdk.policy import TenantPolicy
from sdk.retrieval import MAX_INPUTS, RerankItem
from sdk.runtime import Runtime
from sdk.settings import ClientSettings
from sdk.sync import Client
from sdk.tools import ToolCall, new_call_id
from sdk.transport import Transport
from sdk.types import CompletionResult, Delta

# ClientSettings fields that are adapter fields of the same name (the route is the adapter's own)
_SETTINGS_FIELDS = tuple(f.name for f in dataclasses.fields(ClientSettings) if f.name != "route")
_ALIASES = {"model_name": "model"}


class PagedAdapter(BaseModel, Closing, AsyncClosing):
    """The settings and the SDK client of an adapter; ``with`` / ``async with`` close it."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True, use_attribute_docstrings=True)

    model: str | None = Field(default=None, alias="model_name")
    """HF model directory or ``.gguf`` path; None = the bundled SmolLM2-135M-Instruct.
    With ``base_url``: the remote model id; None = the first one the endpoint lists."""
    base_url: str | None = None
    """An OpenAI-compatible endpoint (``paged serve``, vLLM) to run on; None = in-process."""
    api_key: SecretStr | None = Field(default=None, exclude=True)
    """Bearer token for ``base_url``; unused in-process (LangChain passes keys to every model)."""
    timeout: float | None = None
    """Seconds before a request is aborted (``RequestTimeout``)."""
    max_retries: int = 2
    """Retries, with backoff, of requests the engine refused as overloaded."""
    reasoning_parser: str = "auto"
    """How a thinking model's reasoning is split from the reply (``sdk.reasoning``); in-process only."""
    hooks: list[Hook] = Field(default_factory=list, exclude=True)
    """SDK hooks (filters, audit) run on every call."""
    tenant: str | None = None
    """Tenant id written to hook contexts and audit records, and the engine's fair share."""
    policy: TenantPolicy | None = Field(default=None, exclude=True)
    """The tenant's priority cap, limits and cache isolation (``sdk.policy.TenantPolicy``); None = none."""
    engine_config: dict[str, Any] = Field(default_factory=dict)
    """``engine.EngineConfig`` fields for the in-process engine (e.g. ``num_blocks``); not with ``base_url``."""
    runtime: Runtime | None = Field(default=None, exclude=True)
    """Share one engine between adapters and clients; None = the adapter owns a runtime of its own."""
    transport: Transport | None = Field(default=None, exclude=True)
    """Where requests run, given whole (``ClientSettings.transport``); None = from the fields above."""
    image_limits: ImageLimits | None = Field(default=None, exclude=True)
    """What a request's images may be (``sdk.images.ImageLimits``); None = its defaults. In-process only."""

    _client: Client = PrivateAttr()
    _route: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _take_settings(cls, data: Any) -> Any:
        """``settings=`` (a ``ClientSettings``) fills the settings fields; given with any of them, it is refused."""
        if not isinstance(data, dict) or "settings" not in data:
            return data
        data = dict(data)
        settings = data.pop("settings")
        if settings is None:
            return data
        given = sorted(name for name in data if _ALIASES.get(name, name) in _SETTINGS_FIELDS)
        if given:
            raise ValueError(f"settings and {', '.join(given)} both given: the settings hold them all")
        return {**data, **{name: getattr(settings, name) for name in _SETTINGS_FIELDS}}

    @model_validator(mode="after")
    def _build_client(self) -> Any:
        # NOTE: the key goes only to a remote engine; in-process, a key (as LangChain's suites pass) is unused.
        api_key = self.api_key.get_secret_value() if self.api_key is not None and self.base_url is not None else None
        named = {name: getattr(self, name) for name in _SETTINGS_FIELDS}
        self._client = Client(settings=ClientSettings(**{**named, "api_key": api_key}, route=self._route))
        return self

    @property
    def client(self) -> Client:
        """The SDK client behind the adapter (in-process: on the engine of ``runtime``, or of its own)."""
        return self._client

    @property
    def aclient(self) -> AsyncClient:
        """The same client's async face (``Client.aclient``), which the adapter's async calls run on."""
        return self._client.aclient

    def start(self) -> None:
        """Load the engine (or connect to ``base_url``) now, so the first call does not wait for it."""
        self._client.start()

    def close(self) -> None:
        """Close the adapter's connections and its own runtime (``Client.close``); a shared ``runtime`` stays open."""
        self._client.close()

    async def aclose(self) -> None:
        """``close()`` from async code (``AsyncClient.aclose``)."""
        await self._client.aclient.aclose()

    def _request_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """A call's request options: the adapter's own, then ``options``; None = unset."""
        return {k: v for k, v in {"timeout": self.timeout, **options}.items() if v is not None}


class PoolingAdapter(PagedAdapter):
    """A ``PagedAdapter`` over a pooling model (an embedder, a reranker): ``model`` names it (an HF directory
    in process; the served id with ``base_url``). Its calls send the pooling options set here."""

    dimensions: int | None = None
    """Keep the first ``dimensions`` of each embedding (models that declare Matryoshka sizes); None = all."""
    normalize: bool | None = None
    """L2-normalize embeddings; None = as the model's files say."""
    truncate_prompt_tokens: int | None = -1
    """Most tokens read of each input: -1 = the model's length (the default); None = no cut (a longer input fails)."""

    def _pooling_options(self, **extra: Any) -> dict[str, Any]:
        options = {"dimensions": self.dimensions, "normalize": self.normalize, **extra}
        return {"truncate_prompt_tokens": self.truncate_prompt_tokens, **{k: v for k, v in options.items() if v is not None}}

    def embed_texts(self, texts: Sequence[str], prompt_name: str | None = None) -> list[list[float]]:
        """Embeddings of ``texts`` in order (none for none), ``MAX_INPUTS`` to a request."""
        options = self._pooling_options(prompt_name=prompt_name)
        return [v for part in _parts(texts) for v in self.client.embed(part, **options).embeddings]

    async def aembed_texts(self, texts: Sequence[str], prompt_name: str | None = None) -> list[list[float]]:
        """The async ``embed_texts``: the requests run together (the engine batches them)."""
        options = self._pooling_options(prompt_name=prompt_name)
        results = await asyncio.gather(*(self.aclient.embed(part, **options) for part in _parts(texts)))
        return [v for result in results for v in result.embeddings]

    def rerank_texts(self, query: str, documents: Sequence[str], top_n: int | None) -> list[RerankItem]:
        """The ``top_n`` documents most relevant to ``query``, best first (none for none)."""
        if not documents:
            return []
        return self.client.rerank(query, list(documents), top_n=top_n, return_documents=False, **self._pooling_options()).results

    async def arerank_texts(self, query: str, documents: Sequence[str], top_n: int | None) -> list[RerankItem]:
        """The async ``rerank_texts``."""
        if not documents:
            return []
        result = await self.aclient.rerank(query, list(documents), top_n=top_n, return_documents=False, **self._pooling_options())
        return result.results


def _parts(texts: Sequence[str]) -> list[list[str]]:
    return [list(texts[i : i + MAX_INPUTS]) for i in range(0, len(texts), MAX_INPUTS)]


# NOTE: a framework's LLM returns one reply per call: n is not a knob of the adapters.
_UNSUPPORTED = {"n"}
KNOBS = tuple(name for name in SAMPLING_FIELDS if name not in _UNSUPPORTED)
"""The sampling knobs the adapters take, as fields and per call."""

# The engine's sampling knobs as adapter fields, with their bounds and help (sdk.fields).
_Knobs = create_model(
    "_Knobs",
    __base__=PagedAdapter,
    __module__=__name__,
    **{
        **sampling_fields(exclude=_UNSUPPORTED),
        "stop": field(SAMPLING_KNOBS["stop"], alias="stop_sequences"),
        "cache_salt": field(REQUEST_KNOBS["cache_salt"]),
    },
)


class GenerationAdapter(_Knobs):  # type: ignore[misc, valid-type]
    """A ``PagedAdapter`` that generates text: the engine's sampling knobs are its fields (None = the engine's default)."""

    def _request_options(self, options: dict[str, Any]) -> dict[str, Any]:
        knobs = {name: getattr(self, name) for name in (*KNOBS, "cache_salt")}
        merged = {**knobs, **options}
        merged["stop"] = merged["stop"] or None
        return super()._request_options(merged)


def watch_of(options: dict[str, Any]) -> CutOffWatch:
    """What tells a reply cut inside a call's constraint (``sdk.cut_off``), from the call's options."""
    return CutOffWatch(options.get("response_format"), options.get("tools"), options.get("tool_choice"))


def watched(stream: Iterator[Delta], watch: CutOffWatch | None) -> Iterator[Delta]:
    """``stream``'s deltas; closing them closes (aborts) the stream.

    Raises:
        LengthFinishReasonError: the reply was cut inside its constraint (``watch``), in place of its last delta.
    """
    try:
        for delta in stream:
            if watch is not None and (cut := watch.add(delta)) is not None:
                raise cut
            yield delta
    finally:
        stream.close()  # type: ignore[attr-defined]


async def awatched(stream: AsyncIterator[Delta], watch: CutOffWatch | None) -> AsyncIterator[Delta]:
    """The async ``watched``."""
    try:
        async for delta in stream:
            if watch is not None and (cut := watch.add(delta)) is not None:
                raise cut
            yield delta
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def finish_info(reply: Delta | CompletionResult) -> dict[str, Any]:
    """A finished reply's ``finish_reason`` and usage (as a dict); empty before the last delta."""
    if reply.finish_reason is None or reply.usage is None:
        return {}
    return {"finish_reason": reply.finish_reason, "usage": dataclasses.asdict(reply.usage)}


def tool_call(call_id: str | None, name: str, arguments: dict[str, Any] | str) -> ToolCall:
    """A framework's tool call as the SDK's; a new id when it has none."""
    return ToolCall(id=call_id or new_call_id(), name=name, arguments=tool_arguments(arguments))


def tool_arguments(arguments: dict[str, Any] | str) -> dict[str, Any]:
    """A tool call's arguments as a dict (a framework may give them as their JSON text)."""
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def named_tool_choice(choice: Any) -> Any:
    """A bare tool name as OpenAI's named choice; ``"auto"``, ``"none"``, ``"required"`` and dicts as they are."""
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        return {"type": "function", "function": {"name": choice}}
    return choice
