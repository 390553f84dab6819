"""ResponseFormat: what a reply's text must be, as the SDK, the adapters and the wire spell it.

``response_format`` on a chat or completion request takes any of:

- a pydantic model class: JSON valid against its schema; the result's ``parsed`` is an instance;
- a JSON schema dict (``{"type": "object", "properties": ...}``);
- OpenAI's forms: ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``,
  ``{"type": "json_object"}``, ``{"type": "text"}`` (no constraint);
- this SDK's forms for the rest of the engine's constraints: ``{"type": "regex", "regex": ...}``,
  ``{"type": "choice", "choice": [...]}``, ``{"type": "grammar", "grammar": ...}`` (GBNF-style
  EBNF, start rule ``root``).

Each becomes the engine's ``StructuredOutput``, which guarantees the text by masking every
token it forbids. Errors about a constraint name ``response_format``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError

from engine.errors import ParameterError
from engine.structured_output import StructuredOutput, json_grammar
from sdk.errors import InvalidRequestError
from sdk.fields import from_engine

PARAM = "response_format"
TYPES = ("text", "json_object", "json_schema", "regex", "choice", "grammar")


class JsonSchemaSpec(BaseModel):
    """OpenAI's ``json_schema`` object: a named schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(default="response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    """The JSON schema; empty = any JSON value."""
    strict: bool | None = None
    """Accepted for OpenAI compatibility; the output always follows the schema."""


class _Format(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextFormat(_Format):
    """No constraint."""

    type: Literal["text"] = "text"


class JsonObjectFormat(_Format):
    """Any JSON object."""

    type: Literal["json_object"] = "json_object"


class JsonSchemaFormat(_Format):
    """JSON valid against ``json_schema.schema``."""

    type: Literal["json_schema"] = "json_schema"
    json_schema: JsonSchemaSpec
    _model: type[BaseModel] | None = PrivateAttr(default=None)  # the class it came from: replies parse into it


class RegexFormat(_Format):
    """A full match of ``regex``."""

    type: Literal["regex"] = "regex"
    regex: str = Field(min_length=1)


class ChoiceFormat(_Format):
    """Exactly one of ``choice``."""

    type: Literal["choice"] = "choice"
    choice: list[str] = Field(min_length=1)


class GrammarFormat(_Format):
    """A sentence of ``grammar`` (GBNF-style EBNF, start rule ``root``)."""

    type: Literal["grammar"] = "grammar"
    grammar: str = Field(min_length=1)


ResponseFormat = Annotated[
    Union[TextFormat, JsonObjectFormat, JsonSchemaFormat, RegexFormat, ChoiceFormat, GrammarFormat],
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(ResponseFormat)


def _is_model_class(value: Any) -> bool:
    """Whether ``value`` is a pydantic model class (a format whose replies are parsed into it)."""
    return isinstance(value, type) and issubclass(value, BaseModel)


def to_response_format(value: Any) -> Any:
    """Any accepted spelling (module docstring) as a ``ResponseFormat`` model; None stays None.

    Raises:
        InvalidRequestError: not a spelling this module accepts; ``param`` is ``response_format``.
    """
    if value is None or isinstance(value, _Format):
        return value
    if _is_model_class(value):
        fmt = JsonSchemaFormat(json_schema=JsonSchemaSpec(name=value.__name__, schema=value.model_json_schema()))
        fmt._model = value
        return fmt
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise InvalidRequestError(f"{PARAM} is not valid JSON", param=PARAM) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(
            f"{PARAM} must be a pydantic model class, a JSON schema or a format dict; got {type(value).__name__}",
            param=PARAM,
        )
    if value.get("type") not in TYPES:  # a bare JSON schema ("type": "object", or none at all)
        value = {"type": "json_schema", "json_schema": {"name": value.get("title") or "response", "schema": value}}
    try:
        return _ADAPTER.validate_python(value)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"][1:])  # loc[0] is the union member's tag
        raise InvalidRequestError.about(f"{PARAM}.{where}" if where else PARAM, first["msg"]) from None


def to_structured_output(response_format: Any) -> StructuredOutput | None:
    """The engine constraint of a ``ResponseFormat``; None for text (or None).

    Raises:
        InvalidRequestError: the constraint is past an engine limit; ``param`` is ``response_format``.
    """
    if response_format is None or isinstance(response_format, TextFormat):
        return None
    try:
        if isinstance(response_format, JsonObjectFormat):
            return StructuredOutput(json_object=True)
        if isinstance(response_format, JsonSchemaFormat):
            return StructuredOutput(json_schema=response_format.json_schema.schema_)
        if isinstance(response_format, RegexFormat):
            return StructuredOutput(regex=response_format.regex)
        if isinstance(response_format, ChoiceFormat):
            return StructuredOutput(choice=tuple(response_format.choice))
        return StructuredOutput(grammar=response_format.grammar)
    except ParameterError as exc:
        raise from_engine(exc).at(PARAM) from None  # NOTE: a limit of the whole constraint


def tag_format(constraint: StructuredOutput) -> dict[str, Any]:
    """An engine constraint as an element of a structural tag's format (to combine it with others);
    JSON is written as ``json.dumps`` writes it, as the constraint alone would be."""
    if constraint.json_schema is not None:
        return {"type": "grammar", "grammar": json_grammar(constraint.json_schema)}
    if constraint.json_object:
        return {"type": "grammar", "grammar": json_grammar('{"type":"object"}')}
    if constraint.regex is not None:
        return {"type": "regex", "pattern": constraint.regex}
    if constraint.choice is not None:
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in constraint.choice]}
    if constraint.structural_tag is not None:
        return json.loads(constraint.structural_tag)["format"]
    return {"type": "grammar", "grammar": constraint.grammar}


def parse(response_format: Any, text: str) -> Any:
    """``text`` decoded under a JSON format: an instance of its pydantic class, else the JSON value.

    None for other formats, and for text that does not decode (a reply cut short by
    ``max_tokens`` or a stop string ends mid-structure).
    """
    if not isinstance(response_format, (JsonSchemaFormat, JsonObjectFormat)):
        return None
    try:
        value = json.loads(text)
        model = response_format._model if isinstance(response_format, JsonSchemaFormat) else None
        return value if model is None else model.model_validate(value)
    except (json.JSONDecodeError, ValidationError):
        return None

