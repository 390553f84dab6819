"""A tenant's rate quotas as the ``x-ratelimit-*`` headers report them.

``sdk.rate_limit.RateLimiter`` measures them; ``sdk.errors.RateLimited`` carries them to the caller.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Quota:
    """One limit as the ``x-ratelimit-*`` headers report it."""

    limit: int
    remaining: int
    reset: float  # seconds until the bucket is full again


@dataclass(frozen=True, slots=True)
class RateLimitState:
    """The tenant's request and token quotas now; None for a limit the policy does not set."""

    requests: Quota | None
    tokens: Quota | None
