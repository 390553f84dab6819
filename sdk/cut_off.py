"""Replies cut off inside a constraint: the one rule every route applies.

A reply that ends by length (``finish_reason="length"``) inside a constraint never yields a
parsed object or a half call. It is inside one when its request has a ``response_format``
other than text, forces a tool call (``tool_choice`` ``"required"`` or a named tool), or, with
``"auto"``, had begun a call (its name written) that never closed.

The SDK marks such a reply (``Choice.cut_off``, ``parsed=None``, the cut call left out of
``tool_calls``) and ``raise_for_cut_off()`` raises ``LengthFinishReasonError``; the LangChain
and LlamaIndex adapters raise it; ``paged serve`` answers ``finish_reason="length"``, on which
the openai client's ``parse()`` raises its own ``LengthFinishReasonError``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sdk.errors import LengthFinishReasonError
from sdk.response_format import TextFormat, to_response_format
from sdk.tools import ToolCallDelta, collect_calls, to_tool_choice, to_tools

if TYPE_CHECKING:
    from sdk.types import ChatRequest, CompletionRequest, Delta


class CutOffWatch:
    """Follows one request's deltas and tells which of its completions were cut inside the constraint.

    Args:
        response_format, tools, tool_choice: as the request sets them (any spelling the SDK takes).
    """

    def __init__(self, response_format: Any = None, tools: Sequence[Any] | None = None, tool_choice: Any = None) -> None:
        self._constraint = (response_format, tools, tool_choice)
        self._always: bool | None = None  # every length finish is a cut; None until the first delta
        self._text: dict[int, list[str]] = defaultdict(list)
        self._num_tokens: dict[int, int] = defaultdict(int)
        self._calls: dict[int, list[ToolCallDelta]] = defaultdict(list)

    @classmethod
    def of(cls, request: ChatRequest | CompletionRequest) -> CutOffWatch:
        """The watch of a typed request."""
        return cls(request.response_format, getattr(request, "tools", None), getattr(request, "tool_choice", None))

    def add(self, delta: Delta) -> LengthFinishReasonError | None:
        """Takes the request's next delta; the error when it ends its completion cut inside the constraint."""
        if self._always is None:
            # NOTE: read once the request ran: the request path checks these fields first (hooks, audit)
            self._always = _always_constrained(*self._constraint)
        index = delta.index
        self._text[index].append(delta.text)
        self._num_tokens[index] += len(delta.token_ids)
        self._calls[index] += delta.tool_calls or ()
        if delta.finish_reason != "length" or not (self._always or _has_half_call(self._calls[index])):
            return None
        text = "".join(self._text[index])
        return LengthFinishReasonError(text, max_tokens=self._num_tokens[index], request_id=delta.request_id)


def _always_constrained(response_format: Any, tools: Sequence[Any] | None, tool_choice: Any) -> bool:
    """Whether the whole reply is under a constraint: a format other than text, or a forced tool call."""
    fmt = to_response_format(response_format)
    choice = to_tool_choice(tool_choice, to_tools(tools))
    return (fmt is not None and not isinstance(fmt, TextFormat)) or choice not in (None, "none", "auto")


def _has_half_call(deltas: Sequence[ToolCallDelta]) -> bool:
    """Whether a call was begun (its name streamed) whose arguments never closed."""
    return len({d.index for d in deltas}) > len(collect_calls(deltas))
