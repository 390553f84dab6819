"""ResponseBuilder: a reply's deltas become a response's output items and its stream events, in OpenAI's order.

For a response::

    response.created, response.in_progress
    per output item, in order:
      reasoning:      output_item.added, content_part.added, reasoning_text.delta..., reasoning_text.done,
                      content_part.done, output_item.done
      message:        output_item.added, content_part.added, output_text.delta..., output_text.done,
                      content_part.done, output_item.done
      function_call:  output_item.added, function_call_arguments.delta..., function_call_arguments.done,
                      output_item.done
    response.completed | response.incomplete | response.failed

with ``sequence_number`` counting from 0. A non-streamed response is the same run with its
events dropped, so the two never differ. A reply cut short (``max_tokens``, an output filter)
is ``incomplete``, its last item too; a call whose arguments were cut (they do not parse) was
streamed but is left out of the response's ``output``: nothing half-made passes as a call.
Whitespace between items (around a call) is not a message of its own.
"""

from __future__ import annotations

import json

from sdk.errors import PagedError
from sdk.responses.types import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponseError,
    ResponseEvent,
    ResponseUsage,
    TokenLogprob,
    TopLogprob,
)
from sdk.tools import ToolCallDelta
from sdk.types import Delta
from sdk.types import TokenLogprob as EngineLogprob

_INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


class ResponseBuilder:
    """Builds one response from its reply's deltas; each method returns the events it makes, in order.

    Args:
        response: the response as the request made it (status ``in_progress``, no output);
            filled in place.
        want_logprobs: put each text token's logprobs on the text (``include`` asked for them).
    """

    def __init__(self, response: Response, *, want_logprobs: bool = False) -> None:
        self.response = response
        self._want_logprobs = want_logprobs
        self._sequence = 0
        self._items: list[OutputItem] = []  # every item opened, in order (a cut call included)
        self._open: OutputItem | None = None
        self._calls: dict[int, FunctionCallItem] = {}  # by the reply's call index
        self._whitespace = ""  # text between items, kept until it turns out to begin a message
        self._held_tokens = 0  # tokens of deltas that showed nothing yet
        self._reasoning_tokens = 0
        self._answered = False

    def start(self) -> list[ResponseEvent]:
        """``response.created`` and ``response.in_progress``."""
        return [self._event("response.created", response=self._snapshot()), self._event("response.in_progress", response=self._snapshot())]

    def add(self, delta: Delta) -> list[ResponseEvent]:
        """The events of one delta's reasoning, text and call fragments."""
        self._count_tokens(delta)
        events: list[ResponseEvent] = []
        if delta.reasoning:
            events += self._reasoning(delta.reasoning)
        if delta.text:
            events += self._text(delta.text, delta.logprobs)
        for call in delta.tool_calls or ():
            events += self._call(call)
        return events

    def finish(self, last: Delta) -> list[ResponseEvent]:
        """Closes the reply after its last delta (``finish_reason`` and ``usage`` set): the last item's
        events and ``response.completed`` or ``response.incomplete``."""
        response = self.response
        reason = _INCOMPLETE_REASONS.get(last.finish_reason or "")
        events = self.add(last)
        if not self._items and reason is None:  # an empty reply is an empty message
            events += self._open_message()
        events += self._close("incomplete" if reason else "completed")
        response.output = [item for item in self._items if not _cut_call(item)]
        response.status = "incomplete" if reason else "completed"
        response.incomplete_details = IncompleteDetails(reason=reason) if reason else None  # type: ignore[arg-type]
        if last.usage is not None:
            usage = last.usage
            response.usage = ResponseUsage(
                input_tokens=usage.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
                output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
                output_tokens_details=OutputTokensDetails(reasoning_tokens=self._reasoning_tokens),
            )  # fmt: skip
        return events + [self._event(f"response.{response.status}", response=self._snapshot())]

    def fail(self, error: PagedError) -> list[ResponseEvent]:
        """The reply failed after the stream began: the open item closed incomplete, ``response.failed``."""
        events = self._close("incomplete")
        self.response.output = [item for item in self._items if not _cut_call(item)]
        self.response.status = "failed"
        self.response.error = ResponseError(code=error.code or "server_error", message=error.public_message)
        return events + [self._event("response.failed", response=self._snapshot())]

    # ------------------------------------------------------------------ items

    def _count_tokens(self, delta: Delta) -> None:
        """Reasoning tokens: those of the reply until its answer began (its markers too), once it reasoned."""
        if self._answered:
            return
        if delta.text.strip() or delta.tool_calls:
            self._answered = True
            if self._reasoning_tokens:
                self._reasoning_tokens += self._held_tokens
        elif delta.reasoning:
            self._reasoning_tokens += self._held_tokens + len(delta.token_ids)
            self._held_tokens = 0
        else:
            self._held_tokens += len(delta.token_ids)

    def _reasoning(self, text: str) -> list[ResponseEvent]:
        events = []
        if not isinstance(self._open, ReasoningItem):
            events += self._close("completed")
            item = ReasoningItem(content=[ReasoningText()])
            events += self._open_item(item, ReasoningText())
        item = self._open
        assert isinstance(item, ReasoningItem)
        item.content[0].text += text
        return events + [self._event("response.reasoning_text.delta", **self._at(item), content_index=0, delta=text)]

    def _text(self, text: str, logprobs: list[EngineLogprob] | None) -> list[ResponseEvent]:
        events = []
        if not isinstance(self._open, MessageItem):
            if not text.strip():
                self._whitespace += text
                return []
            text, self._whitespace = self._whitespace + text, ""
            events += self._close("completed") + self._open_message()
        item = self._open
        assert isinstance(item, MessageItem)
        part = item.content[0]
        part.text += text
        wire_logprobs = _logprobs(logprobs) if self._want_logprobs else []
        if self._want_logprobs:
            part.logprobs = (part.logprobs or []) + wire_logprobs
        return events + [
            self._event("response.output_text.delta", **self._at(item), content_index=0, delta=text, logprobs=wire_logprobs)
        ]

    def _open_message(self) -> list[ResponseEvent]:
        text, self._whitespace = self._whitespace, ""
        item = MessageItem(content=[OutputText(logprobs=[] if self._want_logprobs else None)])
        events = self._open_item(item, OutputText())
        if text:
            item.content[0].text = text
            events.append(self._event("response.output_text.delta", **self._at(item), content_index=0, delta=text, logprobs=[]))
        return events

    def _call(self, delta: ToolCallDelta) -> list[ResponseEvent]:
        events = []
        if delta.name is not None:  # a new call: its id and name come first
            self._whitespace = ""
            events += self._close("completed")
            item = FunctionCallItem(call_id=delta.id or "", name=delta.name)
            self._calls[delta.index] = item
            events += self._open_item(item)
        item = self._calls[delta.index]
        fragment = delta.arguments if item.arguments else delta.arguments.lstrip()  # NOTE: the JSON text begins at its value
        if fragment:
            item.arguments += fragment
            events.append(self._event("response.function_call_arguments.delta", **self._at(item), delta=fragment))
        return events

    def _open_item(self, item: OutputItem, part: OutputText | ReasoningText | None = None) -> list[ResponseEvent]:
        self._items.append(item)
        self._open = item
        events = [self._event("response.output_item.added", output_index=len(self._items) - 1, item=item.model_copy(deep=True))]
        if part is not None:
            events.append(self._event("response.content_part.added", **self._at(item), content_index=0, part=part))
        return events

    def _close(self, status: str) -> list[ResponseEvent]:
        """The done events of the open item, which ends with ``status`` (a cut call: ``incomplete``)."""
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = "incomplete" if _cut_call(item) else status  # type: ignore[assignment]
        events = []
        if isinstance(item, MessageItem):
            part = item.content[0]
            events.append(self._event("response.output_text.done", **self._at(item), content_index=0, text=part.text, logprobs=part.logprobs or []))
            events.append(self._event("response.content_part.done", **self._at(item), content_index=0, part=part.model_copy()))
        elif isinstance(item, ReasoningItem):
            part = item.content[0]
            events.append(self._event("response.reasoning_text.done", **self._at(item), content_index=0, text=part.text))
            events.append(self._event("response.content_part.done", **self._at(item), content_index=0, part=part.model_copy()))
        else:
            events.append(self._event("response.function_call_arguments.done", **self._at(item), arguments=item.arguments))
        output_index = self._items.index(item)
        return events + [self._event("response.output_item.done", output_index=output_index, item=item.model_copy(deep=True))]

    # ------------------------------------------------------------------ events

    def _at(self, item: OutputItem) -> dict[str, object]:
        return {"item_id": item.id, "output_index": self._items.index(item)}

    def _snapshot(self) -> Response:
        return self.response.model_copy(deep=True)

    def _event(self, kind: str, **fields: object) -> ResponseEvent:
        event = ResponseEvent(type=kind, sequence_number=self._sequence, **fields)  # type: ignore[arg-type]
        self._sequence += 1
        return event


def _cut_call(item: OutputItem) -> bool:
    """Whether ``item`` is a call whose arguments were cut short (they do not parse as an object)."""
    if not isinstance(item, FunctionCallItem):
        return False
    try:
        return not isinstance(json.loads(item.arguments), dict)
    except json.JSONDecodeError:
        return True


def _logprobs(logprobs: list[EngineLogprob] | None) -> list[TokenLogprob]:
    """The engine's logprobs in the Responses format (each token's UTF-8 bytes beside it)."""
    return [
        TokenLogprob(
            token=t.token, logprob=t.logprob, bytes=list(t.token.encode()),
            top_logprobs=[TopLogprob(token=c.token, logprob=c.logprob, bytes=list(c.token.encode())) for c in t.top_logprobs],
        )  # fmt: skip
        for t in logprobs or ()
    ]
