"""Values on both sides of each bound of a knob, for tests that check every surface takes the engine's bounds."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine.knobs import Kind, Knob


def knob_cases(k: Knob) -> Iterator[tuple[Any, bool]]:
    """(value, accepted) pairs on both sides of each of the knob's bounds."""
    if k.kind in (Kind.INT, Kind.FLOAT):
        step = 1 if k.kind is Kind.INT else 0.5
        if k.ge is not None:
            yield (int(k.ge) if k.kind is Kind.INT else float(k.ge)), True
            yield (int(k.ge) - 1 if k.kind is Kind.INT else k.ge - step), False
        if k.gt is not None:
            yield (int(k.gt) if k.kind is Kind.INT else float(k.gt)), False
        if k.le is not None:
            yield (int(k.le) if k.kind is Kind.INT else float(k.le)), True
            yield (int(k.le) + 1 if k.kind is Kind.INT else k.le + step), False
        yield "1", False  # strict: no str for a number
    elif k.kind is Kind.BOOL:
        yield True, True
        yield "yes", False
    elif k.kind is Kind.STR:
        yield "x" * k.max_chars, True
        yield "x" * (k.max_chars + 1), False
        yield "", False
    elif k.kind is Kind.STR_LIST:
        yield ["x" * k.max_chars] * k.max_items, True
        yield ["x"] * (k.max_items + 1), False
        yield ["x" * (k.max_chars + 1)], False
        yield [""], False
    elif k.kind is Kind.INT_LIST:
        yield [k.item_ge] * k.max_items, True
        yield [k.item_ge] * (k.max_items + 1), False
        yield [k.item_ge - 1], False
    else:
        raise AssertionError(f"no cases for {k.kind}")
