"""Structured output in the engine: constrained text always parses, and constraints change nothing else.

A tiny random-weight model follows no format by itself, so every output that matches its
constraint here was made to by the token masks.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import pytest

from engine import AsyncEngine, Engine, SamplingParams
from engine.errors import ParameterError
from engine.structured_output import StructuredOutput
from engine.structured_output.params import MAX_CHOICES, MAX_CONSTRAINT_CHARS

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{2}-[0-9]{3}"
CHOICES = ("red", "green", "blue")
GRAMMAR = 'root ::= "(" num (" + " num)? ")"\nnum ::= [1-9] [0-9]?'


def prompts(n: int) -> list[list[int]]:
    return [list(range(400 + 37 * i, 400 + 37 * i + 5 + i % 7)) for i in range(n)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(str(model_dir), num_blocks=256, block_size=4, max_num_seqs=16, max_num_batched_tokens=128)


def constrained(form: str, **kw) -> SamplingParams:
    constraint = {
        "json_schema": StructuredOutput(json_schema=SCHEMA),
        "json_object": StructuredOutput(json_object=True),
        "regex": StructuredOutput(regex=REGEX),
        "choice": StructuredOutput(choice=CHOICES),
        "grammar": StructuredOutput(grammar=GRAMMAR),
    }[form]
    return SamplingParams(**{"max_tokens": 160, "temperature": 0.0, "structured_output": constraint, **kw})


def assert_valid(form: str, text: str) -> None:
    if form == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif form == "json_object":
        assert isinstance(json.loads(text), dict)
    elif form == "regex":
        assert re.fullmatch(REGEX, text), text
    elif form == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)?\)", text), text


FORMS = ["json_schema", "regex", "choice", "grammar"]


@pytest.mark.parametrize("form", FORMS)
def test_random_model_output_meets_its_constraint(engine: Engine, form: str) -> None:
    """Greedy and sampled completions of a random model match the constraint and finish with "stop"."""
    params = [constrained(form), constrained(form, temperature=1.0, seed=3), constrained(form, temperature=0.7, seed=10)]
    for out in engine.generate(prompts(3), params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        assert_valid(form, completion.text)
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_unconstrained_rows_are_untouched_by_constrained_ones(engine: Engine) -> None:
    """In a batch mixing constrained and unconstrained requests, the unconstrained tokens equal those made alone."""
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ps = prompts(6)
    alone = [engine.generate([p], plain, use_tqdm=False)[0].outputs[0].token_ids for p in ps[:3]]
    mixed = engine.generate(ps, [plain] * 3 + [constrained(f) for f in ("json_schema", "regex", "choice")], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for out, form in zip(mixed[3:], ("json_schema", "regex", "choice")):
        assert_valid(form, out.outputs[0].text)


def test_preemption_gives_the_same_constrained_output(model_dir, engine: Engine) -> None:
    """Under a KV cache small enough to preempt, constrained requests produce what they produce without pressure."""
    ps = prompts(8)
    params = [constrained("json_schema")] * 4 + [constrained("grammar", temperature=1.0, seed=5)] * 4
    roomy = engine.generate(ps, params, use_tqdm=False)
    tight = Engine(str(model_dir), num_blocks=40, block_size=4, max_num_seqs=16, max_num_batched_tokens=128)
    pressed = tight.generate(ps, params, use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in pressed] == [o.outputs[0].token_ids for o in roomy]


def test_n_completions_each_meet_the_constraint(engine: Engine) -> None:
    """n > 1: every sampled completion has its own matcher and meets the constraint."""
    (out,) = engine.generate(prompts(1), constrained("json_schema", n=4, temperature=1.0, seed=17), use_tqdm=False)
    assert len(out.outputs) == 4 and len({c.text for c in out.outputs}) > 1
    for completion in out.outputs:
        assert_valid("json_schema", completion.text)


@pytest.mark.xfail(strict=True, reason="xgrammar's JSON matcher takes a token of raw tabs ('\t\t\t') inside a string")
def test_json_strings_hold_no_raw_control_characters(engine: Engine) -> None:
    """JSON forbids raw control characters in strings; the compiled schema lets the tabs token (27655) through."""
    (out,) = engine.generate(prompts(1), constrained("json_schema", n=4, temperature=1.0, seed=11), use_tqdm=False)
    for completion in out.outputs:
        json.loads(completion.text)  # strict: a raw control character raises


def test_ignore_eos_still_ends_at_the_end_of_the_structure(engine: Engine) -> None:
    """With ignore_eos, a constrained request still ends when its structure is complete."""
    (out,) = engine.generate(prompts(1), constrained("choice", ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in CHOICES


def test_max_tokens_mid_structure_finishes_with_length(engine: Engine) -> None:
    """A budget too small for the structure ends it with finish_reason "length" (the text is a valid prefix)."""
    (out,) = engine.generate(prompts(1), constrained("json_schema", max_tokens=5), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].text.startswith("{")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize(
    ("constraint", "param"),
    [
        (dict(json_schema={"type": "objectx"}), "structured_output.json_schema"),
        (dict(json_schema={"type": "string", "pattern": "(unclosed"}), "structured_output.json_schema"),
        (dict(regex="[a-"), "structured_output.regex"),
        (dict(grammar='root ::= "a" |'), "structured_output.grammar"),
    ],
)
def test_bad_constraints_are_refused_before_queueing(engine: Engine, constraint: dict, param: str) -> None:
    """A constraint that does not compile is a ParameterError naming its field; nothing is queued, and the next request is served."""
    with pytest.raises(ParameterError) as err:
        engine.add_request(None, prompts(1)[0], SamplingParams(structured_output=StructuredOutput(**constraint)))
    assert err.value.param == param
    assert not engine.has_unfinished_requests()
    (out,) = engine.generate(prompts(1), constrained("regex"), use_tqdm=False)
    assert_valid("regex", out.outputs[0].text)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({}, "structured_output"),
        (dict(regex="a", choice=("a",)), "structured_output"),
        (dict(json_schema="not json"), "structured_output.json_schema"),
        (dict(json_schema=[1]), "structured_output.json_schema"),
        (dict(regex="x" * (MAX_CONSTRAINT_CHARS + 1)), "structured_output.regex"),
        (dict(choice=("a",) * (MAX_CHOICES + 1)), "structured_output.choice"),
        (dict(choice=("",)), "structured_output.choice"),
        (dict(grammar=3), "structured_output.grammar"),
    ],
)
def test_constraint_shape_is_checked_on_construction(kwargs: dict, param: str) -> None:
    """Exactly one form, of the right type and within its size limit; the error names the field."""
    with pytest.raises(ParameterError) as err:
        StructuredOutput(**kwargs)
    assert err.value.param == param


def test_min_tokens_with_a_constraint_is_refused() -> None:
    """min_tokens would forbid the EOS a finished structure needs: refused with a clear error."""
    with pytest.raises(ParameterError, match="min_tokens") as err:
        SamplingParams(min_tokens=2, structured_output=StructuredOutput(regex="a"))
    assert err.value.param == "min_tokens"


def test_async_engine_compiles_off_the_step_loop(model_dir) -> None:
    """AsyncEngine compiles on the compiler's threads; a bad constraint fails its request only."""

    async def main() -> None:
        async with AsyncEngine(str(model_dir), num_blocks=64, block_size=4) as engine:
            seen: list[str] = []
            real = engine.engine.grammars._compile

            def spy(constraint):
                seen.append(threading.current_thread().name)
                return real(constraint)

            engine.engine.grammars._compile = spy
            with pytest.raises(ParameterError, match="regex"):
                async for _ in engine.generate(prompts(1)[0], SamplingParams(structured_output=StructuredOutput(regex="("))):
                    pass
            last = None
            async for last in engine.generate(prompts(1)[0], constrained("choice")):
                pass
            assert last.outputs[0].text in CHOICES
            assert seen and all(name.startswith("paged-grammar") for name in seen)

    asyncio.run(main())


def _tool_tag(name: str) -> dict:
    return {
        "type": "tag",
        "begin": f'<call>{{"name": "{name}", "arguments": ',
        "content": {"type": "json_schema", "json_schema": SCHEMA["properties"]["address"], "max_whitespace_cnt": 1},
        "end": "}</call>",
    }


def test_structural_tags_constrain_only_their_regions(engine: Engine) -> None:
    """Tagged regions (tool calls, say) follow their schema: only tags when they are required, free text around them otherwise."""
    required = {"type": "tags_with_separator", "tags": [_tool_tag("a"), _tool_tag("b")], "separator": "\n", "at_least_one": True}
    params = SamplingParams(
        max_tokens=200, temperature=1.0, seed=4,
        structured_output=StructuredOutput(structural_tag={"type": "structural_tag", "format": required}),
    )  # fmt: skip
    for out in engine.generate(prompts(3), params, use_tqdm=False):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        calls = re.findall(r'<call>\{"name": "([ab])", "arguments": (.*?)\}</call>', text, flags=re.S)
        assert calls and "\n".join(f'<call>{{"name": "{n}", "arguments": {a}}}</call>' for n, a in calls) == text
        for _, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMA["properties"]["address"])
    with pytest.raises(ParameterError) as err:
        engine.add_request(None, prompts(1)[0], SamplingParams(structured_output=StructuredOutput(structural_tag={"type": "nope"})))
    assert err.value.param == "structured_output.structural_tag"
