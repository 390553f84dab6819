"""Command-line flags generated from ``EngineConfig``: one ``--field-name`` per field.

``RestartPolicy`` (how a driver that died is restarted, ``engine.supervisor``) gets its flags
the same way, each named for restarts: ``--max-restarts``, ``--restart-window-s``,
``--restart-backoff-s``, ``--restart-max-backoff-s``; so does ``paged serve``'s
``ResponsesConfig`` (``sdk.responses``), each named for responses: ``--responses-store-max-bytes``,
``--responses-store-max-age-s``, ``--responses-pin-ttl-s``, ``--responses-pin-max-fraction``.

``paged serve`` and ``paged bench`` take their engine flags from here, so a flag's type,
choices, default and help are those of the knob (``engine/config.py``) and never drift from
the dataclass. Every flag's help is the knob's help followed by ``(default: X)``, X being the
dataclass default as Python prints it (``None`` where the help says what None means).

Values are checked by ``EngineConfig`` itself: ``engine_config(args)`` raises ``FlagError``
naming the flag (``--block-size must be in [1, 1024]; got 0``), which ``paged`` reports as a
usage error (exit status 2) before anything loads.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.errors import ParameterError
from engine.knobs import Kind, Knob, knobs_of
from engine.supervisor import RestartPolicy
from sdk.responses.config import ResponsesConfig

T = TypeVar("T")
# Fields shown in their own help group; every other field is in "engine".
ADMISSION_FIELDS = ("max_queued_requests", "max_queued_tokens")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


class FlagError(ValueError):
    """An engine flag value ``EngineConfig`` refuses; the message names the flag as it is typed."""


def parse_size(text: str) -> int:
    """``"2GiB"``, ``"512M"`` or plain bytes -> bytes (K/M/G/T are binary multiples)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1073741824, 512MiB, 2G)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def flag_name(field: str) -> str:
    """``block_size`` -> ``--block-size``."""
    return "--" + field.replace("_", "-")


def add_engine_arguments(parser: argparse.ArgumentParser, repeatable: Collection[str] = ()) -> None:
    """Adds one flag per ``EngineConfig`` field, in the "engine" and "admission limits" groups.

    A field in ``repeatable`` may be given several times (``paged serve --model A --model B``): its
    value is then the list of what was given, and ``engine_kwargs`` takes the first.
    """
    engine = parser.add_argument_group("engine")
    admission = parser.add_argument_group(
        "admission limits", "beyond them a new request is refused (EngineOverloaded; HTTP 429 from paged serve)"
    )
    for k in knobs_of(EngineConfig):
        group = admission if k.name in ADMISSION_FIELDS else engine
        options = _parse_options(k)
        text = _help(k)
        if k.name in repeatable:
            options["action"] = "append"
            text = text.replace(" (default: ", " Repeat the flag for several. (default: ")
        group.add_argument(flag_name(k.name), dest=k.name, default=k.default, help=text, **options)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Every ``EngineConfig`` field as the flags set it (defaults included), ``model`` too; a repeated flag's first."""
    values = {k.name: getattr(args, k.name) for k in knobs_of(EngineConfig)}
    # NOTE: only a repeatable flag's value is a list (SETTINGS values are dicts)
    return {name: value[0] if isinstance(value, list) else value for name, value in values.items()}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` the flags describe.

    Raises:
        FlagError: a value the config refuses, with the fields spelled as flags.
    """
    try:
        return EngineConfig(**engine_kwargs(args))
    except ParameterError as exc:
        raise FlagError(_as_flags(str(exc))) from exc


def add_restart_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per ``RestartPolicy`` field, in the "self-healing" group."""
    group = parser.add_argument_group("self-healing", "how a fresh engine replaces one whose driver died")
    _add_knobs(group, RestartPolicy, _restart_dest)


def restart_policy(args: argparse.Namespace) -> RestartPolicy:
    """The ``RestartPolicy`` the self-healing flags describe.

    Raises:
        FlagError: a value the policy refuses, with the fields spelled as flags.
    """
    return _settings(args, RestartPolicy, _restart_dest)


def add_responses_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per ``ResponsesConfig`` field, each named for responses (``--responses-store-max-bytes`` ...)."""
    group = parser.add_argument_group("responses", "how long stored responses and their pinned conversations live")
    _add_knobs(group, ResponsesConfig, _responses_dest)


def responses_config(args: argparse.Namespace) -> ResponsesConfig:
    """The ``ResponsesConfig`` the responses flags describe.

    Raises:
        FlagError: a value the config refuses, with the fields spelled as flags.
    """
    return _settings(args, ResponsesConfig, _responses_dest)


def _restart_dest(field: str) -> str:
    """``window_s`` -> ``restart_window_s``; a field already named for restarts keeps its name."""
    return field if "restart" in field else "restart_" + field


def _responses_dest(field: str) -> str:
    return "responses_" + field


def _add_knobs(group: Any, cls: type, dest: Callable[[str], str]) -> None:
    """One flag per knob of ``cls``, its destination (and flag) ``dest(field)``."""
    for k in knobs_of(cls):
        group.add_argument(flag_name(dest(k.name)), dest=dest(k.name), default=k.default, help=_help(k), **_parse_options(k))


def _settings(args: argparse.Namespace, cls: type[T], dest: Callable[[str], str]) -> T:
    """``cls`` of the flags ``_add_knobs`` added.

    Raises:
        FlagError: a value ``cls`` refuses, with the fields spelled as flags.
    """
    knobs = knobs_of(cls)
    try:
        return cls(**{k.name: getattr(args, dest(k.name)) for k in knobs})
    except ParameterError as exc:
        message = str(exc)
        for k in sorted(knobs, key=lambda k: len(k.name), reverse=True):
            message = re.sub(rf"\b{k.name}\b", flag_name(dest(k.name)), message)
        raise FlagError(message) from exc


def _parse_options(k: Knob) -> dict[str, Any]:
    if k.kind is Kind.BOOL:
        return {"action": argparse.BooleanOptionalAction}
    if k.kind is Kind.INT:
        return {"type": parse_size, "metavar": "SIZE"} if k.unit == "bytes" else {"type": int}
    if k.kind is Kind.FLOAT:
        return {"type": float}
    if k.kind is Kind.CHOICE:
        return {"choices": k.choices}
    if k.kind is Kind.PATH:
        return {"metavar": "PATH"}
    if k.kind is Kind.STR:
        return {}
    if k.kind is Kind.SETTINGS:
        return {"type": _json_object, "metavar": "JSON"}
    raise TypeError(f"no command-line flag for the {k.kind.value} knob {k.name!r}")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def _help(k: Knob) -> str:
    # NOTE: argparse %-formats help texts; a literal % in a knob's help ("85% of") must be doubled.
    text = k.help.replace("%", "%%")
    if k.unit == "bytes":
        text += " SIZE is bytes, or takes a binary K/M/G/T suffix (512MiB, 2G)."
    return text + " (default: %(default)s)"


def _as_flags(message: str) -> str:
    # NOTE: ParameterError messages name fields as EngineConfig does ("block_size must be ...",
    # "give kv_cache_memory or num_blocks, not both"); on the command line they are flags.
    names = sorted((k.name for k in knobs_of(EngineConfig)), key=len, reverse=True)
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: flag_name(m.group(1)), message)
