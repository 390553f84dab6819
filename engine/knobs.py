"""Knobs: each setting declared once, with its help and bounds, for every surface to derive from.

A knob is a dataclass field declared with ``knob(default, help, ...)``. The dataclass that
owns it checks every knob with ``check_knobs(self)`` in ``__post_init__``; the SDK's pydantic
types, the server's wire models and the command-line flags read the same declaration through
``knobs_of(cls)``, so a bound or a help text is written in one place.

A knob's kind comes from its type annotation::

    int / int | None            an integer within [ge, le] (or (gt, le])
    float                       a finite number within the bounds
    bool                        True or False
    str | None with choices     one of ``choices``
    str | None                  a str of 1..``max_chars`` characters
    tuple[str, ...]             a str or a list of at most ``max_items`` strings of 1..``max_chars`` characters
    tuple[int, ...]             a list of at most ``max_items`` integers >= ``item_ge``
    str | os.PathLike | None    a path
    SomeConfig | None           a nested frozen dataclass of knobs, given as one or as a dict of its fields
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import os
import types
import typing
from dataclasses import dataclass
from typing import Any

from engine.errors import ParameterError

_METADATA_KEY = "knob"


class Kind(enum.Enum):
    INT = "int"
    FLOAT = "float"
    BOOL = "bool"
    CHOICE = "choice"
    STR = "str"
    STR_LIST = "str_list"
    INT_LIST = "int_list"
    PATH = "path"
    SETTINGS = "settings"


@dataclass(frozen=True, slots=True)
class Knob:
    """One declared setting: its name, kind, default, help and bounds."""

    name: str
    kind: Kind
    default: Any
    help: str
    optional: bool = False  # None is a valid value (it means "derived" or "unset"; the help says which)
    ge: float | None = None  # inclusive lower bound
    gt: float | None = None  # exclusive lower bound
    le: float | None = None  # inclusive upper bound
    choices: tuple[str, ...] = ()
    max_items: int | None = None  # lists: most items
    max_chars: int | None = None  # strs and str lists: most characters per str (at least one)
    item_ge: int | None = None  # int lists: lower bound of each item
    unit: str | None = None  # "bytes": a size; the command line also takes 512MiB, 2G
    settings: type | None = None  # SETTINGS: the nested dataclass

    @property
    def limit(self) -> str:
        """The bounds in words, as error messages and help texts give them."""
        if self.kind is Kind.CHOICE:
            return "one of " + ", ".join(self.choices)
        if self.kind in (Kind.STR_LIST, Kind.INT_LIST):
            return f"at most {self.max_items} items"
        if self.kind is Kind.BOOL:
            return "true or false"
        if self.kind is Kind.PATH:
            return "a path"
        if self.kind is Kind.SETTINGS:
            return "an object with the fields " + ", ".join(f.name for f in dataclasses.fields(self.settings))
        if self.kind is Kind.STR:
            return f"1 to {self.max_chars} characters"
        low = f"({_num(self.gt)}" if self.gt is not None else f"[{_num(self.ge)}"
        return f"in {low}, {_num(self.le)}]"


def knob(
    default: Any,
    help: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    choices: tuple[str, ...] = (),
    max_items: int | None = None,
    max_chars: int | None = None,
    item_ge: int | None = None,
    unit: str | None = None,
) -> Any:
    """A dataclass field declared as a knob (see the module docstring for the kinds)."""
    bounds = dict(
        ge=ge, gt=gt, le=le, choices=choices, max_items=max_items, max_chars=max_chars, item_ge=item_ge, unit=unit
    )
    return dataclasses.field(default=default, metadata={_METADATA_KEY: (help, bounds)})


@functools.cache
def knobs_of(cls: type) -> tuple[Knob, ...]:
    """The knobs a dataclass declares, in field order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        declared = f.metadata.get(_METADATA_KEY)
        if declared is None:
            continue
        help_text, bounds = declared
        kind, optional = _kind(hints[f.name], bool(bounds["choices"]))
        settings = _members(hints[f.name])[0] if kind is Kind.SETTINGS else None
        out.append(Knob(f.name, kind, f.default, help_text, optional, **bounds, settings=settings))
    return tuple(out)


def check_knobs(obj: Any) -> None:
    """Checks (and normalises in place) every knob of a dataclass instance.

    A str for a str list becomes a 1-tuple and lists become tuples. Frozen dataclasses are
    written through ``object.__setattr__``, as their own ``__post_init__`` would.

    Raises:
        ParameterError: naming the first field of the wrong type or outside its bounds, and the bound.
    """
    for k in knobs_of(type(obj)):
        value = getattr(obj, k.name)
        checked = check_value(k, value)
        if checked is not value:
            object.__setattr__(obj, k.name, checked)


def check_value(k: Knob, value: Any) -> Any:
    """``value`` checked against ``k``; returns it normalised (lists as tuples)."""
    if value is None and k.optional:
        return value
    name = k.name
    if k.kind is Kind.INT:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParameterError(name, f"{name} must be an integer; got {type(value).__name__}")
        _check_range(k, value)
    elif k.kind is Kind.FLOAT:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ParameterError(name, f"{name} must be a number; got {type(value).__name__}")
        # NOTE: an int compares exactly, however large; math.isfinite would overflow converting it.
        if isinstance(value, float) and not math.isfinite(value):
            raise ParameterError(name, f"{name} must be finite; got {value}")
        _check_range(k, value)
    elif k.kind is Kind.BOOL:
        if not isinstance(value, bool):
            raise ParameterError(name, f"{name} must be a bool; got {type(value).__name__}")
    elif k.kind is Kind.CHOICE:
        if value not in k.choices:
            raise ParameterError(name, f"{name} must be {k.limit}; got {_short_repr(value)}")
    elif k.kind is Kind.STR:
        if not isinstance(value, str) or not 1 <= len(value) <= (k.max_chars or len(value)):
            raise ParameterError(name, f"{name} must be a str of {k.limit}")
    elif k.kind is Kind.STR_LIST:
        return _check_str_list(k, value)
    elif k.kind is Kind.INT_LIST:
        return _check_int_list(k, value)
    elif k.kind is Kind.SETTINGS:
        return _check_settings(k, value)
    elif k.kind is Kind.PATH:
        if not isinstance(value, (str, os.PathLike)):
            raise ParameterError(name, f"{name} must be a path{' or None' if k.optional else ''}; got {type(value).__name__}")
    return value


def short(value: int | float) -> str:
    """A number for an error message: huge ints are not spelled out (nor echoed back to a client)."""
    return str(value) if not isinstance(value, int) or abs(value) < 10**30 else "a number out of range"


def _check_range(k: Knob, value: int | float) -> None:
    low_ok = (k.ge is None or value >= k.ge) and (k.gt is None or value > k.gt)
    if not (low_ok and (k.le is None or value <= k.le)):
        raise ParameterError(k.name, f"{k.name} must be {k.limit}; got {short(value)}")


def _check_str_list(k: Knob, value: Any) -> tuple[str, ...]:
    name = k.name
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (tuple, list)):
        raise ParameterError(name, f"{name} must be a str or a list of str; got {type(value).__name__}")
    if k.max_items is not None and len(value) > k.max_items:
        raise ParameterError(name, f"{name} holds at most {k.max_items} strings; got {len(value)}")
    for s in value:
        if not isinstance(s, str):
            raise ParameterError(name, f"{name} must hold only str; got {type(s).__name__}")
        if not 1 <= len(s) <= (k.max_chars or len(s)):
            raise ParameterError(name, f"{name} strings must have 1 to {k.max_chars} characters each; got {len(s)}")
    return tuple(value)


def _check_int_list(k: Knob, value: Any) -> tuple[int, ...]:
    name = k.name
    if not isinstance(value, (tuple, list)):
        raise ParameterError(name, f"{name} must be a list of int; got {type(value).__name__}")
    if k.max_items is not None and len(value) > k.max_items:
        raise ParameterError(name, f"{name} holds at most {k.max_items} ids; got {len(value)}")
    for i in value:
        if isinstance(i, bool) or not isinstance(i, int) or (k.item_ge is not None and i < k.item_ge):
            raise ParameterError(name, f"{name} must hold integers >= {k.item_ge}; got {_short_repr(i)}")
    return tuple(value)


def _check_settings(k: Knob, value: Any) -> Any:
    """A nested settings dataclass: an instance passes; a dict of its fields builds one (which checks itself)."""
    cls = k.settings
    assert cls is not None
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ParameterError(k.name, f"{k.name} must be {k.limit}; got {type(value).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(str(key) for key in value if key not in names)
    if unknown:
        raise ParameterError(
            k.name, f"{k.name} has no field {_short_repr(unknown[0])}; its fields are {', '.join(names)}"
        )
    return cls(**value)


def _members(hint: Any) -> list[Any]:
    """The non-None members of a union annotation, or ``[hint]``."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else ()
    return [a for a in args if a is not type(None)] or [hint]


def _kind(hint: Any, has_choices: bool) -> tuple[Kind, bool]:
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else ()
    members = _members(hint)
    optional = type(None) in args
    if os.PathLike in members or any(typing.get_origin(m) is os.PathLike for m in members):
        return Kind.PATH, optional
    (base,) = members
    if typing.get_origin(base) is tuple:
        item = typing.get_args(base)[0]
        return (Kind.STR_LIST if item is str else Kind.INT_LIST), optional
    if base is str:
        return (Kind.CHOICE if has_choices else Kind.STR), optional
    if dataclasses.is_dataclass(base):
        return Kind.SETTINGS, optional
    kinds = {int: Kind.INT, float: Kind.FLOAT, bool: Kind.BOOL}
    if base not in kinds:
        raise TypeError(f"no knob kind for the annotation {hint!r}")
    return kinds[base], optional


def _num(x: float | None) -> str:
    if x is None:
        return "inf"
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else str(x)


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."
