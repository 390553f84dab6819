"""What a request body becomes before the SDK sees it: parsed strictly, checked for the tenant, the SDK's typed request, origin.

Bodies are validated from JSON in pydantic's strict mode (a string is not an integer, nor
``1`` a bool), off the event loop past ``THREAD_PARSE_BYTES``, then turned once into the
SDK's ``ChatRequest`` / ``CompletionRequest`` (one per prompt). The tenant's caps are not
applied here: its SDK client applies them (``sdk.policy.request_terms``).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from integrations.openai_server.errors import bad_request, from_sdk, from_validation, model_not_found
from integrations.openai_server.policy import Tenant
from integrations.openai_server.serving import Serving
from sdk.errors import InvalidRequestError, PagedError
from sdk.fields import invalid_request
from sdk.hooks import RequestOrigin
from sdk.prompt_worker import PROMPT_WORKER
from sdk.response_format import to_response_format
from sdk.types import ChatRequest, CompletionRequest
from sdk.wire import Route, format_from_wire, message_from_wire
from sdk.wire import from_wire as sampling_from_wire

THREAD_PARSE_BYTES = 64 << 10  # bodies past this are parsed off the event loop
COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens on /v1/completions
# NOTE: what hooks never see of a request's headers: its credentials.
_CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})


async def parse_body(request: web.Request, model: type[BaseModel], tenant: Tenant) -> Any:
    """The body as ``model``, types strict (a string is not an integer).

    A large body is parsed on the prompt worker's threads, ``tenant``'s turn among the others:
    parsing holds the GIL for milliseconds, and ten at once on ten threads would hold the
    event loop off for as long as all of them.
    """
    raw = await request.read()  # NOTE: raises 413 past client_max_size
    try:
        if len(raw) > THREAD_PARSE_BYTES:
            return await PROMPT_WORKER.run(tenant.name, functools.partial(model.model_validate_json, raw, strict=True))
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        if first["type"] == "json_invalid":
            raise bad_request(f"request body is not valid JSON: {first['ctx']['error']}") from None
        if not first["loc"]:
            raise bad_request("request body must be a JSON object") from None
        raise from_validation(exc) from None


def check_common(body: Any, serving: Serving, tenant: Tenant) -> None:
    """Refuse fields the server cannot honour (400) and a model that is not served or not the tenant's (404)."""
    if (field := body.unsupported()) is not None:
        raise bad_request(f"{field} is not supported by this server", param=field)
    if body.model is not None and (body.model != serving.model_name or not tenant.may_use_model(body.model)):
        raise model_not_found(body.model, [serving.model_name] if tenant.may_use_model(serving.model_name) else [])


class WireCompletionRequest(CompletionRequest):
    """A request to ``/v1/completions``: without ``max_tokens``, OpenAI's 16 (or the tenant's cap, if smaller)."""

    default_max_tokens: ClassVar[int | None] = COMPLETION_MAX_TOKENS


def sdk_requests(body: Any, route: Route) -> tuple[list[ChatRequest | CompletionRequest], str | None]:
    """The body as the SDK's typed requests (a chat's one, or one per prompt), and the wire field that set its constraint.

    The requests carry its sampling knobs under the engine's names, priority (when set: else
    the tenant's), cache_salt, response_format (any wire spelling) and a chat's messages,
    tools, tool_choice, parallel_tool_calls and chat_template_kwargs.

    Raises:
        ApiError: a 400 for a field the SDK refuses, ``param`` naming the wire field.
    """
    data = body.model_dump()
    fields = sampling_from_wire(route, data)
    if route == "chat" and body.max_completion_tokens is not None:
        fields["max_tokens"] = body.max_completion_tokens
    if body.priority is not None:
        fields["priority"] = body.priority
    fields["cache_salt"] = body.cache_salt
    format_field = None
    try:
        if route == "chat":
            fields["messages"] = [chat_message(i, m.model_dump(exclude_none=True)) for i, m in enumerate(body.messages)]
        fmt, format_field = format_from_wire(data)
        fields["response_format"] = to_response_format(fmt)
        if route == "completion":
            first, *rest = body.prompts()
            request = WireCompletionRequest(prompt=first, **fields)
            return [request, *(request.model_copy(update={"prompt": prompt}) for prompt in rest)], format_field
        chat = {
            "tools": body.tools, "tool_choice": body.tool_choice, "parallel_tool_calls": body.parallel_tool_calls,
            "chat_template_kwargs": body.chat_template_kwargs,
        }  # fmt: skip
        return [ChatRequest(**fields, **chat)], format_field
    except ValidationError as exc:
        raise from_sdk(invalid_request(exc), route, format_field) from None
    except PagedError as exc:
        raise from_sdk(exc, route, format_field) from None


def chat_message(index: int, body: dict[str, Any]) -> Any:
    """Message ``index`` of a chat body as an SDK message; its errors name their path under ``messages``."""
    try:
        return message_from_wire(body)
    except InvalidRequestError as exc:
        raise exc.at(f"messages.{index}" + (f".{exc.param}" if exc.param else "")) from None


def origin(request: web.Request) -> RequestOrigin:
    """The peer's address and the request headers, lower-case and without credentials, for the hooks."""
    headers: dict[str, str] = {}
    for name, value in request.headers.items():
        name = name.lower()
        if name not in _CREDENTIAL_HEADERS:
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return RequestOrigin(request.remote, headers)
