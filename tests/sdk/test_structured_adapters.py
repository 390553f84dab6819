"""Structured output through the LangChain and LlamaIndex adapters, on the engine.

The tiny random-weight model follows no format by itself: an object that validates was made to.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

import jsonschema
import pytest
from langchain_core.messages import AIMessage
from langchain_core.utils.function_calling import convert_to_json_schema
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.prompts import PromptTemplate
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from sdk import LengthFinishReasonError
from sdk.integrations import langchain
from sdk.integrations.langchain import PagedChat
from sdk.integrations.llamaindex import PagedLLM


class Pet(BaseModel):
    """A pet."""

    name: str = Field(max_length=10)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


class PetDict(TypedDict):
    """A pet."""

    kind: Annotated[Literal["cat", "dog", "fish"], ..., "the kind of animal"]
    indoor: bool


PET_SCHEMA = {
    "title": "pet",
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
    "required": ["name", "legs"],
}
OPTIONS = {"max_tokens": 200, "temperature": 0}


@pytest.fixture(scope="module")
def tiny_model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture
def chat(tiny_model) -> PagedChat:
    return PagedChat(model=tiny_model, engine_config={"num_blocks": 256}, **OPTIONS)


@pytest.fixture
def llm(tiny_model) -> PagedLLM:
    return PagedLLM(model=tiny_model, engine_config={"num_blocks": 256}, **OPTIONS)


# --- LangChain ----------------------------------------------------------------------------


def test_a_pydantic_schema_gives_instances_on_invoke_and_stream(chat):
    structured = chat.with_structured_output(Pet)
    pet = structured.invoke("Describe a pet.")
    assert isinstance(pet, Pet)
    chunks = list(structured.stream("Describe a pet."))
    assert chunks and all(isinstance(c, Pet) for c in chunks)
    assert chunks[-1] == pet


@pytest.mark.parametrize("schema", [PetDict, PET_SCHEMA], ids=["typeddict", "json_schema"])
async def test_typeddict_and_json_schemas_give_valid_dicts(chat, schema):
    structured = chat.with_structured_output(schema)
    result = await structured.ainvoke("Describe a pet.")
    jsonschema.validate(result, convert_to_json_schema(schema))
    assert [c async for c in structured.astream("Describe a pet.")][-1] == result


@pytest.mark.parametrize("schema", [Pet, PET_SCHEMA], ids=["pydantic", "json_schema"])
async def test_function_calling_forces_the_schemas_tool(chat, schema):
    """The reply is one call of the schema's tool; the result is its arguments, on invoke and stream."""
    out = await chat.with_structured_output(schema, method="function_calling", include_raw=True).ainvoke("A pet?")
    calls = out["raw"].tool_calls
    assert len(calls) == 1 and calls[0]["name"] == ("Pet" if schema is Pet else "pet")
    assert out["raw"].response_metadata["finish_reason"] == "tool_calls" and out["parsing_error"] is None
    assert out["parsed"] == (Pet(**calls[0]["args"]) if schema is Pet else calls[0]["args"])
    structured = chat.with_structured_output(schema, method="function_calling")
    assert [c async for c in structured.astream("A pet?")][-1] == out["parsed"]


def test_json_mode_gives_a_json_object_and_a_cut_one_raises(chat):
    result = chat.with_structured_output(method="json_mode", temperature=1.0, seed=0).invoke("A pet, as JSON.")
    assert isinstance(result, dict)  # a seed whose object closes
    with pytest.raises(LengthFinishReasonError):  # greedy, the object never closes: no partial dict
        chat.with_structured_output(method="json_mode").invoke("A pet, as JSON.")


def test_include_raw_keeps_the_message_and_reports_parsing_errors(chat):
    out = chat.with_structured_output(Pet, include_raw=True).invoke("Describe a pet.")
    assert isinstance(out["raw"], AIMessage) and out["parsing_error"] is None
    assert out["parsed"] == Pet.model_validate_json(out["raw"].content)
    assert out["raw"].usage_metadata["output_tokens"] > 0
    cut = chat.with_structured_output(Pet, include_raw=True, max_tokens=3).invoke("Describe a pet.")
    assert cut["parsed"] is None and cut["parsing_error"] is not None
    assert cut["raw"].response_metadata["finish_reason"] == "length"


def test_response_format_as_a_call_option(chat, tiny_model):
    message = chat.invoke("Describe a pet.", response_format=Pet)
    assert Pet.model_validate_json(message.content)
    streamed = "".join(c.content for c in chat.stream("Describe a pet.", response_format=PET_SCHEMA))
    jsonschema.validate(json.loads(streamed), PET_SCHEMA)
    completion = langchain.PagedLLM(model=tiny_model, engine_config={"num_blocks": 256}, **OPTIONS)
    assert Pet.model_validate_json(completion.invoke("A pet:", response_format=Pet))


def test_bad_arguments_are_refused_when_binding(chat):
    with pytest.raises(ValueError, match="needs a schema"):
        chat.with_structured_output(None)
    with pytest.raises(ValueError, match="unknown method"):
        chat.with_structured_output(Pet, method="xml")
    with pytest.raises(ValueError, match="unsupported argument"):
        chat.with_structured_output(Pet, functions=[])


# --- LlamaIndex ---------------------------------------------------------------------------

PROMPT = PromptTemplate("Describe a pet called {name}.")


async def test_structured_predict_sync_and_async(llm):
    pet = llm.structured_predict(Pet, PROMPT, name="Rex")
    assert isinstance(pet, Pet)
    assert await llm.astructured_predict(Pet, PROMPT, name="Rex") == pet


async def test_stream_structured_predict_ends_with_the_whole_object(llm):
    pet = llm.structured_predict(Pet, PROMPT, name="Rex")
    assert list(llm.stream_structured_predict(Pet, PROMPT, name="Rex"))[-1] == pet
    assert [p async for p in await llm.astream_structured_predict(Pet, PROMPT, name="Rex")][-1] == pet


async def test_as_structured_llm_chats_in_objects(llm):
    structured = llm.as_structured_llm(Pet)
    messages = [ChatMessage(role=MessageRole.USER, content="Describe a pet.")]
    response = structured.chat(messages)
    assert isinstance(response.raw, Pet)
    assert Pet.model_validate_json(response.message.content) == response.raw
    assert isinstance((await structured.achat(messages)).raw, Pet)



class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    address: Address


def test_the_bundled_model_extracts_a_nested_object():
    """The nested object validates and carries the text's name, age and city. The country is left to the
    model: the bundled 135M model in its file's 4-bit blocks (int8 activations, as llama.cpp runs it) names
    another country than its float32 dequantization does. float32: with the bfloat16 cache the file gets by
    default on a CPU with AVX512-BF16, one full run on a busy machine named another city (prompt chunks follow
    the measured step times there, and bfloat16 tiles are not batch-invariant)."""
    llm = PagedLLM(max_tokens=100, temperature=0, engine_config={"dtype": "float32"})
    prompt = PromptTemplate("Extract the person from this text: {text}")
    person = llm.structured_predict(Person, prompt, text="Maria Lopez is 34 years old and lives in Madrid, Spain.")
    assert isinstance(person, Person) and person.address.country
    assert (person.name, person.age, person.address.city) == ("Maria Lopez", 34, "Madrid")
