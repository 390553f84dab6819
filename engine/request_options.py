"""RequestOptions and TenantOptions: the per-request arguments besides prompt and sampling params, declared once."""

from __future__ import annotations

from dataclasses import dataclass

from engine.knobs import check_knobs, knob

MAX_PRIORITY = 1 << 31  # |priority| bound
MAX_ID_CHARS = 256  # request ids, cache salts and tenants
MAX_WEIGHT = 1e6  # tenant weights are in (0, MAX_WEIGHT]


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """Who a request is and how it queues; checked before it is queued.

    Raises:
        ParameterError: naming the field of the wrong type or outside its bounds.
    """

    request_id: str | None = knob(
        None, "Unique among unfinished requests; None = one is made up.", max_chars=MAX_ID_CHARS
    )
    # NOTE: priorities are compared inside the waiting heap; one that is not an int would
    # break the comparison there, on the driver thread, long after the request was accepted.
    priority: int = knob(0, "Smaller runs first; FIFO within a priority.", ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    cache_salt: str | None = knob(
        None, "Requests with different salts never share KV blocks (tenant isolation).", max_chars=MAX_ID_CHARS
    )

    def __post_init__(self) -> None:
        check_knobs(self)


@dataclass(frozen=True, slots=True)
class TenantOptions:
    """Whose a request is, for the scheduler's fair share (``engine.core.fair_share``); set by the SDK client.

    Raises:
        ParameterError: naming the field of the wrong type or outside its bounds.
    """

    tenant: str | None = knob(
        None, "Who the request is for; within a priority, tenants share the token budget by weight. None = one shared tenant.",
        max_chars=MAX_ID_CHARS,
    )  # fmt: skip
    weight: float = knob(1.0, "The tenant's share of the token budget, relative to the other tenants'.", gt=0.0, le=MAX_WEIGHT)

    def __post_init__(self) -> None:
        check_knobs(self)
