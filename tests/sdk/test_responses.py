"""The Responses API's parts without an engine: input items, conversations, the event builder, the store, the pins."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from engine.outputs import Usage
from sdk.errors import InvalidRequestError, LengthFinishReasonError
from sdk.responses.config import ResponsesConfig
from sdk.responses.events import ResponseBuilder
from sdk.responses.items import Conversation, call_ids, check_input
from sdk.responses.pins import ConversationPins
from sdk.responses.store import ResponseStore, StoredResponse
from sdk.responses.types import MessageItem, Response, ResponseRequest
from sdk.tools import ToolCallDelta
from sdk.transport import PrefixPin
from sdk.types import Delta

CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}


# --------------------------------------------------------------------------- input items


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([{"type": "web_search_call"}], "input.0.type"),
        ([{"content": "no role"}], "input.0.type"),
        ([{"role": "tool", "content": "x"}], "input.0.role"),
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input.0.content.0.type"),
        ([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}], "input.0.content.0.image_url"),
        ([{"role": "user", "content": "hi"}, OUTPUT], "input.1.call_id"),
        ([{**CALL, "arguments": "[1]"}], "input.0.arguments"),
        ([{**CALL, "call_id": ""}], "input.0.call_id"),
        ([OUTPUT, CALL], "input.0.call_id"),  # answered before it was made
        ([], "input"),
    ],
)
def test_bad_items_are_refused_naming_their_path(items: list[dict[str, Any]], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_input(items, set())
    assert info.value.param == param and param in str(info.value)


def test_items_get_ids_and_answer_calls_of_the_conversation() -> None:
    checked = check_input([CALL, OUTPUT], set())
    assert [item["id"][:3] for item in checked] == ["fc_", "fco"]
    assert check_input([OUTPUT], {"call_1"})[0]["call_id"] == "call_1"  # a call of an earlier response
    text = check_input("Hi", set())[0]
    assert text == {"type": "message", "id": text["id"], "role": "user", "content": "Hi"} and text["id"].startswith("msg_")


def test_a_conversation_joins_text_and_calls_into_one_assistant_message() -> None:
    history = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        CALL,
        OUTPUT,
    ]
    conversation = Conversation("Answer kindly.", [*history, {"type": "message", "role": "user", "content": "Thanks"}], len(history))
    roles = [(m.role, m.content) for m in conversation.messages]
    assert roles == [
        ("system", "Answer kindly."), ("system", "Be brief."), ("user", "Weather in Paris?"),
        ("assistant", "Let me look."), ("tool", "Sunny"), ("user", "Thanks"),
    ]  # fmt: skip
    assert conversation.messages[3].tool_calls[0].arguments == {"city": "Paris"}
    assert conversation.sources == ["instructions", *["previous_response_id"] * 4, "input.0"]
    assert conversation.wire_param("messages.5.content") == "input.0.content"
    assert conversation.wire_param("messages.1") == "previous_response_id"
    assert conversation.wire_param("prompt") == "input"
    assert call_ids(conversation.items) == {"call_1"}
    assert [m.role for m in conversation.dropping(5).messages] == ["system", "tool", "user"]


def test_unsupported_request_fields_are_named() -> None:
    assert ResponseRequest(input="x", background=True).unsupported() == "background"
    assert ResponseRequest(input="x", conversation="conv_1").unsupported() == "conversation"
    assert ResponseRequest(input="x").unsupported() is None


# --------------------------------------------------------------------------- events


def _build(deltas: list[Delta], **kwargs: Any) -> tuple[Response, list[Any]]:
    builder = ResponseBuilder(Response(model="m"), **kwargs)
    events = builder.start()
    for delta in deltas[:-1]:
        events += builder.add(delta)
    events += builder.finish(deltas[-1])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return builder.response, events


def _last(finish: str, **kwargs: Any) -> Delta:
    return Delta("r", finish_reason=finish, usage=Usage(10, 5, 4), **kwargs)


def test_events_come_in_openai_order_item_by_item() -> None:
    deltas = [
        Delta("r", reasoning="Think", token_ids=[1, 2]),
        Delta("r", token_ids=[3]),  # the end marker: nothing shown
        Delta("r", text="Hi", token_ids=[4]),
        Delta("r", text="\n", token_ids=[5], tool_calls=[ToolCallDelta(index=0, id="call_a", name="f")]),
        Delta("r", token_ids=[6], tool_calls=[ToolCallDelta(index=0, arguments=' {"a": 1}')]),
        _last("tool_calls", token_ids=[7]),
    ]
    response, events = _build(deltas)
    assert [e.type.removeprefix("response.") for e in events] == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done", "output_item.done",
        "completed",
    ]  # fmt: skip
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output[2].arguments == '{"a": 1}' and response.output[2].call_id == "call_a"
    assert response.status == "completed" and response.output_text == "Hi\n"
    assert response.usage.input_tokens_details.cached_tokens == 4 and response.usage.output_tokens_details.reasoning_tokens == 3
    assert {e.output_index for e in events if e.item_id == response.output[1].id} == {1}


def test_whitespace_between_calls_is_no_message() -> None:
    deltas = [
        Delta("r", tool_calls=[ToolCallDelta(index=0, id="c0", name="f"), ToolCallDelta(index=0, arguments="{}")]),
        Delta("r", text="\n"),
        _last("tool_calls", tool_calls=[ToolCallDelta(index=1, id="c1", name="f"), ToolCallDelta(index=1, arguments="{}")]),
    ]
    response, _ = _build(deltas)
    assert [item.type for item in response.output] == ["function_call", "function_call"]


def test_a_cut_call_is_streamed_but_never_output() -> None:
    deltas = [Delta("r", tool_calls=[ToolCallDelta(index=0, id="c0", name="f"), ToolCallDelta(index=0, arguments='{"a": ')]), _last("length")]
    response, events = _build(deltas)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output == []
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[0].item.status == "incomplete"
    assert events[-1].type == "response.incomplete"


def test_a_cut_text_is_incomplete_and_an_empty_reply_a_message() -> None:
    response, _ = _build([Delta("r", text='{"a": "b'), _last("length")])
    assert response.status == "incomplete" and response.output[0].status == "incomplete"
    empty, _ = _build([_last("stop")])
    assert isinstance(empty.output[0], MessageItem) and empty.output_text == "" and empty.status == "completed"


def test_a_failure_after_the_start_fails_the_response() -> None:
    builder = ResponseBuilder(Response(model="m"))
    builder.start()
    builder.add(Delta("r", text="partial"))
    events = builder.fail(LengthFinishReasonError("x", max_tokens=1, request_id="r"))
    assert events[-1].type == "response.failed" and events[-1].response.error.code == "length"
    assert builder.response.output[0].status == "incomplete"


def test_event_json_has_only_each_types_fields() -> None:
    _, events = _build([Delta("r", text="Hi"), _last("stop")])
    delta = json.loads(next(e for e in events if e.type == "response.output_text.delta").model_dump_json())
    assert set(delta) == {"type", "sequence_number", "item_id", "output_index", "content_index", "delta", "logprobs"}
    created = json.loads(events[0].model_dump_json())
    assert created["response"]["error"] is None and created["response"]["status"] == "in_progress"


# --------------------------------------------------------------------------- the store


def _stored(tenant: str, text: str = "x", created: float = 0.0) -> StoredResponse:
    return StoredResponse(tenant, Response(model="m"), [{"type": "message", "role": "user", "content": text}], created=created)


def test_the_store_is_keyed_by_tenant_and_bounded_by_bytes_and_age() -> None:
    now = [1000.0]
    store = ResponseStore(ResponsesConfig(store_max_bytes=2000, store_max_age_s=60), clock=lambda: now[0])
    a = _stored("a", created=now[0])
    assert store.put(a) == []
    assert store.get("a", a.response.id) is a and store.get("b", a.response.id) is None
    assert store.delete("b", a.response.id) is None and store.get("a", a.response.id) is a
    big = [_stored("a", "y" * 500, created=now[0]) for _ in range(3)]
    dropped = [d for s in big for d in store.put(s)]
    assert dropped and dropped[0] is a and store.num_bytes <= 2000 and store.dropped["size"] == len(dropped)
    now[0] += 61
    assert store.get("a", big[-1].response.id) is None and len(store) == 0 and store.num_bytes == 0
    assert store.dropped["age"] >= 1


def test_a_store_with_a_directory_survives_a_restart(tmp_path) -> None:
    store = ResponseStore(directory=tmp_path)
    kept, deleted = _stored("a"), _stored("a")
    kept.created = deleted.created = 10**10  # NOTE: far in the future: within its age whatever the clock
    store.put(kept)
    store.put(deleted)
    store.delete("a", deleted.response.id)
    store.close()
    (tmp_path / "garbage.json").write_text("{not json")
    again = ResponseStore(directory=tmp_path)
    assert again.get("a", kept.response.id).items == kept.items and again.get("a", deleted.response.id) is None
    assert again.get("b", kept.response.id) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [again._path(kept.key).name]


# --------------------------------------------------------------------------- the pins


class PinTransport:
    """Pins and unpins as an engine would, counting; the KV cache's figures are set by the test."""

    def __init__(self) -> None:
        self.pinned: set[str] = set()
        self.gate = asyncio.Event()
        self.gate.set()
        self.figures = {"kv_blocks_total": 100, "kv_blocks_used": 0, "num_requests_waiting": 0}
        self._ids = 0

    async def pin_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> PrefixPin:
        await self.gate.wait()
        self._ids += 1
        self.pinned.add(f"pin-{self._ids}")
        return PrefixPin(f"pin-{self._ids}", token_ids, 0)

    async def unpin_prefix(self, pin_id: str) -> None:
        self.pinned.discard(pin_id)

    def stats(self) -> dict[str, Any]:
        return self.figures


async def test_pins_keep_to_their_budget_and_time() -> None:
    now = [0.0]
    pins = ConversationPins(ResponsesConfig(pin_ttl_s=10, pin_max_fraction=0.5), clock=lambda: now[0])
    transport = PinTransport()
    pins.pin(("a", "r1"), transport, [1] * 30, None, capacity=100)
    pins.pin(("a", "r2"), transport, [1] * 30, None, capacity=100)  # 60 > 50: r1 makes room
    await pins.ready(("a", "r2"))
    assert ("a", "r1") not in pins and pins.num_tokens == 30 and pins.released["budget"] == 1
    pins.pin(("a", "big"), transport, [1] * 51, None, capacity=100)  # never fits
    assert ("a", "big") not in pins
    pins.pin(("a", "r3"), transport, [1] * 15, None, capacity=100, reserve=80)  # the longest request's room stays free
    assert ("a", "r3") in pins and ("a", "r2") not in pins and pins.released["budget"] == 2
    now[0] = 11
    pins.sweep()
    assert pins.num_pins == 0 and pins.released["ttl"] == 1
    await pins.aclose()
    assert transport.pinned == set()


async def test_a_pin_still_computing_is_released_once_computed() -> None:
    pins = ConversationPins()
    transport = PinTransport()
    transport.gate.clear()
    pins.pin(("a", "r1"), transport, [1, 2], None, capacity=100)
    pins.release(("a", "r1"), "deleted")
    transport.gate.set()
    await pins.aclose()
    assert transport.pinned == set() and pins.released == {"deleted": 1}


async def test_requests_waiting_at_two_checks_release_every_pin() -> None:
    pins = ConversationPins()
    transport = PinTransport()
    for n in range(3):
        pins.pin(("a", f"r{n}"), transport, [1] * 5, None, capacity=100)
    pins.sweep()
    assert pins.num_pins == 3  # nothing waits
    transport.figures.update(num_requests_waiting=1)
    pins.sweep()
    assert pins.num_pins == 3  # a request waits between its arrival and the next step
    pins.sweep()
    assert pins.num_pins == 0 and pins.released["pressure"] == 3
    await pins.aclose()
    assert transport.pinned == set()
