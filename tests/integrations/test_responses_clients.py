"""Real clients of the Responses API against `paged serve` on the bundled SmolLM2-135M-Instruct: the openai
client (create, stream, parse), the OpenAI Agents SDK (tools, structured output, chained turns) and LangChain's
``ChatOpenAI(use_responses_api=True)``."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field

from integrations.openai_server.app import create_app
from tests.integrations.conftest import LiveServer

KEY = "sk-responses"
BLOCK_SIZE = 16
WEATHER = {
    "type": "function", "name": "get_weather", "description": "Today's weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                   "additionalProperties": False},
}  # fmt: skip


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Report(BaseModel):
    city: str = Field(max_length=20)
    weather: str = Field(max_length=60)


@pytest.fixture(scope="module")
def server() -> Any:
    live = LiveServer(create_app(api_key=KEY, num_blocks=512, max_num_seqs=8, max_model_len=2048)).start()
    yield live
    live.stop()


def test_openai_create_continue_stream_and_parse(server) -> None:
    """``responses.create`` (a chain of two), ``responses.stream`` and ``responses.parse`` into a pydantic model, streamed and not."""
    client = server.openai(KEY)
    model = server.model_name
    ask = dict(model=model, instructions="Answer in one short sentence.", max_output_tokens=24, temperature=0)
    first = client.responses.create(input="What is the capital of France?", **ask)
    assert first.status == "completed" and "Paris" in first.output_text
    second = client.responses.create(input="And of Germany?", previous_response_id=first.id, **ask)
    assert "Berlin" in second.output_text
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // BLOCK_SIZE * BLOCK_SIZE
    with client.responses.stream(input="What is the capital of France?", **ask) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        streamed = stream.get_final_response()
    assert "".join(deltas) == streamed.output_text == first.output_text
    raw = list(client.responses.create(input="What is the capital of France?", stream=True, **ask))
    assert raw[-1].type == "response.completed" and raw[-1].response.output_text == first.output_text
    city = dict(model=model, input="The largest city of Japan, as JSON.", text_format=City, max_output_tokens=60, temperature=0)
    parsed = client.responses.parse(**city)
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name
    with client.responses.stream(**city) as stream:
        list(stream)
        assert stream.get_final_response().output_parsed == parsed.output_parsed


def test_openai_agents_sdk_runs_tools_and_structured_output(server) -> None:
    """An agent with two function tools and a structured final output, on ``OpenAIResponsesModel``; its turns chain by
    ``previous_response_id`` (each sends only its new items) and read the history from the prefix cache."""
    import asyncio

    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Today's weather in a city."""
        called.append(f"get_weather:{city}")
        return f"Sunny and 21 degrees in {city}."

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        called.append(f"get_time:{city}")
        return "14:05"

    class FirstStepForced(OpenAIResponsesModel):
        """``tool_choice="required"`` forces the first step's call; a 135M model then calls again under ``auto``, so the
        step that reads a tool's result answers (``none``): the engine holds it to the output schema."""

        async def get_response(self, system_instructions, input, model_settings, *args, **kwargs):  # type: ignore[no-untyped-def]
            if isinstance(input, list) and input and input[-1].get("type") == "function_call_output":
                model_settings = dataclasses.replace(model_settings, tool_choice="none")
            return await super().get_response(system_instructions, input, model_settings, *args, **kwargs)

    async def run() -> tuple[Any, Any]:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
        agent = Agent(
            name="weather", instructions="You report the weather of a city. Call get_weather, then answer.",
            tools=[get_weather, get_time], output_type=Report,
            model=FirstStepForced(model=server.model_name, openai_client=client),
            model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=120, parallel_tool_calls=False),
        )  # fmt: skip
        first = await Runner.run(agent, "What is the weather in Paris?", auto_previous_response_id=True, max_turns=4)
        second = await Runner.run(agent, "And in Rome?", previous_response_id=first.last_response_id,
                                  auto_previous_response_id=True, max_turns=4)  # fmt: skip
        await client.close()
        return first, second

    first, second = asyncio.run(run())
    assert isinstance(first.final_output, Report) and isinstance(second.final_output, Report)
    assert "Sunny" in first.final_output.weather and called[0].startswith("get_weather:")
    responses = [*first.raw_responses, *second.raw_responses]
    assert len(responses) == 4  # a call and an answer per run
    for before, after in zip(responses, responses[1:]):
        history = before.usage.input_tokens + before.usage.output_tokens
        assert after.usage.input_tokens_details.cached_tokens >= history - 2 * BLOCK_SIZE


def test_langchain_chat_openai_on_the_responses_api(server) -> None:
    """``ChatOpenAI(use_responses_api=True)``: invoke, bind_tools with a forced call, with_structured_output."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=server.model_name, base_url=server.base_url, api_key=KEY, use_responses_api=True,
                      temperature=0, max_tokens=60, max_retries=0)  # fmt: skip
    reply = chat.invoke("What is the capital of France? Answer in one short sentence.")
    assert "Paris" in reply.text and reply.usage_metadata["input_tokens"] > 0
    calls = chat.bind_tools([WEATHER], tool_choice="required", parallel_tool_calls=False).invoke("Weather in Paris?").tool_calls
    assert [call["name"] for call in calls] == ["get_weather"] and isinstance(calls[0]["args"]["city"], str)
    city = chat.with_structured_output(City).invoke("The largest city of Japan, as JSON.")
    assert isinstance(city, City) and city.name
    assert json.loads(City.model_validate(city).model_dump_json())["name"] == city.name
