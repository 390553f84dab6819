"""``response_format`` in the SDK: every spelling maps onto one engine constraint, and replies parse.

The tiny random-weight model follows no format by itself: a reply that parses was made to.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from engine.errors import ParameterError
from engine.structured_output import StructuredOutput
from sdk import AsyncClient, InvalidRequestError
from sdk.fields import from_engine
from sdk.hooks import Hook, RequestContext
from sdk.response_format import JsonSchemaFormat, TextFormat, to_response_format, to_structured_output
from sdk.types import ChatRequest
from sdk.wire import format_from_wire, format_to_wire, wire_param


class Address(BaseModel):
    city: str = Field(max_length=12)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)
    address: Address


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]}


@pytest.mark.parametrize(
    ("spelling", "expected"),
    [
        (Person, StructuredOutput(json_schema=Person.model_json_schema())),
        (SCHEMA, StructuredOutput(json_schema=SCHEMA)),
        (json.dumps(SCHEMA), StructuredOutput(json_schema=SCHEMA)),
        ({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}, StructuredOutput(json_schema=SCHEMA)),
        ({"type": "json_object"}, StructuredOutput(json_object=True)),
        ({"type": "regex", "regex": "[a-z]+"}, StructuredOutput(regex="[a-z]+")),
        ({"type": "choice", "choice": ["yes", "no"]}, StructuredOutput(choice=("yes", "no"))),
        ({"type": "grammar", "grammar": 'root ::= "a"'}, StructuredOutput(grammar='root ::= "a"')),
        ({"type": "text"}, None),
        (None, None),
    ],
)
def test_every_spelling_is_one_engine_constraint(spelling, expected):
    assert to_structured_output(to_response_format(spelling)) == expected


@pytest.mark.parametrize(
    ("spelling", "param"),
    [
        (42, "response_format"),
        ("{not json", "response_format"),
        ({"type": "regex"}, "response_format.regex"),
        ({"type": "choice", "choice": []}, "response_format.choice"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "nme": "typo"}}, "response_format.json_schema.nme"),
        ({"type": "choice", "choice": ["x"] * 1000}, "response_format"),  # past the engine's MAX_CHOICES
    ],
)
def test_bad_spellings_name_the_field(spelling, param):
    with pytest.raises(InvalidRequestError) as info:
        to_structured_output(to_response_format(spelling))
    assert info.value.param == param


def test_requests_take_a_model_class_and_keep_it_for_parsing():
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}], response_format=Person)
    assert isinstance(request.response_format, JsonSchemaFormat)
    assert request.response_format.json_schema.name == "Person"
    assert isinstance(ChatRequest(messages=[{"role": "user", "content": "hi"}], response_format={"type": "text"}).response_format, TextFormat)


@pytest.mark.parametrize(
    "spelling",
    [Person, {"type": "json_object"}, {"type": "regex", "regex": "[a-z]+"}, {"type": "choice", "choice": ["a", "b"]},
     {"type": "grammar", "grammar": 'root ::= "a"'}],
)  # fmt: skip
def test_the_wire_carries_each_format_both_ways(spelling):
    fmt = to_response_format(spelling)
    body = format_to_wire(fmt)
    back, field = format_from_wire(body)
    assert to_structured_output(to_response_format(back)) == to_structured_output(fmt)
    assert field.split(".")[0] in ("response_format", "structured_outputs")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"guided_regex": "[0-9]+"}, "guided_regex"),
        ({"guided_choice": ["a", "b"]}, "guided_choice"),
        ({"guided_json": SCHEMA}, "guided_json"),
        ({"guided_grammar": 'root ::= "a"'}, "guided_grammar"),
        ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs.json"),
        ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object"),
        ({"response_format": {"type": "text"}}, None),
        ({}, None),
    ],
)
def test_vllm_spellings_from_the_wire(body, field):
    fmt, got = format_from_wire(body)
    assert got == field
    if field is not None:
        assert to_structured_output(to_response_format(fmt)) is not None


def test_two_constraints_in_one_body_are_refused():
    with pytest.raises(InvalidRequestError) as info:
        format_from_wire({"response_format": {"type": "json_object"}, "guided_regex": "a"})
    assert info.value.param == "guided_regex"
    with pytest.raises(InvalidRequestError) as info:
        format_from_wire({"structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert info.value.param == "structured_outputs"


# --- on the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture
async def client(tiny_model):
    client = AsyncClient(tiny_model, num_blocks=256, max_num_seqs=16)
    yield client
    await client.aclose()


async def test_a_model_class_reply_parses_into_it(client):
    results = await client.batch(
        [f"Describe person {i}." for i in range(4)], response_format=Person, max_tokens=400, temperature=0.8, seed=1
    )
    for result in results:
        assert result.finish_reason == "stop"
        assert isinstance(result.parsed, Person)
        assert result.parsed == Person.model_validate_json(result.text)


async def test_n_completions_each_parse(client):
    result = await client.chat("Pick a number.", response_format=SCHEMA, n=3, max_tokens=40, temperature=1.0, seed=3)
    assert len(result.choices) == 3
    for choice in result.choices:
        jsonschema.validate(choice.parsed, SCHEMA)
        assert choice.parsed == json.loads(choice.text)


async def test_regex_choice_and_grammar_replies_match(client):
    regex = await client.chat("Code?", response_format={"type": "regex", "regex": "[A-Z]{2}-[0-9]{3}"}, max_tokens=20)
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", regex.text) and regex.parsed is None
    choice = await client.chat("Colour?", response_format={"type": "choice", "choice": ["red", "green"]}, max_tokens=20)
    assert choice.text in ("red", "green")
    grammar = 'root ::= "(" [1-9] " + " [1-9] ")"'
    sum_ = await client.complete("Sum:", response_format={"type": "grammar", "grammar": grammar}, max_tokens=20)
    assert re.fullmatch(r"\([1-9] \+ [1-9]\)", sum_.text)


async def test_a_reply_cut_short_has_no_parsed_value(client):
    result = await client.chat("Describe someone.", response_format=Person, max_tokens=3)
    assert result.finish_reason == "length" and result.parsed is None


async def test_a_bad_constraint_is_refused_and_the_engine_serves_on(client):
    with pytest.raises(InvalidRequestError) as info:
        await client.chat("hi", response_format={"type": "regex", "regex": "[a-"}, max_tokens=4)
    assert info.value.param == "response_format.regex" and "response_format.regex is invalid" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        await client.chat("hi", response_format={"type": "object", "properties": {"a": {"type": "nonsense"}}})
    assert info.value.param == "response_format.json_schema.schema"
    result = await client.chat("hi", response_format=SCHEMA, max_tokens=60, temperature=0)
    assert result.finish_reason == "stop" and 1 <= result.parsed["n"] <= 9


async def test_hooks_see_the_constrained_text(tiny_model):
    seen: list[str] = []

    class Record(Hook):
        async def on_finish(self, ctx: RequestContext) -> None:
            seen.append(ctx.output_texts[0])

    client = AsyncClient(tiny_model, num_blocks=256, hooks=[Record()])
    result = await client.chat("Colour?", response_format={"type": "choice", "choice": ["red", "green"]})
    await client.aclose()
    assert seen == [result.text]


def test_the_wire_refuses_what_it_cannot_honour():
    with pytest.raises(InvalidRequestError) as info:
        format_from_wire({"response_format": {"type": "regex", "regex": "a"}})  # the SDK's form, not OpenAI's
    assert info.value.param == "response_format.type"
    with pytest.raises(InvalidRequestError) as info:
        format_from_wire({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}})
    assert info.value.param == "structured_outputs.whitespace_pattern"
    assert format_from_wire({"structured_outputs": {"regex": "a", "backend": "xgrammar"}})[1] == "structured_outputs.regex"


@pytest.mark.parametrize(
    ("field", "param", "wire"),
    [
        ("response_format", "response_format.json_schema.nme", "response_format.json_schema.nme"),
        ("response_format", "response_format", "response_format"),
        ("guided_regex", "response_format", "guided_regex"),
        ("guided_choice", "response_format.choice.2", "guided_choice.2"),
        ("structured_outputs.json", "response_format.json_schema.name", "structured_outputs.json"),
        ("structured_outputs.json_object", "response_format", "structured_outputs.json_object"),
    ],
)
def test_sdk_params_follow_the_wire_field(field, param, wire):
    assert wire_param("chat", param, field) == wire


def test_an_error_renamed_for_the_wire_names_the_wire_field_in_its_message():
    """An engine error about a constraint names the SDK's field in the SDK, the body's field on the wire; its reason stays."""
    engine_error = ParameterError.about("structured_output.regex", "is invalid: unterminated [")
    sdk_error = from_engine(engine_error)
    assert (sdk_error.param, str(sdk_error)) == ("response_format.regex", "response_format.regex is invalid: unterminated [")
    wire_error = sdk_error.at(wire_param("chat", sdk_error.param, "guided_regex"))
    assert (wire_error.param, str(wire_error)) == ("guided_regex", "guided_regex is invalid: unterminated [")
    untold = InvalidRequestError("prompt has 900 tokens; max_model_len is 512", param="prompt")
    assert str(untold.at(wire_param("chat", "prompt"))) == str(untold)  # no reason: the message is kept
