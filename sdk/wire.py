"""The OpenAI wire names of the engine's request fields: the one table both ends of the HTTP API read.

``paged serve`` builds its request models from it and ``sdk.http_transport`` its request
bodies, so a field the OpenAI format renames is renamed here and nowhere else. Fields not
listed keep the engine's name (vLLM's extensions: ``top_k``, ``min_p``, ``ignore_eos`` ...).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ValidationError

from sdk.errors import InvalidRequestError
from sdk.fields import CONSTRAINT_FIELDS, SAMPLING_FIELDS, invalid_request
from sdk.tools import ToolCallDelta
from sdk.types import ChatMessage

Route = Literal["chat", "completion"]

# route -> {engine name: wire name}
WIRE_NAMES: dict[Route, dict[str, str]] = {
    # chat's ``logprobs`` is a flag; the number of candidates is ``top_logprobs``
    "chat": {"logprobs": "top_logprobs"},
    "completion": {},
}


def to_wire(route: Route, sampling: dict[str, Any]) -> dict[str, Any]:
    """Engine sampling keyword arguments as the fields of an OpenAI request body."""
    names = WIRE_NAMES[route]
    body = {names.get(name, name): value for name, value in sampling.items() if value is not None}
    if route == "chat" and "top_logprobs" in body:
        body["logprobs"] = True
    return body


def from_wire(route: Route, body: dict[str, Any]) -> dict[str, Any]:
    """The engine sampling fields set in a request body's (wire-named) values; unset ones are left out.

    Chat's ``top_logprobs`` counts only when its ``logprobs`` flag is set (and means 0 without it).
    """
    names = WIRE_NAMES[route]
    sampling = {engine: body.get(names.get(engine, engine)) for engine in SAMPLING_FIELDS}
    if route == "chat":
        sampling["logprobs"] = (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    return {name: value for name, value in sampling.items() if value is not None}


# vLLM's spellings of the constraints OpenAI's response_format lacks: the ``structured_outputs``
# object and its older top-level ``guided_*`` fields; key -> the SDK format type.
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice", "grammar": "grammar"}
GUIDED_FIELDS = {f"guided_{key}": key for key in ("json", "regex", "choice", "grammar")}
# structured_outputs keys vLLM clients send that change nothing here: there is one backend, no
# fallback, and JSON is always written as json.dumps writes it. Any other key is refused.
STRUCTURED_OUTPUTS_IGNORED = ("backend", "disable_fallback", "disable_any_whitespace")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")  # OpenAI's


def format_to_wire(response_format: Any) -> dict[str, Any]:
    """A ``sdk.response_format`` format as request body fields: ``response_format`` for OpenAI's
    JSON forms, vLLM's ``structured_outputs`` for regex, choice and grammar."""
    if response_format is None:
        return {}
    body = response_format.model_dump(mode="json", by_alias=True, exclude_none=True)
    kind = body.pop("type")
    if kind in ("text", "json_object", "json_schema"):
        return {"response_format": {"type": kind, **body}}
    return {"structured_outputs": body}


def format_from_wire(body: dict[str, Any]) -> tuple[Any, str | None]:
    """The constraint a request body sets, in any of the spellings above, and the field that set it.

    Returns:
        ``(format, field)``: an SDK format spelling (``sdk.response_format.to_response_format``
        takes it) and the body field it came from, or ``(None, None)``.

    Raises:
        InvalidRequestError: more than one field sets a constraint, ``structured_outputs`` sets
            more than one or a key it does not know, or ``response_format`` is not one of
            OpenAI's types; ``param`` names the field.
    """

    found: list[tuple[str, Any]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in RESPONSE_FORMAT_TYPES:
            raise InvalidRequestError(
                f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}", param="response_format.type"
            )
        if response_format["type"] != "text":
            found.append(("response_format", response_format))
    structured = body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise InvalidRequestError("structured_outputs must be an object", param="structured_outputs")
        for key in structured:
            if key not in STRUCTURED_OUTPUTS_KEYS and key not in STRUCTURED_OUTPUTS_IGNORED:
                raise InvalidRequestError(f"structured_outputs.{key} is not supported", param=f"structured_outputs.{key}")
        given = {k: v for k, v in structured.items() if k in STRUCTURED_OUTPUTS_KEYS and v not in (None, False)}
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured_outputs takes exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}; got {len(given)}",
                param="structured_outputs",
            )
        (key, value), = given.items()
        found.append((f"structured_outputs.{key}", _format_of(STRUCTURED_OUTPUTS_KEYS[key], value)))
    for name, key in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((name, _format_of(STRUCTURED_OUTPUTS_KEYS[key], body[name])))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequestError(f"one constraint per request; got {names}", param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


def _format_of(kind: str, value: Any) -> Any:
    if kind == "json_schema":  # a bare schema (a dict or its JSON text): to_response_format wraps it
        return value
    if kind == "json_object":
        return {"type": "json_object"}
    return {"type": kind, kind: value}


def wire_param(route: Route, param: str | None, format_field: str | None = None) -> str | None:
    """The wire name of the field an SDK error names (``param``, a dotted path): the one place they are renamed.

    A chat's ``prompt`` is its ``messages``; a sampling knob takes its wire name (``WIRE_NAMES``).
    ``format_field`` is ``format_from_wire``'s second value: under a ``response_format`` field
    the SDK's paths are the wire's; under the vLLM fields, the path below the constraint
    follows the field (``guided_choice.2``), and an error about the whole constraint (it does
    not compile, or is past a limit) names the field.
    """
    if param is None:
        return None
    if route == "chat" and param == "prompt":
        return "messages"  # a chat's prompt is its rendered messages
    if format_field is None or param.split(".")[0] != "response_format":
        return WIRE_NAMES[route].get(param, param)
    if format_field == "response_format":
        return param
    path = CONSTRAINT_FIELDS[STRUCTURED_OUTPUTS_KEYS[format_field.removeprefix("structured_outputs.").removeprefix("guided_")]]
    if param.startswith(path + "."):
        return format_field + param[len(path) :]
    return format_field


def message_to_wire(message: Any) -> dict[str, Any]:
    """An SDK ``ChatMessage`` as an OpenAI chat message (a call's arguments as JSON text)."""
    content = message.content
    if isinstance(content, list):
        content = [part.model_dump(exclude_none=True) for part in content]
    body: dict[str, Any] = {"role": message.role, "content": content}
    if message.name is not None:
        body["name"] = message.name
    if message.tool_calls:
        body["tool_calls"] = [tool_call_to_wire(c) for c in message.tool_calls]
    if message.tool_call_id is not None:
        body["tool_call_id"] = message.tool_call_id
    return body


def message_from_wire(body: dict[str, Any]) -> Any:
    """An OpenAI chat message as an SDK ``ChatMessage``: the reverse of ``message_to_wire``.

    ``developer`` is ``system``, text-only content parts are joined (as a string), text and
    ``image_url`` parts are kept in order, and a call's arguments are parsed from their JSON text.

    Raises:
        InvalidRequestError: not a message the SDK can take; ``param`` is the path inside the
            message (``content.N``, ``tool_call_id``, ``tool_calls.M.function.arguments`` ...).
    """
    content = body.get("content")
    if isinstance(content, list):
        content = _content_parts(content)
    calls = []
    for m, raw in enumerate(body.get("tool_calls") or ()):
        function = raw.get("function") or {}
        where = f"tool_calls.{m}.function.arguments"
        try:
            arguments = json.loads(function.get("arguments") or "")
        except (json.JSONDecodeError, TypeError):
            raise InvalidRequestError.about(where, "not valid JSON") from None
        if not isinstance(arguments, dict):
            raise InvalidRequestError.about(where, "must be a JSON object")
        calls.append({"id": raw.get("id"), "name": function.get("name"), "arguments": arguments})
    role = "system" if body.get("role") == "developer" else body.get("role")
    try:
        return ChatMessage(
            role=role, content=content, name=body.get("name"), tool_calls=calls or None, tool_call_id=body.get("tool_call_id")
        )
    except ValidationError as exc:
        raise invalid_request(exc) from None


IMAGE_DETAILS = ("auto", "low", "high")  # OpenAI's image_url.detail values


def _content_parts(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's wire content parts: their text joined when all are text, else text and image parts.

    Raises:
        InvalidRequestError: a part of another type, or without its text / image URL (``content.N``).
    """
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" and isinstance((part.get("image_url") or {}).get("url"), str):
            image_url = {k: v for k, v in part["image_url"].items() if k in ("url", "detail") and v is not None}
            if image_url.get("detail", "auto") not in IMAGE_DETAILS:
                raise InvalidRequestError.about(f"content.{j}.image_url.detail", f"must be one of {', '.join(IMAGE_DETAILS)}")
            out.append({"type": "image_url", "image_url": image_url})
        elif kind in ("text", "image_url"):
            raise InvalidRequestError.about(f"content.{j}", f"a {kind} part needs its {'text' if kind == 'text' else 'image_url.url'}")
        else:
            raise InvalidRequestError.about(f"content.{j}", f"{kind} parts are not supported; text and image_url are")
    if all(part["type"] == "text" for part in out):
        return "".join(part["text"] for part in out)
    return out


def tool_call_to_wire(call: Any) -> dict[str, Any]:
    """An ``sdk.tools.ToolCall`` as an OpenAI tool call (its arguments as JSON text)."""
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def tool_call_delta_to_wire(delta: Any) -> dict[str, Any]:
    """An ``sdk.tools.ToolCallDelta`` as an entry of OpenAI's streamed ``delta.tool_calls``: a call's
    first entry has its id, type and name, the later ones only an arguments fragment."""
    if delta.id is None and delta.name is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    function = {"name": delta.name, "arguments": delta.arguments}
    return {"index": delta.index, "id": delta.id, "type": "function", "function": function}


def tool_call_delta_from_wire(raw: dict[str, Any]) -> Any:
    """One entry of a streamed OpenAI ``delta.tool_calls`` as an ``sdk.tools.ToolCallDelta``."""

    function = raw.get("function") or {}
    return ToolCallDelta(
        index=int(raw.get("index") or 0), id=raw.get("id"), name=function.get("name"), arguments=function.get("arguments") or ""
    )
