"""What a request body becomes before the SDK sees it: parsed strictly, checked for the tenant, SDK options and origin.

Bodies are validated from JSON in pydantic's strict mode (a string is not an integer, nor
``1`` a bool), off the event loop past ``THREAD_PARSE_BYTES``.
"""

from __future__ import annotations

import functools
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from integrations.openai_server.errors import ApiError, bad_request, from_sdk, from_validation
from integrations.openai_server.policy import Tenant
from integrations.openai_server.serving import Serving
from sdk.errors import PagedError
from sdk.hooks import RequestOrigin
from sdk.prompt_worker import PROMPT_WORKER
from sdk.response_format import to_response_format
from sdk.wire import Route, format_from_wire
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
        raise ApiError(
            404, f"the model {body.model!r} does not exist or this key may not use it", param="model",
            code="model_not_found",
        )  # fmt: skip


def sdk_options(body: Any, route: Route, tenant: Tenant) -> tuple[dict[str, Any], str | None]:
    """The SDK request options a body sets, and the wire field that set its constraint (None without one).

    The options are its sampling knobs under the engine's names, priority (when set: else the
    tenant's), cache_salt, response_format (any wire spelling, as an SDK format) and a chat's
    tools, tool_choice and parallel_tool_calls (the SDK validates them). A completion that sets
    no ``max_tokens`` gets OpenAI's 16, or the tenant's cap if smaller.

    Raises:
        ApiError: a 400 for a constraint the SDK refuses, ``param`` naming the wire field.
    """
    data = body.model_dump()
    options = sampling_from_wire(route, data)
    if route == "chat" and body.max_completion_tokens is not None:
        options["max_tokens"] = body.max_completion_tokens
    if route == "completion" and body.max_tokens is None:
        options["max_tokens"] = min(COMPLETION_MAX_TOKENS, tenant.policy.max_tokens or COMPLETION_MAX_TOKENS)
    if body.priority is not None:
        options["priority"] = body.priority
    options["cache_salt"] = body.cache_salt
    if route == "chat":
        options.update(tools=body.tools, tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls)
    field = None
    try:
        fmt, field = format_from_wire(data)
        options["response_format"] = to_response_format(fmt)
    except PagedError as exc:
        raise from_sdk(exc, route, field) from None
    return options, field


def origin(request: web.Request) -> RequestOrigin:
    """The peer's address and the request headers, lower-case and without credentials, for the hooks."""
    headers: dict[str, str] = {}
    for name, value in request.headers.items():
        name = name.lower()
        if name not in _CREDENTIAL_HEADERS:
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return RequestOrigin(request.remote, headers)
