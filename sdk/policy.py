"""TenantPolicy: what one tenant may ask of the engine, declared once as knobs.

An ``AsyncClient(tenant=..., policy=...)`` holds every request it sends to its policy, and
``paged serve`` builds one such client per tenant of its policy file, so in process and over
HTTP a tenant meets the same rules:

- ``priority``: the tenant's priority and its cap. A request without one gets it; a request
  may ask for a later one (a larger number), never an earlier one.
- ``weight``: its share of the token budget against the other tenants of its priority level
  (``engine.core.fair_share``).
- ``max_tokens``: the most a request may ask for; also the default when it asks for none.
- ``requests_per_minute``, ``tokens_per_minute``, ``max_concurrent_requests``: rate limits
  (``sdk.rate_limit``); None = no limit.
- ``isolate_cache``: the tenant's prompts are salted with a key no client knows, so its KV
  blocks are never shared with another tenant's (no prefix-cache timing signal between
  tenants); its own requests still share them.

``request_terms`` applies the caps and defaults to a request: the one place they are applied.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from engine.knobs import check_knobs, knob, short
from engine.request_options import MAX_PRIORITY, MAX_WEIGHT
from engine.sampling_params import MAX_TOKENS_LIMIT
from sdk.errors import InvalidRequestError
from sdk.fields import SAMPLING_KNOBS

if TYPE_CHECKING:
    from sdk.types import ChatRequest, CompletionRequest

MAX_RATE = 1 << 40  # requests or tokens per minute
ENGINE_MAX_TOKENS: int = SAMPLING_KNOBS["max_tokens"].default  # a request's max_tokens when nothing sets it

# NOTE: one key per process: a salt derived from it cannot be guessed, so no client can send the
# cache_salt of an isolated tenant and share (or time) its blocks.
_SALT_KEY = secrets.token_bytes(32)


@dataclass(frozen=True)
class TenantPolicy:
    """One tenant's priority cap, fair-share weight, limits and cache isolation (see the module docstring).

    Raises:
        ParameterError: a field of the wrong type or outside its bounds (``param`` names it).
    """

    priority: int = knob(
        0, "The tenant's priority and its cap: requests may ask for a later (larger) one, never an earlier one.",
        ge=-MAX_PRIORITY, le=MAX_PRIORITY,
    )  # fmt: skip
    weight: float = knob(1.0, "Share of the token budget against other tenants of the same priority.", gt=0.0, le=MAX_WEIGHT)
    max_tokens: int | None = knob(
        None, "Most tokens a request may ask for, and the default when it asks for none; None = no cap.",
        ge=1, le=MAX_TOKENS_LIMIT,
    )  # fmt: skip
    requests_per_minute: int | None = knob(None, "Requests admitted per minute (a token bucket); None = no limit.", ge=1, le=MAX_RATE)
    tokens_per_minute: int | None = knob(
        None, "Prompt tokens plus max_tokens admitted per minute, unused tokens given back; None = no limit.",
        ge=1, le=MAX_RATE,
    )  # fmt: skip
    max_concurrent_requests: int | None = knob(None, "Requests in flight at once; None = no limit.", ge=1, le=1 << 30)
    isolate_cache: bool = knob(False, "Salt the tenant's prompts so no other tenant shares its KV blocks.")

    def __post_init__(self) -> None:
        check_knobs(self)

    @property
    def has_limits(self) -> bool:
        """Whether any rate or concurrency limit is set."""
        return any(x is not None for x in (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent_requests))


def isolated_salt(tenant: str, cache_salt: str | None) -> str:
    """The engine cache salt of an isolated tenant's request: keyed on the tenant and the request's own salt."""
    message = json.dumps([tenant, cache_salt]).encode()
    return "tenant-" + hmac.new(_SALT_KEY, message, hashlib.sha256).hexdigest()


class Terms(NamedTuple):
    """What a request runs with, its tenant's policy applied."""

    priority: int
    max_tokens: int | None  # None = the engine's default
    cache_salt: str | None  # the engine's salt
    weight: float


def request_terms(policy: TenantPolicy | None, tenant: str | None, request: ChatRequest | CompletionRequest) -> Terms:
    """The priority, ``max_tokens``, cache salt and fair-share weight of ``request`` under ``policy`` (None = none).

    A request without ``max_tokens`` gets its type's ``default_max_tokens``, and under a cap
    the smaller of that (or the engine's default) and the cap.

    Raises:
        InvalidRequestError: it asked for a priority earlier than the tenant's, or more
            ``max_tokens`` than its cap; ``param`` names the field.
    """
    max_tokens = request.max_tokens
    if policy is None:
        return Terms(request.priority, type(request).default_max_tokens if max_tokens is None else max_tokens, request.cache_salt, 1.0)
    priority = policy.priority
    if "priority" in request.model_fields_set:
        if request.priority < priority:
            raise InvalidRequestError.about(
                "priority", f"this tenant's requests may ask for {priority} or later (larger); got {short(request.priority)}"
            )
        priority = request.priority
    cap = policy.max_tokens
    if max_tokens is None:
        max_tokens = type(request).default_max_tokens
        if cap is not None:
            max_tokens = min(cap, max_tokens or ENGINE_MAX_TOKENS)
    elif cap is not None and max_tokens > cap:
        raise InvalidRequestError.about("max_tokens", f"this tenant's requests may ask for at most {cap}; got {max_tokens}")
    return Terms(priority, max_tokens, engine_salt(policy, tenant, request.cache_salt), policy.weight)


def engine_salt(policy: TenantPolicy | None, tenant: str | None, cache_salt: str | None) -> str | None:
    """The engine cache salt of a request: the tenant's own namespace when its policy isolates the cache."""
    if policy is not None and policy.isolate_cache:
        assert tenant is not None
        return isolated_salt(tenant, cache_salt)
    return cache_salt
