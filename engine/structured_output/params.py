"""StructuredOutput: a constraint on a completion's text, checked on construction."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import ParameterError

MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema's JSON, a regex or a grammar
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
FORMS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the completion's text must be: exactly one of the forms.

    - ``json_schema``: JSON valid against this schema (a dict, or its JSON text).
    - ``json_object``: any JSON object.
    - ``regex``: a match of this regular expression.
    - ``choice``: exactly one of these strings.
    - ``grammar``: a sentence of this EBNF grammar (GBNF style, start rule ``root``).
    - ``structural_tag``: free text and tagged regions whose content is constrained (a JSON
      schema between a begin and an end string, e.g. tool calls), in xgrammar's structural-tag
      format (a dict, or its JSON text: ``{"type": "structural_tag", "format": {...}}``).

    The engine guarantees the text by masking every token the constraint does not allow;
    a completion cut short by ``max_tokens`` or a stop string ends mid-structure (finish
    reason ``length`` / ``stop``). JSON is written as ``json.dumps`` writes it: ``", "`` and ``": "`` between items, no other whitespace.

    Raises:
        ParameterError: not exactly one form, a value of the wrong type, or past its size
            limit (``MAX_CONSTRAINT_CHARS``, ``MAX_CHOICES``); ``param`` is
            ``structured_output.<form>``.
    """

    json_schema: str | None = None  # its JSON text (a dict is serialised compactly, in its own key order)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None  # its JSON text, as json_schema

    def __post_init__(self) -> None:
        given = [name for name in FORMS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ParameterError(
                "structured_output", f"structured_output takes exactly one of {', '.join(FORMS)}; got {len(given)}"
            )
        if not isinstance(self.json_object, bool):
            raise ParameterError.about("structured_output.json_object", "must be a bool")
        for name in ("json_schema", "structural_tag"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _object_text(f"structured_output.{name}", value))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check_text(f"structured_output.{name}", value)
        if self.choice is not None:
            object.__setattr__(self, "choice", _check_choice(self.choice))

    @property
    def form(self) -> str:
        """Which form this constraint takes."""
        return next(name for name in FORMS if getattr(self, name) not in (None, False))

    @property
    def param(self) -> str:
        """The field an error about this constraint names."""
        return f"structured_output.{self.form}"


def _check_text(param: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ParameterError.about(param, "must be a non-empty str")
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise ParameterError.about(param, f"has {len(value)} characters; the limit is {MAX_CONSTRAINT_CHARS}")


def _object_text(param: str, schema: Any) -> str:
    if isinstance(schema, str):
        _check_text(param, schema)
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ParameterError.about(param, f"is not valid JSON: {exc.msg}") from None
    if not isinstance(schema, dict):
        raise ParameterError.about(param, f"must be a JSON object (a dict); got {type(schema).__name__}")
    try:
        text = json.dumps(schema, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ParameterError.about(param, f"is not JSON-serialisable: {exc}") from None
    _check_text(param, text)
    return text


def _check_choice(choice: Any) -> tuple[str, ...]:
    param = "structured_output.choice"
    if not isinstance(choice, (list, tuple)) or not choice:
        raise ParameterError.about(param, "must be a non-empty list of str")
    if len(choice) > MAX_CHOICES:
        raise ParameterError.about(param, f"holds at most {MAX_CHOICES} strings; got {len(choice)}")
    for c in choice:
        if not isinstance(c, str) or not 1 <= len(c) <= MAX_CHOICE_CHARS:
            raise ParameterError.about(param, f"must hold strs of 1 to {MAX_CHOICE_CHARS} characters")
    return tuple(choice)
