"""LlamaIndex function calling on PagedLLM, on the engine.

The tiny random-weight model follows no format by itself: a call that validates against its
tool's schema was made to.
"""

from __future__ import annotations

from typing import Literal

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field

from sdk import LengthFinishReasonError
from sdk.integrations.llamaindex import PagedLLM, to_sdk_messages

QUESTION = "What is the weather in Paris, and what is 6 times 7?"


class WeatherArgs(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["C", "F"] = "C"


class MultiplyArgs(BaseModel):
    a: int = Field(ge=-100, le=100)
    b: int = Field(ge=-100, le=100)


def weather(city: str, unit: str = "C") -> str:
    return f"Sunny and 21 {unit} in {city}."


def multiply(a: int, b: int) -> int:
    return a * b


TOOLS = [
    FunctionTool.from_defaults(fn=weather, description="The current weather of a city.", fn_schema=WeatherArgs),
    FunctionTool.from_defaults(fn=multiply, description="Multiply two integers.", fn_schema=MultiplyArgs),
]
SCHEMAS = {t.metadata.name: t.metadata.fn_schema for t in TOOLS}


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> PagedLLM:
    return PagedLLM(model=str(tiny_model_factory("llama")), engine_config={"num_blocks": 256}, max_tokens=120, temperature=0)


def _calls(llm: PagedLLM, response) -> list[tuple[str, dict]]:
    return [(s.tool_name, s.tool_kwargs) for s in llm.get_tool_calls_from_response(response)]


async def test_required_tool_calls_validate_against_the_tools_schemas(llm):
    assert isinstance(llm, FunctionCallingLLM) and llm.metadata.is_function_calling_model
    response = llm.chat_with_tools(TOOLS, QUESTION, tool_required=True)
    selections = llm.get_tool_calls_from_response(response)
    assert len(selections) == 1  # allow_parallel_tool_calls defaults to False
    for s in selections:
        SCHEMAS[s.tool_name].model_validate(s.tool_kwargs)
        assert s.tool_id.startswith("call_")
    assert response.additional_kwargs["finish_reason"] == "tool_calls"
    assert _calls(llm, await llm.achat_with_tools(TOOLS, QUESTION, tool_required=True)) == _calls(llm, response)


async def test_a_named_tool_choice_calls_that_tool(llm):
    response = await llm.achat_with_tools(TOOLS, QUESTION, tool_choice="multiply")
    [(name, kwargs)] = _calls(llm, response)
    assert name == "multiply" and SCHEMAS[name].model_validate(kwargs)


def test_no_call_is_an_error_only_when_asked(llm):
    response = llm.chat_with_tools(TOOLS, QUESTION, tool_choice="none")
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="tool call"):
        llm.get_tool_calls_from_response(response)


def test_predict_and_call_runs_the_chosen_tool(llm):
    result = llm.predict_and_call(TOOLS, QUESTION, tool_required=True)
    [source] = result.sources
    assert not source.is_error and source.tool_name in SCHEMAS
    assert result.response == str(dict(zip(SCHEMAS, TOOLS))[source.tool_name](**source.raw_input["kwargs"]))


async def test_streaming_with_tools_ends_with_the_same_calls(llm):
    expected = _calls(llm, llm.chat_with_tools(TOOLS, QUESTION, tool_required=True))
    streamed = list(llm.stream_chat_with_tools(TOOLS, QUESTION, tool_required=True))
    assert _calls(llm, streamed[-1]) == expected
    counts = [len(llm.get_tool_calls_from_response(r, error_on_no_tool_call=False)) for r in streamed]
    assert counts[0] == 0 and counts[-1] == 1  # the call shows once it is whole
    stream = await llm.astream_chat_with_tools(TOOLS, QUESTION, tool_required=True)
    assert _calls(llm, [r async for r in stream][-1]) == expected


async def test_parallel_calls_cut_by_max_tokens_raise(llm):
    """Greedy, the random model calls again and again until max_tokens cuts a call: every form raises."""
    kwargs = dict(tool_required=True, allow_parallel_tool_calls=True)
    with pytest.raises(LengthFinishReasonError):
        llm.chat_with_tools(TOOLS, QUESTION, **kwargs)
    with pytest.raises(LengthFinishReasonError):
        list(llm.stream_chat_with_tools(TOOLS, QUESTION, **kwargs))
    with pytest.raises(LengthFinishReasonError):
        [r async for r in await llm.astream_chat_with_tools(TOOLS, QUESTION, **kwargs)]


async def test_a_tool_result_history_round_trips(llm):
    user = ChatMessage(role=MessageRole.USER, content=QUESTION)
    first = await llm.achat_with_tools(TOOLS, user, tool_required=True)
    [selection] = llm.get_tool_calls_from_response(first)
    tool = dict(zip(SCHEMAS, TOOLS))[selection.tool_name]
    result = ChatMessage(
        role=MessageRole.TOOL,
        content=str(tool(**selection.tool_kwargs)),
        additional_kwargs={"tool_call_id": selection.tool_id},
    )
    history = [user, first.message, result]

    sdk_user, sdk_call, sdk_result = to_sdk_messages(history)
    [call] = sdk_call.tool_calls
    assert (call.id, call.name, call.arguments) == (selection.tool_id, selection.tool_name, selection.tool_kwargs)
    assert (sdk_result.role, sdk_result.tool_call_id, sdk_result.content) == ("tool", selection.tool_id, result.content)

    second = await llm.achat_with_tools(TOOLS, chat_history=history)
    usage = second.additional_kwargs["usage"]
    assert usage["cached_tokens"] > 0  # the re-sent turns render as before: their KV comes from the cache
    assert second.message.role == MessageRole.ASSISTANT
