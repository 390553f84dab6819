"""The OpenAI wire names of the engine's request fields: the one table both ends of the HTTP API read.

``paged serve`` builds its request models from it and ``sdk.http_transport`` its request
bodies, so a field the OpenAI format renames is renamed here and nowhere else. Fields not
listed keep the engine's name (vLLM's extensions: ``top_k``, ``min_p``, ``ignore_eos`` ...).
"""

from __future__ import annotations

from typing import Any, Literal

from sdk.fields import SAMPLING_FIELDS

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
