"""ClientSettings: where a client's requests run and what they run under, given once.

``AsyncClient``, ``Client`` and the framework adapters take one: their keyword arguments build
it (``ClientSettings.of``), or ``settings=`` gives one whole. Settings that contradict each
other are refused here, where they are given.

    settings = ClientSettings(base_url="http://gpu-box:8000/v1", api_key=KEY, tenant="search")
    client, chat = AsyncClient(settings=settings), PagedChat(settings=settings, temperature=0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sdk.reasoning import check_parser_name

if TYPE_CHECKING:
    from sdk.hooks import Hook
    from sdk.images import ImageLimits
    from sdk.policy import TenantPolicy
    from sdk.runtime import Runtime
    from sdk.transport import Transport


@dataclass(frozen=True, kw_only=True)
class ClientSettings:
    """A client's settings; an in-process engine by default, a remote one with ``base_url``.

    Raises:
        ValueError: ``runtime`` with any of base_url/api_key/engine_config, ``transport`` with any of
            model/base_url/api_key/engine_config, the two together, ``base_url`` with engine_config,
            ``api_key`` without ``base_url``, ``reasoning_parser`` or ``image_limits`` with ``base_url`` or
            ``transport``, or a policy that isolates the cache without a ``tenant``; the message names them.
        InvalidRequestError: an unknown ``reasoning_parser``.
    """

    model: str | None = None
    """HF directory or ``.gguf`` path; None = the bundled SmolLM2-135M-Instruct.
    With ``base_url``: the remote model id; None = the first one the endpoint lists.
    With ``runtime``: the name of one of its chat models (``Runtime.chat_engine``); None = its first."""
    runtime: Runtime | None = None
    """Share this runtime's engine (loaded on first use) instead of loading one."""
    base_url: str | None = None
    """An OpenAI-compatible endpoint (``paged serve``, vLLM ...) to run requests on, through
    ``sdk.http_transport.HttpTransport``; None = in-process."""
    api_key: str | None = field(default=None, repr=False)
    """Sent to ``base_url`` as a bearer token (never shown in the settings' repr)."""
    hooks: Sequence[Hook] = ()
    """Run in order on every request (see ``sdk.hooks``); kept as a tuple."""
    tenant: str | None = None
    """Written to each request's context and audit record, and the engine's fair share: within a
    priority, tenants share the token budget by their policy's weight."""
    policy: TenantPolicy | None = None
    """The tenant's priority cap, weight, ``max_tokens`` cap, rate limits and cache isolation
    (``sdk.policy.TenantPolicy``), enforced on every request; None = none (priorities as asked, weight 1)."""
    transport: Transport | None = None
    """Where requests run; default: ``base_url``'s endpoint, or the engine of ``runtime`` or of the
    client's own runtime for (model, engine_config)."""
    route: str = "client"
    """Names the surface in hook contexts and audit records (adapters set theirs)."""
    max_retries: int = 0
    """Times to retry a request the engine refused as overloaded, or lost to a restart before its
    first output (with backoff)."""
    reasoning_parser: str = "auto"
    """How a thinking model's reasoning is split from its replies' text (``sdk.reasoning``):
    ``"auto"`` (from the chat template), ``"none"``, ``"qwen3"`` or ``"deepseek_r1"``. In-process
    only: a remote server parses with its own."""
    image_limits: ImageLimits | None = None
    """What a request's images may be (``sdk.images.ImageLimits``); None = its defaults. In-process
    only: a remote server has its own."""
    engine_config: Mapping[str, Any] = field(default_factory=dict)
    """``engine.EngineConfig`` fields for the in-process engine."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "hooks", tuple(self.hooks))
        object.__setattr__(self, "engine_config", dict(self.engine_config))
        if self.policy is not None and self.policy.isolate_cache and self.tenant is None:
            raise ValueError("a policy with isolate_cache needs a tenant: the salt is the tenant's")
        check_parser_name(self.reasoning_parser)
        named = {"model": self.model, "base_url": self.base_url, "api_key": self.api_key}
        if self.runtime is not None:
            reason = "the runtime's engine serves the requests"
            # NOTE: model names one of the runtime's chat models here
            _refuse("runtime", {**named, "model": None, "transport": self.transport}, self.engine_config, reason)
            return
        remote = self.transport is not None or self.base_url is not None
        where = "transport" if self.transport is not None else "base_url"
        if self.reasoning_parser != "auto" and remote:
            raise ValueError(f"reasoning_parser and {where} both given: the {where} parses replies with its own")
        if self.image_limits is not None and remote:
            raise ValueError(f"image_limits and {where} both given: the {where} checks images with its own")
        if self.transport is not None:
            _refuse("transport", named, self.engine_config, "the transport fixes where requests run")
        elif self.base_url is None and self.api_key is not None:
            raise ValueError("api_key given without base_url: the in-process engine takes no key")
        elif self.base_url is not None and self.engine_config:
            fields = ", ".join(sorted(self.engine_config))
            raise ValueError(f"base_url and engine fields ({fields}) both given: a remote engine is set up by its server")

    @classmethod
    def of(cls, model: str | None = None, settings: ClientSettings | None = None, **keywords: Any) -> ClientSettings:
        """The settings a constructor was given: ``settings`` whole, or ``model`` and ``keywords``.

        Args:
            model: as the ``model`` field.
            settings: the settings whole.
            **keywords: ``ClientSettings`` fields; the rest are ``engine.EngineConfig`` fields (``engine_config``).

        Raises:
            ValueError: ``settings`` with ``model`` or keywords; as ``ClientSettings`` otherwise.
        """
        if settings is not None:
            given = (["model"] if model is not None else []) + sorted(keywords)
            if given:
                raise ValueError(f"settings and {', '.join(given)} both given: the settings hold them all")
            return settings
        named = {name: keywords.pop(name) for name in KEYWORDS if name in keywords}
        return cls(model=model, engine_config=keywords, **named)


KEYWORDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(ClientSettings)) - {"model", "engine_config"}
"""The keyword arguments a constructor takes as settings fields (besides ``model``); the rest are engine fields."""


def _refuse(setting: str, named: dict[str, Any], engine_config: Mapping[str, Any], reason: str) -> None:
    """Raise ValueError naming the settings given along with ``setting`` (set ``named`` values, engine_config keys)."""
    given = [name for name, value in named.items() if value is not None] + sorted(engine_config)
    if given:
        raise ValueError(f"{setting} and {', '.join(given)} both given: {reason}")
