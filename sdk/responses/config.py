"""ResponsesConfig: how long stored responses and their conversations' pinned prefixes live, declared once as knobs.

``paged serve`` takes each as a flag (``--responses-store-max-bytes`` ...), the SDK as
``AsyncClient(responses=ResponsesConfig(...))``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.knobs import check_knobs, knob

DAY = 86400.0


@dataclass(frozen=True)
class ResponsesConfig:
    """The bounds of the response store and of the conversation pins.

    Raises:
        ParameterError: a field of the wrong type or outside its bounds (``param`` names it).
    """

    store_max_bytes: int = knob(
        64 << 20, "Bytes of stored responses (their JSON, conversation included) kept; past it the oldest are dropped.",
        ge=0, le=1 << 40, unit="bytes",
    )  # fmt: skip
    store_max_age_s: float = knob(
        DAY, "Seconds a stored response is kept after it was made; later it is gone (404).", gt=0.0, le=365 * DAY
    )
    pin_ttl_s: float = knob(
        600.0, "Seconds a stored response's conversation keeps its prefix pinned in the KV cache for the next turn; "
        "0 = never pin.", ge=0.0, le=DAY,
    )  # fmt: skip
    pin_max_fraction: float = knob(
        0.5, "Most of the KV cache that pinned conversations may hold; past it the oldest pins are released.",
        ge=0.0, le=1.0,
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_knobs(self)
