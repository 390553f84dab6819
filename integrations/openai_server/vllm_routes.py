"""The routes vLLM serves beside OpenAI's that clients call: ``/tokenize``, ``/detokenize`` and ``/version``, in vLLM's shapes.

``POST /tokenize`` takes a ``prompt`` (``add_special_tokens``, default true) or chat
``messages`` rendered with the model's chat template (``add_generation_prompt``, default true;
``tools``, ``chat_template_kwargs``) and answers ``{"count", "max_model_len", "tokens",
"token_strs"}`` (``token_strs`` with ``return_token_strs``). ``POST /detokenize`` takes
``{"tokens": [...]}`` and answers ``{"prompt": text}``. ``GET /version`` answers
``{"version": ...}``. Tokenizing runs on the prompt worker's threads, the tenant's turn among the others.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from integrations.openai_server.errors import bad_request, from_sdk
from integrations.openai_server.intake import chat_message, check_common, parse_body
from integrations.openai_server.protocol import ChatMessageParam
from integrations.openai_server.state import STATE, TENANT, route_request
from sdk.errors import PagedError
from sdk.prompt_worker import PROMPT_WORKER
from sdk.tools import to_tools


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize`` body: a ``prompt``, or chat ``messages``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    """Default: true for a prompt; a chat template writes its own."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        return "continue_final_message" if self.continue_final_message else None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]

    def unsupported(self) -> str | None:
        return None


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)


async def tokenize(request: web.Request) -> web.Response:
    request.app[STATE].require_serving()
    tenant = request[TENANT]
    body = await parse_body(request, TokenizeRequest, tenant)
    serving = route_request(request, body.model)
    check_common(body, serving, tenant)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give a prompt or messages, not both", param="prompt")
    tokenizer = serving.engine.tokenizer
    try:
        if body.prompt is not None:
            add_special = body.add_special_tokens is not False
            tokens = await PROMPT_WORKER.run(tenant.name, functools.partial(tokenizer.encode, add_special_tokens=add_special), body.prompt)
        else:
            messages = [chat_message(n, m.model_dump(exclude_none=True)) for n, m in enumerate(body.messages or ())]
            render = serving.client(tenant.name, tenant.policy).transport.render_chat
            tokens = await PROMPT_WORKER.run(
                tenant.name, render, messages, body.add_generation_prompt, to_tools(body.tools), body.chat_template_kwargs
            )  # fmt: skip
    except PagedError as exc:
        raise from_sdk(exc, "chat") from None
    out: dict[str, Any] = {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": list(tokens), "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(list(tokens))
    return web.json_response(out)


async def detokenize(request: web.Request) -> web.Response:
    request.app[STATE].require_serving()
    tenant = request[TENANT]
    body = await parse_body(request, DetokenizeRequest, tenant)
    serving = route_request(request, body.model)
    check_common(body, serving, tenant)
    tokenizer = serving.engine.tokenizer
    vocab = len(tokenizer)
    for n, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            raise bad_request(f"tokens.{n}: {token} is not a token id of this model (0 to {vocab - 1})", param=f"tokens.{n}")
    return web.json_response({"prompt": await PROMPT_WORKER.run(tenant.name, tokenizer.decode, body.tokens)})


async def version(request: web.Request) -> web.Response:
    try:
        number = importlib.metadata.version("paged")
    except importlib.metadata.PackageNotFoundError:
        number = "unknown"
    return web.json_response({"version": number})

