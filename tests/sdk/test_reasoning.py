"""Reasoning apart from the answer: the parser at any chunking, the family from the template, constraints
after the thinking, and the reply through the SDK client, LangChain and LlamaIndex."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from pydantic import BaseModel

from engine.structured_output import StructuredOutput
from sdk import AsyncClient, Runtime
from sdk.errors import InvalidRequestError
from sdk.reasoning import REASONING_FORMATS, ReasoningParser, Start, after_reasoning, reasoning_format
from sdk.tools import tool_constraint
from tests.support.thinking import CALL, R1_TEMPLATE, REPLY, SCHEMA, THINKING_TEMPLATE, TOOLS, ScriptedReplyEngine

QWEN3, R1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek_r1"]


def _chunked(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _split(fmt, start: Start, pieces: list[str]) -> tuple[str, str, int]:
    """(reasoning, answer, most characters held back after any piece) of ``pieces`` through a parser."""
    parser = ReasoningParser(fmt, start)
    reasoning, answer, fed, most_held = "", "", 0, 0
    for piece in pieces:
        r, a = parser.feed(piece)
        reasoning, answer, fed = reasoning + r, answer + a, fed + len(piece)
        most_held = max(most_held, len(parser._buffer))
    r, a = parser.finish()
    return reasoning + r, answer + a, most_held


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize(
    ("fmt", "start", "text", "reasoning", "answer"),
    [
        (QWEN3, Start.EITHER, REPLY, "The user greets me. I greet back.\n", "Hello there!"),
        (QWEN3, Start.EITHER, "Hello <think> there", "", "Hello <think> there"),  # not at the beginning: text
        (QWEN3, Start.THINKING, "a < b </thi nk</think>\n\nyes", "a < b </thi nk", "yes"),
        (R1, Start.THINKING, "Hmm.</think>Done.", "Hmm.", "Done."),
        (R1, Start.THINKING, "<think>Hmm.</think>Done.", "Hmm.", "Done."),  # an old template: the model opens it
        (R1, Start.THINKING, "cut short </thi", "cut short </thi", ""),  # no end: all reasoning
        (QWEN3, Start.EITHER, "  <thin", "", "<thin"),  # a partial start marker at the end is text
        (R1, Start.THINKING, " <thin", "<thin", ""),  # ... or reasoning, where the output starts in it
    ],
)
def test_the_parser_splits_reasoning_at_any_chunking(seed, fmt, start, text, reasoning, answer):
    pieces = _chunked(text, random.Random(seed)) if len(text) > 1 else [text]
    got_reasoning, got_answer, most_held = _split(fmt, start, pieces)
    assert (got_reasoning, got_answer) == (reasoning, answer)
    # NOTE: only a possible marker is held back (with the whitespace before a start marker, dropped anyway)
    assert most_held <= max(len(fmt.start), len(fmt.end)) - 1 + len(text) - len(text.lstrip())


def test_text_is_held_back_only_while_it_may_be_a_marker():
    parser = ReasoningParser(QWEN3, Start.THINKING)
    assert parser.feed("step one </") == ("step one ", "")
    assert parser.feed("b> and") == ("</b> and", "")
    assert parser.feed(" done</think>ok") == (" done", "ok")


def test_the_family_comes_from_the_template_or_the_name(tokenizer):
    assert reasoning_format("auto", THINKING_TEMPLATE) is QWEN3
    assert reasoning_format("auto", R1_TEMPLATE) is R1
    assert reasoning_format("auto", tokenizer.chat_template) is None  # SmolLM2 does not think
    assert reasoning_format("none", THINKING_TEMPLATE) is None
    assert reasoning_format("deepseek_r1", tokenizer.chat_template) is R1
    with pytest.raises(InvalidRequestError, match="reasoning_parser must be one of auto, none, qwen3, deepseek_r1") as exc:
        reasoning_format("qwen", THINKING_TEMPLATE)
    assert exc.value.param == "reasoning_parser"


def test_the_prompt_says_where_the_output_starts():
    assert QWEN3.start_of("<|im_start|>assistant\n") is Start.EITHER
    assert QWEN3.start_of("<|im_start|>assistant\n<think>\n") is Start.THINKING
    assert QWEN3.start_of("assistant\n<think>\n\n</think>\n\n") is Start.ANSWER
    assert R1.start_of("<｜Assistant｜>") is Start.THINKING


@pytest.mark.parametrize(
    ("constraint", "answer"),
    [
        (StructuredOutput(json_schema=SCHEMA), '{"a": 1}'),
        (StructuredOutput(json_object=True), '{"b": [2]}'),
        (StructuredOutput(regex="[0-9]+"), "42"),
        (StructuredOutput(choice=("yes", "no")), "no"),
        (StructuredOutput(grammar='root ::= "hi"'), "hi"),
        (tool_constraint(TOOLS, "required"), CALL),
    ],
)
def test_constraints_hold_only_after_the_thinking(constraint, answer):
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    inside = Grammar.from_structural_tag(after_reasoning(constraint, QWEN3, Start.THINKING).structural_tag)
    either = Grammar.from_structural_tag(after_reasoning(constraint, QWEN3, Start.EITHER).structural_tag)
    assert accepts(inside, "free <b>thought</b>\n</think>\n\n" + answer)
    assert not accepts(inside, answer)  # the prompt opened the thinking: it must close first
    assert not accepts(inside, "thought</think>\n\nnot " + answer)
    assert accepts(either, "<think>\nthought</think>" + answer)
    assert accepts(either, answer)  # no thinking at all
    assert after_reasoning(constraint, QWEN3, Start.ANSWER) is constraint


# --------------------------------------------------------------------------- through the SDK


@pytest.fixture
def thinking_tokenizer(bundled_model_dir):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_model_dir)
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


@pytest.fixture
def scripted(thinking_tokenizer):
    """``scripted(reply, tokenizer=None, **client_kwargs) -> (engine, client)`` over a scripted engine."""
    runtimes: list[Runtime] = []

    def make(reply: str, tokenizer: Any = None, **kwargs: Any) -> tuple[ScriptedReplyEngine, AsyncClient]:
        engine = ScriptedReplyEngine(tokenizer or thinking_tokenizer, reply)
        runtimes.append(runtime := Runtime(engine=engine))
        return engine, AsyncClient(runtime=runtime, **kwargs)

    yield make
    for runtime in runtimes:
        runtime.close()


async def test_a_reply_arrives_with_its_reasoning_apart(scripted):
    _, client = scripted(REPLY)
    result = await client.chat("Hi")
    assert (result.reasoning, result.text, result.finish_reason) == ("The user greets me. I greet back.\n", "Hello there!", "stop")
    deltas = [d async for d in client.stream("Hi")]
    assert "".join(d.reasoning for d in deltas) == result.reasoning
    assert "".join(d.text for d in deltas) == result.text
    assert not any("think>" in d.text or "think>" in d.reasoning for d in deltas)


async def test_a_tool_call_after_the_thinking_is_parsed_from_the_answer(scripted):
    engine, client = scripted("<think>\nI should add.</think>\n\n" + CALL)
    result = await client.chat("Add", tools=TOOLS, tool_choice="required")
    assert result.reasoning == "I should add."
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("add", {"a": 1})]
    assert (result.text, result.finish_reason) == ("", "tool_calls")
    sent = engine.params[0].structured_output
    assert sent == after_reasoning(tool_constraint(TOOLS, "required"), QWEN3, Start.EITHER)


async def test_a_response_format_applies_after_the_thinking(scripted):
    class Answer(BaseModel):
        a: int

    engine, client = scripted('<think>\nOne.</think>\n\n{"a": 1}')
    result = await client.chat("One?", response_format=Answer)
    assert (result.reasoning, result.parsed) == ("One.", Answer(a=1))
    fmt = json.loads(engine.params[0].structured_output.structural_tag)["format"]
    assert fmt["type"] == "or" and fmt["elements"][0]["elements"][0]["begin"] == "<think>"


async def test_enable_thinking_false_closes_the_thinking_in_the_prompt(scripted, thinking_tokenizer):
    engine, client = scripted('{"a": 1}')
    result = await client.chat("One?", chat_template_kwargs={"enable_thinking": False}, response_format=SCHEMA)
    assert thinking_tokenizer.decode(engine.prompts[0]).rstrip().endswith("<think>\n\n</think>")
    assert (result.reasoning, result.parsed) == (None, {"a": 1})
    assert engine.params[0].structured_output == StructuredOutput(json_schema=SCHEMA)  # nothing to defer


async def test_an_r1_prompt_starts_inside_the_thinking(scripted, thinking_tokenizer):
    thinking_tokenizer.chat_template = R1_TEMPLATE
    _, client = scripted("Let me see.\n</think>\n\nSure.")
    result = await client.chat("Hi")
    assert (result.reasoning, result.text) == ("Let me see.\n", "Sure.")


async def test_a_model_without_reasoning_or_parser_none_leaves_the_text(scripted, tokenizer):
    _, plain = scripted(REPLY, tokenizer=tokenizer)
    assert ((await plain.chat("Hi")).text, (await plain.chat("Hi")).reasoning) == (REPLY, None)
    _, off = scripted(REPLY, reasoning_parser="none")
    assert (await off.chat("Hi")).text == REPLY


async def test_bad_reasoning_settings_are_refused_naming_the_field(scripted):
    _, client = scripted(REPLY)
    with pytest.raises(InvalidRequestError) as exc:
        await client.chat("Hi", chat_template_kwargs={"tools": []})
    assert exc.value.param == "chat_template_kwargs"
    with pytest.raises(InvalidRequestError, match="reasoning_parser"):
        scripted(REPLY, reasoning_parser="o1")
    with pytest.raises(ValueError, match="reasoning_parser and base_url"):
        AsyncClient(base_url="http://127.0.0.1:1/v1", reasoning_parser="qwen3")


# --------------------------------------------------------------------------- adapters


def test_paged_chat_puts_reasoning_where_langchain_reads_it(scripted):
    from sdk.integrations.langchain import PagedChat

    _, client = scripted(REPLY)
    chat = PagedChat(runtime=client.runtime)
    message = chat.invoke("Hi")
    assert message.content == "Hello there!"
    assert message.additional_kwargs["reasoning_content"] == "The user greets me. I greet back.\n"
    assert {"type": "reasoning", "reasoning": "The user greets me. I greet back.\n"} in [
        {k: b[k] for k in ("type", "reasoning") if k in b} for b in message.content_blocks
    ]
    chunks = list(chat.stream("Hi"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert (merged.content, merged.additional_kwargs["reasoning_content"]) == (message.content, message.additional_kwargs["reasoning_content"])
    assert not any("think>" in c.content for c in chunks)
    assert PagedChat(runtime=client.runtime, reasoning_parser="none").invoke("Hi").content == REPLY


def test_paged_llm_gives_a_thinking_block(scripted):
    from llama_index.core.base.llms.types import ChatMessage as LIChatMessage
    from llama_index.core.base.llms.types import ThinkingBlock

    from sdk.integrations.llamaindex import PagedLLM

    _, client = scripted(REPLY)
    llm = PagedLLM(runtime=client.runtime)
    response = llm.chat([LIChatMessage(role="user", content="Hi")])
    assert response.message.content == "Hello there!"
    thinking = [b.content for b in response.message.blocks if isinstance(b, ThinkingBlock)]
    assert thinking == ["The user greets me. I greet back.\n"]
    streamed = list(llm.stream_chat([LIChatMessage(role="user", content="Hi")]))
    assert "".join(r.additional_kwargs.get("thinking_delta", "") for r in streamed) == thinking[0]
    assert "".join(r.delta or "" for r in streamed) == "Hello there!"
    assert [b.content for b in streamed[-1].message.blocks if isinstance(b, ThinkingBlock)] == thinking


# --------------------------------------------------------------------------- the real engine


async def test_a_real_engine_holds_only_the_answer_to_the_schema(tiny_model_factory, bundled_model_dir, tmp_path):
    """A tiny random model under a thinking template either thinks or answers straight away (the
    engine masks everything else): a completion is thinking cut short by ``max_tokens`` (no text)
    or a stopped, schema-valid answer; the markers never reach the text."""
    import jsonschema
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_model_dir)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "thinking-tokenizer")
    client = AsyncClient(str(tiny_model_factory("llama", tokenizer_dir=tmp_path / "thinking-tokenizer")), num_blocks=256)
    try:
        results = await client.batch(
            [f"Question {i}" for i in range(8)], response_format=SCHEMA, max_tokens=48, temperature=1.0, seed=1
        )
    finally:
        await client.aclose()
    for result in results:
        if result.finish_reason == "length":
            assert result.reasoning and result.text == ""
        else:
            assert result.finish_reason == "stop"
            jsonschema.validate(json.loads(result.text), SCHEMA)
        assert "</think>" not in (result.reasoning or "")
    assert any(r.reasoning for r in results)  # the constraint let the model think first


async def test_output_filters_and_audit_see_the_reasoning(scripted, tmp_path):
    from sdk.hooks import AuditLog, RegexFilter

    _, client = scripted(REPLY, hooks=[RegexFilter("greet back", on="output"), AuditLog(tmp_path / "audit.jsonl", include_text=True)])
    result = await client.chat("Hi")
    assert result.finish_reason == "content_filter" and result.text == ""
    _, client = scripted(REPLY, hooks=[AuditLog(tmp_path / "audit2.jsonl", include_text=True)])
    await client.chat("Hi")
    record = json.loads((tmp_path / "audit2.jsonl").read_text().splitlines()[-1])
    assert (record["reasoning"], record["completion"]) == ("The user greets me. I greet back.\n", "Hello there!")
    assert record["reasoning_chars"] == len(record["reasoning"])
