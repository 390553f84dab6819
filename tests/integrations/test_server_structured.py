"""Structured output over HTTP on the real engine (tiny random-weight model): every wire spelling, streaming, errors.

The random weights follow no format by themselves: a reply that parses was made to.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Callable, Literal

import aiohttp
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from integrations.openai_server.app import create_app

KEY = "sk-structured"
ENGINE_CONFIG = dict(num_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=512)
MESSAGES = [{"role": "user", "content": "Describe someone."}]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=2)


SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}, "word": {"type": "string", "maxLength": 8}},
    "required": ["n", "word"],
    "additionalProperties": False,
}
REGEX = "[A-Z]{2}-[0-9]{3}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= "(" [1-9] " + " [1-9] ")"'


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    """One server over a tiny llama for the module."""
    from tests.integrations.conftest import LiveServer

    live = LiveServer(create_app(str(tiny_model_factory("llama")), api_key=KEY, **ENGINE_CONFIG)).start()
    yield live
    live.stop()


def _schema_ok(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


def _object_ok(text: str) -> bool:
    return isinstance(json.loads(text), dict)


def _regex_ok(text: str) -> bool:
    return re.fullmatch(REGEX, text) is not None


def _grammar_ok(text: str) -> bool:
    return re.fullmatch(r"\([1-9] \+ [1-9]\)", text) is not None


# (request body fields, check of the reply's text)
SPELLINGS: list[tuple[dict[str, Any], Callable[[str], bool]]] = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}}, _schema_ok),
    ({"response_format": {"type": "json_object"}}, _object_ok),
    ({"structured_outputs": {"json": SCHEMA}}, _schema_ok),
    ({"structured_outputs": {"json_object": True}}, _object_ok),
    ({"structured_outputs": {"regex": REGEX, "backend": "xgrammar"}}, _regex_ok),
    ({"structured_outputs": {"choice": CHOICES}}, lambda text: text in CHOICES),
    ({"structured_outputs": {"grammar": GRAMMAR}}, _grammar_ok),
    ({"guided_json": SCHEMA}, _schema_ok),
    ({"guided_json": json.dumps(SCHEMA)}, _schema_ok),
    ({"guided_regex": REGEX, "guided_decoding_backend": "xgrammar"}, _regex_ok),
    ({"guided_choice": CHOICES}, lambda text: text in CHOICES),
    ({"guided_grammar": GRAMMAR}, _grammar_ok),
]


@pytest.mark.parametrize(("fields", "check"), SPELLINGS, ids=lambda v: str(v)[:40])
def test_every_spelling_constrains_chat_and_completions(server, fields, check):
    """Each spelling holds on both routes, with the official client (vLLM's fields through extra_body)."""
    client = server.openai(KEY)
    openai_field = "response_format" in fields
    kwargs: dict[str, Any] = dict(model=server.model_name, max_tokens=120, temperature=1.0, seed=1)  # a seed whose JSON objects close
    chat_kwargs = dict(kwargs, response_format=fields["response_format"]) if openai_field else dict(kwargs, extra_body=fields)
    chat = client.chat.completions.create(messages=MESSAGES, **chat_kwargs).choices[0]
    assert chat.finish_reason == "stop" and check(chat.message.content)
    completion = client.completions.create(prompt="Answer:", extra_body=fields, **kwargs).choices[0]
    assert completion.finish_reason == "stop" and check(completion.text)


def test_parse_returns_the_model_instance(server):
    """openai's parse() sends a strict json_schema and parses the reply into the pydantic class."""
    out = server.openai(KEY).chat.completions.parse(
        model=server.model_name, messages=MESSAGES, response_format=Person, max_tokens=200, temperature=0.8, seed=2
    )
    message = out.choices[0].message
    assert isinstance(message.parsed, Person)
    assert message.parsed == Person.model_validate_json(message.content)


def test_streams_join_to_valid_output(server):
    """Streamed deltas of a constrained chat (create and the stream helper) and completion join to valid output."""
    client = server.openai(KEY)
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    chunks = client.chat.completions.create(model=server.model_name, messages=MESSAGES, response_format=fmt, max_tokens=120, stream=True)
    assert _schema_ok("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    with client.chat.completions.stream(model=server.model_name, messages=MESSAGES, response_format=Person, max_tokens=200) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Person)
    chunks = client.completions.create(
        model=server.model_name, prompt="Code:", max_tokens=20, stream=True, extra_body={"structured_outputs": {"regex": REGEX}}
    )
    assert _regex_ok("".join(c.choices[0].text for c in chunks))


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
# (request body fields, the param the 400 names): constraints that do not compile or are past a limit
BAD_CONSTRAINTS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}}, "response_format.json_schema.schema"),
    ({"guided_json": BAD_SCHEMA}, "guided_json"),
    ({"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs.json"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ({"guided_choice": ["x"] * 1000}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "nme": "typo"}}}, "response_format.json_schema.nme"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("fields", "param"), BAD_CONSTRAINTS, ids=lambda v: str(v)[:40])
async def test_bad_constraints_are_400_naming_the_wire_field(server, fields, param, stream):
    """A constraint the engine refuses is a 400 naming the field the client used, streaming or not; the next request is served."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
        body = {"messages": MESSAGES, "max_tokens": 8, "stream": stream, **fields}
        async with session.post(server.base_url + "/chat/completions", json=body) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        body = {"prompt": "Code:", "max_tokens": 20, "structured_outputs": {"regex": REGEX}}
        async with session.post(server.base_url + "/completions", json=body) as resp:
            assert resp.status == 200
            assert _regex_ok((await resp.json())["choices"][0]["text"])


def test_the_official_client_raises_bad_request(server):
    """The same refusal reaches openai's client as BadRequestError with the body's param."""
    with pytest.raises(openai.BadRequestError) as err:
        server.openai(KEY).chat.completions.create(model=server.model_name, messages=MESSAGES, extra_body={"guided_regex": "[a-"})
    assert err.value.body["param"] == "guided_regex" and "regex" in err.value.body["message"]


async def test_sdk_over_http_parses_constrained_replies(server):
    """sdk.AsyncClient(base_url=...) sends response_format over the wire and parses the reply."""
    from sdk import AsyncClient

    async with AsyncClient(base_url=server.base_url, api_key=KEY) as client:
        person = await client.chat("Describe someone.", response_format=Person, max_tokens=200, temperature=0.8, seed=4)
        assert isinstance(person.parsed, Person)
        code = await client.complete("Code:", response_format={"type": "regex", "regex": REGEX}, max_tokens=20)
        assert _regex_ok(code.text)
