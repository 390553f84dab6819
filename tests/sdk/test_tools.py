"""Tools in the SDK: specs from every spelling, tool choice, the streaming call parser, rendering."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import BaseModel, Field, ValidationError

from engine.structured_output import StructuredOutput
from sdk import InvalidRequestError
from sdk.chat_template import DEFAULT_TOOL_PROMPT, render_chat, renders_tools
from sdk.tools import (
    ToolCall,
    ToolCallParser,
    collect_calls,
    format_call,
    to_tool,
    to_tool_choice,
    to_tools,
    tool_constraint,
)
from sdk.types import ChatMessage

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class Add(BaseModel):
    """Add two integers."""

    a: int = Field(description="The first term.")
    b: int


def forecast(city: str, days: int = 3) -> str:
    """Forecast for a city.

    Args:
        city: The city's name.
        days (int): How many days ahead.

    Returns:
        The forecast.
    """
    return city


def test_every_tool_spelling_is_one_spec():
    assert to_tool(WEATHER).function.parameters["required"] == ["city"]
    assert to_tool(WEATHER["function"]) == to_tool(WEATHER)  # the bare function object
    add = to_tool(Add).function
    assert (add.name, add.description, add.parameters["required"]) == ("Add", "Add two integers.", ["a", "b"])
    fc = to_tool(forecast).function
    assert fc.name == "forecast" and fc.description == "Forecast for a city."
    assert fc.parameters["properties"]["city"] == {"description": "The city's name.", "title": "City", "type": "string"}
    assert fc.parameters["properties"]["days"]["default"] == 3 and fc.parameters["required"] == ["city"]


@pytest.mark.parametrize(
    "tools",
    [[{"type": "function", "function": {"name": "bad name!"}}], [{"type": "function"}], [3], [WEATHER, WEATHER], [WEATHER] * 129],
)
def test_malformed_tools_are_refused(tools):
    with pytest.raises(InvalidRequestError) as info:
        to_tools(tools)
    assert info.value.param == "tools"


def test_tool_choice_is_normalized_and_checked():
    tools = to_tools([WEATHER, Add])
    assert [to_tool_choice(c, tools) for c in (None, "auto", "none", "required")] == ["auto", "auto", "none", "required"]
    assert to_tool_choice({"type": "function", "function": {"name": "Add"}}, tools) == "Add"
    assert to_tool_choice(None, None) is None
    for bad, tools_ in [("sometimes", tools), ({"type": "function", "function": {"name": "nope"}}, tools),
                        ({"function": {}}, tools), ("required", None)]:  # fmt: skip
        with pytest.raises(InvalidRequestError) as info:
            to_tool_choice(bad, tools_)
        assert info.value.param == "tool_choice"


def test_tool_constraints_by_choice():
    tools = to_tools([WEATHER, Add])
    assert tool_constraint(tools, "none") is None
    auto = json.loads(tool_constraint(tools, "auto").structural_tag)["format"]
    assert auto["type"] == "triggered_tags" and auto["triggers"] == ["<tool_call>"] and len(auto["tags"]) == 2
    required = json.loads(tool_constraint(tools, "required", parallel_tool_calls=False).structural_tag)["format"]
    assert required["type"] == "tags_with_separator" and required["at_least_one"] and required["stop_after_first"]
    named = json.loads(tool_constraint(tools, "Add").structural_tag)["format"]
    assert [t["begin"] for t in named["tags"]] == ['<tool_call>\n{"name": "Add", "arguments": ']
    # a call written by format_call is what the constraint's tag spells
    call = format_call(ToolCall(name="Add", arguments={"a": 1, "b": 2}))
    tag = named["tags"][0]
    assert call == tag["begin"] + '{"a": 1, "b": 2}' + tag["end"]


TEXT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "x": {"y": [1, "}"]}}}\n'
    '</tool_call>\n<tool_call>\n{"name": "Add", "arguments": {}}\n</tool_call> done <tool_'
)


@pytest.mark.parametrize("seed", range(20))
def test_the_stream_parser_splits_text_and_calls_at_any_chunking(seed):
    rng = random.Random(seed)
    parser = ToolCallParser(to_tools([WEATHER, Add]))
    texts, deltas, i = [], [], 0
    while i < len(TEXT):
        n = rng.randint(1, 9)
        text, new = parser.feed(TEXT[i : i + n])
        texts.append(text)
        deltas += new
        i += n
    texts.append(parser.finish())
    assert "".join(texts) == "Let me check. \n done <tool_"
    calls = collect_calls(deltas)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Pa}ris", "x": {"y": [1, "}"]}}), ("Add", {})]
    assert [d.name for d in deltas if d.name] == ["get_weather", "Add"] and len({c.id for c in calls}) == 2


def test_a_call_cut_short_is_neither_call_nor_text():
    parser = ToolCallParser(to_tools([Add]))
    _, deltas = parser.feed('<tool_call>\n{"name": "Add", "arguments": {"a": 1')
    assert deltas[0].name == "Add" and parser.finish() == "" and collect_calls(deltas) == []
    parser = ToolCallParser(to_tools([Add]))
    text, deltas = parser.feed('<tool_call>\n{"name": "Sub", "arguments": {}}\n</tool_call>')
    assert (text, deltas) == ("", []) and parser.finish() == ""
    parser = ToolCallParser(to_tools([Add]))
    assert parser.feed('<tool_call>\n{"name": ') == ("", []) and parser.finish() == ""


def test_message_shapes_are_checked():
    ChatMessage(role="assistant", tool_calls=[ToolCall(name="Add", arguments={"a": 1})])
    for bad in [dict(role="user"), dict(role="tool", content="4"), dict(role="user", content="x", tool_calls=[ToolCall(name="a")])]:
        with pytest.raises(ValidationError):
            ChatMessage(**bad)


# --- rendering ------------------------------------------------------------------------------

QWEN_STYLE = (  # a Hermes-style template that renders tools itself, as Qwen2.5's does
    "{% if tools %}<|im_start|>system\n{{ messages[0]['content'] if messages[0]['role'] == 'system' else '' }}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Return calls in <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' and tools %}{% elif m['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}"
    '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(bundled_model_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(bundled_model_dir)


CONVERSATION = [
    ChatMessage(role="system", content="You are terse."),
    ChatMessage(role="user", content="Weather in Paris, and 2+3?"),
    ChatMessage(role="assistant", tool_calls=[ToolCall(id="c1", name="get_weather", arguments={"city": "Paris"}),
                                              ToolCall(id="c2", name="Add", arguments={"a": 2, "b": 3})]),
    ChatMessage(role="tool", content="sunny", tool_call_id="c1"),
    ChatMessage(role="tool", content="5", tool_call_id="c2"),
]  # fmt: skip


def test_the_default_tool_prompt_renders_tools_calls_and_results(tokenizer):
    assert not renders_tools(tokenizer.chat_template)
    tools = to_tools([WEATHER, Add])
    text = tokenizer.decode(render_chat(tokenizer, CONVERSATION, tools=tools))
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert json.dumps(tools[0].function.model_dump(exclude_none=True)) in text
    assert format_call(CONVERSATION[2].tool_calls[0]) + format_call(CONVERSATION[2].tool_calls[1]) + "<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>user\n<tool_response>\n5\n" in text
    assert DEFAULT_TOOL_PROMPT.splitlines()[0] in text and text.endswith("<|im_start|>assistant\n")


def test_a_conversation_grows_by_appending_tokens(tokenizer):
    """Each turn's prompt starts with the previous turn's prompt and reply: the prefix cache serves it."""
    tools = to_tools([WEATHER, Add])
    original = tokenizer.chat_template
    try:
        for template in (original, QWEN_STYLE):
            tokenizer.chat_template = template
            for n in range(2, len(CONVERSATION)):
                shorter = render_chat(tokenizer, CONVERSATION[:n], add_generation_prompt=False, tools=tools)
                longer = render_chat(tokenizer, CONVERSATION[: n + 1], tools=tools)
                assert longer[: len(shorter)] == shorter
    finally:
        tokenizer.chat_template = original


def test_a_tool_aware_template_renders_tools_itself(tokenizer):
    original = tokenizer.chat_template
    tokenizer.chat_template = QWEN_STYLE
    try:
        assert renders_tools(QWEN_STYLE)
        text = tokenizer.decode(render_chat(tokenizer, CONVERSATION, tools=to_tools([WEATHER, Add])))
    finally:
        tokenizer.chat_template = original
    assert "<tools>{" in text and '"name": "get_weather"' in text and DEFAULT_TOOL_PROMPT.splitlines()[2] not in text
    assert '<tool_call>\n{"name": "Add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text


# --- on the engine (a random-weight model follows no format: every valid call was made to) ---


NESTED = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {
                "guest": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                           "age": {"type": "integer", "minimum": 18, "maximum": 99}},
                          "required": ["name", "age"]},
                "nights": {"type": "integer", "minimum": 1, "maximum": 9},
                "room": {"enum": ["single", "double"]},
            },
            "required": ["guest", "nights", "room"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
SMALL_WEATHER = {**WEATHER, "function": {**WEATHER["function"], "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}  # fmt: skip


@pytest.fixture
async def client(tiny_model_factory):
    from sdk import AsyncClient

    client = AsyncClient(str(tiny_model_factory("llama")), num_blocks=512, max_num_seqs=16)
    yield client
    await client.aclose()


async def test_required_and_named_choices_always_give_valid_calls(client):
    import jsonschema

    tools = [SMALL_WEATHER, NESTED]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    choices = ["required", {"type": "function", "function": {"name": "book"}}]
    results = await client.batch(
        [f"Request {i}" for i in range(8)], tools=tools, tool_choice=choices[0], max_tokens=300, temperature=1.0, seed=2
    )
    results += await client.batch(
        [f"Book {i}" for i in range(4)], tools=tools, tool_choice=choices[1], max_tokens=300, temperature=1.0, seed=2
    )
    for i, result in enumerate(results):
        assert result.finish_reason == "tool_calls" and result.tool_calls, result
        for call in result.tool_calls:
            jsonschema.validate(call.arguments, schemas[call.name])
        if i >= 8:
            assert [c.name for c in result.tool_calls] == ["book"]


async def test_parallel_tool_calls_false_makes_one_call(client):
    result = await client.chat("Go", tools=[SMALL_WEATHER, NESTED], tool_choice="required", parallel_tool_calls=False,
                               max_tokens=300, temperature=1.0, seed=3)  # fmt: skip
    assert len(result.tool_calls) == 1


async def test_streamed_call_deltas_assemble_into_the_collected_calls(client):
    kwargs = dict(tools=[NESTED], tool_choice="required", parallel_tool_calls=False, max_tokens=300, temperature=0.8, seed=5)
    deltas = [d async for d in client.stream("Book a room", **kwargs)]
    calls = collect_calls([c for d in deltas for c in d.tool_calls or ()])
    result = await client.chat("Book a room", **kwargs)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in result.tool_calls]
    assert deltas[-1].finish_reason == "tool_calls" and "".join(d.text for d in deltas) == result.text


async def test_a_tool_turn_resent_computes_only_its_new_tokens(client):
    """A conversation re-sent with the reply and the tool's result computes only what it added."""
    tools = [NESTED]
    history = [ChatMessage(role="user", content="Book a room for Ann.")]
    first = await client.chat(history, tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=300, temperature=0)
    assert first.finish_reason == "tool_calls"
    history += [first.message, ChatMessage(role="tool", content="booked", tool_call_id=first.tool_calls[0].id)]
    before = client.stats()["prompt_tokens_computed"]
    second = await client.chat(history, tools=tools, tool_choice="none", max_tokens=4, temperature=0)
    computed = client.stats()["prompt_tokens_computed"] - before
    # NOTE: the reply counts as new: its sampled tokens need not be how the tokenizer splits its text
    new_tokens = second.usage.prompt_tokens - first.usage.prompt_tokens
    assert computed <= new_tokens + 2 * 16 and second.usage.cached_tokens >= first.usage.prompt_tokens // 16 * 16


async def test_auto_gives_text_or_complete_calls_and_none_gives_text(client):
    tools = [SMALL_WEATHER]
    for result in await client.batch([f"Hi {i}" for i in range(6)], tools=tools, max_tokens=80, temperature=1.0, seed=11):
        assert "<tool_call>" not in result.text or result.finish_reason == "length"
        assert (result.finish_reason == "tool_calls") == bool(result.tool_calls)
    none = await client.chat("Hi", tools=tools, tool_choice="none", max_tokens=20, temperature=0)
    assert none.tool_calls is None and none.finish_reason in ("stop", "length")


async def test_bad_tool_requests_are_refused_naming_the_field(client):
    with pytest.raises(InvalidRequestError) as info:
        await client.chat("Hi", tools=[SMALL_WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError) as info:
        await client.chat("Hi", tools=[{"name": "x", "parameters": {"type": "nonsense"}}], tool_choice="required")
    assert info.value.param == "tools"


async def test_a_response_format_holds_the_text_beside_the_tools(client):
    """With a response format, a forced choice still makes calls; under auto the reply is calls alone or
    formatted text alone (the model picks), never text around calls."""
    json_object = {"type": "json_object"}
    one_call = dict(tools=[SMALL_WEATHER], parallel_tool_calls=False, response_format=json_object, max_tokens=100)
    forced = await client.chat("Hi", tool_choice="required", **one_call)
    assert forced.finish_reason == "tool_calls" and forced.text == ""
    for seed in range(4):
        either = await client.chat("Hi", temperature=1.0, seed=seed, **one_call)
        if either.finish_reason == "tool_calls":
            assert either.text == "" and either.tool_calls
        elif either.finish_reason == "stop":
            assert isinstance(json.loads(either.text), dict) and either.tool_calls is None


def test_an_answer_constraint_joins_the_calls_under_auto():
    tools = to_tools([WEATHER, Add])
    answer = StructuredOutput(json_object=True)
    assert tool_constraint(tools, "none", answer=answer) is answer
    either = json.loads(tool_constraint(tools, "auto", answer=answer).structural_tag)["format"]
    calls, text = either["elements"]
    assert either["type"] == "or" and calls["type"] == "tags_with_separator" and calls["at_least_one"]
    assert text["type"] == "grammar"
    assert tool_constraint(tools, "required", answer=answer) == tool_constraint(tools, "required")
    with pytest.raises(InvalidRequestError) as info:
        tool_constraint(tools, "auto", answer=StructuredOutput(json_schema={"type": "nonsense"}))
    assert info.value.param == "response_format.json_schema.schema"


async def test_output_filters_and_audit_see_tool_calls(tiny_model_factory, tmp_path):
    """An output filter reads the calls' arguments and can stop one mid-stream; the audit log records calls."""
    from sdk import AsyncClient
    from sdk.hooks import AuditLog, RegexFilter

    audit = tmp_path / "audit.jsonl"
    client = AsyncClient(str(tiny_model_factory("llama")), num_blocks=512,
                         hooks=[RegexFilter(r'"room": "(single|double)"', on="output"), AuditLog(audit, include_text=True)])  # fmt: skip
    kwargs = dict(tools=[NESTED], tool_choice="required", parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=5)
    stopped = await client.chat("Book", **kwargs)
    allowed = await client.chat("Book", **{**kwargs, "tools": [SMALL_WEATHER], "tool_choice": "required"})
    await client.aclose()
    assert stopped.finish_reason == "content_filter" and not stopped.tool_calls
    assert allowed.finish_reason == "tool_calls"
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert records[1]["tool_calls"] == ["get_weather"]
    assert records[1]["tool_call_arguments"][0]["arguments"] == allowed.tool_calls[0].arguments


def test_a_cut_is_inside_the_constraint_when_forced_or_inside_a_begun_call():
    """``sdk.cut_off``: a length finish under a forced choice or a JSON format is a cut; under auto, only one
    inside a call whose name was streamed; a call that closed before the cut leaves plain text cut."""
    from engine.outputs import Delta
    from sdk.cut_off import CutOffWatch
    from sdk.tools import ToolCallDelta

    head = Delta("r", text="", token_ids=[1, 2], tool_calls=[ToolCallDelta(index=0, id="call_1", name="get_weather")])
    half = Delta("r", token_ids=[3], tool_calls=[ToolCallDelta(index=0, arguments='{"city": "Par')], finish_reason="length")
    whole = Delta("r", token_ids=[3], tool_calls=[ToolCallDelta(index=0, arguments='{"city": "Paris"}')])
    text_cut = Delta("r", text=" and", token_ids=[4], finish_reason="length")

    def cut(deltas: list[Delta], **request: object) -> object:
        watch = CutOffWatch(tools=[WEATHER], **request)
        return [watch.add(d) for d in deltas][-1]

    error = cut([head, half])
    assert error is not None and (error.text, error.max_tokens, error.request_id) == ("", 3, "r")
    assert cut([head, whole, text_cut]) is None
    assert cut([head, whole, text_cut], tool_choice="required") is not None
    assert cut([text_cut], tool_choice="none", response_format={"type": "json_object"}) is not None
    assert cut([text_cut], tool_choice="none", response_format={"type": "text"}) is None
