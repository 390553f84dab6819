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
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass

from engine.knobs import check_knobs, knob
from engine.request_options import MAX_PRIORITY, MAX_WEIGHT
from engine.sampling_params import MAX_TOKENS_LIMIT

MAX_RATE = 1 << 40  # requests or tokens per minute

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
