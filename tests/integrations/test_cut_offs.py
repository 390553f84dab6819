"""A reply cut by ``max_tokens`` inside its constraint, on every route, on the bundled model (``sdk.cut_off``).

The note's title needs more characters than a dozen tokens hold, and the call's head alone takes most
of its tokens: the cut is certain. No route may return a parsed object or a half call.
"""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel, Field

from integrations.openai_server.app import create_app
from integrations.openai_server.serving import Serving
from sdk import AsyncClient, LengthFinishReasonError, Runtime

KEY = "sk-cut-offs"
NOTE_PROMPT = "Write a note about cats."
SEARCH_PROMPT = "Find books about whales."
NOTE_CUT = 12  # tokens: the reply stops inside the title's string ('{"title": "A cat is')
CALL_CUT = 18  # tokens: the call stops inside its query's string


class Note(BaseModel):
    title: str = Field(min_length=200)


class Search(BaseModel):
    """Search the library catalogue."""

    query: str


def search(query: str) -> str:
    """Search the library catalogue."""
    return "Moby-Dick"


@pytest.fixture(scope="module")
def runtime():
    """One engine of the bundled model for the module's routes."""
    with Runtime(max_num_seqs=8) as runtime:
        runtime.run_sync(runtime.start())
        yield runtime


async def test_the_sdk_marks_a_cut_reply_and_raise_for_cut_off_raises(runtime):
    client = AsyncClient(runtime=runtime)
    note = await client.chat(NOTE_PROMPT, response_format=Note, max_tokens=NOTE_CUT, temperature=0)
    assert (note.finish_reason, note.parsed, note.choices[0].cut_off) == ("length", None, True)
    assert note.text.startswith('{"title": "')
    with pytest.raises(LengthFinishReasonError) as caught:
        note.raise_for_cut_off()
    assert (caught.value.text, caught.value.max_tokens, caught.value.request_id) == (note.text, NOTE_CUT, note.request_id)
    call = await client.chat(SEARCH_PROMPT, tools=[search], tool_choice="required", max_tokens=CALL_CUT, temperature=0)
    assert (call.finish_reason, call.tool_calls, call.choices[0].cut_off) == ("length", None, True)
    plain = await client.chat(NOTE_PROMPT, max_tokens=NOTE_CUT, temperature=0)  # no constraint: an ordinary length
    assert plain.finish_reason == "length" and not plain.choices[0].cut_off
    assert plain.raise_for_cut_off() is plain


def test_paged_chat_raises_as_chat_openai_does_and_include_raw_reports_it(runtime):
    from sdk.integrations.langchain import PagedChat

    chat = PagedChat(runtime=runtime, temperature=0, max_tokens=NOTE_CUT)
    with pytest.raises(LengthFinishReasonError):
        chat.invoke(NOTE_PROMPT, response_format=Note)
    with pytest.raises(LengthFinishReasonError):
        chat.with_structured_output(Note).invoke(NOTE_PROMPT)
    with pytest.raises(LengthFinishReasonError):
        list(chat.with_structured_output(Note).stream(NOTE_PROMPT))
    # NOTE: a dict schema is parsed unvalidated: LangChain's partial-JSON parser would close the open string
    out = chat.with_structured_output(Note.model_json_schema(), include_raw=True).invoke(NOTE_PROMPT)
    assert out["raw"].content.startswith('{"title": "') and out["raw"].response_metadata["finish_reason"] == "length"
    assert out["parsed"] is None and isinstance(out["parsing_error"], LengthFinishReasonError)
    assert (out["parsing_error"].text, out["parsing_error"].max_tokens) == (out["raw"].content, NOTE_CUT)
    called = chat.with_structured_output(Search, method="function_calling", include_raw=True, max_tokens=CALL_CUT)
    out = called.invoke(SEARCH_PROMPT)
    assert out["parsed"] is None and isinstance(out["parsing_error"], LengthFinishReasonError)
    with pytest.raises(LengthFinishReasonError):
        chat.bind_tools([search], tool_choice="required", max_tokens=CALL_CUT).invoke(SEARCH_PROMPT)


async def test_llamaindex_structured_predict_and_function_agent_raise(runtime):
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.prompts import PromptTemplate
    from llama_index.core.tools import FunctionTool

    from sdk.integrations.llamaindex import PagedLLM

    llm = PagedLLM(runtime=runtime, temperature=0, max_tokens=NOTE_CUT)
    with pytest.raises(LengthFinishReasonError):
        llm.structured_predict(Note, PromptTemplate(NOTE_PROMPT))
    with pytest.raises(LengthFinishReasonError):
        await llm.astructured_predict(Note, PromptTemplate(NOTE_PROMPT))
    agent = FunctionAgent(
        tools=[FunctionTool.from_defaults(fn=search)], initial_tool_choice="search",
        llm=PagedLLM(runtime=runtime, temperature=0, max_tokens=CALL_CUT),
    )  # fmt: skip
    with pytest.raises(LengthFinishReasonError):
        await agent.run(user_msg=SEARCH_PROMPT)


async def test_the_server_answers_length_so_the_openai_client_raises(runtime, live_server):
    server = live_server(create_app(api_key=KEY, serving_factory=lambda: Serving(runtime.engine, owns_engine=False)))
    client = server.openai(KEY)
    note = dict(model=server.model_name, messages=[{"role": "user", "content": NOTE_PROMPT}], max_tokens=NOTE_CUT, temperature=0)
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(response_format=Note, **note)
    with pytest.raises(openai.LengthFinishReasonError), client.chat.completions.stream(response_format=Note, **note) as stream:
        list(stream)
    call = dict(
        model=server.model_name, messages=[{"role": "user", "content": SEARCH_PROMPT}], max_tokens=CALL_CUT, temperature=0,
        tools=[openai.pydantic_function_tool(Search)], tool_choice="required",
    )  # fmt: skip
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(**call)
    created = client.chat.completions.create(**call).choices[0]
    assert created.finish_reason == "length" and not created.message.tool_calls
    async with AsyncClient(base_url=server.base_url, api_key=KEY) as remote:  # the SDK over HTTP marks it the same
        cut = await remote.chat(NOTE_PROMPT, response_format=Note, max_tokens=NOTE_CUT, temperature=0)
        assert (cut.finish_reason, cut.parsed, cut.choices[0].cut_off) == ("length", None, True)
