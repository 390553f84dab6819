"""Tools on the bundled SmolLM2-135M, which was never trained on tool use: the constraint makes
every required or named call valid, and an agent conversation re-sent each turn computes only
what the turn added."""

from __future__ import annotations

import itertools

import jsonschema
import pytest

from sdk import AsyncClient, ChatMessage, Runtime

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "book_flight", "description": "Book a flight for some passengers.",
        "parameters": {"type": "object", "properties": {
            "origin": NAME, "destination": NAME,
            "date": {"type": "string", "pattern": "^2027-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"},
            "passengers": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["name", "age"], "additionalProperties": False}}},
            "required": ["origin", "destination", "date", "passengers"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between currencies.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number", "minimum": 0, "maximum": 1000000},
            "source": {"enum": ["EUR", "USD", "GBP", "JPY"]}, "target": {"enum": ["EUR", "USD", "GBP", "JPY"]}},
            "required": ["amount", "source", "target"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "create_event", "description": "Put an event in the calendar.",
        "parameters": {"type": "object", "properties": {
            "title": NAME,
            "start": {"type": "object", "properties": {
                "day": {"type": "integer", "minimum": 1, "maximum": 31}, "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
                "required": ["day", "hour"], "additionalProperties": False},
            "attendees": {"type": "array", "maxItems": 4, "items": NAME}},
            "required": ["title", "start", "attendees"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_products", "description": "Search the shop's catalogue.",
        "parameters": {"type": "object", "properties": {
            "query": NAME,
            "filters": {"type": "object", "properties": {
                "category": {"enum": ["books", "garden", "kitchen", "toys"]},
                "max_price": {"type": "integer", "minimum": 1, "maximum": 5000}},
                "required": ["category"], "additionalProperties": False},
            "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
            "required": ["query", "filters", "limit"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SYSTEM = "You are the assistant of a travel and shopping service. Use the tools to act on the user's requests."

CITIES = ["Paris", "Lisbon", "Osaka", "Nairobi", "Lima", "Oslo", "Hanoi", "Quito", "Porto", "Cairo"]
PEOPLE = ["Ann", "Bilal", "Chen", "Dora", "Emeka", "Farah", "Goran", "Hana", "Ines", "Jonas"]
ASKS = {
    "get_weather": ["What's the weather in {city}?", "Is it cold in {city} today, in fahrenheit?", "Weather for {city} please."],
    "book_flight": ["Book a flight from {city} to {city2} on 2027-03-{day:02d} for {person}, aged {age}.",
                    "{person} ({age}) and {person2} need seats {city} -> {city2} on 2027-11-{day:02d}."],
    "convert_currency": ["Convert {amount} EUR to USD.", "How many yen is {amount} pounds?", "{amount} dollars in euros?"],
    "create_event": ["Schedule '{person} sync' on day {day} at {hour}h with {person2}.", "Calendar: dentist, the {day}th at {hour}:00."],
    "search_products": ["Find {thing} under {amount} in {category}.", "Show me 5 {thing} from the {category} section."],
}  # fmt: skip


def requests() -> list[tuple[str, str]]:
    """100 varied (prompt, intended tool) pairs, five tools in turn."""
    out = []
    counter = itertools.count()
    for i in range(100):
        tool = list(ASKS)[i % 5]
        asks = ASKS[tool]
        k = next(counter)
        prompt = asks[(i // 5) % len(asks)].format(
            city=CITIES[k % 10], city2=CITIES[(k * 3 + 1) % 10], person=PEOPLE[k % 10], person2=PEOPLE[(k + 4) % 10],
            age=18 + k % 60, day=1 + k % 28, hour=8 + k % 10, amount=10 * (1 + k % 50),
            thing=["mugs", "novels", "rakes", "puzzles"][k % 4], category=["kitchen", "books", "garden", "toys"][k % 4],
        )  # fmt: skip
        out.append((prompt, tool))
    return out


@pytest.fixture(scope="module")
def runtime():
    """One engine of the bundled model for the module's tests."""
    with Runtime(max_num_seqs=64) as runtime:
        yield runtime


@pytest.fixture
def client(runtime):
    return AsyncClient(runtime=runtime)


async def test_100_required_requests_all_give_valid_calls(client):
    """100 varied requests over five tools, the pick left to the model: every reply is one valid call."""
    pairs = requests()
    results = await client.batch(
        [[ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content=p)] for p, _ in pairs],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=256, temperature=0,
    )  # fmt: skip
    for (prompt, _), result in zip(pairs, results):
        assert result.finish_reason == "tool_calls" and len(result.tool_calls) == 1, (prompt, result.text)
        call = result.tool_calls[0]
        jsonschema.validate(call.arguments, SCHEMAS[call.name])
    stats = client.stats()
    assert stats["prefix_cache_hits"] > 0.5 * stats["prefix_cache_queries"]  # the tools and system prompt, once


async def test_named_tools_are_called_with_valid_arguments(client):
    """Each tool named in turn, over four of its own requests."""
    pairs = requests()
    for tool in ASKS:
        prompts = [p for p, t in pairs if t == tool][:4]
        results = await client.batch(
            [[ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content=p)] for p in prompts],
            tools=TOOLS, tool_choice={"type": "function", "function": {"name": tool}}, max_tokens=256, temperature=0,
        )  # fmt: skip
        for result in results:
            assert [c.name for c in result.tool_calls] == [tool]
            jsonschema.validate(result.tool_calls[0].arguments, SCHEMAS[tool])


async def test_auto_gives_text_or_valid_calls(client):
    results = await client.batch(
        [[ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content=p)] for p, _ in requests()[:20]],
        tools=TOOLS, max_tokens=120, temperature=0.7, seed=1,
    )  # fmt: skip
    for result in results:
        for call in result.tool_calls or ():
            jsonschema.validate(call.arguments, SCHEMAS[call.name])
        if result.finish_reason != "length":
            assert "<tool_call>" not in result.text


async def test_a_six_turn_agent_conversation_computes_only_each_turns_new_tokens(client):
    """Calls, tool results and answers re-sent each turn: from turn 2 on, each turn computes at most its
    new prompt tokens plus two blocks."""
    await client.start()
    history = [ChatMessage(role="system", content=SYSTEM)]
    asks = ["What's the weather in Oslo?", "Convert 120 EUR to USD.", "Find mugs under 30 in kitchen."]
    previous_prompt = 0
    block_size = 16
    for turn in range(6):
        if turn % 2 == 0:
            history.append(ChatMessage(role="user", content=asks[turn // 2]))
        before = client.stats()["prompt_tokens_computed"]
        result = await client.chat(
            history, tools=TOOLS, tool_choice="required" if turn % 2 == 0 else "none", max_tokens=60, temperature=0,
            parallel_tool_calls=False,
        )  # fmt: skip
        computed = client.stats()["prompt_tokens_computed"] - before
        if turn:
            new_tokens = result.usage.prompt_tokens - previous_prompt
            assert computed <= new_tokens + 2 * block_size, (turn, computed, new_tokens)
        previous_prompt = result.usage.prompt_tokens
        history.append(result.message)
        if result.tool_calls:
            history += [ChatMessage(role="tool", content='{"ok": true}', tool_call_id=c.id) for c in result.tool_calls]
