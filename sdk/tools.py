"""Tools: specs, tool choice, the decoding constraint of a choice, and typed tool calls.

A tool is given as an OpenAI function spec (``{"type": "function", "function": {...}}`` or the
bare ``{"name", "description", "parameters"}``), a pydantic model class (its fields are the
arguments, its docstring the description) or a Python callable with type hints and a
docstring. Each becomes a ``ToolSpec``.

Calls are written in the Hermes format, which Qwen's and Hermes' chat templates teach and the
default tool prompt (``sdk.tool_prompt``) asks for::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_constraint`` turns a tool choice into an engine constraint over that format:
``required`` and a named tool allow nothing but calls whose name is one of the tools' and
whose arguments are valid against its schema; ``auto`` leaves text free and constrains a
call from its first ``<tool_call>`` on; ``none`` constrains nothing.
"""

from __future__ import annotations

import inspect
import json
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal, Union, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model

from engine.errors import ParameterError
from engine.structured_output import StructuredOutput, json_grammar
from sdk.errors import InvalidRequestError
from sdk.fields import CONSTRAINT_FIELDS, from_engine
from sdk.response_format import tag_format

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
MAX_TOOLS = 128


class FunctionSpec(BaseModel):
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None
    """Accepted for OpenAI compatibility: constrained calls always follow the schema."""


class ToolSpec(BaseModel):
    """A tool in OpenAI's shape: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"] = "function"
    function: FunctionSpec

    @property
    def name(self) -> str:
        return self.function.name


class ToolCall(BaseModel):
    """A call the model made: its id (for the tool result's ``tool_call_id``), the tool and its arguments."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(default_factory=lambda: new_call_id())
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCallDelta(BaseModel):
    """New output of call ``index`` of a streamed reply: its id and name on its first delta,
    then fragments of its arguments' JSON text (their concatenation is the arguments)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class NamedToolChoice(BaseModel):
    """OpenAI's ``{"type": "function", "function": {"name": ...}}``: call this tool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    class _Name(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        name: str

    type: Literal["function"] = "function"
    function: _Name


ToolChoice = Union[Literal["auto", "none", "required"], NamedToolChoice]
_TOOL_ADAPTER: TypeAdapter[ToolSpec] = TypeAdapter(ToolSpec)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def to_tool(tool: Any) -> ToolSpec:
    """Any accepted tool spelling (module docstring) as a ``ToolSpec``.

    Raises:
        InvalidRequestError: not a tool spelling, or a malformed spec; ``param`` is ``tools``.
    """
    if isinstance(tool, ToolSpec):
        return tool
    if isinstance(tool, type) and issubclass(tool, BaseModel):
        return _spec(tool.__name__, inspect.getdoc(tool), tool.model_json_schema())
    if isinstance(tool, dict):
        if "function" not in tool and "name" in tool:
            tool = {"type": "function", "function": tool}
        try:
            return _TOOL_ADAPTER.validate_python(tool)
        except ValidationError as exc:
            first = exc.errors(include_url=False, include_input=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InvalidRequestError(f"tools: {where}: {first['msg']}", param="tools") from None
    if callable(tool):
        return _spec(tool.__name__, _summary(inspect.getdoc(tool)), _signature_schema(tool))
    raise InvalidRequestError(
        f"tools takes OpenAI function specs, pydantic classes or callables; got {type(tool).__name__}", param="tools"
    )


def to_tools(tools: Sequence[Any] | None) -> list[ToolSpec] | None:
    """``to_tool`` over a list, names unique and at most ``MAX_TOOLS``; None or empty stays None."""
    if not tools:
        return None
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools holds at most {MAX_TOOLS} tools; got {len(tools)}", param="tools")
    specs = [to_tool(t) for t in tools]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: names must be unique", param="tools")
    return specs


def _spec(name: str, description: str | None, parameters: dict[str, Any]) -> ToolSpec:
    try:
        return ToolSpec(function=FunctionSpec(name=name, description=description or None, parameters=parameters))
    except ValidationError as exc:
        raise InvalidRequestError(f"tools: {exc.errors()[0]['msg']} ({name!r})", param="tools") from None


def _summary(doc: str | None) -> str | None:
    """A docstring's text up to its first section header (``Args:``, ``Returns:`` ...)."""
    if not doc:
        return None
    lines = []
    for line in doc.splitlines():
        if re.match(r"^(Args|Arguments|Parameters|Returns|Raises|Yields|Example|Examples):\s*$", line.strip()):
            break
        lines.append(line)
    return "\n".join(lines).strip() or None


def _signature_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of a callable's parameters, from its type hints and ``Args:`` docstring section."""
    hints = get_type_hints(fn)
    described = _arg_descriptions(inspect.getdoc(fn) or "")
    fields: dict[str, Any] = {}
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        default = ... if param.default is param.empty else param.default
        fields[name] = (hints.get(name, Any), Field(default=default, description=described.get(name)))
    schema = create_model(fn.__name__, **fields).model_json_schema()
    schema.pop("title", None)
    return schema


def _arg_descriptions(doc: str) -> dict[str, str]:
    out: dict[str, str] = {}
    in_args = False
    for line in doc.splitlines():
        if re.match(r"^(Args|Arguments|Parameters):\s*$", line.strip()):
            in_args = True
            continue
        if in_args:
            match = re.match(r"^\s+(\w+)(?:\s*\([^)]*\))?:\s*(.+)$", line)
            if match:
                out[match.group(1)] = match.group(2).strip()
            elif line.strip() and not line.startswith((" ", "\t")):
                break
    return out


def to_tool_choice(choice: Any, tools: Sequence[ToolSpec] | None) -> str | None:
    """The tool choice as ``"auto"``, ``"none"``, ``"required"`` or a tool's name; None without tools.

    Raises:
        InvalidRequestError: an unknown choice, a named tool not among ``tools``, or a choice
            other than ``none`` without tools; ``param`` is ``tool_choice``.
    """
    if isinstance(choice, dict):
        try:
            choice = NamedToolChoice.model_validate(choice)
        except ValidationError:
            raise InvalidRequestError(
                'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            ) from None
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    if choice is None:
        return "auto"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.name for t in tools}:
            raise InvalidRequestError(f"tool_choice names {choice.function.name!r}, which is not among tools", param="tool_choice")
        return choice.function.name
    if choice not in ("auto", "none", "required"):
        raise InvalidRequestError(f'tool_choice must be "auto", "none", "required" or a named tool; got {choice!r}', param="tool_choice")
    return choice


def tool_constraint(
    tools: Sequence[ToolSpec], choice: str, parallel_tool_calls: bool = True, answer: StructuredOutput | None = None
) -> StructuredOutput | None:
    """The engine constraint of a normalized tool ``choice`` (``to_tool_choice``) over ``tools``.

    ``answer`` is the constraint on the reply's text (its response format), None = free text.
    Under ``"none"`` the reply is that text; under ``"auto"`` it is calls or, with an ``answer``,
    either calls alone or that text alone; a forced choice leaves no text to constrain.

    Raises:
        InvalidRequestError: a tool's parameters are not a usable JSON schema (``param`` is
            ``tools``), or ``answer`` is not (``response_format.json_schema.schema``).
    """
    if choice == "none":
        return answer
    answer_format = None
    if answer is not None and choice == "auto":
        try:
            answer_format = tag_format(answer)
        except ParameterError as exc:
            raise from_engine(exc).at(CONSTRAINT_FIELDS[answer.form]) from None
    try:
        return _tool_constraint(tools, choice, parallel_tool_calls, answer_format)
    except ParameterError as exc:
        raise InvalidRequestError(str(exc).replace(exc.param, "tools"), param="tools") from None


def _tool_constraint(
    tools: Sequence[ToolSpec], choice: str, parallel_tool_calls: bool, answer: dict[str, Any] | None
) -> StructuredOutput:
    if choice == "auto" and answer is None:
        fmt: dict[str, Any] = {
            "type": "triggered_tags", "triggers": [CALL_BEGIN], "tags": [_call_tag(t) for t in tools],
            "stop_after_first": not parallel_tool_calls,
        }  # fmt: skip
    else:
        chosen = tools if choice in ("auto", "required") else [t for t in tools if t.name == choice]
        fmt = {
            # NOTE: no separator: after a call only another call or the end may follow (a "\n" would
            # leave only another call, and a small model would repeat its call until max_tokens)
            "type": "tags_with_separator", "tags": [_call_tag(t) for t in chosen], "separator": "",
            "at_least_one": True, "stop_after_first": choice not in ("auto", "required") or not parallel_tool_calls,
        }  # fmt: skip
        if answer is not None:
            fmt = {"type": "or", "elements": [fmt, answer]}
    return StructuredOutput(structural_tag={"type": "structural_tag", "format": fmt})


def _call_tag(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": _call_head(tool.name),
        # NOTE: arguments as json.dumps writes them, so format_call re-renders a call token for token
        "content": {"type": "grammar", "grammar": json_grammar(json.dumps(tool.function.parameters))},
        "end": _CALL_TAIL,
    }


def _call_head(name: str) -> str:
    return f'{CALL_BEGIN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


_CALL_TAIL = f"}}\n{CALL_END}"


def format_call(call: ToolCall) -> str:
    """A call as the model writes it under ``tool_constraint`` (assistant turns in a history)."""
    return _call_head(call.name) + json.dumps(call.arguments, ensure_ascii=False) + _CALL_TAIL


class ToolCallParser:
    """Splits one completion's streamed text into text and ``ToolCallDelta``s.

    ``feed`` takes each new piece of text and returns ``(text, tool call deltas)`` ready to
    send; text that could still turn out to begin a call is held back until it cannot, and
    ``finish`` returns what is held back at the end. A call's id and name come first, once the
    name is complete, then its arguments as fragments of their JSON text.
    """

    _HEAD = re.compile(re.escape(CALL_BEGIN) + r'\s*\{\s*"name"\s*:\s*"([^"]+)"\s*,\s*"arguments"\s*:\s*', re.S)

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        self._names = {t.name for t in tools}
        self._buffer = ""  # text not yet sent: a possible call's beginning, or the call in progress
        self._num_calls = 0  # calls opened so far; the open one is the last
        self.num_complete_calls = 0
        """Calls whose end marker has been read."""
        self._num_sent: int | None = None  # characters of the open call's arguments sent; None = no call open

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buffer += text
        out_text: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._num_sent is None:
                start = self._buffer.find(CALL_BEGIN)
                if start < 0:
                    keep = len(self._buffer) - partial_suffix(self._buffer, CALL_BEGIN)
                    out_text.append(self._buffer[:keep])
                    self._buffer = self._buffer[keep:]
                    break
                out_text.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
                head = self._HEAD.match(self._buffer)
                if head is None or head.group(1) not in self._names:
                    break  # the head is incomplete (or names no tool: text, at finish)
                deltas.append(ToolCallDelta(index=self._num_calls, id=new_call_id(), name=head.group(1)))
                self._num_calls += 1
                self._num_sent = 0
                self._buffer = self._buffer[head.end() :]
            close = self._buffer.find(CALL_END)
            # NOTE: the envelope's "}" closes the call: a "}" followed only by whitespace or the
            # beginning of the end marker is held back until the marker shows whose it is.
            arguments = self._buffer[:close].rstrip()[:-1] if close >= 0 else self._buffer[: _tail_start(self._buffer)]
            if len(arguments) > self._num_sent:
                deltas.append(ToolCallDelta(index=self._num_calls - 1, arguments=arguments[self._num_sent :]))
                self._num_sent = len(arguments)
            if close < 0:
                break
            self._buffer = self._buffer[close + len(CALL_END) :]
            self._num_sent = None
            self.num_complete_calls += 1
        return "".join(out_text), deltas

    def finish(self) -> str:
        """The text held back at the end, when it is text: a partial ``<tool_call>`` marker. A call
        cut short is no text and no call: under a tool constraint, ``<tool_call>`` starts a call.
        One still open was streamed as deltas; its arguments do not parse, so ``collect_calls``
        leaves it out."""
        rest = "" if self._num_sent is not None or self._buffer.startswith(CALL_BEGIN) else self._buffer
        self._buffer, self._num_sent = "", None
        return rest


def collect_calls(deltas: Sequence[ToolCallDelta]) -> list[ToolCall]:
    """The complete calls of one completion's streamed deltas; a call whose arguments do not
    parse (cut short) is left out."""
    parts: dict[int, list[Any]] = {}
    for d in deltas:
        part = parts.setdefault(d.index, [d.id, d.name, []])
        part[0] = part[0] or d.id
        part[1] = part[1] or d.name
        part[2].append(d.arguments)
    calls = []
    for _, (call_id, name, fragments) in sorted(parts.items()):
        try:
            arguments = json.loads("".join(fragments))
        except json.JSONDecodeError:
            continue
        if name and isinstance(arguments, dict):
            calls.append(ToolCall(id=call_id or new_call_id(), name=name, arguments=arguments))
    return calls


def _tail_start(text: str) -> int:
    """Where the envelope's closing ``}`` may start in a call's text so far (its length if nowhere)."""
    i = text.rfind("}")
    return i if i >= 0 and CALL_END.startswith(text[i + 1 :].lstrip()) else len(text)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
