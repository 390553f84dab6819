"""Typed errors raised by the SDK; each carries the HTTP status and OpenAI error type a server maps it to."""

from __future__ import annotations


class PagedError(Exception):
    """Base of every error the SDK raises on the request path."""

    status_code: int = 500
    error_type: str = "server_error"


class InvalidRequestError(PagedError, ValueError):
    """The request can never be served as asked: bad parameters, prompt too long, unknown option."""

    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(PagedError):
    """A remote endpoint refused the API key (HTTP 401)."""

    status_code = 401
    error_type = "authentication_error"


class ContentBlocked(PagedError):
    """An input filter blocked the request before it reached the engine.

    Attributes:
        reason: why, in words safe to show the caller (never the matched text).
        hook: the name of the hook that blocked.
    """

    status_code = 400
    error_type = "content_filter"

    def __init__(self, reason: str, *, hook: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.hook = hook


class HookFailed(PagedError):
    """A filter hook raised; the request fails closed. The original exception is ``__cause__``."""

    def __init__(self, hook: str, stage: str) -> None:
        super().__init__(f"hook {hook!r} failed in {stage}; request rejected")
        self.hook = hook
        self.stage = stage


class OverloadedError(PagedError):
    """The engine's admission queue is full; retry later."""

    status_code = 429
    error_type = "rate_limit_error"


class RequestTimeout(PagedError, TimeoutError):
    """The request did not finish within its timeout; it was aborted and its blocks freed."""

    status_code = 408
    error_type = "timeout"


class EngineFailure(PagedError):
    """The engine failed while serving the request (a fault in a step, or the engine is gone)."""
