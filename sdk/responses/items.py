"""Input items: checked (errors name their path under ``input``), and turned into the chat the model sees.

A request's ``input`` is a user message's text or a list of items:

- ``message``: ``{"role": "user" | "system" | "developer" | "assistant", "content": text or parts}``
  (``type`` may be left out); parts are ``input_text`` / ``output_text`` / ``refusal`` text, and
  ``input_image`` with an ``image_url`` (a data URL, or a URL the server allows);
- ``function_call``: ``{"call_id", "name", "arguments"}`` (a call the assistant made, arguments as JSON text);
- ``function_call_output``: ``{"call_id", "output"}``, answering a call made earlier in the
  conversation (in this input, or in the responses it continues);
- ``reasoning``: a reasoning item of an earlier response; kept in the conversation, not shown to
  the model again (chat templates drop earlier turns' thinking).

A response's conversation is every item it continues, then its own input, then its output:
``Conversation`` renders it as ``ChatMessage``s (``developer`` is ``system``, an assistant's text
and the calls after it are one assistant message, each output a tool message) after the
request's ``instructions``, and remembers which field each message came from so an error about
a message names the item.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from sdk.errors import InvalidRequestError
from sdk.fields import invalid_request
from sdk.responses.types import new_id
from sdk.tools import ToolCall
from sdk.types import ChatMessage, ImagePart, ImageUrl, TextPart

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "refusal")
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def check_input(value: str | list[dict[str, Any]], known_calls: set[str]) -> list[dict[str, Any]]:
    """A request's ``input`` as checked items, each with its ``type`` and an ``id``.

    Args:
        value: a user message's text, or items.
        known_calls: the call ids of the conversation so far; a ``function_call_output`` must
            answer one of them or a call earlier in ``value``.

    Raises:
        InvalidRequestError: ``param`` names the item's field (``input.2.call_id``, ``input.0.type`` ...).
    """
    if isinstance(value, str):
        return [{"type": "message", "id": new_id("msg"), "role": "user", "content": value}]
    if not value:
        raise InvalidRequestError.about("input", "give a text or at least one item")
    calls = set(known_calls)
    items = []
    for n, raw in enumerate(value):
        item = _check_item(raw, f"input.{n}", calls)
        if item["type"] == "function_call":
            calls.add(item["call_id"])
        items.append(item)
    return items


def call_ids(items: Sequence[dict[str, Any]]) -> set[str]:
    """The call ids of the ``function_call`` items among ``items``."""
    return {item["call_id"] for item in items if item.get("type") == "function_call"}


def _check_item(raw: dict[str, Any], where: str, calls: set[str]) -> dict[str, Any]:
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind not in ITEM_TYPES:
        raise InvalidRequestError.about(
            f"{where}.type", f"unknown item type {kind!r}; {', '.join(ITEM_TYPES)} items are supported"
        )
    item = {**raw, "type": kind}
    item.setdefault("id", new_id(_ID_PREFIXES[kind]))
    if not isinstance(item["id"], str):
        raise InvalidRequestError.about(f"{where}.id", "must be a string")
    if kind == "message":
        if item.get("role") not in ROLES:
            raise InvalidRequestError.about(f"{where}.role", f"must be one of {', '.join(ROLES)}")
        _content(item.get("content"), f"{where}.content")
    elif kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            _string(item, name, where)
        _arguments(item["arguments"], f"{where}.arguments")
    elif kind == "function_call_output":
        _string(item, "call_id", where)
        if item["call_id"] not in calls:
            raise InvalidRequestError.about(
                f"{where}.call_id", f"{item['call_id']!r} answers no function_call of this conversation"
            )
        _output_text(item.get("output"), f"{where}.output")
    return item


def _string(item: dict[str, Any], name: str, where: str) -> None:
    if not isinstance(item.get(name), str) or not item[name]:
        raise InvalidRequestError.about(f"{where}.{name}", "a non-empty string is required")


def _arguments(text: str, where: str) -> dict[str, Any]:
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError:
        raise InvalidRequestError.about(where, "not valid JSON") from None
    if not isinstance(arguments, dict):
        raise InvalidRequestError.about(where, "must be a JSON object")
    return arguments


def _content(content: Any, where: str) -> str | list[TextPart | ImagePart]:
    """A message item's content as a ``ChatMessage``'s: its text, or its text and image parts in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise InvalidRequestError.about(where, "a string or a non-empty list of content parts")
    parts: list[TextPart | ImagePart] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise InvalidRequestError.about(f"{where}.{j}", f"an {kind} part needs its text")
            parts.append(TextPart(text=text))
        elif kind == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise InvalidRequestError.about(f"{where}.{j}.image_url", "an image_url (a data URL or an allowed URL) is required; file_id is not supported")
            detail = part.get("detail")
            if detail not in (None, "auto", "low", "high"):
                raise InvalidRequestError.about(f"{where}.{j}.detail", "must be one of auto, low, high")
            parts.append(ImagePart(image_url=ImageUrl(url=part["image_url"], detail=detail)))
        else:
            raise InvalidRequestError.about(
                f"{where}.{j}.type", f"{kind!r} parts are not supported; {', '.join(TEXT_PARTS)} and input_image are"
            )
    if all(isinstance(part, TextPart) for part in parts):
        return "".join(part.text for part in parts)  # type: ignore[union-attr]
    return parts


def _output_text(output: Any, where: str) -> str:
    """A ``function_call_output``'s output: a string, or text parts joined."""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS for p in output):
        return "".join(str(p.get("text") or "") for p in output)
    raise InvalidRequestError.about(where, "a string or a list of input_text parts")


@dataclass
class Conversation:
    """The chat a response's model sees: ``instructions`` then every item of the conversation.

    ``sources[i]`` is the field message ``i`` came from (``instructions``, ``input.3``, or
    ``previous_response_id`` for the items of the responses it continues).
    """

    instructions: str | None
    items: list[dict[str, Any]]  # the conversation so far, then this request's input
    first_new: int  # index in ``items`` of this request's first input item
    messages: list[ChatMessage] = field(init=False)
    sources: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.messages, self.sources = [], []
        builder: dict[str, Any] | None = None  # the assistant message being gathered: {"content", "calls", "source"}
        if self.instructions:
            self._add(ChatMessage(role="system", content=self.instructions), "instructions")
        for n, item in enumerate(self.items):
            source = f"input.{n - self.first_new}" if n >= self.first_new else "previous_response_id"
            kind = item["type"]
            if kind == "reasoning":
                continue
            # NOTE: an assistant message begins a new assistant turn; the calls after it join it
            if builder is not None and kind != "function_call":
                self._add_assistant(builder)
                builder = None
            if kind == "message" and item["role"] != "assistant":
                role = "system" if item["role"] == "developer" else item["role"]
                self._add(_message(role=role, content=_content(item["content"], source + ".content")), source)
            elif kind == "function_call_output":
                output = _output_text(item["output"], source + ".output")
                self._add(_message(role="tool", content=output, tool_call_id=item["call_id"]), source)
            else:
                builder = builder or {"content": None, "calls": [], "source": source}
                if kind == "message":
                    builder["content"] = _content(item["content"], source + ".content")
                else:
                    arguments = _arguments(item["arguments"], source + ".arguments")
                    builder["calls"].append(ToolCall(id=item["call_id"], name=item["name"], arguments=arguments))
        if builder is not None:
            self._add_assistant(builder)

    def _add(self, message: ChatMessage, source: str) -> None:
        self.messages.append(message)
        self.sources.append(source)

    def _add_assistant(self, builder: dict[str, Any]) -> None:
        content = builder["content"]
        if content is None and not builder["calls"]:
            content = ""
        self._add(_message(role="assistant", content=content, tool_calls=builder["calls"] or None), builder["source"])

    @property
    def new_items(self) -> list[dict[str, Any]]:
        """This request's input items."""
        return self.items[self.first_new :]

    def dropping(self, num_items: int) -> Conversation:
        """This conversation without its first ``num_items`` items (``truncation: auto``)."""
        return Conversation(self.instructions, self.items[num_items:], max(self.first_new - num_items, 0))

    def wire_param(self, param: str | None) -> str | None:
        """The request field an SDK error's ``param`` names: ``messages.N...`` is the item message N came
        from, a chat's prompt is the ``input``."""
        if param is None:
            return None
        if param in ("messages", "prompt"):
            return "input"
        head, _, rest = param.partition(".")
        if head != "messages":
            return param
        index, _, below = rest.partition(".")
        if not index.isdigit() or int(index) >= len(self.sources):
            return "input"
        source = self.sources[int(index)]
        return f"{source}.{below}" if below and source.startswith("input.") else source


def _message(**fields: Any) -> ChatMessage:
    try:
        return ChatMessage(**fields)
    except ValidationError as exc:
        raise invalid_request(exc) from None
