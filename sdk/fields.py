"""Pydantic fields derived from the engine's knob declarations.

The SDK's request types, the server's wire models and the framework adapters take their
sampling fields (and ``priority`` / ``cache_salt``) from here, so each bound and help text is
the one declared in ``engine.SamplingParams`` / ``engine.request_options.RequestOptions``.
Types are strict, as the engine's own checks are: an int field takes no bool, float or str.
The SDK's errors about these fields come from here too: a pydantic error (``invalid_request``)
or an engine ``ParameterError`` (``from_engine``), each naming the field as the SDK does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, StringConstraints, ValidationError
from pydantic.fields import FieldInfo

from engine.errors import ParameterError
from engine.knobs import Kind, Knob, knobs_of
from engine.request_options import RequestOptions
from engine.sampling_params import SamplingParams
from sdk.errors import InvalidRequestError

SAMPLING_KNOBS: dict[str, Knob] = {k.name: k for k in knobs_of(SamplingParams)}
REQUEST_KNOBS: dict[str, Knob] = {k.name: k for k in knobs_of(RequestOptions)}
SAMPLING_FIELDS: tuple[str, ...] = tuple(SAMPLING_KNOBS)


def annotation(k: Knob) -> Any:
    """The pydantic type of a knob's values, carrying its bounds (None not included)."""
    if k.kind is Kind.INT:
        return Annotated[int, Field(strict=True, ge=k.ge, gt=k.gt, le=k.le)]
    if k.kind is Kind.FLOAT:
        return Annotated[float, Field(strict=True, ge=k.ge, gt=k.gt, le=k.le, allow_inf_nan=False)]
    if k.kind is Kind.BOOL:
        return Annotated[bool, Field(strict=True)]
    if k.kind is Kind.CHOICE:
        return Literal[k.choices]  # type: ignore[valid-type]
    if k.kind is Kind.STR:
        return Annotated[str, StringConstraints(strict=True, min_length=1, max_length=k.max_chars)]
    if k.kind is Kind.STR_LIST:  # a str stands for a list of one, as in the engine
        item = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=k.max_chars)]
        return Annotated[list[item], BeforeValidator(_listed), Field(max_length=k.max_items)]  # type: ignore[valid-type]
    if k.kind is Kind.INT_LIST:
        item = Annotated[int, Field(strict=True, ge=k.item_ge)]
        return Annotated[list[item], Field(max_length=k.max_items)]  # type: ignore[valid-type]
    return str


def _listed(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def field(k: Knob, *, default: Any = None, **extra: Any) -> tuple[Any, FieldInfo]:
    """``(type, FieldInfo)`` for ``pydantic.create_model``: the knob's bounds and help, None allowed."""
    return annotation(k) | None, Field(default=default, description=k.help, **extra)


def sampling_fields(
    exclude: Iterable[str] = (), renames: Mapping[str, str] | None = None
) -> dict[str, tuple[Any, FieldInfo]]:
    """Every sampling knob as an optional field (None = the engine's default), in declaration order.

    Args:
        exclude: engine names to leave out.
        renames: engine name -> the name a wire format uses for it.
    """
    renames = renames or {}
    skip = set(exclude)
    return {renames.get(name, name): field(k) for name, k in SAMPLING_KNOBS.items() if name not in skip}


def invalid_request(exc: ValidationError) -> InvalidRequestError:
    """A pydantic validation error as ``InvalidRequestError`` naming the first field at fault (no input echoed)."""
    first = exc.errors(include_url=False, include_input=False)[0]
    loc: list[str] = []
    for part in first["loc"]:
        if isinstance(part, str) and not part.isidentifier():
            break  # a union member's tag (``constrained-str``, ``list[...]``), not a field
        loc.append(str(part))
    param = ".".join(loc)
    return InvalidRequestError.about(param, first["msg"]) if param else InvalidRequestError(first["msg"])


# where each engine constraint form lies in an SDK request (SDK errors about a constraint name these)
CONSTRAINT_FIELDS = {
    "json_schema": "response_format.json_schema.schema", "json_object": "response_format", "regex": "response_format.regex",
    "choice": "response_format.choice", "grammar": "response_format.grammar", "structural_tag": "tools",
}  # fmt: skip


def from_engine(exc: ParameterError) -> InvalidRequestError:
    """An engine ``ParameterError`` as the SDK's error, its field under the SDK's name.

    The engine's ``structured_output.<form>`` is the request field that set the constraint
    (``CONSTRAINT_FIELDS``); other fields keep their names.
    """
    param = exc.param
    if param == "structured_output" or param.startswith("structured_output."):
        param = CONSTRAINT_FIELDS.get(param.removeprefix("structured_output."), "response_format")
    return InvalidRequestError(str(exc), param=exc.param, reason=exc.reason).at(param)
