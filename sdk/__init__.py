"""paged SDK: clients over an in-process engine, shared prefixes, hooks and framework adapters.

    from sdk import AsyncClient, Client, ClientSettings, Runtime, TenantPolicy
    from sdk.hooks import Hook, AuditLog, RegexFilter, ContentBlocked
"""

from sdk.client import AsyncClient
from sdk.errors import (
    AuthenticationError,
    ContentBlocked,
    EngineFailure,
    HookFailed,
    InvalidRequestError,
    LengthFinishReasonError,
    NotFoundError,
    OverloadedError,
    PagedError,
    RateLimited,
    RequestJournalled,
    RequestTimeout,
)
from sdk.hooks import Hook, RequestContext, Stop
from sdk.policy import TenantPolicy
from sdk.prefix import PrefixHandle
from sdk.retrieval import Embedding, EmbeddingResult, PoolingUsage, RerankItem, RerankResult, ScoreResult
from sdk.runtime import Runtime
from sdk.settings import ClientSettings
from sdk.sync import Client
from sdk.types import (
    ChatMessage,
    ChatRequest,
    ChatResult,
    CompletionRequest,
    CompletionResult,
    Delta,
    FinishReason,
    RequestLatency,
    Usage,
)

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "ChatMessage",
    "ChatRequest",
    "ChatResult",
    "Client",
    "ClientSettings",
    "CompletionRequest",
    "CompletionResult",
    "ContentBlocked",
    "Delta",
    "Embedding",
    "EmbeddingResult",
    "EngineFailure",
    "FinishReason",
    "Hook",
    "HookFailed",
    "InvalidRequestError",
    "LengthFinishReasonError",
    "NotFoundError",
    "OverloadedError",
    "PagedError",
    "PoolingUsage",
    "PrefixHandle",
    "RateLimited",
    "RequestContext",
    "RequestJournalled",
    "RequestTimeout",
    "RerankItem",
    "RerankResult",
    "Runtime",
    "ScoreResult",
    "Stop",
    "TenantPolicy",
    "RequestLatency",
    "Usage",
]
