"""Typed errors raised by the SDK, and the one table that maps them to HTTP statuses and OpenAI error bodies.

Every error carries its HTTP status, the OpenAI error ``code`` a server sends for it and,
for bad input, the offending ``param``: the server renders them from these attributes, and
``from_wire`` turns a server's error body back into the same class on the client side.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sdk.quota import RateLimitState

# NOTE: the one status -> OpenAI error type table, for the SDK's errors and the server's own.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


def error_type(status: int) -> str:
    """The OpenAI error ``type`` of an HTTP status."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


class PagedError(Exception):
    """Base of every error the SDK raises on the request path.

    Attributes:
        param: the request field at fault, when one is (``temperature``, ``messages``, ...).
    """

    status_code: ClassVar[int] = 500
    code: ClassVar[str | None] = None  # the OpenAI error code a server sends for it

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    @property
    def error_type(self) -> str:
        return error_type(self.status_code)

    @property
    def public_message(self) -> str:
        """What a server tells the client (never a traceback or the engine's internals)."""
        return str(self)


class InvalidRequestError(PagedError, ValueError):
    """The request can never be served as asked: bad parameters, prompt too long, unknown option.

    Attributes:
        reason: the message after the field's name (``message == param + reason``), when it
            begins with it; ``at()`` says the same of another name for the field. None otherwise.
    """

    status_code = 400

    def __init__(self, message: str, *, param: str | None = None, reason: str | None = None) -> None:
        super().__init__(message, param=param)
        self.reason = reason

    @classmethod
    def about(cls, param: str, reason: str) -> InvalidRequestError:
        """The error ``f"{param}: {reason}"`` about the field ``param`` (a dotted path), its parts kept."""
        return cls(f"{param}: {reason}", param=param, reason=f": {reason}")

    def at(self, param: str | None) -> InvalidRequestError:
        """This error about the same field under the name ``param`` (a wire name, a path inside a list).

        The message names ``param`` when it named the field (``reason`` is known); else it is kept.
        """
        if param == self.param:
            return self
        message = str(self) if self.reason is None or param is None else param + self.reason
        return InvalidRequestError(message, param=param, reason=None if param is None else self.reason)


class AuthenticationError(PagedError):
    """A remote endpoint refused the API key (HTTP 401)."""

    status_code = 401
    code = "invalid_api_key"


class NotFoundError(PagedError):
    """What the request names is not there for the caller: an unknown, expired or deleted stored
    response, or another tenant's (HTTP 404; ``param`` names the field that named it)."""

    status_code = 404
    code = "not_found"


class ContentBlocked(PagedError):
    """An input filter blocked the request before it reached the engine.

    Attributes:
        reason: why, in words safe to show the caller (never the matched text).
        hook: the name of the hook that blocked.
        param: the input it blocked where the request has several (a pooling request's ``input.3``,
            ``documents.1``, ``query``); the reason begins with it. None for a chat or completion.
    """

    status_code = 400
    code = "content_filter"

    def __init__(self, reason: str, *, hook: str | None = None, param: str | None = None) -> None:
        super().__init__(reason, param=param)
        self.reason = reason
        self.hook = hook

    def at(self, param: str) -> ContentBlocked:
        """This error about the same input under the name ``param`` (a route's name for the field)."""
        reason = self.reason
        if self.param is not None and reason.startswith(self.param):
            reason = param + reason[len(self.param) :]
        return ContentBlocked(reason, hook=self.hook, param=param)

    @property
    def public_message(self) -> str:
        return f"blocked by a content filter: {self.reason}"


class HookFailed(PagedError):
    """A filter hook raised; the request fails closed. The original exception is ``__cause__``."""

    code = "hook_failed"

    def __init__(self, hook: str, stage: str) -> None:
        super().__init__(f"hook {hook!r} failed in {stage}; request rejected")
        self.hook = hook
        self.stage = stage


class OverloadedError(PagedError):
    """The engine's admission queue is full; retry later."""

    status_code = 429
    code = "overloaded"


class RateLimited(OverloadedError):
    """The tenant's rate limit is spent (``sdk.rate_limit``); retry after ``retry_after`` seconds.

    Attributes:
        retry_after: seconds until the request could be admitted (a guess for concurrency).
        state: the tenant's quotas when it was refused (the server's ``x-ratelimit-*`` headers).
    """

    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float, state: RateLimitState | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.state = state


class RequestTimeout(PagedError, TimeoutError):
    """The request did not finish within its timeout; it was aborted and its blocks freed."""

    status_code = 408
    code = "timeout"


class LengthFinishReasonError(PagedError):
    """A reply held to a constraint reached its token limit before the constraint closed.

    The constraint is a ``response_format`` or a tool call (``sdk.cut_off``): such a reply
    yields no parsed object and no half call. ``raise_for_cut_off()`` and the adapters raise
    it; it is named after the error the openai client raises for the same reply over HTTP.

    Attributes:
        text: the reply's text when it was cut (the partial JSON; empty for a cut tool call).
        max_tokens: the tokens the reply had: the limit it reached.
        request_id: the request's id.
    """

    code = "length"

    def __init__(self, text: str, *, max_tokens: int, request_id: str) -> None:
        super().__init__(
            f"request {request_id}: the reply reached its limit of {max_tokens} tokens inside its constraint "
            "(response_format or tool call); raise max_tokens"
        )
        self.text = text
        self.max_tokens = max_tokens
        self.request_id = request_id


class EngineFailure(PagedError):
    """The engine failed while serving the request (a fault in a step, or the engine is gone)."""

    code = "engine_error"

    @property
    def public_message(self) -> str:
        return "the engine failed to serve the request"


class EngineRestarting(EngineFailure):
    """The engine's driver died and a fresh engine is starting; the request did not run to its end.

    Retryable: ``AsyncClient(max_retries=...)`` retries it when nothing was streamed to the
    caller yet; a server answers it with 503 and ``Retry-After``.

    Attributes:
        retry_after: seconds until the fresh engine is expected to serve.
    """

    status_code = 503
    code = "engine_restarting"

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    @property
    def public_message(self) -> str:
        return "the engine is restarting after a failure: retry the request"


class RequestJournalled(EngineFailure):
    """The server shut down before the request finished and wrote it to its journal (``paged serve --drain-journal``).

    A server restarted on the same ``kv_cache_dir`` finishes it; ``AsyncClient.retrieve(request_id)``
    fetches the whole result once it serves again. A client with ``max_retries`` does that itself and
    its stream goes on (``sdk.reattach``): it raises this only without retries, or when the result
    cannot continue what the stream gave.

    Attributes:
        request_id: the server's id of the request (the ``id`` of its chunks).
        retry_after: seconds to wait before asking for it.
    """

    status_code = 503
    code = "request_journalled"

    def __init__(self, message: str, *, request_id: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.retry_after = retry_after

    @property
    def public_message(self) -> str:
        return str(self)


_BY_STATUS: dict[int, type[PagedError]] = {
    cls.status_code: cls for cls in (AuthenticationError, RequestTimeout, OverloadedError)
}


def from_wire(status: int, error: dict[str, Any], retry_after: float | None = None) -> PagedError:
    """The SDK error for a server's OpenAI error body (``{"message", "type", "param", "code"}``).

    ``retry_after`` is the answer's ``Retry-After`` in seconds, when it had one: a rate limit or a
    restart carries it on (1 s without one).
    """
    message = str(error.get("message") or f"HTTP {status}")
    param = error.get("param") if isinstance(error.get("param"), str) else None
    wait = 1.0 if retry_after is None else retry_after
    if error.get("code") == ContentBlocked.code:
        return ContentBlocked(message, param=param)
    if error.get("code") == EngineRestarting.code:  # NOTE: also an error event after a stream started (HTTP 200)
        return EngineRestarting(message, retry_after=wait)
    if error.get("code") == RequestJournalled.code and isinstance(error.get("request_id"), str):
        return RequestJournalled(message, request_id=error["request_id"], retry_after=wait)
    if error.get("code") == RateLimited.code:
        return RateLimited(message, retry_after=wait)
    if status in _BY_STATUS:
        return _BY_STATUS[status](message)
    if status == NotFoundError.status_code:
        return NotFoundError(message, param=param)
    if 400 <= status < 500:
        return InvalidRequestError(message, param=param)
    return EngineFailure(f"HTTP {status}: {message}")
