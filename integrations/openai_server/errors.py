"""OpenAI-style error bodies, and the mapping from every failure the server sees to one of them."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from aiohttp import web
from pydantic import ValidationError

from integrations.openai_server.protocol import ErrorInfo, ErrorResponse
from sdk.errors import InvalidRequestError, PagedError, RateLimited, error_type
from sdk.fields import invalid_request
from sdk.wire import Route, wire_param

logger = logging.getLogger(__name__)

RETRY_AFTER = "1"  # seconds, on 429 and 503 (a rate limit says its own)


class ApiError(Exception):
    """A failure with an HTTP status and an OpenAI error body; raised by handlers, rendered by middleware."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.request_id = request_id  # in the body only when set: the id of a journalled request

    def body(self) -> ErrorResponse:
        extra = {} if self.request_id is None else {"request_id": self.request_id}
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message,
                type=error_type(self.status),
                param=self.param,
                code=self.code,
                **extra,
            )
        )

    def response(self) -> web.Response:
        return web.json_response(
            self.body().model_dump(), status=self.status, headers=self.headers
        )


def retry_after(seconds: float) -> str:
    """``Retry-After``: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def model_not_found(model: str, served: Sequence[str]) -> ApiError:
    """The 404 for a ``model`` not served to the key: it names the field and the models the key may use."""
    which = ", ".join(repr(name) for name in served) if served else "none"
    message = f"model: {model!r} does not exist or this key may not use it; the models served to this key: {which}"
    return ApiError(404, message, param="model", code="model_not_found")


def from_validation(exc: ValidationError) -> ApiError:
    """The first pydantic error as a 400 naming the offending field (no input values echoed)."""
    error = invalid_request(exc)
    return bad_request(str(error), param=error.param)


def from_sdk(exc: PagedError, route: Route | None, format_field: str | None = None) -> ApiError:
    """The HTTP answer to an SDK error, from its type's status, code and param; never a traceback.

    On a chat or completion ``route`` the field it names takes its wire name
    (``sdk.wire.wire_param``; ``format_field`` is the wire field that set the request's
    constraint), and so does the message of an error about one field; None: the error names
    the wire field already (``sdk.responses``).
    """
    headers = {"Retry-After": RETRY_AFTER} if exc.status_code in (429, 503) else None
    if isinstance(exc, RateLimited):
        headers = {"Retry-After": retry_after(exc.retry_after)}
    param = exc.param if route is None else wire_param(route, exc.param, format_field)
    if isinstance(exc, InvalidRequestError):
        exc = exc.at(param)
    return ApiError(exc.status_code, exc.public_message, param=param, code=exc.code, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Render every failure as an OpenAI error body; never a stack trace."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.reason
        if exc.status == 413:
            message = f"request body too large (limit {request.app._client_max_size} bytes)"
        return ApiError(exc.status, message, code=_http_code(exc.status)).response()
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, "internal server error", code="internal_error").response()


def _http_code(status: int) -> str | None:
    return {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
